"""Native fast paths, kept only where a measurement earns them, each with the pure-torch
reference the tests hold it to (engine/models/ops.py, engine/worker/attention.py).

`cpu_kernels()` loads ext/cpu/ as `torch.ops.vkv.*`: a source file per kernel family (attention,
rope, norms, panels, the decode step, the greedy pick, LoRA; ops.cpp registers them and ops.h
lists them; the inner loops several families share in headers), compiled the first time on a
machine (g++ and ninja) into $VKV_CACHE_DIR/ext (default ~/.cache/vkv/ext), keyed by every
source and header, the compiler flags, torch's version and the CPU's features, so later starts
only load it. The files are compiled as one translation unit (a generated file that includes
each): torch's headers cost every unit about 4.5 s, and built as eight units the kernels took
96 s of CPU against 40 s as one (the 2-vCPU EPYC, -O3), a cost each test build of another ISA
pays again; one unit also keeps every inner loop inlinable into the decode step as before. Where it cannot be built, it returns None and `cpu_kernels_error()` says
why; the engine then runs the torch references. A failed build leaves a note under the same
key, so the next process reads the reason instead of compiling again.

The kernels' vector paths come per ISA (`kernel_isa()`): "avx512", "avx2" (AVX2 + FMA) or
"scalar" (what the compiler vectorizes by itself). The default is the best this CPU runs;
`VKV_CPU_ISA=avx2` (or `scalar`) builds a narrower one, so one machine builds and tests every
path below its own. An ISA the CPU lacks is refused with the reason and the best one is used.
`VKV_CPU_ISA=avx512-emulated` (tests) builds the AVX-512 layer on a CPU without it, each
AVX-512 intrinsic carried out by SIMDe (the simde-py package) with what the CPU has: slower
than native, but the same tiles, tails and lane counts, so the AVX-512 path is tested on any
machine before it meets one.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import threading
from functools import lru_cache
from pathlib import Path

import torch

# *.cpp compiled, *.h included; all of them key the build. VKV_KERNEL_SOURCES names another folder
# (the suite's tests of the build itself use a one-op source that compiles in seconds)
SOURCES = Path(os.environ.get("VKV_KERNEL_SOURCES") or Path(__file__).parent / "cpu")
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, expanded in our code; the libgomp.so.1
# it links is the one torch already loaded (same soname), so there is one thread pool.
# -fno-trapping-math: nothing here turns floating-point exceptions on, and with them possible GCC
# leaves loops whose body selects between floats scalar, attention's softmax among them (an exp
# and a rounding per score). No value changes (unlike -ffast-math). Measured:
# benchmarks/results/cpu/design_choices.json, "if_conversion".
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
ISAS = ("avx512", "avx2", "scalar")  # widest first
EMULATED = "avx512-emulated"  # the AVX-512 layer through SIMDe, on any CPU: for tests
ISA_FLAGS = {"avx512": [], "avx2": ["-mno-avx512f"], "scalar": ["-mno-avx"],  # -mno-avx: no AVX, AVX2, FMA, AVX-512
             EMULATED: ["-DVKV_EMULATE_AVX512", "-O1"]}  # -O1: SIMDe compiles 40 s faster
_lock = threading.Lock()
_loaded: bool | None = None
_error: str | None = None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    return frozenset(_cpu_features().decode(errors="replace").partition(":")[2].split())


def cpu_field(name: str) -> str:
    """The first CPU's /proc/cpuinfo field `name` ("model name", "cpu family", "model"), or "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((value.strip() for key, _, value in (line.partition(":") for line in f)
                         if key.strip() == name), "unknown")
    except OSError:
        return "unknown"


def cpu_model() -> str:
    return cpu_field("model name")


