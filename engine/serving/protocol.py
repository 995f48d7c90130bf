"""OpenAI's request and response shapes, with vLLM's extra sampling fields."""
from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict, Field

from engine.beam_search import BeamSearchParams
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    skip_special_tokens: bool = True
    use_beam_search: bool = False  # n is the beam width
    length_penalty: float = 1.0

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams | BeamSearchParams:
        """Raises ValueError, with the reason, for values out of range."""
        if self.use_beam_search:
            if logprobs is not None:
                raise ValueError("logprobs are not supported with beam search")
            return BeamSearchParams(self.n, max_tokens, self.ignore_eos, self.length_penalty)
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, skip_special_tokens=self.skip_special_tokens)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(c: CompletionOutput, tokenizer, start: int = 0) -> dict | None:
    if c.logprobs is None:
        return None
    records = c.logprobs[start:]
    return {"tokens": [tokenizer.decode([r.token_id]) for r in records],
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{tokenizer.decode([t]): v for t, v in r.top} for r in records],
            "text_offset": []}


def chat_logprobs(c: CompletionOutput, tokenizer, start: int = 0) -> dict | None:
    if c.logprobs is None:
        return None
    entry = lambda t, v: {"token": tokenizer.decode([t]), "logprob": v,
                          "bytes": list(tokenizer.decode([t]).encode())}
    return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, v) for t, v in r.top]}
                        for r in c.logprobs[start:]]}


def envelope(kind: str, request_id: str, model: str, choices: list, extra: dict | None = None) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, **(extra or {})}


def error_body(message: str, kind: str = "invalid_request_error", code: int | str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
