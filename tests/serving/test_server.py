"""The OpenAI-compatible server on loopback, with the official `openai` client and raw HTTP."""
import asyncio
import json
import random
import re
import threading
import time

import httpx
import openai
import pytest

from engine.serving.loop.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.serving.options import ServerOptions
from engine.serving.api.server import build_app
from helpers import async_engine, free_port, served
from lossy import prompt_scores

KEY = "sk-test-key"
MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Water boils at", "1, 2, 3, 4,", "The opposite of hot is",
           "My favourite fruit is", "Once upon a time", "def add(a, b):", "The sky is"]


@pytest.fixture(scope="module")
def server():
    engine = async_engine(model=None, max_num_seqs=32, kv_cache_memory=256 << 20)
    with served(engine, MODEL, ServerOptions(api_key=KEY, max_body_bytes=64 << 10, enable_sleep_routes=True)) as base:
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def wait_idle(engine: AsyncEngine) -> dict:
    for _ in range(200):
        stats = engine.stats
        if stats.num_running == 0 and stats.num_waiting == 0 and not engine.streams:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {engine.stats}")


ASK_PARIS = "What is the capital of France? Answer in one sentence."  # (as `make run` asks; test_engine_api.py)


def test_completions_and_chat_with_the_openai_client(client, server):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.choices[0].text and 1 <= out.usage.completion_tokens <= 8
    assert out.usage.prompt_tokens > 0 and out.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK_PARIS}],
                                          max_tokens=16, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK_PARIS}],
        max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}) if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content
    many = client.completions.create(model=MODEL, prompt="My name is", max_tokens=6, n=3, temperature=1.0, seed=3,
                                     logprobs=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) for c in many.choices)
    assert client.models.list().data[0].id == MODEL
    assert wait_idle(server[1]).kv.pages_in_use == 0


def test_64_concurrent_streams_with_random_disconnects(client, server):
    base, engine = server
    want = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS}
    rng = random.Random(0)
    plan = [(PROMPTS[i % len(PROMPTS)], rng.random() < 0.3) for i in range(64)]

    async def one(prompt: str, disconnect: bool, http: httpx.AsyncClient):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        text, chunks = "", 0
        async with http.stream("POST", "/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if disconnect and chunks == 2:
                    return None
        return text

    async def run_all():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            return await asyncio.gather(*(one(p, d, http) for p, d in plan))

    results = asyncio.run(run_all())
    for (prompt, disconnected), text in zip(plan, results):
        if not disconnected:
            assert text == want[prompt], prompt
    stats = wait_idle(engine)
    assert stats.kv.pages_in_use == 0
    engine.engine.kv.audit()


@pytest.mark.parametrize("case", ["bad_json", "unknown_model", "bad_value", "too_long", "too_big",
                                  "no_key", "wrong_key", "missing_field", "n_too_large"])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(case, server):
    base, engine = server
    good = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body, status = json.dumps(good), None
    if case == "bad_json":
        body, status = '{"model": "smollm2", "prompt": ', 400
    elif case == "unknown_model":
        body, status = json.dumps({**good, "model": "gpt-9"}), 404
    elif case == "bad_value":
        body, status = json.dumps({**good, "temperature": -1}), 400
    elif case == "too_long":
        body, status = json.dumps({**good, "prompt": "hello " * 2100}), 400
    elif case == "too_big":
        body, status = json.dumps({**good, "prompt": "x" * (70 << 10)}), 413
    elif case == "no_key":
        headers, status = {"Content-Type": "application/json"}, 401
    elif case == "wrong_key":
        headers, status = {**headers, "Authorization": "Bearer nope"}, 401
    elif case == "missing_field":
        body, status = json.dumps({"model": MODEL}), 400
    elif case == "n_too_large":
        body, status = json.dumps({**good, "n": 1000}), 400
    r = httpx.post(base + "/v1/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    ok = httpx.post(base + "/v1/completions", json=good, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    assert wait_idle(engine).kv.pages_in_use == 0


def test_health_and_prometheus_metrics(server, client):
    base, _ = server
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert httpx.get(base + "/metrics").status_code == 401  # behind the API key, as /v1
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ["vkv:num_requests_running", "vkv:num_requests_waiting", "vkv:kv_cache_usage_ratio",
                 "vkv:pages_total", "vkv:pages_free", "vkv:pages_in_use", "vkv:pages_cached", "vkv:pages_shared",
                 "vkv:prefix_cache_queries_total", "vkv:prefix_cache_hits_total", "vkv:num_preemptions_total",
                 "vkv:cow_copies_total", "vkv:prompt_tokens_total", "vkv:generation_tokens_total",
                 "vkv:time_to_first_token_seconds_bucket", "vkv:inter_token_latency_seconds_bucket",
                 "vkv:e2e_request_latency_seconds_bucket", "vkv:page_map_seconds_per_step_bucket"]:
        assert name in text, name


def test_beam_search_through_the_server_matches_the_offline_api(client, server):
    from engine import LLM, BeamSearchParams

    prompt = "The best way to learn a language is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=3,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    llm = LLM()
    want = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))[0]
    start = len(want.prompt_token_ids)
    assert [c.text for c in out.choices] == [llm.tokenizer.decode(s.tokens[start:], skip_special_tokens=True)
                                             for s in want.sequences]
    assert out.usage.completion_tokens == 3 * 8
    bad = httpx.post(server[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"prompt": prompt, "n": 3, "use_beam_search": True, "logprobs": 2})
    assert bad.status_code == 400 and "beam search" in bad.json()["error"]["message"]
    assert wait_idle(server[1]).kv.pages_in_use == 0


