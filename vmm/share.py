"""One physical page pool, several tenants: each model's KV cache draws from the same pages.

Note [Shared pool]
------------------
Rationale. A server with several models used to need a pool per model, each sized before any
traffic: memory idle in one model's pool cannot serve another model's burst. With virtual KV,
each model keeps its own reservations and views; only the physical pages need to come from
one place, so memory flows to whichever model has traffic now, with no copy and no restart.

Approach. A `SharedPool` owns one `PagePool`. `tenant(name, floor, cap)` gives a `PoolShare`,
which looks like a PagePool to reservations and KV caches (the same page ids, handles, lock and
reference counts) but owns only the pages it allocated. A share never holds more than its
cap, and never takes the pages other tenants' floors keep for them: what a tenant can take now
is min(cap - used, free - the others' unmet floors). When a tenant is short, `borrow` asks the
others to give back pages they hold but no running sequence needs (the owner of each share
registers a `Tenant` for the share: an engine's scheduler's (engine/sched/tenant.py), whose
KV cache frees its idle pages first, then its prefix cache's): first the tenants above their fair share (the pool / the number of tenants, or the
floor if higher), the most above it first, then any tenant above its floor. A tenant at or
below its floor gives nothing.

Implementation. Pages are owned by exactly one tenant from `alloc` to the `drop` that frees
them (tenants never share pages: their prefix caches have separate namespaces), so a tenant's
usage is the size of its owned set and `audit` checks each tenant's pages against its own
mappings and holds, and the group that every referenced page has exactly one owner.

When that is not enough and the short tenant is below its fair share, the tenants above theirs
preempt running sequences (`Tenant.preempt_for`: their own scheduler's rule, swap or recompute) until
they are down to their fair share: a burst on one model cannot keep another from its share.

Limitations. A tenant above its fair share is never preempted for one that is also above
its own, so two bursts share what is left as they free it. All tenants use the pool's
one page size. Sleeping a tenant gives its pages back to the pool for the others; the pool's
physical memory stays.
"""
from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

from vmm.errors import InvariantViolation, PoolExhausted
from vmm.pool import PagePool, PoolStats, expected_refs


class Tenant(Protocol):
    """What the user of a share does for the group when another tenant is short: a declared
    interface (engine/sched/tenant.py implements it for an engine), not callbacks."""

    def spare_pages(self) -> int:
        """Pages it could free now without stopping anything (idle, then cached)."""

    def free_spare(self, pages: int) -> None:
        """Free up to that many of its spare pages."""

    def preempt_for(self, pages: int) -> None:
        """Preempt running sequences (its own rule) until that many more pages are free."""


class _NoTenant:
    def spare_pages(self) -> int:
        return 0

    def free_spare(self, pages: int) -> None:
        pass

    def preempt_for(self, pages: int) -> None:
        pass


