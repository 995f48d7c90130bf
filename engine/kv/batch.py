"""One step's sequences, as every KV cache and kernel sees them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass(slots=True)
class StepBatch:
    seqs: list[Sequence]
    starts: list[int]  # first row of each sequence's queries in the flat token batch
    q_lens: list[int]
    ctx_lens: list[int]  # tokens in the cache once this step has written
    positions: torch.Tensor  # [tokens] position of each token in its sequence
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32
    context_lens: torch.Tensor  # [seqs] int32

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.ctx_lens)

    def spans(self):
        """(sequence, first query row, query len, context len) per sequence."""
        return zip(self.seqs, self.starts, self.q_lens, self.ctx_lens)

    def per_token(self, values: list[int], device) -> torch.Tensor:
        """One value per sequence, repeated for each of its scheduled tokens."""
        return torch.tensor(values, device=device).repeat_interleave(
            torch.tensor(self.q_lens, device=device))
