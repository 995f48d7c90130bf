"""The offline API: `LLM(...).generate(prompts, params)`."""
from __future__ import annotations

import time
from itertools import count

from tqdm import tqdm

from engine.request.beam_search import BeamSearchOutput, BeamSearchParams
from engine.config import EngineConfig
from engine.request.inputs import chat_prompt
from engine.core.llm_engine import LLMEngine
from engine.request.lora_request import LoRARequest
from engine.request.outputs import RequestOutput
from engine.request.sampling_params import SamplingParams
from engine.stats import EngineStats


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = count()

    @classmethod
    def from_config(cls, config: EngineConfig, loaded: tuple | None = None) -> LLM:
        """An LLM for an EngineConfig; `loaded` as LLMEngine takes it."""
        llm = cls.__new__(cls)
        llm.engine, llm._ids = LLMEngine(config, loaded), count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's name for the same."""
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (or vLLM's {"prompt": ...} and
        {"prompt_token_ids": ...}); outputs come back in input order. A request that fails
        comes back with finish_reason "error" and the reason in `error`. `priority` (one per
        prompt, lower first) matters under scheduling_policy="priority". `lora_request`: the
        LoRA adapter every prompt runs with, or one per prompt (None: the base model); needs
        enable_lora=True."""
        prompts = as_prompt_list(prompts)
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        priority = priority if priority is not None else [0] * len(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if not len(params) == len(priority) == len(loras) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams, {len(priority)} priorities "
                             f"and {len(loras)} LoRA requests")
        return self._submit("gen", prompts, params, use_tqdm, priority, loras)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each prompt's beam_width best continuations, best first."""
        prompts = as_prompt_list(prompts)
        n = len(prompts)
        return self._submit("beam", prompts, [params] * n, use_tqdm, [0] * n, [lora_request] * n)

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool = True,
             lora_request: LoRARequest | None = None):
        """One conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([chat_prompt(self.tokenizer, c) for c in conversations], params, use_tqdm,
                             lora_request=lora_request)

    def _submit(self, kind: str, prompts: list, params: list, use_tqdm: bool, priority: list[int],
                loras: list) -> list:
        """Tokenize and check every prompt (and load its adapter) before any runs, so a bad one
        leaves the engine as it was."""
        requests = [self.engine.process_inputs(f"{kind}-{next(self._ids)}", prompt, p, group="llm", priority=urgency,
                                               lora_request=lora)
                    for prompt, p, urgency, lora in zip(prompts, params, priority, loras)]  # one caller: one group
        for request in requests:
            self.engine.add(request)
        return self._run([r.request_id for r in requests], use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        done = {}
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), self.engine.counters.generation_tokens
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                tokens = self.engine.counters.generation_tokens - generated
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: level 1 releases the KV cache's physical memory, level 2 the
        weights' too (LLM(enable_sleep_mode=True)); generate() refuses until wake_up().
        Everything above stays built, at the same addresses."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map memory back: tags "weights" and "kv_cache", default both. Weights that slept at
        level 2 come back empty: update_weights_from_* or reload_weights() before generating."""
        self.engine.wake_up(tags)

    def reload_weights(self) -> None:
        """Read the engine's own checkpoint into place again (after sleep level 2)."""
        self.engine.reload_weights()

    def update_weights_from_tensor(self, named_tensors) -> None:
        """New weights in place (LLMEngine.update_weights_from_tensor)."""
        self.engine.update_weights_from_tensor(named_tensors)

    def update_weights_from_disk(self, path: str) -> None:
        self.engine.update_weights_from_disk(path)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def close(self) -> None:
        """Give the KV memory back and stop the engine's threads and workers; a disk KV tier
        finishes its writes first, so the next LLM over the same directory finds them."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
