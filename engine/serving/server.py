"""`vkv serve`: an OpenAI-compatible HTTP server over the engine, with Prometheus metrics.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming as server-sent events that
end with `data: [DONE]`), GET /v1/models, GET /health, GET /metrics, GET /openapi.json. Binds
127.0.0.1 unless told otherwise; with an API key, /v1 routes want `Authorization: Bearer <key>`.

No request can hurt another's: bad JSON, unknown fields, bad values and prompts that can never
fit get a 400 naming the problem (unknown model 404, wrong key 401, too large 413, too slow
408), each with OpenAI's error object, and nothing reaches the engine. A request that fails
inside the engine fails alone (500, or an error event in its stream). One request may ask for
at most `max_prompts_per_request` sequences (prompts x n), and admission is fair between requests.
A client that disconnects aborts its request, which frees its pages. On SIGTERM the server
stops accepting, lets requests in flight finish for `--shutdown-timeout` seconds, ends the
streams still running with an error event and [DONE], then stops the engine and frees its
memory.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import signal
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EngineConfig
from engine.inputs import Prompt, check_cache_salt
from engine.llm_engine import LLMEngine
from engine.lora import LoRARequest
from engine.multi import MultiLLM
from engine.outputs import RequestOutput, RequestOutputKind
from engine.processor import EngineRequest
from engine.sampling_params import SamplingParams
from engine.serving.async_engine import SLEEPING, AsyncEngine, EngineDeadError, RequestCancelled, Turns
from engine.serving.http import BodyGuard, GuardedH11Protocol
from engine.serving.metrics import Metrics
from engine.serving.options import ServerOptions
from engine.serving.tools import calls_in, guide, render, tool_use
from engine.structured import StructuredOutputsParams
from engine.serving.protocol import (ChatCompletionRequest, CompletionRequest, KVLimitRequest, LoadLoRARequest,
                                     NamedToolChoice, PauseRequest, TokenText, UnloadLoRARequest, UpdateWeightsRequest,
                                     envelope, error_body, new_id, parse_limit, usage)

log = logging.getLogger("vkv.server")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        self.status, self.message, self.kind = status, message, kind


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, kind, status), status_code=status)


def _with_limits(schema: dict, app: FastAPI, vocab: int, max_n: int) -> dict:
    """The OpenAPI schema with this server's own limits written in: token ids in [0, vocab) (a
    prompt's, stop_token_ids) and n, best_of at most --max-n; cached as FastAPI caches its own."""
    def token_ids(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node.update(minimum=0, maximum=vocab - 1)
            for child in node.values():
                token_ids(child)
        elif isinstance(node, list):
            for child in node:
                token_ids(child)

    models = schema.get("components", {}).get("schemas", {})
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = models.get(name, {}).get("properties", {})
        for field in ("prompt", "stop_token_ids"):
            token_ids(properties.get(field, {}).get("anyOf") or properties.get(field, {}).get("items"))
        for field in ("n", "best_of"):
            if field in properties:
                for branch in properties[field].get("anyOf", [properties[field]]):
                    if branch.get("type") == "integer":
                        branch["maximum"] = max_n
    app.openapi_schema = schema
    return schema


def build_app(engines: AsyncEngine | dict[str, AsyncEngine], model_name: str | None = None,
              options: ServerOptions = ServerOptions(), group: MultiLLM | None = None,
              adapters: dict[str, str] | None = None) -> FastAPI:
    """The app over one engine (served as model_name) or several ({name: engine}, the models of
    `group`, which share its KV pool); of `options` it reads the API key and the limits.
    adapters: {LoRA adapter name: path} over the (first) model, loaded here; a request's
    `model` names a model or an adapter."""
    api_key, limits = options.api_key, options
    engines = engines if isinstance(engines, dict) else {model_name: engines}
    default = next(iter(engines))
    if adapters and not engines[default].lora_enabled:
        raise ValueError("LoRA adapters need enable_lora (--enable-lora)")
    taken = [name for name in adapters or {} if name in engines]
    if taken:
        raise ValueError(f"LoRA adapter name {taken[0]!r} is a model's name")
    engines[default].load_adapters(adapters or {})

    def loras() -> dict[str, tuple[str, LoRARequest]]:
        """Every adapter served, from the engines' own registries: name -> (its base model, request)."""
        return {name: (model, lora) for model, e in engines.items() for name, lora in e.adapters().items()}

    texts = {name: TokenText(e.tokenizer) for name, e in engines.items()}

    @asynccontextmanager
    async def lifespan(_):
        yield
        for engine in engines.values():
            engine.shutdown()
        if group is not None:
            group.close()
        print("vkv: engine stopped, KV memory released", flush=True)

    app = FastAPI(title="vkv", docs_url=None, redoc_url=None, lifespan=lifespan)
    vocab = min(e.vocab_size for e in engines.values())
    app.openapi = lambda: app.openapi_schema or _with_limits(FastAPI.openapi(app), app, vocab, limits.max_n)
    app.add_middleware(BodyGuard, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout)

    def base(model: str | None) -> tuple[str, AsyncEngine]:
        """The model a request names (none: the first), or 404."""
        if model is None:
            return default, engines[default]
        if model not in engines:
            raise HTTPError(404, f"model {model!r} does not exist; this server has "
                                 f"{', '.join(map(repr, [*engines, *loras()]))}", "model_not_found")
        return model, engines[model]

    def pick(model: str | None) -> tuple[str, str, AsyncEngine, LoRARequest | None]:
        """What a generation request's `model` names: (that name, its base model, the base's
        engine, the LoRA adapter or None); 404 for a name this server does not have."""
        if model is not None and model not in engines and model in (served := loras()):
            parent, lora = served[model]
            return model, parent, engines[parent], lora
        name, engine = base(model)
        return name, name, engine, None

    def named(model: str | None) -> dict[str, AsyncEngine]:
        """An admin route's models: the one named, or all."""
        return dict([base(model)]) if model is not None else engines

    @app.exception_handler(HTTPError)
    async def _http_error(_, exc: HTTPError):
        return error(exc.status, exc.message, exc.kind)

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        return error(503, str(exc), "engine_dead")

    @app.exception_handler(RequestCancelled)
    async def _cancelled(_, exc: RequestCancelled):
        return error(503, str(exc), "service_unavailable")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        # A union (a message's roles, text or parts) reports an error per branch: the deepest is
        # the one that says what is wrong; the branches' own labels are left out of its path.
        errors = exc.errors()
        first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
        labels = {"str", "int", "float", "bool", "dict", "list", "none", "body"}
        where = ".".join(str(p) for p in first.get("loc", ())
                         if isinstance(p, int) or (p not in labels and str(p).isidentifier()))
        return error(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed body')}")

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(_, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _bug(_, exc: Exception):
        log.exception("unexpected error", exc_info=exc)
        return error(500, f"internal error: {type(exc).__name__}", "internal_error")

    def client_of(request: Request, body) -> str:
        """Who asks: the API key that authenticated it (one key: everyone), else the peer
        address, with OpenAI's `user` field when the request names one. A replica behind the
        front door (which checked the client and holds the replica's key) takes its word."""
        if options.replica_rank is not None and (forwarded := request.headers.get("x-vkv-client")):
            return forwarded
        who = "key" if api_key is not None else (request.client.host if request.client else "unknown")
        return f"{who}/{body.user}" if body.user else who

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
            raise HTTPError(401, "invalid or missing API key", "authentication_error")

    def check(engine: AsyncEngine, body, best_of: int | None = None) -> None:
        if engine.is_sleeping:
            raise HTTPError(503, SLEEPING, "service_unavailable")
        if engine.weights_empty:
            raise HTTPError(503, "the weights woke up empty after sleep level 2: POST /update_weights_from_disk "
                            "first", "service_unavailable")
        for name, value in (("n", body.n), ("best_of", best_of)):
            if value is not None and not 1 <= value <= limits.max_n:
                raise HTTPError(400, f"{name} must be in [1, {limits.max_n}], got {value}")
        if body.stream_options is not None and not body.stream:
            raise HTTPError(400, "stream_options needs stream: true")

    async def prepare(engine: AsyncEngine, rid: str, client: str, prompts: list[Prompt], body,
                      max_tokens: int | None, logprobs: int | None, best_of: int | None = None,
                      structured: StructuredOutputsParams | None = None, deltas: bool = False,
                      prompt_logprobs: int | None = None, lora: LoRARequest | None = None) -> list[EngineRequest]:
        """Check the request whole before any of it runs (one engine request per prompt, all in
        the client's group: the scheduler shares seats between groups); 400 with the reason if
        bad. deltas: outputs hold what is new (a stream)."""
        per_prompt = max(body.n, best_of or 0)
        if len(prompts) * per_prompt > limits.max_prompts_per_request:
            raise HTTPError(400, f"{len(prompts)} prompts x {per_prompt} sequences exceed the "
                                 f"{limits.max_prompts_per_request} one request may ask for")
        try:
            params = body.sampling_params(max_tokens, logprobs, best_of)  # max_tokens None: as many as fit
            if structured is not None:  # a forced tool call
                params.structured_outputs = structured
            if prompt_logprobs is not None:  # echo with logprobs
                params = dataclasses.replace(params, prompt_logprobs=prompt_logprobs)
            if deltas and isinstance(params, SamplingParams):
                params.output_kind = RequestOutputKind.DELTA
            return [await engine.process(f"{rid}-{i}", prompt, params, client, body.priority, lora)
                    for i, prompt in enumerate(prompts)]
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc

    def salted(prompts: list[Prompt], body, client: str) -> list[Prompt]:
        """The request's cache_salt on each of its prompts (with --isolate-clients, by default
        a digest of its client's identity)."""
        try:
            salt = check_cache_salt(body.cache_salt)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc
        if salt is None and options.isolate_clients:
            salt = "client:" + hashlib.sha256(client.encode()).hexdigest()
        return [dataclasses.replace(p, cache_salt=salt) for p in prompts] if salt is not None else prompts

    async def tokenize(engine: AsyncEngine, raw_prompts: list, client: str) -> list[Prompt]:
        prompts = []
        for i, raw in enumerate(raw_prompts):
            try:
                prompts.append(await engine.tokenize(raw, client))
            except ValueError as exc:
                where = f"prompt[{i}]: " if len(raw_prompts) > 1 else ""
                raise HTTPError(400, where + str(exc)) from exc
        return prompts

    @app.get("/health")
    async def health():
        dead = next((e.dead for e in engines.values() if e.dead), None)
        if dead:
            return error(503, str(dead), "engine_dead")
        stalled = next((why for e in engines.values() if (why := e.stalled())), None)
        if stalled:
            return error(503, stalled, "engine_stalled")
        return {"status": "ok"}

    # Behind the key when there is one: the prefix-cache counters and prefill timings would let
    # one client probe what another's prompts hold. --metrics-public opens it again.
    @app.get("/metrics", dependencies=[] if options.metrics_public else [Depends(authorize)])
    async def metrics():
        if group is None:
            text = engines[default].metrics.render(await engines[default].fresh_stats())
        else:
            text = engines[default].metrics.render({name: await e.fresh_stats() for name, e in engines.items()})
        return Response(text, media_type="text/plain; version=0.0.4")

    # vLLM's sleep mode: /sleep drains the requests in flight (new ones get 503), then releases
    # every physical KV page (level 1) and the weights' pages too (level 2: sleep mode and
    # --enable-weight-updates); /wake_up?tags=weights&tags=kv_cache maps memory back at the same
    # addresses. Nothing above is rebuilt. Admin routes, as in vLLM: left out of the OpenAPI
    # schema. With several models, ?model=NAME picks one (default: all of them).
    @app.post("/sleep", dependencies=[Depends(authorize)], include_in_schema=False)
    async def sleep(level: int = Query(1, ge=1, le=2, description="1: the KV cache's pages go; 2: the weights' too"),
                    model: str | None = None):
        engines = named(model)
        if level == 2:
            weight_updates()  # (the weights must come back through an update)
        try:
            asleep = [await e.sleep(level) for e in engines.values()]
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc
        return {"is_sleeping": all(asleep)}  # False: a wake-up came while the requests in flight drained

    @app.post("/wake_up", dependencies=[Depends(authorize)], include_in_schema=False)
    async def wake_up(model: str | None = None, tags: list[str] | None = Query(None)):
        try:
            for e in named(model).values():
                await e.wake_up(tags)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc
        return {"is_sleeping": any(e.engine.is_sleeping for e in named(model).values())}

    @app.get("/is_sleeping", dependencies=[Depends(authorize)], include_in_schema=False)
    async def is_sleeping(model: str | None = None):
        return {"is_sleeping": all(e.is_sleeping for e in named(model).values())}

    # An RL loop's routes (SGLang's names; engine/models/weights.py), behind the key and
    # --enable-weight-updates: they stop generation and read a directory of the server's machine.
    def weight_updates() -> None:
        if not options.enable_weight_updates:
            raise HTTPError(403, "weight updates are off: start the server with --enable-weight-updates",
                            "permission_error")

    @app.post("/pause_generation", dependencies=[Depends(authorize)], include_in_schema=False)
    async def pause_generation(body: PauseRequest):
        weight_updates()
        for e in named(body.model).values():
            await e.pause_generation(body.mode)
        return {"paused": True, "mode": body.mode}

    @app.post("/continue_generation", dependencies=[Depends(authorize)], include_in_schema=False)
    async def continue_generation(model: str | None = None):
        weight_updates()
        for e in named(model).values():
            await e.continue_generation()
        return {"paused": False}

    @app.post("/update_weights_from_disk", dependencies=[Depends(authorize)], include_in_schema=False)
    async def update_weights_from_disk(body: UpdateWeightsRequest):
        weight_updates()
        try:
            for e in named(body.model).values():
                await e.update_weights_from_disk(body.model_path)
        except (ValueError, FileNotFoundError) as exc:
            raise HTTPError(400, str(exc)) from exc
        except RuntimeError as exc:  # requests in flight: pause first
            raise HTTPError(409, str(exc), "conflict") from exc
        return {"success": True, "weights_version": [e.engine.weights_version for e in named(body.model).values()]}

    # kvcached's kvctl: each model's floor and cap of the shared KV pool, read and set at run time.
    @app.get("/kv_limits", dependencies=[Depends(authorize)], include_in_schema=False)
    async def kv_limits():
        if group is None:
            raise HTTPError(404, "this server has one model: it has the whole KV pool", "not_found")
        return group.limits()

    @app.post("/kv_limits", dependencies=[Depends(authorize)], include_in_schema=False)
    async def set_kv_limits(body: KVLimitRequest):
        if group is None:
            raise HTTPError(404, "this server has one model: it has the whole KV pool", "not_found")
        base(body.model)
        try:
            if body.min is None and body.max is None:
                raise ValueError("give min, max or both (one left out keeps its current value)")
            now = group.limits()[body.model]
            group.set_limits(body.model, parse_limit(now["min_bytes"] if body.min is None else body.min),
                             parse_limit(now["max_bytes"] if body.max is None else body.max))
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc
        return group.limits()

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        cards = [{"id": name, "object": "model", "owned_by": "vkv", "root": name, "parent": None,
                  "max_model_len": e.max_model_len} for name, e in engines.items()]
        cards += [{"id": name, "object": "model", "owned_by": "vkv", "root": name, "parent": parent,
                   "max_model_len": engines[parent].max_model_len} for name, (parent, _) in loras().items()]
        return {"object": "list", "data": cards}

    # vLLM's runtime adapter routes (there behind VLLM_ALLOW_RUNTIME_LORA_UPDATING, here behind
    # --allow-runtime-lora-updating): they read a directory of the server's file system.
    def runtime_lora(parent: str) -> AsyncEngine:
        if not options.allow_runtime_lora_updating:
            raise HTTPError(404, "loading adapters at run time is off: start the server with "
                                 "--allow-runtime-lora-updating", "not_found")
        engine = base(parent)[1]
        if not engine.lora_enabled:
            raise HTTPError(400, "LoRA is not enabled: start the server with --enable-lora")
        return engine

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorize)], include_in_schema=False)
    async def load_lora_adapter(body: LoadLoRARequest):
        parent = body.model if body.model is not None else default  # "" names no model: 404, as elsewhere
        engine = runtime_lora(parent)
        if body.lora_name in loras() or body.lora_name in engines:
            raise HTTPError(400, f"the name {body.lora_name!r} is taken: unload it first")
        try:
            await engine.add_lora(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorize)], include_in_schema=False)
    async def unload_lora_adapter(body: UnloadLoRARequest):
        served = loras()
        if body.lora_name not in served:
            runtime_lora(default)
            raise HTTPError(404, f"no LoRA adapter named {body.lora_name!r}", "not_found")
        parent, _ = served[body.lora_name]
        runtime_lora(parent).remove_lora(body.lora_name)  # requests running with it finish with it
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        model_name, parent, engine, lora = pick(body.model)
        tokens = texts[parent]
        check(engine, body, body.best_of)
        if body.suffix:
            raise HTTPError(400, "suffix is not supported: the model has no fill-in-the-middle mode")
        scored = body.echo and body.logprobs is not None  # the prompt's tokens get logprobs too
        if scored and body.stream:
            raise HTTPError(400, "echo with logprobs is not streamed: ask without stream")
        if body.stream and body.best_of is not None and body.best_of > body.n:
            raise HTTPError(400, "best_of > n cannot be streamed: the best are known only at the end")
        raw = body.prompts()
        if not raw:
            raise HTTPError(400, "prompt must not be empty")
        client = client_of(request, body)
        prompts = salted(await tokenize(engine, raw, client), body, client)
        rid = new_id("cmpl")
        requests = await prepare(engine, rid, client, prompts, body, body.max_tokens, body.logprobs, body.best_of,
                                 deltas=body.stream, prompt_logprobs=body.logprobs if scored else None, lora=lora)
        echoes = [(p.text if p.text is not None else engine.tokenizer.decode(p.token_ids)) if body.echo else ""
                  for p in prompts]

        def choice(i: int, c, first: bool = True) -> dict:
            return {"index": i * body.n + c.index, "text": (echoes[i] if first else "") + c.text,
                    "logprobs": tokens.completion_logprobs(c), "finish_reason": c.finish_reason}

        if body.stream:
            chunks = _stream(engine, rid, requests, body, "text_completion", model_name, choice)
            return StreamingResponse(chunks, media_type="text/event-stream")
        outs = await _collect(engine, requests, request)
        choices = [choice(i, c) for i, o in enumerate(outs) for c in o.outputs]
        if scored:  # the echoed prompt's tokens first, then the completion's (text offsets after the prompt)
            for ch, (i, o) in zip(choices, ((i, o) for i, o in enumerate(outs) for _ in o.outputs)):
                ch["logprobs"] = tokens.echoed_logprobs(o.prompt_logprobs, o.prompt_token_ids, ch["logprobs"],
                                                        len(echoes[i]))
        return envelope("text_completion", rid, model_name, choices, {"usage": usage(outs)})

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(body: ChatCompletionRequest, request: Request):
        model_name, parent, engine, lora = pick(body.model)
        tokens = texts[parent]
        check(engine, body)
        if body.top_logprobs is not None and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true")
        try:
            choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) else body.tool_choice
            use = tool_use(body.tools, choice, body.parallel_tool_calls)
            forced = guide(use)
            if forced and (body.structured() is not None or body.use_beam_search):
                raise ValueError("a forced tool call is a structured output: give tool_choice or a structured output "
                                 "(or beam search), not both")
            if forced and (body.stop or body.stop_token_ids):
                raise ValueError("stop and stop_token_ids cannot be combined with a forced tool call (tool_choice "
                                 "required or naming a function): they would cut the call's arguments")
            conversation, template_tools = render(body.conversation(), use, engine.template_takes_tools)
            client = client_of(request, body)
            prompt, = salted([await engine.chat_prompt(conversation, client, template_tools)], body, client)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(body, name) is not None and getattr(body, name) < 1:
                raise HTTPError(400, f"{name} must be >= 1, got {getattr(body, name)}")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        rid = new_id("chatcmpl")
        requests = await prepare(engine, rid, client, [prompt], body, max_tokens, logprobs, structured=forced,
                                 deltas=body.stream and not use.offered, lora=lora)

        def message(c) -> tuple[dict, str | None]:
            """The completion as an assistant message, its tool calls parsed, and why it ended."""
            content, calls = c.text, []
            if use.offered and c.finish_reason == "stop":
                try:
                    content, calls = calls_in(c.text, use)
                except (ValueError, KeyError, TypeError):  # not the JSON the grammar allows: left as text
                    pass
            return ({"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {}),
                    "tool_calls" if calls else c.finish_reason)

        def choice(_, c, first: bool) -> dict:
            return {"index": c.index, "delta": ({"role": "assistant"} if first else {}) | {"content": c.text},
                    "logprobs": tokens.chat_logprobs(c), "finish_reason": c.finish_reason}

        if body.stream and use.offered:  # calls are known at the end: one chunk per choice, then [DONE]
            return StreamingResponse(_tool_stream(engine, rid, requests, body, model_name, message,
                                                  tokens.chat_logprobs), media_type="text/event-stream")
        if body.stream:
            chunks = _stream(engine, rid, requests, body, "chat.completion.chunk", model_name, choice)
            return StreamingResponse(chunks, media_type="text/event-stream")
        outs = await _collect(engine, requests, request)
        choices = []
        for c in outs[0].outputs:
            said, reason = message(c)
            choices.append({"index": c.index, "message": said, "logprobs": tokens.chat_logprobs(c),
                            "finish_reason": reason})
        return envelope("chat.completion", rid, model_name, choices, {"usage": usage(outs)})

    return app


async def _tool_stream(engine: AsyncEngine, rid: str, requests: list[EngineRequest], body, model: str,
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
        yield _error_event(exc)
        yield "data: [DONE]\n\n"
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


def _error_event(failure: Exception) -> str:
    """The server-sent event that ends a failed stream: 503 if the engine died or the server
    is stopping, 400 if the request failed of its own doing, else 500."""
    status, message = (503 if isinstance(failure, (EngineDeadError, RequestCancelled)) else 500), str(failure)
    if status == 500 and _clients_own(message):
        status, message = 400, _clients_own(message)
    return f"data: {json.dumps(error_body(message, type(failure).__name__, status))}\n\n"


def _clients_own(failure: str) -> str | None:
    """What to tell the client when its request failed of its own doing (a 400), else None."""
    if failure.startswith("SamplingError") and "allows no token" in failure:
        return ("the request's constraints (min_tokens, stop_token_ids, logit_bias or a structured output) "
                "allow no next token")
    if failure.startswith("GrammarError: "):
        return failure.removeprefix("GrammarError: ")
    return None


async def _collect(engine: AsyncEngine, requests: list[EngineRequest], request: Request) -> list[RequestOutput]:
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
    if failed and _clients_own(failed):
        raise HTTPError(400, _clients_own(failed))
    if failed:
        raise HTTPError(500, f"the request failed inside the engine: {failed}", "internal_error")
    return outs


async def _stream(engine: AsyncEngine, rid: str, requests: list[EngineRequest], body, kind: str, model: str,
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
                yield _error_event(failure)
                break
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
        else:
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


def _graceful_server(config: uvicorn.Config, engines: list[AsyncEngine], grace: float) -> uvicorn.Server:
    """uvicorn's server, except that streams still running at the end of the grace period end
    with an error event and [DONE] instead of being cut off mid-body."""

    def cancel_all() -> None:
        for engine in engines:
            engine.cancel_all("the server is shutting down")

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            cut = asyncio.get_running_loop().call_later(max(grace - 1.0, 0.0), cancel_all)
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    return Server(config)


def serve(args, options: ServerOptions) -> None:
    """One server (a replica of a front door's too) on uvicorn, until SIGTERM or SIGINT."""
    if options.replica_rank is not None:
        _title(f"vkv: rank {options.replica_rank}")
    app, async_engines, what = make_app(args, options)
    protocol = type("GuardedH11", (GuardedH11Protocol,), {"header_timeout": options.header_timeout, "peers": Counter(),
                                                          "max_per_peer": options.max_connections_per_peer})
    print(f"vkv: serving {what} on http://{options.host}:{options.port}", flush=True)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level, http=protocol,
                            timeout_keep_alive=options.timeout_keep_alive,
                            limit_concurrency=options.limit_concurrency,
                            timeout_graceful_shutdown=options.shutdown_timeout)
    # uvicorn re-raises SIGTERM/SIGINT once it has shut down, with the handler it found: make
    # that a clean exit (status 0) rather than death by signal (143), as supervisors expect.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    try:
        _graceful_server(config, list(async_engines.values()), options.shutdown_timeout).run()
    finally:  # when uvicorn did not get as far as the app's shutdown
        for async_engine in async_engines.values():
            async_engine.shutdown()


def make_app(args, options: ServerOptions) -> tuple[FastAPI, dict[str, AsyncEngine], str]:
    """The app `vkv serve` serves, its engines (by served name), and a line saying what it is."""
    adapters = parse_lora_modules(options.lora_modules)
    models = dict(m.split("=", 1) for m in args.model or [] if "=" in m)
    if models:  # several models, one KV pool
        if len(models) != len(args.model):
            raise SystemExit("vkv serve: with several models every --model is NAME=SOURCE")
        config = EngineConfig.from_cli_args(argparse.Namespace(**{**vars(args), "model": None}))
        group = MultiLLM.from_config({name: source or None for name, source in models.items()}, config,
                                     {name: limit for name, limit in map(parse_kv_limit, options.kv_limit)})
        metrics, turns = Metrics(list(models), group.shared), Turns(group.shared_step_tokens)
        async_engines = {name: AsyncEngine(engine, name, metrics, turns, options.idle_sleep_seconds,
                                           options.health_stall_seconds)
                         for name, engine in group.engines.items()}
        app = lora_app(async_engines, options, adapters, group)
        what = f"{', '.join(models)} over one {config.kv_layout} KV pool of {group.shared.pool.num_pages} pages"
    else:
        if options.kv_limit or options.idle_sleep_seconds is not None:
            raise SystemExit("vkv serve: --kv-limit and --idle-sleep-seconds are for several models "
                             "(--model NAME=SOURCE ...)")
        engine = LLMEngine(EngineConfig.from_cli_args(args))
        source = (args.model or [None])[-1]
        name = options.served_model_name or (source.rstrip("/").split("/")[-1] if source else "SmolLM2-135M-Instruct")
        async_engines = {name: AsyncEngine(engine, stall_seconds=options.health_stall_seconds)}
        app = lora_app(async_engines, options, adapters)
        what = f"{name} ({engine.config.kv_layout} KV, {engine.attention.name} attention)"
    if adapters:
        what += f", LoRA adapters {', '.join(adapters)}"
    return app, async_engines, what


def parse_lora_modules(items: tuple[str, ...]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... (or vLLM's JSON form {"name": ..., "path": ...})."""
    adapters = {}
    for item in items:
        try:
            spec = json.loads(item) if item.lstrip().startswith("{") else dict(zip(("name", "path"), item.split("=", 1)))
        except ValueError:
            spec = {}
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise SystemExit(f"vkv serve: --lora-modules {item!r}: expected NAME=PATH")
        adapters[spec["name"]] = spec["path"]
    return adapters


def lora_app(engines: dict[str, AsyncEngine], options: ServerOptions, adapters: dict[str, str],
             group: MultiLLM | None = None) -> FastAPI:
    """build_app, with the adapters loaded first: one that does not load stops the server."""
    try:
        return build_app(engines, options=options, group=group, adapters=adapters)
    except ValueError as exc:
        for engine in engines.values():
            engine.shutdown()
        raise SystemExit(f"vkv serve: {exc}") from None


def parse_kv_limit(text: str) -> tuple[str, tuple[float | int, float | int]]:
    """--kv-limit NAME=MIN:MAX, each bytes or a percentage of the pool."""
    name, sep, limits = text.partition("=")
    low, colon, high = limits.partition(":")
    if not (sep and colon and name):
        raise SystemExit(f"vkv serve: --kv-limit {text!r}: expected NAME=MIN:MAX, e.g. chat=10%:60%")
    try:
        return name, (parse_limit(low or 0), parse_limit(high or "100%"))
    except ValueError as exc:
        raise SystemExit(f"vkv serve: --kv-limit {text!r}: {exc}") from None


def _title(title: str) -> None:
    """Name this process for `ps` (vLLM titles its engines the same way), where the OS lets us."""
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:  # the kernel's 15-character name at least
        import ctypes
        try:
            ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)
