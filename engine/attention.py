"""Attention over the virtual KV cache with stock kernels that read it in place.

Each step's sequences are described by `VirtualBatch`. A kernel gets, per layer, K and V as
[slots, rows, kv_heads, head_dim] views of the cache and reads each sequence's first
`context_len` rows of its slot: no gather, no copy.

  sdpa   torch's scaled_dot_product_attention per sequence over its slot (CPU, and anywhere)
  flash  PyTorch's built-in FlashAttention-2, one varlen call for the whole batch: slot
         offsets in `cum_seq_k`, lengths in `seqused_k` (CUDA, fp16/bf16)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("sdpa", "flash")


@dataclass(slots=True)
class VirtualBatch:
    token_slots: torch.Tensor  # [tokens] slot of each scheduled token
    positions: torch.Tensor  # [tokens] its position in its sequence
    seqs: list[tuple[int, int, int, int]]  # per sequence: slot, first token, query len, context len
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32
    slot_starts: torch.Tensor  # [seqs + 1] int32: first row of each slot in the flattened cache
    context_lens: torch.Tensor  # [seqs] int32
    max_query_len: int
    max_context_len: int


def _causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """Query i sits at position ctx_len - q_len + i and sees keys up to there."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos


def sdpa_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: VirtualBatch) -> torch.Tensor:
    out = torch.empty_like(q)
    for slot, start, q_len, ctx_len in batch.seqs:
        qs = q[start:start + q_len].transpose(0, 1)[None]
        ks = k_cache[slot, :ctx_len].transpose(0, 1)[None]
        vs = v_cache[slot, :ctx_len].transpose(0, 1)[None]
        mask = None if q_len == 1 or q_len == ctx_len else _causal_mask(q_len, ctx_len, q.device)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                           is_causal=q_len == ctx_len and q_len > 1, enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)
    return out


def _flatten_slots(cache: torch.Tensor) -> torch.Tensor:
    """[slots, rows, H, D] -> [slots * rows, H, D] without copying; slots are back to back."""
    slots, rows, heads, dim = cache.shape
    if cache.stride(0) != rows * cache.stride(1) or cache.stride(-1) != 1:
        raise ValueError(f"KV view strides {cache.stride()} cannot be flattened for FlashAttention")
    return cache.as_strided((slots * rows, heads, dim), cache.stride()[1:], cache.storage_offset())


def flash_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: VirtualBatch) -> torch.Tensor:
    out = torch.ops.aten._flash_attention_forward(
        q, _flatten_slots(k_cache), _flatten_slots(v_cache), batch.cu_seqlens_q, batch.slot_starts,
        batch.max_query_len, batch.max_context_len, 0.0, True, False, seqused_k=batch.context_lens)[0]
    return out


def pick_attention(name: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The user's choice, checked; else the best kernel present for this device and dtype."""
    flash_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if name is None:
        return "flash" if flash_ok else "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {ATTENTION_BACKENDS}")
    if name == "flash" and not flash_ok:
        raise ValueError("attention 'flash' needs a CUDA device and fp16/bf16")
    return name


KERNELS = {"sdpa": sdpa_attend, "flash": flash_attend}


class VirtualAttention:
    """What the model calls each layer: store new K/V in the slots, attend over the cache."""

    def __init__(self, kv_cache, kernel: str, batch: VirtualBatch):
        self.kv, self.kernel, self.batch = kv_cache, KERNELS[kernel], batch

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        b = self.batch
        self.kv.k_caches[layer][b.token_slots, b.positions] = k
        self.kv.v_caches[layer][b.token_slots, b.positions] = v

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.kernel(q, self.kv.k_caches[layer], self.kv.v_caches[layer], self.batch)
