"""Structured outputs: a grammar decides which tokens may come next, as a mask on the logits.

A request asks for one of: a JSON schema (`json`), any JSON object (`json_object`), a regular
expression (`regex`), one of a list of strings (`choice`), or a grammar (`grammar`: Lark, or
GBNF/EBNF). llguidance (the grammar engine vLLM also offers) compiles it against the
tokenizer; every sequence of the request gets its own matcher, which yields the allowed-token
mask before each sample and consumes each sampled token after. When the grammar is complete
the sequence stops ("stop"), with or without an EOS token.

Preemption by recompute keeps a sequence's generated tokens, so its matcher stays where it is;
anything that takes tokens back (speculative decoding) rolls the matcher back by as many.
"""
from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Each request's budget in the grammar engine (llguidance's units: a grammar's size, and lexer
# "fuel", a deterministic bound on the work of building it and of each token's mask). A grammar
# past it is refused at submission, or fails its request alone while it runs (a 400 either way).
BUDGET = {"max_grammar_size": 500_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
          "max_items_in_row": 2100, "step_max_items": 50_000, "max_lexer_states": 250_000}
MAX_CHOICES = 2000  # a choice of this many strings fits the row limit above (each row holds a few more items)


def engine_message(error: str | None, kind: str) -> str:
    """What a client is told of a grammar-engine error: which limit or what did not parse, never
    the engine's own text (its parser state, the generated grammar, a caret under it)."""
    first = (error or "").splitlines()[0] if error else ""  # (the rest is the engine's parser state)
    if first.startswith("Unsatisfiable schema:") and len(first) < 300:  # the schema's own contradiction
        return "the JSON schema cannot be satisfied: " + first.removeprefix("Unsatisfiable schema:").strip()
    text = first.lower()
    if "items; max is" in text or "max_items" in text:
        return (f"the structured output has more alternatives or repeats in one place than the grammar engine's "
                f"limits allow (a choice holds at most {MAX_CHOICES:,} options)")
    if any(word in text for word in ("lexer", "fuel", "expressions", "too large", "size", "states", "limit")):
        return "the structured output is too large or too complex for the grammar engine's limits"
    return {"json": "the JSON schema is not one the grammar engine can follow",
            "regex": "the regex does not parse", "grammar": "the grammar does not parse"}.get(
        kind, "the structured output is not one the grammar engine can follow")


def _limits():
    from llguidance import LLParserLimits

    return LLParserLimits(**BUDGET)


MAX_SCHEMA_DEPTH = 64  # objects and arrays inside each other: far past any real schema, far below Python's stack


def nesting(value) -> int:
    """How deep objects and arrays sit inside each other in a JSON value (iterative: no stack
    for a hostile one to overflow)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:  # past it the answer is known
                todo.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@dataclass
class StructuredOutputsParams:
    """vLLM's names. Exactly one of the fields is set."""
    json: dict | str | None = None  # a JSON schema (object or its text)
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            except RecursionError:
                raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
        if self.json is not None and nesting(self.json) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        checks = [(self.json is None or isinstance(self.json, dict), "json must be a JSON schema object"),
                  (self.json_object in (None, True, False), "json_object must be a boolean"),
                  (self.regex is None or isinstance(self.regex, str), "regex must be a string"),
                  (self.grammar is None or isinstance(self.grammar, str), "grammar must be a string"),
                  (self.choice is None or (isinstance(self.choice, list) and self.choice
                                           and all(isinstance(c, str) and c for c in self.choice)),
                   "choice must be a non-empty list of non-empty strings"),
                  (self.choice is None or len(self.choice) <= MAX_CHOICES,
                   f"choice holds at most {MAX_CHOICES:,} options, got {len(self.choice or ()):,}")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def to_llguidance(self) -> str:
        """The request as llguidance's grammar text."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        compact = {"whitespace_flexible": False}  # no runs of whitespace a small model may loop in
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json, defaults=compact)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(any_to_lark(self.grammar))


class Grammars:
    """Compiles requests' grammars and makes their matchers; wraps the tokenizer once, on first use.
    Requests are compiled where they are checked (engine/core/processor.py: a server's tokenizer
    thread), matchers are made on the engine's thread; the lock keeps the wrapper and the cache
    whole between them."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64):
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None
        self._compiled: dict[str, str] = {}  # request's grammar, as JSON -> checked grammar
        self.cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The grammar, checked against the tokenizer and at its first token (cached: a grammar
        seen before is not checked again); ValueError with the reason."""
        from llguidance import LLMatcher

        key = json.dumps(asdict(params), sort_keys=True)
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
        kind = next(k for k in KINDS if getattr(params, k) not in (None, False))
        try:
            grammar = params.to_llguidance()
        except Exception as exc:  # llguidance raises plain errors for malformed input
            raise ValueError(f"invalid structured output: {engine_message(str(exc), kind)}") from None
        error = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=_limits())
        if error:
            raise ValueError(f"invalid structured output: {engine_message(error, kind)}")
        self._check(grammar, kind)
        with self._lock:
            if len(self._compiled) >= self.cache_size:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = grammar
        return grammar

    def matcher(self, grammar: str, kind: str = "") -> object:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {engine_message(matcher.get_error(), kind)}")
        return matcher

    def _check(self, grammar: str, kind: str) -> None:
        """Refuse, before anything runs, a grammar no text can satisfy (its first mask is an
        error: `{"$ref": "#"}`, `start: start`) or one past the grammar engine's limits at its
        first token (a 2,001-way choice, `a{1000000}`). Deeper failures end the request with a
        GrammarError while it runs."""
        matcher = self.matcher(grammar, kind)
        allowed = self.masks([matcher])[0].nonzero().flatten()
        if matcher.is_error() or not len(allowed):
            raise ValueError("the structured output cannot be satisfied: no text matches it")
        if not matcher.consume_token(int(allowed[0])):
            raise ValueError(f"invalid structured output: {engine_message(matcher.get_error(), kind)}")

    def masks(self, matchers: list, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """bool [rows, vocab] on `device` (the logits'): True where a token may come next; None
        when no row has a grammar."""
        if all(m is None for m in matchers):
            return None
        import llguidance.torch as lt

        bits = lt.allocate_token_bitmask(len(matchers), self.vocab_size)
        bits.fill_(-1)
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                lt.fill_next_token_bitmask(matcher, bits, row)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = (bits[:, :, None] >> shifts) & 1
        return allowed.flatten(1)[:, :self.vocab_size].bool().to(device)


class GrammarError(RuntimeError):
    """A request's grammar failed while generating (a limit of the grammar engine): the
    client's request, so the server answers 400, naming the limit (engine_message), never the
    engine's parser state."""


def consume(matcher, token_id: int) -> bool:
    """Advance a matcher by one sampled token; True when its grammar is now complete. A grammar
    that reached a point no text completes (a schema whose property requires itself) errs, and
    then allows only EOS: that ends the request as an error, not as a "stop" with text the
    grammar does not match."""
    if not matcher.consume_token(token_id) or matcher.is_error():
        raise GrammarError(f"the structured output's grammar failed while generating: "
                           f"{engine_message(matcher.get_error(), '')}")
    if matcher.is_stopped() and not matcher.is_accepting():
        raise GrammarError("the structured output's grammar failed while generating: no text completes it")
    return matcher.is_stopped()
