"""What the engine reports about itself: typed snapshots, taken between steps."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class TierStats:
    """One KV tier below the pool (engine/kv/tiers.py)."""
    tier: str  # host | disk
    capacity_bytes: int
    used_bytes: int
    entries: int
    bytes_written: int
    bytes_read: int
    entries_restored: int
    tokens_restored: int = 0  # filled in by the KV cache, which knows the tokens of a page
    dropped: int = 0  # entries let go for room (LRU), or disk writes dropped when it fell behind
    errors: int = 0  # OS errors and files found missing, truncated or corrupt: dropped and recomputed
    errors_by: tuple[tuple[tuple[str, str], int], ...] = ()  # ((operation, errno name), count) of the OS errors
    off: bool = False  # turned itself off after errors in a row (the engine goes on without it)


@dataclass(frozen=True, slots=True)
class KVStats:
    """The KV cache's pages, sharing and mapping cost. Pages count over all regions."""
    layout: str
    page_size: int  # bytes
    pages_total: int
    pages_free: int
    pages_in_use: int  # mapped for unfinished sequences
    pages_idle: int  # still mapped in the slots of finished sequences (deferred reclamation)
    pages_cached: int  # held by the prefix cache alone
    pages_shared: int  # referenced more than once
    peak_pages_mapped: int
    map_seconds: float  # time spent mapping and copying pages on the critical path
    cow_copies: int
    swap_outs: int  # sequences preempted by swapping
    swap_ins: int  # of which brought back
    swap_bytes_out: int
    swap_bytes_in: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    evictions: int  # prefix-cache entries dropped for memory
    asleep: bool = False  # sleep mode: every physical page released (none in use, none free)
    tiers: tuple[TierStats, ...] = ()  # the KV tiers below the pool, fastest first (engine/kv/tiers.py)
    tier_restore_seconds: float = 0.0  # admitting: looking up and copying entries back from the tiers
    tier_offload_seconds: float = 0.0  # evicting: copying entries into the tiers (disk: into its queue)
    prefix_cache_imported: int = 0  # pages mapped from a pool shared across processes, computed by another
    prefix_cache_partial_hits: int = 0  # of the hits, tokens found in the first rows of a cached page (copied)
    prefix_cache_partial_bytes: int = 0  # the bytes those copies moved (a page of each region per copy)


@dataclass(slots=True)
class Counters:
    """An engine's totals since it started; the engine loop is their one writer."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    spec_drafts: int = 0  # speculative proposals verified (one per sequence and step)
    spec_draft_tokens: int = 0  # tokens they proposed
    spec_accepted_tokens: int = 0  # of which the model kept
    multi_step_calls: int = 0  # steps that ran several greedy decode steps in one call (num_scheduler_steps)
    multi_step_decode_steps: int = 0  # the decode steps those calls ran

    def count_step(self, drafts: int, drafted: int, accepted: int, decode_steps: int, new_tokens: int,
                   outputs) -> None:
        """One step: its verified drafts, its decode steps in one call (1: a step as usual), the
        tokens it appended, and the requests it ended."""
        self.spec_drafts += drafts
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        if decode_steps > 1:
            self.multi_step_calls += 1
            self.multi_step_decode_steps += decode_steps
        self.generation_tokens += new_tokens
        for o in outputs:
            if o.finished:
                self.requests_failed += bool(o.error)
                self.requests_finished += not o.error

    def totals(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv: KVStats
    attention_backend: str
    platform: dict  # which paths run here and why (LLMEngine.platform): compute/KV dtype, GEMM, kernel ISA
    num_running: int
    num_waiting: int
    preemptions: int
    kv_utilization: float  # bytes of computed tokens / bytes mapped
    prompt_tokens: int
    generation_tokens: int
    requests_finished: int
    requests_failed: int
    spec_drafts: int = 0  # speculative proposals verified (one per sequence and step)
    spec_draft_tokens: int = 0  # tokens they proposed
    spec_accepted_tokens: int = 0  # of which the model kept
    multi_step_calls: int = 0  # steps that ran several greedy decode steps in one call (num_scheduler_steps)
    multi_step_decode_steps: int = 0  # the decode steps those calls ran
    map_ahead_seconds: float = 0.0  # the map-ahead worker's mapping time
    map_ahead_wait_seconds: float = 0.0  # steps' time spent waiting for it (exposed)
    running_loras: tuple[str, ...] = ()  # adapters of the running sequences
    waiting_loras: tuple[str, ...] = ()  # adapters of the waiting ones
    max_loras: int = 0  # adapters a step may run (0: LoRA off)

    @property
    def map_exposed_seconds(self) -> float:
        """Mapping time on the critical path: in the scheduler, plus waits for the worker."""
        return self.kv.map_seconds + self.map_ahead_wait_seconds

    @property
    def map_hidden_seconds(self) -> float:
        """Mapping time the worker spent while the forward pass ran."""
        return max(0.0, self.map_ahead_seconds - self.map_ahead_wait_seconds)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verified proposal: the kept drafts plus the model's own token."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0
