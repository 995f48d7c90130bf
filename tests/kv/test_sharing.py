"""Prefix caching, parallel sampling, beam search and copy-on-write: page accounting on SmolLM2's
KV geometry (helpers.NARROW), beam search against transformers on SmolLM2 itself."""
import pytest
import torch

from engine import LLM, SamplingParams
from helpers import NARROW, assert_pool_whole

SYSTEM = ("You are a meticulous assistant for a railway company. Answer questions about timetables, "
          "tickets, delays, refunds, luggage and accessibility. Be brief and exact. ") * 8
QUESTIONS = ["When does the first train leave?", "Can I bring a bicycle?", "How do refunds work?",
             "Is there step-free access?", "What if my train is late?", "Are dogs allowed?"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_shared_prefix_maps_fewer_pages_and_changes_nothing(kv_layout):
    results = {}
    for caching in (False, True):
        llm = LLM(model=NARROW, kv_layout=kv_layout, enable_prefix_caching=caching, max_num_seqs=8,
                  max_num_batched_tokens=2048)
        llm.generate(SYSTEM + QUESTIONS[0], GREEDY, use_tqdm=False)  # warms the cache when on
        outs = llm.generate([SYSTEM + q for q in QUESTIONS[1:]], GREEDY, use_tqdm=False)
        results[caching] = ([o.outputs[0].token_ids for o in outs], llm.stats())
        assert_pool_whole(llm)
    (plain, off), (cached, on) = results[False], results[True]
    assert cached == plain
    system_tokens = len(llm.tokenizer.encode(SYSTEM))
    assert on.kv.prefix_cache_hits >= 0.8 * system_tokens * (len(QUESTIONS) - 1)
    assert on.kv.peak_pages_mapped < 0.6 * off.kv.peak_pages_mapped, (on, off)
    assert off.kv.prefix_cache_hits == 0


@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_a_prefix_that_ends_inside_a_page_is_a_hit_to_the_token(kv_layout):
    """A cached page whose first rows are the prompt's next tokens is copied (copy-on-write of a
    partial page), not computed; greedy text equals computing it."""
    tokens = [(i * 37) % 5000 + 100 for i in range(400)]
    prompts = [tokens[:300], tokens[:217] + [7, 8, 9, 10], tokens[:123], tokens[:40] + [11, 12]]
    results = {}
    for caching in (False, True):
        with LLM(model=NARROW, kv_layout=kv_layout, enable_prefix_caching=caching, max_num_seqs=4) as llm:
            llm.generate([prompts[0]], GREEDY, use_tqdm=False)  # computed whole (and cached, when on)
            outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts[1:]]
            results[caching] = [o.outputs[0].token_ids for o in outs]
            cached = [o.num_cached_tokens for o in outs]
            partial = llm.stats().kv.prefix_cache_partial_hits
            assert_pool_whole(llm)
    assert results[True] == results[False]
    # every matched token (of the 123-token prompt, all but the last: its logits are computed), less
    # one where the last matched token's row runs on into the next page (interleaved rows straddle pages)
    for got, matched in zip(cached, [217, 122, 40]):
        assert matched - 1 <= got <= matched, cached
    assert partial > 0 or kv_layout == "interleaved"  # (an interleaved 64 KiB page holds 1.4 tokens: whole pages suffice)


def test_parallel_samples_share_the_prompt_and_copy_its_last_page():
    llm = LLM(model=NARROW, kv_layout="interleaved", enable_prefix_caching=False)
    prompt = SYSTEM + QUESTIONS[0]
    one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    many = llm.generate(prompt, SamplingParams(n=4, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert all(o.token_ids == one.outputs[0].token_ids for o in many.outputs)
    stats = llm.stats()
    assert stats.kv.cow_copies >= 3  # each sibling copies the shared last prompt page once
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
        llm = LLM(model=NARROW, kv_layout=kv_layout, enable_prefix_caching=False)
        params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=4)
        if shared:
            llm.generate(prompt, params, use_tqdm=False)
        else:  # four independent requests: nothing shared
            llm.generate([prompt] * 4, SamplingParams(temperature=0.8, seed=1, max_tokens=4), use_tqdm=False)
        peaks[shared] = llm.stats().kv.peak_pages_mapped
        assert_pool_whole(llm)
    assert peaks[True] < 0.5 * peaks[False], peaks



def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def hf_beam_search(prompt_ids: list[int], width: int, max_new_tokens: int, eos_id: int, length_penalty: float):
    """transformers' num_beams on the same weights: (tokens up to the first EOS, score) per beam."""
    from helpers import bundled_dir, hf_model

    with torch.no_grad():
        ref = hf_model(bundled_dir()).generate(
            torch.tensor([prompt_ids]), num_beams=width, num_return_sequences=width, do_sample=False,
            max_new_tokens=max_new_tokens, early_stopping=False, length_penalty=length_penalty,
            output_scores=True, return_dict_in_generate=True)
    beams = []
    for row, score in zip(ref.sequences, ref.sequences_scores):
        tokens = row[len(prompt_ids):].tolist()
        end = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)  # the rest is padding
        beams.append((tokens[:end], float(score)))
    return beams


