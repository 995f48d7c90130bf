"""What the suite's workers would otherwise make themselves, made at the lowest priority in
the cycles they leave idle (a worker waiting on the native build's lock, on a server's start, on
a deadline): the bundled model's fp32 conversion (about 10 s of one core), then the kernels of
every other ISA that test_kernels' children test (20-25 s each). Started by conftest.py when a
run with workers includes test_kernels.py. Each is what its first user would make (the same
$VKV_CACHE_DIR, sources and flags, so the same key) under the same file lock: a worker that
needs it first waits for it, and one stopped at the end of the run is made again by the next
process that needs it."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def other_isas(buildable_only: bool = True) -> list[str]:
    """The kernel ISAs this machine can build besides its own: each narrower one, and AVX-512
    through SIMDe (ext.EMULATED) where the CPU lacks it (only where SIMDe's headers are
    installed, if buildable_only)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import ext
    narrower = list(ext.ISAS[ext.ISAS.index(ext.native_isa()) + 1:])
    emulated = ext.native_isa() != "avx512" and (not buildable_only or ext.simde_include() is not None)
    return narrower + ([ext.EMULATED] if emulated else [])


if __name__ == "__main__":
    subprocess.run([sys.executable, "-c", "from engine.models.loader import checkpoint_dir; checkpoint_dir(None)"],
                   cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for isa in other_isas():
        subprocess.run([sys.executable, "-c", "import ext; ext.cpu_kernels()"], cwd=str(ROOT),
                       env={**os.environ, "VKV_CPU_ISA": isa}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
