"""From what sequences did in a step to what requests show: text, stop strings, outputs.

The scheduler hands over a `SeqOutput` per sequence that moved (its new tokens, why it
finished). Here each completion's tokens are detokenized one at a time, stop strings are looked
for in the text, and each request's output is built: everything so far, only what is new since
its last output (RequestOutputKind.DELTA, what a stream sends as it is), or one output at the
end. While a completion runs, text that may be the start of a stop string is held back, so no
output ever shows it.

A stop string ends a completion here; `process` returns those sequences for the engine to
finish in the scheduler, with the requests whose processing raised (they fail alone).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request.beam_search import BeamSearchOutput
from engine.sched.beam_search import BeamGroup
from engine.request.detokenizer import IncrementalDetokenizer
from engine.request.inputs import Prompt
from engine.request.outputs import (CompletionOutput, LogprobsOnePosition, RequestOutput, RequestOutputKind,
                                    position)
from engine.sample.sampler import Sampled
from engine.request.sampling_params import SamplingParams
from engine.sched.step import SeqOutput
from engine.request.sequence import Sequence


@dataclass
class Completion:
    """One of a request's completions, as its outputs show it."""
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsOnePosition] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # where each logprobs position's token starts
    cum_logprob: float = 0.0
    shown: int = 0  # characters of the detokenizer's text that outputs may show
    sent: tuple[int, int, int] = (0, 0, 0)  # DELTA: characters, tokens and logprobs already in outputs
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token that ended it


