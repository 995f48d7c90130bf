"""Prefill-to-decode handoff: a prompt's KV handed to another process by mapping its pages (one
pool shared across processes, vmm/owner.py) against by copying them (today's copy: a restore
from the host KV tier), for prompts of 256 to 8,192 tokens.

Both sides are real KV caches of SmolLM2-135M's geometry (30 layers, 3 KV heads of 64, fp32)
over real pages. Mapping: the prefill cache computes (maps and commits) the prompt's pages over
an AttachedPool, which publishes them; the decode cache, over a second connection to the same
owner (the owner treats it as another process), admits the same tokens: the time of that
admission (one lookup round trip, then one mmap per page run) is the handoff. Copy: one cache
with a host tier, its prompt's entries evicted to the tier, then admitted again: the restore
copies every byte back. Each figure is the median of --repeats admissions; bytes copied are the
entries restored times their bytes. Mapping copies nothing: the last, partial page, which the
prefill side published under a name of exactly its tokens, is taken whole (out of the
directory, the decoder its one holder); where the prompt ends exactly at a page's end that page
is a cached entry, and the rows the decoder needs are copied out of it. The prompt's last token
is computed again for its logits on the decode side (tokens_left).

    python benchmarks/bench_handoff.py --json benchmarks/results/cpu/handoff.json --plot benchmarks/results/cpu/handoff.png

On a GPU (`--backend cuda`, run by benchmarks/gpu_suite.py) the pool's pages are the GPU's,
created shareable by the owner and imported by each process (cuMemExportToShareableHandle), and
the copy restores from pinned host memory; the times then include a device synchronize. There
the handoff is also set against what engines on one GPU do instead: a device-to-device copy of
the same bytes (`device_copy`: CUDA IPC's importer copies from the exporter's buffer; timed here
in one process, so opening the IPC handle is left out and the copy is a lower bound), with the
memory each holds: a copy needs a second buffer of the prompt's bytes, mapping none (both
caches map the same pages). `mapping_wins_from_tokens`: the shortest prompt from which mapping
took less time than the device copy, at every longer prompt measured too (None: nowhere).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402

import vmm  # noqa: E402
from engine.kv.tiers import make_tiers, namespace_of  # noqa: E402
from engine.kv.manager import KVManager  # noqa: E402
from engine.kv.virtual import VirtualLayout  # noqa: E402
from engine.models import load_config  # noqa: E402
from engine.request.sampling_params import SamplingParams  # noqa: E402
from engine.request.sequence import Sequence  # noqa: E402

PARAMS = SamplingParams(max_tokens=1)


def prefill(kv, tokens: list[int], rid: str) -> Sequence:
    seq = Sequence(rid, 0, tokens, PARAMS, 0.0)
    kv.admit(seq)
    assert kv.ensure_mapped(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    kv.commit(seq)
    return seq


def admit_time(kv, tokens: list[int], repeats: int, before=lambda: None) -> tuple[float, int]:
    """The median time of admitting `tokens` (with whatever it copies done), and the hits."""
    times, hits = [], 0
    for i in range(repeats):
        before()
        seq = Sequence(f"d{i}", 0, tokens, PARAMS, 0.0)
        start = time.perf_counter()
        hits = kv.admit(seq)
        kv.pool.backend.synchronize()
        times.append(time.perf_counter() - start)
        kv.release(seq)
    return statistics.median(times), hits


def by_mapping(cfg, layout: str, page: int, tokens: list[int], repeats: int, kind: str) -> dict:
    rows = len(tokens) + 64
    with tempfile.TemporaryDirectory() as d:
        need = 4 * len(tokens) * cfg.kv_bytes_per_token(4) // page + 512
        owner = vmm.PoolOwner(vmm.make_backend(kind, page, shareable=True), need, os.path.join(d, "pool.sock")).start()
        try:
            caches = []
            for _ in range(2):  # the prefill process and the decode process
                pool = vmm.AttachedPool(owner.path, None if kind == "host" else vmm.make_backend(kind, page))
                caches.append(KVManager(VirtualLayout(cfg, layout, 2, rows, torch.float32, pool.backend,
                                                      pool.num_pages, 1, None, pool), True))
            prefiller, decoder = caches
            prefills = iter(range(repeats))
            # before each admission the prefill side computes the prompt and is done (its pages wait
            # in the directory, the last, partial one too: each handoff takes that one whole)
            seconds, hits = admit_time(decoder, tokens, repeats,
                                       before=lambda: prefiller.release(prefill(prefiller, tokens, f"p{next(prefills)}")))
            copied = decoder.lookup.partial_bytes // repeats
            decoder.audit()
            pages = len(decoder.layout.page_range(0, hits)) * decoder.layout.num_regions
            for kv in caches:
                kv.close()
            owner.audit()
        finally:
            owner.stop()
    return {"seconds": seconds, "tokens_mapped": hits, "tokens_left": len(tokens) - hits, "pages": pages,
            "bytes_copied": copied}


def by_copy(cfg, layout: str, page: int, tokens: list[int], repeats: int, kind: str) -> dict:
    rows = len(tokens) + 64
    backend = vmm.make_backend(kind, page)
    need = 2 * len(tokens) * cfg.kv_bytes_per_token(4) // page + 512
    layout_of = VirtualLayout(cfg, layout, 2, rows, torch.float32, backend, need)
    namespace = namespace_of(b"bench", layout_of.geometry())
    tiers = make_tiers(backend.device, layout_of.entry_bytes, need * page, None, 1, namespace, {})
    kv = KVManager(layout_of, True, namespace=namespace, tiers=tiers)
    kv.release(prefill(kv, tokens, "p"))
    # every entry to the host tier before each admission: the admission copies it back
    seconds, hits = admit_time(kv, tokens, repeats, before=kv.prefix_cache.clear)
    pages = len(kv.layout.page_range(0, hits)) * kv.layout.num_regions
    kv.close()
    return {"seconds": seconds, "tokens_mapped": hits, "tokens_left": len(tokens) - hits,
            "pages": pages, "bytes_copied": pages * page}


def by_device_copy(nbytes: int, repeats: int) -> dict:
    """A device-to-device copy of nbytes on the current GPU: median seconds with a synchronize
    (as the other two are timed), and the bytes its destination holds."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return {"seconds": statistics.median(samples), "seconds_range": [min(samples), max(samples)],
            "bytes_copied": nbytes, "extra_bytes_held": nbytes}


