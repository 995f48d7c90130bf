"""vkv's real CudaBackend, through the real cuda-bindings, against the driver emulator's strict
reading of the documented VMM rules (tests/cuda_emulator): contexts in every thread, the
reservation alignment, page-by-page unmapping, and no stray mapping, page or context after a
failure or at close. Driver failures are injected by the emulator."""
import threading
import time

import pytest
import torch

import vmm
from conftest import cuda_unavailable
from cuda_emulator import EmulatedCudaBackend, counts, fail
from engine.kv.manager import KVManager
from engine.kv.virtual import VirtualLayout
from engine.models.config import ModelConfig

pytestmark = [pytest.mark.cuda_emulated,
              pytest.mark.skipif(vmm.cuda_unavailable_reason() is None, reason="a real GPU: the emulator is not loaded"),
              pytest.mark.skipif(cuda_unavailable() is not None, reason=f"no emulator: {cuda_unavailable()}")]
MIB = 1 << 20


def clean() -> bool:
    c = counts()
    return c.allocations == c.reservations == c.mappings == c.context_retains == 0


def test_everything_goes_back_at_close_including_the_context():
    backend = EmulatedCudaBackend()
    pool = vmm.PagePool(backend, 4)
    res = vmm.Reservation(pool, 3 * pool.page_size)
    res.map_new(0, 3)
    assert counts().mappings == 3 and counts().context_retains == 1
    res.release()
    pool.close()
    backend.close()
    assert clean()


def test_a_thread_with_no_current_context_can_map():
    backend = EmulatedCudaBackend()
    pool = vmm.PagePool(backend, 4)
    errors = []

    def worker():  # a fresh thread: nothing has made a context current in it
        try:
            res = vmm.Reservation(pool, 2 * pool.page_size)
            res.map_new(0, 2)
            res.view(torch.int32, (4,), check=True).fill_(7)
            res.release()
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors
    pool.close()
    backend.close()
    assert clean()


def test_page_sizes_that_are_not_a_power_of_two_reserve_at_the_granularity():
    backend = EmulatedCudaBackend(page_size=6 * MIB)  # a multiple of 2 MiB, not a power of two
    pool = vmm.PagePool(backend, 2)
    res = vmm.Reservation(pool, 12 * MIB)
    res.map_new(0, 2)
    x = res.view(torch.uint8, (12 * MIB,), check=True)
    x[6 * MIB - 1: 6 * MIB + 1] = 9
    res.unmap(0, 2)  # one cuMemUnmap per page: each page was its own mapping
    res.release()
    pool.close()
    backend.close()
    assert clean()


def test_a_failed_map_leaves_nothing_mapped_and_nothing_held():
    backend = EmulatedCudaBackend()
    pool = vmm.PagePool(backend, 4)
    res = vmm.Reservation(pool, 4 * pool.page_size)
    fail("cuMemMap", 3)  # the third page of the run
    with pytest.raises(vmm.PoolExhausted):
        res.map_new(0, 4)
    assert counts().mappings == 0 and pool.num_free == 4 and not res.mapped_pages()
    fail("cuMemSetAccess", 1, code=1)
    with pytest.raises(vmm.VmmError):
        res.map_new(0, 2)
    assert counts().mappings == 0 and pool.num_free == 4
    res.map_new(0, 4)  # and the driver is fine afterwards
    pool.audit([res])
    res.release()
    pool.close()
    backend.close()
    assert clean()


