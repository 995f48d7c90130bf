"""Tokens as the OpenAI APIs show them in logprobs: their text, their exact bytes (a byte-level
or byte-fallback token is its own bytes, not U+FFFD), and each API's logprobs form."""
from __future__ import annotations

from engine.request.detokenizer import IncrementalDetokenizer
from engine.request.outputs import CompletionOutput, LogprobsOnePosition, top_of


class TokenText:
    """How tokens read in logprobs: their text and their exact bytes, cached per token id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._byte_level = _byte_decoder() if _is_byte_level(tokenizer) else None

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: a byte-fallback token is its one byte, not U+FFFD."""
        if token_id not in self._bytes:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self._byte_level and all(ch in self._byte_level for ch in piece):
                raw = bytes(self._byte_level[ch] for ch in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = bytes([int(piece[3:5], 16)])
            else:
                raw = piece.replace("\u2581", " ").encode()
            self._bytes[token_id] = raw
        return list(self._bytes[token_id])

    def completion_logprobs(self, c: CompletionOutput, k: int) -> dict | None:
        """The completions API's form, each position's k most likely tokens."""
        if c.logprobs is None:
            return None
        chosen = [next(iter(entries)) for entries in c.logprobs]  # (each position's own token comes first)
        return {"tokens": [self.text(t) for t in chosen],
                "token_logprobs": [entries[t].logprob for t, entries in zip(chosen, c.logprobs)],
                "top_logprobs": [self.top(top_of(entries, k)) for entries in c.logprobs],
                "text_offset": list(c.text_offsets or [])}

    def top(self, pairs) -> dict[str, float]:
        """{text: logprob}, most likely first; tokens of the same text (byte tokens that each
        read U+FFFD) keep the likelier one's logprob, not the last one's."""
        top: dict[str, float] = {}
        for t, v in pairs:
            top.setdefault(self.text(t), v)
        return top

    def echoed_logprobs(self, scored: list[LogprobsOnePosition | None], prompt_ids: list[int], completion: dict,
                        shift: int, k: int) -> dict:
        """The completions API's logprobs with echo: the prompt's tokens (the first has no
        logprob, as OpenAI's), then the completion's, whose text offsets move past the prompt's
        `shift` characters. A prompt token's offset is where its text starts among theirs."""
        texts = [self.text(t) for t in prompt_ids]
        reader, offsets = IncrementalDetokenizer(self.tokenizer, []), []
        for t in prompt_ids:  # (as a completion's offsets: where the text read so far ends)
            offsets.append(len(reader.text))
            reader.add(t)
        return {"tokens": texts + completion["tokens"],
                "token_logprobs": [r[t].logprob if r else None for r, t in zip(scored, prompt_ids)]
                + completion["token_logprobs"],
                "top_logprobs": [self.top(top_of(r, k)) if r else None for r in scored] + completion["top_logprobs"],
                "text_offset": offsets + [shift + o for o in completion["text_offset"]]}

    def chat_logprobs(self, c: CompletionOutput, k: int) -> dict | None:
        """The chat API's form: per token, its top_logprobs are exactly the k most likely."""
        if c.logprobs is None:
            return None
        entry = lambda t, v: {"token": self.text(t), "logprob": v, "bytes": self.bytes(t)}
        content = []
        for entries in c.logprobs:
            chosen = next(iter(entries))  # (each position's own token comes first)
            content.append({**entry(chosen, entries[chosen].logprob),
                            "top_logprobs": [entry(t, v) for t, v in top_of(entries, k)]})
        return {"content": content}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in type(backend.decoder).__name__ + str(backend.decoder)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table
