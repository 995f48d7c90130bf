"""vLLM's /tokenize, /detokenize and /version, with its fields and answers.

/tokenize takes a prompt or a conversation (through the model's chat template, tools written in
as a generation request's are) and answers {count, max_model_len, tokens, token_strs}; it counts
a text of any length the body's bound admits, as vLLM's does. /detokenize answers {prompt}; an
id outside the vocabulary is a 400 (vLLM's tokenizer drops it silently). Both run on the
tokenizer threads in the client's turn. Unlike vLLM, where only /v1 paths take the key, both are
behind the key here: they spend the server's threads. /version is open, as /health is.
"""
from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Depends, Request

from engine.serving.api.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, conversation_of
from engine.serving.api.state import HTTPError, ServerState, authorize, state_of
from engine.serving.api.tools import render, tool_use

router = APIRouter()


@router.post("/tokenize", dependencies=[Depends(authorize)])
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request,
                   state: ServerState = Depends(state_of)):
    _, _, engine, _ = state.pick(body.model)  # an adapter reads its base model's tokenizer
    client = state.client_of(request, body)
    try:
        if isinstance(body, TokenizeChatRequest):
            messages, tools = render(conversation_of(body.messages), tool_use(body.tools, None, None),
                                     engine.preprocess.template_takes_tools)
            ids = (await engine.preprocess.chat_prompt(
                messages, client, tools, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                add_special_tokens=body.add_special_tokens)).token_ids
        else:
            ids = await engine.preprocess.encode(body.prompt, client, body.add_special_tokens)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from exc
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": engine.preprocess.pieces(ids) if body.return_token_strs else None}


@router.post("/detokenize", dependencies=[Depends(authorize)])
async def detokenize(body: DetokenizeRequest, request: Request, state: ServerState = Depends(state_of)):
    _, _, engine, _ = state.pick(body.model)
    try:
        return {"prompt": await engine.preprocess.decode(body.tokens, state.client_of(request, body))}
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from exc


@router.get("/version")
async def version():
    try:
        return {"version": metadata.version("vkv")}
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown"}