def test_a_failed_copy_on_write_keeps_the_original_page():
    backend = EmulatedCudaBackend()
    pool = vmm.PagePool(backend, 4)
    a, b = vmm.Reservation(pool, pool.page_size), vmm.Reservation(pool, pool.page_size)
    (page,) = a.map_new(0)
    a.view(torch.int32, (4,), check=True).copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    b.share(a, 0, 0)
    for call, nth in (("cuMemMap", 1), ("cuMemMap", 2), ("cuMemUnmap", 2)):  # scratch map, remap, unmap
        fail(call, nth)
        with pytest.raises(vmm.VmmError):
            b.copy_on_write(0)
        assert b.page_at(0) == page and pool.ref_counts[page] == 2
        assert b.view(torch.int32, (4,), check=True).tolist() == [1, 2, 3, 4]
        pool.audit([a, b])
        assert counts().mappings == 2  # a's page and b's: no scratch mapping left over
    assert b.copy_on_write(0) != page
    a.release(), b.release()
    pool.close()
    backend.close()
    assert clean()


def test_a_virtual_kv_cache_gives_everything_back_at_close():
    cfg = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=2, head_dim=64)
    kv = KVManager(VirtualLayout(cfg, "interleaved", 4, 256, torch.float32, EmulatedCudaBackend(), 8))
    assert counts().reservations == 2  # the slots' range and the backend's scratch page
    kv.close()
    assert clean()


def test_a_released_handle_cannot_be_mapped_again():
    """The driver keeps a released allocation's memory while a mapping holds it, but the handle
    is gone: mapping it anew fails (the emulator's rule, as the documentation reads)."""
    from cuda.bindings import driver as cu
    backend = EmulatedCudaBackend()
    handle = backend.create_page()
    a, b = backend.reserve(backend.page_size), backend.reserve(backend.page_size)
    backend.map(a, [handle])
    backend.release_page(handle)  # deferred: a still maps it
    err, = cu.cuMemMap(b, backend.page_size, 0, handle, 0)
    assert err != cu.CUresult.CUDA_SUCCESS
    backend.unmap(a, backend.page_size)
    backend.free_reservation(a, backend.page_size), backend.free_reservation(b, backend.page_size)
    backend.close()
    assert clean()


def test_an_unmap_that_fails_part_way_leaves_the_bookkeeping_with_the_driver():
    backend = EmulatedCudaBackend()
    pool = vmm.PagePool(backend, 4)
    res = vmm.Reservation(pool, 4 * pool.page_size)
    pages = res.map_new(0, 4)
    fail("cuMemUnmap", 3)  # the third page of the run
    with pytest.raises(vmm.PartialUnmap) as caught:
        res.unmap(0, 4)
    assert caught.value.done == 2
    assert res.mapped_pages() == {2: pages[2], 3: pages[3]} and counts().mappings == 2
    pool.audit([res])
    res.unmap(2, 2)
    res.release()
    pool.close()
    backend.close()
    assert clean()


def test_a_backend_that_fails_to_start_keeps_no_context():
    fail("cuMemAddressReserve", 1)  # the scratch page's range, the last step of construction
    with pytest.raises(vmm.VmmError):
        EmulatedCudaBackend()
    with pytest.raises(ValueError):
        EmulatedCudaBackend(page_size=3 * MIB)  # not a multiple of the granularity
    assert clean()


# -- pages shared with other processes (cuMemExportToShareableHandle / ImportFromShareableHandle)

def test_a_page_created_without_the_posix_handle_type_cannot_be_exported():
    from vmm.cuda import CudaDriverError
    backend = EmulatedCudaBackend()
    handle = backend.create_page()
    with pytest.raises(CudaDriverError, match="cuMemExportToShareableHandle"):
        backend.export_page(handle)
    backend.release_page(handle)
    backend.close()
    assert clean()


