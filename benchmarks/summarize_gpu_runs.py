"""The GPU suite's runs side by side: each headline figure's median, minimum and maximum over
every lease, written to one JSON that the documents quote (a single run of a 15-minute lease on a
shared machine is never the figure: the spread between leases is larger than most effects).

    .venv/bin/python benchmarks/summarize_gpu_runs.py benchmarks/results/h100-80gb-hbm3

A run is a folder with the suite's files (the folder itself is run 1, then run2, run3, ...; a
later lease's run folder joins by being there). Per run it reads:
  attention.json   FlashAttention-2's device time over per_layer and interleaved virtual KV,
                   and over a contiguous tensor (Llama-3-8B heads, decode 32 x 1,024)
  throughput.json  offline output tok/s per layout (random Llama-3-8B bf16, 64 ShareGPT requests)
  mapping.json     one 2 MiB page: cuMemCreate, cuMemMap, cuMemSetAccess medians
  handoff.json     8,192 tokens handed over by mapping, and by restoring from pinned host memory
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "runs": values}


def row(rows: list[dict], **match) -> dict:
    return next(r for r in rows if all(r.get(k) == v for k, v in match.items()))


def one_run(folder: Path) -> dict:
    attention = json.loads((folder / "attention.json").read_text())["rows"]
    llama = dict(shape="llama-3-8b", case="decode-32x1024", kernel="flash")
    contiguous = row(attention, layout="contiguous", **llama)["device_ms"]
    figures = {"attention_per_layer_over_contiguous": row(attention, layout="per_layer", **llama)["device_ms"]
               / contiguous,
               "attention_interleaved_over_contiguous": row(attention, layout="interleaved", **llama)["device_ms"]
               / contiguous,
               "attention_contiguous_device_ms": contiguous}
    for r in json.loads((folder / "throughput.json").read_text())["runs"]:
        figures[f"throughput_{r['system'].removeprefix('vkv-')}_tok_s"] = r["output_tokens_per_s"]
    page = json.loads((folder / "mapping.json").read_text())["sweep"][0]["per_page"]
    for call in ("create", "map", "set_access"):
        figures[f"page_{call}_us"] = page[call]["median_us"]
    handoff = [r for r in json.loads((folder / "handoff.json").read_text())["rows"]
               if r.get("layout") == "interleaved" and r.get("prompt_tokens") == 8192][0]
    figures["handoff_8192_mapping_ms"] = handoff["mapping"]["seconds"] * 1e3
    figures["handoff_8192_host_restore_ms"] = handoff["copy"]["seconds"] * 1e3
    figures["handoff_8192_restore_over_mapping"] = handoff["copy"]["seconds"] / handoff["mapping"]["seconds"]
    return figures


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/h100-80gb-hbm3")
    folders = [root] + sorted((p for p in root.glob("run*") if p.is_dir()), key=lambda p: int(p.name[3:]))
    runs = {("run1" if f == root else f.name): one_run(f) for f in folders}
    keys = list(next(iter(runs.values())))
    machine = json.loads((root / "suite.json").read_text()).get("machine", {})
    summary = {"benchmark": "gpu_suite_across_runs", "machine": machine,
               "command": f"benchmarks/summarize_gpu_runs.py {root}", "runs": list(runs),
               "figures": {k: spread([runs[r][k] for r in runs]) for k in keys}}
    (root / "across_runs.json").write_text(json.dumps(summary, indent=1))
    for k, v in summary["figures"].items():
        print(f"{k:40s} median {v['median']:.4g}  [{v['min']:.4g}, {v['max']:.4g}]  n={v['n']}")


if __name__ == "__main__":
    main()
