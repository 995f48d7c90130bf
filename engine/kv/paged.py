"""The block-table layout (engine/kv/layout.py): the PagedAttention baseline, in the same engine.

Per layer, K and V are pools of blocks [num_blocks, block_size, kv_heads, head_dim]. A sequence
owns a block table (page k of the sequence is `seq.kv.table[k]`) and takes one more block
every `block_size` tokens. Block ids and their reference counts live in a
`vmm.PageAllocator`, the bookkeeping the virtual layouts use, and prefix caching, forks and
copy-on-write come from the same KV manager (engine/kv/manager.py), so the two differ only in
where K/V live. The
native CPU kernel reads blocks through the table, as it reads virtual slots; the sdpa
reference gathers them first.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

import vmm
from engine.kv.layout import KVHandle, KVLayout
from engine.models.config import ModelConfig
from engine.request.sequence import Sequence


GONE = -1  # a table entry before the sliding window: its block went back to the pool


@dataclass(eq=False)
class BlockTable(KVHandle):
    """A sequence's block table: page k is block `table[k]`."""
    table: list[int] = field(default_factory=list)

    @property
    def place(self) -> tuple[int, ...]:
        return tuple(self.table)


class PagedLayout(KVLayout):
    name = "paged"

    def __init__(self, cfg: ModelConfig, block_size: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device):
        H, D = cfg.num_kv_heads, cfg.head_dim
        self.block_size = block_size
        self._token_bytes = cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
        self.pool = vmm.PageAllocator(num_blocks, block_size * self._token_bytes)
        shape = (num_blocks, block_size, H, D)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]

    @property
    def page_size(self) -> int:
        """One block, all layers, K and V."""
        return self.pool.page_size

    @property
    def token_bytes(self) -> int:
        return self._token_bytes

    # -- geometry -------------------------------------------------------------------------
    def page_end(self, k: int) -> int:
        return (k + 1) * self.block_size

    def tokens_in_pages(self, m: int) -> int:
        return m * self.block_size

    def page_range(self, start: int, end: int) -> range:
        return range(start // self.block_size, math.ceil(end / self.block_size))

    # -- sleep ----------------------------------------------------------------------------
    def unmap_all(self) -> None:
        """The block pools' storage shrinks to nothing; the tensors stay the same objects."""
        for cache in (*self.k_caches, *self.v_caches):
            cache.untyped_storage().resize_(0)

    def wake_up(self) -> None:
        for cache in (*self.k_caches, *self.v_caches):
            if cache.untyped_storage().nbytes() == 0:
                cache.untyped_storage().resize_(cache.numel() * cache.element_size())
                cache.zero_()

    @property
    def asleep(self) -> bool:
        return self.k_caches[0].untyped_storage().nbytes() == 0

    def pages_at(self, seq: Sequence, k: int) -> tuple[int, ...] | None:
        table = seq.kv.table
        return (table[k],) if k < len(table) and table[k] != GONE else None

    @contextlib.contextmanager
    def entry_views(self, pages: tuple[int, ...]) -> Iterator[list[torch.Tensor]]:
        yield self._block_views(pages[0])

    def page_views(self, seq: Sequence, k: int) -> list[torch.Tensor]:
        return self._block_views(seq.kv.table[k])

    def _block_views(self, block: int) -> list[torch.Tensor]:
        """Block `block` of every layer's K, then V, as bytes."""
        return [cache[block].view(-1).view(torch.uint8) for cache in (*self.k_caches, *self.v_caches)]

    def geometry(self) -> dict:
        return {"layout": self.name, "dtype": str(self.k_caches[0].dtype), "block_size": self.block_size,
                "k_cache": list(self.k_caches[0].shape[1:]), "layers": len(self.k_caches)}

    # -- blocks ---------------------------------------------------------------------------
    def can_allocate(self, n: int = 1) -> bool:
        return True

    def place(self, seq: Sequence) -> BlockTable:
        return BlockTable(seq.seq_id)

    def install(self, seq: Sequence, k: int, pages: tuple[int, ...] | None) -> None:
        if pages is not None:
            self.pool.hold(pages[0])
        seq.kv.table.append(GONE if pages is None else pages[0])

    def unmap_page(self, seq: Sequence, k: int) -> None:
        table = seq.kv.table
        self.pool.drop(table[k])
        table[k] = GONE

    def map_fresh(self, seq: Sequence, indices: list[int]) -> None:
        seq.kv.table += self.pool.alloc_many(len(indices))  # indices always extend the table

    def copy_on_write(self, seq: Sequence, k: int) -> None:
        table = seq.kv.table
        old, new = table[k], self.pool.alloc()
        for cache in self.k_caches + self.v_caches:
            cache[new] = cache[old]
        table[k] = new
        self.pool.drop(old)

    def vacate(self, seq: Sequence, keep_pages: bool) -> None:
        """Blocks go straight back: a block table has nothing to gain from keeping them."""
        for block in seq.kv.table:
            if block != GONE:
                self.pool.drop(block)

    # -- checks ---------------------------------------------------------------------------
    def audit(self, handles: set[KVHandle], held: dict[int, int]) -> None:
        expected = Counter(b for h in handles for b in h.table if b != GONE)
        expected.update(held)
        self.pool.check(expected)

    def block_table(self, seqs: list[Sequence], ctx_lens: list[int]) -> tuple[list[list[int]], int]:
        return [[max(b, 0) for b in s.kv.table[:-(-ctx // self.block_size)]]  # GONE: never read
                for s, ctx in zip(seqs, ctx_lens)], self.block_size

    def close(self) -> None:
        self.k_caches.clear()
        self.v_caches.clear()
