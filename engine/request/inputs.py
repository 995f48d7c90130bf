"""Prompts as the engine takes them: token ids, with the text they came from when there is one.

Prompts are tokenized once, here, and checked against the vocabulary; chat conversations go
through the model's chat template in `chat_prompt` and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None
    cache_salt: str | None = None  # vLLM's: cached KV is shared only between prompts of the same salt


def tokenize(tokenizer, vocab_size: int, prompt) -> Prompt:
    """A string, a list of token ids, vLLM's {"prompt": ...} / {"prompt_token_ids": ...} (either
    with a "cache_salt"), or a Prompt; ValueError, with the reason, for anything empty, out of
    the vocabulary, or a dict with other keys."""
    if isinstance(prompt, Prompt):
        return prompt
    salt = None
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids' (one of them) and an optional "
                             f"'cache_salt', got keys {sorted(prompt)}")
        salt = check_cache_salt(prompt.get("cache_salt"))
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if salt is not None:
            inner = tokenize(tokenizer, vocab_size, prompt)
            return Prompt(inner.token_ids, inner.text, salt)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        check_text(prompt)
        return Prompt(tokenizer.encode(prompt), prompt)
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                        for t in prompt):
        raise ValueError("a prompt must be a string or a list of token ids")
    if not prompt:
        raise ValueError("the prompt has no tokens")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    return Prompt(list(prompt))


def check_cache_salt(salt) -> str | None:
    """None, or a non-empty string of valid Unicode (the salt is hashed, never stored in clear)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt must be a non-empty string")
    try:
        check_text(salt)
    except ValueError as exc:
        raise ValueError(f"cache_salt: {exc}") from None
    return salt


def chat_prompt(tokenizer, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, add_special_tokens: bool = False) -> Prompt:
    """One conversation through the model's chat template, ready for the assistant's turn
    (`tools`: handed to a template that takes them). The rest as vLLM's /tokenize takes them:
    the assistant's turn opened or not, the last message left open to be continued, and the
    tokenizer's special tokens added around the template's text (which has its own)."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    for message in messages:
        check_text(message.get("content") or "")
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message, **extra)
    except Exception as exc:  # templates raise their own errors for conversations they refuse
        raise ValueError(f"cannot apply the chat template: {exc}") from exc
    return Prompt(tokenizer.encode(text, add_special_tokens=add_special_tokens), text)


def check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text is not valid Unicode ({exc.reason} at position {exc.start})") from exc
