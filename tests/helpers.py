"""Shared by the engine tests: the bundled model, Hugging Face references, prompts."""
from __future__ import annotations

import functools

import torch

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "def fibonacci(n):",
    "In 1969, the first humans",
    "Photosynthesis is the process by which plants convert light into chemical energy. "
    "The main stages of photosynthesis are",
    "A list of prime numbers: 2, 3, 5,",
]


@functools.cache
def bundled_dir():
    from engine.models.loader import checkpoint_dir
    return checkpoint_dir(None)


@functools.cache
def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation of one prompt: the reference."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def assert_pool_whole(llm) -> None:
    llm.engine.kv.audit()
    stats = llm.stats()
    assert stats.kv.pages_in_use == 0, stats
    assert stats.num_running == 0 and stats.num_waiting == 0
