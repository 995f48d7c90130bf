"""Prefix caching, parallel sampling and copy-on-write on the real model."""
import pytest
import torch

from engine import LLM, SamplingParams
from helpers import assert_pool_whole

SYSTEM = ("You are a meticulous assistant for a railway company. Answer questions about timetables, "
          "tickets, delays, refunds, luggage and accessibility. Be brief and exact. ") * 16
QUESTIONS = ["When does the first train leave?", "Can I bring a bicycle?", "How do refunds work?",
             "Is there step-free access?", "What if my train is late?", "Are dogs allowed?"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_shared_prefix_maps_fewer_pages_and_changes_nothing(kv_layout):
    results = {}
    for caching in (False, True):
        llm = LLM(kv_layout=kv_layout, enable_prefix_caching=caching, max_num_seqs=8,
                  max_num_batched_tokens=2048)
        llm.generate(SYSTEM + QUESTIONS[0], GREEDY, use_tqdm=False)  # warms the cache when on
        outs = llm.generate([SYSTEM + q for q in QUESTIONS[1:]], GREEDY, use_tqdm=False)
        results[caching] = ([o.outputs[0].token_ids for o in outs], llm.stats())
        assert_pool_whole(llm)
    (plain, off), (cached, on) = results[False], results[True]
    assert cached == plain
    system_tokens = len(llm.tokenizer.encode(SYSTEM))
    assert on["prefix_cache_hits"] >= 0.8 * system_tokens * (len(QUESTIONS) - 1)
    assert on["peak_pages_mapped"] < 0.6 * off["peak_pages_mapped"], (on, off)
    assert off["prefix_cache_hits"] == 0


def test_parallel_samples_share_the_prompt_and_copy_its_last_page():
    llm = LLM(kv_layout="interleaved", enable_prefix_caching=False)
    prompt = SYSTEM + QUESTIONS[0]
    one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    many = llm.generate(prompt, SamplingParams(n=4, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert all(o.token_ids == one.outputs[0].token_ids for o in many.outputs)
    stats = llm.stats()
    assert stats["cow_copies"] >= 3  # each sibling copies the shared last prompt page once
    seeded = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False)[0]
    for i, o in enumerate(seeded.outputs):
        alone = llm.generate(prompt, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6), use_tqdm=False)[0]
        assert o.token_ids == alone.outputs[0].token_ids
    assert_pool_whole(llm)


@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_parallel_sampling_peak_pages_below_independent_sequences(kv_layout):
    prompt = SYSTEM + QUESTIONS[2]
    peaks = {}
    for shared in (True, False):
        llm = LLM(kv_layout=kv_layout, enable_prefix_caching=False)
        params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=4)
        if shared:
            llm.generate(prompt, params, use_tqdm=False)
        else:  # four independent requests: nothing shared
            llm.generate([prompt] * 4, SamplingParams(temperature=0.8, seed=1, max_tokens=4), use_tqdm=False)
        peaks[shared] = llm.stats()["peak_pages_mapped"]
        assert_pool_whole(llm)
    assert peaks[True] < 0.5 * peaks[False], peaks

