"""The engine loop: requests in, one `step()` at a time, outputs back.

    schedule -> map KV pages (inside the scheduler) -> model forward -> sample -> detokenize
    -> check stop conditions -> finished sequences give their slots back
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

import vmm
from engine.attention import pick_attention
from engine.beam_search import BeamGroup, BeamSearchOutput, BeamSearchParams
from engine.config import DEFAULT_HOST_PAGE, EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv.paged import PagedKVCache
from engine.kv.virtual import VirtualKVCache
from engine.model_runner import ModelRunner
from engine.models import load_config, load_model, load_tokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    arrival: float
    texts: list[str] = field(default_factory=list)
    unforked: list[Sequence] = field(default_factory=list)  # n > 1: wait to share seq 0's prompt
    beam: BeamGroup | None = None  # beam search: seqs are the live beams

    @property
    def finished(self) -> bool:
        return self.beam.done if self.beam else all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = c = config
        self.model_config = load_config(c.model)
        self.tokenizer = load_tokenizer(c.model)
        self.max_model_len = c.resolve_max_model_len(self.model_config.max_position_embeddings)
        self.model = load_model(c.model, self.model_config, c.device, c.dtype, c.seed)
        self.eos_ids = self.model_config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.kv = self._make_kv_cache()
        self.attention = pick_attention(c.attention_backend, c.device, c.dtype, c.kv_layout)
        self.scheduler = Scheduler(self.kv, c.max_num_seqs, c.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv, self.attention, c.device)
        self.requests: dict[str, Request] = {}
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}

    def _make_kv_cache(self) -> VirtualKVCache | PagedKVCache:
        c = self.config
        if c.kv_layout == "paged":
            itemsize = torch.empty((), dtype=c.dtype).element_size()
            block_bytes = c.block_size * self.model_config.kv_bytes_per_token(itemsize)
            num_blocks = c.kv_budget_bytes() // block_bytes
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory {c.kv_budget_bytes()} is below one block ({block_bytes} bytes)")
            return PagedKVCache(self.model_config, c.block_size, num_blocks, c.dtype, c.device,
                                c.enable_prefix_caching)
        if c.device.type == "cuda":
            backend = vmm.CudaBackend(c.device.index or 0, c.page_size)
        else:
            backend = vmm.HostBackend(c.page_size or DEFAULT_HOST_PAGE)
        num_pages = c.kv_budget_bytes() // backend.page_size
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory {c.kv_budget_bytes()} is below one page ({backend.page_size} bytes)")
        return VirtualKVCache(self.model_config, c.kv_layout, c.max_num_seqs, self.max_model_len,
                              c.dtype, backend, num_pages, c.enable_prefix_caching)

    # -- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt has no tokens")
        if min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.model_config.vocab_size})")
        return None, ids

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams | BeamSearchParams) -> None:
        """Refuse, with the numbers, a request that could never run to its end. A beam group
        runs in lockstep, so all its beams must be able to run at once."""
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds max_model_len {self.max_model_len}")
        width = params.beam_width if isinstance(params, BeamSearchParams) else 1
        if width > self.config.max_num_seqs:
            raise ValueError(f"beam_width {width} exceeds max_num_seqs {self.config.max_num_seqs}")
        pages = width * self.kv.pages_for(total)
        if pages > self.kv.pool.num_pages:
            beams = f" for {width} beams" if width > 1 else ""
            raise ValueError(f"{total} tokens{beams} need {pages} KV pages, more than the "
                             f"whole KV budget of {self.kv.pool.num_pages} pages")

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | BeamSearchParams) -> None:
        """With BeamSearchParams the request is a beam search: its beams are greedy sequences
        that a BeamGroup steers."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        self.check_fits(len(ids), params)
        beam = None
        if isinstance(params, BeamSearchParams):
            beam = BeamGroup(params, self.eos_ids, self.max_model_len)
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        now = time.monotonic()
        seqs = [Sequence(request_id, i, list(ids), params, now, generator=self._generator(params, i))
                for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens) for _ in seqs]
        self.requests[request_id] = Request(request_id, text, ids, params, seqs, detoks, now, [""] * len(seqs),
                                            seqs[1:], beam)
        if beam:
            beam.live[seqs[0]] = 0.0
        self.scheduler.add(seqs[0])
        self.counters["prompt_tokens"] += len(ids)

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        g = torch.Generator(device=self.config.device)
        g.manual_seed(params.seed + index if params.seed is not None else int(torch.randint(1 << 62, ())))
        return g

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else []:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | BeamSearchOutput]:
        """One forward pass over the scheduled batch; outputs of the requests it advanced."""
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        logits, sampling = self.runner.run(scheduled)
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.kv.commit(seq)
        touched = {seq.request_id: self.requests[seq.request_id] for seq in sampling}
        to_sample = []
        for row, seq in enumerate(sampling):
            if beam := touched[seq.request_id].beam:
                beam.offer(seq, logits[row])
            else:
                to_sample.append((row, seq))
        rows, seqs = self._with_forks(to_sample)
        for seq, sampled in zip(seqs, sample(logits[rows], seqs, self.eos_ids)):
            self._append(seq, sampled)
        for request in touched.values():
            if request.beam and request.beam.ready:
                self._advance_beams(request)
        return [self._output(r) for r in touched.values() if r.finished or not r.beam]

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
                if not self.scheduler.can_adopt():
                    self.scheduler.add(sibling)
                    continue
                self.kv.fork(seq, sibling)
                self.scheduler.adopt(sibling)
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
            beams.append(self._fork_beam(c.parent) if c.parent in continued else c.parent)
            continued.add(c.parent)
        for seq in group.live:
            if seq not in continued:
                self.scheduler.finish(seq, "dropped")
        for beam, c in zip(beams, continuations):
            beam.token_ids.append(c.token_id)
        group.live = {beam: c.cum_logprob for beam, c in zip(beams, continuations)}
        request.seqs = beams
        self.counters["generation_tokens"] += len(beams)
        self.counters["requests_finished"] += group.done

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = parent.branch()
        if parent.status is SequenceStatus.RUNNING and self.scheduler.can_adopt():
            self.kv.fork(parent, child)
            self.scheduler.adopt(child)
        else:  # no room: it queues and recomputes
            self.scheduler.add(child)
        return child

    def _append(self, seq: Sequence, sampled) -> None:
        request = self.requests[seq.request_id]
        seq.token_ids.append(sampled.token_id)
        seq.first_token_time = seq.first_token_time or time.monotonic()
        if sampled.logprob is not None:
            seq.output_logprobs.append({sampled.token_id: sampled.logprob, **sampled.top_logprobs})
        self.counters["generation_tokens"] += 1
        request.detokenizers[seq.index].add(sampled.token_id)
        reason = self._finish_reason(seq, request)
        if reason:
            self.scheduler.finish(seq, reason)
            if request.finished:
                self.counters["requests_finished"] += 1

    def _finish_reason(self, seq: Sequence, request: Request) -> str | None:
        """Why seq stops now, if it does; also sets the text it shows so far. While it runs,
        text that may be the start of a stop string is held back, so a stream never shows it."""
        p, token = seq.params, seq.token_ids[-1]
        text = request.detokenizers[seq.index].text
        stops = [at for at in (text.find(stop) for stop in p.stop) if at >= 0]
        reason = "stop" if stops else None
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
        outputs = [CompletionOutput(s.index, request.texts[s.index], s.output_token_ids, s.finish_reason,
                                    s.output_logprobs if s.params.logprobs is not None else None,
                                    sum(next(iter(d.values())) for d in s.output_logprobs)
                                    if s.params.logprobs is not None else None)
                   for s in request.seqs]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.finished)

    def _beam_output(self, request: Request) -> BeamSearchOutput:
        for hypothesis in request.beam.finished:
            hypothesis.text = self.tokenizer.decode(hypothesis.tokens, skip_special_tokens=True)
        return BeamSearchOutput(request.request_id, request.prompt_token_ids, request.beam.finished)

    # -- numbers --------------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv.stats()
        running = self.scheduler.running
        token_bytes = sum(s.num_computed_tokens for s in running) * self.kv.token_bytes
        mapped_bytes = (kv["pages_in_use"] + kv["pages_idle"]) * self.kv.page_size
        return {**kv, "preemptions": self.scheduler.num_preemptions,
                "kv_utilization": token_bytes / mapped_bytes if mapped_bytes else 0.0,
                "num_running": len(running), "num_waiting": len(self.scheduler.waiting),
                "kv_layout": self.config.kv_layout, "attention_backend": self.attention, **self.counters}

    def close(self) -> None:
        self.kv.close()
