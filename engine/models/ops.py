"""The model step's small fused operations: the native kernels (ext) on the CPU where they
build, else torch references that compute what Hugging Face's modules compute, step by step.

    add_rms_norm   residual += x; x = rmsnorm(residual) * weight (no residual: the first layer)
    silu_and_mul   silu(gate) * up over a fused [gate | up] projection
    rope           rotary embedding with a precomputed [positions, D] table (cos | sin)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ext


def native(device: torch.device):
    """torch.ops.vkv on the CPU when the kernels load, else None."""
    return ext.cpu_kernels() if device.type == "cpu" else None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 use_native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x) * weight, residual + x); without a residual, x is the residual."""
    if use_native:
        if residual is None:
            residual = x.clone()
            torch.ops.vkv.add_rms_norm(x, None, weight, eps)
        else:
            torch.ops.vkv.add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = x if residual is None else residual + x
    return rms_norm_reference(residual, weight, eps), residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor, use_native: bool) -> torch.Tensor:
    if use_native:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
        torch.ops.vkv.silu_and_mul(gate_up, out)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_table(inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[positions, D]: cos of each position's D/2 angles, then their sin, in the activation dtype
    (angles in fp32, as Hugging Face computes them)."""
    angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq.to(device)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def rope_reference(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, D]; cos_sin: the table's rows for those tokens. x * cos + rotate_half(x)
    * sin in x's dtype, as Hugging Face's apply_rotary_pos_emb."""
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
