"""Weights that sleep (engine/models/weight_pages.py, Note [Weights that sleep]): with sleep
mode, sleep(level=2) gives the weights' physical pages back (the pool's memfd holds nothing),
wake_up(tags=["weights"]) maps fresh ones at the same addresses (memory comes with the update that
writes them), the engine refuses to generate
until new weights are written whole, and then answers as before; over the host's pages and
CUDA's (the driver emulator where there is no GPU); over HTTP behind the flag; and under random
sequences of sleeps, wake-ups, updates and requests (hypothesis)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from helpers import SHAPE, assert_pool_whole, checkpoint, serving

from engine import LLM
from engine.config import EngineConfig
from engine.core.llm_engine import EngineSleeping
from engine.models import load_config, load_model
from engine.models.linear import Linear
from engine.models.weight_pages import WeightPages
from vmm.host import resident_bytes
from test_weights_update import GREEDY, PROMPTS, greedy


def weight_tensors(model) -> list[torch.Tensor]:
    """Every tensor an update writes (what WeightPages holds)."""
    found = []
    for m in model.modules():
        for t in (*m._parameters.values(), *(getattr(m, name, None) for name in ("panels", "pick", "pick_bounds", "pick_scales"))):
            if t is not None and t.numel() and not t.is_mkldnn:
                found.append(t)
    return found


def held_bytes(pages: WeightPages) -> int:
    """Physical bytes behind the weights' range now (mincore)."""
    return resident_bytes(pages.range.addr, pages.range.nbytes)


@pytest.mark.parametrize("layout,steps,dtype", [("per_layer", 1, "float32"), ("paged", 1, "float32"),
                                                ("per_layer", 8, "float32"), ("per_layer", 1, "bfloat16")])
def test_sleep_level_2_gives_the_weights_back_and_wakes_them_at_the_same_addresses(tmp_path, layout, steps, dtype):
    """(steps: multi-step decode, whose greedy pick's bf16 copy of the LM head sleeps and wakes too;
    bf16 on a CPU with native bf16: oneDNN's packed weights, dropped asleep and made by the update)"""
    checkpoint(tmp_path / "w", seed=1)
    with LLM(model=str(tmp_path / "w"), kv_layout=layout, kv_cache_memory=4 << 20, enable_sleep_mode=True,
             kv_offloading_size=0.01, num_scheduler_steps=steps, dtype=dtype) as llm:
        before = greedy(llm)
        model, pages = llm.engine.model, llm.engine.model.pages
        tensors = weight_tensors(model)
        addresses = [t.data_ptr() for t in tensors]
        assert all(pages.range.addr <= a < pages.range.addr + pages.range.nbytes for a in addresses)
        distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        assert pages.range.nbytes >= held_bytes(pages) >= sum(distinct.values())
        llm.sleep(2)
        assert held_bytes(pages) == 0 and llm.is_sleeping()
        with pytest.raises(EngineSleeping):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with pytest.raises(EngineSleeping, match="wake_up"):  # writing into pages that are not there
            llm.update_weights_from_disk(str(tmp_path / "w"))
        llm.wake_up(["weights"])
        assert held_bytes(pages) == 0 and llm.is_sleeping()  # nothing written yet; the KV cache still sleeps
        assert all(m.packed is None or m.packed.numel() == 0 for m in model.modules() if isinstance(m, Linear))
        llm.wake_up(["kv_cache"])
        with pytest.raises(EngineSleeping, match="empty"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="every weight"):  # empty weights take a whole update only
            llm.update_weights_from_tensor({"model.norm.weight": torch.ones(SHAPE["hidden_size"])})
        llm.update_weights_from_disk(str(tmp_path / "w"))
        assert [t.data_ptr() for t in tensors] == addresses
        assert pages.range.nbytes >= held_bytes(pages) >= sum(distinct.values())
        assert greedy(llm) == before
        assert all(m.packed is None or m.packed.numel() for m in model.modules() if isinstance(m, Linear))
        assert_pool_whole(llm)
        pages.pool.audit([pages.range])


def test_sleep_level_2_and_wake_tags_are_refused_by_name():
    with LLM(model="random:tiny", kv_cache_memory=1 << 20) as llm:
        with pytest.raises(ValueError, match="enable_sleep_mode"):
            llm.sleep(2)
        with pytest.raises(ValueError, match="sleep level 3"):
            llm.sleep(3)
        with pytest.raises(ValueError, match="'everything'"):
            llm.wake_up(["everything"])
        assert not llm.is_sleeping()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="random:tiny", enable_sleep_mode=True, tensor_parallel_size=2)


def test_weight_pages_over_each_backend_keep_addresses_and_take_new_values(backend):
    """Over the host's memfd pages and CUDA's (cuMemCreate/cuMemMap; the emulator here, whose
    device is the host's; a real GPU's pages take a model loaded on the GPU)."""
    model = load_model("random:tiny", load_config("random:tiny"), backend.device, torch.float32)
    tensors = weight_tensors(model)
    values = [t.clone() for t in tensors]
    pages = WeightPages(model, backend)
    addresses = [t.data_ptr() for t in tensors]
    assert all(pages.range.addr <= a < pages.range.addr + pages.range.nbytes for a in addresses)
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))  # moved, not changed
    pages.release()
    assert pages.asleep and pages.pool.asleep and not pages.range.mapped_pages()
    pages.restore()
    assert pages.empty and [t.data_ptr() for t in tensors] == addresses
    with torch.no_grad():
        for t, v in zip(tensors, values):
            t.copy_(v)
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    pages.pool.audit([pages.range])
    pages.close()
    backend.close()  # (its context: a test that counts the emulator's retains may run next in this worker)
    if backend.device.type != "cpu":  # weights elsewhere cannot move into the pages in place: refused by name
        on_host = load_model("random:tiny", load_config("random:tiny"), torch.device("cpu"), torch.float32)
        with pytest.raises(ValueError, match="load the model on the pages' device"):
            WeightPages(on_host, backend)


