"""Holding a lossy path (an fp8 or bf16 KV cache, bf16 weights and arithmetic, LoRA on bf16, a
tier restoring bf16 pages) to its reference by what no CPU's order of sums can tip.

Rationale. Greedy tokens alone are a bad witness. Two correct runs that sum in another order
(another layout's kernel, AVX-512 instead of AVX2, native bf16 instead of fp32) differ in the
last bits; where the model's top two tokens are nearly tied, that tips the token, and from there
the two continuations part for good. A threshold fitted to where one CPU's ties fall ("all but
one prompt agree") fails on the next CPU.

Approach.
1. Teacher forcing. The reference's greedy continuation is fed to the candidate as a prompt with
   `prompt_logprobs`: every position is scored on the same history, so a tie tipped at token 5
   does not change what tokens 6.. are compared on. Each token's logprob must lie within the
   format's tolerance of the reference's: on average (`mean`) and at every token (`token`).
2. Greedy agreement where no near tie exists. At each position whose reference top-2 gap is
   at least the per-token tolerance, the candidate's top token must be the reference's. Nearer
   ties are skipped and counted (`Agreement.skipped`); a test asserts enough were compared.
3. Free-running greedy, where teacher forcing cannot reach (a prefix read from the cache:
   prompt_logprobs computes a prompt whole): the two continuations agree up to their first
   difference, and there the reference's top two were within the tolerance (a near tie).

Tolerances come from the format, not from a run. u is the unit roundoff of the narrowest format a
value passes through: 2^-(mantissa bits + 1), so e4m3 2^-4, e5m2 2^-3, bf16 2^-8. A stored value
is off from its fp32 by at most u, relative; a logprob moves by a sum of such errors weighted by
how much the model's output depends on each, so its error scales with u. Two error models:
- STORED: only the KV cache rounds (fp8 caches; a bf16 cache under fp32 arithmetic). Each K and
  V is rounded once. A logprob moves by at most 16u at any token, and by 2u on average.
- COMPUTED: weights and activations round too (dtype="bfloat16"): every GEMM's inputs, at every
  layer. At most 128u at a token, 16u on average.
The multipliers are the model's sensitivity, the same for every format of one error model: on
the bundled SmolLM2 (AMD EPYC, AVX-512 + AVX512-BF16), e4m3 and e5m2 both move a token's logprob
by 0.6u on average and by at most 9u and 5u; native bf16 arithmetic by 5u on average and 39u at
most. The bounds leave a factor of 2-3 above those, the same factor for both formats, and are far
below what a wrong read costs (a page of another sequence moves logprobs by nats, on average).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine import SamplingParams
from engine.request.outputs import LogprobsOnePosition, top_of

MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10,
                 torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def unit_roundoff(dtype: torch.dtype) -> float:
    return 2.0 ** -(MANTISSA_BITS[dtype] + 1)


@dataclass(frozen=True)
class Tolerance:
    """How far a lossy path's logprobs may lie from the reference's, in nats."""
    mean: float
    token: float

    @classmethod
    def stored(cls, dtype: torch.dtype) -> Tolerance:
        u = unit_roundoff(dtype)
        return cls(2 * u, 16 * u)

    @classmethod
    def computed(cls, dtype: torch.dtype) -> Tolerance:
        u = unit_roundoff(dtype)
        return cls(16 * u, 128 * u)


@dataclass(frozen=True)
class Scored:
    """One position of a teacher-forced sequence: the forced token's logprob, and the model's top
    token there with the gap between its top two logprobs."""
    logprob: float
    top: int
    gap: float

    @classmethod
    def of(cls, token: int, entries: LogprobsOnePosition) -> Scored:
        """A position's logprobs (vLLM's dict, asked with 2 top tokens) as a Scored."""
        (first, best), (_, second) = top_of(entries, 2)
        return cls(entries[token].logprob, first, best - second)


def scored_completion(c) -> list[Scored]:
    """A completion's positions (logprobs=2) as Scored."""
    return [Scored.of(t, entries) for t, entries in zip(c.token_ids, c.logprobs)]


