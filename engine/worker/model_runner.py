"""Build one step's flat batch, run the model, return logits of the sequences that sample (and
of the prompt rows whose logprobs are wanted)."""
from __future__ import annotations

import dataclasses
import logging

import torch

from engine.worker.attention import AttentionBackend
from engine.worker.cuda_graphs import DecodeGraphs
from engine.kv.manager import KVManager
from engine.kv.batch import StepBatch
from engine.worker.lora import LoRABatch
from engine.models.linear import FEW_ROWS
from engine.models.ops import rope_table
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence
from engine.sched.step import Scheduled

log = logging.getLogger("vkv.runner")


@torch.inference_mode()
def activation_peak(model, max_tokens: int, max_rows: int, device: torch.device) -> int:
    """Bytes a worst-case step allocates on the GPU above the weights (vLLM's profile run): the
    model over max_tokens tokens, logits for max_rows of them, attention stubbed out (its own
    allocations are the output, the size of q, which the stub returns too)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
    model(ids, lambda layer, q, k, v: q.clone(), torch.arange(min(max_rows, max_tokens), device=device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


class ModelRunner:
    def __init__(self, model, kv: KVManager, attention: AttentionBackend, max_model_len: int,
                 device: torch.device, dtype: torch.dtype, workers=None, graph_sizes: list[int] | None = None):
        """graph_sizes: the batch sizes whose decode steps are captured as CUDA graphs (None: eager)."""
        self.model, self.kv, self.attention, self.device = model, kv, attention, device
        self.workers = workers  # engine.worker.parallel.Workers when tensor parallel (kv is then a RecordedKV)
        self.max_model_len = max_model_len
        self.cos_sin = rope_table(model.inv_freq, max_model_len, dtype, device)
        self.graphs, self.graph_error = None, None
        if graph_sizes:
            try:
                self.graphs = self._capture(graph_sizes)
            except Exception as exc:  # a capture the GPU or a kernel refuses: every step eager, and said
                self.graph_error = f"capturing the decode graphs failed: {type(exc).__name__}: {exc}"[:400]
                log.warning("vkv: %s; every step runs eagerly", self.graph_error)
                torch.cuda.synchronize(device)

    def _capture(self, sizes: list[int]) -> DecodeGraphs:
        """The decode graphs, captured over one mapped page that a placeholder sequence holds
        meanwhile (engine/worker/cuda_graphs.py)."""
        holder = Sequence("vkv-graph-capture", 0, [0], SamplingParams(max_tokens=1), 0.0)
        self.kv.admit(holder, cached=False)
        try:
            if not self.kv.ensure_mapped(holder, 1):
                raise RuntimeError("no KV page free to capture the decode graphs over: lower max_num_seqs "
                                   "or pass enforce_eager")
            table, block_size = self.kv.layout.block_table([holder], [1])
            width = -(-self.max_model_len // block_size)
            return DecodeGraphs(self.forward, sizes, width, block_size, self.max_model_len, table[0], self.device)
        finally:
            self.kv.release(holder, keep_pages=False)

    def runs_steps(self, rows: int) -> bool:
        """Whether several greedy decode steps of `rows` sequences can run in one native call
        (`run_steps`): the model's one-call decode path with its steps (not over a k-quant
        embedding) and its row limit, the native attention kernel, no sliding window, one rank."""
        return (bool(self.model.decode) and self.model.multi_step and rows <= FEW_ROWS
                and self.attention.name == "native" and not self.kv.window and not self.workers)

    def prepare(self, scheduled: Scheduled, ahead: int = 0) -> tuple[torch.Tensor, StepBatch, torch.Tensor, list,
                                                                      list, LoRABatch | None]:
        """The flat batch; per sequence that samples (seq, its first logits row, rows): one row
        after its last known token, plus one after each drafted token; per sequence scoring its
        prompt (seq, its first logits row, position, rows): the rows of its prompt positions
        this step computes, each the guess at the next prompt token; and the rows of each LoRA
        adapter (the sequences ordered so that each adapter's rows are one segment). With
        `ahead`, the block table also holds each sequence's next `ahead` rows (multi-step)."""
        scheduled = by_adapter(scheduled)
        input_ids, positions, token_seq, starts, q_lens, ctx_lens = [], [], [], [], [], []
        logits_indices, sampling, scoring, row = [], [], [], 0
        for i, (seq, n) in enumerate(scheduled):
            first, ctx = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += (seq.token_ids + seq.draft)[first:ctx] if seq.draft else seq.token_ids[first:ctx]
            positions += range(first, ctx)
            token_seq += [i] * n
            starts.append(row)
            q_lens.append(n)
            ctx_lens.append(ctx)
            row += n
            last = min(ctx, seq.num_prompt_tokens - 1)  # prompt position `last - 1` guesses the prompt's last token
            if seq.scores_prompt and first < last:
                scoring.append((seq, len(logits_indices), first, last - first))
                logits_indices += range(row - n, row - n + last - first)
            if ctx >= len(seq):  # the step reaches the end of what is known: sample after it
                rows = ctx - len(seq) + 1
                sampling.append((seq, len(logits_indices), rows))
                logits_indices += range(row - rows, row)
        seqs = [s for s, _ in scheduled]
        table, block_size = self.kv.layout.block_table(seqs, [ctx + ahead for ctx in ctx_lens])
        width = max(map(len, table))
        tensor = lambda x, dtype=torch.int32: torch.tensor(x, dtype=dtype, device=self.device)
        batch = StepBatch(seqs, starts, q_lens, ctx_lens, tensor(positions, torch.long), tensor(token_seq),
                          tensor(starts), tensor(q_lens), tensor(ctx_lens), tensor([0] + [s + n for s, n in zip(starts, q_lens)]),
                          tensor([t + [0] * (width - len(t)) for t in table]), block_size)
        lora = LoRABatch.of([seq.lora for seq in seqs], starts, q_lens, native=self.model.native)
        return tensor(input_ids, torch.long), batch, tensor(logits_indices, torch.long), sampling, scoring, lora

    def run(self, scheduled: Scheduled) -> tuple[torch.Tensor, list, list]:
        """The step's logits, the sampling rows and the prompt-scoring rows (see prepare)."""
        input_ids, batch, logits_indices, sampling, scoring, lora = self.prepare(scheduled)
        if self.graphs and lora is None and len(logits_indices) == len(batch.q_lens):  # (no prompt rows scored)
            logits = self.graphs.run(input_ids, batch)
            if logits is not None:  # a decode step a graph holds
                return logits, sampling, scoring
        if self.workers:  # tensor parallel: the other ranks apply the KV operations and run the same step
            self.workers.send(self.kv.take_ops(), (input_ids, dataclasses.replace(batch, seqs=[]), logits_indices))
        try:
            return self.forward(input_ids, batch, logits_indices, lora), sampling, scoring
        except RuntimeError as error:  # gloo says only "connection closed": say what the worker said
            if self.workers:
                self.workers.blame(error)
            raise

    def run_steps(self, scheduled: Scheduled, steps: int, stop_ids: list[int]) -> dict[Sequence, list[int]]:
        """Multi-step decode (where `runs_steps`; every sequence decoding one token, its pages
        mapped for `steps` rows): each sequence's greedy tokens, up to the step where every
        sequence had picked one of stop_ids; -2 where its logits were not finite (its last)."""
        input_ids, batch, _, _, _, _ = self.prepare(scheduled, ahead=steps - 1)
        tokens = self.model.greedy_steps(input_ids, self._attention(batch), steps, stop_ids)
        if tokens is None:
            raise RuntimeError("multi-step decode asked of a step the one-call path cannot run")
        return {seq: [t for t in column if t != -1] for seq, column in zip(batch.seqs, tokens.T.tolist())}

    def forward(self, input_ids: torch.Tensor, batch: StepBatch, logits_indices: torch.Tensor,
                lora: LoRABatch | None = None) -> torch.Tensor | None:
        """The model over one flat batch; logits on rank 0, None on the other ranks."""
        return self.model(input_ids, self._attention(batch), logits_indices, lora)

    def _attention(self, batch: StepBatch):
        layout = self.kv.layout
        return self.attention.prepare(layout.k_caches, layout.v_caches, batch, self.cos_sin,
                                      paged=layout.name == "paged", window=self.kv.window)


def by_adapter(scheduled: Scheduled) -> Scheduled:
    """The step's sequences with each LoRA adapter's together (base-model ones first, then
    each adapter in the order it first appears); as they were when none has an adapter."""
    if all(seq.lora is None for seq, _ in scheduled):
        return scheduled
    order: dict = {None: 0}
    for seq, _ in scheduled:
        order.setdefault(seq.lora, len(order))
    return sorted(scheduled, key=lambda item: order[item[0].lora])
