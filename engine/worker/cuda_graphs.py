"""Decode steps replayed as CUDA graphs.

Note [Decode as CUDA graphs]
Rationale: an eager decode step launches every kernel of every layer from Python, one by
one; for a batch of a few sequences the GPU waits on those launches, not on memory. A CUDA
graph replays the whole forward pass with one launch. vkv's virtual layouts are the case graphs
were made for: a slot's K/V address never moves while the engine runs, so a captured step reads
and writes the cache where the capture saw it, and between replays only the step's small
inputs change. The block table replays too, with its rows copied in like the other inputs.

Approach: one graph per batch-size bucket (vLLM's capture sizes: 1, 2, 4, then multiples of 8
up to max_num_seqs), captured largest first into one memory pool after a warm-up run of each.
A step whose sequences all decode one token, with no LoRA adapter and no prompt scoring, goes
to the smallest bucket that holds it: its inputs are copied into the bucket's static tensors,
and the padding rows repeat the last sequence (its token, position, context and table row),
so they write the bytes it writes to the place it writes them, and their logits are dropped.
The attention step is prepared inside the capture, so what it derives from the batch (rotary
rows, the store's indices, FlashAttention's slot offsets, FlexAttention's block mask) is
recomputed on the device at every replay: the steps it can make are those that read nothing
back to the host (engine/worker/attention_step.py).

Implementation: ModelRunner owns one DecodeGraphs. Only `run` writes the static inputs and only
a replay writes the static logits; the logits `run` returns are a view of them, valid until the
next step (the engine samples before it runs another). Capture needs rows that are mapped: a
placeholder sequence holds one page (or block) while the graphs are captured, then goes.
`bytes` is the pool's size after capture: build_rank set the same amount aside before it sized
the KV cache (a decode step's activations at the largest bucket, measured by a profile run).
Off a GPU nothing is captured and a bucket's static batch runs eagerly: the CPU's tests check
the padding and the static batch that way, the GPU's the graphs themselves.

Limitations: FlashAttention is captured with max_seqlen_k = max_model_len (its work split sees
the longest context a slot may hold, not this step's). Steps with prefill rows, drafts, LoRA or
prompt logprobs run eagerly, as do engines with tensor parallelism or sleep mode (their weights
move) and attention kernels that read the host (sdpa, flash-attn 2.x). Pages are mapped before a
step, never while a graph is captured.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from engine.kv.batch import StepBatch

Forward = Callable[[torch.Tensor, StepBatch, torch.Tensor], torch.Tensor]
CAPTURED_KERNELS = ("flash", "flex")  # the attention steps that read nothing back to the host


def why_eager(device: torch.device, enforce_eager: bool, attention: str, tensor_parallel: int,
              sleep_mode: bool) -> str | None:
    """None where decode steps replay as graphs; else why every step runs eagerly."""
    if device.type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "enforce_eager"
    if attention not in CAPTURED_KERNELS:
        return f"attention {attention!r} is not captured (only {', '.join(CAPTURED_KERNELS)})"
    if tensor_parallel > 1:
        return "tensor parallelism"
    if sleep_mode:
        return "sleep mode (its weights are given back and taken again)"
    return None


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's batch sizes for decode graphs, up to max_num_seqs (which is always one)."""
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    def __init__(self, forward: Forward, sizes: list[int], width: int, block_size: int, max_model_len: int,
                 placeholder: list[int], device: torch.device):
        """forward(input_ids, batch, logits_indices) -> logits, the eager step; width: the block
        table's columns a step may use; placeholder: a mapped block-table row the capture reads."""
        self.forward, self.sizes, self.width, self.block_size = forward, sorted(sizes), width, block_size
        self.max_model_len = max_model_len
        largest = self.sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.ctx_len = torch.ones(largest, **i32)
        self.block_table = torch.tensor([placeholder + [0] * (width - len(placeholder))] * largest, **i32)
        self.rows = torch.arange(largest + 1, **i32)  # token_seq, q_start and cu_seqlens_q alike
        self.q_len = torch.ones(largest, **i32)
        self.logits_indices = torch.arange(largest, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.seconds, self.bytes, self.replays = 0.0, 0, 0  # replays: the steps `run` took
        if device.type != "cuda":  # no graphs: each bucket's static batch runs eagerly (tests/worker/test_cuda_graphs.py)
            return
        start, before = time.perf_counter(), torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture(size, pool)
        torch.cuda.synchronize(device)
        self.seconds = time.perf_counter() - start
        self.bytes = torch.cuda.memory_reserved(device) - before

    def _batch(self, size: int) -> StepBatch:
        """The static batch of a bucket: views of the static inputs (its Python lists give the
        kernels their bounds: one query a sequence, contexts up to max_model_len)."""
        return StepBatch([None] * size, list(range(size)), [1] * size, [self.max_model_len] * size,
                         self.positions[:size], self.rows[:size], self.rows[:size], self.q_len[:size],
                         self.ctx_len[:size], self.rows[:size + 1], self.block_table[:size], self.block_size)

    def _capture(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.input_ids[:size], self._batch(size), self.logits_indices[:size])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels chosen, compiled and their memory taken
            for _ in range(2):
                self.forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.forward(*args)
        return graph, logits

    def bucket(self, batch: StepBatch) -> int | None:
        """The bucket a step replays in, or None where it runs eagerly (see `run`)."""
        n = len(batch.q_lens)
        if batch.max_query_len != 1 or batch.block_table.shape[1] > self.width or n > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= n)

    def run(self, input_ids: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """The logits of a decode step (one row a sequence, in order), replayed; None where the
        step is not one a graph holds (a query of several rows, a wider table, too many rows)."""
        size = self.bucket(batch)
        if size is None:
            return None
        n, table = len(batch.q_lens), batch.block_table
        self.replays += 1
        for static, given in ((self.input_ids, input_ids), (self.positions, batch.positions),
                              (self.ctx_len, batch.ctx_len)):
            static[:n].copy_(given)
            static[n:size].copy_(given[n - 1:].expand(size - n))  # padding: the last sequence again
        self.block_table[:n, :table.shape[1]].copy_(table)
        self.block_table[n:size, :table.shape[1]].copy_(table[n - 1:].expand(size - n, -1))
        if size not in self.graphs:  # (on the CPU: the same static batch, run eagerly)
            return self.forward(self.input_ids[:size], self._batch(size), self.logits_indices[:size])[:n]
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
