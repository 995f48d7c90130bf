"""`vkv serve`: an OpenAI-compatible HTTP server over the engine, with Prometheus metrics.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events that
end with `data: [DONE]`; vLLM's `use_beam_search` turns `n` into a beam width), GET /v1/models,
GET /health, GET /metrics. Binds 127.0.0.1 unless told otherwise; with an API key, /v1 routes want `Authorization: Bearer <key>`. Bodies over
the size limit get 413; bad JSON, bad values and prompts that can never fit get 400; all
errors carry OpenAI's error object, and the server keeps serving. A client that disconnects
aborts its request, which frees its pages. On SIGTERM uvicorn stops accepting, lets requests
in flight finish (up to 10 s), then the app's shutdown stops the engine and frees its memory.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.serving.async_engine import AsyncEngine, EngineDeadError
from engine.serving.protocol import (ChatCompletionRequest, CompletionRequest, chat_logprobs,
                               completion_logprobs, envelope, error_body, new_id, usage)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.inputs import Prompt
from engine.outputs import RequestOutput


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        self.status, self.message, self.kind = status, message, kind


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=status)


class BodyLimit:
    """ASGI middleware: refuse request bodies over max_bytes with 413, declared or streamed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = error(413, f"request body exceeds {self.max_bytes} bytes")
        if declared is not None and int(declared) > self.max_bytes:
            return await too_large(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPError(413, f"request body exceeds {self.max_bytes} bytes")
            return message

        try:
            await self.app(scope, limited, send)
        except HTTPError:
            await too_large(scope, receive, send)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = 1 << 20, max_n: int = 16) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_):
        yield
        engine.shutdown()
        print("vkv: engine stopped, KV memory released", flush=True)

    app = FastAPI(title="vkv", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    tokenizer = engine.engine.tokenizer
    max_len = engine.engine.max_model_len

    @app.exception_handler(HTTPError)
    async def _http_error(_, exc: HTTPError):
        return error(exc.status, exc.message, exc.kind)

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        return error(503, str(exc), "engine_dead")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"invalid request: {where}: {first.get('msg', 'malformed body')}")

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
            raise HTTPError(401, "invalid or missing API key", "authentication_error")

    def check(body) -> None:
        if body.model not in (None, model_name):
            raise HTTPError(404, f"model {body.model!r} does not exist; this server has {model_name!r}",
                            "model_not_found")
        if not 1 <= body.n <= max_n:
            raise HTTPError(400, f"n must be in [1, {max_n}], got {body.n}")

    def prepare(prompts: list, body, max_tokens: int | None, logprobs: int | None):
        """Tokenize and check every prompt before any runs; 400 with the reason if bad."""
        try:
            ids = [engine.engine.tokenize(p).token_ids for p in prompts]
            if max_tokens is None:  # as much as fits after the longest prompt
                max_tokens = max(1, max_len - max(len(i) for i in ids))
            params = body.sampling_params(max_tokens, logprobs)
            for prompt_ids in ids:
                engine.engine.validate(Prompt(prompt_ids), params)
            return params, ids
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc

    @app.get("/health")
    async def health():
        if engine.dead:
            return error(503, str(engine.dead), "engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "vkv",
                                            "max_model_len": max_len}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        params, ids = prepare(body.prompts(), body, body.max_tokens, body.logprobs)
        rid = new_id("cmpl")
        texts = [p if isinstance(p, str) else None for p in body.prompts()]

        def choice(prompt_index: int, c, text: str, start: int = 0) -> dict:
            return {"index": prompt_index * body.n + c.index, "text": text,
                    "logprobs": completion_logprobs(c, tokenizer, start), "finish_reason": c.finish_reason}

        if body.stream:
            chunks = _stream_chunks(engine, rid, ids, params, texts, "text_completion", model_name,
                                    lambda i, c, delta, start: choice(i, c, delta, start), body)
            return StreamingResponse(chunks, media_type="text/event-stream")
        outs = await _collect(engine, rid, ids, params, texts, request)
        return envelope("text_completion", rid, model_name,
                        [choice(i, c, c.text) for i, o in enumerate(outs) for c in o.outputs],
                        {"usage": usage(outs)})

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatCompletionRequest, request: Request):
        check(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:
            raise HTTPError(400, f"cannot apply the chat template: {exc}") from exc
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params, ids = prepare([prompt_ids], body, body.max_completion_tokens or body.max_tokens, logprobs)
        rid = new_id("chatcmpl")

        def choice(_, c, delta: str, start: int) -> dict:
            return {"index": c.index, "delta": ({"role": "assistant"} if start == 0 else {}) | {"content": delta},
                    "logprobs": chat_logprobs(c, tokenizer, start), "finish_reason": c.finish_reason}

        if body.stream:
            chunks = _stream_chunks(engine, rid, ids, params, [prompt], "chat.completion.chunk", model_name,
                                    choice, body)
            return StreamingResponse(chunks, media_type="text/event-stream")
        outs = await _collect(engine, rid, ids, params, [prompt], request)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c, tokenizer), "finish_reason": c.finish_reason}
                   for c in outs[0].outputs]
        return envelope("chat.completion", rid, model_name, choices, {"usage": usage(outs)})

    return app


