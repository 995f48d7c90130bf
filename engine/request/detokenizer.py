"""Incremental detokenization that never emits half a multi-byte character.

Tokens are decoded in a window that starts a few tokens back (`prefix`); new text is what the
window decodes to beyond what its first part (`prefix:read`) already gave. A window whose text
ends in U+FFFD is waiting for the rest of a character, so nothing is emitted until it comes, or
until the completion ends there (`flush`: then the text is what its tokens decode to).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids[-6:])
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Append a token; returns the text it completes (maybe empty: the bytes of a character
        not yet whole are held back)."""
        self.ids.append(token_id)
        return self._advance(hold=True)

    def flush(self) -> str:
        """At the end: the text held back, as decoding the tokens shows it (a character cut short
        is a replacement character), so the whole text is what the tokens decode to."""
        return self._advance(hold=False)

    def _advance(self, hold: bool) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if len(window) <= len(before) or (hold and window.endswith("\ufffd")):
            return ""
        delta = window[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
