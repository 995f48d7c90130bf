"""Schemathesis against the server's own OpenAPI schema (in process, no network): valid and
invalid requests to every route, generated from the schema. None may answer 5xx, every
refusal carries OpenAI's error object, and the engine is alive at the end. The model is
`random:tiny` with a short max_model_len, so every accepted request finishes quickly."""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.serving.async_engine import AsyncEngine
from engine.serving.options import ServerOptions
from engine.serving.server import build_app


@pytest.fixture()
def tiny_engine():
    engine = AsyncEngine(LLMEngine(EngineConfig(model="random:tiny", max_num_seqs=8, kv_cache_memory=16 << 20,
                                                page_size=4096, max_model_len=48)))
    yield engine
    engine.shutdown()


@pytest.fixture()
def api_schema(tiny_engine):
    app = build_app(tiny_engine, "tiny", ServerOptions(max_prompts_per_request=8, max_n=4))
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error(api_schema, tiny_engine, mode):
    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=api_schema.as_strategy(generation_mode=mode))
    def check(case):
        assert tiny_engine.dead is None, ("the engine died after these requests:", sent[-12:])
        response = case.call()
        sent.append((case.method, case.path, case.body, response.status_code))
        assert response.status_code < 500, (case.method, case.path, case.body, response.status_code,
                                            response.text[:300])
        if response.status_code >= 400:
            assert response.json()["error"]["message"], response.text[:300]
        assert tiny_engine.dead is None, ("the engine died after these requests:", sent[-12:])

    sent = []  # every request of the run, in order: the engine lives across them

    check()
    assert not tiny_engine.streams
