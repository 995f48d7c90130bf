"""No request can take the server down or hurt another's: each reproducer that once killed the
engine, answered 500 or hung a connection, now gets a clear 4xx (OpenAI's error object) or
works, and the server goes on serving. Runs on `random:tiny` with small limits, so it is fast."""
import asyncio
import json
import socket
import time
from collections import Counter

import httpx
import pytest
from uvicorn.protocols.http import h11_impl

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.serving.loop.async_engine import AsyncEngine
from engine.serving.loop.preprocess import THREADS
from engine.serving import http
from engine.serving.http import GuardedH11Protocol
from engine.serving.options import ServerOptions
from engine.serving.api.server import build_app
from helpers import assert_pool_whole, async_engine, served

OPTIONS = ServerOptions(max_body_bytes=4 << 20, body_timeout=1.5, max_prompts_per_request=16)


PER_PEER = 16  # connections one address may hold open


@pytest.fixture(scope="module")
def server():
    engine = async_engine(max_num_seqs=4, page_size=4096, max_model_len=256)
    protocol = type("H", (GuardedH11Protocol,), {"header_timeout": 1.0, "max_per_peer": PER_PEER, "peers": Counter()})
    with served(engine, "tiny", OPTIONS, http=protocol) as base:
        yield base, engine, int(base.rsplit(":", 1)[1])