def test_an_imported_page_is_the_importers_to_release_and_outlives_the_exporters_handle():
    """Import gives a handle of the importer's own; the physical page lives until every handle is
    released and every mapping unmapped, whoever let go first."""
    import os
    exporter, importer = EmulatedCudaBackend(shareable=True), EmulatedCudaBackend()
    page = exporter.page_size
    handle = exporter.create_page()
    a, b = exporter.reserve(page), importer.reserve(page)
    exporter.map(a, [handle])
    exporter.byte_view(a, page).fill_(5)
    fd = exporter.export_page(handle)
    imported = importer.import_page(fd)
    os.close(fd)  # the importer's handle does not need the descriptor
    assert counts().allocations == 2  # two handles, one physical page
    exporter.unmap(a, page)
    exporter.release_page(handle)  # the exporter lets go first
    importer.map(b, [imported])
    assert int(importer.byte_view(b, page)[0]) == 5 and int(importer.byte_view(b, page)[-1]) == 5
    importer.byte_view(b, page).fill_(6)
    importer.unmap(b, page)
    importer.release_page(imported)
    exporter.free_reservation(a, page), importer.free_reservation(b, page)
    exporter.close(), importer.close()
    assert clean()


def test_an_import_of_what_is_not_an_exported_page_is_refused():
    import os
    from vmm.cuda import CudaDriverError
    backend = EmulatedCudaBackend()
    fd = os.memfd_create("not-a-page")
    os.ftruncate(fd, backend.page_size)
    with pytest.raises(CudaDriverError, match="cuMemImportFromShareableHandle"):
        backend.import_page(fd)
    os.close(fd)
    backend.close()
    assert clean()


def test_a_pool_owner_needs_shareable_pages_and_an_attached_process_a_cuda_backend(tmp_path):
    from vmm.attach import AttachedPool, OwnerError
    plain = EmulatedCudaBackend()
    with pytest.raises(ValueError, match="shareable=True"):
        vmm.PoolOwner(plain, 4, str(tmp_path / "no.sock"))
    plain.close()
    owner = vmm.PoolOwner(EmulatedCudaBackend(shareable=True), 4, str(tmp_path / "pool.sock")).start()
    try:
        with pytest.raises(OwnerError, match="attach with a cuda backend"):
            AttachedPool(owner.path)
        fail("cuMemImportFromShareableHandle", 3)  # the third page: the two imported are released again
        with pytest.raises(vmm.VmmError, match="cuMemImportFromShareableHandle"):
            AttachedPool(owner.path, EmulatedCudaBackend())
        assert counts().allocations == 4 and counts().context_retains == 1  # the owner's pages and context
        deadline = time.monotonic() + 1
        while owner.stats()["processes"]:  # the owner sees the failed process leave
            assert time.monotonic() < deadline
            time.sleep(0.005)
        pool = AttachedPool(owner.path, EmulatedCudaBackend())
        assert counts().allocations == 8  # the owner's four pages and this process's four imports
        res = vmm.Reservation(pool, 2 * pool.page_size)
        res.map_new(0, 2)
        res.view(torch.int32, (4,), check=True).fill_(3)
        res.release()
        pool.audit([])
        pool.close()
        assert counts().allocations == 4  # the imports released by the process that made them
    finally:
        owner.stop()
    assert clean()


def test_a_release_that_fails_part_way_can_be_retried_and_loses_no_page():
    backend = EmulatedCudaBackend()
    pool = vmm.PagePool(backend, 4)
    res = vmm.Reservation(pool, 4 * pool.page_size)
    pages = res.map_new(0, 4)
    fail("cuMemUnmap", 3)  # the third page of the run
    with pytest.raises(vmm.PartialUnmap):
        res.release()
    assert not res.released and res.mapped_pages() == {2: pages[2], 3: pages[3]}
    pool.audit([res])  # the first two went back to the pool with their mappings
    res.release()  # the retry unmaps what is left
    assert res.released and pool.num_free == 4
    fail("cuMemRelease", 2)  # sleeping: the second page fails to go back
    with pytest.raises(vmm.VmmError):
        pool.release_memory()
    assert pool.asleep and pool.num_free == 0
    pool.restore_memory()  # what was left is released; each page is made anew when first taken
    assert not pool.asleep and pool.num_free == 4 and len(pool.handles) == 4
    pool.close()
    backend.close()
    assert clean()
