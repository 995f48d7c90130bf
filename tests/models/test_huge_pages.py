"""The GEMM panels on transparent huge pages (engine/models/huge_pages.py)."""
import torch

from engine.models import huge_pages
from engine.models.huge_pages import onto_huge_pages


def anon_huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping that holds addr (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_panels_move_into_one_arena_in_place_with_their_values():
    """Each tensor keeps its Python object and its values; all now live in one storage, and
    where the kernel allows huge pages the arena's aligned span is advised onto them."""
    torch.manual_seed(0)
    tensors = [torch.randn(n, 576, 32) for n in (30, 18, 96, 18)] + [torch.randn(7, 64, 32).bfloat16()]
    before, ids = [t.clone() for t in tensors], [id(t) for t in tensors]
    said = onto_huge_pages(tensors)
    assert [id(t) for t in tensors] == ids
    assert all(torch.equal(t, b) and t.is_contiguous() for t, b in zip(tensors, before))
    mode = huge_pages.thp_mode()
    if mode in ("always", "madvise"):
        assert said.startswith("panels on 2 MiB pages"), said
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        print(said, anon_huge_kib(tensors[2].data_ptr()), "KiB of huge pages")  # the kernel may fall short
    else:
        assert said == f"panels on 4 KiB pages (transparent huge pages: {mode})"


def test_without_huge_pages_the_panels_stay_and_the_reason_is_said(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    t = torch.randn(64, 576, 32)
    ptr = t.data_ptr()
    assert onto_huge_pages([t]) == "panels on 4 KiB pages (transparent huge pages: never)"
    assert t.data_ptr() == ptr
    small = torch.randn(4, 4)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    assert onto_huge_pages([small]) == "panels on 4 KiB pages (under 2 MiB in all)"


def test_an_arena_that_cannot_be_allocated_leaves_the_panels_where_they_are(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    t = torch.randn(64, 576, 32)
    ptr, before = t.data_ptr(), t.clone()

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(huge_pages.torch, "empty", no_memory)
    assert onto_huge_pages([t]) == "panels on 4 KiB pages (no memory for the arena)"
    assert t.data_ptr() == ptr and torch.equal(t, before)
