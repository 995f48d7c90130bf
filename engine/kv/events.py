"""KV events: every change to what the cache holds by name, in the order it happened.

Note [KV events]
----------------
Rationale. A router that sends each request to the replica already holding its prefix must
know what every replica holds. vLLM publishes that as a stream of events (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`) and the routers of the field read it (llm-d's KV-cache
scorer, NVIDIA Dynamo's KV router, Ray Serve's and SGLang's cache-aware routers). vkv speaks
the same stream (engine/kv/publisher.py puts it on the wire in vLLM's schema).

Approach. Each KV cache has one `KVEventLog`. What changes a named entry records the change
where it makes it, and nowhere else:
  GPU      the pool's prefix cache (engine/kv/prefix_cache.py): an entry committed (with its
           tokens, its parent's name, its adapter), evicted, trimmed or cleared ("GPU" is
           vLLM's word for the engine's own KV pool, on a CPU too)
  CPU      the host tier (engine/kv/tiers.py HostTier): an entry offloaded or dropped for room
  STORAGE  the disk tier (DiskTier): an entry queued, found at start, trimmed, found damaged,
           failed to write (its writer thread), or the whole tier turned off
Over a pool several engine processes share (vmm/owner.py) the directory is the cache every
process hits, and its one writer, the pool's owner, announces it (engine/kv/pool_events.py):
each process's prefix cache then records nothing of its own.
The engine takes the log after each step (and after sleep) and hands it to the publisher. An
entry's name is its 32-byte SHA-256 chain hash; on the wire it is its first 8 bytes as an
unsigned integer (vLLM's block hashes are integers).

Implementation. The log records nothing until `start()` (no publisher, no cost), so a cache
nobody listens to grows no list. Consecutive events of one kind, medium and page size merge
into one, as vLLM batches a request's blocks: a run of stored pages each the child of the one
before is one `Stored` with its parent and all its tokens.

Limitations. Tier events carry no token ids: entries move between tiers by name. A KV page
holds a whole number of tokens only if the layout says so: where a page's token count differs
from the run before it (a per_layer page of 85 fp32 tokens, then one of 86), a new event
starts, each with its own `block_size`. Over a shared pool a page's description travels to the
owner with its name (a page of very many tokens, past half a message, is announced without them).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"


@dataclass
class Stored:
    names: list[bytes]
    parent: bytes | None  # the name of the page before the first, None for a sequence's first page
    token_ids: list[int]  # every page's tokens, in order ([] where unknown: tier moves, imports)
    block_size: int  # tokens per page
    lora_name: str | None
    medium: str


@dataclass
class Removed:
    names: list[bytes]
    medium: str


@dataclass
class Cleared:
    """Forget everything this engine was announced holding, in every medium (vLLM's
    AllBlocksCleared): new weights made it all stale, or the engine closed and its memory went."""


@dataclass
class KVEventLog:
    """What changed, oldest first, until the engine takes it. Thread-safe (the disk writer
    thread records its failures)."""
    recording: bool = False
    page_tokens: int = 0  # tokens per page where an event does not say (tier moves)
    events: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, page_tokens: int) -> None:
        """Record from now on (a publisher takes the events); before any entry exists."""
        self.recording, self.page_tokens = True, page_tokens

    def stored(self, names: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int | None,
               lora_name: str | None, medium: str) -> None:
        if not self.recording or not names:
            return
        block_size = block_size or self.page_tokens
        with self.lock:
            last = self.events[-1] if self.events else None
            if (isinstance(last, Stored) and (last.medium, last.lora_name, last.block_size) == (medium, lora_name, block_size)
                    and (last.names[-1] == parent or (medium != GPU and not token_ids and not last.token_ids))):
                last.names.extend(names)
                last.token_ids.extend(token_ids)
            else:
                self.events.append(Stored(list(names), parent, list(token_ids), block_size, lora_name, medium))

    def removed(self, names: list[bytes], medium: str) -> None:
        if not self.recording or not names:
            return
        with self.lock:
            last = self.events[-1] if self.events else None
            if isinstance(last, Removed) and last.medium == medium:
                last.names.extend(names)
            else:
                self.events.append(Removed(list(names), medium))

    def cleared(self) -> None:
        if self.recording:
            with self.lock:
                self.events.append(Cleared())

    def take(self) -> list:
        """The events since the last take, oldest first."""
        with self.lock:
            events, self.events = self.events, []
        return events


class AnnouncedEntries(OrderedDict):
    """A tier's index of entries by name (least recently used first) whose arrivals and
    departures are recorded in a KVEventLog: every way an entry comes or goes (set, pop,
    popitem, clear) is announced once."""

    def __init__(self, log: KVEventLog | None, medium: str):
        super().__init__()
        self.log, self.medium = log or KVEventLog(), medium

    def __setitem__(self, name: bytes, value) -> None:
        new = name not in self
        super().__setitem__(name, value)
        if new:
            self.log.stored([name], None, [], None, None, self.medium)

    def pop(self, name: bytes, *default):
        had = name in self
        value = super().pop(name, *default)
        if had:
            self.log.removed([name], self.medium)
        return value

    def popitem(self, last: bool = True):
        name, value = super().popitem(last)
        self.log.removed([name], self.medium)
        return name, value

    def clear(self) -> None:
        names = list(self)
        super().clear()
        self.log.removed(names, self.medium)

    def announce_gone(self) -> None:
        """(a tier closing) Every entry announced removed, the index kept for its numbers: the
        engine no longer serves them, though a disk tier's files stay for the next one."""
        self.log.removed(list(self), self.medium)

    def __delitem__(self, name: bytes) -> None:
        super().__delitem__(name)
        self.log.removed([name], self.medium)
