"""KV events for a pool several engine processes share: its directory, announced by its owner.

Over one physical pool (vmm/owner.py) a page any process computed is cached for every process
on the host: a router choosing among those processes should see one cache, the directory, not
each process's passing view of it (a process lets go of its cached entries as soon as no
sequence of its own maps them, while the pages stay cached for the others). So the directory's
one writer, the owner, is the one that announces it (`PoolOwner(announce=True)`): an entry a
process publishes comes with its description (its parent's name, its tokens, its adapter:
engine/kv/prefix_cache.py sends them when the owner announces), and is announced stored
(medium "GPU", vLLM's word for the engine's own pool) when it enters the directory and removed
when it leaves it (evicted for an alloc, taken whole by a decode replica, or at stop). The
processes over the pool record nothing of their own.

`PoolEvents` takes the owner's log of changes on a thread of its own every `interval` seconds and
hands each batch to the ZMQ publisher (engine/kv/publisher.py: vLLM's `KVEventBatch`, the PUB
and replay sockets), as rank 0 of the config's ports. `vkv pool-owner --kv-events-config JSON`
and `vkv serve -dp N --kv-events-config JSON` run it (the replicas then publish nothing).
"""
from __future__ import annotations

import logging
import threading

import vmm
from engine.config import KVEventsConfig
from engine.kv.events import GPU, KVEventLog
from engine.kv.publisher import ZmqEventPublisher

log = logging.getLogger("vkv.kv_events")


class PoolEvents:
    def __init__(self, owner: vmm.PoolOwner, config: KVEventsConfig, interval: float = 0.1):
        if not owner.announce:
            raise ValueError("the pool's owner does not announce its directory: make it with announce=True")
        self.owner, self.interval = owner, interval
        self.log = KVEventLog()
        self.log.start(0)  # each change says its own block size
        self.publisher = ZmqEventPublisher(config, 0)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vkv-pool-events", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.flush()
            except Exception:  # a bug here must not end every later announcement
                log.exception("vkv: announcing the pool's changes failed; going on with the next")

    def flush(self) -> None:
        """The owner's changes since the last flush, published as one batch (none: nothing sent)."""
        for change in self.owner.take_changes():
            if change[0] == "stored":
                _, name, meta = change
                parent = meta.get("parent")
                self.log.stored([name], bytes.fromhex(parent) if parent else None, list(meta.get("tokens") or ()),
                                int(meta.get("size") or 0), meta.get("lora"), GPU)
            else:
                self.log.removed([change[1]], GPU)
        events = self.log.take()
        if events:
            self.publisher.publish(events)

    def close(self) -> None:
        """Publish what is left (call after the owner stopped, so its last removals go too)."""
        self.stopping.set()
        self.thread.join(timeout=5)
        self.flush()
        self.publisher.close()
