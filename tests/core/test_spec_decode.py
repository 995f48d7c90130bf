"""Speculative decoding with n-gram proposals changes nothing a request gets: greedy tokens are
identical with and without it (every layout, prefix caching on, under preemption), sampled
tokens follow the model's distribution exactly; and priority scheduling serves urgent
requests first without changing anyone's output."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.request.sequence import Sequence
from engine.sample.spec_decode import NgramProposer, SpeculativeConfig, verify
from helpers import assert_pool_whole

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree while the fox "
           "runs through the tall green grass toward the river.")
PROMPTS = [f"Repeat the following text exactly.\n\n{PASSAGE}\n\n{PASSAGE[:40]}",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "The capital of France is"]


def test_the_ngram_proposer_continues_the_latest_earlier_occurrence():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2,
                                                prompt_lookup_min=1))
    seq = Sequence("r", 0, [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7], SamplingParams(), 0.0)
    assert proposer.propose(seq, 10) == [2, 3, 6]  # "6 7" last seen before the end at 6-7: then 2 3 6
    assert proposer.propose(seq, 2) == [2, 3]
    seq.token_ids += [4]
    assert proposer.propose(seq, 10) == []  # "7 4" and "4" never occurred before
    seq.token_ids += [5]
    assert proposer.propose(seq, 10) == [6, 7, 8]  # "4 5": no; "5": at 0


def test_lookup_lengths_default_as_in_vllm():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(prompt_lookup_min=2).prompt_lookup_max == 2


def test_no_drafts_once_the_batch_reaches_disable_by_batch_size():
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    busy = LLM(speculative_config=SPEC | {"disable_by_batch_size": 4})
    busy.generate(PROMPTS, greedy, use_tqdm=False)  # four at once: never drafts
    assert busy.stats().spec_drafts == 0
    busy.generate(PROMPTS[:3], greedy, use_tqdm=False)
    assert busy.stats().spec_drafts > 0


@pytest.mark.parametrize("layout", ["interleaved", "per_layer", "paged"])
def test_greedy_output_is_identical_with_speculation(layout):
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # (dequantized: over GGUF blocks a recomputed prompt's rows sum in another order than the
    # decode steps that first wrote them, and preemption may tip a near tie: gguf_weights.py)
    roomy = LLM(kv_layout=layout, kv_cache_memory=128 << 20, quantization="dequantize")
    want = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, greedy, use_tqdm=False)]
    kv = roomy.engine.kv
    need = [kv.capacity.pages_for(len(roomy.tokenizer.encode(p)) + 48) for p in PROMPTS]
    tight = dict(kv_layout=layout, kv_cache_memory=int(0.6 * sum(need)) * kv.layout.page_size, max_num_seqs=4,
                 quantization="dequantize")
    spec = LLM(**tight, speculative_config=SPEC)  # prefix caching is on by default
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy, use_tqdm=False)]
    assert got == want
    stats = spec.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.spec_drafts <= stats.spec_draft_tokens <= 4 * stats.spec_drafts
    assert 1 < stats.spec_mean_accepted_length <= 5 and 0 < stats.spec_acceptance_rate < 1
    assert stats.preemptions > 0, stats
    assert_pool_whole(spec)


def test_rejection_sampling_keeps_the_models_distribution():
    """With a point-mass proposal, emitted tokens must follow the model's p whatever is drafted."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.3, 0.2, 0.1, 0.0, 2.0]])
    p = logits[0].softmax(-1)
    seq = Sequence("r", 0, [1], SamplingParams(temperature=1.0), 0.0)
    for draft in (0, 3):  # a likely and an unlikely proposal
        counts = torch.zeros(5)
        seq.generator = torch.Generator().manual_seed(draft)
        trials = 6000
        for _ in range(trials):
            counts[verify(logits, seq, [draft])[0].token_id] += 1
        assert (counts / trials - p).abs().max() < 0.025, (draft, counts / trials, p)


def test_sampled_requests_stay_reproducible_with_a_seed():
    llm = LLM(speculative_config=SPEC)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=24)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    again = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert_pool_whole(llm)