def native_isa() -> str:
    """The widest kernel ISA this CPU runs."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "scalar"


@lru_cache(maxsize=None)
def kernel_isa() -> tuple[str, str]:
    """(the ISA the kernels are built for, why): VKV_CPU_ISA if this CPU runs it, else the best."""
    best, asked = native_isa(), os.environ.get("VKV_CPU_ISA", "").strip().lower()
    if not asked or asked == "native":
        return best, f"the widest this CPU ({cpu_model()}) runs"
    if asked == EMULATED:
        if simde_include() is None:
            return best, f"VKV_CPU_ISA={asked} needs SIMDe's headers (pip install simde-py): using {best}"
        return asked, f"VKV_CPU_ISA={asked}: the AVX-512 layer carried out by SIMDe (slow; for tests)"
    if asked not in ISAS:
        return best, f"VKV_CPU_ISA={asked!r} is not one of {ISAS + (EMULATED,)}: using {best}"
    if ISAS.index(asked) < ISAS.index(best):
        return best, f"VKV_CPU_ISA={asked} asked, but this CPU lacks it: using {best}"
    return asked, f"VKV_CPU_ISA={asked}"


def simde_include() -> str | None:
    """The folder holding SIMDe's headers (simde-py), or None where it is not installed."""
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


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
                print(f"vkv: the native CPU kernels are unavailable, running the torch references: {_error}",
                      file=sys.stderr, flush=True)
        return torch.ops.vkv if _loaded else None


def _build_and_load() -> None:
    if os.environ.get("VKV_NO_NATIVE"):
        raise RuntimeError("VKV_NO_NATIVE is set")
    isa = kernel_isa()[0]
    build = build_dir()
    library = build / f"{_library(build)}.so"
    if not (build / "BUILT").is_file():
        _build(build, isa, _flags(isa))
    try:
        torch.ops.load_library(str(library))
    except OSError:  # marked BUILT, but the library is gone or damaged (a cache cleaned by hand): once more
        (build / "BUILT").unlink(missing_ok=True)
        library.unlink(missing_ok=True)
        _build(build, isa, _flags(isa))
        torch.ops.load_library(str(library))
    built = torch.ops.vkv.isa()
    if built != isa:
        raise RuntimeError(f"the kernels were built for {built!r}, not {isa!r}")


def _flags(isa: str) -> list[str]:
    return FLAGS + ISA_FLAGS[isa] + ([f"-I{simde_include()}"] if isa == EMULATED else [])


def build_dir() -> Path:
    """Where the kernels for this source, ISA, compiler flags, torch, Python and CPU are built:
    $VKV_CACHE_DIR/ext/cpu-KEY."""
    flags = _flags(kernel_isa()[0])
    files = [f.name.encode() + b"\0" + f.read_bytes() for f in _source_files(("*.cpp", "*.h"))]
    key = hashlib.sha256(b"\0".join([*files, " ".join(flags).encode(), torch.__version__.encode(),
                                     sys.version.encode(), _cpu_features()])).hexdigest()[:16]
    root = Path(os.environ.get("VKV_CACHE_DIR", Path.home() / ".cache" / "vkv"))
    return root / "ext" / f"cpu-{key}"


def _source_files(patterns: tuple[str, ...]) -> list[Path]:
    return sorted(f for pattern in patterns for f in SOURCES.glob(pattern))


def _library(build: Path) -> str:
    return "vkv_" + build.name.replace("-", "_")  # vkv_cpu_KEY: a C identifier (TORCH_EXTENSION_NAME)