@dataclass
class RequestState:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    completions: list[Completion]
    beam: BeamGroup | None = None
    error: str | None = None
    prompt_logprobs: list[LogprobsOnePosition | None] | None = None  # per prompt token (prompt_logprobs); the first None
    prompt_logprobs_sent: bool = False  # DELTA: they go out once, in the first output after the prompt
    num_cached_tokens: int = 0  # prompt tokens found cached when its first sequence was admitted

    @property
    def finished(self) -> bool:
        if self.error:
            return True
        return self.beam.done if self.beam else all(c.finish_reason for c in self.completions)


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: tuple[int, ...] = ()):
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.requests: dict[str, RequestState] = {}
        self.decoded: dict[int, str] = {}  # a token's text alone (Logprob.decoded_token), by id

    def decode(self, token_id: int) -> str:
        if (text := self.decoded.get(token_id)) is None:
            text = self.decoded[token_id] = self.tokenizer.decode([token_id])
        return text

    def logprobs(self, s: Sampled) -> LogprobsOnePosition:
        return position(s.token_id, s.logprob, s.rank, s.top, self.decode)

    def add(self, request_id: str, prompt: Prompt, params: SamplingParams, beam: BeamGroup | None = None) -> None:
        completions = [Completion(IncrementalDetokenizer(self.tokenizer, prompt.token_ids, params.skip_special_tokens))
                       for _ in range(1 if beam else params.num_samples)]
        scored = [None] * len(prompt.token_ids) if params.prompt_logprobs is not None else None
        self.requests[request_id] = RequestState(request_id, prompt, params, completions, beam, prompt_logprobs=scored)

    def add_prompt_scores(self, scores: list[tuple[Sequence, int, list[Sampled]]]) -> None:
        """prompt_logprobs a step scored (engine/core/engine_core.py): per sequence, the position of its first
        scored prompt token and the scores. A sequence computing its prompt again after a
        preemption writes the same values."""
        for seq, first, scored in scores:
            state = self.requests.get(seq.request_id)
            if state is None or state.prompt_logprobs is None:
                continue
            for i, s in enumerate(scored, first):
                state.prompt_logprobs[i] = self.logprobs(s)

    def abort(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def process(self, seq_outputs: list[SeqOutput]
                ) -> tuple[list[RequestOutput | BeamSearchOutput], list[Sequence], list[str]]:
        """The outputs of the requests that moved; the sequences a stop string ended; the
        requests whose processing raised."""
        touched: dict[str, RequestState] = {}
        stopped, failed = [], []
        for o in seq_outputs:
            state = self.requests.get(o.seq.request_id)
            if state is None:
                continue
            touched[state.request_id] = state
            if o.seq.index == 0 and o.seq.num_cached_tokens:
                state.num_cached_tokens = max(state.num_cached_tokens, o.seq.num_cached_tokens)
            if o.error:
                self._fail(state, o.error)
            elif not state.beam and not state.error and not state.completions[o.seq.index].finish_reason:
                try:
                    if self._take(state, state.completions[o.seq.index], o):
                        stopped.append(o.seq)
                except Exception as exc:
                    self._fail(state, f"{type(exc).__name__}: {exc}")
                    failed.append(state.request_id)
        outputs = []
        for state in touched.values():
            if state.finished:
                del self.requests[state.request_id]
            if state.finished or not (state.beam or state.params.output_kind is RequestOutputKind.FINAL_ONLY):
                outputs.append(self._beam_output(state) if state.beam else self._output(state))
        return outputs, stopped, failed

    @staticmethod
    def _fail(state: RequestState, error: str) -> None:
        """The request ends with its (first) error; completions still running end with "error"."""
        state.error = state.error or error
        for c in state.completions:
            c.finish_reason = c.finish_reason or "error"

    def _take(self, state: RequestState, c: Completion, o: SeqOutput) -> bool:
        """Detokenize the new tokens one at a time; True when a stop string ended the completion
        before the scheduler did."""
        p = state.params
        for i, s in enumerate(o.new):
            ends = i == len(o.new) - 1 and o.finish_reason
            # a stop by EOS or a stop token keeps the token, not its text (vLLM's rule, as for stop
            # strings: `stop_token_ids=['.']` ended "Paris." and a chat turn "...<|im_end|>"); the text
            # before it is final, a character cut short showing as its tokens decode
            by_token = ends and o.finish_reason == "stop" and (
                s.token_id in p.stop_token_ids or (s.token_id in self.eos_ids and not p.ignore_eos))
            if by_token:
                c.detokenizer.flush()
            before = len(c.detokenizer.text)
            self._add_token(c, s)
            text = c.detokenizer.text  # a stop string ending before `before` would have stopped it already
            stops = [(at, stop) for stop in p.stop if (at := text.find(stop, max(0, before - len(stop) + 1))) >= 0] \
                if len(c.token_ids) >= p.min_tokens else []  # as vLLM: no stop string before min_tokens
            if stops:
                (c.shown, c.stop_reason), c.finish_reason = min(stops, key=lambda found: found[0]), "stop"
                return o.finish_reason is None
            if ends:
                if not by_token:  # (a character cut short at the end shows as its tokens decode)
                    c.detokenizer.flush()
                c.shown, c.finish_reason = (before if by_token else len(c.detokenizer.text)), o.finish_reason
                if by_token and s.token_id in p.stop_token_ids:  # (EOS: None, as vLLM's)
                    c.stop_reason = s.token_id
            else:
                c.shown = max(c.shown, len(text) - (max(map(len, p.stop), default=1) - 1))
        if not o.new and o.finish_reason:  # finished with no token (an abort, a drop)
            c.finish_reason = o.finish_reason
        return False

    def _add_token(self, c: Completion, s: Sampled) -> None:
        c.token_ids.append(s.token_id)
        if s.logprob is not None:
            c.cum_logprob += s.logprob
        if s.top is not None:
            c.logprobs.append(self.logprobs(s))
            c.text_offsets.append(len(c.detokenizer.text))
        c.detokenizer.add(s.token_id)

    def _output(self, state: RequestState) -> RequestOutput:
        p = state.params
        ranked = list(enumerate(state.completions))
        choosing = bool(p.best_of and p.best_of > p.n)  # (best_of == n: nothing to choose; indices as streamed)
        if choosing and state.finished and not state.error:
            ranked = sorted(ranked, key=lambda ic: ic[1].cum_logprob, reverse=True)[:p.n]
        logprobs, delta = p.logprobs is not None, p.output_kind is RequestOutputKind.DELTA
        outputs = []
        for rank, (index, c) in enumerate(ranked):
            text, tokens, records, offsets = c.detokenizer.text[:c.shown], c.token_ids, c.logprobs, c.text_offsets
            if delta:
                chars, count, logged = c.sent
                c.sent = (max(chars, len(text)), len(tokens), len(records))
                text, tokens, records, offsets = text[chars:], tokens[count:], records[logged:], offsets[logged:]
            outputs.append(CompletionOutput(
                rank if choosing else index, text, list(tokens),
                cumulative_logprob=c.cum_logprob if logprobs or p.best_of else None,
                logprobs=list(records) if logprobs else None, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, text_offsets=list(offsets) if logprobs else None))
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None and delta:
            prompt_logprobs, state.prompt_logprobs_sent = (None if state.prompt_logprobs_sent else prompt_logprobs), True
        return RequestOutput(state.request_id, state.prompt.text, state.prompt.token_ids,
                             list(prompt_logprobs) if prompt_logprobs else None, outputs, state.finished,
                             state.error, state.num_cached_tokens)

    def _beam_output(self, state: RequestState) -> BeamSearchOutput:
        start, prompt_text = len(state.prompt.token_ids), state.prompt.text
        if state.beam.finished and prompt_text is None:
            prompt_text = self.tokenizer.decode(state.prompt.token_ids, skip_special_tokens=True)
        for hypothesis in state.beam.finished:
            hypothesis.completion_text = self.tokenizer.decode(hypothesis.tokens[start:], skip_special_tokens=True)
            hypothesis.text = prompt_text + hypothesis.completion_text
        return BeamSearchOutput(state.request_id, state.prompt.token_ids, state.beam.finished, error=state.error)
