"""Requests in: tokenized and checked once, where they enter (vLLM's input processor).

`InputProcessor.process` refuses, with the numbers, a request that could never run to its end
or that names tokens outside the vocabulary, and compiles its grammar; it reads only what never
changes during a request's check (the model, the config, the KV geometry and the pool's
current cap), so a server runs it on its tokenizer thread, off the engine's. What it returns,
an `EngineRequest`, the engine adds without checking again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.request.beam_search import BeamSearchParams
from engine.sched.beam_search import BeamGroup
from engine.config import EngineConfig
from engine.kv.capacity import KVCapacity
from engine.request.inputs import Prompt, tokenize
from engine.request.lora_request import LoRARequest
from engine.worker.lora import Adapter, LoRARegistry
from engine.models.config import ModelConfig
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence
from engine.request.structured import Grammars


@dataclass(frozen=True)
class EngineRequest:
    """A request checked against the model and the KV budget, ready to be added (vLLM's
    EngineCoreRequest)."""
    request_id: str
    prompt: Prompt
    params: SamplingParams | BeamSearchParams
    group: str | None = None  # who asked: admission is fair between groups
    priority: int = 0  # lower runs first under scheduling_policy="priority"
    grammar: str | None = None  # its structured output, compiled
    lora: Adapter | None = None  # the LoRA adapter it runs with, loaded


class InputProcessor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, tokenizer,
                 eos_ids: tuple[int, ...], grammars: Grammars, capacity: KVCapacity,
                 loras: LoRARegistry | None = None):
        """capacity: the KV cache's room (the pages a sequence needs, the most this model can
        hold); loras: the LoRA adapters in memory (None: LoRA is off)."""
        self.config, self.model_config, self.max_model_len = config, model_config, max_model_len
        self.tokenizer, self.eos_ids, self.grammars = tokenizer, eos_ids, grammars
        self.capacity, self.loras = capacity, loras

    def process(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams,
                group: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None) -> EngineRequest:
        c, vocab = self.config, self.model_config.vocab_size
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and c.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (--scheduling-policy priority); "
                             f"under {c.scheduling_policy!r} it would be ignored")
        prompt, grammar = tokenize(self.tokenizer, vocab, prompt), None
        if isinstance(params, SamplingParams):
            if any(t >= vocab for t in params.token_ids_used()):
                raise ValueError(f"stop_token_ids and logit_bias must name token ids below the vocabulary "
                                 f"size {vocab}")
            banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            if params.min_tokens and len(banned) >= vocab:
                raise ValueError(f"min_tokens {params.min_tokens} bans every token of the vocabulary until then: "
                                 f"stop_token_ids (and EOS) name all {vocab}")
            if params.structured_outputs:
                grammar = self.grammars.compile(params.structured_outputs)
        if params.max_tokens is None:  # as many as fit after this prompt (vLLM's; the server's default too)
            room = self.max_model_len - len(prompt.token_ids)
            if room < 1:
                raise ValueError(f"prompt ({len(prompt.token_ids)} tokens) leaves no room for a token under "
                                 f"max_model_len {self.max_model_len}")
            params = replace(params, max_tokens=room)
        total = len(prompt.token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt.token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds max_model_len {self.max_model_len}")
        width = params.beam_width if isinstance(params, BeamSearchParams) else 1  # beams run in lockstep
        if width > c.max_num_seqs:
            raise ValueError(f"beam_width {width} exceeds max_num_seqs {c.max_num_seqs}")
        request = EngineRequest(request_id, prompt, params, group, priority, grammar, self.adapter(lora_request))
        self.check_room(request)
        return request

    def check_room(self, request: EngineRequest) -> None:
        """The request fits the KV pages this model can ever hold: checked where it is made, and
        again as the engine takes it (a limit lowered in between would strand it for good)."""
        params = request.params
        total = len(request.prompt.token_ids) + params.max_tokens
        width = params.beam_width if isinstance(params, BeamSearchParams) else 1
        pages = width * self.pages_needed(total)
        most = self.capacity.most
        if pages > most:
            shared = " (this model's cap, less the other models' floors)" if most < self.capacity.total else ""
            raise ValueError(f"{total} tokens{f' for {width} beams' if width > 1 else ''} need {pages} KV pages, "
                             f"more than the whole KV budget of {most} pages{shared}")

    def pages_needed(self, total: int) -> int:
        """The most pages a sequence of `total` tokens maps at once (a sliding window's pages are
        let go as it grows)."""
        window, pages_for = self.model_config.sliding_window, self.capacity.pages_for
        if not window:
            return pages_for(total)
        # the live rows (a window and a step's chunk) start anywhere in a page: one page more
        # a region than the rows alone fill (counted short, a request that needs it waits for ever)
        return min(pages_for(total), pages_for(window + self.config.max_num_batched_tokens) + pages_for(1))

    def adapter(self, request: LoRARequest | None) -> Adapter | None:
        """The adapter a request names, loaded and checked (engine/worker/lora.py); ValueError by name."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if self.loras is None:
            raise ValueError(f"LoRA adapter {request.lora_name!r} asked for, but LoRA is not enabled "
                             f"(enable_lora=True, --enable-lora)")
        return self.loras.get(request)

    def sequence(self, request: EngineRequest, now: float) -> Sequence:
        """The request's first sequence, as the engine's thread adds it: its n > 1 (or best_of)
        siblings ride on it until they fork; a beam search's first beam is steered by its
        BeamGroup (`seq.beam`) and samples greedily. Each has its own seeded generator and
        grammar matcher."""
        params, beam = request.params, None
        if isinstance(params, BeamSearchParams):
            beam = BeamGroup(params, self.eos_ids, self.max_model_len)
            params = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        ids, grammar = request.prompt.token_ids, request.grammar
        seqs = [Sequence(request.request_id, i, list(ids), params, now, request.group or request.request_id,
                         request.priority, generator=self._generator(params, i), cache_salt=request.prompt.cache_salt,
                         lora=request.lora,
                         grammar=self.grammars.matcher(grammar) if grammar else None, beam=beam)
                for i in range(params.num_samples)]
        seqs[0].siblings = seqs[1:]
        if beam:
            beam.start(seqs[0])
        return seqs[0]

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Seeded requests draw from their own generators (seed + index for the index-th
        completion); the rest share torch's default one."""
        if params.seed is None or params.greedy:
            return None
        g = torch.Generator(device=self.config.device)
        g.manual_seed((params.seed + index) % (1 << 64))
        return g
