"""The engine loop on a background thread, for a server's many concurrent requests.

Handlers (asyncio) submit and abort through a command queue; the loop thread owns the engine
alone: it applies commands between steps, runs `step()`, and hands each request's outputs to
its asyncio queue. A request whose consumer goes away (client disconnect) is aborted, so its
pages go back at once. If a step raises, the engine is dead: every request in flight gets
EngineDeadError, new ones are refused with it, and the server reports itself unhealthy.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.inputs import Prompt
from engine.llm_engine import LLMEngine
from engine.serving.metrics import Metrics
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float
    last_token_time: float | None = None
    tokens_seen: int = 0
    first_token_time: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.metrics = Metrics(lambda: self.stats)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.streams: dict[str, _Stream] = {}
        self.stats = engine.stats()
        self.running = True
        self.dead: EngineDeadError | None = None
        self.thread = threading.Thread(target=self._loop, name="vkv-engine", daemon=True)
        self.thread.start()

    # -- called from the event loop -------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams | BeamSearchParams,
                       prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as it advances; a beam search yields once, at its end."""
        if self.dead:
            raise self.dead
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        self.streams[request_id] = stream
        self._command("add", request_id, prompt_ids, params, prompt_text)
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

    def shutdown(self) -> None:
        """Stop the loop (requests still running are aborted) and give the KV memory back."""
        if not self.running:
            return
        self.running = False
        self.wake.set()
        self.thread.join(timeout=10)
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
            traceback.print_exc()
            self.dead = EngineDeadError(f"the engine failed and stopped: {exc!r}")
            for stream in self.streams.values():
                self._put(stream, self.dead)
            self.streams.clear()

    def _run_steps(self) -> None:
        while self.running:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            mapped_before = self.engine.map_seconds
            outputs = self.engine.step()
            now = time.monotonic()
            self.metrics.observe_step(self.engine.map_seconds - mapped_before)
            for out in outputs:
                self._deliver(out, now)
            self.stats = self.engine.stats()
        for request_id in list(self.streams):
            self.engine.abort(request_id)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, request_id, *args = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort(request_id)
                self.streams.pop(request_id, None)
                continue
            prompt_ids, params, text = args
            try:
                self.engine.add_request(request_id, Prompt(prompt_ids, text), params)
            except Exception as exc:  # refused: the handler raises it as an HTTP error
                self._put(self.streams.pop(request_id, None), exc)

    def _deliver(self, out: RequestOutput | BeamSearchOutput, now: float) -> None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return
        if isinstance(out, BeamSearchOutput):
            out = out.to_request_output()
        tokens = sum(len(o.token_ids) for o in out.outputs)
        if tokens > stream.tokens_seen:
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.metrics.ttft.observe(now - stream.arrival)
            else:
                self.metrics.itl.observe(now - stream.last_token_time)
            stream.last_token_time, stream.tokens_seen = now, tokens
        if out.finished:
            self.streams.pop(out.request_id, None)
            self.metrics.e2e.observe(now - stream.arrival)
        self._put(stream, out)

    @staticmethod
    def _put(stream: _Stream | None, item) -> None:
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