def post(base: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(base + path, content=content, headers={"Content-Type": "application/json"}, timeout=60, **kw)


def assert_still_serving(base: str, engine: AsyncEngine) -> None:
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    ok = post(base, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1, ok.text
    deadline = time.monotonic() + 10
    while engine.streams and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.streams


CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
CASES = {  # name: (path, body, status, words the error must contain)
    "tiny temperature is greedy": ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-300}, 200, ()),
    "tiny repetition penalty": ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e-300}, 400, ("repetition_penalty",)),
    "stop token past the vocabulary": ("/v1/completions", {"prompt": "Hi", "min_tokens": 1, "stop_token_ids": [50000]},
                                       400, ("stop_token_ids", "vocabulary")),
    "logit bias past the vocabulary": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": 5}}, 400, ("logit_bias",)),
    "empty prompt list": ("/v1/completions", {"prompt": []}, 400, ("prompt",)),
    "max_completion_tokens 0": (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, ("max_completion_tokens",)),
    "text part that is a number": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                                   400, ("messages",)),
    "text part that is null": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
                               400, ("text",)),
    "lone surrogate": ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', 400, ("Unicode",)),
    "seed too large": ("/v1/completions", {"prompt": "Hi", "seed": 2 ** 64}, 400, ("seed",)),
    "seed too large, streaming": ("/v1/completions", {"prompt": "Hi", "seed": 2 ** 64, "stream": True}, 400, ("seed",)),
    "seed too small": (CHAT, {"messages": HI, "seed": -2 ** 63 - 1}, 400, ("seed",)),
    "invalid UTF-8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, ("UTF-8",)),
    "deeply nested JSON": ("/v1/completions", "[" * 100_000, 400, ()),
    "unknown field": ("/v1/completions", {"prompt": "Hi", "frobnicate": 1}, 400, ("frobnicate",)),
    "suffix": ("/v1/completions", {"prompt": "Hi", "suffix": "end"}, 400, ("suffix",)),
    "echo with logprobs, streamed": ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 1, "stream": True},
                                     400, ("echo",)),
    "best_of below n": ("/v1/completions", {"prompt": "Hi", "n": 3, "best_of": 2}, 400, ("best_of",)),
    "best_of streamed": ("/v1/completions", {"prompt": "Hi", "best_of": 3, "stream": True}, 400, ("best_of",)),
    "stop under beam search": ("/v1/completions", {"prompt": "Hi", "n": 2, "use_beam_search": True, "stop": ["x"]},
                               400, ("stop", "beam")),
    "a tool that is not a function": (CHAT, {"messages": HI, "tools": [{"type": "retrieval"}]}, 400, ("tools[0]",)),
    "tool_choice without tools": (CHAT, {"messages": HI, "tool_choice": "auto"}, 400, ("tool_choice", "needs tools")),
    "tool_choice naming no tool": (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
                                   ("'g'", "not among")),
    "forced tool call and a structured output": (CHAT, {"messages": HI, "guided_regex": "a",
                                                        "tools": [{"type": "function", "function": {"name": "f"}}],
                                                        "tool_choice": "required"}, 400, ("structured output",)),
    "tool call with arguments that are not JSON": (CHAT, {"messages": HI + [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{oops"}}]}]}, 400, ("tool_calls[0]",)),
    "top_logprobs without logprobs": (CHAT, {"messages": HI, "top_logprobs": 2}, 400, ("top_logprobs",)),
    "image part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                   400, ("image_url",)),
    "tool message without the call it answers": (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400,
                                                 ("tool_call_id",)),
    # each accepted before: a result answering no call, a stop that cut the forced call's arguments
    # into content, a function of a string that looped to the length limit
    "tool result answering no call": (CHAT, {"messages": HI + [{"role": "tool", "tool_call_id": "nope", "content": "x"}]},
                                      400, ("tool_call_id 'nope' answers no tool call",)),
    "stop under a forced tool call": (CHAT, {"messages": HI, "stop": [","],
                                             "tools": [{"type": "function", "function": {"name": "f"}}],
                                             "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
                                      ("stop", "forced tool call")),
    "a function of a string": (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, 400, ("parameters must be a JSON schema of type object",)),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, ("role", "user")),
    "message name": (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, ("name",)),
    "message without content": (CHAT, {"messages": [{"role": "user"}]}, 400, ("content",)),
    "stream_options without stream": (CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, 400,
                                      ("stream_options",)),
    "two structured outputs": (CHAT, {"messages": HI, "guided_regex": "a", "response_format": {"type": "json_object"}},
                               400, ("structured",)),
    "bad regex": (CHAT, {"messages": HI, "guided_regex": "["}, 400, ("structured output",)),
    "json_schema without a schema": (CHAT, {"messages": HI, "response_format": {"type": "json_schema",
                                                                               "json_schema": {"name": "x"}}},
                                     400, ("schema",)),
    "too many sequences": ("/v1/completions", {"prompt": ["a"] * 4, "n": 5}, 400, ("sequences",)),
    "unknown route": ("/v1/nothing", {"prompt": "Hi"}, 404, ()),
    "priority under fcfs": ("/v1/completions", {"prompt": "Hi", "priority": 3}, 400, ("priority", "scheduling")),
    "temperature under beam search": ("/v1/completions", {"prompt": "Hi", "n": 2, "use_beam_search": True,
                                                          "temperature": 0.7}, 400, ("temperature", "beam")),
    "greedy beam search": ("/v1/completions", {"prompt": "Hi", "n": 2, "use_beam_search": True, "temperature": 0,
                                               "max_tokens": 2}, 200, ()),
    "seed under beam search": (CHAT, {"messages": HI, "n": 2, "use_beam_search": True, "seed": 1}, 400, ("seed", "beam")),
    "length_penalty without beams": ("/v1/completions", {"prompt": "Hi", "length_penalty": 2.0}, 400,
                                     ("length_penalty", "beam")),
    "every token a stop token": ("/v1/completions", {"prompt": "Hi", "min_tokens": 2,
                                                     "stop_token_ids": list(range(49152))},
                                 400, ("stop_token_ids", "1024")),
    "min_tokens under a grammar": (CHAT, {"messages": HI, "min_tokens": 3, "max_tokens": 8,
                                          "guided_json": {"$ref": "#"}}, 400, ("min_tokens",)),
    # grammars no text satisfies, and grammars past the grammar engine's limits: refused at submission
    "json schema that refers to itself": (CHAT, {"messages": HI, "guided_json": {"$ref": "#"}}, 400,
                                          ("cannot be satisfied",)),
    "regex that matches nothing": (CHAT, {"messages": HI, "guided_regex": "[^\\x00-\\x{10FFFF}]"}, 400,
                                   ("cannot be satisfied",)),
    "grammar that never ends": (CHAT, {"messages": HI, "guided_grammar": "start: start"}, 400,
                                ("cannot be satisfied",)),
    "2,001 choices": (CHAT, {"messages": HI, "guided_choice": [f"c{i}" for i in range(2001)]}, 400,
                      ("choice holds at most 2,000 options",)),
    "2,000 choices, the limit": (CHAT, {"messages": HI, "max_tokens": 2, "guided_choice": [f"c{i}" for i in range(2000)]},
                                 200, ()),  # refused before
    "a regex that does not parse": (CHAT, {"messages": HI, "guided_regex": "(a"}, 400, ("the regex does not parse",)),
    "a grammar that does not parse": (CHAT, {"messages": HI, "guided_grammar": "start: ::= tools"}, 400,
                                      ("the grammar does not parse",)),
    "a regex of a million repeats": (CHAT, {"messages": HI, "guided_regex": "a{1000000}"}, 400, ("limits",)),
    "a grammar past the limits after its first token": (CHAT, {"messages": HI, "max_tokens": 8,
                                                              "guided_regex": "(x|y)a{1000000}"}, 400,
                                                        ("grammar failed", "limits")),
    "temperature past fp32": ("/v1/completions", {"prompt": "Hi", "temperature": 1e39}, 400, ("temperature",)),
    "cache_salt": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "cache_salt": "tenant-a"}, 200, ()),
    "cache_salt on chat": (CHAT, {"messages": HI, "max_tokens": 2, "cache_salt": "tenant-a"}, 200, ()),
    "empty cache_salt": ("/v1/completions", {"prompt": "Hi", "cache_salt": ""}, 400, ("cache_salt",)),
    "cache_salt not a string": (CHAT, {"messages": HI, "cache_salt": 7}, 400, ("cache_salt",)),
    # strict types, as OpenAI's schema: no coercion
    "temperature true": ("/v1/completions", {"prompt": "Hi", "temperature": True}, 400, ("temperature",)),
    "n true": ("/v1/completions", {"prompt": "Hi", "n": True}, 400, ("n",)),
    "max_tokens a string": ("/v1/completions", {"prompt": "Hi", "max_tokens": "4"}, 400, ("max_tokens",)),
    "token ids as floats": ("/v1/completions", {"prompt": [1.0, 2.0]}, 400, ("prompt",)),
    "token ids as booleans": ("/v1/completions", {"prompt": [True, 2]}, 400, ("prompt",)),
    "temperature an integer": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}, 200, ()),
    "logit_bias key with a space": ("/v1/completions", {"prompt": "Hi", "logit_bias": {" 5": 1}}, 400, ("logit_bias",)),
    "logit_bias key in Arabic digits": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"\u0665": 1}}, 400,
                                        ("logit_bias",)),
    "text too long to tokenize": ("/v1/completions", {"prompt": "a" * 100_000}, 400, ("cannot fit",)),
    "chat too long to tokenize": (CHAT, {"messages": [{"role": "user", "content": "a" * 100_000}]}, 400,
                                  ("cannot fit",)),
    "lone surrogate stop": ("/v1/completions", '{"prompt": "Hi", "stop": ["\\ud800"]}', 400, ("stop",)),
    # a review's reproducers (each a 500, a slowed engine or a field dropped without a word)
    "length_penalty -Infinity": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 3, "use_beam_search": true, "n": 2, '
                                 '"length_penalty": -Infinity}', 400, ("length_penalty",)),
    "length_penalty 700": ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "use_beam_search": True, "n": 2,
                                               "length_penalty": 700}, 400, ("length_penalty",)),
    "length_penalty NaN": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 3, "use_beam_search": true, "n": 2, '
                           '"length_penalty": NaN}', 400, ("length_penalty",)),
    "a schema string nested 3,000 deep": ("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                              "guided_json": "[" * 3000 + "]" * 3000}, 400, ("nests",)),
    "a schema nested 300 deep": (CHAT, {"messages": HI, "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
            '{"type": "object", "properties": {"a": ' * 300 + "{}" + "}}" * 300)}}}, 400, ("nests",)),
    "lone surrogate user": ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "user": "\\udc00"}', 400, ("user",)),
    "lone surrogate user on chat": (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "user": "\\udc00"}', 400,
                                    ("user",)),
    "65 stop strings": ("/v1/completions", {"prompt": "Hi", "stop": [f"s{i}" for i in range(65)]}, 400, ("stop",)),
    "a stop string of 1,025 characters": ("/v1/completions", {"prompt": "Hi", "stop": ["a" * 1025]}, 400, ("stop",)),
    "min_tokens with a structured output": ("/v1/completions", {"prompt": "Hi", "max_tokens": 10, "min_tokens": 5,
                                                                "guided_choice": ["yes", "no"]}, 400, ("min_tokens",)),
    "ignore_eos with a structured output": ("/v1/completions", {"prompt": "Hi", "ignore_eos": True,
                                                                "guided_choice": ["yes", "no"]}, 400, ("ignore_eos",)),
    "json_object with a json_schema": (CHAT, {"messages": HI, "response_format": {
        "type": "json_object", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}, 400, ("json_schema",)),
    "text with a json_schema": (CHAT, {"messages": HI, "response_format": {
        "type": "text", "json_schema": {"name": "x", "schema": {"type": "integer"}}}}, 400, ("json_schema",)),
    "an empty schema is a schema": (CHAT, {"messages": HI, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 200, ()),
    "an unknown field beside a tool's function": (CHAT, {"messages": HI, "tools": [
        {"type": "function", "function": {"name": "f"}, "extra": 1}]}, 400, ("extra",)),
    "max_completion_tokens and another max_tokens": (CHAT, {"messages": HI, "max_completion_tokens": 3,
                                                           "max_tokens": 100}, 400, ("max_tokens",)),
    "max_completion_tokens and the same max_tokens": (CHAT, {"messages": HI, "max_completion_tokens": 3,
                                                            "max_tokens": 3}, 200, ()),
    "logit_bias key of 5,000 digits": ("/v1/completions", {"prompt": "Hi", "logit_bias": {"7" * 5000: 1}}, 400,
                                       ("logit_bias",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_and_odd_requests_get_clear_answers_and_hurt_no_one(server, case):
    base, engine, _ = server
    path, body, status, words = CASES[case]
    r = post(base, path, body)
    assert r.status_code == status, r.text
    if status != 200:
        message = r.json()["error"]["message"]
        assert all(w in message for w in words), message
        assert "<state>" not in message and "compute_time_us" not in message  # no internal parser state
        assert not any(word in message for word in ("Parser Error", "lexer error", "left-recursive", "^", "%import")), \
            message  # nor the grammar engine's own words, nor a generated grammar under a caret
    assert_still_serving(base, engine)


def test_one_address_cannot_hold_every_connection(server):
    base, engine, port = server
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(PER_PEER)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b"".join(iter(lambda: extra.recv(65536), b""))
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b" 429 " in head.split(b"\r\n")[0], reply[:200]
        assert json.loads(body)["error"]["type"] == "rate_limit_exceeded"
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert_still_serving(base, engine)


def test_the_concurrency_limit_answers_in_openai_shape():
    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(http._service_unavailable({}, None, send))
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["error"]["type"] == "service_unavailable"
    assert h11_impl.service_unavailable is http._service_unavailable


def test_body_limits_and_deadlines(server):
    base, engine, port = server

    def raw(data: bytes, wait: float = 0.0) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(data)
            time.sleep(wait)
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)

    def chunks():  # a chunked body larger than the limit, never declared
        for _ in range(5):
            yield b"x" * (1 << 20)

    r = httpx.post(base + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]
    both = raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n"
               b"Content-Type: application/json\r\n\r\n0\r\n\r\n")
    assert both.split(b"\r\n")[0].split()[1] in (b"400",), both[:200]
    start = time.monotonic()  # a body shorter than its Content-Length: 408 after the body deadline
    short = raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                b"Content-Type: application/json\r\n\r\n{\"prompt\"")
    assert b" 408 " in short.split(b"\r\n")[0] and time.monotonic() - start < 10
    start = time.monotonic()  # a silent connection is closed after the header deadline
    assert raw(b"") == b"" and time.monotonic() - start < 5
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # slowloris: a byte at a time
        start, closed = time.monotonic(), False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)
        assert closed and time.monotonic() - start < 5
    assert_still_serving(base, engine)