def test_bad_speculative_configs_are_refused_by_name():
    for bad, word in (({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"), ({"k": 3}, "unknown"),
                      ({"disable_by_batch_size": 0}, "disable_by_batch_size")):
        with pytest.raises(ValueError, match=word):
            LLM(model="random:tiny", kv_cache_memory=1 << 20, speculative_config=bad)


def test_priority_serves_urgent_requests_first_and_changes_no_output():
    prompts = [[i + 10, i + 11, i + 12, i + 13] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    roomy = LLM(model="random:tiny", kv_cache_memory=4 << 20, page_size=4096)
    alone = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model="random:tiny", kv_cache_memory=12 * 4096, page_size=4096, max_num_seqs=2,
                scheduling_policy="priority")
    engine, order = tight.engine, []
    priorities = [5, 1, 9, 0, 3, 7, 2, 8]
    for i, (prompt, urgency) in enumerate(zip(prompts, priorities)):
        engine.add_request(f"r{i}", prompt, params, priority=urgency)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                order.append(priorities[int(out.request_id[1:])])
    assert [done[f"r{i}"] for i in range(8)] == alone
    assert order == sorted(order)  # two seats: the most urgent pairs finish first
    assert_pool_whole(tight)


def test_an_urgent_request_takes_the_pages_of_a_less_urgent_one_scheduled_before_it():
    """vLLM's rule: the least urgent running sequence is preempted, even one scheduled earlier in
    the step (taken back out of it); before, the urgent one was (finishing last). And beams
    waiting for siblings no longer hold a recomputing beam in a loop of preempting itself."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(model="random:tiny", kv_layout="interleaved", page_size=4096, kv_cache_memory=14 * 4096,
             scheduling_policy="priority", max_num_batched_tokens=64, enable_prefix_caching=False) as llm:
        engine, finished = llm.engine, []
        engine.add_request("low", list(range(10, 37)), params, priority=10)
        engine.step()
        engine.add_request("urgent", list(range(40, 60)), params, priority=0)
        for _ in range(500):
            finished += [o.request_id for o in engine.step() if o.finished]
            if not engine.has_unfinished():
                break
        assert finished == ["urgent", "low"]
        assert_pool_whole(llm)


def test_n_siblings_fork_from_a_parent_whose_prompt_ends_in_a_small_chunk():
    """n = 2 under speculation, the prompt's last chunk one token long: the parent must not take
    drafts that step, since its siblings fork from its first row (once they forked with the
    drafted count computed and a token fewer than that: a request failed or the batch broke)."""
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]  # 17 tokens: "5 6" was followed by 7 8 9
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
    options = dict(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096, max_num_batched_tokens=16)
    with LLM(**options) as plain:
        want = [c.token_ids for c in plain.generate([prompt], greedy, use_tqdm=False)[0].outputs]
    with LLM(**options, speculative_config=SPEC) as spec:
        out = spec.generate([prompt], greedy, use_tqdm=False)[0]
        assert out.error is None and [c.token_ids for c in out.outputs] == want
        assert spec.stats().spec_drafts > 0  # (the siblings, once forked, do take drafts)
        assert_pool_whole(spec)


def test_a_seeded_sampled_request_gives_its_tokens_whatever_else_runs_beside_it():
    """Whether a row gets drafts depends on the batch (disable_by_batch_size, the budget), and
    verifying drafts draws other random numbers than sampling one token: a seeded sampled
    request decodes one token a step, as it would without speculation."""
    llm = LLM(model="random:tiny", kv_cache_memory=8 << 20, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    repeating = [5, 6, 7, 8] * 6
    seeded = SamplingParams(temperature=0.6, seed=42, max_tokens=24, ignore_eos=True)
    alone = llm.generate([repeating], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [[100 + i, 200 + i, 300 + i] for i in range(9)]  # nine more: past disable_by_batch_size
    outs = llm.generate([repeating] + others, [seeded] + [SamplingParams(temperature=0, max_tokens=24,
                                                                         ignore_eos=True)] * 9, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    assert_pool_whole(llm)
