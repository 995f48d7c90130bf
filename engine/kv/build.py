"""Building an engine's KV cache from its config: the layout, the page source, the tiers."""
from __future__ import annotations

import torch

import vmm
from engine.config import DEFAULT_HOST_PAGE, EngineConfig
from engine.kv.paged import PagedKVCache
from engine.kv.tiers import make_tiers, namespace_of
from engine.kv.virtual import VirtualKVCache
from engine.models import weights_fingerprint
from engine.models.config import ModelConfig


def backend_for(c: EngineConfig, shareable: bool = False) -> vmm.Backend:
    """Where a virtual KV cache's physical pages come from (vmm.make_backend): the GPU's VMM, or
    the host's memfd in the engine's default page size. shareable: CUDA pages a pool owner
    exports to other processes (host pages always can be)."""
    if c.device.type == "cuda":
        return vmm.make_backend("cuda", c.page_size, c.device.index or 0, shareable)
    return vmm.make_backend("host", c.page_size or DEFAULT_HOST_PAGE)


def make_kv_cache(c: EngineConfig, cfg: ModelConfig, budget: int, max_model_len: int, tile_rows: int,
                  pool: vmm.PoolShare | None = None) -> VirtualKVCache | PagedKVCache:
    """One rank's KV cache: cfg holds its share of the KV heads, budget its bytes (or pool, a
    share of a pool several models draw from). tile_rows: what the attention kernel loads
    past a sequence's end (engine/attention.py)."""
    if c.kv_layout == "paged":
        itemsize = torch.empty((), dtype=c.kv_dtype).element_size()
        block_bytes = c.block_size * cfg.kv_bytes_per_token(itemsize)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {budget} is below one block ({block_bytes} bytes)")
        return PagedKVCache(cfg, c.block_size, num_blocks, c.kv_dtype, c.device, c.enable_prefix_caching)
    if c.kv_pool is not None:  # a pool several engine processes draw from (vmm/owner.py)
        pool = vmm.AttachedPool(c.kv_pool, backend_for(c) if c.device.type == "cuda" else None)
    if pool is not None:
        backend, num_pages = pool.backend, pool.num_pages
    else:
        backend = backend_for(c)
        num_pages = budget // backend.page_size
        if num_pages < 1:
            backend.close()
            raise ValueError(f"kv_cache_memory {budget} is below one page ({backend.page_size} bytes)")
    swap = None
    if c.preemption_mode == "swap":  # swapped sequences keep their slots: twice the slots
        swap = vmm.SwapSpace(backend, int(c.swap_space * (1 << 30)), c.swap_path)
    return VirtualKVCache(cfg, c.kv_layout, c.max_num_seqs * (2 if swap else 1), max_model_len, c.kv_dtype,
                          backend, num_pages, c.enable_prefix_caching, tile_rows, swap, pool)


def shared_names(kv: VirtualKVCache, c: EngineConfig) -> None:
    """Over a pool several processes share, pages are named in a namespace of the weights and
    the KV geometry, so no process maps another model's or layout's pages for a prefix."""
    geometry = {"compute_dtype": str(c.compute_dtype), **kv.geometry()}
    kv.name_pages_in(namespace_of(weights_fingerprint(c.model, c.seed), geometry))


def attach_tiers(kv: VirtualKVCache | PagedKVCache, c: EngineConfig) -> None:
    """The KV tiers below the pool. Pages are named in a namespace of the weights and the KV
    geometry, so a disk tier never hands an engine another model's or layout's bytes."""
    geometry = kv.geometry()
    describe = {"model": c.model or "bundled", "compute_dtype": str(c.compute_dtype), **geometry}
    weights = weights_fingerprint(c.model, c.seed) if c.kv_offloading_path else b""
    namespace = namespace_of(weights, {k: v for k, v in describe.items() if k != "model"})
    tiers = make_tiers(c.device, kv.entry_bytes, int(c.kv_offloading_size * (1 << 30)),
                       c.kv_offloading_path, int(c.kv_offloading_path_size * (1 << 30)), namespace, describe,
                       kv.events)
    kv.attach_tiers(tiers, namespace)
