"""An fp8 KV cache (kv_cache_dtype, vLLM's names) on the bundled model: a quarter of fp32's
bytes per token, held to the full-precision cache by the format's tolerance on every layout
and kernel (teacher-forced logprobs, tests/lossy.py), the same tokens up to a near tie through
every way a page is reused (prefix caching, forks), and
refused by name where a kernel cannot read it. The kernels themselves are held to their
references in test_kernels.py; random traffic over fp8 caches runs in test_engine_property.py."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.attention import pick_attention
from engine.config import EngineConfig
from helpers import PROMPTS, assert_pool_whole
from lossy import (Tolerance, assert_agree_until_a_near_tie, assert_close, continuations, greedy_with_gaps,
                   teacher_forced)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# 4 KiB pages: all 6 prompts fit at once; the weights in fp32, as the tolerances assume (over GGUF
# blocks, x rounded to int8 in every layer adds its own error to the cache's)
SMALL = dict(kv_cache_memory=16 << 20, max_num_seqs=8, page_size=4096, quantization="dequantize")
E4M3 = Tolerance.stored(torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def reference():
    """The full-precision cache's greedy continuations of PROMPTS, and its own teacher-forced
    scores of them: what every fp8 cache is held to (tests/lossy.py)."""
    with LLM(**SMALL) as llm:
        sequences = continuations(llm, PROMPTS, GREEDY.max_tokens)
        first = [len(s) - GREEDY.max_tokens for s in sequences]
        return sequences, first, teacher_forced(llm, sequences, first)


def scored(options: dict, reference) -> list:
    sequences, first, _ = reference
    with LLM(**options, **SMALL) as llm:
        got = teacher_forced(llm, sequences, first)
        assert_pool_whole(llm)
        return got


def test_fp8_stores_a_quarter_of_fp32s_bytes_per_token():
    for layout in ("per_layer", "interleaved", "paged"):
        tiny = dict(model="random:tiny", kv_layout=layout, **SMALL)
        with LLM(**tiny) as full, LLM(kv_cache_dtype="fp8_e5m2", **tiny) as fp8:
            assert fp8.engine.kv.layout.token_bytes * 4 == full.engine.kv.layout.token_bytes, layout
            assert {c.dtype for c in fp8.engine.kv.layout.k_caches + fp8.engine.kv.layout.v_caches} == {torch.float8_e5m2}


@pytest.mark.parametrize("name, dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_stays_close_to_the_full_precision_cache(name, dtype, reference):
    """Each fp8 format, teacher-forced on the full-precision cache's continuations: logprobs
    within the format's tolerance and the same top token wherever there is no near tie. A cache
    that decoded wrongly moves logprobs by nats."""
    with LLM(kv_cache_dtype=name, **SMALL) as llm:
        assert llm.engine.platform()["kv_dtype"] == str(dtype).removeprefix("torch.")
    print(name, assert_close(scored(dict(kv_cache_dtype=name), reference), reference[2], Tolerance.stored(dtype)))


@pytest.mark.parametrize("layout, kernel", [("interleaved", None), ("paged", None), ("per_layer", "sdpa")])
def test_every_layout_and_the_reference_kernel_stay_as_close_in_fp8(layout, kernel, reference):
    """Every layout stores the same bytes for the same K and V, and sdpa decodes fp8 with
    torch's own conversion; their kernels sum attention in different orders, so each is held to
    the full-precision cache by e4m3's tolerance, not to another fp8 run token for token."""
    got = scored(dict(kv_layout=layout, kv_cache_dtype="fp8", attention_backend=kernel), reference)
    print(layout, kernel, assert_close(got, reference[2], E4M3))


def test_reused_fp8_pages_give_the_tokens_computing_them_gives():
    """A cached prefix and n > 1 siblings forked from one prompt read the fp8 bytes they would
    have written themselves (swapping fp8 pages out and back, and the KV tiers, run in
    test_engine_property's random traffic and test_kv_tiers). A step of another batch shape
    rounds its fp32 sums otherwise, which can tip a stored value to the neighbouring fp8 one, so
    the tokens agree up to a near tie (tests/lossy.py), not necessarily to the last."""
    prompts = ["You are a careful assistant who answers briefly. " * 6 + p for p in PROMPTS]  # whole cached pages
    with LLM(kv_cache_dtype="fp8", **SMALL) as llm:
        computed = greedy_with_gaps(llm, prompts, GREEDY)
        cached = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.stats().kv.prefix_cache_hits > 0
        print("cached", assert_agree_until_a_near_tie(cached, computed, E4M3.token))
        forked = llm.generate(prompts[:2], SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True),
                              use_tqdm=False)
        for r in forked:
            assert len({tuple(o.token_ids) for o in r.outputs}) == 1  # siblings read the same shared pages
        print("forked", assert_agree_until_a_near_tie([r.outputs[0].token_ids for r in forked], computed[:2],
                                                      E4M3.token))
        assert_pool_whole(llm)


def test_kv_cache_dtypes_are_checked_and_gpu_kernels_refuse_fp8_by_name():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="fp8").kv_dtype == torch.float8_e4m3fn
    assert EngineConfig(kv_cache_dtype="auto", dtype="bfloat16").kv_dtype == torch.bfloat16
    for kernel in ("flash", "flash-attn"):
        with pytest.raises(ValueError, match="not float8_e4m3fn \\(kv_cache_dtype\\): that cache runs on sdpa"):
            pick_attention(kernel, torch.device("cuda"), torch.bfloat16, "per_layer", 64, 256, None,
                           torch.float8_e4m3fn)
    assert pick_attention(None, torch.device("cpu"), torch.float32, "per_layer", 64, kv_dtype=torch.float8_e5m2).name \
        in ("native", "sdpa")
