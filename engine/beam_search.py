"""Beam search over the engine's batch, with vLLM's API and beams that share KV pages.

Every beam is a live sequence in the scheduler, batched with everything else. After each step
a group keeps its `beam_width` best continuations by cumulative logprob: a beam continued once
goes on as it is; continued twice, it forks (the child maps all of the parent's pages, one
more reference each, and the first write into the shared last page copies it); not continued,
it is finished and its references go. End-of-sequence candidates become finished hypotheses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # generated tokens
    cum_logprob: float
    text: str = ""
    finish_reason: str = "length"


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Group:
    prompt_ids: list[int]
    live: list[tuple[Sequence, float]]  # (beam, cumulative logprob)
    finished: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    def __init__(self, engine, params: BeamSearchParams):
        self.engine, self.params = engine, params
        self.seq_params = SamplingParams(temperature=params.temperature or 1.0, max_tokens=params.max_tokens,
                                         logprobs=min(2 * params.beam_width, 20), ignore_eos=True)

    def run(self, prompts: list[list[int]]) -> list[BeamSearchOutput]:
        groups = []
        for i, ids in enumerate(prompts):
            seq = self._beam(f"beam-{time.monotonic_ns()}-{i}", ids)
            self.engine.scheduler.add(seq)
            groups.append(_Group(ids, [(seq, 0.0)]))
        while any(g.live for g in groups):
            self.engine.step()
            for g in groups:
                if g.live and all(seq.beam_candidates is not None for seq, _ in g.live):
                    self._advance(g)
        return [self._output(g) for g in groups]

    def _beam(self, request_id: str, token_ids: list[int]) -> Sequence:
        return Sequence(request_id, 0, list(token_ids), self.seq_params, time.monotonic(), is_beam=True)

    def _advance(self, g: _Group) -> None:
        p, eos = self.params, self.engine.eos_ids
        candidates = sorted(((cum + lp, seq, token) for seq, cum in g.live
                             for lp, token in zip(*seq.beam_candidates)), key=lambda c: -c[0])
        chosen = []
        for score, parent, token in candidates:
            if len(chosen) == p.beam_width:
                break
            if token in eos and not p.ignore_eos:
                g.finished.append(BeamSearchSequence(parent.output_token_ids + [token], score, finish_reason="stop"))
            else:
                chosen.append((parent, token, score))
        continued, beams = set(), []
        for parent, token, score in chosen:  # forks first: a parent still holds only its own tokens
            if parent not in continued:
                continued.add(parent)
                beams.append((parent, token, score))
            elif self.engine.scheduler.can_adopt():
                child = self._beam(parent.request_id, parent.token_ids)
                self.engine.kv.fork(parent, child)
                self.engine.scheduler.adopt(child)
                beams.append((child, token, score))
        for seq, _ in g.live:
            if seq not in continued:
                self.engine.scheduler.finish(seq, "dropped")
        g.live = []
        for seq, token, score in beams:
            seq.token_ids.append(token)
            seq.beam_candidates = None
            if seq.num_output_tokens >= p.max_tokens or len(seq) >= self.engine.max_model_len:
                g.finished.append(BeamSearchSequence(seq.output_token_ids, score))
                self.engine.scheduler.finish(seq, "length")
            else:
                g.live.append((seq, score))

    def _output(self, g: _Group) -> BeamSearchOutput:
        lp = self.params.length_penalty
        best = sorted(g.finished, key=lambda s: -s.cum_logprob / max(len(s.tokens), 1) ** lp)
        best = best[:self.params.beam_width]
        for s in best:
            s.text = self.engine.tokenizer.decode(s.tokens, skip_special_tokens=True)
        return BeamSearchOutput(g.prompt_ids, best)
