"""What generate() returns, in vLLM's shapes (vllm/outputs.py, vllm/logprobs.py), so code
written against vLLM reads vkv's outputs unchanged: `out.outputs[0].logprobs[i][token_id].logprob`.

Logprobs, per position a `dict[int, Logprob]` (vLLM's `LogprobsOnePosition`): the token at that
position first (the sampled one, or the prompt's), then the k most likely tokens, best first; a
token among both is one entry, whose rank is its place in the top k. `rank` is the token's place
in the whole vocabulary from 1 (ties count against it); `decoded_token` its text alone. A
request's prompt logprobs start with None: the first prompt token has no logprob.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    """What each output of a request holds (vLLM's names): everything so far, only what is new
    since the last output (what a stream sends), or one output at the end."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    """One token's logprob at a position (vLLM's)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]
SampleLogprobs = list[LogprobsOnePosition]
PromptLogprobs = list[LogprobsOnePosition | None]


def position(token_id: int, logprob: float, rank: int | None, top: list[tuple[int, float]],
             decoded) -> LogprobsOnePosition:
    """One position's dict, as vLLM builds it: the token first, then the top k (ranks 1..k);
    `decoded(token_id)` is a token's text."""
    entries = {token_id: Logprob(logprob, rank, decoded(token_id))}
    for k, (t, v) in enumerate(top, 1):
        entries[t] = Logprob(v, k, decoded(t))
    return entries


def top_of(entries: LogprobsOnePosition, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a position, best first, as (token id, logprob)."""
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entries.items() if lp.rank is not None and lp.rank <= k)
    return [(t, v) for _, t, v in ranked]


@dataclass
class CompletionOutput:
    """One completion: its text and tokens so far (RequestOutputKind.DELTA: since the last output)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it (None: EOS, or not by a stop)
    text_offsets: list[int] | None = None  # vkv's: where each logprobs position's token starts in `text`

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None  # per prompt token, the first None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # vkv's: why the request failed, when it did (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens found cached (vLLM's name): not computed for this request
