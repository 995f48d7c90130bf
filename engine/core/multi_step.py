"""Multi-step decode (vLLM v0's `num_scheduler_steps`): several greedy decode steps in one native call.

Rationale: one sequence decoding on the CPU spent about 0.9 ms of a 7.5-10.5 ms bf16 step in
Python around the native call (scheduling, building the batch, sampling, output processing),
and the first Python after a call that streamed the weights runs on cold caches. A step of
nothing but plain greedy decodes needs nothing from Python between its tokens: each token can
be fed back natively.

Approach: after `schedule()`, `plan` says how many steps the batch runs: more than one only when
every scheduled sequence decodes one token under plain greedy settings, nothing waits to be
admitted and no fork is due; at most each sequence's tokens left (max_tokens, max_model_len).
The scheduler maps the rows those steps write (`Scheduler.look_ahead`); the runner runs them in
one native call (`ModelRunner.run_steps`), which ends early once every sequence has picked a
stop token; `update_from_output` takes each sequence's tokens as it takes accepted drafts, up
to the first that stops it.

Implementation: the native loop (`decode_layers` given `tokens`) is the one-step call's
arithmetic, with torch.max's first maximal index as the pick, so the tokens are the ones that
single steps pick (tests/core/test_multi_step.py holds every layout and dtype to that).

Limitations: tokens arrive in bursts of up to `num_scheduler_steps` (a stream waits longer for
its next token, and a request arriving mid-call waits for the call); rows that stop before the
others, and tokens after a stop string (found in text, after the call), are computed and
dropped. Sampled rows (temperature > 0), logprobs, penalties, logit bias, min_tokens, grammars,
beams, LoRA adapters and n > 1 forks run one step at a time, as does a batch over the one-call
path's row limit or on another attention kernel.
"""
from __future__ import annotations

from engine.request.sequence import Sequence
from engine.sample.sampler import adjusts_logits
from engine.sched.step import SchedulerOutput


def plain_greedy(seq: Sequence) -> bool:
    """Whether seq's next tokens are each row's argmax and nothing more (no logprobs, no logits
    processing, no grammar, beam or adapter)."""
    p = seq.params
    return (p.greedy and p.logprobs is None and not p.best_of and seq.grammar is None and seq.beam is None
            and seq.lora is None and not adjusts_logits(seq))


def plan(out: SchedulerOutput, max_steps: int, max_model_len: int, eos_ids: tuple[int, ...],
         waiting: bool) -> tuple[int, list[int]]:
    """Steps the scheduled batch runs in one call (1: a step as usual), and the tokens that stop
    any of its sequences (the call ends once every sequence has picked one)."""
    if max_steps < 2 or waiting or out.forks or out.failed or not out.scheduled:
        return 1, []
    steps, stops = max_steps, set()
    for seq, n in out.scheduled:
        p = seq.params
        if n != 1 or seq.num_pending_tokens != 1 or seq.draft or seq.siblings or not plain_greedy(seq):
            return 1, []
        left = max_model_len - len(seq)
        if p.max_tokens is not None:
            left = min(left, p.max_tokens - seq.num_output_tokens)
        steps = min(steps, left)
        stops.update(p.stop_token_ids, () if p.ignore_eos else eos_ids)
    return max(steps, 1), sorted(stops)
