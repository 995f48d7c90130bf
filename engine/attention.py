"""Attention kernels, and the choice between them.

Every KV layout hands its caches over in one shape: per layer, K and V as [blocks, rows, heads,
D] (a virtual slot is one block as long as the slot; the block table's blocks are 16 rows),
and per sequence a row of a block table. A kernel reads sequence b's position p at
`cache[table[b, p // rows], p % rows]`, in place.

  native        vkv's CPU kernel (ext/cpu/kernels.cpp): rotary embedding and the K/V store in
                one call, then one attention call per layer for the whole batch
  flash         PyTorch's built-in FlashAttention-2 (CUDA, fp16/bf16, virtual layouts): one
                varlen call, slot offsets in `cum_seq_k`, lengths in `seqused_k`
  flash-attn    the flash-attn package (2.x, built by the user): `flash_attn_with_kvcache`,
                vAttention's own call: k_cache [slots, rows, H, D] with `cache_batch_idx` =
                slots and `cache_seqlens` = lengths; the block table through `block_table`
                (its blocks must be multiples of 256 rows). Decodes in one call, prefill
                chunks left-padded to the longest in a second.
  flash-attn-4  flash-attn-4 (CuTe DSL, Hopper and newer): `flash_attn_varlen_func` with the
                built-in flash's contract (`cu_seqlens_k` = slot offsets, `seqused_k`). It
                loads whole 128-row tiles, so the KV cache maps whole tiles and zeroes new
                pages (`tile_rows`).
  sdpa          the reference: torch's rotary math, an indexed store, and one
                scaled_dot_product_attention call per sequence over its slot (a block table's
                blocks gathered first)
The GPU libraries are imported only when chosen; `library()` is where they are found.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

import ext
from engine.config import ATTENTION_BACKENDS
from engine.kv.batch import StepBatch
from engine.ops import rope_reference

LIBRARIES = {"flash-attn": ("flash_attn", "flash_attn_with_kvcache"),
             "flash-attn-4": ("flash_attn.cute", "flash_attn_varlen_func")}


def fa4_support(head_dim: int, capability: tuple[int, int]) -> tuple[int, str | None]:
    """flash-attn-4's KV tile for this head size on this GPU (the rows its TMA loads whole, so
    rows up to a tile boundary must be mapped and finite), or (0, why it is refused). The rule
    is the library's own (flash_attn/cute/interface.py at fa4-v4.0.0.beta27: `_validate_head_dims`
    and `_tile_size_fwd_sm90` for a causal, non-local call; SM100 runs 128-row tiles, and its
    head size 256 kernel refuses seqused_k, which vkv passes). The tile is not exported by the
    library, so it is reproduced here."""
    major = capability[0]
    if head_dim % 8:
        return 0, f"head_dim {head_dim} is not a multiple of 8"
    if major == 9:
        if not 8 <= head_dim <= 256:
            return 0, f"head_dim {head_dim} is outside 8..256 on Hopper"
        return (128 if head_dim <= 128 else 128 if head_dim <= 192 else 80), None
    if major in (10, 11):
        if not 8 <= head_dim <= 128:
            return 0, f"head_dim {head_dim} is outside 8..128 (the 256 kernel refuses seqused_k) on SM{major}x"
        return 128, None
    return 0, f"compute capability {major}.x is not Hopper or Blackwell"


def tile_rows(kernel: str, head_dim: int, device: torch.device) -> int:
    """Rows a kernel may load past a sequence's length (the KV cache maps and zeroes them)."""
    if kernel != "flash-attn-4":
        return 1
    return fa4_support(head_dim, torch.cuda.get_device_capability(device))[0]


def library(kernel: str):
    """The function a GPU library kernel calls, or None where the package is not installed."""
    module, name = LIBRARIES[kernel]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def pick_attention(name: str | None, device: torch.device, dtype: torch.dtype, kv_layout: str,
                   head_dim: int, block_size: int = 16, sliding_window: int | None = None) -> str:
    """The user's choice, checked; else the best kernel present for this device, dtype, layout
    (a sliding window runs on sdpa alone: the others are not given the window)."""
    gpu = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
    virtual = kv_layout != "paged"
    fa4_why = fa4_support(head_dim, torch.cuda.get_device_capability(device))[1] if device.type == "cuda" else "no GPU"
    reasons = {
        "flash-attn-4": None if gpu and virtual and fa4_why is None and library("flash-attn-4") else
        "needs flash-attn-4 installed, fp16/bf16, a virtual layout and a GPU it supports"
        + (f" ({fa4_why})" if fa4_why else ""),
        "flash-attn": None if gpu and (virtual or block_size % 256 == 0) and library("flash-attn") else
        "needs the flash-attn package, a CUDA GPU, fp16/bf16, and a virtual layout or blocks of 256 rows",
        "flash": None if gpu and virtual else
        "needs a CUDA device, fp16/bf16, a virtual kv_layout and head_dim a multiple of 8 up to 256",
        "native": None if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim % 2 == 0
        and ext.cpu_kernels() is not None else
        f"needs the CPU, fp32 or bf16, an even head_dim and the built kernels ({ext.cpu_kernels_error()})",
        "sdpa": None,
    }
    if sliding_window:
        reasons = {k: why or ("is not given sliding windows yet: use sdpa" if k != "sdpa" else None)
                   for k, why in reasons.items()}
    assert set(reasons) == set(ATTENTION_BACKENDS)
    if name is None:
        return next(kernel for kernel, why in reasons.items() if why is None)
    if reasons[name]:
        raise ValueError(f"attention {name!r} {reasons[name]}")
    return name


