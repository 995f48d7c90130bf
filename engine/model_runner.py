"""Build one step's flat batch, run the model, return logits of the sequences that sample."""
from __future__ import annotations

import torch

from engine.kv.batch import StepBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model, kv_cache, device: torch.device):
        self.model, self.kv, self.device = model, kv_cache, device

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        input_ids, positions, starts, q_lens, ctx_lens = [], [], [], [], []
        logits_indices, sampling, row = [], [], 0
        for seq, n in scheduled:
            first, ctx = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[first:ctx]
            positions += range(first, ctx)
            starts.append(row)
            q_lens.append(n)
            ctx_lens.append(ctx)
            row += n
            if ctx == len(seq):  # the step reaches the end of what is known: sample after it
                logits_indices.append(row - 1)
                sampling.append(seq)
        tensor = lambda x, dtype=torch.long: torch.tensor(x, dtype=dtype, device=self.device)
        batch = StepBatch([s for s, _ in scheduled], starts, q_lens, ctx_lens, tensor(positions),
                          tensor([0] + [s + n for s, n in zip(starts, q_lens)], torch.int32),
                          tensor(ctx_lens, torch.int32))
        return tensor(input_ids), batch, tensor(logits_indices), sampling

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        input_ids, batch, logits_indices, sampling = self.prepare(scheduled)
        attn = self.kv.attention(batch)
        logits = self.model(input_ids, batch.positions, attn, logits_indices)
        return logits, sampling
