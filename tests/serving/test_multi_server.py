"""`vkv serve` with several models over one KV pool: routing by the `model` field, per-model
metrics, limits at run time through the admin route, idle sleep, and `vkv top`."""
import re
import time

import httpx
import pytest
import helpers
from helpers import serving

from engine import LLM, SamplingParams
from engine.multi import MultiLLM
from engine.serving.loop.async_engine import AsyncEngine, Turns
from engine.serving.loop.metrics import Metrics
from engine.serving.options import ServerOptions
from engine.serving.api.server import build_app, parse_kv_limit
from engine.top import COLUMNS, render, scrape

KEY = "sk-multi"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    group = MultiLLM({"tiny": "random:tiny", "qwen": "random:qwen3-small"}, kv_cache_memory=16 << 20,
                     kv_limits={"tiny": (0.1, 0.9)})
    metrics, turns = Metrics(list(group.engines), group.shared), Turns(group.shared_step_tokens)
    engines = {name: AsyncEngine(engine, name, metrics, turns, idle_sleep=0.5 if name == "qwen" else None)
               for name, engine in group.engines.items()}
    with serving(build_app(engines, options=ServerOptions(api_key=KEY, enable_sleep_routes=True), group=group)) as base:
        yield base, group


def complete(base: str, model: str | None, prompt=(1, 2, 3, 4, 5), **extra) -> httpx.Response:
    return helpers.complete(base, prompt, key=KEY, **({"model": model} if model is not None else {}), **extra)


