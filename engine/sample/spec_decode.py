"""Speculative decoding with n-gram proposals (vLLM's "ngram" method, prompt lookup decoding).

Each decoding sequence proposes up to k tokens: the longest n-gram (n from prompt_lookup_max
down to prompt_lookup_min) that ends its tokens and occurred before in its prompt or output,
followed by the tokens that came after its latest earlier occurrence. One forward pass computes
every proposal of the batch (k + 1 query rows per sequence, like a prefill chunk), and each
sequence keeps the longest prefix of its proposal the model agrees with, plus one token of
its own:

  greedy   a drafted token is kept while it is the model's argmax
  sampled  drafted token d, at a row whose distribution (after temperature, top-k, top-p,
           min-p) is p, is kept with probability p(d); at the first refusal the token is drawn
           from p without d, renormalized: rejection sampling with a point-mass proposal, so
           every token emitted follows p exactly

Rollback costs nothing in a virtual KV cache: rows written for refused tokens are overwritten
later, the scheduler counts only kept tokens as computed (so the prefix cache never sees the
others), and pages mapped for them stay for the next step.

Requests with penalties, logit_bias, min_tokens, structured outputs or logprobs, and beams,
decode one token a step: their next distribution depends on each previous token in ways a row
computed before that token was chosen cannot reflect. So do seeded sampled requests: whether a
row gets drafts depends on the rest of the batch (disable_by_batch_size, the token budget), and
verifying drafts draws other random numbers than sampling one token, so a seed would give other
tokens beside other traffic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.sampler import Sampled, filter_logits, row_max
from engine.request.sequence import Sequence


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's names and defaults for the n-gram method: the lookup lengths default to each
    other, or to 5 when neither is given. `disable_by_batch_size`: no drafts in a step that
    runs that many sequences or more (vLLM stops drafting for new requests then), since a
    batch that large already keeps the processor busy and drafts only add work; default 8, the
    measured break-even on the CPU (benchmarks/bench_spec_decode.py)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = 8

    def __post_init__(self):
        lookup_max = self.prompt_lookup_max or self.prompt_lookup_min or 5
        object.__setattr__(self, "prompt_lookup_max", lookup_max)
        object.__setattr__(self, "prompt_lookup_min", self.prompt_lookup_min or lookup_max)
        checks = [(self.method == "ngram", f"speculative method {self.method!r} is not supported: use 'ngram'"),
                  (1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens must be in [1, 16]"),
                  (1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16,
                   "need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16"),
                  (self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
                   "disable_by_batch_size must be >= 1")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_dict(cls, options: dict) -> SpeculativeConfig:
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative_config fields: {sorted(unknown)}")
        return cls(**options)


def speculates(seq: Sequence) -> bool:
    """Whether seq's next tokens may be drafted (see the module note)."""
    p = seq.params
    return not (p.logit_bias or p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
                or seq.num_output_tokens < p.min_tokens or p.structured_outputs or p.logprobs is not None
                or p.best_of or (p.seed is not None and p.temperature > 0))


class NgramProposer:
    """Per sequence, an index from each n-gram to the end of its latest occurrence, grown one
    position per token; a lookup is one dictionary probe per n."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.index: dict[int, tuple[int, dict]] = {}  # seq_id -> (positions indexed, {ngram: end})

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that may follow seq's tokens."""
        c, tokens = self.config, seq.token_ids
        limit = min(c.num_speculative_tokens, limit)
        if limit <= 0:
            return []
        done, grams = self.index.get(seq.seq_id, (0, {}))
        last = len(tokens) - 1
        for end in range(done, last):  # every n-gram ending before the last token: the earlier occurrences
            for n in range(c.prompt_lookup_min, min(c.prompt_lookup_max, end + 1) + 1):
                grams[tuple(tokens[end - n + 1:end + 1])] = end
        self.index[seq.seq_id] = (max(done, last), grams)
        for n in range(min(c.prompt_lookup_max, len(tokens)), c.prompt_lookup_min - 1, -1):
            end = grams.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + limit]
        return []

    def forget(self, seq: Sequence) -> None:
        """seq is gone: its index goes too."""
        self.index.pop(seq.seq_id, None)

    def propose_all(self, running: list[Sequence], max_model_len: int) -> dict[Sequence, list[int]]:
        """Drafts for the decoding sequences that may take them; none in a step as large as
        disable_by_batch_size."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return {}
        drafts = {}
        for seq in running:  # (not while n > 1 siblings wait to fork from its next row, which drafts would move)
            if seq.num_pending_tokens == 1 and speculates(seq) and seq.beam is None and not seq.siblings:
                room = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - len(seq))
                drafts[seq] = self.propose(seq, room - 1)
        return drafts


def verify_rows(logits: torch.Tensor, rows: list[tuple[Sequence, int, int]]) -> dict[Sequence, list[Sampled] | Exception]:
    """Per sequence whose step carried drafts (rows > 1), the tokens it emits, or the exception
    its verification raised: that row's failure is its own."""
    results = {}
    for seq, first, n in rows:
        try:
            results[seq] = verify(logits[first:first + n], seq, seq.draft[:n - 1])
        except Exception as exc:
            results[seq] = exc
    return results


def verify(logits: torch.Tensor, seq: Sequence, draft: list[int]) -> list[Sampled]:
    """The tokens seq emits from its len(draft) + 1 rows of logits: the kept drafts, then one
    of its own."""
    p = seq.params
    if p.greedy:
        best = row_max(logits.float())[1].tolist()
        kept = next((i for i, d in enumerate(draft) if d != best[i]), len(draft))
        return [Sampled(t) for t in draft[:kept]] + [Sampled(best[kept])]
    probs = filter_logits(logits.float() / p.temperature, [p] * logits.shape[0]).softmax(-1)
    emitted = []
    for i, d in enumerate(draft):
        if float(torch.rand((), generator=seq.generator)) < float(probs[i, d]):
            emitted.append(Sampled(d))
            continue
        residual = probs[i].clone()
        residual[d] = 0
        emitted.append(Sampled(_draw_one(residual, seq)))
        return emitted
    return emitted + [Sampled(_draw_one(probs[len(draft)], seq))]


def _draw_one(weights: torch.Tensor, seq: Sequence) -> int:
    return int(torch.multinomial(weights / weights.sum(), 1, generator=seq.generator))