def test_a_stalled_engine_is_reported_by_health_and_its_step_is_logged(caplog):
    """A step that does not return (a blocking read, as a FIFO in the tier directory once was):
    /health answered 200 throughout; now 503 past --health-stall-seconds, and the step that took
    too long is named in the log when it returns."""
    engine = AsyncEngine(LLMEngine(EngineConfig(model="random:tiny", max_num_seqs=4, kv_cache_memory=4 << 20,
                                                page_size=4096)), stall_seconds=0.5)
    real_step, release = engine.engine.step, threading.Event()

    def stuck_step(*args):
        release.wait(10)
        return real_step(*args)

    engine.engine.step = stuck_step
    app = build_app(engine, MODEL)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vkv") as c:
            healthy = await c.get("/health")
            pending = asyncio.create_task(c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}))
            await asyncio.sleep(1.2)
            stalled = await c.get("/health")
            release.set()
            done = await pending
            recovered = await c.get("/health")  # the loop goes round again: within a bound, not at once
            for _ in range(50):
                if recovered.status_code == 200:
                    break
                await asyncio.sleep(0.1)
                recovered = await c.get("/health")
            return healthy, stalled, done, recovered

    try:
        with caplog.at_level("WARNING", logger="vkv.server"):
            healthy, stalled, done, recovered = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert healthy.status_code == 200, healthy.text
    assert done.status_code == 200, done.text
    assert recovered.status_code == 200, recovered.text
    assert stalled.status_code == 503 and "no progress" in stalled.json()["error"]["message"]
    assert any("an engine step took" in r.getMessage() for r in caplog.records)


