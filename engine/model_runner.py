"""Build one step's flat batch, run the model, return logits of the sequences that sample."""
from __future__ import annotations

import torch

from engine.attention import VirtualAttention, VirtualBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_cache, kernel: str, device: torch.device):
        self.model, self.kv, self.kernel, self.device = model, kv_cache, kernel, device

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        input_ids, positions, token_slots, seqs, cu_q, starts, ctx_lens = [], [], [], [], [0], [], []
        logits_indices, sampling = [], []
        for seq, n in scheduled:
            first, ctx = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[first:ctx]
            positions += range(first, ctx)
            token_slots += [seq.slot] * n
            seqs.append((seq.slot, cu_q[-1], n, ctx))
            cu_q.append(cu_q[-1] + n)
            starts.append(seq.slot * self.kv.rows)
            ctx_lens.append(ctx)
            if ctx == len(seq):  # the step reaches the end of what is known: sample after it
                logits_indices.append(cu_q[-1] - 1)
                sampling.append(seq)
        as_tensor = lambda x, dtype=torch.long: torch.tensor(x, dtype=dtype, device=self.device)
        batch = VirtualBatch(
            token_slots=as_tensor(token_slots), positions=as_tensor(positions), seqs=seqs,
            cu_seqlens_q=as_tensor(cu_q, torch.int32), slot_starts=as_tensor(starts + [self.kv.num_slots * self.kv.rows], torch.int32),
            context_lens=as_tensor(ctx_lens, torch.int32), max_query_len=max(n for _, _, n, _ in seqs),
            max_context_len=max(ctx_lens))
        return as_tensor(input_ids), batch, as_tensor(logits_indices), sampling

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        input_ids, batch, logits_indices, sampling = self.prepare(scheduled)
        attn = VirtualAttention(self.kv, self.kernel, batch)
        logits = self.model(input_ids, batch.positions, attn, logits_indices)
        return logits, sampling
