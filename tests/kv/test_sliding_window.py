"""Sliding-window attention by unmapping: a Mistral-shaped checkpoint whose window is a few
pages long generates several windows' worth of tokens; greedy output equals transformers' on
every layout, and a long sequence's pages stay bounded by its window."""
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from helpers import assert_pool_whole, bundled_dir, hf_greedy

WINDOW = 40
MAX_NEW = 150  # almost four windows


def save_mistral(path, window: int, vocab: int = 49152, scale: float = 1.0):
    """A small Mistral checkpoint (random weights, matrices times `scale`) with the bundled
    model's tokenizer at path."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                           max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MistralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale if p.dim() > 1 else 1)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_dir() / name, path / name)
    return path


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    # larger weights than the init's: outputs that depend on the context
    return save_mistral(tmp_path_factory.mktemp("mistral-sw"), WINDOW, scale=8)


@pytest.fixture(scope="module")
def prompt():
    return list(range(1000, 1012))


@pytest.fixture(scope="module")
def reference(mistral_dir, prompt):
    return hf_greedy(mistral_dir, prompt, MAX_NEW)


def test_the_window_changes_the_output(mistral_dir, prompt, reference):
    """Guard: without the window the same weights generate something else, so the equality
    below could not hold by chance."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32, sliding_window=None).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    assert out[0, len(prompt):].tolist() != reference


@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_greedy_matches_transformers_over_several_windows(mistral_dir, prompt, reference, kv_layout):
    # 4 KiB pages: 8 tokens (interleaved), 32 tokens per region (per_layer); blocks of 8 tokens.
    # No prefix cache here: it would keep the pages that left the window (evictable) and blur
    # the bound on what the sequence itself maps.
    llm = LLM(model=str(mistral_dir), kv_layout=kv_layout, page_size=4096, block_size=8,
              kv_cache_memory=4 << 20, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert llm.stats().attention_backend == "sdpa"
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert out == reference
    kv = llm.engine.kv
    window_pages = len(kv.layout.page_range(0, WINDOW)) * kv.layout.num_regions
    chunk_pages = len(kv.layout.page_range(0, 16)) * kv.layout.num_regions  # one step writes up to 16 tokens
    assert llm.stats().kv.peak_pages_mapped <= window_pages + chunk_pages + kv.layout.num_regions, llm.stats().kv
    assert llm.stats().kv.peak_pages_mapped < kv.capacity.pages_for(len(prompt) + MAX_NEW)
    assert_pool_whole(llm)


def test_forks_and_prefix_hits_keep_working_with_the_window(mistral_dir, prompt, reference):
    llm = LLM(model=str(mistral_dir), kv_layout="interleaved", page_size=4096, kv_cache_memory=4 << 20,
              max_num_batched_tokens=16)
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    forks = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=3),
                         use_tqdm=False)
    assert all(c.token_ids == reference for o in first + forks for c in o.outputs)
    assert llm.stats().kv.prefix_cache_hits > 0
    assert_pool_whole(llm)


def test_swap_keeps_working_with_the_window(mistral_dir, prompt, reference):
    llm = LLM(model=str(mistral_dir), kv_layout="interleaved", page_size=4096, kv_cache_memory=30 * 4096,
              max_num_batched_tokens=16, preemption_mode="swap", swap_space=0.01)
    llm.engine.scheduler.swap_min_tokens = 1
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=3)
    outs = llm.generate([prompt, prompt], greedy, use_tqdm=False)
    assert all(c.token_ids == reference for o in outs for c in o.outputs)
    assert llm.stats().kv.swap_ins > 0
    assert_pool_whole(llm)


def test_a_sequence_preempted_with_drafts_comes_back_without_them(tmp_path):
    """Speculative drafts belong to the step a sequence was scheduled in: one preempted while
    holding them kept them, and the next update counted them off its computed tokens again, so
    it recomputed rows whose window pages were already unmapped (a segfault in attention)."""
    save_mistral(tmp_path, 16, vocab=64)
    prompts = [[21 + i, 7, 8, 9, 10, 11, 12] * 3 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(model=str(tmp_path), kv_layout="interleaved", page_size=4096, kv_cache_memory=64 * 4096) as roomy:
        want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(tmp_path), kv_layout="interleaved", page_size=4096, kv_cache_memory=13 * 4096,
             max_num_seqs=6, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                 "prompt_lookup_min": 1}) as llm:
        llm.engine.scheduler.swap_min_tokens = 1
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.stats().preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == want
        assert_pool_whole(llm)


def test_a_kernel_that_attends_to_everything_refuses_a_window():
    """The native step took a window and attended to the whole context (a review's reproducer:
    1.97 off sdpa's output); the engine runs windows on sdpa, a caller naming a kernel is told."""
    from engine.worker.attention import StepAttention
    with pytest.raises(ValueError, match="sliding window of 8 runs on sdpa"):
        StepAttention("native", [], [], None, None, window=8)


def test_a_pool_of_the_pages_the_check_counts_runs_every_prompt(tmp_path):
    """The live rows of a window and a chunk start anywhere in a page: they touch one page more
    than they fill. A pool of exactly the pages the admission check counted preempted a lone
    request for ever at some prompt lengths (a review's reproducer: window 42, chunks of 12)."""
    save_mistral(tmp_path, 42)
    opts = dict(model=str(tmp_path), kv_layout="interleaved", page_size=4096, max_num_batched_tokens=12,
                enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(kv_cache_memory=64 << 20, **opts) as roomy:
        pages = roomy.engine.processor.pages_needed(80)
        expected = {n: roomy.generate([list(range(5, 5 + n))], params, use_tqdm=False)[0].outputs[0].token_ids
                    for n in range(52, 76)}
    with LLM(kv_cache_memory=pages * 4096, **opts) as tight:
        engine = tight.engine
        for n, want in expected.items():
            engine.add_request(f"r{n}", list(range(5, 5 + n)), params)
            got, steps = None, 0
            while engine.has_unfinished() and steps < 300:
                got = next((o for o in engine.step() if o.finished), got)
                steps += 1
            assert got is not None and got.outputs[0].token_ids == want, (n, steps)
        assert_pool_whole(tight)
