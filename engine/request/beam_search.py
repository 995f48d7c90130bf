"""Beam search's request and answer, with vLLM's names (`BeamSearchParams`,
`BeamSearchSequence`, `BeamSearchOutput`): what `LLM.beam_search` takes and returns. How the
beams are chosen is engine/sched/beam_search.py's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.request.outputs import CompletionOutput, RequestOutput
from engine.request.sampling_params import in_range, range_text


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int | None  # None: as many as fit under max_model_len after the prompt
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)
                and in_range("length_penalty", self.length_penalty)):
            raise ValueError(f"length_penalty must be a number in {range_text('length_penalty')}, "
                             f"got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """A finished beam. As in vLLM, tokens and text include the prompt."""
    tokens: list[int]
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty: what ranks the beams
    finish_reason: str  # "stop" | "length"
    text: str = ""  # prompt and continuation
    completion_text: str = ""  # the continuation alone


@dataclass
class BeamSearchOutput:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first
    finished: bool = True
    error: str | None = None  # why the search failed, when it did

    def to_request_output(self) -> RequestOutput:
        """The beams as completions of generated tokens only, as vLLM's server returns them."""
        start = len(self.prompt_token_ids)
        outputs = [CompletionOutput(i, s.completion_text, s.tokens[start:], cumulative_logprob=s.cum_logprob,
                                    finish_reason=s.finish_reason)
                   for i, s in enumerate(self.sequences)]
        return RequestOutput(self.request_id, None, self.prompt_token_ids, outputs=outputs, finished=True,
                             error=self.error)
