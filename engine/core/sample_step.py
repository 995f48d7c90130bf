"""One step's sampling: each sampling sequence's result from the step's logits.

Drafted rows are verified (spec_decode), a beam's row goes to its group whole (beam_search
chooses), and the rest are sampled in one batch (sampler), with the n > 1 siblings forking
from a sequence sampling from its row. Every row ends as tokens or as the exception it raised,
so one request's failure stays its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.sampler import sample
from engine.sched.step import RowResult, SchedulerOutput
from engine.request.sequence import Sequence
from engine.sample.spec_decode import verify_rows
from engine.request.structured import Grammars


@dataclass
class StepSample:
    results: dict[Sequence, RowResult]
    drafts: int = 0  # sequences whose drafts this step verified
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    decode_steps: int = 1  # greedy decode steps run in one call (engine/core/multi_step.py)


def sample_step(logits: torch.Tensor, rows: list[tuple[Sequence, int, int]], out: SchedulerOutput,
                grammars: Grammars, eos_ids: tuple[int, ...]) -> StepSample:
    """rows: (seq, its first logits row, rows) per sampling sequence (engine/worker/model_runner.py)."""
    drafted = [r for r in rows if r[2] > 1]
    results: dict[Sequence, RowResult] = verify_rows(logits, drafted)
    step = StepSample(results, len(drafted), sum(n - 1 for _, _, n in drafted),
                      sum(len(r) - 1 for r in results.values() if isinstance(r, list)))
    plain_rows, plain = [], []
    for seq, first, n in rows:
        if n == 1 and seq.beam:
            results[seq] = logits[first]
        elif n == 1:
            for s in (seq, *out.forks.get(seq, ())):
                plain_rows.append(first)
                plain.append(s)
    masks = grammars.masks([s.grammar for s in plain], logits.device)
    every_row = plain_rows == list(range(logits.shape[0]))  # (then no copy)
    plain_logits = logits if every_row else logits[plain_rows]
    for seq, result in zip(plain, sample(plain_logits, plain, eos_ids, masks)):
        results[seq] = result if isinstance(result, Exception) else [result]
    return step
