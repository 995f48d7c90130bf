"""Multi-step decode (num_scheduler_steps, engine/core/multi_step.py): several greedy decode steps
in one native call change nothing a request gets. Greedy tokens are those of one step at a time
on every KV layout, in fp32 and in bf16, with stops by EOS, by stop token, by max_tokens and by
max_model_len, and under random traffic (arrivals, aborts, admission waits, preemption); a batch
with a row that needs Python between tokens runs one step at a time; the calls did run; and the
pool is whole afterwards."""
import functools

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import ext
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from helpers import assert_pool_whole, drive

pytestmark = pytest.mark.skipif(ext.cpu_kernels() is None, reason="multi-step decode runs the native kernels")

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4, 5,", "Once upon a time"]


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("layout,dtype", [("per_layer", "float32"), ("interleaved", "float32"),
                                          ("paged", "float32"), ("per_layer", "bfloat16")])
def test_greedy_tokens_are_those_of_single_steps(layout, dtype):
    one = LLM(kv_layout=layout, dtype=dtype)
    many = LLM(kv_layout=layout, dtype=dtype, num_scheduler_steps=8)
    for params in (SamplingParams(temperature=0, max_tokens=40),  # EOS may end some early
                   SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),  # not a multiple of 8
                   SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)):  # fewer than 8
        assert tokens(many, PROMPTS, params) == tokens(one, PROMPTS, params), params
    stats = many.stats()
    assert stats.multi_step_calls > 0 and stats.multi_step_decode_steps > 2 * stats.multi_step_calls, stats
    assert_pool_whole(many)


def test_stop_tokens_and_max_model_len_end_a_call_where_single_steps_end():
    one, many = LLM(max_model_len=64), LLM(max_model_len=64, num_scheduler_steps=8)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = tokens(one, PROMPTS[:1], greedy)[0]
    stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[first[11]])
    want = tokens(one, PROMPTS[:1], stop)
    assert tokens(many, PROMPTS[:1], stop) == want and len(want[0]) <= 12
    long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # up to max_model_len
    assert tokens(many, PROMPTS, long) == tokens(one, PROMPTS, long)
    assert_pool_whole(many)


def test_a_row_that_needs_python_between_tokens_keeps_its_batch_to_single_steps():
    one, many = LLM(), LLM(num_scheduler_steps=8)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for odd in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
                SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)):
        calls = many.stats().multi_step_calls
        got = many.generate(PROMPTS, [greedy, odd, greedy, greedy], use_tqdm=False)
        want = one.generate(PROMPTS, [greedy, odd, greedy, greedy], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], odd
        assert many.stats().multi_step_calls == calls, odd  # every step of this batch had the odd row
        assert got[1].outputs[0].logprobs == want[1].outputs[0].logprobs
    assert_pool_whole(many)


def test_num_scheduler_steps_is_checked_by_name():
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="num_scheduler_steps"):
            EngineConfig(model="random:tiny", num_scheduler_steps=bad)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(model="random:tiny", num_scheduler_steps=4, speculative_config={"method": "ngram"})


# -- under random traffic ---------------------------------------------------------------------

PAGE = 4096
PAGES = {"interleaved": 8, "per_layer": 12, "paged": 5}  # tight (the longest request needs 6, 8, 3): waits and preemption


@functools.cache
def tiny() -> tuple:
    """random:tiny (2 layers) and its tokenizer, loaded once; each engine gets fresh KV state."""
    engine = LLM(model="random:tiny", seed=0, kv_cache_memory=1 << 20).engine
    return engine.model, engine.tokenizer


@functools.cache
def alone(prompt: tuple[int, ...], max_tokens: int, stop: int | None) -> list[int]:
    """What the request gets by itself, one step at a time, in a roomy engine."""
    roomy = LLM.from_config(EngineConfig(model="random:tiny", kv_cache_memory=1 << 22, seed=0), tiny())
    return tokens(roomy, [list(prompt)], greedy(max_tokens, stop))[0]


def greedy(max_tokens: int, stop: int | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          stop_token_ids=[] if stop is None else [stop])


request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(3, 500), min_size=8, max_size=20).map(tuple),
    "max_tokens": st.integers(1, 24), "stop": st.none() | st.integers(3, 500),
    "arrive": st.integers(0, 6), "abort": st.none() | st.integers(0, 10)})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(layout=st.sampled_from(list(PAGES)), steps=st.integers(2, 8), seats=st.integers(1, 4),
       caching=st.booleans(), ahead=st.sampled_from([0, 4]), requests=st.lists(request, min_size=1, max_size=6))
def test_random_traffic_under_several_steps_a_call_gives_what_single_steps_give(layout, steps, seats, caching,
                                                                                 ahead, requests):
    pages = PAGES[layout] * (16 * 512 if layout == "paged" else PAGE)
    llm = LLM.from_config(EngineConfig(model="random:tiny", kv_layout=layout, page_size=PAGE, kv_cache_memory=pages,
                                       max_num_seqs=seats, enable_prefix_caching=caching, max_num_batched_tokens=32,
                                       map_ahead_tokens=ahead, num_scheduler_steps=steps, seed=0), tiny())
    add = lambda engine, request_id, r: engine.add_request(request_id, list(r["prompt"]),
                                                           greedy(r["max_tokens"], r["stop"]))
    done = drive(llm, requests, add)
    event(f"several decode steps a call: {llm.stats().multi_step_calls > 0}")
    event(f"preempted: {llm.stats().preemptions > 0}")
    for i, r in enumerate(requests):
        if r["abort"] is None:
            assert done[f"r{i}"].outputs[0].token_ids == alone(r["prompt"], r["max_tokens"], r["stop"]), r
    assert_pool_whole(llm)
    llm.engine.close()


def test_the_stage_clock_times_every_stage_of_the_steps_it_is_on_for_and_nothing_else():
    """decode_layers' stage clock (benchmarks/bench_decode_stages.py): off, it adds nothing; on,
    every stage of every step run gets time, the steps are counted, and a read with reset clears."""
    import torch
    llm = LLM(model="random:tiny", seed=0, kv_cache_memory=1 << 22, num_scheduler_steps=4)
    params = greedy(12, None)
    torch.ops.vkv.decode_stage_times(True)
    tokens(llm, [[5, 6, 7, 8]], params)
    assert set(torch.ops.vkv.decode_stage_times(True).values()) == {0.0}
    torch.ops.vkv.time_decode_stages(True)
    try:
        tokens(llm, [[5, 6, 7, 8]], params)
    finally:
        torch.ops.vkv.time_decode_stages(False)
    times = torch.ops.vkv.decode_stage_times(True)
    assert times.pop("steps") >= 11 and llm.stats().multi_step_calls > 0  # (the first token is the prompt's)
    times.pop("steps in one region")  # (tests/worker/test_cpu_paths.py counts those)
    assert set(times) == {"context prefetch", "norms", "qkv", "rope", "attention", "o", "gate_up", "down", "pick",
                          "next embedding"}
    assert all(us > 0 for us in times.values()), times
    assert set(torch.ops.vkv.decode_stage_times(False).values()) == {0.0}
