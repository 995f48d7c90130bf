"""What generate() returns, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    """What each output of a request holds (vLLM's names): everything so far, only what is new
    since the last output (what a stream sends), or one output at the end."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class TokenLogprob:
    """One generated token: its logprob and the k most likely tokens at its position."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
    text_offset: int = 0  # where the token's text starts in the completion's text


@dataclass
class CompletionOutput:
    """One completion: its text and tokens so far (RequestOutputKind.DELTA: since the last output)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # why the request failed, when it did (finish_reason "error")
    prompt_logprobs: list[TokenLogprob | None] | None = None  # prompt_logprobs: per prompt token, the first None
    num_cached_tokens: int = 0  # prompt tokens found cached (vLLM's name): not computed for this request
