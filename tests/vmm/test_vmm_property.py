"""Random sequences of pool and mapping operations keep every page accounted for.

After every step: each page is free xor referenced, its reference count equals its mappings
plus explicit holds, and every mapping shows the bytes last written to its physical page.
"""
import itertools
from collections import Counter

import pytest
import torch
from conftest import cuda_unavailable, make_cuda_backend
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import vmm

PAGES, RESERVATIONS, SPAN = 10, 3, 6
slot = st.integers(0, RESERVATIONS - 1)
index = st.integers(0, SPAN - 1)
TAG_WORDS = 16


class PageMachine(RuleBasedStateMachine):
    def make_backend(self) -> vmm.Backend:
        return vmm.HostBackend(4096)

    def __init__(self):
        super().__init__()
        self.backend = self.make_backend()
        self.page = self.backend.page_size
        self.pool = vmm.PagePool(self.backend, PAGES)
        self.res = [vmm.Reservation(self.pool, SPAN * self.page) for _ in range(RESERVATIONS)]
        self.held: Counter = Counter()
        self.tags: dict[int, int] = {}
        self.next_tag = itertools.count(1)

    def words(self, r: int, i: int) -> torch.Tensor:
        return self.res[r].view(torch.int32, (TAG_WORDS,), offset=i * self.page, check=True)

    def tag(self, r: int, i: int) -> None:
        self.tags[self.res[r].page_at(i)] = value = next(self.next_tag)
        self.words(r, i).fill_(value)

    @rule()
    def alloc(self):
        try:
            page = self.pool.alloc()
        except vmm.PoolExhausted:
            assert self.pool.num_free == 0
            return
        self.held[page] += 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def drop_hold(self, data):
        page = data.draw(st.sampled_from(sorted(self.held)))
        self.pool.drop(page)
        self.held[page] -= 1
        self.held += Counter()

    @precondition(lambda self: self.held)
    @rule(data=st.data(), r=slot, i=index)
    def map_held(self, data, r, i):
        page = data.draw(st.sampled_from(sorted(self.held)))
        if self.res[r].page_at(i) is not None:
            try:
                self.res[r].map(i, page)
                raise AssertionError("mapping over a mapped index must fail")
            except vmm.AlreadyMapped:
                return
        self.res[r].map(i, page)
        self.words(r, i).fill_(self.tags.setdefault(page, next(self.next_tag)))

    @rule(r=slot, i=index, n=st.integers(1, 3))
    def map_new(self, r, i, n):
        free_before = self.pool.num_free
        try:
            self.res[r].map_new(i, n)
        except (vmm.AlreadyMapped, vmm.OutOfRange, vmm.PoolExhausted):
            assert self.pool.num_free == free_before
            return
        for k in range(i, i + n):
            self.tag(r, k)

    @rule(src=slot, i=index, dst=slot, j=index)
    def share(self, src, i, dst, j):
        try:
            self.res[dst].share(self.res[src], i, j)
        except (vmm.NotMapped, vmm.AlreadyMapped):
            return

    @rule(r=slot, i=index)
    def copy_on_write(self, r, i):
        old = self.res[r].page_at(i)
        try:
            new = self.res[r].copy_on_write(i)
        except (vmm.NotMapped, vmm.PoolExhausted):
            return
        if new != old:
            assert self.words(r, i)[0].item() == self.tags[old]
            self.tag(r, i)  # the private copy diverges; the invariant checks the other sharers

    @rule(r=slot, i=index)
    def unmap(self, r, i):
        try:
            self.res[r].unmap(i)
        except vmm.NotMapped:
            pass

    @rule(r=slot)
    def release(self, r):
        self.res[r].release()
        self.res[r] = vmm.Reservation(self.pool, SPAN * self.page)

    @invariant()
    def accounting_and_bytes_hold(self):
        self.pool.audit(self.res, self.held)
        stats = self.pool.stats()
        assert stats.free + stats.in_use == PAGES
        for r, res in enumerate(self.res):
            for i, page in res.mapped_pages().items():
                assert torch.all(self.words(r, i) == self.tags[page]), (r, i, page)

    def teardown(self):
        for res in self.res:
            res.release()
        for page, count in self.held.items():
            for _ in range(count):
                self.pool.drop(page)
        self.pool.audit([])
        assert self.pool.stats().free == PAGES
        self.pool.close()
        self.backend.close()


TestPageMachine = PageMachine.TestCase
TestPageMachine.settings = settings(max_examples=500, stateful_step_count=30, deadline=None)


class CudaPageMachine(PageMachine):
    """The same operations on vkv's CUDA backend (the driver emulator where there is no GPU)."""

    def make_backend(self) -> vmm.Backend:
        return make_cuda_backend()


TestCudaPageMachine = pytest.mark.cuda_emulated(pytest.mark.skipif(
    cuda_unavailable() is not None, reason=f"no CUDA backend: {cuda_unavailable()}")(CudaPageMachine.TestCase))
TestCudaPageMachine.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                        suppress_health_check=list(HealthCheck))