def test_a_failing_engine_fails_its_requests_and_reports_unhealthy():
    engine = AsyncEngine(LLMEngine(EngineConfig(max_num_seqs=4, kv_cache_memory=64 << 20)))
    real_step, calls = engine.engine.step, []

    def faulty_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated device fault")
        return real_step()

    engine.engine.step = faulty_step
    app = build_app(engine, MODEL)
    body = {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vkv") as c:
            stream = await c.post("/v1/completions", json=body | {"stream": True})
            return stream, await c.get("/health"), await c.post("/v1/completions", json=body)

    try:
        stream, health, after = asyncio.run(scenario())
    finally:
        engine.shutdown()
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert "simulated device fault" in events[-1]["error"]["message"]
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert health.status_code == 503 and after.status_code == 503
    assert "simulated device fault" in after.json()["error"]["message"]


def test_sigterm_lets_the_stream_in_flight_finish_then_stops_the_engine():
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--model", "random:tiny",
                             "--log-level", "warning", "--max-num-seqs", "4", "--shutdown-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 600, "temperature": 1.0, "seed": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # sampled: text (a chunk) most steps
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)  # mid-stream
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert events[-1] == "data: [DONE]" and len(events) > 100  # chunks kept coming after the signal
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["completion_tokens"] == 600  # the stream ran to its end after the signal (about 1 s)
    assert "KV memory released" in output, output
    assert proc.returncode == 0  # a clean shutdown on SIGTERM exits 0, as supervisors expect


def test_a_stream_longer_than_the_grace_period_ends_with_an_error_event_and_done():
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--model", "random:tiny",
                             "--log-level", "warning", "--shutdown-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:
                        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert events[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
    assert "KV memory released" in output, output


def test_chat_and_completion_logprobs_are_exact(client):
    for k in (1, 3):
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=k)
        for entry in chat.choices[0].logprobs.content:
            assert len(entry.top_logprobs) == k
            assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write 世界 twice."}],
                                          max_tokens=24, temperature=0, logprobs=True, top_logprobs=0)
    content = chat.choices[0].logprobs.content
    if chat.choices[0].finish_reason == "stop":
        content = content[:-1]  # the end-of-turn token, a special token the text leaves out
    assert bytes(b for e in content for b in e.bytes).decode() == chat.choices[0].message.content
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for offset, token in zip(lp.text_offset, lp.tokens):
        assert out.choices[0].text[offset:].startswith(token) or "\ufffd" in token


def test_echo_logit_bias_and_best_of_work(client):
    plain = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "The sky is" + plain.choices[0].text
    forced = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0,
                                       logit_bias={"1234": 100}, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 3
    from engine.models import load_tokenizer
    assert forced.choices[0].text == load_tokenizer(None).decode([1234] * 3)
    best = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=6, temperature=1.0,
                                     n=2, best_of=5, seed=11)
    assert sorted(c.index for c in best.choices) == [0, 1]
    assert best.usage.completion_tokens <= 5 * 6


