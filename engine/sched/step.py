"""One step's types, in their own module (vLLM v1's sched/output.py): what the scheduler hands
the runner and the sampler (`SchedulerOutput`, `Scheduled`), what a step's rows give a sequence
(`RowResult`), and what a sequence did in the step (`SeqOutput`). The scheduler writes the
first, the sampler the second, the scheduler's `update_from_output` the third; the runner,
map-ahead, sampling and the output processor read them without importing the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sample.sampler import Sampled
from engine.request.sequence import Sequence

Scheduled = list[tuple[Sequence, int]]  # (sequence, number of its tokens computed this step)
# What a step's rows gave a sequence: its tokens (one, or the kept drafts and one more), a beam's
# logits row (its group chooses), or the exception its row raised.
RowResult = list[Sampled] | torch.Tensor | Exception


@dataclass(slots=True)
class SeqOutput:
    """What one sequence did in a step (vLLM's EngineCoreOutput): the tokens it took, and why
    it finished, if it did (with the error when it failed)."""
    seq: Sequence
    new: list[Sampled]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class SchedulerOutput:
    """One step: what each sequence computes, and the siblings that fork from a sequence whose
    prompt this step completes (they sample from its row)."""
    scheduled: Scheduled = field(default_factory=list)
    forks: dict[Sequence, list[Sequence]] = field(default_factory=dict)
    failed: list[SeqOutput] = field(default_factory=list)  # requests failed while scheduling (see _checked)
    steps: int = 1  # greedy decode steps the batch runs in one call (multi-step: Scheduler.look_ahead)

    def __bool__(self) -> bool:
        return bool(self.scheduled or self.failed)
