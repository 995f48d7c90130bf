"""One sequence being generated: its tokens and how far its KV is computed.

Where its KV lives (a slot, a block table) is the KV cache's business, kept on the sequence
as `kv` from admission to release and written by the cache alone. Everything else that
changes while it runs (its tokens, how far they are computed, its drafts, its status and finish
reason) is the scheduler's: no other module writes it (engine/sched/scheduler.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from itertools import count

import torch

from engine.request.sampling_params import SamplingParams
from engine.request.structured import consume


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()  # preempted, its KV in the swap tier: computed tokens kept
    FINISHED = auto()


_ids = count()


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    params: SamplingParams
    arrival: float
    group: str | None = None  # who asked (one client request); admission is fair between groups
    priority: int = 0  # lower runs first (scheduling_policy="priority")
    seq_id: int = field(default_factory=lambda: next(_ids))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached (pool or tiers)
    status: SequenceStatus = SequenceStatus.WAITING
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    grammar: object | None = None  # structured outputs: the matcher that masks its next token
    draft: list[int] = field(default_factory=list)  # speculative tokens this step verifies
    cache_salt: str | None = None  # shares cached pages only with sequences of the same salt
    lora: object | None = None  # the LoRA adapter it runs with (engine/worker/lora.py Adapter); its pages are its own
    siblings: list[Sequence] = field(default_factory=list)  # n > 1: fork from it once its prompt is computed
    beam: object | None = None  # a beam search's beams: the BeamGroup that steers them (engine/sched/beam_search.py)
    kv: object | None = None  # its KV state while it holds a place: the KV manager's handle (engine/kv/layout.py)

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)

    def branch(self) -> Sequence:
        """A new sequence with the same tokens so far, its prompt the same (a beam's fork)."""
        child = Sequence(self.request_id, self.index, list(self.token_ids), self.params, self.arrival,
                         group=self.group, priority=self.priority, cache_salt=self.cache_salt, lora=self.lora,
                         beam=self.beam)
        child.num_prompt_tokens = self.num_prompt_tokens
        return child

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def adapter_name(self) -> str | None:
        """Its adapter's name (announced with its pages: engine/kv/events.py), if any."""
        return self.lora.name if self.lora is not None else None

    @property
    def adapter_digest(self) -> str | None:
        """What names its pages apart from the base model's (its adapter's SHA-256), if any."""
        return self.lora.digest if self.lora is not None else None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """Are its prompt tokens' logprobs wanted (prompt_logprobs)? Then its prompt is computed
        whole, never read from the prefix cache or the tiers, whose pages have no logits."""
        return self.params.prompt_logprobs is not None

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V the next forward passes must compute."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def stop_reason(self, eos_ids: tuple[int, ...], max_model_len: int | None) -> str | None:
        """Why it stops at the token it just took, if it does (its grammar, if any, takes the
        token first; stop strings aside: text is the output processor's)."""
        p, token = self.params, self.token_ids[-1]
        if self.grammar is not None and consume(self.grammar, token):
            return "stop"
        if self.num_output_tokens >= p.min_tokens:
            if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return "stop"
        if self.num_output_tokens >= p.max_tokens or (max_model_len and len(self) >= max_model_len):
            return "length"
        return None
