"""The admin routes against what runs beside them (a review's reproducers): a weights update
from disk answers a bad path with a 400, never a 500; with several models it checks the
checkpoint against every model before any takes it, and reads it off the engine's thread; a
sleep asked while generation is paused answers; a pause ends only the requests the engine had
(a stream registered meanwhile goes on after continue); a KV cap lowered after a request was
checked refuses it by name instead of stranding it; the front door answers deep JSON 400."""
import asyncio
import threading
import time

import httpx
import pytest
from helpers import async_engine, checkpoint, serving

from engine import SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.multi import MultiLLM
from engine.serving.loop.async_engine import AsyncEngine, RequestCancelled, Turns
from engine.serving.loop.metrics import Metrics
from engine.serving.options import ServerOptions
from engine.serving.api.server import build_app

OPTIONS = ServerOptions(enable_weight_updates=True, enable_sleep_routes=True)


def tiny() -> AsyncEngine:
    return async_engine(page_size=4096, max_model_len=256)


def test_bad_checkpoint_paths_are_400s_and_a_sleep_while_paused_answers(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    (tmp_path / "bad" / "model.safetensors").mkdir()
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00")
    engine = tiny()
    with serving(build_app(engine, "tiny", OPTIONS)) as base:
        for path in ("a" * 300, "/tmp/" + "b" * 5000, str(tmp_path / "bad"), "~no_such_user_xyz/ckpt"):
            r = httpx.post(base + "/update_weights_from_disk", json={"model_path": path}, timeout=30)
            assert r.status_code == 400, (path[:40], r.status_code, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.post(base + "/pause_generation", timeout=10).json() == {"paused": True, "mode": "abort"}
        assert httpx.post(base + "/sleep", timeout=10).json() == {"is_sleeping": True}
        assert httpx.post(base + "/wake_up", timeout=10).json() == {"is_sleeping": False}
        httpx.post(base + "/continue_generation", timeout=10)
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200


def test_several_models_take_an_update_all_or_none_read_off_the_engine_thread(tmp_path):
    checkpoint(tmp_path / "old", 0), checkpoint(tmp_path / "new", 1)
    group = MultiLLM({"a": str(tmp_path / "old"), "b": "random:qwen3-small"}, kv_cache_memory=16 << 20)
    metrics, turns = Metrics(list(group.engines), group.shared), Turns(group.shared_step_tokens)
    engines = {n: AsyncEngine(e, n, metrics, turns) for n, e in group.engines.items()}
    reader = []
    read = LLMEngine.read_weights_from_disk

    def where_read(self, path):
        reader.append(threading.current_thread().name)
        return read(self, path)

    LLMEngine.read_weights_from_disk = where_read
    try:
        with serving(build_app(engines, options=OPTIONS, group=group)) as base:
            r = httpx.post(base + "/update_weights_from_disk", json={"model_path": str(tmp_path / "new")}, timeout=60)
            assert r.status_code == 400 and "differ from the running model" in r.json()["error"]["message"]  # b refuses it
            assert [group.engines[n].weights_version for n in "ab"] == [0, 0]  # and a took nothing
            r = httpx.post(base + "/update_weights_from_disk", json={"model_path": str(tmp_path / "new"), "model": "a"},
                           timeout=60)
            assert r.status_code == 200 and group.engines["a"].weights_version == 1
        assert reader and not any("engine" in name for name in reader), reader
    finally:
        LLMEngine.read_weights_from_disk = read
        for e in engines.values():
            e.shutdown()
        group.close()


def test_a_pause_ends_the_engines_requests_and_not_a_stream_registered_meanwhile():
    engine = tiny()
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        running = engine.generate(engine.engine.process_inputs("old", [1, 2, 3], params))
        first = asyncio.ensure_future(running.__anext__())
        await first  # in the engine, producing tokens
        # a request whose stream is registered but whose Add is still queued behind the pause
        pause = asyncio.ensure_future(engine.pause_generation("abort"))
        late = engine.generate(engine.engine.process_inputs("late", [4, 5], SamplingParams(max_tokens=3)))
        got_late = asyncio.ensure_future(late.__anext__())
        await pause
        with pytest.raises(RequestCancelled):
            async for _ in running:
                pass
        await asyncio.sleep(0.2)
        assert not got_late.done()  # waits for continue_generation, not cancelled
        await engine.continue_generation()
        out = await asyncio.wait_for(got_late, 30)
        async for out in late:
            pass
        return out

    try:
        assert asyncio.run(run()).finished
    finally:
        engine.shutdown()


def test_a_cap_lowered_after_the_check_refuses_the_request_by_name():
    group = MultiLLM({"tiny": "random:tiny", "qwen": "random:qwen3-small"}, kv_cache_memory=16 << 20)
    try:
        e = group.engines["tiny"]
        request = e.process_inputs("r", list(range(1, 200)), SamplingParams(max_tokens=50, ignore_eos=True))
        group.set_limits("tiny", 0, 2 * group.shared.pool.page_size)
        with pytest.raises(ValueError, match="need .* KV pages, more than the whole KV budget of 2 pages"):
            group.add("tiny", request)
        assert not e.has_unfinished()
    finally:
        group.close()


def test_the_front_door_answers_deep_json_with_a_400():
    from engine.serving.dp.front_door import FrontDoor

    door = FrontDoor.__new__(FrontDoor)  # the parsing path only: no replicas behind it
    door.options = ServerOptions()

    class Body:
        headers = {}
        client = None

        async def body(self):
            return b"[" * 100_000 + b"]" * 100_000

    answer = asyncio.run(door.generate(Body(), "/v1/completions"))
    assert answer.status_code == 400 and b"nested too deep" in answer.body


def test_the_rl_routes_without_the_flag_are_403_with_or_without_a_body():
    """A pause with no body answered 400 "body: Field required" before the flag was checked."""
    engine = tiny()
    with serving(build_app(engine, "tiny", ServerOptions())) as base:
        for body in (None, {"mode": "retract"}, {"mode": "sideways"}, [1]):  # (a bad body too: the flag first)
            r = httpx.post(base + "/pause_generation", json=body, timeout=10)
            assert r.status_code == 403 and "--enable-weight-updates" in r.json()["error"]["message"]


def test_the_sleep_routes_need_their_flag_and_the_key():
    """POST /sleep (level 1) stopped a keyless server for anyone: vLLM keeps it behind its dev mode."""
    engine = tiny()
    with serving(build_app(engine, "tiny", ServerOptions())) as base:
        for path in ("/sleep", "/wake_up"):
            r = httpx.post(base + path, timeout=10)
            assert r.status_code == 404 and "--enable-sleep-routes" in r.json()["error"]["message"]
    with serving(build_app(tiny(), "tiny", ServerOptions(api_key="k", enable_sleep_routes=True))) as base:
        assert httpx.post(base + "/sleep", timeout=10).status_code == 401
        assert httpx.post(base + "/sleep", headers={"authorization": "Bearer k"}, timeout=30).json() == \
            {"is_sleeping": True}


def test_a_request_while_generation_is_paused_waits_its_bound_then_gets_a_503_with_retry_after():
    engine = tiny()
    options = ServerOptions(enable_weight_updates=True, pause_wait_seconds=0.5)
    with serving(build_app(engine, "tiny", options)) as base:
        assert httpx.post(base + "/pause_generation", json={"mode": "retract"}, timeout=10).status_code == 200
        began = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "paused" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
        assert time.monotonic() - began < 3
        waited = threading.Thread(target=lambda: answers.append(httpx.post(
            base + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=10)))
        answers = []
        waited.start()
        time.sleep(0.2)
        assert httpx.post(base + "/continue_generation", timeout=10).status_code == 200
        waited.join(timeout=10)
        assert answers[0].status_code == 200  # it went on within its bound
