"""Mapping ahead on a worker thread (vAttention's eager mapping).

Rationale: mapping a page costs microseconds (a 2 MiB CUDA page: tens), and a step of many
decoding sequences maps a page for each that crosses a page boundary, all on the critical path.

Approach: once a step is scheduled, a worker thread maps the pages each of its sequences
will write in the next `tokens` tokens, while the main thread runs the forward pass; the
next step's `ensure_mapped` finds them mapped. The engine waits for the worker before it
touches the KV cache again, so the worker and the scheduler never run at once: the forward
pass reads only pages mapped before it began, and the worker maps only unmapped addresses.

Costs and limits: pages mapped ahead are taken from the free pool only (never by reclaiming
or preempting), and only while `keep_free` pages stay free, so mapping ahead never causes a
preemption; a sequence that ends early leaves them mapped in its idle slot for the next one.
Copy-on-write still happens on the critical path, when the shared page is written. Waiting
for a worker slower than the forward pass puts the difference back on the critical path:
`wait_seconds` counts it (exposed), `seconds - wait_seconds` is what was hidden.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from engine.kv.manager import KVManager
from engine.sched.step import Scheduled


class MapAhead:
    def __init__(self, kv: KVManager, tokens: int, keep_free: int):
        self.kv, self.tokens, self.keep_free = kv, tokens, keep_free
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="vkv-map-ahead")
        self.pending: Future | None = None
        self.seconds = 0.0  # the worker's time spent mapping
        self.wait_seconds = 0.0  # the main thread's time spent waiting for it

    def start(self, scheduled: Scheduled) -> None:
        """Map, in the background, what each scheduled sequence writes after this step."""
        plan = [(seq, seq.num_computed_tokens + n) for seq, n in scheduled]
        self.pending = self.worker.submit(self._map, plan)

    def wait(self) -> None:
        """Block until the worker is done (its exceptions surface here)."""
        if self.pending is None:
            return
        start = time.perf_counter()
        pending, self.pending = self.pending, None
        self.seconds += pending.result()
        self.wait_seconds += time.perf_counter() - start

    def _map(self, plan: list) -> float:
        start = time.perf_counter()
        for seq, end in plan:
            if self.kv.capacity.free_now <= self.keep_free:
                break
            limit = seq.num_prompt_tokens + seq.params.max_tokens  # it never grows past this
            self.kv.map_ahead(seq, end, min(end + self.tokens, limit), self.keep_free)
        return time.perf_counter() - start

    def close(self) -> None:
        self.wait()
        self.worker.shutdown()
