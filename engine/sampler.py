"""Turn each sequence's logits into its next token, honouring its own SamplingParams.

Sequences differ in every parameter and each seeded request owns a generator, so sampling runs
row by row: at most max_num_seqs rows a step, cheap next to the forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass(slots=True)
class Sampled:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:  # Hugging Face's: over prompt and output tokens
        seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:  # OpenAI's: output only
        ids, counts = torch.tensor(seq.output_token_ids, device=logits.device).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def sample_one(logits: torch.Tensor, seq: Sequence, banned: list[int]) -> Sampled:
    p = seq.params
    raw = logits
    logits = apply_penalties(logits.clone(), seq)
    if banned:  # min_tokens not reached: no EOS or stop token yet
        logits[banned] = float("-inf")
    if p.greedy:
        token = int(logits.argmax())
    else:
        logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=seq.generator))
    if p.logprobs is None:
        return Sampled(token)
    logprobs = raw.log_softmax(-1)
    top = torch.topk(logprobs, p.logprobs) if p.logprobs else None
    top_dict = dict(zip(top.indices.tolist(), top.values.tolist())) if top is not None else {}
    return Sampled(token, float(logprobs[token]), top_dict)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> list[Sampled]:
    out = []
    for row, seq in zip(logits, seqs):
        p = seq.params
        banned = []
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
        out.append(sample_one(row, seq, banned))
    return out
