"""The admin routes, as vLLM's: left out of the OpenAPI schema, behind the key; with several
models ?model=NAME (or the body's `model`) picks one, default all of them.

- vLLM's sleep mode: /sleep drains the requests in flight (new ones get 503), then releases
  every physical KV page (level 1) and the weights' pages too (level 2: sleep mode and
  --enable-weight-updates); /wake_up?tags=weights&tags=kv_cache maps memory back at the same
  addresses. Nothing above is rebuilt.
- An RL loop's routes (SGLang's names): /pause_generation, /continue_generation,
  /update_weights_from_disk, behind --enable-weight-updates.
- kvcached's kvctl: /kv_limits, each model's floor and cap of the shared KV pool, read and set."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from engine.serving.api.protocol import KVLimitRequest, PauseRequest, UpdateWeightsRequest, parse_limit
from engine.serving.api.state import HTTPError, ServerState, authorize, state_of

router = APIRouter(dependencies=[Depends(authorize)])
ONE_MODEL = "this server has one model: it has the whole KV pool"


def sleep_routes(state: ServerState = Depends(state_of)) -> None:
    state.sleep_routes()


def weight_updates(state: ServerState = Depends(state_of)) -> None:
    """(a dependency: the flag is checked before the body is read, so it is 403 whatever the body)"""
    state.weight_updates()


@router.post("/sleep", include_in_schema=False, dependencies=[Depends(sleep_routes)])
async def sleep(level: int = Query(1, ge=1, le=2, description="1: the KV cache's pages go; 2: the weights' too"),
                model: str | None = None, state: ServerState = Depends(state_of)):
    engines = state.named(model)
    if level == 2:
        state.weight_updates()  # (the weights must come back through an update)
    try:
        asleep = [await e.sleep(level) for e in engines.values()]
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from exc
    return {"is_sleeping": all(asleep)}  # False: a wake-up came while the requests in flight drained


@router.post("/wake_up", include_in_schema=False, dependencies=[Depends(sleep_routes)])
async def wake_up(model: str | None = None, tags: list[str] | None = Query(None),
                  state: ServerState = Depends(state_of)):
    try:
        for e in state.named(model).values():
            await e.wake_up(tags)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from exc
    return {"is_sleeping": any(e.engine.is_sleeping for e in state.named(model).values())}


@router.get("/is_sleeping", include_in_schema=False)
async def is_sleeping(model: str | None = None, state: ServerState = Depends(state_of)):
    return {"is_sleeping": all(e.is_sleeping for e in state.named(model).values())}


@router.post("/pause_generation", include_in_schema=False, dependencies=[Depends(weight_updates)])
async def pause_generation(body: PauseRequest | None = None, state: ServerState = Depends(state_of)):
    body = body or PauseRequest()  # (no body: SGLang's default, abort)
    for e in state.named(body.model).values():
        await e.pause_generation(body.mode)
    return {"paused": True, "mode": body.mode}


@router.post("/continue_generation", include_in_schema=False, dependencies=[Depends(weight_updates)])
async def continue_generation(model: str | None = None, state: ServerState = Depends(state_of)):
    for e in state.named(model).values():
        await e.continue_generation()
    return {"paused": False}


@router.post("/update_weights_from_disk", include_in_schema=False, dependencies=[Depends(weight_updates)])
async def update_weights_from_disk(body: UpdateWeightsRequest, state: ServerState = Depends(state_of)):
    engines = state.named(body.model)
    try:  # every model reads and checks it first: none takes weights another refuses
        checked = [(e, await e.read_weights_from_disk(body.model_path)) for e in engines.values()]
        for e, update in checked:
            await e.update_weights(update)
    except (ValueError, FileNotFoundError) as exc:
        raise HTTPError(400, str(exc)) from exc
    except RuntimeError as exc:  # requests in flight: pause first
        raise HTTPError(409, str(exc), "conflict") from exc
    return {"success": True, "weights_version": [e.engine.weights_version for e in engines.values()]}


@router.get("/kv_limits", include_in_schema=False)
async def kv_limits(state: ServerState = Depends(state_of)):
    if state.group is None:
        raise HTTPError(404, ONE_MODEL, "not_found")
    return state.group.limits()


@router.post("/kv_limits", include_in_schema=False)
async def set_kv_limits(body: KVLimitRequest, state: ServerState = Depends(state_of)):
    group = state.group
    if group is None:
        raise HTTPError(404, ONE_MODEL, "not_found")
    state.base(body.model)
    try:
        if body.min is None and body.max is None:
            raise ValueError("give min, max or both (one left out keeps its current value)")
        now = group.limits()[body.model]
        group.set_limits(body.model, parse_limit(now["min_bytes"] if body.min is None else body.min),
                         parse_limit(now["max_bytes"] if body.max is None else body.max))
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from exc
    return group.limits()
