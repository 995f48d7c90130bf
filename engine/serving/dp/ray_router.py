"""vkv's Ray Serve request router (Note [Replicas on Ray Serve] in engine/serving/dp/ray_serve.py):
each request to the replica holding the most of its leading pages, else the less busy of two.
A module of its own because Ray imports a router class by its path, and Ray is optional."""
from __future__ import annotations

import random
import time
from collections import deque

from ray.serve.request_router import FIFOMixin, RequestRouter

from engine.serving.dp.ray_serve import BUSIER, EXPECT_SECONDS, MAX_REPORTED, RouteKey, page_names

MAX_UNNAMED = 1024  # requests remembered before the names are known, at most (the newest)


class PrefixRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, busier: int = BUSIER, expect_seconds: float = EXPECT_SECONDS):
        self.busier, self.expect_seconds = busier, expect_seconds
        self.sent: dict[int, tuple[object, float]] = {}  # page name -> (replica it was just sent to, when)
        self.held: dict[object, tuple[tuple, set[int]]] = {}  # replica -> (its report, its names as a set)
        # requests routed before any replica's stats said how pages are named (the first
        # STATS_PERIOD after a start): (key, replica, when), named into `sent` once that is known
        self.unnamed: deque[tuple[RouteKey, object, float]] = deque(maxlen=MAX_UNNAMED)

    def _load(self, replica) -> int:
        queued = self.replica_queue_len_cache.get(replica.replica_id)
        stats = replica.routing_stats or {}
        return queued if queued is not None else stats.get("running", 0) + stats.get("waiting", 0)

    def _holds(self, replica) -> set[int]:
        stats = replica.routing_stats or {}
        report = stats.get("held") or []
        cached = self.held.get(replica.replica_id)
        if cached is None or cached[0] is not report:
            cached = self.held[replica.replica_id] = (report, set(report))
        return cached[1]

    def _names(self, pending, replicas, now: float) -> list[int]:
        """The request's page names, computed once (Ray may ask again for the same request)."""
        named = getattr(pending.routing_context, "vkv_names", None) if pending is not None else None
        if named:
            return named
        key = pending.args[-1] if pending is not None and pending.args else None
        naming = next((r.routing_stats for r in replicas if (r.routing_stats or {}).get("page_ends")), None)
        if naming is not None:  # what went out before the names were known counts as held where it went
            while self.unnamed:
                early, replica, when = self.unnamed.popleft()
                if now - when < self.expect_seconds:
                    self._remember(self._named(early, naming), replica, when)
        if not isinstance(key, RouteKey):
            return []
        if naming is None:
            pending.routing_context.vkv_key = key  # (kept unnamed when routed: on_request_routed)
            return []
        return self._named(key, naming)

    @staticmethod
    def _named(key: RouteKey, naming: dict) -> list[int]:
        """key's page names under a replica's stats (its namespace and page boundaries)."""
        return page_names(key, bytes.fromhex(naming["namespace"]), naming["page_ends"])

    def _depth(self, replica, names: list[int], now: float) -> int:
        held, depth = self._holds(replica), 0
        for name in names:
            where = self.sent.get(name)
            if name not in held and not (where and where[0] == replica.replica_id
                                         and now - where[1] < self.expect_seconds):
                break
            depth += 1
        return depth

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        now = time.monotonic()
        names = self._names(pending_request, candidate_replicas, now)
        load = {r.replica_id: self._load(r) for r in candidate_replicas}
        least = min(load.values())
        best = max(candidate_replicas, key=lambda r: (self._depth(r, names, now), -load[r.replica_id]))
        if names and self._depth(best, names, now) and load[best.replica_id] <= least + self.busier:
            chosen = [[best], sorted((r for r in candidate_replicas if r is not best), key=lambda r: load[r.replica_id])]
        else:
            two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            chosen = [sorted(two, key=lambda r: load[r.replica_id])]
        if pending_request is not None:
            pending_request.routing_context.vkv_names = names  # for on_request_routed
        return chosen

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        now, context = time.monotonic(), pending_request.routing_context
        self._remember(getattr(context, "vkv_names", ()), replica_id, now)
        if not getattr(context, "vkv_names", None) and getattr(context, "vkv_key", None) is not None:
            self.unnamed.append((context.vkv_key, replica_id, now))

    def _remember(self, names, replica_id, when: float) -> None:
        """`names` were just sent to replica_id (at `when`): they count as held there for a while."""
        now = time.monotonic()
        for name in names:
            self.sent.pop(name, None)  # to the end: the map stays oldest first
            self.sent[name] = (replica_id, when)
        while self.sent:  # forget from the oldest: what expired, and past the bound what is left
            name, (_, at) = next(iter(self.sent.items()))
            if now - at < self.expect_seconds and len(self.sent) <= 4 * MAX_REPORTED:
                break
            del self.sent[name]
