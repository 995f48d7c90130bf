"""How a generation request's answer leaves the server: whole (`collect`), as server-sent events
(`stream`), or, when it may call tools, as one event per choice once it is done
(`tool_stream`); a failed stream ends with an error event and [DONE] (`error_tail`). The
completion and chat routes (engine/serving/api/routes/) call these with the engine requests they
prepared; nothing here knows a route."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request

from engine.request.outputs import RequestOutput
from engine.core.processor import EngineRequest
from engine.serving.loop.async_engine import AsyncEngine, EngineDeadError, RequestCancelled
from engine.serving.api.protocol import envelope, usage
from engine.serving.api.state import HTTPError
from engine.serving.edge import stream_tail


async def tool_stream(engine: AsyncEngine, rid: str, requests: list[EngineRequest], body, model: str,
                       message, logprobs) -> AsyncIterator[str]:
    """A stream of a request that may call tools: each choice whole, as one delta (content and
    `tool_calls` with their indices, and its logprobs as the unstreamed answer has them), then
    usage if asked, then [DONE]; an error event instead if the request fails."""
    kind, outs = "chat.completion.chunk", None
    try:
        async for out in engine.generate(requests[0]):
            outs = out
        if outs.error:
            raise RuntimeError(outs.error)
    except Exception as exc:
        yield error_tail(exc)
        return
    for c in outs.outputs:
        said, reason = message(c)
        delta = said | {"tool_calls": [call | {"index": i} for i, call in enumerate(said.get("tool_calls", []))]}
        if not delta["tool_calls"]:
            del delta["tool_calls"]
        yield f"data: {json.dumps(envelope(kind, rid, model, [{'index': c.index, 'delta': delta, 'logprobs': logprobs(c), 'finish_reason': None}]))}\n\n"
        yield f"data: {json.dumps(envelope(kind, rid, model, [{'index': c.index, 'delta': {}, 'logprobs': None, 'finish_reason': reason}]))}\n\n"
    if body.stream_options and body.stream_options.include_usage:
        yield f"data: {json.dumps(envelope(kind, rid, model, [], {'usage': usage([outs])}))}\n\n"
    yield "data: [DONE]\n\n"


def error_tail(failure: Exception) -> str:
    """The end of a failed stream (edge.stream_tail): 503 if the engine died or the server is
    stopping, 400 if the request failed of its own doing, else 500."""
    status, message = (503 if isinstance(failure, (EngineDeadError, RequestCancelled)) else 500), str(failure)
    if status == 500 and clients_own(message):
        status, message = 400, clients_own(message)
    return stream_tail(message, type(failure).__name__, status).decode()


def clients_own(failure: str) -> str | None:
    """What to tell the client when its request failed of its own doing (a 400), else None."""
    if failure.startswith("SamplingError") and "allows no token" in failure:
        return ("the request's constraints (min_tokens, stop_token_ids, logit_bias or a structured output) "
                "allow no next token")
    if failure.startswith("GrammarError: "):
        return failure.removeprefix("GrammarError: ")
    return None


async def collect(engine: AsyncEngine, requests: list[EngineRequest], request: Request) -> list[RequestOutput]:
    """Run every prompt to the end; abort them all if the client goes away first."""
    async def last(one: EngineRequest) -> RequestOutput:
        out = None
        async for out in engine.generate(one):
            pass
        return out

    task = asyncio.ensure_future(asyncio.gather(*map(last, requests)))
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise HTTPError(499, "client disconnected")
    outs = task.result()
    failed = next((o.error for o in outs if o.error), None)
    if failed and clients_own(failed):
        raise HTTPError(400, clients_own(failed))
    if failed:
        raise HTTPError(500, f"the request failed inside the engine: {failed}", "internal_error")
    return outs


async def stream(engine: AsyncEngine, rid: str, requests: list[EngineRequest], body, kind: str, model: str,
                  choice) -> AsyncIterator[str]:
    """Server-sent events: a chunk per output with something new (the engine's deltas, sent as
    they are), then usage, then [DONE]. An error ends the stream with an error event and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(requests[i]):
                await queue.put((i, out))
        except Exception as exc:  # the engine died, refused it, or the server is shutting down
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(requests))]
    sent: dict[tuple[int, int], int] = {}  # (prompt, completion) -> tokens generated so far
    ended: set[tuple[int, int]] = set()  # completions whose finish_reason was sent
    cached: dict[int, int] = {}  # prompt -> its tokens found in the prefix cache
    try:
        running = len(tasks)
        while running:
            i, out = await queue.get()
            if out is None:
                running -= 1
                continue
            failure = out if isinstance(out, Exception) else (out.error and RuntimeError(out.error))
            if failure:
                yield error_tail(failure)
                return
            choices = []
            cached[i] = max(cached.get(i, 0), getattr(out, "num_cached_tokens", 0))
            for c in out.outputs:
                key = (i, c.index)
                if key in ended:
                    continue
                first = key not in sent
                if first or c.text or c.finish_reason or c.logprobs:
                    choices.append(choice(i, c, first))
                sent[key] = sent.get(key, 0) + len(c.token_ids)  # usage counts tokens whose text is not out yet too
                if c.finish_reason:
                    ended.add(key)
            if choices:
                yield f"data: {json.dumps(envelope(kind, rid, model, choices))}\n\n"
        if body.stream_options and body.stream_options.include_usage:
            prompt = sum(len(r.prompt.token_ids) for r in requests)
            counts = {"prompt_tokens": prompt, "completion_tokens": sum(sent.values()),
                      "total_tokens": prompt + sum(sent.values()),
                      "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}
            yield f"data: {json.dumps(envelope(kind, rid, model, [], {'usage': counts}))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
