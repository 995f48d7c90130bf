"""One step of attention, as each kernel family runs it (engine/worker/attention.py chooses the kernel
and prepares its step once a step): every layer calls `step(layer, q, k, v)`, which applies the
rotary embedding, stores K and V in place in the layer's cache ([blocks, rows, heads, D]) and
attends over each sequence's rows.

  NativeStep   vkv's CPU kernels: rope and store in one call, one attention call for the batch
  TorchStep    the reference: torch's rotary math, an indexed store, sdpa per sequence
  FlashStep    FlashAttention's varlen contract over the slots flattened into one key range
  KVCacheStep  flash-attn 2.x's flash_attn_with_kvcache (slots, or the block table)
  FlexStep     FlexAttention over the slots or the block table, through a block mask

A step built from a batch whose sequences all decode one token reads nothing back to the host
(no `.tolist()`, no tensor made from Python values), so it can be built inside a CUDA graph's
capture and replayed (engine/worker/cuda_graphs.py).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.kv.batch import StepBatch
from engine.models.ops import rope_reference

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class NativeStep:
    """vkv's CPU kernels: rotary embedding and the K/V store in one call, then one attention
    call per layer for the whole batch (and, for a few rows, every layer in one call)."""

    def __init__(self, k_caches, v_caches, batch: StepBatch, cos_sin: torch.Tensor, window: int | None):
        no_window(window, "vkv's CPU kernels")
        self.k_caches, self.v_caches, self.batch, self.cos_sin = k_caches, v_caches, batch, cos_sin

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, b = self.k_caches[layer], self.v_caches[layer], self.batch
        torch.ops.vkv.rope_store(q, k, v, b.positions, self.cos_sin, k_cache, v_cache, b.block_table,
                                 b.block_size, b.token_seq)
        out = torch.empty_like(q)
        torch.ops.vkv.attention(q, k_cache, v_cache, b.block_table, b.block_size, b.q_start, b.q_len,
                                b.ctx_len, q.shape[-1] ** -0.5, out)
        return out

    def native_args(self) -> tuple:
        """What the native `decode_layers` needs of this step (after the layers' weights)."""
        b = self.batch  # (decode_layers runs fp32; a bf16 table is widened as it is read)
        return (b.positions, self.cos_sin, self.k_caches, self.v_caches, b.block_table, b.block_size, b.token_seq,
                b.q_start, b.q_len, b.ctx_len, self.k_caches[0].shape[-1] ** -0.5)


class TorchStep:
    """The reference (sdpa), and the base of the GPU libraries' steps: torch's rotary math, an
    indexed store, and one scaled_dot_product_attention call per sequence over its slot (a
    block table's blocks gathered first)."""

    def __init__(self, k_caches, v_caches, batch: StepBatch, cos_sin: torch.Tensor, window: int | None):
        self.k_caches, self.v_caches, self.batch, self.window = k_caches, v_caches, batch, window
        self.rows = cos_sin[batch.positions]
        block = batch.block_table[batch.token_seq.long(), batch.positions // batch.block_size]
        self.store_at = (block.long(), batch.positions % batch.block_size)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        q, k = rope_reference(q, self.rows), rope_reference(k, self.rows)
        k_cache[self.store_at] = narrow(k, k_cache.dtype)  # a narrower cache: rounded here
        v_cache[self.store_at] = narrow(v, v_cache.dtype)
        return self.attend(q, k_cache, v_cache)

    @functools.cached_property
    def tables(self) -> list[list[int]]:
        """The block table on the host (read once a step, by the per-sequence paths only)."""
        return self.batch.block_table.tolist()

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               members: list[int] | None = None) -> torch.Tensor:
        """sdpa per sequence (all of them, or the batch's sequences `members`)."""
        b, out = self.batch, torch.empty_like(q)
        for i in range(len(b.starts)) if members is None else members:
            table, start, q_len, ctx = self.tables[i], b.starts[i], b.q_lens[i], b.ctx_lens[i]
            first = max(0, ctx - q_len - self.window + 1) if self.window else 0  # the first key any query sees
            keys, values = (sequence_rows(c, table, ctx, first).to(q.dtype) for c in (k_cache, v_cache))
            out[start:start + q_len] = sdpa_sequence(q[start:start + q_len], keys, values, self.window, first)
        return out


class FlashStep(TorchStep):
    """FlashAttention's varlen contract (PyTorch's built-in FlashAttention-2, flash-attn-4): the
    slots flattened into one key range, slot offsets in `cu_seqlens_k`, lengths in `seqused_k`."""

    def __init__(self, k_caches, v_caches, batch, cos_sin, window, varlen):
        no_window(window, "FlashAttention's varlen step")
        super().__init__(k_caches, v_caches, batch, cos_sin, window)
        self.varlen = varlen
        slots = batch.block_table[:, 0]
        rows = k_caches[0].shape[1]
        total = slots.new_full((1,), k_caches[0].shape[0] * rows)  # (made on the device: capturable)
        self.slot_starts = torch.cat([slots * rows, total]).to(torch.int32)

    def attend(self, q, k_cache, v_cache):
        b = self.batch
        return self.varlen(q, flatten_slots(k_cache), flatten_slots(v_cache), b.cu_seqlens_q, self.slot_starts,
                           b.max_query_len, b.max_context_len, b.ctx_len)


class KVCacheStep(TorchStep):
    """flash-attn 2.x's `flash_attn_with_kvcache`, vAttention's own call: slots by
    `cache_batch_idx`, or the block table by `block_table`."""

    def __init__(self, k_caches, v_caches, batch, cos_sin, window, call, paged: bool):
        no_window(window, "flash_attn_with_kvcache's step")
        super().__init__(k_caches, v_caches, batch, cos_sin, window)
        self.call, self.paged = call, paged
        self.groups = self._padded_groups()

    def _padded_groups(self) -> list[tuple]:
        """flash_attn_with_kvcache takes q as [batch, q_len, H, D]: decodes go in one call, the
        other sequences in a second with their queries left-padded to the longest (padding
        rows sit before the real ones, so the bottom-right causal alignment holds)."""
        b, groups = self.batch, []
        for members in ([i for i, n in enumerate(b.q_lens) if n == 1], [i for i, n in enumerate(b.q_lens) if n > 1]):
            if not members:
                continue
            width = max(b.q_lens[i] for i in members)
            rows = [(g, width - b.q_lens[i] + j, b.starts[i] + j) for g, i in enumerate(members) for j in range(b.q_lens[i])]
            index = torch.tensor(rows, dtype=torch.long, device=b.positions.device).T
            sel = torch.tensor(members, dtype=torch.long, device=b.positions.device)
            groups.append((len(members), width, index, b.ctx_len[sel], b.block_table[sel]))
        return groups

    def attend(self, q, k_cache, v_cache):
        out = torch.empty_like(q)
        for count, width, (group, row, token), lengths, table in self.groups:
            padded = q.new_zeros(count, width, *q.shape[1:])
            padded[group, row] = q[token]
            where = {"block_table": table} if self.paged else {"cache_batch_idx": table[:, 0].contiguous()}
            result = self.call(padded, k_cache, v_cache, cache_seqlens=lengths, causal=True, **where)
            out[token] = result[group, row]
        return out



class FlexStep(TorchStep):
    """FlexAttention (torch.nn.attention.flex_attention) reading the cache as it lies, slots or
    the block table, through a block mask: the library's own paged path (its PagedAttention
    helper builds the same mask from its page table; this one is built from vkv's table).

    The sequences that decode one token go in one call: q is [sequences, heads, 1, D] and the
    whole layer cache one key range [1, kv_heads, blocks * rows, D] that every sequence shares.
    The mask lists each sequence's KV blocks (`kv_block` rows each: a block of the table, or a
    slot cut in pieces), every one full but the last, so the kernel reads those blocks alone and
    evaluates `mask_mod` in the last only. mask_mod is the whole truth on its own (the kernel
    skips it in full blocks; torch's unfused path applies it everywhere): a key belongs to the
    sequence and lies before its length. Over the block table that needs a block's place in the
    sequence: `logical_of[block]`, one per block (a block shared by several sequences, a
    prefix or a fork, sits at the same place in each). Sequences with several queries (prefill
    chunks) run on sdpa, one by one (TorchStep.attend)."""

    def __init__(self, k_caches, v_caches, batch, cos_sin, window, flex, kv_block: int, paged: bool,
                 options: dict | None = None, static_batch: bool = False):
        no_window(window, "FlexAttention's step")
        super().__init__(k_caches, v_caches, batch, cos_sin, window)
        self.flex, self.kv_block, self.options, self.static_batch = flex, kv_block, options, static_batch
        decoding = [i for i, n in enumerate(batch.q_lens) if n == 1]
        self.prefilling = [i for i, n in enumerate(batch.q_lens) if n > 1]
        self.decode_rows = None  # every sequence decodes: q's rows are the batch's, in order
        table, ctx = batch.block_table, batch.ctx_len
        if self.prefilling and decoding:
            self.decode_rows = torch.tensor([batch.starts[i] for i in decoding], device=table.device)
            which = torch.tensor(decoding, device=table.device)
            table, ctx = table[which], ctx[which]
        self.mask = decode_mask(table, ctx, k_caches[0].shape[0], k_caches[0].shape[1], kv_block, paged) \
            if decoding else None

    def attend(self, q, k_cache, v_cache, members=None):
        if self.mask is None:
            return super().attend(q, k_cache, v_cache)
        out = super().attend(q, k_cache, v_cache, self.prefilling) if self.prefilling else None
        rows = (q if self.decode_rows is None else q[self.decode_rows]).unsqueeze(2)
        if self.static_batch:  # compiled for this batch size: flex's decode kernel, which splits the keys
            torch._dynamo.mark_static(rows, 0)
        keys, values = (flatten_slots(c).unsqueeze(0).transpose(1, 2) for c in (k_cache, v_cache))
        options = {"kernel_options": self.options} if self.options else {}
        result = self.flex(rows, keys, values, block_mask=self.mask, enable_gqa=True, **options)[:, :, 0]
        if out is None:
            return result
        out[self.decode_rows] = result
        return out


def decode_mask(table: torch.Tensor, ctx: torch.Tensor, blocks: int, rows: int, kv_block: int, paged: bool):
    """FlexAttention's BlockMask for sequences decoding one token each over a cache of `blocks`
    blocks of `rows` rows (table [sequences, width] int32, ctx [sequences] int32 lengths),
    seen as one key range cut in pieces of kv_block rows (rows % kv_block == 0). Built on the
    table's device with no read back to the host (capturable)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_seqs, width = table.shape
    per_block = rows // kv_block
    pieces = blocks * per_block  # the mask's width: the kernel checks it covers the key range
    count = (ctx + kv_block - 1) // kv_block  # pieces each sequence reads, >= 1
    step = torch.arange(pieces if not paged else width, device=table.device, dtype=torch.int32)
    if paged:  # a piece is a block of the table
        listed = table
    else:  # a slot's pieces, in order
        listed = table[:, :1] * per_block + step[:per_block]
    full = listed.new_zeros(n_seqs, 1, 1, pieces)
    listed_width = min(listed.shape[1], pieces)  # (a table may be wider than the cache has blocks)
    full[:, 0, 0, :listed_width] = listed[:, :listed_width]
    last = listed.gather(1, (count - 1).long()[:, None])
    partial = listed.new_zeros(n_seqs, 1, 1, pieces)
    partial[:, 0, 0, :1] = last
    ctx = ctx.to(torch.int32)
    if paged:
        columns = step[None, :].expand(n_seqs, width)
        where = torch.where(columns < count[:, None], table.long(), blocks)  # unused columns: a spare entry
        logical_of = table.new_zeros(blocks + 1)
        logical_of[where.flatten()] = columns.flatten()
        tbl = table

        def mask_mod(b, h, q_idx, kv_idx):
            block = kv_idx // rows
            place = logical_of[block]
            return (tbl[b, place] == block) & (place * rows + kv_idx % rows < ctx[b])
    else:
        first = table[:, 0] * rows

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= first[b]) & (kv_idx < first[b] + ctx[b])
    args = dict(BLOCK_SIZE=(128, kv_block), mask_mod=mask_mod, seq_lengths=(1, blocks * rows))
    try:
        return BlockMask.from_kv_blocks(torch.ones_like(count).view(n_seqs, 1, 1), partial,
                                        (count - 1).view(n_seqs, 1, 1), full, compute_q_blocks=False, **args)
    except TypeError:  # a torch without compute_q_blocks (the backward's transpose: unneeded here)
        return BlockMask.from_kv_blocks(torch.ones_like(count).view(n_seqs, 1, 1), partial,
                                        (count - 1).view(n_seqs, 1, 1), full, **args)

def narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: rounded to nearest even, and for fp8 saturated at the
    format's largest finite value (as the native kernel stores it; e5m2 would overflow to inf)."""
    if dtype in FP8:
        top = torch.finfo(dtype).max
        x = x.clamp(-top, top)
    return x.to(dtype)


def sequence_rows(cache: torch.Tensor, table: list[int], ctx: int, first: int = 0) -> torch.Tensor:
    """A sequence's rows [first, ctx): a view of its slot, or its blocks gathered."""
    size = cache.shape[1]
    if -(-ctx // size) == 1:
        return cache[table[0], first:ctx]
    skip = first // size  # blocks wholly before `first` are neither read nor gathered
    return cache[table[skip:-(-ctx // size)]].flatten(0, 1)[first - skip * size:ctx - skip * size]


def no_window(window: int | None, kernel: str) -> None:
    """A kernel that attends to the whole context refuses a window instead of ignoring it
    (pick_attention runs windowed models on sdpa; a test or benchmark may name a kernel)."""
    if window:
        raise ValueError(f"{kernel} attends to the whole context: a sliding window of {window} runs on sdpa")


def causal_mask(q_len: int, ctx_len: int, device, window: int | None = None, first: int = 0) -> torch.Tensor:
    """Query i sits at position ctx_len - q_len + i and sees the keys at positions [first,
    ctx_len) up to its own, and with a window only the last `window` of those."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(first, ctx_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask & (k_pos > q_pos - window) if window else mask


def sdpa_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                  first: int = 0) -> torch.Tensor:
    """q: [q_len, heads, D]; k, v: the keys and values at positions [first, first + len), any
    strides. The query heads that share a KV head become extra query rows of it ([kv_heads,
    q_len * group, D]), so K and V are read as they lie, never expanded."""
    q_len, num_heads, dim = q.shape
    ctx_len, kv_heads = first + k.shape[0], k.shape[1]
    group = num_heads // kv_heads
    qs = q.view(q_len, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, q_len * group, dim)
    mask = None
    if q_len > 1:
        mask = causal_mask(q_len, ctx_len, q.device, window, first).repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(qs, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return o.view(kv_heads, q_len, group, dim).transpose(0, 1).reshape(q_len, num_heads, dim)


def flatten_slots(cache: torch.Tensor) -> torch.Tensor:
    """[slots, rows, H, D] -> [slots * rows, H, D] without copying; slots lie back to back.
    Fails loudly rather than let a kernel copy the (mostly unmapped) reservation."""
    slots, rows, heads, dim = cache.shape
    if cache.stride(0) != rows * cache.stride(1) or cache.stride(-1) != 1:
        raise ValueError(f"KV view strides {cache.stride()} cannot be flattened for FlashAttention")
    return cache.as_strided((slots * rows, heads, dim), cache.stride()[1:], cache.storage_offset())


def flash_varlen(q, k_flat, v_flat, cu_seqlens_q, k_starts, max_q: int, max_k: int, seqused_k):
    """FlashAttention-2 as PyTorch ships it: sequence b's keys are rows k_starts[b] onwards,
    seqused_k[b] of them; causal alignment is bottom-right."""
    return torch.ops.aten._flash_attention_forward(
        q, k_flat, v_flat, cu_seqlens_q, k_starts, max_q, max_k, 0.0, True, False,
        seqused_k=seqused_k)[0]