def prompt_scores(out) -> list[float]:
    """Each prompt token's logprob given the ones before (prompt_logprobs), from the second."""
    return [entries[t].logprob for t, entries in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


@dataclass
class Agreement:
    """What a comparison checked: tokens compared, near ties skipped, the largest and mean
    logprob differences."""
    compared: int = 0
    skipped: int = 0
    worst: float | None = None  # teacher-forced comparisons only
    mean: float | None = None

    def __str__(self) -> str:
        said = f"{self.compared} tokens compared, {self.skipped} skipped (near ties, or after the first)"
        return said if self.mean is None else f"{said}, logprob difference mean {self.mean:.4f} max {self.worst:.4f}"


def continuations(llm, prompts, max_tokens: int = 24) -> list[list[int]]:
    """Each prompt's token ids followed by its greedy continuation: what teacher forcing feeds."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]


def teacher_forced(llm, sequences: list[list[int]], first: list[int] | int) -> list[list[Scored]]:
    """Each sequence scored by `llm` from position `first` on (the continuation), every position
    on the sequence's own tokens before it."""
    firsts = first if isinstance(first, list) else [first] * len(sequences)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    scored = []
    for out, start in zip(outs, firsts):
        scored.append([Scored.of(out.prompt_token_ids[i], out.prompt_logprobs[i])
                       for i in range(start, len(out.prompt_token_ids))])
    return scored


def assert_close(got: list[list[Scored]], want: list[list[Scored]], tol: Tolerance, min_compared: float = 0.4) -> Agreement:
    """Teacher-forced logprobs within `tol` of the reference's, and the same top token wherever
    the reference's top two are at least `tol.token` apart; at least `min_compared` of all
    positions must be such (else the test would check nothing)."""
    diffs = [abs(g.logprob - w.logprob) for gs, ws in zip(got, want) for g, w in zip(gs, ws)]
    assert diffs and all(len(g) == len(w) for g, w in zip(got, want))
    result = Agreement(worst=max(diffs), mean=sum(diffs) / len(diffs))
    tipped = []
    for i, (gs, ws) in enumerate(zip(got, want)):
        for j, (g, w) in enumerate(zip(gs, ws)):
            if w.gap < tol.token:
                result.skipped += 1
            else:
                result.compared += 1
                if g.top != w.top:
                    tipped.append((i, j, round(w.gap, 4)))
    assert result.mean <= tol.mean and result.worst <= tol.token, f"{result}; allowed {tol}"
    assert not tipped, f"top token differs where the reference's top two are >= {tol.token:.4f} apart " \
                       f"(sequence, position, gap): {tipped}; {result}"
    assert result.compared >= min_compared * len(diffs), f"too few positions without a near tie: {result}"
    return result


def greedy_with_gaps(llm, prompts, params: SamplingParams, **kwargs) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and, per token, the gap between the top two logprobs."""
    outs = llm.generate(prompts, replace(params, logprobs=2), use_tqdm=False, **kwargs)
    return [(o.outputs[0].token_ids, [s.gap for s in scored_completion(o.outputs[0])]) for o in outs]


def assert_agree_until_a_near_tie(got: list[list[int]], want: list[tuple[list[int], list[float]]],
                                  tie: float) -> Agreement:
    """Free-running greedy: each `got` equals the reference up to its first difference, and at
    that position the reference's top two logprobs were less than `tie` apart."""
    result, parted = Agreement(), []
    for i, (g, (w, gaps)) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if first is None:
            assert len(g) == len(w), (i, g, w)
            result.compared += len(w)
            continue
        result.compared += first
        result.skipped += len(w) - first
        if gaps[first] >= tie:
            parted.append((i, first, round(gaps[first], 4)))
    assert not parted, f"greedy tokens part where the reference had no near tie (< {tie:.4f}) " \
                       f"(sequence, position, gap): {parted}; {result}"
    return result
