"""What every route of the server reads: one `ServerState`, built once by `build_app` and kept as
`app.state.vkv`; the routes (engine/serving/api/routes/) take it with `Depends(state_of)`.

Who writes what: `build_app` makes the state; nothing writes it afterwards. Adapters live in the
engines' own registries (`AsyncEngine.adapters`), written by the engine's side, so the state
holds no second registry. Every engine call goes through the `AsyncEngine` of its model.

A request's checks, in one place each: which model it names (`base`, `pick`, `named`), who asks
(`client_of`), the key (`authorize`), the limits and the engine's state (`check`), the whole
request before any of it runs (`prepare`), its prompts (`tokenize`, `salted`), and the flags
that open the RL and adapter routes (`weight_updates`, `runtime_lora`). A refusal is an
`HTTPError`, which the app turns into OpenAI's error object.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from fastapi import Request

from engine.request.inputs import Prompt, check_cache_salt
from engine.request.lora_request import LoRARequest
from engine.multi import MultiLLM
from engine.request.outputs import RequestOutputKind
from engine.core.processor import EngineRequest
from engine.request.sampling_params import SamplingParams
from engine.serving.loop.async_engine import SLEEPING, AsyncEngine
from engine.serving.options import ServerOptions
from engine.serving.edge import UNAUTHORIZED, client_of, client_salt, key_ok
from engine.serving.api.token_text import TokenText
from engine.request.structured import StructuredOutputsParams


class HTTPError(Exception):
    """A refusal: its status, OpenAI's error type, the message the client reads, and for a 503
    the seconds to wait before a retry (Retry-After)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 retry_after: float | None = None):
        self.status, self.message, self.kind, self.retry_after = status, message, kind, retry_after


def state_of(request: Request) -> ServerState:
    """The server's state (a route's dependency)."""
    return request.app.state.vkv


def authorize(request: Request) -> None:
    """The API key, when the server has one (a route's dependency)."""
    state_of(request).authorize(request)


