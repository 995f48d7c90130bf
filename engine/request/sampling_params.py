"""Per-request sampling settings, with vLLM's names and checks.

Every value is checked here, once, with a message that names the field; what depends on the
model (token ids against the vocabulary) is checked by the engine when the request arrives.
Temperatures below 1e-5 mean greedy, as in vLLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.request.outputs import RequestOutputKind
from engine.request.structured import StructuredOutputsParams

GREEDY_BELOW = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
MAX_TEMPERATURE = 1e4  # logits / temperature in fp32: far beyond this every token is equally likely anyway
MAX_LOGPROBS = 20
MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS = 64, 1024, 1024
# Each bounded number's range, (low, high, low excluded): checked here, and written from this one
# table into the server's OpenAPI schema (engine/serving/api/protocol.py), so a client sees the bounds.
RANGES: dict[str, tuple[float, float | None, bool]] = {
    "n": (1, None, False), "temperature": (0, MAX_TEMPERATURE, False), "top_p": (0, 1, True),
    "top_k": (-1, None, False), "min_p": (0, 1, False), "seed": (*SEED_RANGE, False), "min_tokens": (0, None, False),
    "repetition_penalty": (0.01, 100, False), "presence_penalty": (-2, 2, False), "frequency_penalty": (-2, 2, False),
    "logprobs": (0, MAX_LOGPROBS, False), "prompt_logprobs": (0, MAX_LOGPROBS, False),
    "length_penalty": (-10, 10, False)}  # beam search's: a beam's score divides by its length to this power


def in_range(name: str, value) -> bool:
    low, high, open_low = RANGES[name]
    return (value > low if open_low else value >= low) and (high is None or value <= high)


def range_text(name: str) -> str:
    low, high, open_low = RANGES[name]
    number = lambda x: str(x) if isinstance(x, int) else f"{x:g}"
    return f"{'(' if open_low else '['}{number(low)}, {'inf)' if high is None else number(high) + ']'}"


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # sample this many, return the n with the best cumulative logprob
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: as many as fit under max_model_len after the prompt (vLLM's)
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # how many most likely tokens to report per generated token
    prompt_logprobs: int | None = None  # the same per prompt token (vLLM's): each prompt token's logprob given
    # the tokens before it, and the k most likely there; the prompt is then computed whole (no cached prefix)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None  # a grammar the output follows
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each of its outputs holds

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == -1:
            self.top_k = 0
        self._check()
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0

    def _check(self) -> None:
        def real(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def integer(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def ranged(name: str, integral: bool = False, optional: bool = False) -> tuple[bool, str]:
            value = getattr(self, name)
            ok = (optional and value is None) or ((integer(value) if integral else real(value)) and in_range(name, value))
            return ok, f"{name} must be {'an integer' if integral else 'a number'} in {range_text(name)}, got {value!r}"

        checks = [
            ranged("n", integral=True),
            (self.best_of is None or (integer(self.best_of) and integer(self.n) and self.best_of >= self.n),
             f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}"),
            ranged("temperature"), ranged("top_p"), ranged("top_k", integral=True), ranged("min_p"),
            ranged("seed", integral=True, optional=True),
            (self.max_tokens is None or (integer(self.max_tokens) and self.max_tokens >= 1),
             f"max_tokens must be >= 1 or None, got {self.max_tokens!r}"),
            (integer(self.min_tokens) and self.min_tokens >= 0 and
             (self.max_tokens is None or (integer(self.max_tokens) and self.min_tokens <= self.max_tokens)),
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}"),
            ranged("logprobs", integral=True, optional=True), ranged("prompt_logprobs", integral=True, optional=True),
            ranged("repetition_penalty"), ranged("presence_penalty"), ranged("frequency_penalty"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            # each is searched for in the new text of every token: bounded, so one request's list
            # cannot slow the engine's thread for everybody
            (len(self.stop) <= MAX_STOP_STRINGS, f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"),
            (all(len(s) <= MAX_STOP_LENGTH for s in self.stop if isinstance(s, str)),
             f"a stop string holds at most {MAX_STOP_LENGTH:,} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"),
            (all(integer(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids >= 0"),
            (all(integer(t) and t >= 0 for t in self.logit_bias), "logit_bias keys must be token ids >= 0"),
            (all(real(b) and -100 <= b <= 100 for b in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be StructuredOutputsParams or a dict of its fields"),
            # a structured output ends where its grammar does: neither can be honoured past that
            (self.structured_outputs is None or not self.min_tokens,
             "min_tokens cannot be honoured with a structured output: it ends where its grammar ends"),
            (self.structured_outputs is None or not self.ignore_eos,
             "ignore_eos cannot be honoured with a structured output: it ends where its grammar ends"),
            (isinstance(self.output_kind, RequestOutputKind), "output_kind must be a RequestOutputKind"),
            (not (self.output_kind is RequestOutputKind.DELTA and self.best_of and self.best_of > self.n),
             "best_of > n cannot be streamed as deltas: the best are known only at the end"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def num_samples(self) -> int:
        """Sequences the request generates (best_of of them, or n)."""
        return self.best_of or self.n

    def token_ids_used(self) -> list[int]:
        """Token ids these settings name, for the engine to check against the vocabulary."""
        return [*self.stop_token_ids, *self.logit_bias]
