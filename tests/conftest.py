import pytest

import vmm

BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.skipif(
    vmm.cuda_unavailable_reason() is not None,
    reason=f"CUDA backend unavailable: {vmm.cuda_unavailable_reason()}"))]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend present here: host always, CUDA where a GPU exists."""
    b = vmm.make_backend(request.param, 4096 if request.param == "host" else None)
    yield b
    b.close()


@pytest.fixture
def pool(backend):
    p = vmm.PagePool(backend, 16)
    yield p
    p.close()
