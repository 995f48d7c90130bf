"""What one rank holds: its shard of the weights, its attention backend and its KV cache.

LLMEngine builds rank 0 (the only rank without tensor parallelism); engine/worker/parallel.py builds
ranks 1..N-1 in their own processes by the same function, so every rank's KV cache has the same
geometry (rows of 1/N of the bytes, the same page size and page count).
"""
from __future__ import annotations

import dataclasses

import torch

import ext
import vmm
from engine.worker.attention import AttentionBackend, pick_attention
from engine.config import EngineConfig
from engine.kv.build import make_kv_cache
from engine.kv.manager import KVManager
from engine.kv.memory import KVMemory
from engine.worker.cuda_graphs import why_eager
from engine.worker.model_runner import activation_peak
from engine.models import load_config, load_model
from engine.models.config import ModelConfig


@dataclasses.dataclass
class Rank:
    model_config: ModelConfig  # the whole model's shape
    max_model_len: int
    model: object
    attention: AttentionBackend
    kv: KVManager
    memory: KVMemory  # the engine's side of the same cache: sleep, wake up, new weights

    def platform(self, c: EngineConfig) -> dict[str, str]:
        """Which paths run on this machine, and why: arithmetic, GEMMs, attention, kernel ISA."""
        compute, why = c.arithmetic()
        isa, isa_why = ext.kernel_isa()
        return {"compute_dtype": str(compute).removeprefix("torch."), "compute_reason": why,
                "kv_dtype": str(c.kv_dtype).removeprefix("torch."), "gemm": self.model.gemm_path,
                "attention": self.attention.name,
                "kernel_isa": f"{isa} ({isa_why})" if self.model.native else f"none ({ext.cpu_kernels_error()})",
                "panel_prefetch": torch.ops.vkv.ahead_hint() if self.model.native else "none"}


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """N must divide the query heads, the KV heads and the MLP width (KV heads are not replicated)."""
    for name, value in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor_parallel_size {world} must divide the model's {name} ({value})")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank's KV cache holds: 1/N of the heads."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world)


def build_rank(c: EngineConfig, rank: int = 0, model=None, pool: vmm.PoolShare | None = None) -> Rank:
    """Rank `rank`'s weights (or `model`, already loaded), attention and KV cache (over `pool`,
    a share of a pool several models draw from, when given). On a GPU without a set
    kv_cache_memory, the pool is sized after a profile run of a worst-case step."""
    mc, tp = load_config(c.model), c.tensor_parallel_size  # (LLMEngine checked that tp divides the model)
    max_model_len = c.resolve_max_model_len(mc.max_position_embeddings)
    if model is None:
        model = load_model(c.model, mc, c.device, c.dtype, c.seed, (rank, tp), c.compute_dtype,
                           sleep_mode=c.enable_sleep_mode, greedy_pick=c.num_scheduler_steps > 1,
                           quantization="gguf" if c.gguf_blocks else None)
    attention = pick_attention(c.attention_backend, c.device, c.compute_dtype, c.kv_layout, mc.head_dim,
                               c.block_size, mc.sliding_window, c.kv_dtype)
    peak = 0
    if c.device.type == "cuda" and c.kv_cache_memory is None:
        peak = activation_peak(model, c.max_num_batched_tokens, c.max_num_seqs, c.device)
        if why_eager(c.device, c.enforce_eager, attention.name, tp, c.enable_sleep_mode) is None:
            peak += activation_peak(model, c.max_num_seqs, c.max_num_seqs, c.device)  # the graphs' pool
    kv = make_kv_cache(c, shard_config(mc, tp), c.kv_budget_bytes(peak) // tp, max_model_len,
                       attention.tile_rows(attention.target), pool, mc.sliding_window, model.fingerprint)
    return Rank(mc, max_model_len, model, attention, kv, KVMemory(kv))