@pytest.mark.parametrize("kv_layout,length_penalty", [("interleaved", 1.0), ("paged", 2.0)])
def test_beam_search_matches_transformers_and_releases_every_page(kv_layout, length_penalty):
    from engine import BeamSearchParams

    llm = LLM(kv_layout=kv_layout, quantization="dequantize")  # (transformers: the GGUF in fp32)
    questions = ["What is 2+2? Reply with one number.", "Say hi.", "Name a primary color in one word."]
    prompts = [chat_prompt_ids(llm.tokenizer, q) for q in questions]
    width, steps = 3, 20
    outs = llm.beam_search(prompts, BeamSearchParams(width, steps, length_penalty=length_penalty))
    reasons = set()
    for ids, out in zip(prompts, outs):
        reference = hf_beam_search(ids, width, steps, llm.engine.eos_ids[0], length_penalty)
        assert [s.tokens[len(ids):] for s in out.sequences] == [tokens for tokens, _ in reference]
        assert [s.score for s in out.sequences] == pytest.approx([score for _, score in reference], rel=1e-5)
        reasons |= {s.finish_reason for s in out.sequences}
    assert reasons == {"stop", "length"}  # beams that ended on EOS and beams cut at max_tokens
    assert llm.stats().kv.cow_copies > 0  # beams forked, then diverged inside a shared page
    assert_pool_whole(llm)


def test_beams_and_plain_requests_under_memory_pressure_change_nothing():
    from engine import BeamSearchParams

    roomy = LLM(model=NARROW, kv_layout="interleaved")
    prompts = [chat_prompt_ids(roomy.tokenizer, q) for q in ("Say hi.", "Tell me a joke.", "What is rain?")]
    beam, greedy = BeamSearchParams(beam_width=3, max_tokens=12), SamplingParams(temperature=0, max_tokens=12)
    want_beams = roomy.beam_search(prompts[:2], beam)
    want_plain = roomy.generate(prompts, greedy, use_tqdm=False)
    # 118 pages of 64 KiB and three seats: one beam group at a time, beams preempted and requeued.
    tight = LLM(model=NARROW, kv_layout="interleaved", kv_cache_memory=118 * 65536, max_num_seqs=3)
    engine, done = tight.engine, {}
    engine.add_request("beam-0", prompts[0], beam)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"plain-{i}", prompt, greedy)
    engine.add_request("beam-1", prompts[1], beam)
    for _ in range(2000):
        done |= {out.request_id: out for out in engine.step() if out.finished}
        if not engine.has_unfinished():
            break
    assert [[s.tokens for s in done[f"beam-{i}"].sequences] for i in range(2)] == \
        [[s.tokens for s in o.sequences] for o in want_beams]
    assert [done[f"plain-{i}"].outputs[0].token_ids for i in range(3)] == [o.outputs[0].token_ids for o in want_plain]
    assert tight.stats().preemptions > 0
    assert_pool_whole(tight)


def test_beams_share_the_prompt_pages():
    from engine import BeamSearchParams

    prompt = SYSTEM + QUESTIONS[3]
    beams = LLM(model=NARROW, kv_layout="interleaved", enable_prefix_caching=False)
    beams.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))
    alone = LLM(model=NARROW, kv_layout="interleaved", enable_prefix_caching=False)
    alone.generate([prompt] * 4, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert beams.stats().kv.peak_pages_mapped < 0.5 * alone.stats().kv.peak_pages_mapped
    assert_pool_whole(beams)


def test_beam_search_refuses_what_it_cannot_run():
    from engine import BeamSearchParams

    llm = LLM(model=NARROW, max_num_seqs=4)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_num_seqs"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=10**6))
    assert llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences
    assert_pool_whole(llm)


def test_a_prompt_that_fits_alone_runs_when_its_cached_prefix_would_cost_a_page_too_many():
    """A review's reproducer hung the engine for good: the cached first page's last row runs into
    the next page, so the hit needs a private copy of a page while the cache keeps the original:
    more pages than the prompt needs computed. Alone, it is now computed without the hit."""
    import random
    import threading

    page = 64 << 10  # per_layer over SmolLM2's KV geometry: 85.3 rows a page
    opts = dict(model=NARROW, kv_layout="per_layer", max_num_seqs=4, max_model_len=512,
                kv_cache_memory=200 * page, page_size=page)
    prompt = random.Random(7).sample(range(100, 5000), 200)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(enable_prefix_caching=False, **opts) as llm:
        assert llm.engine.kv.capacity.pages_for(200) <= 200 < llm.engine.kv.capacity.pages_for(200) + 2 * 30  # the case: tight
        expected = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(**opts) as llm:
        llm.generate([prompt[:86]], params, use_tqdm=False)  # caches the first page
        done = []
        worker = threading.Thread(target=lambda: done.append(llm.generate([prompt], params, use_tqdm=False)),
                                  daemon=True)
        worker.start()
        worker.join(60)
        assert done, "the engine spun on the request for 60 s"
        assert done[0][0].outputs[0].token_ids == expected
        assert_pool_whole(llm)
