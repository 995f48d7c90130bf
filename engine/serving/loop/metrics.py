"""Prometheus metrics, all prefixed `vkv:`.

Latency histograms are observed by the engine thread as tokens come out; everything else is
read from the statistics snapshot the engine thread takes when Prometheus scrapes. A server of
several models over one pool labels every per-model series `model="NAME"`; the pool-wide
gauges (`vkv:pages_total`, `vkv:pages_free`) stay unlabelled and read the shared pool.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
MAP_BUCKETS = (1e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1)

GAUGES = {  # metric: (how to read it from EngineStats, help)
    "vkv:num_requests_running": (lambda s: s.num_running, "Sequences in the running batch."),
    "vkv:num_requests_waiting": (lambda s: s.num_waiting, "Sequences waiting for admission or swapped out."),
    "vkv:kv_cache_usage_ratio": (lambda s: s.kv.pages_in_use / max(s.kv.pages_total, 1),
                                 "Share of KV pages mapped for unfinished sequences."),
    "vkv:kv_utilization_ratio": (lambda s: s.kv_utilization, "Token bytes in use / bytes mapped."),
    "vkv:pages_total": (lambda s: s.kv.pages_total, "Physical KV pages in the pool."),
    "vkv:pages_free": (lambda s: s.kv.pages_free, "Free KV pages."),
    "vkv:pages_in_use": (lambda s: s.kv.pages_in_use, "Pages mapped for unfinished sequences."),
    "vkv:pages_idle": (lambda s: s.kv.pages_idle, "Pages finished sequences keep mapped for reuse."),
    "vkv:pages_cached": (lambda s: s.kv.pages_cached, "Pages held only by the prefix cache."),
    "vkv:pages_shared": (lambda s: s.kv.pages_shared, "Pages referenced more than once."),
    "vkv:peak_pages_mapped": (lambda s: s.kv.peak_pages_mapped, "Most pages referenced at once."),
    "vkv:asleep": (lambda s: int(s.kv.asleep), "1 while the engine sleeps: every physical KV page released."),
}
COUNTERS = {
    "vkv:prefix_cache_queries": (lambda s: s.kv.prefix_cache_queries, "Prompt tokens looked up in the prefix cache."),
    "vkv:prefix_cache_hits": (lambda s: s.kv.prefix_cache_hits, "Prompt tokens found in the prefix cache."),
    "vkv:num_preemptions": (lambda s: s.preemptions, "Sequences preempted for memory."),
    "vkv:cow_copies": (lambda s: s.kv.cow_copies, "Pages copied on write."),
    "vkv:swap_outs": (lambda s: s.kv.swap_outs, "Sequences preempted by swapping their KV out."),
    "vkv:swap_ins": (lambda s: s.kv.swap_ins, "Swapped sequences brought back."),
    "vkv:swap_out_bytes": (lambda s: s.kv.swap_bytes_out, "Bytes copied to the swap tier."),
    "vkv:swap_in_bytes": (lambda s: s.kv.swap_bytes_in, "Bytes copied back from the swap tier."),
    "vkv:prefix_cache_evictions": (lambda s: s.kv.evictions, "Prefix-cache entries evicted."),
    "vkv:prefix_cache_partial_hits": (lambda s: s.kv.prefix_cache_partial_hits,
                                      "Of the hits, prompt tokens found in a cached page's first rows and copied."),
    "vkv:prefix_cache_partial_bytes_copied": (lambda s: s.kv.prefix_cache_partial_bytes,
                                              "Bytes those partial hits copied (a page of each region each)."),
    "vkv:prefix_cache_imported_pages": (lambda s: s.kv.prefix_cache_imported,
                                        "Pages of a prefix another process computed, mapped from the shared pool."),
    "vkv:prompt_tokens": (lambda s: s.prompt_tokens, "Prompt tokens received."),
    "vkv:generation_tokens": (lambda s: s.generation_tokens, "Tokens generated."),
    "vkv:request_success": (lambda s: s.requests_finished, "Requests finished."),
    "vkv:request_failure": (lambda s: s.requests_failed, "Requests that failed inside the engine."),
    "vkv:page_map_seconds": (lambda s: s.kv.map_seconds, "Time spent mapping KV pages in the scheduler."),
    "vkv:page_map_exposed_seconds": (lambda s: s.map_exposed_seconds,
                                     "Mapping time on the critical path (scheduler, waits for the map-ahead worker)."),
    "vkv:page_map_hidden_seconds": (lambda s: s.map_hidden_seconds,
                                    "Mapping time the map-ahead worker hid behind forward passes."),
    "vkv:spec_decode_num_drafts": (lambda s: s.spec_drafts, "Speculative proposals verified."),
    "vkv:spec_decode_num_draft_tokens": (lambda s: s.spec_draft_tokens, "Tokens proposed by speculative decoding."),
    "vkv:spec_decode_num_accepted_tokens": (lambda s: s.spec_accepted_tokens, "Proposed tokens the model kept."),
    "vkv:multi_step_calls": (lambda s: s.multi_step_calls,
                             "Steps that ran several greedy decode steps in one call (num_scheduler_steps)."),
    "vkv:multi_step_decode_steps": (lambda s: s.multi_step_decode_steps, "Decode steps those calls ran."),
    "vkv:kv_tier_restore_seconds": (lambda s: s.kv.tier_restore_seconds,
                                    "Time spent restoring prefix pages from the KV tiers at admission."),
    "vkv:kv_tier_offload_seconds": (lambda s: s.kv.tier_offload_seconds,
                                    "Time spent copying evicted prefix pages into the KV tiers."),
}
TIER_GAUGES = {  # per KV tier, labelled tier="host" | "disk"
    "vkv:kv_tier_capacity_bytes": (lambda t: t.capacity_bytes, "Bytes the KV tier may hold."),
    "vkv:kv_tier_used_bytes": (lambda t: t.used_bytes, "Bytes of entries in the KV tier."),
    "vkv:kv_tier_entries": (lambda t: t.entries, "Prefix-cache entries in the KV tier."),
    "vkv:kv_tier_off": (lambda t: int(t.off), "1 when the KV tier turned itself off after OS errors in a row."),
}
TIER_COUNTERS = {
    "vkv:kv_tier_written_bytes": (lambda t: t.bytes_written, "Bytes written to the KV tier."),
    "vkv:kv_tier_read_bytes": (lambda t: t.bytes_read, "Bytes read back from the KV tier."),
    "vkv:kv_tier_restored_tokens": (lambda t: t.tokens_restored, "Prompt tokens restored from the KV tier instead of computed."),
    "vkv:kv_tier_dropped": (lambda t: t.dropped, "Entries the KV tier let go for room, or writes it dropped when behind."),
}


# The names the Gateway API Inference Extension's model-server protocol reads of vLLM (and routers
# built for vLLM: llm-d, Dynamo, Ray Serve), with vLLM's meaning; labelled model_name="NAME" on a
# server of several models, as vLLM labels its own.
VLLM_GAUGES = {
    "vllm:num_requests_running": (lambda s: s.num_running, "Requests in model execution batches (vLLM's name)."),
    "vllm:num_requests_waiting": (lambda s: s.num_waiting, "Requests waiting to be processed (vLLM's name)."),
    "vllm:kv_cache_usage_perc": (lambda s: s.kv.pages_in_use / max(s.kv.pages_total, 1),
                                 "KV-cache usage, 1 = 100% (vLLM's name): pages mapped for unfinished requests."),
}


POOL_WIDE = {"vkv:pages_total": lambda pool: pool.num_pages, "vkv:pages_free": lambda pool: pool.num_free}


class _Snapshot:
    """The statistics of each model ({None: stats} for a server of one model)."""
    stats: dict[str | None, EngineStats] = {}
    pool = None  # a vmm.SharedPool when several models share one

    def collect(self):
        stats = self.stats
        if not stats:
            return
        labels = ["model"] if None not in stats else []
        for table, family in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for name, (read, doc) in table.items():
                if labels and name in POOL_WIDE:
                    yield family(name, doc, value=POOL_WIDE[name](self.pool.pool))
                    continue
                metric = family(name, doc, labels=labels)
                for model, s in stats.items():
                    metric.add_metric([model] if labels else [], read(s))
                yield metric
        yield from self._vllm(stats)
        errors = CounterMetricFamily("vkv:kv_tier_errors", "OS errors at a KV tier's files, and files found damaged "
                                     "or not regular (each entry dropped and recomputed), by operation and errno.",
                                     labels=labels + ["tier", "op", "errno"])
        for model, s in stats.items():
            for tier in s.kv.tiers:
                for (op, code), n in tier.errors_by:
                    errors.add_metric(([model] if labels else []) + [tier.tier, op, code], n)
        yield errors
        for table, family in ((TIER_GAUGES, GaugeMetricFamily), (TIER_COUNTERS, CounterMetricFamily)):
            for name, (read, doc) in table.items():
                metric = family(name, doc, labels=labels + ["tier"])
                for model, s in stats.items():
                    for tier in s.kv.tiers:
                        metric.add_metric(([model] if labels else []) + [tier.tier], read(tier))
                yield metric


    def _vllm(self, stats: dict[str | None, EngineStats]):
        labels = ["model_name"] if None not in stats else []
        for name, (read, doc) in VLLM_GAUGES.items():
            metric = GaugeMetricFamily(name, doc, labels=labels)
            for model, s in stats.items():
                metric.add_metric([model] if labels else [], read(s))
            yield metric
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters (vLLM's name): "
                                 "the labels say which, the value when they were read.",
                                 labels=labels + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        for model, s in stats.items():
            if s.max_loras:
                info.add_metric(([model] if labels else []) + [str(s.max_loras), ",".join(s.running_loras),
                                                              ",".join(s.waiting_loras)], time.time())
        yield info


class Metrics:
    def __init__(self, models: list[str] | None = None, pool=None):
        """models: the names of a server's several models (their series get a model label),
        pool: the vmm.SharedPool they share; None for a server of one model."""
        self.registry = CollectorRegistry()
        self.labelled = bool(models)
        labels = ["model"] if models else []
        hist = lambda name, doc, buckets: Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
        self.ttft = hist("vkv:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.itl = hist("vkv:inter_token_latency_seconds", "Time between tokens of a request.", LATENCY_BUCKETS)
        self.e2e = hist("vkv:e2e_request_latency_seconds", "Request latency, arrival to finish.", LATENCY_BUCKETS)
        self.map_time = hist("vkv:page_map_seconds_per_step", "Page mapping time on the critical path of one engine step.", MAP_BUCKETS)
        self.wake = hist("vkv:wake_seconds", "Time to wake a model that slept while idle, on its next request.",
                         LATENCY_BUCKETS)
        self.snapshot = _Snapshot()
        self.snapshot.pool = pool
        self.registry.register(self.snapshot)

    def of(self, histogram: Histogram, model: str | None) -> Histogram:
        """The histogram's series for one model (the histogram itself when unlabelled)."""
        return histogram.labels(model) if self.labelled else histogram

    def observe_step(self, map_seconds: float, model: str | None = None) -> None:
        self.of(self.map_time, model).observe(map_seconds)

    def render(self, stats: EngineStats | dict[str, EngineStats]) -> bytes:
        self.snapshot.stats = stats if isinstance(stats, dict) else {None: stats}
        return generate_latest(self.registry)
