import os
import subprocess
import sys
from pathlib import Path

import pytest

import vmm
from cuda_emulator import make_backend
from cuda_emulator import unavailable_reason as emulator_unavailable


def cuda_unavailable() -> str | None:
    """None when a CUDA backend can run here: the real driver on a GPU, else the emulator."""
    if vmm.cuda_unavailable_reason() is None:
        return None
    return emulator_unavailable()


def make_cuda_backend(page_size: int | None = None, shareable: bool = False) -> vmm.Backend:
    """vkv's CudaBackend: over the real driver where there is a GPU, over the driver emulator
    (tests/cuda_emulator) where there is none."""
    return make_backend(page_size, shareable)


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda_emulated,
                                   pytest.mark.skipif(cuda_unavailable() is not None,
                                                      reason=f"no CUDA backend: {cuda_unavailable()}")])
BACKENDS = ["host", CUDA]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend: the host's, and CUDA's (real driver or its emulator)."""
    b = vmm.HostBackend(4096) if request.param == "host" else make_cuda_backend()
    yield b
    b.close()


@pytest.fixture
def pool(backend):
    p = vmm.PagePool(backend, 16)
    yield p
    p.close()


@pytest.fixture(scope="session", autouse=True)
def weights_load_once():
    """Every engine of a test run over the same model, device, dtype and seed shares one loaded
    copy of the weights (read-only once prepared), so each model loads once per run instead of
    once per engine. Tensor-parallel shards load as usual. A test that updates weights in place
    takes `own_weights`; a copy updated anyway is not handed out again (a later engine of the
    same worker would run the updated weights: a chat in test_server.py answered garbage)."""
    import engine.worker.rank as rank
    import ext

    load, loaded = rank.load_model, {}

    def load_once(spec, cfg, device, dtype, seed=0, tp=(0, 1), compute_dtype=None, sleep_mode=False,
                  greedy_pick=False, quantization=None):
        if tp != (0, 1) or sleep_mode:  # (weights that sleep are one engine's)
            return load(spec, cfg, device, dtype, seed, tp, compute_dtype, sleep_mode, greedy_pick, quantization)
        # (and the engine's choices of GEMM, which a test may force)
        key = (spec, str(device), dtype, seed, compute_dtype, greedy_pick, quantization, ext.bf16_gemm(),
               ext.bf16_dot_gemm())
        if key not in loaded or loaded[key].weights_version:  # never share weights updated in place
            loaded[key] = load(spec, cfg, device, dtype, seed, tp, compute_dtype, greedy_pick=greedy_pick,
                               quantization=quantization)
        return loaded[key]

    rank.load_model = load_once
    yield
    rank.load_model = load


@pytest.fixture(scope="session", autouse=True)
def tokenizer_loads_once():
    """Every engine of a test run over the same model shares one tokenizer (the engine only reads
    it): building one reads and parses its files, a fifth of a small engine's start."""
    import engine.core.llm_engine as llm_engine

    load, loaded = llm_engine.load_tokenizer, {}

    def load_once(spec):
        if spec not in loaded:
            loaded[spec] = load(spec)
        return loaded[spec]

    llm_engine.load_tokenizer = load_once
    yield
    llm_engine.load_tokenizer = load


@pytest.fixture
def own_weights(monkeypatch):
    """For a test whose engine writes its weights in place: its engines load a copy of their own
    (the shared one may still be running in an engine another test of this worker made)."""
    import engine.worker.rank as rank
    from engine.models import load_model

    monkeypatch.setattr(rank, "load_model", load_model)


_PREBUILD = Path(__file__).parent / "prebuild.py"


def pytest_sessionstart(session):
    """In the run's first process (xdist's controller, or the only one), when the run includes
    test_kernels.py and workers: the bundled model's conversion and the other ISAs' kernel builds
    start at the lowest priority (tests/prebuild.py says why)."""
    config = session.config
    if (hasattr(config, "workerinput") or os.environ.get("VKV_OTHER_ISA_RUN") or os.environ.get("VKV_NO_NATIVE")
            or not getattr(config.option, "numprocesses", None)):
        return
    kernels = _PREBUILD.parent / "ext" / "test_kernels.py"
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [Path.cwd()]
    if not any(p == kernels or p in kernels.parents for p in paths):
        return
    prebuild = subprocess.Popen([sys.executable, str(_PREBUILD)], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # niced at once, long before its imports end and it starts the builds, which inherit it (not
    # by preexec_fn: this process has threads)
    try:
        os.setpriority(os.PRIO_PROCESS, prebuild.pid, 19)
    except ProcessLookupError:  # (it has already ended: nothing of it to slow the run)
        return
    config._vkv_prebuild = prebuild


def pytest_sessionfinish(session):
    """The prebuild, if still running, is stopped with the run (its build is made again by the next
    process that needs it)."""
    prebuild = getattr(session.config, "_vkv_prebuild", None)
    if prebuild is not None and prebuild.poll() is None:
        try:
            os.killpg(prebuild.pid, 9)
        except ProcessLookupError:  # (it ended since)
            pass
        prebuild.wait()
