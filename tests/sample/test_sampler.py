"""The batched sampler, row by row against hand-computed expectations, and the engine under
random sampling parameters in and out of range: bad values are refused by name, anything
accepted runs, and nothing a request asks for takes the engine down."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from engine import LLM, SamplingParams
from engine.sample.sampler import SamplingError, sample
from engine.request.sequence import Sequence
from helpers import assert_pool_whole

EOS = (0,)


def seq(prompt=(1, 2), output=(), **params) -> Sequence:
    s = Sequence("r", 0, [*prompt, *output], SamplingParams(**params), 0.0)
    s.num_prompt_tokens = len(prompt)
    return s


def draws(logits: torch.Tensor, s: Sequence, n: int = 400) -> set[int]:
    return {sample(logits[None], [s], EOS)[0].token_id for _ in range(n)}


def test_greedy_rows_take_the_argmax_and_penalties_change_it():
    logits = torch.tensor([0.0, 1.0, 3.0, 2.5, -1.0])
    assert sample(logits[None], [seq(temperature=0)], EOS)[0].token_id == 2
    # repetition (Hugging Face's): positive logits of seen tokens divided, negative multiplied
    assert sample(logits[None], [seq(prompt=(2,), temperature=0, repetition_penalty=2.0)], EOS)[0].token_id == 3
    # presence and frequency (OpenAI's): over output tokens only
    s = seq(prompt=(3,), output=(2,), temperature=0, presence_penalty=0.6)
    assert sample(logits[None], [s], EOS)[0].token_id == 3  # 3.0 - 0.6 < 2.5
    s = seq(output=(2, 2), temperature=0, frequency_penalty=0.2)
    assert sample(logits[None], [s], EOS)[0].token_id == 2  # 3.0 - 0.4 > 2.5
    s = seq(output=(2, 2, 2), temperature=0, frequency_penalty=0.2)
    assert sample(logits[None], [s], EOS)[0].token_id == 3  # 3.0 - 0.6 < 2.5
    assert sample(logits[None], [seq(temperature=0, logit_bias={4: 10.0})], EOS)[0].token_id == 4


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([9.0, 0.0, 8.0, 1.0])
    s = seq(temperature=0, min_tokens=2, max_tokens=4, stop_token_ids=[2])
    assert sample(logits[None], [s], EOS)[0].token_id == 3
    s = seq(output=(3, 3), temperature=0, min_tokens=2, max_tokens=4, stop_token_ids=[2])
    assert sample(logits[None], [s], EOS)[0].token_id == 0


def test_top_k_top_p_min_p_keep_exactly_the_tokens_they_should():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log()
    assert draws(logits, seq(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(logits, seq(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.75
    assert draws(logits, seq(temperature=1.0, top_p=0.76)) == {0, 1, 2}
    assert draws(logits, seq(temperature=1.0, min_p=0.25)) == {0, 1, 2}  # >= 0.125
    assert draws(logits, seq(temperature=1.0, top_p=0.8)) == {0, 1, 2}  # 0.75 before token 2
    assert draws(logits, seq(temperature=1.0, top_k=3, top_p=0.8)) == {0, 1}  # renormalized: 0.83 before it
    # min-p first (vLLM's order), then top-p over what it left: min-p 0.25 keeps {0, 1, 2} (0.9 of
    # the mass), renormalized 0.83 comes before token 2, past 0.8 (top-p first would keep it: 0.75)
    assert draws(logits, seq(temperature=1.0, top_p=0.8, min_p=0.25)) == {0, 1}


def test_seeded_draws_repeat_and_follow_the_distribution():
    logits = torch.tensor([0.0, math.log(3.0)])  # p = 1/4, 3/4
    a = [sample(logits[None], [seq(temperature=1.0, seed=7)], EOS)[0].token_id for _ in range(3)]
    gen = lambda: torch.Generator().manual_seed(11)
    s1, s2 = seq(temperature=1.0), seq(temperature=1.0)
    s1.generator, s2.generator = gen(), gen()
    assert [sample(logits[None], [s1], EOS)[0].token_id for _ in range(50)] == \
        [sample(logits[None], [s2], EOS)[0].token_id for _ in range(50)]
    ones = sum(sample(logits[None], [seq(temperature=1.0)], EOS)[0].token_id for _ in range(4000))
    assert 0.72 < ones / 4000 < 0.78
    assert len(a) == 3


def test_logprobs_are_the_raw_distribution_and_top_k_is_exactly_k():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    out = sample(logits[None], [seq(temperature=0, logprobs=2, repetition_penalty=3.0, prompt=(2,))], EOS)[0]
    raw = logits.log_softmax(-1)
    assert out.token_id == 1 and out.logprob == pytest.approx(float(raw[1]))
    assert [t for t, _ in out.top] == [2, 1] and out.top[0][1] == pytest.approx(float(raw[2]))
    assert sample(logits[None], [seq(temperature=0, logprobs=0)], EOS)[0].top == []


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.tensor([[0.0, 1.0, 2.0], [float("nan"), 0.0, 1.0], [3.0, 1.0, 0.0]])
    rows = [seq(temperature=0), seq(temperature=0.7), seq(temperature=1.0, top_k=1)]
    good, bad, also_good = sample(logits, rows, EOS)
    assert good.token_id == 2 and also_good.token_id == 0
    assert isinstance(bad, SamplingError) and "non-finite" in str(bad)
    masks = torch.tensor([[True, True, True], [False, False, False], [True, False, False]])
    results = sample(torch.zeros(3, 3), rows, EOS, masks)
    assert isinstance(results[1], SamplingError) and "allows no token" in str(results[1])
    assert results[2].token_id == 0


# -- the engine under random parameters ------------------------------------------------------
number = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, 1e-300, 1e-6, 1e-5, 0.01, 0.5, 1, 2, 100, 1e300, -1]),
                   st.integers(-3, 3), st.booleans(), st.text(max_size=2))
token = st.one_of(st.integers(-3, 3), st.integers(49140, 49160), st.integers(0, 49151))
FIELDS = {
    "temperature": number, "top_p": number, "top_k": st.one_of(st.integers(-3, 60000), number), "min_p": number,
    "repetition_penalty": number, "presence_penalty": number, "frequency_penalty": number,
    "min_tokens": st.integers(-2, 8), "max_tokens": st.none() | st.integers(-1, 8) | number,
    "n": st.integers(-1, 3) | st.just("2"),
    "best_of": st.none() | st.integers(-1, 4), "logprobs": st.none() | st.integers(-1, 25) | number,
    "seed": st.none() | st.integers(-2 ** 70, 2 ** 70), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(token, max_size=3), "logit_bias": st.dictionaries(token, number, max_size=3),
    "stop": st.lists(st.text(max_size=3), max_size=2),
}


@pytest.fixture(scope="module")
def tiny():
    llm = LLM(model="random:tiny", max_num_seqs=8, kv_cache_memory=16 << 20, page_size=4096,
              max_model_len=64)  # max_tokens=None: up to 61 tokens
    yield llm
    llm.engine.close()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(kwargs=st.fixed_dictionaries({}, optional=FIELDS))
def test_random_sampling_parameters_never_take_the_engine_down(tiny, kwargs):
    try:
        params = SamplingParams(**kwargs)
        outs = tiny.generate([[5, 6, 7], [9, 10]], params, use_tqdm=False)
    except ValueError as exc:  # (never a TypeError: a wrong type is refused by name too)
        assert str(exc)  # refused, with a reason, before anything ran
    else:
        for out in outs:
            assert out.finished and out.error is None, out.error
            assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
            assert len(out.outputs) == params.n
    assert_pool_whole(tiny)
    control = tiny.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(control[0].outputs[0].token_ids) == 3