class PoolShare:
    """A tenant's view of a shared pool: the PagePool interface, limited to its own pages."""

    def __init__(self, group: SharedPool, name: str, floor: int, cap: int):
        self.group, self.name = group, name
        self.floor, self.cap = floor, cap
        self.owned: set[int] = set()
        self.asleep = False
        self.peak_in_use = 0
        self._tenant = None  # who uses the share (its scheduler registers itself), held weakly

    def register(self, tenant: Tenant) -> None:
        """The share's user, asked for pages when another tenant is short (once, at its start).
        Held weakly: each reservation's finalizer holds its share, so a strong reference here
        would keep a dropped engine's scheduler, KV manager and reservations alive for good."""
        self._tenant = weakref.ref(tenant)

    @property
    def tenant(self) -> Tenant:
        tenant = self._tenant() if self._tenant else None
        return tenant if tenant is not None else _NoTenant()

    # -- the pool's pages, seen through the share ---------------------------------------
    @property
    def pool(self) -> PagePool:
        return self.group.pool

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def backend(self):
        return self.pool.backend

    @property
    def handles(self) -> list:
        return self.pool.handles

    @property
    def lock(self):
        return self.pool.lock

    @property
    def ref_counts(self) -> list[int]:
        return self.pool.ref_counts

    def own_refs(self, page: int) -> int:
        return self.pool.own_refs(page)

    @property
    def num_pages(self) -> int:
        """The most pages this tenant may ever hold (its cap)."""
        return self.cap

    @property
    def most_pages(self) -> int:
        """The most pages this tenant can ever hold at once: its cap, less what the other
        tenants' floors keep for them (a request needing more would wait forever)."""
        others = sum(t.floor for t in self.group.tenants.values() if t is not self)
        return max(0, min(self.cap, self.pool.num_pages - others))

    @property
    def used(self) -> int:
        return len(self.owned)

    @property
    def num_free(self) -> int:
        """Pages this tenant can take now."""
        with self.lock:
            if self.asleep:
                return 0
            return max(0, min(self.cap - self.used, self.group.available_to(self)))

    # -- the PagePool verbs -------------------------------------------------------------
    def alloc(self) -> int:
        with self.lock:
            if self.num_free < 1:
                raise PoolExhausted(f"model {self.name!r}: no page it may take ({self.used} held, cap "
                                    f"{self.cap}, {self.pool.num_free} free in the shared pool)")
            page = self.pool.alloc()
            self.owned.add(page)
            self.peak_in_use = max(self.peak_in_use, self.used)
            return page

    def alloc_many(self, n: int) -> list[int]:
        with self.lock:
            if n > self.num_free:
                raise PoolExhausted(f"model {self.name!r}: needs {n} pages, may take {self.num_free}")
            return [self.alloc() for _ in range(n)]

    def hold(self, page: int) -> None:
        with self.lock:
            if page not in self.owned:
                raise InvariantViolation(f"model {self.name!r} holds page {page} of another tenant")
            self.pool.hold(page)

    def drop(self, page: int) -> bool:
        with self.lock:
            freed = self.pool.drop(page)
            if freed:
                self.owned.discard(page)
            return freed

    def drop_many(self, pages) -> None:
        for page in pages:
            self.drop(page)

    def borrow(self, need: int) -> None:
        """Ask the other tenants for pages until `need` are free to this one (or none can give)."""
        self.group.borrow(self, need)

    def borrowable(self) -> int:
        """Pages the other tenants could give this one now."""
        return self.group.borrowable(self)

    # -- numbers and checks ---------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self.lock:
            shared = sum(1 for p in self.owned if self.pool.ref_counts[p] > 1)
            return PoolStats(self.page_size, self.cap, self.num_free, self.used, shared, self.peak_in_use,
                             self.asleep)

    def check(self, expected: Mapping[int, int]) -> None:
        with self.lock:
            for page in set(expected) | self.owned:
                if page not in self.owned:
                    raise InvariantViolation(f"model {self.name!r} references page {page} it does not own")
                if self.pool.ref_counts[page] != expected.get(page, 0):
                    raise InvariantViolation(f"model {self.name!r}, page {page}: ref count "
                                             f"{self.pool.ref_counts[page]}, its owners hold {expected.get(page, 0)}")

    def audit(self, reservations: Iterable, held: Mapping[int, int] = {}) -> None:
        with self.lock:
            self.check(expected_refs(reservations, held))

    # -- sleep: the tenant's pages go back to the shared pool ------------------------------
    def release_memory(self) -> None:
        with self.lock:
            if self.owned:
                raise InvariantViolation(f"model {self.name!r} still holds {self.used} pages")
            self.asleep = True

    def restore_memory(self) -> None:
        self.asleep = False

    def close(self) -> None:
        """The group owns the pool; a tenant leaving has nothing to release."""


