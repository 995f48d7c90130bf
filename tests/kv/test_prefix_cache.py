"""PrefixCache alone, over a real page pool: names, references, least-recently-used eviction,
hits to the token, and what it announces."""
import pytest

import vmm
from engine.kv.events import KVEventLog
from engine.kv.prefix_cache import PrefixCache, chain_hash, root_name


@pytest.fixture
def pool():
    p = vmm.PagePool(vmm.HostBackend(4096), 8)
    yield p
    p.close()


def names_of(tokens: list[int], size: int, root: bytes = root_name()) -> list[bytes]:
    names, parent = [], root
    for start in range(0, len(tokens) - len(tokens) % size, size):
        parent = chain_hash(parent, tokens[start:start + size])
        names.append(parent)
    return names


def test_a_name_depends_on_every_token_before_it_and_on_the_root():
    a, b = names_of([1, 2, 3, 4], 2), names_of([9, 2, 3, 4], 2)
    assert a[0] != b[0] and a[1] != b[1]  # the second page's tokens are equal: its parent is not
    roots = {root_name(), root_name(b"ns"), root_name(cache_salt="s"), root_name(adapter=b"lora"),
             root_name(b"", "s", b"lora")}
    assert len(roots) == 5  # namespaces, salts and adapters never share a first page
    assert len(a[0]) == 32 and chain_hash(root_name(), [1, 2]) == a[0]  # SHA-256, reproducible anywhere


def test_insert_holds_each_page_and_match_finds_the_longest_prefix(pool):
    cache = PrefixCache(pool)
    pages = pool.alloc_many(3)
    names = names_of([1, 2, 3, 4, 5, 6], 2)
    for k, (name, page) in enumerate(zip(names, pages)):
        cache.insert(name, (page,), names[k - 1] if k else root_name(), [2 * k + 1, 2 * k + 2], first=not k)
    assert all(pool.own_refs(p) == 2 for p in pages)  # the writer's and the cache's
    assert cache.match(names) == [(p,) for p in pages]
    assert cache.match([names[0], names_of([1, 2, 9, 9], 2)[1], names[2]]) == [(pages[0],)]  # stops at a miss
    assert cache.match(names_of([7, 7], 2)) == []
    cache.insert(names[0], (pages[0],))  # again: nothing more held
    assert pool.own_refs(pages[0]) == 2


def test_evict_lets_go_of_the_least_recently_used_entries_nobody_maps(pool):
    cache = PrefixCache(pool)
    names = names_of(list(range(1, 9)), 2)
    pages = pool.alloc_many(4)
    for name, page in zip(names, pages):
        cache.insert(name, (page,))
    pool.drop_many(pages[1:])  # the writers end; page 0's writer still maps it
    cache.match([names[1]])  # now the most recently used
    assert cache.evictable_pages() == 3
    cache.evict(want_free=pool.num_free + 1)
    assert list(cache.entries) == [names[0], names[3], names[1]]  # names[2], the oldest free one, went
    cache.evict(want_free=8)
    assert list(cache.entries) == [names[0]] and cache.evictions == 3  # mapped by its writer: kept
    pool.drop(pages[0])
    cache.clear()
    assert pool.num_free == 8 and not cache.entries


def test_a_hit_to_the_token_finds_the_page_that_begins_with_the_next_tokens(pool):
    cache = PrefixCache(pool)
    root = root_name()
    page, other = pool.alloc_many(2)
    cache.insert(chain_hash(root, [5, 6, 7, 8]), (page,), root, [5, 6, 7, 8], first=True)
    cache.insert(chain_hash(root, [5, 9, 9, 9]), (other,), root, [5, 9, 9, 9], first=True)
    assert cache.partial(root, [5, 6, 7, 1]) == ((page,), 3)
    assert cache.partial(root, [5, 9, 1]) == ((other,), 2)
    assert cache.partial(root, [4]) is None and cache.partial(b"x" * 32, [5]) is None


def test_what_it_takes_in_and_lets_go_is_announced(pool):
    events = KVEventLog()
    events.start(2)
    cache = PrefixCache(pool, events)
    name = names_of([1, 2], 2)[0]
    page = pool.alloc()
    cache.insert(name, (page,), root_name(), [1, 2], first=True)
    pool.drop(page)
    cache.evict(8)
    kinds = [type(e).__name__ for e in events.take()]
    assert kinds == ["Stored", "Removed"]
