"""GET /health and GET /metrics (Prometheus)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from engine.serving.api.state import ServerState, state_of
from engine.serving.edge import refusal

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(state_of)):
    dead = next((e.dead for e in state.engines.values() if e.dead), None)
    if dead:
        return refusal(503, str(dead), "engine_dead")
    stalled = next((why for e in state.engines.values() if (why := e.stalled())), None)
    if stalled:
        return refusal(503, stalled, "engine_stalled")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request, state: ServerState = Depends(state_of)):
    """Behind the key when there is one: the prefix-cache counters and prefill timings would let
    one client probe what another's prompts hold. --metrics-public opens it again."""
    if not state.options.metrics_public:
        state.authorize(request)
    engines, first = state.engines, state.engines[state.default]
    if state.group is None:
        text = first.metrics.render(await first.fresh_stats())
    else:
        text = first.metrics.render({name: await e.fresh_stats() for name, e in engines.items()})
    return Response(text, media_type="text/plain; version=0.0.4")
