"""`vkv top`: a live view of a server's KV pool, read from its /metrics (kvcached's kvtop).

Every second: the pool's pages (total, free) and, per model (or per replica, for a front door
over replicas: `rank R`), pages in use, cached, idle and shared, sequences running and waiting,
preemptions. Nothing but the Prometheus text the server already serves; one model or several.
"""
from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

COLUMNS = [("in use", "vkv:pages_in_use"), ("cached", "vkv:pages_cached"), ("idle", "vkv:pages_idle"),
           ("shared", "vkv:pages_shared"), ("running", "vkv:num_requests_running"),
           ("waiting", "vkv:num_requests_waiting"), ("preempted", "vkv:num_preemptions_total")]


def scrape(url: str, api_key: str | None = None, timeout: float = 5.0) -> dict[str, dict[str, float]]:
    """{metric: {model, or "rank R" for a replica ("" when unlabelled): value}} of the vkv: series
    at url/metrics."""
    request = urllib.request.Request(url.rstrip("/") + "/metrics")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vkv:") and "tier" not in sample.labels:
                who = sample.labels.get("model") or (f"rank {sample.labels['rank']}" if "rank" in sample.labels else "")
                values.setdefault(sample.name, {})[who] = sample.value
    return values


def render(values: dict[str, dict[str, float]], url: str) -> str:
    pool = "vkv:pool_pages_" if "vkv:pool_pages_total" in values else "vkv:pages_"  # replicas: the shared pool
    total = values.get(pool + "total", {}).get("", 0)
    free = values.get(pool + "free", {}).get("", 0)
    models = sorted({m for _, name in COLUMNS for m in values.get(name, {}) if m or pool == "vkv:pages_"}) or [""]
    lines = [f"vkv top  {url}  {time.strftime('%H:%M:%S')}",
             f"pool: {int(total)} pages, {int(free)} free ({100 * free / total if total else 0:.0f}%)", "",
             f"{'model':<24}" + "".join(f"{title:>11}" for title, _ in COLUMNS)]
    for model in models:
        cells = "".join(f"{int(values.get(name, {}).get(model, 0)):>11}" for _, name in COLUMNS)
        lines.append(f"{model or '(the model)':<24}{cells}")
    return "\n".join(lines)


def main(url: str, api_key: str | None = None, interval: float = 1.0, once: bool = False) -> None:
    while True:
        try:
            screen = render(scrape(url, api_key), url)
        except (urllib.error.URLError, OSError) as exc:
            screen = f"vkv top  {url}: cannot read /metrics ({exc})"
            if once:
                raise SystemExit(screen)
        if once:
            print(screen)
            return
        sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")  # home, clear, redraw
        sys.stdout.flush()
        time.sleep(interval)
