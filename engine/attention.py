"""Stock attention kernels, and the choice between them.

  sdpa   torch's scaled_dot_product_attention, one call per sequence (CPU, and anywhere)
  flash  PyTorch's built-in FlashAttention-2, one varlen call for the whole batch (CUDA, fp16/bf16)

KV caches (engine/kv) decide what K and V each sequence's call sees: the virtual caches pass
views of the sequence's own slot, read in place; the block-table cache gathers its blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor:
    """Query i sits at position ctx_len - q_len + i and sees keys up to there."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    return torch.arange(ctx_len, device=device)[None, :] <= q_pos


def sdpa_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [q_len, heads, D]; k, v: [ctx_len, kv_heads, D], any strides. The query heads that
    share a KV head become extra query rows of it ([kv_heads, q_len * group, D]), so K and V
    are read as they lie, never expanded."""
    q_len, num_heads, dim = q.shape
    ctx_len, kv_heads = k.shape[0], k.shape[1]
    group = num_heads // kv_heads
    qs = q.view(q_len, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, q_len * group, dim)
    mask = None
    if q_len > 1:
        mask = causal_mask(q_len, ctx_len, q.device).repeat_interleave(group, dim=0)
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


def pick_attention(name: str | None, device: torch.device, dtype: torch.dtype, kv_layout: str) -> str:
    """The user's choice, checked; else the best kernel present for this device, dtype and
    layout. The block-table layout gathers its blocks for sdpa (no paged kernel wired yet)."""
    flash_ok = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and kv_layout != "paged"
    if name is None:
        return "flash" if flash_ok else "sdpa"
    if name == "flash" and not flash_ok:
        raise ValueError("attention 'flash' needs a CUDA device, fp16/bf16 and a virtual kv_layout")
    return name