def test_over_http_level_2_is_behind_the_flag_and_the_weights_come_back_through_an_update(tmp_path):
    import httpx

    from engine.core.llm_engine import LLMEngine
    from engine.serving.loop.async_engine import AsyncEngine
    from engine.serving.options import ServerOptions
    from engine.serving.api.server import build_app

    checkpoint(tmp_path / "w", seed=2)
    ask = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    for flag in (False, True):  # (a server's end stops its engine: one each)
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tmp_path / "w"), kv_cache_memory=4 << 20,
                                                    enable_sleep_mode=True)))
        options = ServerOptions(api_key="k", enable_weight_updates=flag, enable_sleep_routes=True)
        with serving(build_app(engine, "m", options)) as base:
            with httpx.Client(base_url=base, headers={"Authorization": "Bearer k"}, timeout=60) as http:
                if not flag:
                    r = http.post("/sleep", params={"level": 2})
                    assert r.status_code == 403 and "--enable-weight-updates" in r.json()["error"]["message"]
                    assert http.post("/sleep", params={"level": 3}).status_code in (400, 422)
                    expected = http.post("/v1/completions", json=ask).json()["choices"][0]["text"]
                    continue
                assert http.post("/sleep", params={"level": 2}).json() == {"is_sleeping": True}
                assert http.post("/v1/completions", json=ask).status_code == 503
                r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "w")})
                assert r.status_code == 409 and "wake_up" in r.json()["error"]["message"]
                r = http.post("/wake_up", params={"tags": "sideways"})
                assert r.status_code == 400 and "sideways" in r.json()["error"]["message"]
                assert http.post("/wake_up", params={"tags": "weights"}).json() == {"is_sleeping": True}
                assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {"is_sleeping": False}
                r = http.post("/v1/completions", json=ask)
                assert r.status_code == 503 and "empty" in r.json()["error"]["message"]
                r = http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "w")})
                assert r.status_code == 200, r.text
                assert http.post("/v1/completions", json=ask).json()["choices"][0]["text"] == expected
        engine.shutdown()


OPS = st.lists(st.sampled_from(["sleep1", "sleep2", "wake", "wake_weights", "wake_kv", "load_a", "load_b",
                                "generate"]), min_size=1, max_size=10)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    checkpoint(root / "a", seed=3)
    checkpoint(root / "b", seed=4)
    expected = {}
    for name in ("a", "b"):
        with LLM(model=str(root / name), kv_cache_memory=2 << 20) as llm:
            expected[name] = greedy(llm)
    engine = LLM(model=str(root / "a"), kv_cache_memory=2 << 20, enable_sleep_mode=True)
    yield root, expected, engine
    engine.close()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=OPS)
def test_random_sleeps_wakes_and_updates_keep_the_invariants(two_checkpoints, ops):
    """After every operation: the weights hold memory for every tensor while loaded and none while
    asleep or woken empty; no tensor moves; a request is answered only when the KV cache and the weights are awake
    and loaded, and then exactly as a fresh engine on the loaded weights answers; an update
    into sleeping weights is refused; the KV pool is whole."""
    root, expected, llm = two_checkpoints
    pages = llm.engine.model.pages
    tensors = weight_tensors(llm.engine.model)
    addresses = [t.data_ptr() for t in tensors]
    least = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    llm.wake_up()
    if pages.empty:
        llm.update_weights_from_disk(str(root / "a"))
    loaded = "a" if greedy(llm) == expected["a"] else "b"
    for op in ops:
        weights_asleep, empty = pages.asleep, pages.empty
        if op.startswith("sleep"):
            llm.sleep(int(op[-1]))
        elif op.startswith("wake"):
            llm.wake_up({"wake": None, "wake_weights": ["weights"], "wake_kv": ["kv_cache"]}[op])
        elif op.startswith("load"):
            if weights_asleep:
                with pytest.raises(EngineSleeping):
                    llm.update_weights_from_disk(str(root / op[-1]))
            else:
                llm.update_weights_from_disk(str(root / op[-1]))
                loaded = op[-1]
        elif llm.is_sleeping() or empty:
            with pytest.raises(EngineSleeping):
                llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        else:
            assert greedy(llm) == expected[loaded]
        held = held_bytes(pages)
        assert held == 0 if pages.asleep or pages.empty else pages.range.nbytes >= held >= least
        assert [t.data_ptr() for t in tensors] == addresses
        if not llm.engine.kv_memory.asleep:
            assert_pool_whole(llm)


def test_a_wake_up_without_memory_fails_clearly_and_leaves_the_weights_asleep():
    """cuMemCreate out of memory midway through restore (the driver emulator): the error comes
    out, the pages made so far go back, the weights stay asleep, and a later wake-up works."""
    from conftest import cuda_unavailable, make_cuda_backend
    if cuda_unavailable():
        pytest.skip(f"no CUDA backend: {cuda_unavailable()}")
    from cuda_emulator import counts, fail
    model = load_model("random:tiny", load_config("random:tiny"), torch.device("cpu"), torch.float32)
    backend = make_cuda_backend()
    pages = WeightPages(model, backend)
    pages.release()
    before = counts().allocations
    fail("cuMemCreate", 2)
    with pytest.raises(Exception, match="OUT_OF_MEMORY|out of memory"):
        pages.restore()
    assert pages.asleep and counts().allocations == before and not pages.range.mapped_pages()
    pages.restore()
    assert pages.empty
    pages.pool.audit([pages.range])
    pages.close()
    backend.close()  # (its context: a test that counts the emulator's retains may run next in this worker)
