"""The engine loop on a background thread, for a server's many concurrent requests.

Handlers (asyncio) submit, abort and ask for statistics through a command queue; the loop
thread owns the engine alone: it applies commands between steps, runs `step()`, and hands
each request's outputs to its asyncio queue. A request whose consumer goes away (client
disconnect) is aborted, so its pages go back at once. A request that fails inside the engine
ends with its error and the others go on; if a step itself raises, the engine is dead: every
request in flight gets EngineDeadError, new ones are refused with it, and the server reports
itself unhealthy.

Sleep: a sleep command stops new requests (refused like a shutdown's, 503), lets the ones in
flight finish, then releases the KV memory; wake-up maps it back.

Tokenization, chat templating and request checks (grammars compiled) run on worker threads,
each with its own tokenizer, so a large prompt never blocks the event loop and never shares a
tokenizer with the engine thread; each client's jobs wait in a queue of its own and the
threads serve the clients in turn (`FairWorkers`), so one client's burst of large prompts
delays another client's request by at most one job per thread.

Several models over one pool (engine/multi.py): each model has its AsyncEngine and loop
thread, and every loop does its engine work only while holding the models' shared `Turns`, a
lock granted in arrival order: the models' steps alternate, and a model's KV cache is never
touched by another model's thread while its own runs (giving pages back reaches into the other
models' caches). A model idle for `idle_sleep` seconds sleeps; its next request wakes it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from collections import OrderedDict, deque
from dataclasses import dataclass

from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.inputs import Prompt, chat_prompt, tokenize
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.outputs import RequestOutput, RequestOutputKind
from engine.multi import idle_long_enough, step_budget
from engine.processor import EngineRequest
from engine.sampling_params import SamplingParams
from engine.serving.metrics import Metrics
from engine.stats import EngineStats

log = logging.getLogger("vkv.server")
SLEEPING = "the engine is sleeping: POST /wake_up first"
PREPROCESS_THREADS = 2  # fast tokenizers release the GIL: two clients' prompts tokenize at once


class EngineDeadError(RuntimeError):
    pass


class RequestCancelled(RuntimeError):
    """The server ended the request (it is shutting down); the message says why."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last_token_time: float | None = None
    deltas: bool = False  # outputs hold what is new (RequestOutputKind.DELTA), not everything so far
    tokens_seen: int = 0
    first_token_time: float | None = None


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


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model: str | None = None, metrics: Metrics | None = None,
                 turns: Turns | None = None, idle_sleep: float | None = None, stall_seconds: float = 30.0):
        """model, metrics, turns: a server of several models names each, and they share the
        metrics and the turns. idle_sleep: seconds without requests before the model sleeps.
        stall_seconds: no progress this long and /health says the engine is stalled."""
        self.engine, self.model = engine, model
        self.turns = turns or Turns()
        self.turns.engines.append(engine)
        self.idle_sleep, self.idle_asleep = idle_sleep, False
        self.last_active = time.monotonic()
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the handlers' own
        self.max_model_len = engine.max_model_len
        self.max_token_bytes = max(len(t.encode("utf-8", "surrogatepass")) for t in self.tokenizer.get_vocab())
        self.metrics = metrics or Metrics()
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.streams: dict[str, _Stream] = {}
        self.stats: EngineStats = engine.stats()  # the latest snapshot
        self.running = True  # the loop thread goes on
        self.accepting = True  # new requests are taken
        self.dead: EngineDeadError | None = None
        # written by the engine thread alone, read by /health: when its loop last went round (it goes
        # round every 50 ms when idle), and the bound past which a step is logged as slow
        self.progress_at = time.monotonic()
        self.stall_seconds = stall_seconds
        self.sleep_waiters: list[asyncio.Future] = []  # sleep once nothing is in flight, then tell them
        self.preprocessor = FairWorkers(PREPROCESS_THREADS, lambda: copy.deepcopy(engine.tokenizer))
        self.thread = threading.Thread(target=self._loop, name="vkv-engine", daemon=True)
        self.thread.start()

    # -- called from the event loop -------------------------------------------------------
    async def tokenize(self, prompt, client: str = "") -> Prompt:
        self._check_size(prompt.get("prompt") if isinstance(prompt, dict) else prompt)
        return await self._preprocess(client, tokenize, self.engine.model_config.vocab_size, prompt)

    async def chat_prompt(self, messages: list[dict], client: str = "", tools: list | None = None) -> Prompt:
        self._check_size("".join(m["content"] for m in messages if isinstance(m.get("content"), str)))
        return await self._preprocess(client, chat_prompt, messages, tools)

    @property
    def template_takes_tools(self) -> bool:
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    def _check_size(self, text) -> None:
        """Refuse a text too long to fit max_model_len before it takes the tokenizer's thread:
        no token covers more characters than the longest token's UTF-8 bytes, so a longer text
        needs more tokens than the model takes."""
        if isinstance(text, str) and len(text) > self.max_model_len * self.max_token_bytes:
            raise ValueError(f"the prompt's {len(text)} characters cannot fit in max_model_len "
                             f"{self.max_model_len} tokens (none covers more than {self.max_token_bytes})")

    async def _preprocess(self, client: str, fn, *args):
        """fn(a worker's tokenizer, *args), in the client's turn."""
        return await asyncio.wrap_future(self.preprocessor.submit(client, fn, *args))

    async def process(self, request_id: str, prompt: Prompt, params: SamplingParams | BeamSearchParams,
                      group: str | None = None, priority: int = 0,
                      lora_request: LoRARequest | None = None) -> EngineRequest:
        """The request checked (ValueError, with the reason, if the engine would refuse it). It
        reads only what never changes (and compiles grammars or loads its LoRA adapter, which
        may take a while), so it runs on the worker; the engine does not check it again."""
        return await self._preprocess(group or request_id, lambda _: self.engine.process_inputs(
            request_id, prompt, params, group=group, priority=priority, lora_request=lora_request))

    @property
    def lora_enabled(self) -> bool:
        return self.engine.config.enable_lora

    async def add_lora(self, request: LoRARequest) -> None:
        """Load and check an adapter off the event loop (ValueError by name)."""
        await asyncio.to_thread(self.engine.add_lora, request)

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs as it advances (as its params' output_kind says); a beam
        search yields once, at its end."""
        if self.dead:
            raise self.dead
        if not self.accepting:
            raise RequestCancelled("the server is shutting down")
        if self.is_sleeping:
            raise RequestCancelled(SLEEPING)
        request_id = request.request_id
        deltas = getattr(request.params, "output_kind", None) is RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic(), deltas)
        self.streams[request_id] = stream
        self._command("add", request)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._command("abort", request_id)

    async def fresh_stats(self, timeout: float = 2.0) -> EngineStats:
        """Statistics taken now by the engine thread (between steps); the latest snapshot if
        the engine is dead or busier than `timeout`."""
        if self.dead or not self.running:
            return self.stats
        future = asyncio.get_running_loop().create_future()
        self._command("stats", future)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return self.stats

    @property
    def is_sleeping(self) -> bool:
        """Asleep, or going to sleep once the requests in flight are done (a model that slept
        for being idle is not: its next request wakes it)."""
        return bool(self.sleep_waiters) or (self.engine.is_sleeping and not self.idle_asleep)

    async def sleep(self, level: int = 1) -> bool:
        """Returns True once asleep, or False if a wake-up came while the requests in flight were
        draining (the last command wins); ValueError for a level the engine does not have."""
        return await self._ask("sleep", level)

    async def wake_up(self) -> None:
        await self._ask("wake")

    async def _ask(self, kind: str, *args):
        if self.dead:
            raise self.dead
        future = asyncio.get_running_loop().create_future()
        self._command(kind, future, *args)
        return await future

    def cancel_all(self, reason: str) -> None:
        """End every request in flight with RequestCancelled(reason); new ones are refused."""
        self._command("cancel", reason)

    def shutdown(self) -> None:
        """Stop the loop (requests still running are aborted) and give the KV memory back."""
        if not self.running:
            return
        self.running = False
        self.wake.set()
        self.thread.join(timeout=10)
        self.preprocessor.shutdown()
        if not self.thread.is_alive():
            self.engine.close()

    def _command(self, *command) -> None:
        self.commands.put(command)
        self.wake.set()

    # -- the loop thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run_steps()
        except Exception as exc:
            log.exception("the engine failed")
            self.dead = EngineDeadError(f"the engine failed and stopped: {exc!r}")
            for stream in self.streams.values():
                self._put(stream, self.dead)
            self.streams.clear()

    def stalled(self) -> str | None:
        """Why the engine thread is not moving (for /health), or None: it has made no progress
        for longer than stall_seconds, stuck in a step or an I/O call that does not return."""
        idle = time.monotonic() - self.progress_at
        if self.running and idle > self.stall_seconds:
            return f"the engine thread has made no progress for {idle:.0f} s (over {self.stall_seconds:g} s)"
        return None

    def _run_steps(self) -> None:
        while self.running:
            if not self.engine.has_unfinished() and self.commands.empty():
                self.wake.wait(0.05)
                self.wake.clear()
            with self.turns:
                self._turn()
            self.progress_at = time.monotonic()
        with self.turns:
            for request_id in list(self.streams):
                self.engine.abort(request_id)

    def _turn(self) -> None:
        """Commands, then one step if there is work (with the models' turn held)."""
        self._apply_commands()
        if self.sleep_waiters and not self.engine.has_unfinished():
            waiters, self.sleep_waiters = self.sleep_waiters, []
            for future in waiters:
                _settle(future, self._sleep_now)
        if not self.engine.has_unfinished():
            if self.idle_sleep is not None and idle_long_enough(self.engine, self.last_active, self.idle_sleep,
                                                                time.monotonic()):
                self.engine.sleep(1)  # its pages go back to the pool the models share
                self.idle_asleep = True
            return
        self.last_active = time.monotonic()
        mapped_before, started = self.engine.map_seconds, time.monotonic()
        outputs = self.engine.step(self.turns.budget(self.engine))
        now = time.monotonic()
        if now - started > self.stall_seconds:
            log.warning("vkv: an engine step took %.1f s, over --health-stall-seconds %g (%d requests running)",
                        now - started, self.stall_seconds, self.engine.stats().num_running)
        self.metrics.observe_step(self.engine.map_seconds - mapped_before, self.model)
        for out in outputs:
            self._deliver(out, now)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, *args = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(args[0])
                self.streams.pop(args[0], None)
            elif kind == "add":
                self._add(*args)
            elif kind == "sleep":
                future, level = args
                if level != 1:  # the engine refuses it: say so now rather than after the drain
                    _settle(future, self.engine.sleep, level)
                else:
                    self.sleep_waiters.append(future)
            elif kind == "wake":  # a sleep still draining is called off: the last command wins
                self.idle_asleep = False
                waiters, self.sleep_waiters = self.sleep_waiters, []
                for future in waiters:
                    future.get_loop().call_soon_threadsafe(_resolve, future, False)
                _settle(args[0], self.engine.wake_up)
            elif kind == "stats":
                self.stats = self.engine.stats()
                future = args[0]
                future.get_loop().call_soon_threadsafe(_resolve, future, self.stats)
            elif kind == "cancel":
                self.accepting = False
                for request_id, stream in list(self.streams.items()):
                    self.engine.abort(request_id)
                    self._put(stream, RequestCancelled(args[0]))
                self.streams.clear()

    def _sleep_now(self) -> bool:
        self.engine.sleep(1)
        self.idle_asleep = False  # asked for: requests are refused until /wake_up
        return True

    def _add(self, request: EngineRequest) -> None:
        if self.is_sleeping:  # it raced a sleep command
            self._put(self.streams.pop(request.request_id, None), RequestCancelled(SLEEPING))
            return
        self.last_active = time.monotonic()
        if self.idle_asleep:  # slept for being idle: this request wakes it
            self.engine.wake_up()
            self.idle_asleep = False
            self.metrics.of(self.metrics.wake, self.model).observe(time.monotonic() - self.last_active)
        try:
            self.engine.add(request)
        except Exception as exc:  # refused: the handler raises it as an HTTP error
            self._put(self.streams.pop(request.request_id, None), exc)

    def _deliver(self, out: RequestOutput | BeamSearchOutput, now: float) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        if isinstance(out, BeamSearchOutput):
            out = out.to_request_output()
        tokens = sum(len(o.token_ids) for o in out.outputs) + (stream.tokens_seen if stream.deltas else 0)
        if tokens > stream.tokens_seen:
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.metrics.of(self.metrics.ttft, self.model).observe(now - stream.arrival)
            else:
                self.metrics.of(self.metrics.itl, self.model).observe(now - stream.last_token_time)
            stream.last_token_time, stream.tokens_seen = now, tokens
        if out.finished:
            self.streams.pop(out.request_id, None)
            self.metrics.of(self.metrics.e2e, self.model).observe(now - stream.arrival)
        self._put(stream, out)

    @staticmethod
    def _put(stream: _Stream | None, item) -> None:
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _settle(future: asyncio.Future, fn, *args) -> None:
    """Run fn on the engine thread; its result or its exception goes to the handler's future."""
    try:
        result = fn(*args)
    except Exception as exc:
        future.get_loop().call_soon_threadsafe(_reject, future, exc)
    else:
        future.get_loop().call_soon_threadsafe(_resolve, future, result)
