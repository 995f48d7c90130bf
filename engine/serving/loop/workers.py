"""The threads around an AsyncEngine: `Turns`, the lock that makes several models' loops take
turns, and `FairWorkers`, the tokenizer threads that serve each client's queue in turn."""
from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict, deque

from engine.core.llm_engine import LLMEngine
from engine.multi import step_budget


class Turns:
    """A lock granted in the order it was asked for, so the models' loops alternate steps; it
    also knows the models' engines, so a step can be kept short while others have work."""

    def __init__(self, step_tokens: int | None = None):
        self._cv = threading.Condition()
        self._next = self._serving = 0
        self.engines: list[LLMEngine] = []  # the models taking turns
        self.step_tokens = step_tokens  # a step's tokens while another model has work

    def budget(self, engine: LLMEngine) -> int | None:
        """Tokens `engine` may compute this step (None: its own limit)."""
        return step_budget(engine, self.engines, self.step_tokens)

    def __enter__(self) -> None:
        with self._cv:
            ticket, self._next = self._next, self._next + 1
            self._cv.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._serving += 1
            self._cv.notify_all()


class FairWorkers:
    """A few threads, each with its own state (a tokenizer), serving per-client queues in turn."""

    def __init__(self, threads: int, make_state):
        self._queues: OrderedDict[str, deque] = OrderedDict()  # client -> its jobs, in turn order
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, args=(make_state(),), name=f"vkv-tokenize-{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, client: str, fn, *args) -> concurrent.futures.Future:
        """fn(state, *args) on a worker, after the jobs queued before it by this client; other
        clients' jobs take turns with them."""
        future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._queues.setdefault(client, deque()).append((future, fn, args))
            self._cv.notify()
        return future

    def _work(self, state) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queues or self._closed)
                if self._closed:
                    return
                client, jobs = next(iter(self._queues.items()))
                future, fn, args = jobs.popleft()
                del self._queues[client]
                if jobs:  # its next job goes to the back of the turn
                    self._queues[client] = jobs
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(state, *args))
                except BaseException as exc:
                    future.set_exception(exc)

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            for jobs in self._queues.values():
                for future, _, _ in jobs:
                    future.cancel()
            self._queues.clear()
            self._cv.notify_all()
