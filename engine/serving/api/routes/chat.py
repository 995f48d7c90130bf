"""POST /v1/chat/completions: OpenAI's chat, streamed or whole, with the model's chat template,
tools (a forced call is a structured output; calls are parsed out of the answer), logprobs and
structured outputs, over a model or one of its adapters."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from engine.serving.api.protocol import ChatCompletionRequest, NamedToolChoice, envelope, new_id, usage
from engine.serving.api.state import HTTPError, ServerState, authorize, state_of
from engine.serving.api.streams import collect, stream, tool_stream
from engine.serving.api.tools import calls_in, guide, render, tool_use

router = APIRouter(dependencies=[Depends(authorize)])


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(state_of)):
    model_name, parent, engine, lora = state.pick(body.model)
    tokens = state.texts[parent]
    state.check(engine, body)
    await state.unpaused(engine)
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
        conversation, template_tools = render(body.conversation(), use, engine.preprocess.template_takes_tools)
        client = state.client_of(request, body)
        prompt, = state.salted([await engine.preprocess.chat_prompt(conversation, client, template_tools)], body, client)
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from exc
    for name in ("max_completion_tokens", "max_tokens"):
        if getattr(body, name) is not None and getattr(body, name) < 1:
            raise HTTPError(400, f"{name} must be >= 1, got {getattr(body, name)}")
    if None not in (body.max_completion_tokens, body.max_tokens) and body.max_completion_tokens != body.max_tokens:
        raise HTTPError(400, "give max_completion_tokens or max_tokens (its older name), not both with other values")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    chat_logprobs = lambda c: tokens.chat_logprobs(c, logprobs or 0)
    rid = new_id("chatcmpl")
    requests = await state.prepare(engine, rid, client, [prompt], body, max_tokens, logprobs, structured=forced,
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

    def delta(_, c, first: bool) -> dict:
        return {"index": c.index, "delta": ({"role": "assistant"} if first else {}) | {"content": c.text},
                "logprobs": chat_logprobs(c), "finish_reason": c.finish_reason}

    if body.stream and use.offered:  # calls are known at the end: one chunk per choice, then [DONE]
        return StreamingResponse(tool_stream(engine, rid, requests, body, model_name, message, chat_logprobs),
                                 media_type="text/event-stream")
    if body.stream:
        chunks = stream(engine, rid, requests, body, "chat.completion.chunk", model_name, delta)
        return StreamingResponse(chunks, media_type="text/event-stream")
    outs = await collect(engine, requests, request)
    choices = []
    for c in outs[0].outputs:
        said, reason = message(c)
        choices.append({"index": c.index, "message": said, "logprobs": chat_logprobs(c),
                        "finish_reason": reason})
    return envelope("chat.completion", rid, model_name, choices, {"usage": usage(outs)})
