"""Building an engine's KV cache from its config: the layout, the page source, the tiers, the
namespace pages are named in, and the KV manager over them, whole."""
from __future__ import annotations

import logging

import torch

import vmm
from engine.config import DEFAULT_HOST_PAGE, EngineConfig
from engine.kv.events import KVEventLog
from engine.kv.manager import KVManager
from engine.kv.paged import PagedLayout
from engine.kv.tiers import KVTiers, make_tiers, namespace_of
from engine.kv.virtual import VirtualLayout
from engine.models.config import ModelConfig

log = logging.getLogger("vkv.kv")


def backend_for(c: EngineConfig, shareable: bool = False) -> vmm.Backend:
    """Where a virtual KV cache's physical pages come from (vmm.make_backend): the GPU's VMM, or
    the host's memfd in the engine's default page size. shareable: CUDA pages a pool owner
    exports to other processes (host pages always can be)."""
    if c.device.type == "cuda":
        return vmm.make_backend("cuda", c.page_size, c.device.index or 0, shareable)
    return vmm.make_backend("host", c.page_size or DEFAULT_HOST_PAGE)


def make_kv_cache(c: EngineConfig, cfg: ModelConfig, budget: int, max_model_len: int, tile_rows: int,
                  pool: vmm.PoolShare | None = None, window: int | None = None, weights: bytes = b"") -> KVManager:
    """One rank's KV manager over its layout: cfg holds its share of the KV heads, budget its
    bytes (or pool, a share of a pool several models draw from). tile_rows: what the attention
    kernel loads past a sequence's end (engine/worker/attention.py); window: the model's sliding
    window; weights: the loaded weights' fingerprint (`model.fingerprint`), which pages shared
    with other processes or kept on disk are named under."""
    layout = make_layout(c, cfg, budget, max_model_len, tile_rows, pool)
    events = KVEventLog()
    if c.kv_events_config is not None and c.kv_events_config.publishes:
        events.start(layout.page_end(0))  # before the tiers: a disk tier's files are announced
    namespace, tiers = b"", None
    try:
        if c.offloading:
            namespace, tiers = make_tiers_for(layout, c, events, weights)
        if c.kv_pool is not None:
            namespace = shared_namespace(layout, c, weights)
        return KVManager(layout, c.enable_prefix_caching, namespace=namespace, window=window, tiers=tiers,
                         events=events)
    except BaseException:
        layout.close()
        raise


def make_layout(c: EngineConfig, cfg: ModelConfig, budget: int, max_model_len: int, tile_rows: int,
                pool: vmm.PoolShare | None) -> VirtualLayout | PagedLayout:
    if c.kv_layout == "paged":
        itemsize = torch.empty((), dtype=c.kv_dtype).element_size()
        block_bytes = c.block_size * cfg.kv_bytes_per_token(itemsize)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {budget} is below one block ({block_bytes} bytes)")
        return PagedLayout(cfg, c.block_size, num_blocks, c.kv_dtype, c.device)
    if c.kv_pool is not None:  # a pool several engine processes draw from (vmm/owner.py)
        pool = vmm.AttachedPool(c.kv_pool, backend_for(c) if c.device.type == "cuda" else None)
        ignored = [name for name in ("kv_cache_memory", "page_size") if getattr(c, name) is not None]
        if ignored:  # said, not silently dropped: the owner's pool decides both
            log.warning("vkv: %s ignored over kv_pool: the pool's owner has %d pages of %d bytes",
                        " and ".join(ignored), pool.num_pages, pool.page_size)
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
    return VirtualLayout(cfg, c.kv_layout, c.max_num_seqs * (2 if swap else 1), max_model_len, c.kv_dtype,
                         backend, num_pages, tile_rows, swap, pool)


def shared_namespace(layout: VirtualLayout, c: EngineConfig, weights: bytes) -> bytes:
    """Over a pool several processes share, pages are named in a namespace of the weights and
    the KV geometry, so no process maps another model's or layout's pages for a prefix."""
    return namespace_of(weights, dtypes(c) | layout.geometry())


def dtypes(c: EngineConfig) -> dict:
    """The dtypes KV depends on besides the cache's own: bf16 weights computed in fp32 (a CPU
    without native bf16) give other KV than fp32 weights do."""
    return {"compute_dtype": str(c.compute_dtype), "weights_dtype": str(c.dtype)}


def make_tiers_for(layout: VirtualLayout | PagedLayout, c: EngineConfig, events: KVEventLog,
                   weights: bytes) -> tuple[bytes, KVTiers]:
    """The KV tiers below the pool, and the namespace pages are named in: one of the weights and
    the KV geometry, so a disk tier never hands an engine another model's or layout's bytes."""
    geometry = layout.geometry()
    describe = {"model": c.model or "bundled", **dtypes(c), **geometry}
    weights = weights if c.kv_offloading_path else b""
    namespace = namespace_of(weights, {k: v for k, v in describe.items() if k != "model"})
    tiers = make_tiers(c.device, layout.entry_bytes, int(c.kv_offloading_size * (1 << 30)),
                       c.kv_offloading_path, int(c.kv_offloading_path_size * (1 << 30)), namespace, describe, events)
    return namespace, tiers