def test_metrics_are_fresh_after_an_abort_and_count_exactly(server):
    base, engine, _ = server

    def scrape() -> dict[str, float]:
        lines = httpx.get(base + "/metrics").text.splitlines()
        return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("vkv:")}

    before = scrape()
    post(base, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 7, "ignore_eos": True, "n": 2})
    after = scrape()
    assert after["vkv:generation_tokens_total"] - before["vkv:generation_tokens_total"] == 14
    assert after["vkv:prompt_tokens_total"] - before["vkv:prompt_tokens_total"] == 3
    assert after["vkv:request_success_total"] - before["vkv:request_success_total"] == 1
    body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 3:
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while (m := scrape())["vkv:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m["vkv:num_requests_running"] == 0 and m["vkv:pages_in_use"] == 0, m
    assert {"vkv:pages_idle", "vkv:pages_cached", "vkv:pages_free"} <= set(m)
    assert m["vkv:pages_free"] + m["vkv:pages_idle"] + m["vkv:pages_cached"] == m["vkv:pages_total"]


def test_stream_usage_counts_tokens_whose_text_is_held_back(server):
    """Tokens whose text is empty (a special token skipped, part of a UTF-8 character not
    complete yet; here <|im_start|>, forced by logit_bias): the stream sends no chunk for them, but
    usage counts them, as the non-streamed answer does. It once counted only tokens sent."""
    base, _, _ = server
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 24, "ignore_eos": True, "temperature": 0,
            "logit_bias": {"1": 100}}  # a special token, skipped: text "" throughout
    whole = post(base, "/v1/completions", body).json()
    with httpx.stream("POST", base + "/v1/completions", timeout=30,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    chunks = sum(1 for e in events if e["choices"])
    assert chunks < 24  # some tokens sent no chunk (the case this guards)
    streamed, answered = events[-1]["usage"], whole["usage"]
    for usage in (streamed, answered):  # (cached tokens: whatever the cache held at each request)
        assert 0 <= usage.pop("prompt_tokens_details")["cached_tokens"] <= 3
    assert streamed == answered == {"prompt_tokens": 4, "completion_tokens": 24, "total_tokens": 28}


def test_a_request_of_many_prompts_does_not_starve_a_small_one(server):
    base, engine, _ = server
    # Two clients at one address: OpenAI's `user` field tells them apart (as the API key would).
    big = {"prompt": [[i + 1, i + 2] for i in range(16)], "max_tokens": 48, "ignore_eos": True, "user": "a"}
    small = {"prompt": [7, 7, 7], "max_tokens": 4, "ignore_eos": True, "user": "b"}

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            order = []

            async def send(name, body, delay):
                await asyncio.sleep(delay)
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                order.append(name)
            await asyncio.gather(send("big", big, 0), send("small", small, 0.3))
            return order

    # 4 seats: the big request fills them and queues 12 more; the small one takes a seat at once.
    assert asyncio.run(scenario()) == ["small", "big"]


def test_tokenization_does_not_block_the_event_loop(server):
    base, engine, _ = server
    prompt = "hello world, this is a test. " * 33_000  # about 1 MB, 270k tokens: too long, after tokenizing

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            big = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": prompt})) for _ in range(4)]
            await asyncio.sleep(0.2)
            worst = 0.0
            while not all(b.done() for b in big):
                start = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                worst = max(worst, time.monotonic() - start)
                await asyncio.sleep(0.05)
            return worst, [b.result().status_code for b in big]

    worst, statuses = asyncio.run(scenario())
    assert statuses == [400] * 4
    assert worst < 1.0, worst  # four 1 MB tokenizations take several seconds together


def test_offline_engine_fails_one_request_and_serves_the_rest():
    """A bug inside one request's processing (here: its detokenizer raises) fails that request
    with finish reason "error" and its message; the others finish as they would alone."""
    llm = LLM(model="random:tiny", max_num_seqs=4, kv_cache_memory=8 << 20, page_size=4096)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6]], greedy, use_tqdm=False)]
    engine = llm.engine
    engine.add_request("ok-0", [1, 2, 3], greedy)
    engine.add_request("doomed", [9, 9, 9], SamplingParams(n=2, max_tokens=6, ignore_eos=True))
    engine.add_request("ok-1", [4, 5, 6], greedy)

    def broken(token_id):
        raise RuntimeError("simulated detokenizer bug")
    for completion in engine.output_processor.requests["doomed"].completions:
        completion.detokenizer.add = broken
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert "simulated detokenizer bug" in done["doomed"].error
    assert {c.finish_reason for c in done["doomed"].outputs} == {"error"}
    assert [done["ok-0"].outputs[0].token_ids, done["ok-1"].outputs[0].token_ids] == alone
    assert llm.stats().requests_failed == 1
    assert_pool_whole(llm)


