"""Beam search, with vLLM's API (`LLM.beam_search(prompts, BeamSearchParams(...))`) and the
selection rule of transformers' `generate(num_beams=...)`.

Every live beam is a sequence in the engine's batch. When all beams of a group have their next
token's logprobs, `BeamGroup.advance` picks the continuations:

  - the top K = (1 + number of stop tokens, at least 2) * beam_width candidates over all beams
    by cumulative logprob;
  - those that end (a stop token, or max_tokens reached) and rank among the first beam_width
    become finished hypotheses, scored cum_logprob / generated_len ** length_penalty, of which
    the beam_width best are kept;
  - the first beam_width that do not end live on;
  - the search stops when every candidate ends, or when the best live beam, normalized by the
    current length, cannot beat the worst kept hypothesis (transformers' early_stopping=False).

The scheduler turns the choice into page operations (`Scheduler.update_from_output`): a parent
chosen once appends its token, a parent chosen twice forks (the child maps the parent's pages,
one more reference each; the first write into their shared last page copies it), a parent not
chosen is dropped and its references go. The group alone writes its live beams (`take`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request.beam_search import BeamSearchParams, BeamSearchSequence
from engine.request.sequence import Sequence


@dataclass(slots=True)
class Continuation:
    parent: Sequence
    token_id: int
    cum_logprob: float
    branch: bool = False  # the parent is continued by an earlier continuation too: a child forks for this one


def gang(seq: Sequence, running: list[Sequence]) -> list[Sequence]:
    """The running sequences that leave with seq when it is preempted: itself, and its beam
    search's other beams (they cannot advance without it)."""
    if seq.beam is None:
        return [seq]
    return [s for s in running if s is seq or s.beam is seq.beam]


class BeamGroup:
    """One beam-search request: its live beams with their cumulative logprobs, the logprobs
    each has produced this round, and the best finished hypotheses."""

    def __init__(self, params: BeamSearchParams, stop_ids: tuple[int, ...], max_model_len: int):
        self.params, self.max_model_len = params, max_model_len
        self.stop_ids = () if params.ignore_eos else stop_ids
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * params.beam_width
        self.live: dict[Sequence, float] = {}
        self.logprobs: dict[Sequence, torch.Tensor] = {}
        self.finished: list[BeamSearchSequence] = []
        self.can_improve = True

    def start(self, beam: Sequence) -> None:
        """The first beam: the prompt."""
        self.live = {beam: 0.0}

    def take(self, beams: list[Sequence], continuations: list[Continuation]) -> None:
        """The beams now live, one per continuation of the last `advance`."""
        self.live = {beam: c.cum_logprob for beam, c in zip(beams, continuations)}

    def unchosen(self, continuations: list[Continuation]) -> list[Sequence]:
        """The live beams no continuation continues: dropped."""
        chosen = {id(c.parent) for c in continuations}
        return [beam for beam in self.live if id(beam) not in chosen]

    def fail(self) -> None:
        """The search ended in an error: no beam lives on."""
        self.live, self.logprobs = {}, {}

    def offer(self, beam: Sequence, logits: torch.Tensor) -> None:
        self.logprobs[beam] = logits.float().log_softmax(-1)

    @property
    def ready(self) -> bool:
        return len(self.logprobs) == len(self.live)

    @property
    def done(self) -> bool:
        return not self.live

    def advance(self) -> list[Continuation]:
        """This round's continuations; none when the search is over."""
        beams = list(self.live)
        scores = torch.stack([self.logprobs[b] + self.live[b] for b in beams])
        top = scores.flatten().topk(min(self.num_candidates, scores.numel()))
        vocab, width = scores.shape[1], self.params.beam_width
        continuations, ended = [], []
        for rank, (score, index) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            c = Continuation(beams[index // vocab], index % vocab, score)
            reason = self._finish_reason(c)
            if reason is None and len(continuations) < width:
                continuations.append(c)
            elif reason is not None and rank < width and self.can_improve:
                ended.append(self._hypothesis(c, reason))
        self.finished = sorted(self.finished + ended, key=lambda h: h.score, reverse=True)[:width]
        self._check_improvement(continuations, beams[0].num_output_tokens + 1)
        self.logprobs.clear()
        seen = set()
        for c in continuations:
            c.branch = id(c.parent) in seen
            seen.add(id(c.parent))
        return continuations if self.can_improve else []

    def _finish_reason(self, c: Continuation) -> str | None:
        if c.token_id in self.stop_ids:
            return "stop"
        generated = c.parent.num_output_tokens + 1
        if generated >= self.params.max_tokens or len(c.parent) + 1 >= self.max_model_len:
            return "length"
        return None

    def _hypothesis(self, c: Continuation, reason: str) -> BeamSearchSequence:
        generated = c.parent.num_output_tokens + 1
        return BeamSearchSequence(c.parent.token_ids + [c.token_id], c.cum_logprob,
                                  c.cum_logprob / generated ** self.params.length_penalty, reason)

    def _check_improvement(self, continuations: list[Continuation], generated: int) -> None:
        """Can a live beam still beat the worst kept hypothesis? (transformers' heuristic for
        early_stopping=False: judge the best live beam at its current length.)"""
        if not continuations:
            self.can_improve = False
        elif len(self.finished) == self.params.beam_width:
            best = continuations[0].cum_logprob / generated ** self.params.length_penalty
            self.can_improve = self.can_improve and best > self.finished[-1].score