def test_echo_with_logprobs_scores_the_prompt_as_the_engine_does(client):
    """lm-eval-harness's loglikelihood request: echo the prompt with its tokens' logprobs (the
    first has none), then the completion's; they equal the engine's prompt_logprobs."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    lp, text = out.choices[0].logprobs, out.choices[0].text
    from engine import LLM, SamplingParams
    with LLM(kv_cache_memory=16 << 20) as llm:
        want = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    n = len(want.prompt_token_ids)
    assert len(lp.tokens) == n + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(prompt_scores(want), abs=1e-4)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert text.startswith(prompt) and "".join(lp.tokens[:n]) == prompt
    assert lp.text_offset == sorted(lp.text_offset) and text[lp.text_offset[n]:].startswith(lp.tokens[n])


def test_best_of_returns_the_n_most_likely_samples():
    from engine import LLM, SamplingParams
    llm = LLM(max_num_seqs=8)
    best = llm.generate("My favourite animal is", SamplingParams(n=2, best_of=5, temperature=1.0, seed=11,
                                                                 max_tokens=6), use_tqdm=False)[0].outputs
    every = llm.generate("My favourite animal is", SamplingParams(n=5, temperature=1.0, seed=11, max_tokens=6,
                                                                  logprobs=0), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]


def test_structured_outputs_with_the_openai_client(client, server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city and its country as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    assert set(json.loads(chat.choices[0].message.content)) == {"city", "country"}
    assert chat.choices[0].finish_reason == "stop"
    ask = 'Output a JSON object with a key "answer" set to "yes".'
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                         max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": [" yes", " no"]}})
    assert choice.choices[0].text in (" yes", " no")
    regex = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=12, temperature=0,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", regex.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Is water wet? Answer:", max_tokens=5, temperature=0, stream=True,
        extra_body={"guided_choice": [" yes", " no"]}) if c.choices)
    assert streamed == choice.choices[0].text
    assert wait_idle(server[1]).kv.pages_in_use == 0


def test_token_bytes_are_the_tokens_own_bytes():
    from engine.models import load_tokenizer
    from engine.serving.api.token_text import TokenText

    tokenizer = load_tokenizer(None)
    text = "Größe: 世界 🎉 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = TokenText(tokenizer)
    assert any("\ufffd" in tokens.text(t) for t in ids)  # pieces of characters do not decode alone
    assert bytes(b for t in ids for b in tokens.bytes(t)).decode() == text


def test_sleep_drains_the_stream_in_flight_releases_the_kv_memory_and_wakes_up(client, server):
    import os
    url, engine = server
    headers = {"Authorization": f"Bearer {KEY}"}
    greedy = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    before = httpx.post(url + "/v1/completions", json=greedy, headers=headers, timeout=60).json()
    kv = engine.engine.kv
    committed = lambda: os.fstat(kv.pool.backend.fd).st_blocks * 512
    assert committed() >= 0.99 * (256 << 20)

    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=40, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the request is in flight when sleep is asked for
    asleep = {}
    asker = threading.Thread(target=lambda: asleep.update(httpx.post(url + "/sleep", headers=headers, timeout=60).json()))
    asker.start()
    for _ in range(100):  # sleep is pending: new requests are refused with 503 at once
        if httpx.get(url + "/is_sleeping", headers=headers).json()["is_sleeping"]:
            break
        time.sleep(0.02)
    refused = httpx.post(url + "/v1/completions", json=greedy, headers=headers, timeout=10)
    assert refused.status_code == 503 and "sleeping" in refused.json()["error"]["message"]
    rest = list(stream)  # ...and the one in flight still runs to its end
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in [first, *rest]) > 1
    asker.join(timeout=60)
    assert asleep == {"is_sleeping": True}
    assert committed() <= 0.2 * (256 << 20)  # the memfd's pages are punched out
    gauges = dict(line.rsplit(" ", 1) for line in httpx.get(url + "/metrics", headers=headers).text.splitlines()
                  if line.startswith(("vkv:pages_in_use ", "vkv:pages_free ", "vkv:asleep ", "vkv:kv_cache_usage_ratio ")))
    assert {k: float(v) for k, v in gauges.items()} == {"vkv:pages_in_use": 0, "vkv:pages_free": 0, "vkv:asleep": 1,
                                                         "vkv:kv_cache_usage_ratio": 0}, gauges
    level2 = httpx.post(url + "/sleep?level=2", headers=headers)  # the weights too: the RL flag's
    assert level2.status_code == 403 and "--enable-weight-updates" in level2.json()["error"]["message"]

    assert httpx.post(url + "/wake_up", headers=headers).json() == {"is_sleeping": False}
    assert not httpx.get(url + "/is_sleeping", headers=headers).json()["is_sleeping"]
    after = httpx.post(url + "/v1/completions", json=greedy, headers=headers, timeout=60).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    wait_idle(engine)


def test_a_wake_up_during_the_drain_calls_the_sleep_off(client, server):
    """The last command wins, and both answers tell the truth: the sleep asked while a stream
    was in flight answers {"is_sleeping": false} once the wake-up came, and nothing sleeps."""
    url, engine = server
    headers = {"Authorization": f"Bearer {KEY}"}
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    asleep = {}
    asker = threading.Thread(target=lambda: asleep.update(httpx.post(url + "/sleep", headers=headers, timeout=60).json()))
    asker.start()
    for _ in range(100):
        if httpx.get(url + "/is_sleeping", headers=headers).json()["is_sleeping"]:
            break
        time.sleep(0.02)
    assert httpx.post(url + "/wake_up", headers=headers).json() == {"is_sleeping": False}
    asker.join(timeout=60)
    assert asleep == {"is_sleeping": False}
    rest = list(stream)
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    assert not httpx.get(url + "/is_sleeping", headers=headers).json()["is_sleeping"] and not engine.engine.is_sleeping
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2},
                    headers=headers, timeout=60)
    assert ok.status_code == 200
    wait_idle(engine)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                   "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                               "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_calls_with_the_openai_client(client):
    """A forced call's arguments validate against its function's schema; "required" calls
    offered functions; a streamed call reassembles to the same call; a history with a tool
    result continues."""
    import jsonschema

    named = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=40,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    call, = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                              temperature=0, tool_choice="required")
    calls = required.choices[0].message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
    for c in calls:
        schema = (WEATHER if c.function.name == "get_weather" else TIME)["function"]["parameters"]
        jsonschema.validate(json.loads(c.function.arguments), schema)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=40,
                                                 temperature=0, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(call.function.name, json.loads(call.function.arguments))]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    scored = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**scored).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(**scored, stream=True) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]  # null before, though the unstreamed answer had them
    assert len(whole) == 8 and [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=12,
                                           temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_tool_calls_are_parsed_from_hermes_blocks():
    from engine.serving.api.tools import calls_in, render, tool_use

    use = tool_use([WEATHER], None, None)
    assert use.choice == "auto"
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "C"}}\n</tool_call>'
    content, calls = calls_in(text, use)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "unit": "C"}
    for unknown in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>not json</tool_call>"):
        assert calls_in(unknown, use) == (unknown, [])  # not a call to an offered function: left as text
    conversation, tools = render(ASK, use, template_takes_tools=False)
    assert tools is None and conversation[0]["role"] == "system" and "get_weather" in conversation[0]["content"]
    for bad, words in (([{"type": "function"}], r"tools\[0\]"), ([WEATHER, WEATHER], "twice")):
        with pytest.raises(ValueError, match=words):
            tool_use(bad, None, None)
    with pytest.raises(ValueError, match="not among the tools"):
        tool_use([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(ValueError, match="needs tools"):
        tool_use(None, "required", None)
    two = text + '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert len(calls_in(two, use)[1]) == 2
    content, calls = calls_in(two, tool_use([WEATHER], "auto", False))  # parallel_tool_calls: false
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Rome"] and content == "Let me check."
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    with pytest.raises(ValueError, match="strict function 'get_weather'.*under \"auto\""):
        tool_use([strict], None, None)
    assert tool_use([strict], "required", None).functions[0].strict  # enforced by the schema there
    with pytest.raises(ValueError, match="strict must be true or false"):
        tool_use([{"type": "function", "function": {**WEATHER["function"], "strict": "yes"}}], "required", None)


def test_echoed_offsets_and_top_logprobs_read_as_the_text_does():
    """A review's reproducers: with echo, a prompt token's offset summed each token's U+FFFD-laden
    text (not monotonic for an emoji prompt, 9 where ' is' begins at 3), and top_logprobs kept the
    last, least likely, of tokens that read alike."""
    from engine.models import load_tokenizer
    from engine.request.outputs import CompletionOutput, Logprob
    from engine.serving.api.token_text import TokenText

    tokenizer = load_tokenizer(None)
    text = TokenText(tokenizer)
    prompt = tokenizer.encode("🎉🎉🎉 is", add_special_tokens=False)
    empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offsets = text.echoed_logprobs([None] * len(prompt), prompt, empty, 6, 1)["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] == 3  # ' is' starts after the three emoji
    partial = [t for t in range(200, 260) if tokenizer.decode([t]) == "\ufffd"][:2]
    c = CompletionOutput(0, "x", [partial[0]], logprobs=[{partial[0]: Logprob(-0.1, 1), partial[1]: Logprob(-3.0, 2)}],
                         text_offsets=[0])
    assert text.completion_logprobs(c, 2)["top_logprobs"] == [{"\ufffd": -0.1}]
