"""One step of attention, as each kernel family runs it (engine/worker/attention.py chooses the kernel
and prepares its step once a step): every layer calls `step(layer, q, k, v)`, which applies the
rotary embedding, stores K and V in place in the layer's cache ([blocks, rows, heads, D]) and
attends over each sequence's rows.

  NativeStep   vkv's CPU kernels: rope and store in one call, one attention call for the batch
  TorchStep    the reference: torch's rotary math, an indexed store, sdpa per sequence
  FlashStep    FlashAttention's varlen contract over the slots flattened into one key range
  KVCacheStep  flash-attn 2.x's flash_attn_with_kvcache (slots, or the block table)
"""
from __future__ import annotations

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
        self.tables = batch.block_table.tolist()
        self.rows = cos_sin[batch.positions]
        block = batch.block_table[batch.token_seq.long(), batch.positions // batch.block_size]
        self.store_at = (block.long(), batch.positions % batch.block_size)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        q, k = rope_reference(q, self.rows), rope_reference(k, self.rows)
        k_cache[self.store_at] = narrow(k, k_cache.dtype)  # a narrower cache: rounded here
        v_cache[self.store_at] = narrow(v, v_cache.dtype)
        return self.attend(q, k_cache, v_cache)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        b, out = self.batch, torch.empty_like(q)
        for table, start, q_len, ctx in zip(self.tables, b.starts, b.q_lens, b.ctx_lens):
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
        total = torch.tensor([k_caches[0].shape[0] * rows], dtype=torch.int32, device=slots.device)
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
