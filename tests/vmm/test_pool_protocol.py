"""The three pools declare one protocol (vmm.Pool) and keep it: a PagePool, a tenant's share of a
SharedPool and a process's AttachedPool to a PoolOwner each have every member with its
parameters, and count references alike on the verbs a KV cache uses."""
import inspect

import pytest

import vmm
from vmm.attach import AttachedPool
from vmm.pool import PagePool, Pool
from vmm.share import PoolShare

METHODS = [n for n, m in vars(Pool).items() if not n.startswith("_") and callable(m)]
PROPERTIES = [n for n, m in vars(Pool).items() if isinstance(m, property)]


@pytest.mark.parametrize("cls", [PagePool, PoolShare, AttachedPool])
def test_each_pool_has_every_member_of_the_protocol_with_its_parameters(cls):
    for name in METHODS:
        theirs = list(inspect.signature(getattr(cls, name)).parameters)
        assert theirs == list(inspect.signature(getattr(Pool, name)).parameters), (cls.__name__, name, theirs)
    for name in PROPERTIES:
        assert isinstance(inspect.getattr_static(cls, name), property), (cls.__name__, name)


@pytest.fixture(params=["page_pool", "share", "attached"])
def any_pool(request, tmp_path):
    backend = vmm.HostBackend(4096)
    if request.param == "page_pool":
        pool = vmm.PagePool(backend, 8)
        yield pool
        pool.close()
    elif request.param == "share":
        shared = vmm.SharedPool(vmm.PagePool(backend, 8))
        yield shared.tenant("a")
        shared.close()
    else:
        owner = vmm.PoolOwner(backend, 8, str(tmp_path / "pool.sock")).start()
        pool = vmm.AttachedPool(owner.path)
        yield pool
        pool.close()
        owner.stop()


def test_each_pool_counts_references_alike(any_pool):
    pool = any_pool
    for name in ("page_size", "backend", "handles", "ref_counts", "lock"):
        assert hasattr(pool, name), name
    assert pool.num_pages == 8 and pool.num_free == 8 and pool.most_pages == 8
    a, (b, c) = pool.alloc(), pool.alloc_many(2)
    assert pool.num_free == 5 and {pool.own_refs(p) for p in (a, b, c)} == {1}
    pool.hold(a)
    assert pool.own_refs(a) == 2 and pool.drop(a) is False and pool.drop(a) is True
    pool.drop_many([b, c])
    assert pool.num_free == 8 and pool.stats().in_use == 0
    pool.check({})
    with pytest.raises(vmm.PoolExhausted):
        pool.alloc_many(9)
    assert pool.num_free == 8  # all or nothing
