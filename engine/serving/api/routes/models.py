"""GET /v1/models, and vLLM's runtime adapter routes /v1/load_lora_adapter and
/v1/unload_lora_adapter (behind --allow-runtime-lora-updating; left out of the schema). Adapters
live in the engines' own registries: loading one goes through its model's AsyncEngine."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from engine.serving.api.protocol import LoadLoRARequest, UnloadLoRARequest
from engine.serving.api.state import HTTPError, ServerState, authorize, state_of

router = APIRouter(dependencies=[Depends(authorize)])


@router.get("/v1/models")
async def models(state: ServerState = Depends(state_of)):
    engines = state.engines
    cards = [{"id": name, "object": "model", "owned_by": "vkv", "root": name, "parent": None,
              "max_model_len": e.max_model_len} for name, e in engines.items()]
    cards += [{"id": name, "object": "model", "owned_by": "vkv", "root": name, "parent": parent,
               "max_model_len": engines[parent].max_model_len} for name, (parent, _) in state.loras().items()]
    return {"object": "list", "data": cards}


@router.post("/v1/load_lora_adapter", include_in_schema=False)
async def load_lora_adapter(body: LoadLoRARequest, state: ServerState = Depends(state_of)):
    parent = body.model if body.model is not None else state.default  # "" names no model: 404, as elsewhere
    engine = state.runtime_lora(parent)
    if body.lora_name in state.loras() or body.lora_name in state.engines:
        raise HTTPError(400, f"the name {body.lora_name!r} is taken: unload it first")
    try:
        await engine.preprocess.add_lora(body.lora_name, body.lora_path)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", include_in_schema=False)
async def unload_lora_adapter(body: UnloadLoRARequest, state: ServerState = Depends(state_of)):
    served = state.loras()
    if body.lora_name not in served:
        state.runtime_lora(state.default)
        raise HTTPError(404, f"no LoRA adapter named {body.lora_name!r}", "not_found")
    parent, _ = served[body.lora_name]
    state.runtime_lora(parent).remove_lora(body.lora_name)  # requests running with it finish with it
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