class SharedPool:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.tenants: dict[str, PoolShare] = {}

    def tenant(self, name: str, floor: int = 0, cap: int | None = None) -> PoolShare:
        if name in self.tenants:
            raise ValueError(f"model {name!r} already has a share of the pool")
        share = PoolShare(self, name, 0, self.pool.num_pages)
        self.tenants[name] = share
        try:
            self.set_limits(name, floor, cap)
        except ValueError:
            del self.tenants[name]
            raise
        return share

    def set_limits(self, name: str, floor: int = 0, cap: int | None = None) -> None:
        """A tenant's floor (pages no other tenant may take from it) and cap (pages it may never
        exceed); refused, naming what is wrong, if they cannot hold together."""
        if name not in self.tenants:
            raise ValueError(f"unknown model {name!r} in a KV limit: the models are {sorted(self.tenants)}")
        total = self.pool.num_pages
        cap = total if cap is None else cap
        if not 0 <= floor <= cap:
            raise ValueError(f"model {name!r}: KV limit floor {floor} must be in [0, cap {cap}]")
        if cap > total:
            raise ValueError(f"model {name!r}: KV limit cap {cap} exceeds the pool's {total} pages")
        floors = floor + sum(t.floor for n, t in self.tenants.items() if n != name)
        if floors > total:
            raise ValueError(f"model {name!r}: the KV floors would sum to {floors} pages, more than the pool's {total}")
        with self.pool.lock:
            share = self.tenants[name]
            share.floor, share.cap = floor, cap

    def available_to(self, share: PoolShare) -> int:
        """Free pages `share` may take: those not kept for the other tenants' unmet floors."""
        kept = sum(max(0, t.floor - t.used) for t in self.tenants.values() if t is not share and not t.asleep)
        return self.pool.num_free - kept

    def fair_share(self, tenant: PoolShare) -> int:
        return max(tenant.floor, self.pool.num_pages // max(1, len(self.tenants)))

    def borrow(self, share: PoolShare, need: int) -> None:
        """Others give back pages they do not need, those most above their fair share first,
        then any above its floor, until `need` pages are free to `share`. If that is not enough
        and `share` is below its own fair share, the tenants above theirs preempt running
        sequences, down to their fair share."""
        others = [t for t in self.tenants.values() if t is not share]
        above_fair = sorted((t for t in others if t.used > self.fair_share(t)),
                            key=lambda t: t.used - self.fair_share(t), reverse=True)
        short = lambda: min(need, share.cap - share.used) - share.num_free
        for giver in above_fair + [t for t in others if t not in above_fair]:
            if short() <= 0:
                return
            if giver.used > giver.floor:
                giver.tenant.free_spare(min(short(), giver.used - giver.floor))
        if share.used >= self.fair_share(share):
            return
        for giver in above_fair:
            if short() <= 0:
                return
            if giver.used > self.fair_share(giver):
                giver.tenant.preempt_for(min(short(), giver.used - self.fair_share(giver)))

    def borrowable(self, share: PoolShare) -> int:
        """Pages the others would give `share` now: their spare ones above their floors, and,
        while `share` is below its fair share, what the others hold above theirs."""
        under_fair = share.used < self.fair_share(share)
        total = 0
        for t in self.tenants.values():
            if t is not share:
                excess = max(0, t.used - self.fair_share(t)) if under_fair else 0
                total += min(max(0, t.used - t.floor), max(t.tenant.spare_pages(), excess))
        return max(0, min(total, share.cap - share.used - share.num_free))

    def audit(self) -> None:
        """Every referenced page has exactly one owner; free pages have none."""
        with self.pool.lock:
            owners = Counter(p for t in self.tenants.values() for p in t.owned)
            for page, count in enumerate(self.pool.ref_counts):
                if (count > 0) != (owners[page] == 1) or owners[page] > 1:
                    raise InvariantViolation(f"page {page}: ref count {count}, {owners[page]} owners")

    def close(self) -> None:
        self.pool.close()
