"""Structured outputs through llguidance: whatever the model's weights (here random ones), the
text follows the grammar, the sequence stops when the grammar is complete, and a bad grammar
is refused before anything runs."""
import json
import re

import pytest

from engine import LLM, SamplingParams
from helpers import assert_pool_whole

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99},
                                           "kind": {"enum": ["cat", "dog"]}},
          "required": ["ok", "count", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny():
    llm = LLM(model="random:tiny", max_num_seqs=8, kv_cache_memory=16 << 20, page_size=4096)
    yield llm
    llm.engine.close()


@pytest.mark.parametrize("kind, spec, check", [
    ("json", SCHEMA, lambda t: set(json.loads(t)) == {"ok", "count", "kind"}),
    ("regex", r"[a-c]{2}-[0-9]{3}", lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
    ("choice", ["alpha", "beta", "gamma"], lambda t: t in ("alpha", "beta", "gamma")),
    ("grammar", 'root ::= "(" [0-9] ("+" [0-9])? ")"', lambda t: re.fullmatch(r"\(\d(\+\d)?\)", t)),
    ("grammar", 'start: "x" NUM\nNUM: /[0-9]{2}/', lambda t: re.fullmatch(r"x\d\d", t)),
])
def test_sampled_text_follows_the_grammar_and_stops_when_complete(tiny, kind, spec, check):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=64, structured_outputs={kind: spec})
    out = tiny.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and check(c.text), c.text
    assert_pool_whole(tiny)


def test_structured_and_plain_requests_share_a_batch(tiny):
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    alone = tiny.generate([[1, 2, 3]], plain, use_tqdm=False)[0].outputs[0].token_ids
    mixed = tiny.generate([[1, 2, 3], [4, 5, 6]], [plain, SamplingParams(temperature=0, max_tokens=40,
                                                                          structured_outputs={"json": SCHEMA})],
                          use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert json.loads(mixed[1].outputs[0].text)["kind"] in ("cat", "dog")


@pytest.mark.parametrize("spec, words", [
    ({"regex": "("}, "regex"), ({"json": "{not json"}, "JSON"), ({"choice": []}, "choice"),
    ({"grammar": "start: undefined_rule"}, "structured output"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
])
def test_bad_grammars_are_refused_before_anything_runs(tiny, spec, words):
    with pytest.raises(ValueError, match=words):
        tiny.generate([[1, 2]], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert_pool_whole(tiny)


def test_each_request_has_a_budget_in_the_grammar_engine(tiny, monkeypatch):
    """engine/request/structured.py BUDGET bounds a grammar's size and the work of building it: past
    it, the request is refused before anything runs."""
    import engine.request.structured as structured

    options = {"choice": [f"option number {i}" for i in range(60)]}
    monkeypatch.setitem(structured.BUDGET, "max_items_in_row", 20)
    with pytest.raises(ValueError, match="structured output"):
        tiny.generate("Hi", SamplingParams(max_tokens=2, structured_outputs=options), use_tqdm=False)
    monkeypatch.undo()
    out = tiny.generate("Hi", SamplingParams(max_tokens=8, structured_outputs=options), use_tqdm=False)[0]
    assert out.error is None


def test_a_grammar_that_reaches_a_dead_end_fails_instead_of_stopping_with_broken_text(tiny):
    """llguidance errs at a point no text completes and then allows only EOS: the request ended
    "stop" with '{"a":' (a review's reproducer). It now fails, naming the grammar; and a schema
    that contradicts itself is refused with the engine's own one-line reason."""
    self_required = {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}
    for spec in ({"json": self_required}, {"grammar": 'start: "x" y\ny: y "z"'}):
        try:
            out = tiny.generate([[1, 2]], SamplingParams(max_tokens=16, structured_outputs=spec), use_tqdm=False)[0]
        except ValueError:
            continue  # refused up front: as good
        assert out.outputs[0].finish_reason != "stop" and out.error and "grammar" in out.error, out
    with pytest.raises(ValueError, match="minItems \\(3\\) is greater than maxItems \\(1\\)"):
        tiny.generate([[1, 2]], SamplingParams(structured_outputs={"json": {"type": "array", "minItems": 3,
                                                                             "maxItems": 1}}), use_tqdm=False)
    assert_pool_whole(tiny)
