"""The engine's greedy tokens equal transformers' on the same weights, whatever the KV layout,
batching, chunking or memory pressure (the bundled GGUF dequantized, as transformers loads it; its
blocks against the dequantized model: test_gguf_blocks.py)."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.request.outputs import top_of
from helpers import PROMPTS, assert_pool_whole, bundled_dir, hf_greedy

MAX_NEW = 16
QUANTIZATION = "dequantize"  # (the bundled GGUF's weights as transformers loads them: fp32)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def prompt_ids():
    from engine.models import load_tokenizer
    tok = load_tokenizer(None)
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(prompt_ids):
    return [hf_greedy(bundled_dir(), ids, MAX_NEW) for ids in prompt_ids]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_greedy_matches_transformers(kv_layout, prefix_caching, prompt_ids, reference):
    llm = LLM(quantization=QUANTIZATION, kv_layout=kv_layout, enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(llm)


def test_prompt_logprobs_equal_transformers_in_chunks_and_never_come_from_the_cache(prompt_ids):
    """prompt_logprobs (vLLM's): per prompt token, its logprob given the tokens before it and
    the k most likely there, computed in chunks of 8 tokens; a prompt whose pages are cached
    is computed again (a cached page has no logits), and preemption writes no token twice."""
    from helpers import hf_model
    model = hf_model(bundled_dir())
    llm = LLM(quantization=QUANTIZATION, kv_cache_memory=90 * 65536, max_num_seqs=6, max_num_batched_tokens=8, page_size=4096)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, prompt_logprobs=2)
    for _ in range(2):  # the second finds its pages cached
        llm.generate(prompt_ids[4], GREEDY, use_tqdm=False)
    hits = llm.stats().kv.prefix_cache_hits
    assert hits > 0
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    assert llm.stats().kv.prefix_cache_hits == hits and llm.stats().preemptions > 0
    for ids, out in zip(prompt_ids, outs):
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        top = lp.topk(2)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i, record in enumerate(out.prompt_logprobs[1:]):
            assert next(iter(record)) == ids[i + 1]  # (vLLM's order: the position's own token first)
            assert record[ids[i + 1]].logprob == pytest.approx(float(lp[i, ids[i + 1]]), abs=2e-4)
            assert [t for t, _ in top_of(record, 2)] == top.indices[i].tolist()
            mine = float(lp[i, ids[i + 1]])  # its rank in the whole vocabulary, ties against it (vLLM's)
            assert int((lp[i] > mine + 2e-4).sum()) + 1 <= record[ids[i + 1]].rank <= int((lp[i] >= mine - 2e-4).sum())
    assert_pool_whole(llm)


@pytest.mark.parametrize("kv_layout", ["interleaved", "paged"])
def test_preemption_under_a_tiny_budget_changes_nothing(kv_layout, prompt_ids, reference):
    # 90 pages of 64 KiB (1.4 interleaved fp32 tokens each; paged: 16-token blocks of the same
    # bytes) hold about two of these sequences at once.
    llm = LLM(quantization=QUANTIZATION, kv_layout=kv_layout, kv_cache_memory=90 * 65536, max_num_seqs=6)
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    stats = llm.stats()
    assert stats.preemptions > 0, stats
    assert stats.kv.peak_pages_mapped <= stats.kv.pages_total
    assert_pool_whole(llm)


@pytest.mark.parametrize("kv_layout, page_size, num_pages", [("interleaved", 65536, 90), ("per_layer", 4096, 600)])
def test_preemption_by_swap_changes_nothing(kv_layout, page_size, num_pages, prompt_ids, reference, tmp_path):
    # As above (per_layer: 10 pages of 5 tokens per region), but preempted sequences keep
    # their KV in a swap file and come back to the same virtual addresses.
    swap_file = tmp_path / "swap"
    llm = LLM(quantization=QUANTIZATION, kv_layout=kv_layout, kv_cache_memory=num_pages * page_size, page_size=page_size, max_num_seqs=6,
              preemption_mode="swap", swap_space=0.25, swap_path=str(swap_file))
    llm.engine.scheduler.swap_min_tokens = 1  # these prompts are short: swap every preempted one
    assert swap_file.exists()
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    kv = llm.stats().kv
    assert kv.swap_outs > 0 and kv.swap_ins == kv.swap_outs, kv
    assert 0 < kv.swap_bytes_in <= kv.swap_bytes_out  # a page still in the prefix cache comes back uncopied
    assert_pool_whole(llm)
    llm.engine.close()
    assert not swap_file.exists()


def test_chunked_prefill_and_small_steps_change_nothing(prompt_ids, reference):
    llm = LLM(quantization=QUANTIZATION, kv_layout="per_layer", max_num_batched_tokens=7, max_num_seqs=3)
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_pool_whole(llm)


FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_families_match_transformers(family, tmp_path):
    import transformers
    cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    prompts = [[5, 17, 99, 2048], [7] * 11, list(range(100, 133))]
    want = [hf_greedy(str(tmp_path), p, 12) for p in prompts]
    llm = LLM(model=str(tmp_path), kv_layout="per_layer")
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert_pool_whole(llm)
