"""The engine loop: requests in, one `step()` at a time, outputs back.

    schedule (pages mapped inside) -> model forward -> count what was computed -> sample ->
    detokenize -> stop checks -> finished sequences give their slots back

A failure while sampling or finishing one request fails that request alone (finish reason
"error", the message in its output) and the step goes on for the others. A failure of the
batch as a whole (the forward pass, the KV cache) propagates: the engine is then broken.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

import ext
import vmm
from engine.attention import pick_attention, tile_rows
from engine.beam_search import BeamGroup, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.config import DEFAULT_HOST_PAGE, EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.inputs import Prompt, tokenize
from engine.kv.paged import PagedKVCache
from engine.kv.tiers import make_tiers, namespace_of
from engine.kv.virtual import VirtualKVCache
from engine.map_ahead import MapAhead
from engine.model_runner import ModelRunner, activation_peak
from engine.parallel import RecordedKV, Workers, check_divisible, shard_config
from engine.models import load_config, load_model, load_tokenizer, weights_fingerprint
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampler import Sampled, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_decode import NgramProposer, SpeculativeConfig, speculates, verify
from engine.sequence import Sequence
from engine.stats import EngineStats
from engine.structured import Grammars, consume

log = logging.getLogger("vkv.engine")


def make_backend(c: EngineConfig) -> vmm.Backend:
    """Where a virtual KV cache's physical pages come from: the GPU's VMM or the host's memfd."""
    if c.device.type == "cuda":
        return vmm.CudaBackend(c.device.index or 0, c.page_size)
    return vmm.HostBackend(c.page_size or DEFAULT_HOST_PAGE)


class EngineSleeping(RuntimeError):
    """A request came while the engine sleeps."""


