"""Automatic prefix caching: a page whose tokens are all computed is named by a hash of its
tokens chained to its parent page's hash, and kept for later sequences with the same prefix.

Names are SHA-256 digests (32 bytes): a page's name is SHA-256(parent's name || its token ids
as little-endian uint32), and the first page's parent is a root that names the namespace (the
KV cache's geometry), the request's `cache_salt` and its LoRA adapter's digest. So the same name means the same tokens in
the same place after the same prefix, in any process and after a restart, and a match cannot be
forged offline: Python's `hash()` of a tuple of ints is neither salted nor collision-resistant
(vLLM's CVE-2025-25183 was exactly this). A request with a cache_salt only ever shares pages
with requests that carry the same salt (vLLM's semantics). Hashing costs about 1 µs a page.

A prefix that ends inside a page is a hit to the token: entries are also indexed by their
parent's name with their tokens (`partial`), and the KV cache copies the cached page whose
first rows are the sequence's next tokens into a page of its own (engine/kv/lookup.py `partial`).
Entries let go to the KV tiers keep that index (`partial_evicted`, the last EVICTED_INDEX of
them, while a tier holds them): the page is then restored from the tier instead (entries the
disk tier found at start have no tokens here, so they serve whole pages only).
Over a shared pool a sequence's last, partial page is also published when it ends, under a
`tail_name` of exactly its tokens: a process given the same prompt (the decode side of a
prefill-to-decode handoff) maps every whole page before it and takes that one (it leaves the
directory for the taker alone, who writes its next rows in place): nothing is copied. A prompt
that ends exactly at a page's end takes that whole page the same way, and publishes it again
when it commits it.

The cache holds one reference on every page of an entry (an entry is the page of each KV
region that covers those tokens), so a cached page outlives the sequence that wrote it. Entries
sit in LRU order; `evict` drops the least recently used entries nobody else maps, only when
the pool needs the memory.

Over a pool shared by several processes (`vmm.AttachedPool`, Note [Pool across processes]) the
cache is this process's view of one directory: an entry it commits is also published there
under its name, and a name it does not hold is looked up there, so a prefix another process
computed is mapped in place (its pages counted in `imported`). The directory is then the
cache: `trim` lets go of every entry no sequence of this process maps (its pages stay cached in
the directory, for every process, until the owner evicts them for an alloc), so no idle process
sits on pages another needs.
"""
from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable

from engine.kv.events import GPU, KVEventLog
from vmm import PageAllocator

ROOT = b"vkv/prefix/v1"
EVICTED_INDEX = 1 << 16  # entries let go to the tiers whose tokens are kept for hits to the token
TAIL = b"vkv/tail/v1"


def root_name(namespace: bytes = b"", cache_salt: str | None = None, adapter: bytes | None = None) -> bytes:
    """The name a sequence's first page chains from: the namespace (what the bytes of a page
    depend on besides the tokens), the request's cache_salt and its LoRA adapter's digest (an
    adapter changes every layer's K/V), each length-prefixed."""
    h = hashlib.sha256(ROOT)
    h.update(struct.pack("<I", len(namespace)) + namespace)
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8", "surrogatepass")
        h.update(b"\x01" + struct.pack("<I", len(salt)) + salt)
    if adapter is not None:
        h.update(b"\x02" + struct.pack("<I", len(adapter)) + adapter)
    return h.digest()


