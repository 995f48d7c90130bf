"""What runs before a request reaches the engine thread, on worker threads: tokenization, chat
templating, the request's checks (grammars compiled, its LoRA adapter loaded) and loading an
adapter an admin asks for.

Each worker thread has a tokenizer of its own (never the engine thread's), so a large prompt
never blocks the event loop; each client's jobs wait in a queue of its own and the threads
serve the clients in turn (`FairWorkers`), so one client's burst of large prompts delays
another client's request by at most one job per thread. A text that cannot fit max_model_len
is refused before it takes a thread. The engine does not check a request again: what is
checked here reads only what never changes.
"""
from __future__ import annotations

import asyncio
import copy

from engine.request.beam_search import BeamSearchParams
from engine.request.inputs import Prompt, chat_prompt, check_text, tokenize
from engine.core.llm_engine import LLMEngine
from engine.request.lora_request import LoRARequest
from engine.core.processor import EngineRequest
from engine.request.sampling_params import SamplingParams
from engine.serving.loop.workers import FairWorkers

THREADS = 2  # fast tokenizers release the GIL: two clients' prompts tokenize at once


class Preprocessor:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the handlers' own
        self.max_model_len = engine.max_model_len
        self.max_token_bytes = max(len(t.encode("utf-8", "surrogatepass")) for t in self.tokenizer.get_vocab())
        self.workers = FairWorkers(THREADS, lambda: copy.deepcopy(engine.tokenizer))

    async def tokenize(self, prompt, client: str = "") -> Prompt:
        self._check_size(prompt.get("prompt") if isinstance(prompt, dict) else prompt)
        return await self._run(client, tokenize, self.engine.model_config.vocab_size, prompt)

    async def chat_prompt(self, messages: list[dict], client: str = "", tools: list | None = None,
                          **template) -> Prompt:
        """The conversation through the chat template (engine/request/inputs.py chat_prompt's
        `template` options: vLLM's /tokenize sets them)."""
        self._check_size("".join(m["content"] for m in messages if isinstance(m.get("content"), str)))
        return await self._run(client, lambda tokenizer: chat_prompt(tokenizer, messages, tools, **template))

    async def encode(self, text: str, client: str = "", add_special_tokens: bool = True) -> list[int]:
        """A text's token ids, whatever its length (/tokenize counts a text's tokens; the
        request's body bound keeps it bounded)."""
        check_text(text)
        return await self._run(client, lambda tokenizer: tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int], client: str = "") -> str:
        """The ids' text; ValueError for an id outside the vocabulary."""
        vocab = self.engine.model_config.vocab_size
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        return await self._run(client, lambda tokenizer: tokenizer.decode(token_ids))

    def pieces(self, token_ids: list[int]) -> list[str]:
        """Each id's piece of the vocabulary as the tokenizer stores it (vLLM's token_strs)."""
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    @property
    def template_takes_tools(self) -> bool:
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    def _check_size(self, text) -> None:
        """Refuse a text too long to fit max_model_len before it takes the tokenizer's thread:
        no token covers more characters than the longest token's UTF-8 bytes, so a longer text
        needs more tokens than the model takes."""
        if isinstance(text, str) and len(text) > self.max_model_len * self.max_token_bytes:
            raise ValueError(f"the prompt's {len(text)} characters cannot fit in max_model_len "
                             f"{self.max_model_len} tokens (none covers more than {self.max_token_bytes})")

    async def _run(self, client: str, fn, *args):
        """fn(a worker's tokenizer, *args), in the client's turn."""
        return await asyncio.wrap_future(self.workers.submit(client, fn, *args))

    async def process(self, request_id: str, prompt: Prompt, params: SamplingParams | BeamSearchParams,
                      group: str | None = None, priority: int = 0,
                      lora_request: LoRARequest | None = None) -> EngineRequest:
        """The request checked (ValueError, with the reason, if the engine would refuse it). It
        reads only what never changes (and compiles grammars or loads its LoRA adapter, which
        may take a while), so it runs on a worker; the engine does not check it again."""
        return await self._run(group or request_id, lambda _: self.engine.process_inputs(
            request_id, prompt, params, group=group, priority=priority, lora_request=lora_request))

    async def add_lora(self, name: str, path: str) -> None:
        """Load, check and serve an adapter, on a worker thread (ValueError by name; the
        engine's adapter registry is thread-safe)."""
        await self._run("admin", lambda _: self.engine.add_lora(LoRARequest(name, self.engine.next_lora_id(), path)))

    def shutdown(self) -> None:
        self.workers.shutdown()