def test_requests_go_to_the_model_they_name(server):
    base, _ = server
    alone = LLM(model="random:tiny", kv_cache_memory=4 << 20).generate(
        [[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    tiny = complete(base, "tiny")
    assert tiny.status_code == 200 and tiny.json()["model"] == "tiny"
    assert tiny.json()["choices"][0]["text"] == alone[0].outputs[0].text
    assert complete(base, "qwen").json()["model"] == "qwen"
    assert complete(base, None).json()["model"] == "tiny"  # the first model when none is named
    missing = complete(base, "gpt-4")
    assert missing.status_code == 404 and "'tiny', 'qwen'" in missing.json()["error"]["message"]
    listed = httpx.get(base + "/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in listed] == ["tiny", "qwen"]


def test_metrics_label_each_model_and_not_the_pool(server):
    base, group = server
    complete(base, "tiny")
    text = httpx.get(base + "/metrics", headers=AUTH).text
    assert 'vkv:pages_in_use{model="tiny"}' in text and 'vkv:pages_in_use{model="qwen"}' in text
    assert f"vkv:pages_total {float(group.shared.pool.num_pages)}" in text
    assert 'vkv:time_to_first_token_seconds_count{model="tiny"}' in text
    view = render(scrape(base, KEY), base)  # vkv top
    assert "tiny" in view and "qwen" in view and f"pool: {group.shared.pool.num_pages} pages" in view


def test_vkv_top_shows_the_numbers_metrics_and_the_engines_have(server):
    """Each number of `vkv top`'s screen against /metrics read by another parser (a regex over
    the text) and against the engines themselves, with pages cached on both models."""
    base, group = server
    for model in ("tiny", "qwen"):
        assert complete(base, model, prompt=[1 + i % 50 for i in range(300)]).status_code == 200
    text = httpx.get(base + "/metrics", headers=AUTH).text
    view = render(scrape(base, KEY), base).splitlines()

    def metric(name: str, model: str | None = None) -> int:
        labels = "" if model is None else f'{{model="{model}"}}'
        return int(float(re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M).group(1)))

    total, free = metric("vkv:pages_total"), metric("vkv:pages_free")
    assert total == group.shared.pool.num_pages and view[1].startswith(f"pool: {total} pages, {free} free")
    rows = {line.split()[0]: [int(cell) for cell in line.split()[1:]] for line in view[4:]}
    assert set(rows) == {"tiny", "qwen"}
    for model in rows:
        assert rows[model] == [metric(name, model) for _, name in COLUMNS], (model, rows[model])
        kv = group.engines[model].stats().kv
        assert rows[model][:4] == [kv.pages_in_use, kv.pages_cached, kv.pages_idle, kv.pages_shared], model
    assert rows["tiny"][1] + rows["tiny"][2] > 0  # its prompt cached or idle: not all zeros (qwen sleeps when idle)


def test_limits_change_at_run_time_and_bad_ones_are_refused_by_name(server):
    base, group = server
    limits = httpx.get(base + "/kv_limits", headers=AUTH).json()
    total = group.shared.pool.num_pages
    assert limits["tiny"]["min_pages"] == int(0.1 * total) and limits["tiny"]["max_pages"] == int(0.9 * total)
    set_ = httpx.post(base + "/kv_limits", json={"model": "tiny", "min": "5%", "max": "50%"}, headers=AUTH)
    assert set_.status_code == 200 and set_.json()["tiny"]["max_pages"] == total // 2
    for body, status, words in [({"model": "nope", "max": "50%"}, 404, "'nope'"),
                                ({"model": "tiny", "min": "60%", "max": "50%"}, 400, "floor"),
                                ({"model": "tiny", "min": "a lot"}, 400, "percentage"),
                                ({"model": "qwen", "min": "99%"}, 400, "floors would sum"),
                                ({"model": "tiny", "ceiling": 1}, 400, "ceiling"),
                                ({"model": "tiny", "max": " 50%"}, 400, "percentage"),  # each read as 50% before
                                ({"model": "tiny", "max": "\u0665\u0660%"}, 400, "percentage"),
                                ({"model": "tiny", "max": "50_000_000"}, 400, "percentage"),
                                ({"model": "tiny", "max": -1}, 400, "max"),
                                ({"model": "tiny"}, 400, "give min, max or both")]:  # reset the limits before
        response = httpx.post(base + "/kv_limits", json=body, headers=AUTH)
        assert response.status_code == status and words in response.json()["error"]["message"], response.text
    kept = httpx.post(base + "/kv_limits", json={"model": "tiny", "max": "60%"}, headers=AUTH).json()["tiny"]
    assert kept["min_pages"] == int(0.05 * total) and kept["max_pages"] == int(0.6 * total)  # min kept
    assert httpx.post(base + "/kv_limits", json={"model": "tiny"}).status_code == 401
    assert complete(base, "tiny").status_code == 200
    assert parse_kv_limit("chat=10%:1073741824") == ("chat", (0.1, 1073741824))
    with pytest.raises(SystemExit, match="NAME=MIN:MAX"):
        parse_kv_limit("chat=10%")


def test_an_idle_model_sleeps_and_its_next_request_wakes_it(server):
    base, group = server
    assert complete(base, "qwen").status_code == 200
    for _ in range(100):
        if group.engines["qwen"].is_sleeping:
            break
        time.sleep(0.05)
    assert group.engines["qwen"].is_sleeping and group.shared.tenants["qwen"].used == 0
    assert complete(base, "qwen").status_code == 200  # wakes it
    wakes = scrape(base, KEY)["vkv:wake_seconds_count"]
    assert wakes["qwen"] >= 1 and wakes.get("tiny", 0) == 0


def test_one_model_sleeps_on_request_while_the_other_serves(server):
    base, _ = server
    assert httpx.post(base + "/sleep?model=tiny", headers=AUTH).json() == {"is_sleeping": True}
    assert complete(base, "tiny").status_code == 503
    assert complete(base, "qwen").status_code == 200
    assert httpx.post(base + "/wake_up?model=tiny", headers=AUTH).json() == {"is_sleeping": False}
    assert complete(base, "tiny").status_code == 200
    assert httpx.post(base + "/sleep?model=nope", headers=AUTH).status_code == 404
