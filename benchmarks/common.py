"""What every benchmark shares: where it was measured, and how its results are written."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from engine.machine import machine_info  # noqa: F401  (re-exported for the benchmarks)


def vkv_commit() -> str:
    """The short hash of the checkout's HEAD (a result's code), or "unknown" outside git."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(__file__))
    return done.stdout.strip() or "unknown"


def save(result: dict, json_path: str | None, plot_path: str | None, plot) -> None:
    """Write a benchmark's JSON and PNG where asked."""
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    if plot_path:
        os.makedirs(os.path.dirname(plot_path) or ".", exist_ok=True)
        plot(result, plot_path)


# An AVX2 CPU's code paths on a wider one: vkv's AVX2 kernels (and the bf16 path of a CPU without
# native bf16), with ATen, oneDNN and MKL held to AVX2. The memory system stays this machine's.
AVX2_ENV = {"VKV_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def add_level_arguments(parser: argparse.ArgumentParser) -> None:
    """--split: where this machine's two read-bandwidth levels part (roofline.read_gbps); --isa
    (avx2: run_as starts the script again under AVX2_ENV); --json and --plot, where the result goes."""
    parser.add_argument("--split", type=float, default=45.0, help="GB/s between the slow and the fast level")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: vkv's AVX2 kernels, ATen, oneDNN and MKL held to AVX2 (on this machine's memory)")
    parser.add_argument("--json", help="where the result's JSON goes")
    parser.add_argument("--plot", help="where its PNG goes")


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_as(isa: str, script: str, argv: list[str] | None) -> None:
    """Under isa "avx2", start `script` again with AVX2_ENV set (the libraries read it as they
    load); returns at once where it is set already, or for "native"."""
    if isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        again = [sys.executable, os.path.abspath(script), *(sys.argv[1:] if argv is None else argv)]
        os.execve(sys.executable, again, {**os.environ, **AVX2_ENV})


def isa_label(isa: str) -> str:
    """What a result records of --isa: "native", or "avx2" with the settings it ran under."""
    return isa if isa == "native" else f"avx2 ({' '.join(f'{k}={v}' for k, v in AVX2_ENV.items())})"