async def _collect(engine: AsyncEngine, rid: str, ids: list[list[int]], params, texts, request: Request):
    """Run every prompt to the end; abort them all if the client goes away first."""
    async def last(i: int) -> RequestOutput:
        out = None
        async for out in engine.generate(f"{rid}-{i}", ids[i], params, texts[i]):
            pass
        return out

    task = asyncio.ensure_future(asyncio.gather(*(last(i) for i in range(len(ids)))))
    while not task.done():
        await asyncio.wait([task], timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise HTTPError(499, "client disconnected")
    return task.result()


async def _stream_chunks(engine: AsyncEngine, rid: str, ids, params, texts, kind: str, model: str,
                         choice, body) -> AsyncIterator[str]:
    """Server-sent events: one chunk per new text of any completion, then usage, then [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for out in engine.generate(f"{rid}-{i}", ids[i], params, texts[i]):
                await queue.put((i, out))
        except Exception as exc:  # the engine died or refused it: the stream ends with the error
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(ids))]
    sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, completion) -> (chars, tokens)
    finals: dict[int, RequestOutput] = {}
    try:
        running = len(tasks)
        while running:
            i, out = await queue.get()
            if out is None:
                running -= 1
                continue
            if isinstance(out, Exception):
                yield f"data: {json.dumps(error_body(str(out), type(out).__name__, 500))}\n\n"
                break
            finals[i] = out
            choices = []
            for c in out.outputs:
                chars, tokens = sent.get((i, c.index), (0, 0))
                if len(c.text) > chars or c.finish_reason or len(c.token_ids) > tokens and c.logprobs:
                    choices.append(choice(i, c, c.text[chars:], tokens))
                    sent[(i, c.index)] = (len(c.text), len(c.token_ids))
            if choices:
                yield f"data: {json.dumps(envelope(kind, rid, model, choices))}\n\n"
        if body.stream_options and body.stream_options.include_usage:
            yield f"data: {json.dumps(envelope(kind, rid, model, [], {'usage': usage(list(finals.values()))}))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


def serve(args) -> None:
    import uvicorn

    engine = LLMEngine(EngineConfig.from_cli_args(args))
    name = args.served_model_name or (args.model.rstrip("/").split("/")[-1] if args.model
                                      else "SmolLM2-135M-Instruct")
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, name, args.api_key, args.max_body_bytes)
    print(f"vkv: serving {name} on http://{args.host}:{args.port} "
          f"({engine.config.kv_layout} KV, {engine.attention} attention)", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=10)
    finally:  # when uvicorn did not get as far as the app's shutdown
        async_engine.shutdown()
