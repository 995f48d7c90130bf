"""POST /v1/completions: OpenAI's (legacy) completions, streamed or whole, with echo, logprobs
(of the prompt too, with echo), n and best_of, over a model or one of its adapters."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine.serving.api.protocol import CompletionRequest, envelope, new_id, usage
from engine.serving.api.state import HTTPError, ServerState, authorize, state_of
from engine.serving.api.streams import collect, stream

router = APIRouter(dependencies=[Depends(authorize)])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(state_of)):
    model_name, parent, engine, lora = state.pick(body.model)
    tokens = state.texts[parent]
    state.check(engine, body, body.best_of)
    await state.unpaused(engine)
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
    client = state.client_of(request, body)
    prompts = state.salted(await state.tokenize(engine, raw, client), body, client)
    rid = new_id("cmpl")
    requests = await state.prepare(engine, rid, client, prompts, body, body.max_tokens, body.logprobs, body.best_of,
                                   deltas=body.stream, prompt_logprobs=body.logprobs if scored else None, lora=lora)
    echoes = [(p.text if p.text is not None else engine.tokenizer.decode(p.token_ids)) if body.echo else ""
              for p in prompts]

    def choice(i: int, c, first: bool = True) -> dict:
        return {"index": i * body.n + c.index, "text": (echoes[i] if first else "") + c.text,
                "logprobs": tokens.completion_logprobs(c, body.logprobs or 0), "finish_reason": c.finish_reason}

    if body.stream:
        chunks = stream(engine, rid, requests, body, "text_completion", model_name, choice)
        return StreamingResponse(chunks, media_type="text/event-stream")
    outs = await collect(engine, requests, request)
    choices = [choice(i, c) for i, o in enumerate(outs) for c in o.outputs]
    if scored:  # the echoed prompt's tokens first, then the completion's (text offsets after the prompt)
        for ch, (i, o) in zip(choices, ((i, o) for i, o in enumerate(outs) for _ in o.outputs)):
            ch["logprobs"] = tokens.echoed_logprobs(o.prompt_logprobs, o.prompt_token_ids, ch["logprobs"],
                                                    len(echoes[i]), body.logprobs)
    return envelope("text_completion", rid, model_name, choices, {"usage": usage(outs)})
