"""Native fast paths, kept only where a measurement earns them, each with the pure-torch
reference the tests hold it to (engine/ops.py, engine/attention.py).

`cpu_kernels()` loads ext/cpu/kernels.cpp as `torch.ops.vkv.*`, compiling it the first time on
a machine (about 20 s; g++ and ninja) into $VKV_CACHE_DIR/ext (default ~/.cache/vkv/ext),
keyed by the source, the compiler flags, torch's version and the CPU's features, so later
starts only load it. Where it cannot be built, it returns None and `cpu_kernels_error()` says
why; the engine then runs the torch references.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "cpu" / "kernels.cpp"
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, expanded in our code; the libgomp.so.1
# it links is the one torch already loaded (same soname), so there is one thread pool.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
_lock = threading.Lock()
_loaded: bool | None = None
_error: str | None = None


def cpu_kernels_error() -> str | None:
    """Why the CPU kernels are unavailable, or None when they load (or were not tried)."""
    return _error


def cpu_kernels():
    """torch.ops.vkv with the CPU kernels, or None (see cpu_kernels_error)."""
    global _loaded, _error
    with _lock:
        if _loaded is None:
            try:
                _build_and_load()
                _loaded = True
            except Exception as exc:  # no compiler, no ninja, a build error: run the references
                _loaded, _error = False, f"{type(exc).__name__}: {exc}".strip()[:2000]
        return torch.ops.vkv if _loaded else None


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    if os.environ.get("VKV_NO_NATIVE"):
        raise RuntimeError("VKV_NO_NATIVE is set")
    if shutil.which("ninja") is None:
        try:
            import ninja  # the PyPI package ships the binary
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError as exc:
            raise RuntimeError("ninja is needed to build the CPU kernels (pip install ninja)") from exc
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), torch.__version__.encode(),
                                     sys.version.encode(), _cpu_features()])).hexdigest()[:16]
    root = Path(os.environ.get("VKV_CACHE_DIR", Path.home() / ".cache" / "vkv"))
    build = root / "ext" / f"cpu-{key}"
    build.mkdir(parents=True, exist_ok=True)
    if not (build / f"vkv_cpu_{key}.so").exists():
        print("vkv: compiling the CPU kernels once for this machine (about 20 s) ...", file=sys.stderr, flush=True)
    cpp_extension.load(name=f"vkv_cpu_{key}", sources=[str(SOURCE)], build_directory=str(build),
                       extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def _cpu_features() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