def mapping_wins_from(rows: list[dict]) -> int | None:
    """The shortest prompt from which mapping beat the device copy at every longer one measured."""
    rows = sorted(rows, key=lambda r: r["prompt_tokens"])
    wins = [r["mapping"]["seconds"] < r["device_copy"]["seconds"] for r in rows]
    for i in range(len(rows)):
        if all(wins[i:]):
            return rows[i]["prompt_tokens"]
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,512,1024,2000,2048,4096,8192")
    parser.add_argument("--layouts", default="per_layer,interleaved")
    parser.add_argument("--page-sizes", default=None, help="bytes, comma-separated (default: 64 KiB and 2 MiB "
                                                           "on the host, 2 MiB on CUDA)")
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    cfg = load_config("random:smollm2-135m")
    rng = random.Random(0)
    rows = []
    page_sizes = args.page_sizes or (f"{64 << 10},{2 << 20}" if args.backend == "host" else f"{2 << 20}")
    for layout in args.layouts.split(","):
        for page in map(int, page_sizes.split(",")):
            for n in map(int, args.lengths.split(",")):
                tokens = [rng.randrange(100, cfg.vocab_size) for _ in range(n)]
                mapped = by_mapping(cfg, layout, page, tokens, args.repeats, args.backend)
                copied = by_copy(cfg, layout, page, tokens, args.repeats, args.backend)
                rows.append({"layout": layout, "page_size": page, "prompt_tokens": n, "mapping": mapped, "copy": copied})
                mapped["extra_bytes_held"] = 0  # the decoder maps the pages the prefill side holds
                if args.backend == "cuda":  # the same bytes, device to device
                    rows[-1]["device_copy"] = by_device_copy(mapped["pages"] * page, args.repeats)
                device = (f", device copy {rows[-1]['device_copy']['seconds'] * 1e3:7.3f} ms"
                          if "device_copy" in rows[-1] else "")
                print(f"{layout:11} page {page >> 10:5} KiB {n:5} tokens: mapping {mapped['seconds'] * 1e3:7.2f} ms "
                      f"({mapped['bytes_copied']} B copied, {mapped['tokens_left']} tokens left), copy "
                      f"{copied['seconds'] * 1e3:7.2f} ms ({copied['bytes_copied'] / 2**20:.1f} MiB){device}", flush=True)
    result = {"benchmark": "handoff", "command": "python benchmarks/bench_handoff.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "threads": torch.get_num_threads(), "model_geometry": "smollm2-135m fp32",
              "backend": args.backend,
              "rows": rows}
    if args.backend == "cuda":
        result["mapping_wins_from_tokens"] = {f"{layout} {page}": mapping_wins_from(
            [r for r in rows if (r["layout"], r["page_size"]) == (layout, page)])
            for layout in args.layouts.split(",") for page in map(int, page_sizes.split(","))}
    save(result, args.json_path, args.plot_path, plot)
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for layout in sorted({r["layout"] for r in result["rows"]}):
        for page in sorted({r["page_size"] for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["layout"] == layout and r["page_size"] == page
                    and r["mapping"]["tokens_mapped"]]  # a prompt with no whole page hands nothing over
            xs = [r["prompt_tokens"] for r in rows]
            label = f"{layout}, {page >> 10} KiB pages"
            ax.plot(xs, [r["mapping"]["seconds"] * 1e3 for r in rows], "o-", label=f"mapping: {label}")
            copied = [r for r in rows if r["copy"]["tokens_mapped"]]  # no whole page: the tier restores nothing
            ax.plot([r["prompt_tokens"] for r in copied], [r["copy"]["seconds"] * 1e3 for r in copied], "x--",
                    label=f"copy (host tier): {label}")
            device = [r for r in rows if "device_copy" in r]
            if device:
                ax.plot([r["prompt_tokens"] for r in device], [r["device_copy"]["seconds"] * 1e3 for r in device], "s:",
                        label=f"device-to-device copy: {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("handoff time (ms, median)")
    ax.set_title("Prompt KV handed to another process: by mapping vs by copying")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
