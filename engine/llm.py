"""The offline API: `LLM(...).generate(prompts, params)`."""
from __future__ import annotations

import time
from itertools import count

from tqdm import tqdm

from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts are strings or token-id lists (or vLLM's {"prompt": ...} and
        {"prompt_token_ids": ...}); outputs come back in input order. Every prompt is checked
        before any runs, so a bad one leaves the engine as it was."""
        prompts = as_prompt_list(prompts)
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return self._submit("gen", prompts, params, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: each prompt's beam_width best continuations, best first."""
        prompts = as_prompt_list(prompts)
        return self._submit("beam", prompts, [params] * len(prompts), use_tqdm)

    def _submit(self, kind: str, prompts: list, params: list, use_tqdm: bool) -> list:
        """Check every prompt before any runs, so a bad one leaves the engine as it was."""
        for prompt, p in zip(prompts, params):
            self.engine.check_fits(len(self.engine.tokenize(prompt)[1]), p)
        ids = [f"{kind}-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(request_id, prompt, p)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        done = {}
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), self.engine.counters["generation_tokens"]
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
                tokens = self.engine.counters["generation_tokens"] - generated
                bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [done[i] for i in ids]

    def chat(self, messages, params: SamplingParams | None = None, use_tqdm: bool = True):
        """One conversation (a list of {"role", "content"}) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in conversations]
        prompt_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(prompt_ids, params, use_tqdm)

    def stats(self) -> dict:
        return self.engine.stats()


def as_prompt_list(prompts) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [p.get("prompt_token_ids", p.get("prompt")) if isinstance(p, dict) else p for p in prompts]