def chain_hash(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def _longest(children: dict[bytes, tuple[int, ...]], token_ids: list[int]) -> tuple[bytes, int] | None:
    """The child whose tokens begin with the longest run of token_ids, and that run's length."""
    best, most = None, 0
    for name, tokens in children.items():
        n = 0
        for a, b in zip(tokens, token_ids):
            if a != b:
                break
            n += 1
        if n > most:
            best, most = name, n
    return None if best is None else (best, most)


def tail_name(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """The name of a partial last page: exactly these tokens after the page named parent (never
    a whole page's name: a different prefix)."""
    return chain_hash(hashlib.sha256(TAIL + parent).digest(), token_ids)


class PrefixCache:
    def __init__(self, pool: PageAllocator, events: KVEventLog | None = None,
                 on_evict: Callable[[bytes, tuple[int, ...]], None] | None = None):
        self.pool = pool
        self.shared = hasattr(pool, "lookup")  # a pool several processes draw from: one directory of names
        # what comes and goes, for routers (Note [KV events]); over a shared pool the directory's
        # owner announces what the pool holds for every process (vmm/owner.py, engine/kv/pool_events.py),
        # not each process its view of it: this cache then records nothing (a log never started)
        self.events = KVEventLog() if self.shared else (events or KVEventLog())
        self.on_evict = on_evict  # called with (name, pages) before an entry's pages are let go (the KV tiers)
        self.entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        # each entry's tokens under its parent's name (a root for a first page), for hits that
        # end inside a page (`partial`); entries imported from a shared pool have none
        self.children: dict[bytes, dict[bytes, tuple[int, ...]]] = {}
        self.parent_of: dict[bytes, bytes] = {}
        # the same index for entries let go to the KV tiers (`on_evict`), oldest first, bounded:
        # a hit to the token on a page a tier holds (the tiers say whether they still do)
        self.evicted: OrderedDict[bytes, bytes] = OrderedDict()  # name -> parent
        self.evicted_children: dict[bytes, dict[bytes, tuple[int, ...]]] = {}
        self.queries = self.hits = self.evictions = 0  # queries and hits count tokens
        self.imported = 0  # pages found in the shared directory, computed by another process

    def match(self, hashes: list[bytes]) -> list[tuple[int, ...]]:
        """The entries of the longest cached prefix of `hashes`, now most recently used."""
        found = []
        for h in hashes:
            pages = self.entries.get(h)
            if pages is None:
                break
            self.entries.move_to_end(h)
            found.append(pages)
        if self.shared and len(found) < len(hashes):
            rest = hashes[len(found):]
            for h, pages in zip(rest, self.pool.lookup(rest)):
                if h in self.entries:  # held here already (a sliding window let an earlier page go)
                    self.pool.drop_many(pages)
                    pages = self.entries[h]
                else:
                    self.entries[h] = pages  # the lookup's references become the cache's
                    self.imported += len(pages)
                    self.events.stored([h], hashes[len(found) - 1] if found else None, [], None, None, GPU)
                found.append(pages)
        return found

    def insert(self, h: bytes, pages: tuple[int, ...], parent: bytes | None = None,
               token_ids: list[int] = (), lora_name: str | None = None, first: bool = False) -> None:
        """Cache the entry named h: the pages of each region that hold token_ids, after the
        page named parent (first: parent is the sequence's root, not a page)."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        for page in pages:
            self.pool.hold(page)
        self.entries[h] = pages
        if parent is not None and token_ids:
            self.children.setdefault(parent, {})[h] = tuple(token_ids)
            self.parent_of[h] = parent
        self.events.stored([h], None if first else parent, list(token_ids), len(token_ids), lora_name, GPU)
        if self.shared:  # described for the owner's announcements (sent only if it announces)
            self.pool.publish([(h, pages)], [{"parent": None if first or parent is None else parent.hex(),
                                              "tokens": list(token_ids), "size": len(token_ids), "lora": lora_name}])

    def partial(self, parent: bytes, token_ids: list[int]) -> tuple[tuple[int, ...], int] | None:
        """The entry after `parent` whose tokens begin with the longest run of token_ids, and
        how many match (none: None); now most recently used. A hit that ends inside a page."""
        found = _longest(self.children.get(parent, {}), token_ids)
        if found is None:
            return None
        self.entries.move_to_end(found[0])
        return self.entries[found[0]], found[1]

    def partial_evicted(self, parent: bytes, token_ids: list[int], held) -> tuple[bytes, int] | None:
        """As `partial`, over the entries let go to the KV tiers that `held(name)` says a tier
        still holds: the name to restore and how many of token_ids its first rows hold."""
        children = self.evicted_children.get(parent, {})
        for name in [name for name in children if not held(name)]:  # gone from the tiers meanwhile
            self._unindex_evicted(name)
        return _longest(self.evicted_children.get(parent, {}), token_ids)

    def _index_evicted(self, h: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        self.evicted[h] = parent
        self.evicted_children.setdefault(parent, {})[h] = tokens
        while len(self.evicted) > EVICTED_INDEX:
            self._unindex_evicted(next(iter(self.evicted)))

    def _unindex_evicted(self, h: bytes) -> None:
        parent = self.evicted.pop(h)
        siblings = self.evicted_children[parent]
        del siblings[h]
        if not siblings:
            del self.evicted_children[parent]

    def publish_tail(self, parent: bytes, token_ids: list[int], pages: tuple[int, ...]) -> None:
        """Over a shared pool: publish a sequence's last, partial page (its tokens after the page
        named parent) so a process given exactly this prompt copies its rows instead of computing
        them: the last page of a prefill-to-decode handoff. The directory holds it until evicted."""
        self.pool.publish([(tail_name(parent, token_ids), pages)])

    def last_page(self, parent: bytes, token_ids: list[int], whole: bool) -> tuple[tuple[int, ...], bool] | None:
        """Over a shared pool: the page of a prompt's end holding exactly token_ids after parent,
        as any process computed it (whole: a whole page, under its name; else the partial last
        page a sequence published when it ended, under its `tail_name`), each page with one more
        reference of this process's (drop them when done), and whether it is this process's
        alone. It is taken when it can be: out of the directory, this process its one holder, so
        it is mapped and its last rows written in place, nothing copied (a whole page comes back
        to the directory when the taker commits it again). A whole page another process maps
        stays for everyone: it is to be copied."""
        name = chain_hash(parent, token_ids) if whole else tail_name(parent, token_ids)
        if name in self.entries and all(self.pool.own_refs(p) == 1 for p in self.entries[name]):
            pages = self.entries.pop(name)  # held here by the cache alone (matched, left for the last token)
            self._forget(name)
            self.events.removed([name], GPU)
            self.pool.drop_many(pages)
        taken = self.pool.take(name)
        if taken is not None:
            self.imported += 0 if whole else len(taken)  # a whole page was counted when it was matched
            return taken, True
        if not whole:
            return None
        if name in self.entries:  # mapped by a sequence here: copied from
            self.entries.move_to_end(name)
            for page in self.entries[name]:
                self.pool.hold(page)
            return self.entries[name], False
        found = self.pool.lookup([name])
        return (found[0], False) if found else None

    def evictable_pages(self) -> int:
        """Pages only the cache references: what evict() could free now."""
        return sum(1 for pages in self.entries.values() for p in pages if self.pool.own_refs(p) == 1)

    def evict(self, want_free: int) -> None:
        """Drop least recently used entries that no sequence maps until the pool has want_free
        free pages or nothing more can go."""
        for h in list(self.entries):
            if self.pool.num_free >= want_free:
                return
            pages = self.entries[h]
            if all(self.pool.own_refs(p) == 1 for p in pages):
                del self.entries[h]
                self._let_go(h, pages)
                self.evictions += 1

    def trim(self) -> None:
        """Over a shared pool: let go of the entries no sequence here maps (the directory keeps them)."""
        idle = [h for h, pages in self.entries.items() if all(self.pool.own_refs(p) == 1 for p in pages)]
        self.pool.drop_many([p for h in idle for p in self.entries.pop(h)])  # one message to the owner
        for h in idle:
            self._forget(h)
        self.events.removed(idle, GPU)

    def held(self) -> Counter:
        return Counter(p for pages in self.entries.values() for p in pages)

    def clear(self, offload: bool = True) -> None:
        """Let every entry go (sleep, close): each goes to the tiers first, as an eviction would
        (offload=False: not, new weights made them stale)."""
        if self.on_evict is None or not offload:  # nowhere for them to go: all gone at once
            if self.entries or not offload:  # (new weights: what the tiers were announced holding is stale too)
                self.events.cleared()
            self.pool.drop_many([p for pages in self.entries.values() for p in pages])
            self.children.clear()
            self.parent_of.clear()
            if not offload:  # stale (new weights): no hit to the token on what the tiers hold
                self.evicted.clear()
                self.evicted_children.clear()
        else:
            for h, pages in self.entries.items():
                self._let_go(h, pages)
        self.entries.clear()

    def _let_go(self, h: bytes, pages: tuple[int, ...]) -> None:
        """An entry leaves the cache: its bytes to the tiers (if any, which keep its tokens'
        index for hits to the token), then its references."""
        if self.on_evict and h in self.parent_of and h not in self.evicted:
            self._index_evicted(h, self.parent_of[h], self.children[self.parent_of[h]][h])
        self._forget(h)
        self.events.removed([h], GPU)
        if self.on_evict:
            self.on_evict(h, pages)
        self.pool.drop_many(pages)

    def _forget(self, h: bytes) -> None:
        """h leaves the index of entries by parent."""
        parent = self.parent_of.pop(h, None)
        if parent is not None:
            siblings = self.children[parent]
            del siblings[h]
            if not siblings:
                del self.children[parent]