@dataclass
class ServerState:
    engines: dict[str, AsyncEngine]  # by served name; the first is the default model
    options: ServerOptions
    group: MultiLLM | None = None  # several models over one KV pool (their engines are `engines`)
    default: str = field(init=False)
    texts: dict[str, TokenText] = field(init=False)  # each model's tokens as text (logprobs)

    def __post_init__(self):
        self.default = next(iter(self.engines))
        self.texts = {name: TokenText(e.tokenizer) for name, e in self.engines.items()}

    # -- which model ------------------------------------------------------------------------
    def loras(self) -> dict[str, tuple[str, LoRARequest]]:
        """Every adapter served, from the engines' own registries: name -> (its base model, request)."""
        return {name: (model, lora) for model, e in self.engines.items() for name, lora in e.adapters().items()}

    def base(self, model: str | None) -> tuple[str, AsyncEngine]:
        """The model a request names (none: the first), or 404."""
        if model is None:
            return self.default, self.engines[self.default]
        if model not in self.engines:
            raise HTTPError(404, f"model {model!r} does not exist; this server has "
                                 f"{', '.join(map(repr, [*self.engines, *self.loras()]))}", "model_not_found")
        return model, self.engines[model]

    def pick(self, model: str | None) -> tuple[str, str, AsyncEngine, LoRARequest | None]:
        """What a generation request's `model` names: (that name, its base model, the base's
        engine, the LoRA adapter or None); 404 for a name this server does not have."""
        if model is not None and model not in self.engines and model in (served := self.loras()):
            parent, lora = served[model]
            return model, parent, self.engines[parent], lora
        name, engine = self.base(model)
        return name, name, engine, None

    def named(self, model: str | None) -> dict[str, AsyncEngine]:
        """An admin route's models: the one named, or all."""
        return dict([self.base(model)]) if model is not None else self.engines

    # -- who asks ---------------------------------------------------------------------------
    def client_of(self, request: Request, body) -> str:
        """Who asks: the API key that authenticated it (one key: everyone), else the peer
        address, with OpenAI's `user` field when the request names one. A replica behind the
        front door (which checked the client and holds the replica's key) takes its word."""
        if self.options.replica_rank is not None and (forwarded := request.headers.get("x-vkv-client")):
            return forwarded
        return client_of(self.options.api_key, request.client.host if request.client else None,
                         getattr(body, "user", None))

    def authorize(self, request: Request) -> None:
        if not key_ok(request.headers.get("authorization"), self.options.api_key):
            raise HTTPError(401, UNAUTHORIZED, "authentication_error")

    # -- a generation request ---------------------------------------------------------------
    def check(self, engine: AsyncEngine, body, best_of: int | None = None) -> None:
        if engine.is_sleeping:
            raise HTTPError(503, SLEEPING, "service_unavailable")
        if engine.weights_empty:
            raise HTTPError(503, "the weights woke up empty after sleep level 2: POST /update_weights_from_disk "
                            "first", "service_unavailable")
        for name, value in (("n", body.n), ("best_of", best_of)):
            if value is not None and not 1 <= value <= self.options.max_n:
                raise HTTPError(400, f"{name} must be in [1, {self.options.max_n}], got {value}")
        if body.stream_options is not None and not body.stream:
            raise HTTPError(400, "stream_options needs stream: true")

    async def prepare(self, engine: AsyncEngine, rid: str, client: str, prompts: list[Prompt], body,
                      max_tokens: int | None, logprobs: int | None, best_of: int | None = None,
                      structured: StructuredOutputsParams | None = None, deltas: bool = False,
                      prompt_logprobs: int | None = None, lora: LoRARequest | None = None) -> list[EngineRequest]:
        """Check the request whole before any of it runs (one engine request per prompt, all in
        the client's group: the scheduler shares seats between groups); 400 with the reason if
        bad. deltas: outputs hold what is new (a stream)."""
        per_prompt, most = max(body.n, best_of or 0), self.options.max_prompts_per_request
        if len(prompts) * per_prompt > most:
            raise HTTPError(400, f"{len(prompts)} prompts x {per_prompt} sequences exceed the "
                                 f"{most} one request may ask for")
        try:
            params = body.sampling_params(max_tokens, logprobs, best_of)  # max_tokens None: as many as fit
            if structured is not None:  # a forced tool call
                params.structured_outputs = structured
            if prompt_logprobs is not None:  # echo with logprobs
                params = dataclasses.replace(params, prompt_logprobs=prompt_logprobs)
            if deltas and isinstance(params, SamplingParams):
                params.output_kind = RequestOutputKind.DELTA
            return [await engine.preprocess.process(f"{rid}-{i}", prompt, params, client, body.priority, lora)
                    for i, prompt in enumerate(prompts)]
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc

    def salted(self, prompts: list[Prompt], body, client: str) -> list[Prompt]:
        """The request's cache_salt on each of its prompts (with --isolate-clients, by default
        a digest of its client's identity)."""
        try:
            salt = check_cache_salt(body.cache_salt)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from exc
        if salt is None and self.options.isolate_clients:
            salt = client_salt(client)
        return [dataclasses.replace(p, cache_salt=salt) for p in prompts] if salt is not None else prompts

    @staticmethod
    async def tokenize(engine: AsyncEngine, raw_prompts: list, client: str) -> list[Prompt]:
        prompts = []
        for i, raw in enumerate(raw_prompts):
            try:
                prompts.append(await engine.preprocess.tokenize(raw, client))
            except ValueError as exc:
                where = f"prompt[{i}]: " if len(raw_prompts) > 1 else ""
                raise HTTPError(400, where + str(exc)) from exc
        return prompts

    async def unpaused(self, engine: AsyncEngine) -> None:
        """A request made while generation is paused (an RL loop loading new weights) waits for it
        to go on, at most --pause-wait-seconds, then gets 503 with Retry-After."""
        deadline = time.monotonic() + self.options.pause_wait_seconds
        while engine.engine.paused:
            if time.monotonic() >= deadline:
                raise HTTPError(503, f"generation is paused (new weights are being loaded) and did not go on within "
                                     f"{self.options.pause_wait_seconds:g} s: retry shortly", "service_unavailable",
                                retry_after=max(1.0, self.options.pause_wait_seconds / 2))
            await asyncio.sleep(0.05)

    # -- the routes behind a flag -------------------------------------------------------------
    def sleep_routes(self) -> None:
        """vLLM's /sleep and /wake_up stop serving until woken: behind --enable-sleep-routes (vLLM
        keeps them behind its dev mode), and the key."""
        if not self.options.enable_sleep_routes:
            raise HTTPError(404, "the sleep routes are off: start the server with --enable-sleep-routes", "not_found")

    def weight_updates(self) -> None:
        """An RL loop's routes (SGLang's names; engine/models/weights.py) stop generation and read
        a directory of the server's machine: behind --enable-weight-updates."""
        if not self.options.enable_weight_updates:
            raise HTTPError(403, "weight updates are off: start the server with --enable-weight-updates",
                            "permission_error")

    def runtime_lora(self, parent: str) -> AsyncEngine:
        """vLLM's runtime adapter routes (there behind VLLM_ALLOW_RUNTIME_LORA_UPDATING, here behind
        --allow-runtime-lora-updating) read a directory of the server's file system."""
        if not self.options.allow_runtime_lora_updating:
            raise HTTPError(404, "loading adapters at run time is off: start the server with "
                                 "--allow-runtime-lora-updating", "not_found")
        engine = self.base(parent)[1]
        if not engine.lora_enabled:
            raise HTTPError(400, "LoRA is not enabled: start the server with --enable-lora")
        return engine