def _build(build: Path, isa: str, flags: list[str]) -> None:
    """Compile into `build`, one process at a time, and mark it BUILT.

    Processes that start together (pytest workers, tensor-parallel ranks, servers) wait on one
    flock: the kernel releases it when its holder dies, however it dies. torch's own lock is a
    file that a killed builder leaves behind, after which every later start waits forever on it;
    so it is only ever taken under the flock, and a stale one is removed. A build interrupted
    before BUILT is done again by the next process."""
    import fcntl

    build.mkdir(parents=True, exist_ok=True)
    with open(build / "flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if (build / "BUILT").is_file():  # built by the process we waited for
            return
        failed = build / "FAILED"
        if failed.is_file():  # this source, these flags, this machine: it did not build before
            raise RuntimeError(f"{failed.read_text().strip()} (an earlier build; delete {build} to try again)")
        (build / "lock").unlink(missing_ok=True)  # torch's, left by a builder that died
        _ninja_on_path()  # not a build failure: installing ninja fixes it
        print(f"vkv: compiling the CPU kernels ({isa}) once for this machine (about 20 s) ...",
              file=sys.stderr, flush=True)
        try:
            from torch.utils import cpp_extension

            unity = build / "vkv_kernels.cpp"  # every family's file in one translation unit (see the note above)
            text = "".join(f'#include "{f}"\n' for f in _source_files(("*.cpp",)))
            if not unity.is_file() or unity.read_text() != text:  # (rewritten, ninja would compile it all again)
                unity.write_text(text)
            cpp_extension.load(name=_library(build), sources=[str(unity)], build_directory=str(build),
                               extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
                               verbose=False)
        except Exception as exc:
            if COMPILER_ERROR.search(str(exc)):  # the source does not compile here: not tried again.
                # Anything else (no compiler on PATH, cc1plus killed, a full disk) may pass: tried
                # again at the next start rather than leaving the torch references for good
                (build / "FAILED").write_text(f"{type(exc).__name__}: {exc}".strip()[:2000])
            raise
        (build / "BUILT").touch()


COMPILER_ERROR = re.compile(r":\d+:\d+: error:")  # a diagnostic in the source: file:line:col: error:


def _ninja_on_path() -> None:
    if shutil.which("ninja") is None:
        try:
            import ninja  # the PyPI package ships the binary
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError as exc:
            raise RuntimeError("ninja is needed to build the CPU kernels (pip install ninja)") from exc


@lru_cache(maxsize=None)
def bf16_gemm() -> tuple[bool, str]:
    """(whether oneDNN runs bf16 GEMMs natively on this CPU, why): probed by packing a small
    bf16 weight, the call the model makes. Without AVX512-BF16/AMX/AVX-NE-CONVERT (or at least
    AVX512-BW/VL/DQ) oneDNN refuses it, and where it runs emulated it is several times slower
    than fp32 (design_choices.json, "emulated_bf16_gemm"). A narrower
    VKV_CPU_ISA than this CPU's stands for a CPU without native bf16 (none below AVX-512 has
    it, bar AVX-NE-CONVERT's newest), so the engine takes that CPU's path, not only its kernels."""
    if not torch.backends.mkldnn.is_available():
        return False, "PyTorch was built without oneDNN"
    isa = kernel_isa()[0]
    if isa != native_isa():
        return False, f"VKV_CPU_ISA={isa} stands for a CPU without native bf16 arithmetic"
    flags = cpu_flags()
    if not flags & {"avx512_bf16", "amx_bf16", "avx_ne_convert"}:
        return False, "this CPU has no native bf16 arithmetic (no AVX512-BF16, AMX or AVX-NE-CONVERT)"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError as exc:
        return False, f"oneDNN refuses bf16 weights here: {str(exc).splitlines()[0]}"
    return True, "oneDNN bf16 (native bf16 instructions)"


@lru_cache(maxsize=None)
def bf16_dot_gemm() -> tuple[bool, str]:
    """(whether bf16 steps of many rows run on vkv's own bf16 panels, in AVX512-BF16's dot
    products, instead of oneDNN's bf16 GEMM over a second packing, why): where the kernels were
    built with AVX512-BF16 (`bf16_dot()`) and the CPU has no AMX, whose tiles oneDNN's bf16 GEMM
    uses at several times the dot products' rate (ext/cpu/panels.h's Note [bf16 steps in bf16 dot
    products])."""
    if cpu_kernels() is None:
        return False, f"no native kernels: {cpu_kernels_error()}"
    if not torch.ops.vkv.bf16_dot():
        return False, "the kernels' build has no AVX512-BF16"
    if "amx_bf16" in cpu_flags():
        return False, "AMX: oneDNN's bf16 GEMM runs on its tiles"
    return True, "AVX512-BF16 dot products over the panels"


def _cpu_features() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""