def test_one_clients_tokenization_burst_does_not_queue_another_client(server):
    """Each client's tokenization jobs wait in a queue of their own and the workers serve the
    clients in turn: client b's one job starts right after the jobs in flight, not after all
    of client a's 40 queued before it."""
    _, engine, _ = server
    order: list[str] = []

    def slow(tokenizer, who):  # a tokenization that takes 10 ms
        order.append(who)
        time.sleep(0.01)
        return tokenizer.encode("hello")

    burst = [engine.preprocess.workers.submit("a", slow, "a") for _ in range(40)]
    order.append("b asks")
    small = engine.preprocess.workers.submit("b", slow, "b")
    assert small.result(timeout=30) and all(f.result(timeout=30) for f in burst)
    # in turn: after the jobs in flight (one a thread, taken before b asked, though on a loaded
    # machine perhaps not yet started) and at most one more of a's; FIFO: after all 40 of a's
    assert order.index("b") - order.index("b asks") <= THREADS + 2, order


@pytest.mark.parametrize("isolate", [False, True])
def test_isolated_clients_never_reuse_each_others_cached_prefixes(isolate):
    """--isolate-clients: each client's pages are salted with its identity (here OpenAI's
    `user` at one address), so one client's prompt is never a cache hit for another, and so
    cannot be timed or counted by it; the same client still reuses its own."""
    engine = AsyncEngine(LLMEngine(EngineConfig(model="random:tiny", max_num_seqs=4, kv_cache_memory=8 << 20,
                                                page_size=4096)))
    app = build_app(engine, "tiny", ServerOptions(isolate_clients=isolate))
    secret = {"prompt": list(range(100, 300)), "max_tokens": 2}

    async def hits(user):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vkv") as c:
            before = engine.engine.kv.prefix_cache.hits
            r = await c.post("/v1/completions", json=secret | {"user": user})
            assert r.status_code == 200, r.text
            return engine.engine.kv.prefix_cache.hits - before

    try:
        assert asyncio.run(hits("victim")) == 0
        assert (asyncio.run(hits("attacker")) == 0) == isolate
        assert asyncio.run(hits("victim")) > 0  # a client's own prefix is still cached for it
    finally:
        engine.shutdown()