@dataclass
class Request:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    seqs: list[Sequence]  # its completions (best_of of them); a beam search's live beams are its group's
    detokenizers: list[IncrementalDetokenizer]
    texts: list[str] = field(default_factory=list)
    unforked: list[Sequence] = field(default_factory=list)  # n > 1: wait to share seq 0's prompt
    beam: BeamGroup | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        if self.error:
            return True
        return self.beam.done if self.beam else all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: tuple | None = None, tp_rank: int = 0,
                 pool: vmm.PoolShare | None = None):
        """loaded: (model, tokenizer) already in memory for config.model, to run another engine
        over the same weights (a fresh KV cache and scheduler) without loading them again.
        tp_rank > 0: a tensor-parallel worker's engine (engine/parallel.py), never stepped.
        pool: this model's share of a physical pool several models draw from (engine/multi.py);
        config.kv_cache_memory is then ignored."""
        self.config = c = config
        self.model_config = load_config(c.model)
        self.max_model_len = c.resolve_max_model_len(self.model_config.max_position_embeddings)
        tp = c.tensor_parallel_size
        self.workers = None
        if tp > 1:
            check_divisible(self.model_config, tp)
            if loaded is not None:
                raise ValueError("an engine with tensor_parallel_size > 1 loads its own weight shards")
            if tp_rank == 0:
                self.workers = Workers(c, tp, LLMEngine)
        if loaded is None:
            loaded = (load_model(c.model, self.model_config, c.device, c.dtype, c.seed, (tp_rank, tp), c.compute_dtype),
                      load_tokenizer(c.model))
        self.model, self.tokenizer = loaded
        self.eos_ids = self.model_config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.attention = pick_attention(c.attention_backend, c.device, c.compute_dtype, c.kv_layout,
                                        self.model_config.head_dim, c.block_size, self.model_config.sliding_window)
        peak = 0
        if c.device.type == "cuda" and c.kv_cache_memory is None:  # size the pool after a profile run
            peak = activation_peak(self.model, c.max_num_batched_tokens, c.max_num_seqs, c.device)
        if pool is not None:
            if tp > 1 or c.kv_layout == "paged":
                raise ValueError("a shared KV pool needs a virtual kv_layout (interleaved or per_layer) and "
                                 "tensor_parallel_size 1")
            self.kv = self._make_kv_cache(self.model_config, 0, pool)
        else:
            self.kv = self._make_kv_cache(shard_config(self.model_config, tp), c.kv_budget_bytes(peak) // tp)
        self.kv.window = self.model_config.sliding_window
        if c.offloading:
            self._attach_tiers()
        if self.workers:
            self.kv = RecordedKV(self.kv)
        self.scheduler = Scheduler(self.kv, c.max_num_seqs, c.max_num_batched_tokens, policy=c.scheduling_policy,
                                   preemption_mode=c.preemption_mode)
        self.runner = ModelRunner(self.model, self.kv, self.attention, self.max_model_len, c.device, c.compute_dtype,
                                  self.workers)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.requests: dict[str, Request] = {}
        self.closed = False
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.num_finished = self.num_failed = 0
        spec = c.speculative_config
        self.proposer = NgramProposer(SpeculativeConfig.from_dict(spec)) if spec else None
        self.num_drafts = self.num_drafted = self.num_accepted = 0
        self.map_ahead = MapAhead(self.kv, c.map_ahead_tokens, self.scheduler.headroom_pages) \
            if c.map_ahead_tokens else None
        if tp_rank == 0:
            log.info("vkv: %s", "; ".join(f"{k}: {v}" for k, v in self.platform().items()))

    def platform(self) -> dict[str, str]:
        """Which paths run on this machine, and why: arithmetic, GEMMs, attention, kernel ISA."""
        compute, why = self.config.arithmetic()
        isa, isa_why = ext.kernel_isa()
        return {"compute_dtype": str(compute).removeprefix("torch."), "compute_reason": why,
                "kv_dtype": str(self.config.dtype).removeprefix("torch."), "gemm": self.model.gemm_path,
                "attention": self.attention,
                "kernel_isa": f"{isa} ({isa_why})" if self.model.native else f"none ({ext.cpu_kernels_error()})"}

    def _make_kv_cache(self, cfg, budget: int, pool: vmm.PoolShare | None = None) -> VirtualKVCache | PagedKVCache:
        """This rank's KV cache: cfg holds its share of the KV heads, budget its bytes (or
        pool, a share of a pool several models draw from)."""
        c = self.config
        if c.kv_layout == "paged":
            itemsize = torch.empty((), dtype=c.dtype).element_size()
            block_bytes = c.block_size * cfg.kv_bytes_per_token(itemsize)
            num_blocks = budget // block_bytes
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory {budget} is below one block ({block_bytes} bytes)")
            return PagedKVCache(cfg, c.block_size, num_blocks, c.dtype, c.device,
                                c.enable_prefix_caching)
        if pool is not None:
            backend, num_pages = pool.backend, pool.num_pages
        else:
            backend = make_backend(c)
            num_pages = budget // backend.page_size
            if num_pages < 1:
                backend.close()
                raise ValueError(f"kv_cache_memory {budget} is below one page ({backend.page_size} bytes)")
        swap = None
        if c.preemption_mode == "swap":  # swapped sequences keep their slots: twice the slots
            swap = vmm.SwapSpace(backend, int(c.swap_space * (1 << 30)), c.swap_path)
        return VirtualKVCache(cfg, c.kv_layout, c.max_num_seqs * (2 if swap else 1),
                              self.max_model_len, c.dtype, backend, num_pages, c.enable_prefix_caching,
                              tile_rows(self.attention, cfg.head_dim, c.device), swap, pool)

    def _attach_tiers(self) -> None:
        """The KV tiers below the pool. Pages are named in a namespace of the weights and the KV
        geometry, so a disk tier never hands this engine another model's or layout's bytes."""
        c, geometry = self.config, self.kv.geometry()
        describe = {"model": c.model or "bundled", "compute_dtype": str(c.compute_dtype), **geometry}
        weights = weights_fingerprint(c.model, c.seed) if c.kv_offloading_path else b""
        namespace = namespace_of(weights, {k: v for k, v in describe.items() if k != "model"})
        tiers = make_tiers(c.device, self.kv.entry_bytes, int(c.kv_offloading_size * (1 << 30)),
                           c.kv_offloading_path, int(c.kv_offloading_path_size * (1 << 30)), namespace, describe)
        self.kv.attach_tiers(tiers, namespace)

    # -- requests -------------------------------------------------------------------------
    def tokenize(self, prompt) -> Prompt:
        return tokenize(self.tokenizer, self.model_config.vocab_size, prompt)

    def validate(self, prompt: Prompt, params: SamplingParams | BeamSearchParams) -> None:
        """Refuse, with the numbers, a request that could never run to its end or that names
        tokens outside the vocabulary. A beam group runs in lockstep, so all its beams must be
        able to run at once."""
        vocab = self.model_config.vocab_size
        if isinstance(params, SamplingParams):
            if any(t >= vocab for t in params.token_ids_used()):
                raise ValueError(f"stop_token_ids and logit_bias must name token ids below the vocabulary "
                                 f"size {vocab}")
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            if params.min_tokens and len(banned) >= vocab:
                raise ValueError(f"min_tokens {params.min_tokens} bans every token of the vocabulary until then: "
                                 f"stop_token_ids (and EOS) name all {vocab}")
            if params.structured_outputs:
                self.grammars.compile(params.structured_outputs)
        num_prompt_tokens = len(prompt.token_ids)
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds max_model_len {self.max_model_len}")
        width = params.beam_width if isinstance(params, BeamSearchParams) else 1
        if width > self.config.max_num_seqs:
            raise ValueError(f"beam_width {width} exceeds max_num_seqs {self.config.max_num_seqs}")
        window = self.model_config.sliding_window  # its pages are let go as it grows
        pages = width * self.kv.pages_for(min(total, window + self.config.max_num_batched_tokens) if window else total)
        if pages > self.kv.pool.num_pages:
            beams = f" for {width} beams" if width > 1 else ""
            raise ValueError(f"{total} tokens{beams} need {pages} KV pages, more than the "
                             f"whole KV budget of {self.kv.pool.num_pages} pages")

    def add_request(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams, *,
                    group: str | None = None, priority: int = 0) -> None:
        """prompt: text, token ids or a Prompt. With BeamSearchParams the request is a beam
        search: its beams are greedy sequences that a BeamGroup steers. Requests of one
        `group` (one client's) share fairly with other groups; lower `priority` runs first."""
        if self.is_sleeping:
            raise EngineSleeping("the engine is sleeping: wake it up first")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (--scheduling-policy priority); "
                             f"under {self.config.scheduling_policy!r} it would be ignored")
        prompt = self.tokenize(prompt)
        self.validate(prompt, params)
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = BeamGroup(params, self.eos_ids, self.max_model_len)
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        now, ids = time.monotonic(), prompt.token_ids
        seqs = [Sequence(request_id, i, list(ids), params, now, group or request_id, priority,
                         generator=self._generator(params, i), cache_salt=prompt.cache_salt)
                for i in range(params.num_samples)]
        if params.structured_outputs:
            grammar = self.grammars.compile(params.structured_outputs)
            for seq in seqs:
                seq.grammar = self.grammars.matcher(grammar)
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) for _ in seqs]
        if beam:  # the group holds the live beams
            beam.live[seqs[0]] = 0.0
        self.requests[request_id] = Request(request_id, prompt, params, [] if beam else seqs, detoks,
                                            [""] * len(seqs), seqs[1:], beam)
        self.scheduler.add(seqs[0])
        self.num_prompt_tokens += len(ids)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Seeded requests draw from their own generators (seed + index for the index-th
        completion); the rest share torch's default one."""
        if params.seed is None or params.greedy:
            return None
        g = torch.Generator(device=self.config.device)
        g.manual_seed((params.seed + index) % (1 << 64))
        return g

    def abort(self, request_id: str) -> None:
        if self.requests.pop(request_id, None):
            self.scheduler.finish_request(request_id, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def map_seconds(self) -> float:
        """Time spent mapping and copying KV pages so far on the step's critical path (waiting
        for the map-ahead worker included)."""
        return self.kv.map_seconds + (self.map_ahead.wait_seconds if self.map_ahead else 0.0)

    # -- sleep (vLLM's sleep mode) ---------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release every physical KV page; reservations, views and weights stay, so waking up
        rebuilds nothing above the KV cache. Requests in flight are not touched: sleeping with
        any unfinished raises (finish or abort them first; the server drains them)."""
        if level != 1:
            raise ValueError(f"sleep level {level} is not supported: level 1 releases the KV cache and "
                             f"keeps the weights (level 2, dropping weights too, is not implemented)")
        if self.has_unfinished():
            raise RuntimeError(f"cannot sleep with {len(self.requests)} requests in flight: finish or abort them")
        if not self.is_sleeping:
            self.kv.sleep()
            self.sync_workers()

    def wake_up(self) -> None:
        self.kv.wake_up()
        self.sync_workers()

    def sync_workers(self) -> None:
        """Tensor parallel: the other ranks make the KV calls made outside a step now."""
        if self.workers:
            self.workers.send(self.kv.take_calls(), None)

    @property
    def is_sleeping(self) -> bool:
        return self.kv.asleep

    # -- the loop -------------------------------------------------------------------------
    def step(self, token_budget: int | None = None) -> list[RequestOutput | BeamSearchOutput]:
        """One forward pass over the scheduled batch; outputs of the requests it advanced.
        token_budget: at most this many tokens this step (below max_num_batched_tokens), so
        other models sharing the machine wait at most one short step (engine/multi.py)."""
        if self.proposer:
            self._propose()
        scheduled = self.scheduler.schedule(token_budget)
        if not scheduled:
            return []
        if self.map_ahead:
            self.map_ahead.start(scheduled)
        try:
            logits, sampling = self.runner.run(scheduled)
        finally:
            if self.map_ahead:
                self.map_ahead.wait()
        drafted = self._verify_drafts(logits, sampling)
        self.scheduler.update_after_step(scheduled, {s: len(s.draft) + 1 - len(e) for s, e in drafted.items()})
        return self._process(logits, sampling, drafted)

    def _propose(self) -> None:
        """Drafts for the decoding sequences that may take them (engine/spec_decode.py)."""
        limit = self.proposer.config.disable_by_batch_size
        busy = limit is not None and len(self.scheduler.running) >= limit
        for seq in self.scheduler.running:
            seq.draft = []
            if not busy and seq.num_pending_tokens == 1 and speculates(seq) and not self.requests[seq.request_id].beam:
                room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
                seq.draft = self.proposer.propose(seq, room - 1)
        if len(self.proposer.index) > 4 * self.config.max_num_seqs:  # forget sequences that are gone
            live = {s.seq_id for s in (*self.scheduler.running, *self.scheduler.swapped, *self.scheduler.waiting)}
            self.proposer.index = {k: v for k, v in self.proposer.index.items() if k in live}

    def _verify_drafts(self, logits: torch.Tensor, sampling: list[tuple[Sequence, int, int]]) -> dict:
        """For each sequence whose step carried drafts, the tokens it emits: the kept drafts,
        then one of its own. A verification that raises fails its request."""
        drafted = {}
        for seq, first, rows in sampling:
            if rows == 1:
                continue
            self.num_drafts += 1
            self.num_drafted += rows - 1
            try:
                drafted[seq] = verify(logits[first:first + rows], seq, seq.draft[:rows - 1])
            except Exception as exc:
                self._fail(self.requests[seq.request_id], exc)
                continue
            self.num_accepted += len(drafted[seq]) - 1
        return drafted

    def _process(self, logits: torch.Tensor, sampling: list[tuple[Sequence, int, int]],
                 drafted: dict[Sequence, list[Sampled]]) -> list[RequestOutput | BeamSearchOutput]:
        touched: dict[str, Request] = {}
        plain: list[tuple[int, Sequence]] = []
        for seq, first, rows in sampling:
            request = touched.setdefault(seq.request_id, self.requests[seq.request_id])
            if request.error:
                continue
            if seq in drafted:
                for sampled in drafted[seq]:
                    if seq.is_finished or request.error:
                        break
                    self._guarded(request, self._append, seq, sampled, request)
            elif request.beam:
                self._guarded(request, request.beam.offer, seq, logits[first])
            else:
                plain.append((first, seq))
            seq.draft = []
        rows, seqs = self._with_forks(plain)
        masks = self.grammars.masks([s.grammar for s in seqs], logits.device)
        for seq, result in zip(seqs, sample(logits[rows], seqs, self.eos_ids, masks)):
            request = touched[seq.request_id]
            if isinstance(result, Exception):
                self._fail(request, result)
            elif not request.error:
                self._guarded(request, self._append, seq, result, request)
        for request in touched.values():
            if request.beam and not request.error and request.beam.ready:
                self._guarded(request, self._advance_beams, request)
        return [self._output(r) for r in touched.values() if r.finished or not r.beam]

    def _guarded(self, request: Request, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:
            self._fail(request, exc)

    def _fail(self, request: Request, exc: Exception) -> None:
        """The request ends with the error; its pages go back; everyone else goes on."""
        if request.error:
            return
        log.error("request %s failed", request.request_id, exc_info=exc)
        request.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish_request(request.request_id, "error")
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
        if request.beam:
            request.beam.live.clear()
        self.num_failed += 1

    def _with_forks(self, sampling: list[tuple[int, Sequence]]) -> tuple[list[int], list[Sequence]]:
        """When a request's first sequence has its prompt computed, its siblings fork from it
        (sharing every prompt page) and sample their first token from the same logits. A
        sibling that finds no room queues and computes the prompt itself."""
        rows, seqs = [], []
        for row, seq in sampling:
            rows.append(row)
            seqs.append(seq)
            request = self.requests[seq.request_id]
            while request.unforked and seq.num_output_tokens == 0:
                sibling = request.unforked.pop(0)
                if self.scheduler.fork(seq, sibling):
                    rows.append(row)
                    seqs.append(sibling)
        return rows, seqs

    def _advance_beams(self, request: Request) -> None:
        """Carry out the group's choice: forks first (a parent still holds only its own
        tokens), then parents nobody continues are dropped, then every beam takes its token."""
        group = request.beam
        continuations = group.advance()
        beams, continued = [], set()
        for c in continuations:
            if c.parent in continued:
                child = c.parent.branch()
                self.scheduler.fork(c.parent, child)  # no room: it queues and recomputes
                beams.append(child)
            else:
                beams.append(c.parent)
            continued.add(c.parent)
        for seq in group.live:
            if seq not in continued:
                self.scheduler.finish(seq, "dropped")
        for beam, c in zip(beams, continuations):
            beam.token_ids.append(c.token_id)
        group.live = {beam: c.cum_logprob for beam, c in zip(beams, continuations)}
        self.num_generation_tokens += len(beams)
        self.num_finished += group.done

    def _append(self, seq: Sequence, sampled: Sampled, request: Request) -> None:
        seq.token_ids.append(sampled.token_id)
        detokenizer = request.detokenizers[seq.index]
        if sampled.logprob is not None:
            seq.cum_logprob += sampled.logprob
        if sampled.top is not None:
            seq.output_logprobs.append(TokenLogprob(sampled.token_id, sampled.logprob, sampled.top,
                                                    len(detokenizer.text)))
        self.num_generation_tokens += 1
        detokenizer.add(sampled.token_id)
        complete = seq.grammar is not None and consume(seq.grammar, sampled.token_id)
        reason = self._finish_reason(seq, request, complete)
        if reason:
            self.scheduler.finish(seq, reason)
            self.num_finished += request.finished

    def _finish_reason(self, seq: Sequence, request: Request, grammar_complete: bool) -> str | None:
        """Why seq stops now, if it does; also sets the text it shows so far. While it runs,
        text that may be the start of a stop string is held back, so a stream never shows it."""
        p, token = seq.params, seq.token_ids[-1]
        text = request.detokenizers[seq.index].text
        stops = [at for at in (text.find(stop) for stop in p.stop) if at >= 0]
        reason = "stop" if stops or grammar_complete else None
        if not reason and seq.num_output_tokens >= p.min_tokens:
            if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                reason = "stop"
        if not reason and (seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len):
            reason = "length"
        held = max(map(len, p.stop), default=1) - 1 if not reason else 0
        request.texts[seq.index] = text[:min(stops)] if stops else text[:len(text) - held]
        return reason

    def _output(self, request: Request) -> RequestOutput | BeamSearchOutput:
        if request.finished:
            self.requests.pop(request.request_id, None)
        if request.beam:
            return self._beam_output(request)
        seqs = request.seqs
        if request.params.best_of and request.finished and not request.error:
            seqs = sorted(seqs, key=lambda s: s.cum_logprob, reverse=True)[:request.params.n]
        logprobs = request.params.logprobs is not None
        outputs = [CompletionOutput(i if request.params.best_of else s.index, request.texts[s.index],
                                    s.output_token_ids, s.finish_reason, s.output_logprobs if logprobs else None,
                                    s.cum_logprob if logprobs or request.params.best_of else None)
                   for i, s in enumerate(seqs)]
        return RequestOutput(request.request_id, request.prompt.text, request.prompt.token_ids, outputs,
                             request.finished, request.error)

    def _beam_output(self, request: Request) -> BeamSearchOutput:
        start = len(request.prompt.token_ids)
        prompt_text = request.prompt.text
        if request.beam.finished and prompt_text is None:
            prompt_text = self.tokenizer.decode(request.prompt.token_ids, skip_special_tokens=True)
        for hypothesis in request.beam.finished:
            hypothesis.completion_text = self.tokenizer.decode(hypothesis.tokens[start:], skip_special_tokens=True)
            hypothesis.text = prompt_text + hypothesis.completion_text
        return BeamSearchOutput(request.request_id, request.prompt.token_ids, request.beam.finished,
                                error=request.error)

    # -- numbers --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv = self.kv.stats()
        running = self.scheduler.running
        token_bytes = sum(s.num_computed_tokens for s in running) * self.kv.token_bytes
        mapped_bytes = (kv.pages_in_use + kv.pages_idle) * kv.page_size
        return EngineStats(kv=kv, attention_backend=self.attention, platform=self.platform(), num_running=len(running),
                           num_waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped), preemptions=self.scheduler.num_preemptions,
                           kv_utilization=token_bytes / mapped_bytes if mapped_bytes else 0.0,
                           prompt_tokens=self.num_prompt_tokens, generation_tokens=self.num_generation_tokens,
                           requests_finished=self.num_finished, requests_failed=self.num_failed,
                           spec_drafts=self.num_drafts, spec_draft_tokens=self.num_drafted,
                           spec_accepted_tokens=self.num_accepted,
                           map_ahead_seconds=self.map_ahead.seconds if self.map_ahead else 0.0,
                           map_ahead_wait_seconds=self.map_ahead.wait_seconds if self.map_ahead else 0.0)

    def close(self) -> None:
        """Give everything back (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.map_ahead:
            self.map_ahead.close()
        if self.workers:
            self.workers.close()
        self.kv.close()
