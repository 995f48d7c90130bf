"""The engine's core: one step over the scheduled batch (vLLM v1's EngineCore).

    drafts (spec_decode) -> Scheduler.schedule -> ModelRunner.run -> sample_step (sampler,
    spec_decode, beam rows) -> Scheduler.update_from_output

or, for a batch of plain greedy decodes under num_scheduler_steps > 1 (engine/core/multi_step.py):

    Scheduler.schedule -> multi_step.plan -> Scheduler.look_ahead -> ModelRunner.run_steps
    -> Scheduler.update_from_output

The core knows sequences and token ids, never text: the LLMEngine (engine/core/llm_engine.py) makes
a request's sequences before a step and turns what they did into outputs after it. The
scheduler writes every sequence's schedule state. A row whose sampling raises ends as that
exception, failing its request alone; a failure of the batch as a whole (the forward pass, the
KV cache) propagates, and the engine is then broken.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import vmm

from engine.config import EngineConfig
from engine.kv.manager import KVManager
from engine.worker.map_ahead import MapAhead
from engine.worker.cuda_graphs import capture_sizes, why_eager
from engine.worker.model_runner import ModelRunner
from engine.core import multi_step
from engine.core.sample_step import StepSample, sample_step
from engine.sample.sampler import Sampled, SamplingError, score
from engine.sched.scheduler import Scheduler
from engine.sched.tenant import SchedulerTenant
from engine.sched.step import Scheduled, SchedulerOutput, SeqOutput
from engine.request.sequence import Sequence
from engine.sample.spec_decode import NgramProposer, SpeculativeConfig
from engine.request.structured import Grammars


@dataclass
class CoreOutput:
    """What one step did: each sequence that moved (its new tokens, why it finished), the
    prompt tokens it scored (prompt_logprobs: a sequence, the position of its first scored
    token, the scores), and its sampling counts (speculative drafts verified and accepted)."""
    seqs: list[SeqOutput]
    prompt_scores: list[tuple[Sequence, int, list[Sampled]]]
    sampled: StepSample


class EngineCore:
    def __init__(self, config: EngineConfig, kv: KVManager, model, attention, max_model_len: int,
                 eos_ids: tuple[int, ...], grammars: Grammars, workers=None):
        c = config
        self.kv, self.max_model_len, self.eos_ids, self.grammars = kv, max_model_len, eos_ids, grammars
        self.scheduler = Scheduler(kv, c.max_num_seqs, c.max_num_batched_tokens, policy=c.scheduling_policy,
                                   preemption_mode=c.preemption_mode, eos_ids=eos_ids, max_model_len=max_model_len,
                                   max_loras=c.max_loras if c.enable_lora else None)
        self.tenant = SchedulerTenant(self.scheduler)  # over a pool several models share, the others ask it
        if isinstance(kv.pool, vmm.PoolShare):  # for pages (the share holds it weakly: this object keeps it)
            kv.pool.register(self.tenant)
        self.eager_reason = why_eager(c.device, c.enforce_eager, attention.name, c.tensor_parallel_size,
                                      c.enable_sleep_mode)
        self.runner = ModelRunner(model, kv, attention, max_model_len, c.device, c.compute_dtype, workers,
                                  None if self.eager_reason else capture_sizes(c.max_num_seqs))
        spec = c.speculative_config
        self.proposer = NgramProposer(SpeculativeConfig.from_dict(spec)) if spec else None
        self.map_ahead = MapAhead(kv, c.map_ahead_tokens, self.scheduler.headroom_pages) if c.map_ahead_tokens else None
        self.max_steps = c.num_scheduler_steps

    @property
    def decode_path(self) -> str:
        """How decode steps run: replayed CUDA graphs (how many, their memory), or eagerly and why."""
        graphs = self.runner.graphs
        if graphs is None:
            return f"eager ({self.runner.graph_error or self.eager_reason})"
        return (f"CUDA graphs for batch sizes {graphs.sizes[0]}..{graphs.sizes[-1]} ({len(graphs.sizes)} graphs, "
                f"{graphs.bytes / 2 ** 20:.0f} MiB, captured in {graphs.seconds:.1f} s)")

    def add(self, seq: Sequence) -> None:
        self.scheduler.queues.add(seq)

    def abort(self, request_id: str) -> None:
        self._forget(self.scheduler.queues.finish_request(request_id, "abort"))

    def has_unfinished(self) -> bool:
        return self.scheduler.queues.has_unfinished()

    def step(self, token_budget: int | None = None) -> CoreOutput | None:
        """One forward pass over what the scheduler picks (at most token_budget tokens); None
        when nothing was scheduled."""
        drafts = self.proposer.propose_all(self.scheduler.queues.running, self.max_model_len) if self.proposer else None
        out = self.scheduler.schedule(token_budget, drafts)
        if not out:
            return None
        steps, stops = multi_step.plan(out, self.max_steps, self.max_model_len, self.eos_ids,
                                       bool(self.scheduler.queues.waiting or self.scheduler.queues.swapped))
        if steps > 1 and self.runner.runs_steps(len(out.scheduled)):
            self.scheduler.look_ahead(out, steps)
        # (with nothing scheduled, only requests failed while scheduling: nothing runs)
        if out.steps > 1:
            scores, sampled = [], self._run_steps(out, stops)
        else:
            scores, sampled = self._run(out) if out.scheduled else ([], StepSample({}))
        seqs = self.scheduler.update_from_output(out, sampled.results)
        self._forget([o.seq for o in seqs if o.seq.is_finished])
        return CoreOutput(seqs, scores, sampled)

    def _run(self, out: SchedulerOutput) -> tuple[list[tuple[Sequence, int, list[Sampled]]], StepSample]:
        """The forward pass, then the prompt tokens it scored and each row's sampled tokens."""
        with self._mapping_ahead(out.scheduled):
            logits, rows, scoring = self.runner.run(out.scheduled)
        scores = [(seq, position + 1, score(logits[first:first + n], seq.token_ids[position + 1:position + 1 + n],
                                            seq.params.prompt_logprobs)) for seq, first, position, n in scoring]
        return scores, sample_step(logits, rows, out, self.grammars, self.eos_ids)

    def _run_steps(self, out: SchedulerOutput, stops: list[int]) -> StepSample:
        """Several greedy decode steps in one call: each sequence's tokens (a row whose logits were
        not finite fails its request, as the sampler fails it)."""
        with self._mapping_ahead(out.scheduled):
            tokens = self.runner.run_steps(out.scheduled, out.steps, stops)
        return StepSample({seq: SamplingError(f"request {seq.request_id!r}: the processed distribution has "
                                              "non-finite logits") if -2 in picked else [Sampled(t) for t in picked]
                           for seq, picked in tokens.items()}, decode_steps=max(map(len, tokens.values())))

    @contextlib.contextmanager
    def _mapping_ahead(self, scheduled: Scheduled):
        """The map-ahead worker maps the scheduled sequences' next pages while the forward pass runs."""
        if self.map_ahead:
            self.map_ahead.start(scheduled)
        try:
            yield
        finally:
            if self.map_ahead:
                self.map_ahead.wait()

    def finish(self, stopped: list[Sequence], failed: list[str]) -> None:
        """After output processing: the sequences a stop string ended, the requests whose
        processing raised."""
        for seq in stopped:
            self.scheduler.queues.finish(seq, "stop")
        gone = list(stopped)
        for request_id in failed:
            gone += [o.seq for o in self.scheduler.fail_request(request_id, "failed in output processing")]
        self._forget(gone)

    def _forget(self, seqs: list[Sequence]) -> None:
        if self.proposer:
            for seq in seqs:
                self.proposer.forget(seq)

    @property
    def map_seconds(self) -> float:
        """Time spent mapping and copying KV pages so far on the step's critical path (waiting
        for the map-ahead worker included)."""
        return self.kv.map_seconds + (self.map_ahead.wait_seconds if self.map_ahead else 0.0)

    def close(self) -> None:
        if self.map_ahead:
            self.map_ahead.close()
