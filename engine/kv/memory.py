"""The engine's side of its KV cache: memory given away and back, and prefixes forgotten.

The KV manager (engine/kv/manager.py) serves the scheduler, sequence by sequence. These are the
engine's, for the cache as a whole, and only while no sequence holds KV (the engine finishes or
refuses requests first): vLLM's sleep mode (`sleep` gives every physical page back while the
places kernels read stay the same objects; `wake_up` maps them again) and new weights
(`forget_prefixes`: nothing computed under the old weights is found again). Who writes what:
these write the layout's mappings and the prefix cache as the manager's verbs do, never at the
same time (both run on the engine's thread).
"""
from __future__ import annotations

from engine.kv.manager import KVManager


class KVMemory:
    def __init__(self, kv: KVManager):
        self.kv = kv

    @property
    def busy(self) -> int:
        """Sequences holding a place (running or swapped out)."""
        return len(self.kv.handles)

    def _idle(self) -> None:
        if self.kv.handles:
            raise RuntimeError(f"{len(self.kv.handles)} sequences still hold KV")

    def sleep(self) -> None:
        """Give every physical page back (the prefix cache is emptied, to the tiers if any: they
        come back after wake_up); the places kernels read (`k_caches`, `v_caches`) stay."""
        self._idle()
        if self.kv.prefix_cache:
            self.kv.prefix_cache.clear()
        self.kv.layout.unmap_all()

    def wake_up(self) -> None:
        self.kv.layout.wake_up()

    @property
    def asleep(self) -> bool:
        return self.kv.layout.asleep

    def forget_prefixes(self, namespace: bytes) -> None:
        """New weights: every cached entry goes (not to the tiers: its KV is the old weights')
        and pages are named in `namespace` from now on, so nothing computed before is found
        again, here, in a tier or in a pool other processes share."""
        self._idle()
        if self.kv.prefix_cache:
            self.kv.prefix_cache.clear(offload=False)
        self.kv.lookup.namespace = namespace
