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

Who writes what. Handlers send typed commands (`Add`, `Abort`, `Sleep`, `Wake`, `Snapshot`,
`Cancel`, `Stop`) and never touch the engine; the loop thread alone applies them and alone
writes the engine's lifecycle, one `Lifecycle` value (serving, draining for a sleep, asleep,
asleep for being idle, closing, stopped, dead) that handlers only read. Adapters are loaded
and checked on a worker thread (the engine's adapter registry is thread-safe) so a large one
never stalls a step.

Tokenization, chat templating and request checks (grammars compiled) run on worker threads,
each with its own tokenizer, the clients served in turn (engine/serving/loop/preprocess.py).

Several models over one pool (engine/multi.py): each model has its AsyncEngine and loop
thread, and every loop does its engine work only while holding the models' shared `Turns`, a
lock granted in arrival order: the models' steps alternate, and a model's KV cache is never
touched by another model's thread while its own runs (giving pages back reaches into the other
models' caches). A model idle for `idle_sleep` seconds sleeps; its next request wakes it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.request.beam_search import BeamSearchOutput
from engine.core.llm_engine import EngineSleeping, LLMEngine
from engine.request.lora_request import LoRARequest
from engine.request.outputs import RequestOutput, RequestOutputKind
from engine.multi import idle_long_enough
from engine.core.processor import EngineRequest
from engine.serving.loop.commands import (Abort, Add, Cancel, Command, EngineDeadError, Lifecycle, Phase, RequestCancelled,
                                     Pause, Resume, Sleep, Snapshot, Stop, UpdateWeights, Wake)
from engine.serving.loop.metrics import Metrics
from engine.serving.loop.preprocess import Preprocessor
from engine.serving.loop.workers import Turns
from engine.stats import EngineStats

log = logging.getLogger("vkv.server")
SLEEPING = "the engine is sleeping: POST /wake_up first"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last_token_time: float | None = None
    deltas: bool = False  # outputs hold what is new (RequestOutputKind.DELTA), not everything so far
    tokens_seen: int = 0
    first_token_time: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model: str | None = None, metrics: Metrics | None = None,
                 turns: Turns | None = None, idle_sleep: float | None = None, stall_seconds: float = 30.0):
        """model, metrics, turns: a server of several models names each, and they share the
        metrics and the turns. idle_sleep: seconds without requests before the model sleeps.
        stall_seconds: no progress this long and /health says the engine is stalled."""
        self.engine, self.model = engine, model
        self.turns = turns or Turns()
        self.turns.engines.append(engine)
        self.idle_sleep = idle_sleep
        self.last_active = time.monotonic()
        self.preprocess = Preprocessor(engine)  # tokenization, chat templates, checks: on worker threads
        self.tokenizer = self.preprocess.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.metrics = metrics or Metrics()
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.streams: dict[str, _Stream] = {}
        self.stats: EngineStats = engine.stats()  # the latest snapshot
        self.lifecycle = Lifecycle()  # written by the loop thread alone
        self._shut = False  # shutdown() was called (by whoever stops the server: once)
        # written by the engine thread alone, read by /health: when its current turn began (None while
        # it waits for work: an idle thread the OS has not run for a while is not stalled), and the
        # bound past which a turn is a stall and a step is logged as slow
        self.turn_began: float | None = None
        self.stall_seconds = stall_seconds
        self.sleep_waiters: list[tuple[asyncio.Future, int]] = []  # (reply, level): sleep once nothing is in flight
        self.thread = threading.Thread(target=self._loop, name="vkv-engine", daemon=True)
        self.thread.start()

    @property
    def dead(self) -> EngineDeadError | None:
        return self.lifecycle.failure

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    def _become(self, phase: Phase, failure: EngineDeadError | None = None) -> None:
        """(loop thread) The one place the lifecycle changes."""
        self.lifecycle = Lifecycle(phase, failure)

    # -- called from the event loop -------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        return self.engine.config.enable_lora

    def adapters(self) -> dict[str, LoRARequest]:
        """The adapters this model serves, by name (the engine's registry; a copy)."""
        return self.engine.lora_requests()

    def load_adapters(self, adapters: dict[str, str]) -> None:
        """At start-up, before any request: serve these adapters ({name: path}); ValueError by name."""
        for name, path in adapters.items():
            self.engine.add_lora(LoRARequest(name, self.engine.next_lora_id(), path))

    def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter (the registry is thread-safe; requests running with it finish)."""
        return self.engine.remove_lora(name)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs as it advances (as its params' output_kind says); a beam
        search yields once, at its end."""
        if self.dead:
            raise self.dead
        if self.phase in (Phase.CLOSING, Phase.STOPPED):
            raise RequestCancelled("the server is shutting down")
        if self.is_sleeping:
            raise RequestCancelled(SLEEPING)
        request_id = request.request_id
        deltas = getattr(request.params, "output_kind", None) is RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic(), deltas)
        self.streams[request_id] = stream
        if self.dead:  # died since the check above: its handler may have missed this stream
            self.streams.pop(request_id, None)
            raise self.dead
        self._command(Add(request))
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
                self._command(Abort(request_id))

    async def fresh_stats(self, timeout: float = 2.0) -> EngineStats:
        """Statistics taken now by the engine thread (between steps); the latest snapshot if
        the engine is dead or busier than `timeout`."""
        if self.phase in (Phase.DEAD, Phase.STOPPED):
            return self.stats
        future = asyncio.get_running_loop().create_future()
        self._command(Snapshot(future))
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return self.stats

    @property
    def is_sleeping(self) -> bool:
        """Asleep, or going to sleep once the requests in flight are done (a model that slept
        for being idle is not: its next request wakes it)."""
        return self.phase in (Phase.DRAINING, Phase.ASLEEP) or (self.phase is Phase.SERVING and self.engine.is_sleeping)

    async def sleep(self, level: int = 1) -> bool:
        """Returns True once asleep, or False if a wake-up came while the requests in flight were
        draining (the last command wins); ValueError for a level the engine does not have."""
        return await self._ask(lambda reply: Sleep(reply, level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Map memory back ("weights", "kv_cache"; default both: LLMEngine.wake_up)."""
        await self._ask(lambda reply: Wake(reply, None if tags is None else tuple(tags)))

    @property
    def weights_empty(self) -> bool:
        """The weights woke up empty after sleep level 2: new ones must be loaded first."""
        pages = self.engine.model.pages
        return pages is not None and pages.empty

    async def pause_generation(self, mode: str = "abort") -> None:
        """No step until continue_generation; "abort" ends the requests in flight (their streams
        end with RequestCancelled), "retract" keeps them to compute again (LLMEngine's)."""
        await self._ask(lambda reply: Pause(reply, mode))

    async def continue_generation(self) -> None:
        await self._ask(Resume)

    async def read_weights_from_disk(self, path: str) -> dict:
        """A checkpoint's tensors read and checked on a worker thread: the engine (and every
        other model's, which wait for its turn) keeps stepping meanwhile."""
        return await asyncio.to_thread(self.engine.read_weights_from_disk, path)

    async def update_weights(self, state: dict) -> None:
        """New weights in place (LLMEngine.update_weights_from_tensor); ValueError by name,
        nothing changed."""
        await self._ask(lambda reply: UpdateWeights(reply, state))

    async def _ask(self, command):
        if self.dead:
            raise self.dead
        future = asyncio.get_running_loop().create_future()
        self._command(command(future))
        return await future

    def cancel_all(self, reason: str) -> None:
        """End every request in flight with RequestCancelled(reason); new ones are refused."""
        self._command(Cancel(reason))

    def shutdown(self) -> None:
        """Stop the loop (requests still running are aborted) and give the KV memory back."""
        if self._shut:
            return
        self._shut = True
        self._command(Stop())
        self.thread.join(timeout=10)
        self.preprocess.shutdown()
        if not self.thread.is_alive():
            self.engine.close()

    def _command(self, command: Command) -> None:
        self.commands.put(command)
        self.wake.set()

    # -- the loop thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run_steps()
        except Exception as exc:
            log.exception("the engine failed")
            self._become(Phase.DEAD, EngineDeadError(f"the engine failed and stopped: {type(exc).__name__}: {exc}"))
            for request_id in list(self.streams):  # (a copy: the loop thread registers streams meanwhile)
                self._put(self.streams.pop(request_id, None), self.dead)

    def stalled(self) -> str | None:
        """Why the engine thread is not moving (for /health), or None: its turn began longer than
        stall_seconds ago, stuck in a step or an I/O call that does not return (or waiting that long
        for another model's turn to end)."""
        began = self.turn_began
        stuck = time.monotonic() - began if began is not None else 0.0
        if self.phase not in (Phase.STOPPED, Phase.DEAD) and stuck > self.stall_seconds:
            return f"the engine thread has made no progress for {stuck:.0f} s (over {self.stall_seconds:g} s)"
        return None

    def _run_steps(self) -> None:
        while self.phase is not Phase.STOPPED:
            if (self.engine.paused or not self.engine.has_unfinished()) and self.commands.empty():
                self.wake.wait(0.05)
                self.wake.clear()
            self.turn_began = time.monotonic()
            with self.turns:
                self._turn()
            self.turn_began = None
        with self.turns:
            for request_id in list(self.streams):
                self.engine.abort(request_id)

    def _turn(self) -> None:
        """Commands, then one step if there is work (with the models' turn held)."""
        self._apply_commands()
        if self.phase is Phase.STOPPED:
            return
        if self.sleep_waiters and not self.engine.has_unfinished():  # (paused too: nothing to drain)
            waiters, self.sleep_waiters = self.sleep_waiters, []
            level = max(level for _, level in waiters)
            for future, _ in waiters:
                _settle(future, self._sleep_now, level)
        if self.engine.paused:
            return
        if not self.engine.has_unfinished():
            if self.idle_sleep is not None and idle_long_enough(self.engine, self.last_active, self.idle_sleep,
                                                                time.monotonic()):
                self.engine.sleep(1)  # its pages go back to the pool the models share
                self._become(Phase.IDLE_ASLEEP)
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
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case Abort(request_id):
                    self.engine.abort(request_id)
                    self.streams.pop(request_id, None)
                case Add(request):
                    self._add(request)
                case Sleep(reply, level) if level not in self.engine.sleep_levels:  # refused: now, not after the drain
                    _settle(reply, self.engine.sleep, level)
                case Sleep(reply, level):
                    self.sleep_waiters.append((reply, level))
                    if self.phase in (Phase.SERVING, Phase.IDLE_ASLEEP, Phase.ASLEEP):
                        self._become(Phase.DRAINING)
                case Wake(reply, tags):  # a sleep still draining is called off: the last command wins
                    waiters, self.sleep_waiters = self.sleep_waiters, []
                    for future, _ in waiters:
                        future.get_loop().call_soon_threadsafe(_resolve, future, False)
                    if self.phase in (Phase.DRAINING, Phase.ASLEEP, Phase.IDLE_ASLEEP):
                        self._become(Phase.SERVING)
                    _settle(reply, self.engine.wake_up, tags)
                case Pause(reply, mode):
                    # the requests the engine forgets end here; a stream the loop thread registered
                    # meanwhile belongs to an Add still queued, which waits for continue_generation
                    for request_id in _settle(reply, self.engine.pause_generation, mode) or ():
                        self._put(self.streams.pop(request_id, None),
                                  RequestCancelled("the request was aborted: generation was paused"))
                case Resume(reply):
                    _settle(reply, self.engine.continue_generation)
                case UpdateWeights(reply, state):
                    _settle(reply, self.engine.update_weights_from_tensor, state)
                case Snapshot(reply):
                    self.stats = self.engine.stats()
                    reply.get_loop().call_soon_threadsafe(_resolve, reply, self.stats)
                case Cancel(reason):
                    self._become(Phase.CLOSING)
                    for request_id, stream in list(self.streams.items()):
                        self.engine.abort(request_id)
                        self._put(stream, RequestCancelled(reason))
                    self.streams.clear()
                case Stop():
                    self._become(Phase.STOPPED)
                    return

    def _sleep_now(self, level: int) -> bool:
        self.engine.sleep(level)
        if self.phase is Phase.DRAINING:
            self._become(Phase.ASLEEP)  # asked for: requests are refused until a wake-up
        return True

    def _add(self, request: EngineRequest) -> None:
        if self.is_sleeping:  # it raced a sleep command
            self._put(self.streams.pop(request.request_id, None), RequestCancelled(SLEEPING))
            return
        self.last_active = time.monotonic()
        if self.phase is Phase.IDLE_ASLEEP:  # slept for being idle: this request wakes it
            self.engine.wake_up()
            self._become(Phase.SERVING)
            self.metrics.of(self.metrics.wake, self.model).observe(time.monotonic() - self.last_active)
        try:
            self.engine.add(request)
        except EngineSleeping as exc:  # half awake (wake_up with one tag), or weights not loaded yet: a 503
            self._put(self.streams.pop(request.request_id, None), RequestCancelled(str(exc)))
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


def _settle(future: asyncio.Future, fn, *args):
    """Run fn on the engine thread; its result or its exception goes to the handler's future
    (the result is returned too; None after an exception)."""
    try:
        result = fn(*args)
    except Exception as exc:
        future.get_loop().call_soon_threadsafe(_reject, future, exc)
        return None
    future.get_loop().call_soon_threadsafe(_resolve, future, result)
    return result
