"""The vmm library on every backend present: data integrity, sharing, copy-on-write, errors."""
import threading

import pytest
import torch

import vmm


def page_view(res: vmm.Reservation, index: int) -> torch.Tensor:
    n = res.page_size // 4
    return res.view(torch.int32, (n,), offset=res.offset_of(index), check=True)


def test_write_through_one_mapping_reads_through_another(pool):
    a, b = vmm.Reservation(pool, 4 * pool.page_size), vmm.Reservation(pool, 4 * pool.page_size)
    (page,) = a.map_new(2)
    b.share(a, 2, 0)
    page_view(a, 2).fill_(1234)
    assert torch.all(page_view(b, 0) == 1234)
    page_view(b, 0)[7] = -5
    assert page_view(a, 2)[7].item() == -5
    assert pool.ref_counts[page] == 2 and pool.stats().shared == 1
    pool.audit([a, b])
    a.release(), b.release()
    assert pool.stats().free == pool.num_pages


def test_copy_on_write_leaves_the_other_sharer_untouched(pool):
    a, b = vmm.Reservation(pool, 2 * pool.page_size), vmm.Reservation(pool, 2 * pool.page_size)
    a.map_new(0, 2)
    b.share(a, 0, 0, 2)
    page_view(a, 1).copy_(torch.arange(pool.page_size // 4, dtype=torch.int32))
    old = b.page_at(1)
    new = b.copy_on_write(1)
    assert new != old and a.page_at(1) == old
    assert torch.equal(page_view(b, 1), page_view(a, 1))  # the copy carries the bytes
    page_view(b, 1).fill_(-1)
    assert torch.equal(page_view(a, 1).cpu(), torch.arange(pool.page_size // 4, dtype=torch.int32))
    assert b.copy_on_write(1) == new  # already private: nothing to do
    pool.audit([a, b])
    a.release(), b.release()
    pool.audit([])


def test_remap_after_unmap_shows_the_new_page(pool):
    a = vmm.Reservation(pool, pool.page_size)
    b = vmm.Reservation(pool, pool.page_size)
    a.map_new(0)
    b.map_new(0)
    page_view(a, 0).fill_(1)
    page_view(b, 0).fill_(2)
    a.unmap(0)
    a.share(b, 0, 0)
    assert torch.all(page_view(a, 0) == 2)
    a.release(), b.release()


def test_map_run_and_strided_views(pool):
    res = vmm.Reservation(pool, 8 * pool.page_size)
    pages = pool.alloc_many(4)
    res.map_run(2, pages[::-1])  # physical order scattered, virtual order contiguous
    for page in pages:
        pool.drop(page)
    span = 4 * pool.page_size // 2
    x = res.view(torch.float16, (span,), offset=res.offset_of(2), check=True)
    x.copy_((torch.arange(span) % 2039).to(torch.float16))  # every value exact in fp16, neighbours differ
    rows = res.view(torch.float16, (4, 8), strides=(span // 4, 2), offset=res.offset_of(2), check=True)
    assert torch.equal(rows[:, 0], x[:: span // 4])
    assert rows[1, 3].item() == x[span // 4 + 6].item() == (span // 4 + 6) % 2039
    assert torch.isfinite(x).all()
    res.release()
    pool.audit([])


def test_misuse_raises_clear_errors_and_corrupts_nothing(pool):
    res = vmm.Reservation(pool, 4 * pool.page_size)
    res.map_new(0)
    with pytest.raises(vmm.AlreadyMapped):
        res.map_new(0)
    with pytest.raises(vmm.NotMapped):
        res.unmap(1)
    with pytest.raises(vmm.OutOfRange):
        res.map_new(4)
    with pytest.raises(vmm.OutOfRange):
        res.map_new(3, 2)
    with pytest.raises(vmm.UnmappedAccess):
        res.view(torch.uint8, (2 * pool.page_size,), check=True)
    with pytest.raises(vmm.OutOfRange):
        res.view(torch.uint8, (5 * pool.page_size,))
    page = pool.alloc()
    pool.drop(page)
    with pytest.raises(vmm.DoubleFree):
        pool.drop(page)
    with pytest.raises(vmm.DoubleFree):
        res.map(1, page)  # a free page must be allocated first
    for bad in (-1, pool.num_pages):  # -1 would index the last page's count
        with pytest.raises(vmm.OutOfRange):
            res.map(1, bad)
        with pytest.raises(vmm.OutOfRange):
            pool.hold(bad)
    pool.audit([res])
    res.release()
    with pytest.raises(vmm.ReservationReleased):
        res.release()
    with pytest.raises(vmm.ReservationReleased):
        res.map_new(0)
    pool.audit([])
    assert pool.stats().free == pool.num_pages


def test_exhaustion_is_typed_and_all_or_nothing(pool):
    res = vmm.Reservation(pool, 32 * pool.page_size)
    res.map_new(0, pool.num_pages - 2)
    with pytest.raises(vmm.PoolExhausted):
        res.map_new(20, 3)
    assert pool.stats().free == 2
    pool.audit([res])
    res.release()
    pool.audit([])


def test_release_by_garbage_collection_returns_pages(pool):
    res = vmm.Reservation(pool, 2 * pool.page_size)
    res.map_new(0, 2)
    del res
    import gc
    gc.collect()
    assert pool.stats().free == pool.num_pages


def test_worker_threads_map_while_others_read(backend):
    pool = vmm.PagePool(backend, 64)
    reservations = [vmm.Reservation(pool, 16 * pool.page_size) for _ in range(4)]
    errors = []

    def churn(res, seed):
        try:
            for round_ in range(30):
                res.map_new(0, 8)
                page_view(res, 3).fill_(seed * 1000 + round_)
                assert torch.all(page_view(res, 3) == seed * 1000 + round_)
                res.unmap(0, 8)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(r, i)) for i, r in enumerate(reservations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    pool.audit(reservations)
    assert pool.stats().free == pool.num_pages
    for r in reservations:
        r.release()
    pool.close()


def test_host_page_size_is_validated():
    with pytest.raises(ValueError):
        vmm.HostBackend(1000)
    with pytest.raises(ValueError):
        vmm.make_backend("tpu")


def test_cuda_backend_says_why_it_is_unavailable():
    reason = vmm.cuda_unavailable_reason()
    if reason is None:
        pytest.skip("CUDA is available here")
    with pytest.raises(vmm.BackendUnavailable, match="cuda|CUDA"):
        vmm.CudaBackend()


def test_host_pool_larger_than_the_kernel_can_map_is_refused_up_front():
    backend = vmm.HostBackend(4096)
    with pytest.raises(ValueError, match="larger pages"):
        vmm.PagePool(backend, backend.max_mapped_pages() + 1)
    backend.close()


def test_a_swap_slot_freed_twice_is_refused_and_a_failed_put_keeps_its_slot():
    """A slot freed twice was handed to two owners (each overwriting the other's KV); a put of too
    many bytes lost its slot for good."""
    import torch

    from vmm.errors import DoubleFree
    from vmm.swap import SlotStore

    store = SlotStore(torch.device("cpu"), 4096, 2 * 4096)
    with pytest.raises(ValueError, match="do not fit"):
        store.put([torch.zeros(4097, dtype=torch.uint8)])
    assert store.num_free == 2
    slot = store.put([torch.ones(16, dtype=torch.uint8)])
    store.discard(slot)
    with pytest.raises(DoubleFree):
        store.discard(slot)
    with pytest.raises(DoubleFree):
        store.get(slot, [torch.empty(16, dtype=torch.uint8)])
    assert sorted({store.put([torch.ones(1, dtype=torch.uint8)]) for _ in range(2)}) == [0, 1]
    store.close()


def test_a_named_swap_file_is_removed_when_the_store_cannot_be_built(tmp_path, monkeypatch):
    import mmap

    from vmm.swap import SlotStore

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_memory)
    with pytest.raises(OSError):
        SlotStore(torch.device("cpu"), 4096, 2 * 4096, str(tmp_path / "swap"))
    assert list(tmp_path.iterdir()) == []


def test_a_swap_out_that_fails_part_way_frees_the_slots_it_took_and_unmaps_nothing():
    from engine.kv.manager import KVManager
    from engine.kv.virtual import VirtualLayout
    from engine.models.config import ModelConfig
    from engine.request.sampling_params import SamplingParams
    from engine.request.sequence import Sequence

    class FailingSwap(vmm.SwapSpace):
        saves = 0

        def save(self, addr):
            FailingSwap.saves += 1
            if FailingSwap.saves == 3:
                raise OSError(28, "No space left on device")
            return super().save(addr)

    cfg = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=3, num_kv_heads=3,
                      head_dim=40)  # 34 tokens a 64 KiB page of both layers' K and V
    backend = vmm.HostBackend(64 << 10)
    swap = FailingSwap(backend, 16 * (64 << 10))
    kv = KVManager(VirtualLayout(cfg, "interleaved", 2, 256, torch.float32, backend, 16, 1, swap), True)
    seq = Sequence("s", 0, list(range(1, 121)), SamplingParams(max_tokens=1), 0.0)
    kv.admit(seq)
    assert kv.ensure_mapped(seq, 110)
    seq.num_computed_tokens = 110
    mapped = kv.layout.pool.num_free
    with pytest.raises(OSError):
        kv.swap_out(seq)
    assert swap.num_free == swap.num_slots and not seq.kv.swapped
    assert kv.layout.pool.num_free == mapped
    kv.audit()
    assert kv.swap_out(seq) and len(kv.layout.swapped_pages(seq)) == 4
    kv.close()


def test_a_woken_pool_creates_each_page_when_first_taken(backend, monkeypatch):
    """Waking costs nothing: restore_memory creates no page; alloc creates each at first use, and
    a creation that fails is NoMemory and gives back what the same alloc_many took."""
    pool = vmm.PagePool(backend, 4)
    res = vmm.Reservation(pool, 4 * pool.page_size)
    res.map_new(0, 2)
    res.unmap(0, 2)
    pool.release_memory()
    pool.restore_memory()
    assert pool.handles == [None] * 4 and pool.num_free == 4 and not pool.asleep
    pages = res.map_new(0, 2)
    assert sorted(i for i, h in enumerate(pool.handles) if h is not None) == sorted(pages)
    page_view(res, 1).fill_(77)
    assert torch.all(page_view(res, 1) == 77)
    made = []

    def create_once():  # the system has memory for one more page only
        if made:
            raise vmm.PoolExhausted("no memory")
        made.append(1)
        return real()

    real = backend.create_page
    monkeypatch.setattr(backend, "create_page", create_once)
    with pytest.raises(vmm.NoMemory, match="no memory"):  # not PoolExhausted: waiting for room would not help
        res.map_new(2, 2)
    assert pool.num_free == 2 and res.mapped_pages() == dict(zip((0, 1), pages))
    pool.audit([res])
    res.release()
    pool.release_memory()  # pages never created have nothing to give back
    assert pool.asleep
    pool.close()


def test_private_host_pages_live_in_their_one_mapping():
    """PrivateHostBackend (the weights' in sleep mode): 2 MiB-aligned ranges, memory that comes
    with the mapping and goes with it, no second mapping of a page, no copy into one."""
    from vmm.host import resident_bytes
    backend = vmm.make_backend("host-private")
    pool = vmm.PagePool(backend, 3)
    a, b = vmm.Reservation(pool, 3 * pool.page_size), vmm.Reservation(pool, pool.page_size)
    assert a.addr % (2 << 20) == 0
    pages = a.map_new(0, 3)
    assert resident_bytes(a.addr, a.nbytes) == 0  # nothing touched yet
    page_view(a, 1).fill_(5)
    assert torch.all(page_view(a, 1) == 5) and resident_bytes(a.addr, a.nbytes) >= pool.page_size
    with pytest.raises(vmm.AlreadyMapped, match="one place"):
        backend.map(b.addr, [pool.handles[pages[0]]])
    with pytest.raises(vmm.VmmError, match="nothing is copied"):  # (copy-on-write, swap)
        backend.copy_page(pool.handles[pages[2]], a.addr)
    a.unmap(0, 3)
    assert resident_bytes(a.addr, a.nbytes) == 0
    a.map_new(0, 3)
    assert torch.all(page_view(a, 1) == 0)  # fresh memory: the old bytes went with the mapping
    pool.audit([a, b])
    a.release(), b.release()
    pool.close()
