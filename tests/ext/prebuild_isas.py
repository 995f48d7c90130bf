"""Build the kernels of every other ISA that test_kernels' children test, one after the other, in
processes of the lowest priority: started by conftest.py when a run includes them, so that those
builds take cycles the suite leaves idle (a worker waiting on the native build's lock, on a
server's start, on a deadline) instead of a worker's time when the children start. Each build is
the one the child would make itself (same sources, flags and $VKV_CACHE_DIR, so the same key),
under the same flock: a child that starts first waits for it, and a build stopped at the end of
the run is made again by whoever needs it next."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
    for isa in other_isas():
        subprocess.run([sys.executable, "-c", "import ext; ext.cpu_kernels()"], cwd=str(ROOT),
                       env={**os.environ, "VKV_CPU_ISA": isa}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
