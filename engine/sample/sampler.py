"""Turn a step's logits into next tokens, each row under its own SamplingParams, in one batch.

    logits -> allowed-token masks (structured outputs) -> logit_bias -> penalties -> bans
    (min_tokens) -> greedy rows: argmax | sampled rows: / temperature -> top-k -> top-p -> min-p
    -> softmax -> exponential race (seeded rows draw from their own generator)

Reported logprobs are the model's raw distribution (vLLM's default), before any of the above.

A row whose processed logits are not finite, or that allows no token at all, fails with
`SamplingError`; if the batch raises anything, every row is sampled alone so the failure
stays with the row that caused it. Callers fail that row's request and go on.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

import ext
from engine.request.sequence import Sequence


class SamplingError(RuntimeError):
    """One row could not be sampled; the message says why."""


@dataclass(slots=True)
class Sampled:
    token_id: int
    logprob: float | None = None  # of the chosen token under the raw distribution
    top: list[tuple[int, float]] | None = None  # the k most likely tokens, best first
    rank: int | None = None  # the chosen token's among the vocabulary, from 1 (ties count against it, as vLLM's)


def sample(logits: torch.Tensor, seqs: Seq[Sequence], eos_ids: tuple[int, ...],
           masks: torch.Tensor | None = None) -> list[Sampled | Exception]:
    """One Sampled, or the exception that row raised, per row of logits [rows, vocab].
    `masks`: optional bool [rows, vocab], True where a token is allowed."""
    try:
        return _sample_batch(logits, seqs, eos_ids, masks)
    except Exception as exc:
        if len(seqs) == 1:
            return [exc]
    return [sample(logits[i:i + 1], seqs[i:i + 1], eos_ids, None if masks is None else masks[i:i + 1])[0]
            for i in range(len(seqs))]


def _sample_batch(logits, seqs, eos_ids, masks) -> list[Sampled]:
    adjusted = [row for row, seq in enumerate(seqs) if adjusts_logits(seq)]
    x = logits.float()
    if masks is not None or adjusted:  # the raw logits stay for logprobs and a row-by-row retry
        x = x.clone()
    if masks is not None:
        x.masked_fill_(~masks, float("-inf"))
    for row in adjusted:
        _adjust_row(x[row], seqs[row], eos_ids)
    best, tokens = row_max(x)  # the greedy tokens, and (max propagates NaN) a check of every row
    for row, value in enumerate(best.tolist()):
        if not math.isfinite(value):
            what = "allows no token" if value == float("-inf") else "has non-finite logits"
            raise SamplingError(f"request {seqs[row].request_id!r}: the processed distribution {what}")
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    tokens = tokens.cpu()
    if sampled:
        tokens[sampled] = _draw(x[sampled], [seqs[i] for i in sampled]).cpu()
    return _with_logprobs(logits, tokens.tolist(), seqs)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.max(x, -1) of [rows, vocab] logits: each row's maximum and the first index of it (NaN
    where the row holds one). On the CPU by the native kernel where it loads: torch's runs about
    45 us a row of a 49,152-token vocabulary (0.7 ms for 32 rows), the native one 4."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1]
            and ext.cpu_kernels() is not None):
        x = x.contiguous()
        values, indices = x.new_empty(x.shape[0]), torch.empty(x.shape[0], dtype=torch.long)
        torch.ops.vkv.row_max(x, values, indices)
        return values, indices
    return x.max(-1)


def adjusts_logits(seq: Sequence) -> bool:
    """Whether seq's logits are processed before its pick (logit_bias, penalties, a min_tokens ban)."""
    p = seq.params
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or (p.presence_penalty or p.frequency_penalty)
                or (seq.num_output_tokens < p.min_tokens and (p.stop_token_ids or not p.ignore_eos)))


def _adjust_row(x: torch.Tensor, seq: Sequence, eos_ids: tuple[int, ...]) -> None:
    """logit_bias, penalties and min_tokens bans, in place on one row."""
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=x.device)
        x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device)
    if p.repetition_penalty != 1.0:  # Hugging Face's: over prompt and output tokens
        seen = torch.tensor(sorted(set(seq.token_ids)), device=x.device)
        scores = x[seen]
        x[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:  # OpenAI's: output only
        ids, counts = torch.tensor(seq.output_token_ids, device=x.device).unique(return_counts=True)
        x[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(x.dtype)
    if seq.num_output_tokens < p.min_tokens:  # no EOS or stop token yet
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        if banned:
            x[torch.tensor(banned, device=x.device)] = float("-inf")


def _draw(x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Sample one token per row: temperature, top-k, top-p, min-p, then an exponential race
    (argmax of p / E with E ~ Exp(1) draws from p)."""
    device = x.device
    temperature = torch.tensor([s.params.temperature for s in seqs], device=device)
    x = filter_logits(x / temperature[:, None], [s.params for s in seqs])
    probs = x.softmax(-1)
    noise = torch.empty_like(probs).exponential_()
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            noise[row].exponential_(generator=seq.generator)
    noise.clamp_(min=1e-30)  # never 0: a 0/0 would win the argmax
    return row_max(probs / noise)[1]


def filter_logits(x: torch.Tensor, params) -> torch.Tensor:
    """min-p relative to the most likely token, then top-k (ties with the k-th kept), then top-p
    over what is left (the smallest set whose mass reaches p): vLLM's order (min-p is one of its
    logits processors, run before its top-k/top-p sampler)."""
    vocab = x.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=x.device)
    top_p = torch.tensor([p.top_p for p in params], device=x.device)
    min_p = torch.tensor([p.min_p for p in params], device=x.device)
    if bool((min_p > 0).any()):
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        ordered, order = x.sort(-1, descending=True)
        kth = ordered.gather(-1, (top_k - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        probs = ordered.softmax(-1)
        drop = ((top_p[:, None] < 1) & (probs.cumsum(-1) - probs > top_p[:, None])) | (ordered == float("-inf"))
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return x


def score(logits: torch.Tensor, tokens: list[int], k: int) -> list[Sampled]:
    """Given tokens under their rows' raw distributions, each with its row's k most likely
    tokens (prompt_logprobs: row i is the model's guess at tokens[i])."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])
    ranks = (lp >= chosen).sum(-1).tolist()
    top = torch.topk(lp, k) if k else None
    tops = zip(top.indices.tolist(), top.values.tolist()) if top is not None else ([] for _ in tokens)
    return [Sampled(t, c, list(zip(*ranked)) if k else [], r)
            for t, c, ranked, r in zip(tokens, chosen[:, 0].tolist(), tops, ranks)]


def _with_logprobs(logits: torch.Tensor, tokens: list[int], seqs) -> list[Sampled]:
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None or s.params.best_of]
    out = [Sampled(t) for t in tokens]
    if not want:
        return out
    logprobs = logits[want].float().log_softmax(-1)
    for row, lp in zip(want, logprobs):
        k = seqs[row].params.logprobs or 0
        out[row].logprob = float(lp[tokens[row]])
        if seqs[row].params.logprobs is not None:
            top = torch.topk(lp, k) if k else None
            out[row].top = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            out[row].rank = int((lp >= lp[tokens[row]]).sum())
    return out