class StepAttention:
    """One step's attention, called by every layer: rotate q and k, store k and v at their
    positions, attend over each sequence's cached context."""

    def __init__(self, kernel: str, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 batch: StepBatch, cos_sin: torch.Tensor, paged: bool = False, window: int | None = None):
        self.kernel, self.k_caches, self.v_caches, self.batch = kernel, k_caches, v_caches, batch
        self.window = window  # sliding window: keys before it are read by no query (and may be unmapped)
        self.paged = paged  # a block table of many blocks, not one slot per sequence
        self.cos_sin = cos_sin
        if kernel == "native" and ext.cpu_kernels() is None:
            raise RuntimeError(f"the native attention kernel is unavailable: {ext.cpu_kernels_error()}")
        if kernel != "native":
            self.tables = batch.block_table.tolist()
            self.rows = cos_sin[batch.positions]
            block = batch.block_table[batch.token_seq.long(), batch.positions // batch.block_size]
            self.store_at = (block.long(), batch.positions % batch.block_size)
        if kernel in ("flash", "flash-attn-4"):
            slots = batch.block_table[:, 0]
            rows = k_caches[0].shape[1]
            total = torch.tensor([k_caches[0].shape[0] * rows], dtype=torch.int32, device=slots.device)
            self.slot_starts = torch.cat([slots * rows, total]).to(torch.int32)
        if kernel == "flash-attn":
            self.groups = self._padded_groups()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache, b = self.k_caches[layer], self.v_caches[layer], self.batch
        if self.kernel == "native":
            torch.ops.vkv.rope_store(q, k, v, b.positions, self.cos_sin, k_cache, v_cache, b.block_table,
                                     b.block_size, b.token_seq)
            out = torch.empty_like(q)
            torch.ops.vkv.attention(q, k_cache, v_cache, b.block_table, b.block_size, b.q_start, b.q_len,
                                    b.ctx_len, q.shape[-1] ** -0.5, out)
            return out
        q, k = rope_reference(q, self.rows), rope_reference(k, self.rows)
        k_cache[self.store_at] = k.to(k_cache.dtype)  # a bf16 cache under fp32 activations: rounded here
        v_cache[self.store_at] = v.to(v_cache.dtype)
        if self.kernel == "flash":
            return flash_varlen(q, flatten_slots(k_cache), flatten_slots(v_cache), b.cu_seqlens_q,
                                self.slot_starts, b.max_query_len, b.max_context_len, b.ctx_len)
        if self.kernel == "flash-attn-4":
            out = library("flash-attn-4")(q, flatten_slots(k_cache), flatten_slots(v_cache), cu_seqlens_q=b.cu_seqlens_q,
                                          cu_seqlens_k=self.slot_starts, max_seqlen_q=b.max_query_len,
                                          max_seqlen_k=b.max_context_len, seqused_k=b.ctx_len, causal=True,
                                          num_splits=1)
            return out[0] if isinstance(out, tuple) else out
        if self.kernel == "flash-attn":
            return self._with_kvcache(q, k_cache, v_cache)
        out = torch.empty_like(q)
        for table, start, q_len, ctx in zip(self.tables, b.starts, b.q_lens, b.ctx_lens):
            first = max(0, ctx - q_len - self.window + 1) if self.window else 0  # the first key any query sees
            keys, values = (sequence_rows(c, table, ctx, first).to(q.dtype) for c in (k_cache, v_cache))
            out[start:start + q_len] = sdpa_sequence(q[start:start + q_len], keys, values, self.window, first)
        return out

    def native_args(self, layer: int) -> tuple | None:
        """What the native `decode_layer` needs of this step for `layer` (after the layer's
        weights), or None where this step's attention is not the native kernel's."""
        if self.kernel != "native" or self.window:
            return None
        b, k_cache = self.batch, self.k_caches[layer]
        return (b.positions, self.cos_sin, k_cache, self.v_caches[layer], b.block_table, b.block_size, b.token_seq,
                b.q_start, b.q_len, b.ctx_len, k_cache.shape[-1] ** -0.5)

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

    def _with_kvcache(self, q, k_cache, v_cache) -> torch.Tensor:
        call, out = library("flash-attn"), torch.empty_like(q)
        for count, width, (group, row, token), lengths, table in self.groups:
            padded = q.new_zeros(count, width, *q.shape[1:])
            padded[group, row] = q[token]
            where = {"block_table": table} if self.paged else {"cache_batch_idx": table[:, 0].contiguous()}
            result = call(padded, k_cache, v_cache, cache_seqlens=lengths, causal=True, **where)
            out[token] = result[group, row]
        return out


def sequence_rows(cache: torch.Tensor, table: list[int], ctx: int, first: int = 0) -> torch.Tensor:
    """A sequence's rows [first, ctx): a view of its slot, or its blocks gathered."""
    size = cache.shape[1]
    if -(-ctx // size) == 1:
        return cache[table[0], first:ctx]
    skip = first // size  # blocks wholly before `first` are neither read nor gathered
    return cache[table[skip:-(-ctx // size)]].flatten(0, 1)[first - skip * size:ctx - skip * size]


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
