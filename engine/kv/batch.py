"""One step's sequences, as every KV cache and kernel sees them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request.sequence import Sequence


@dataclass(slots=True)
class StepBatch:
    """Tokens of all scheduled sequences, flat: sequence i's queries are rows starts[i] ..
    starts[i] + q_lens[i], at positions ctx_lens[i] - q_lens[i] .. ctx_lens[i] - 1.

        sequence i's KV:  [ computed before this step ][ written this step ]
                          0                 ctx - q_len                   ctx

    Its position p lives in block block_table[i, p // block_size], row p % block_size."""
    seqs: list[Sequence]
    starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]  # tokens in the cache once this step has written
    positions: torch.Tensor  # [tokens] int64
    token_seq: torch.Tensor  # [tokens] int32: which sequence of the batch each token belongs to
    q_start: torch.Tensor  # [seqs] int32
    q_len: torch.Tensor  # [seqs] int32
    ctx_len: torch.Tensor  # [seqs] int32
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32
    block_table: torch.Tensor  # [seqs, max blocks] int32
    block_size: int

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.ctx_lens)
