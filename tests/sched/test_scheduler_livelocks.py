"""Requests that pass the admission check finish (a review's reproducers, each of which stepped
for ever): a beam idle for its sibling gives its pages before a plain request preempts itself;
the "admit again without the hit" fallback applies beside idle beams too; under lpm a client
with nothing running is served first, so seat sharing does not hand the seat straight back; a
beam search is preempted whole, so two searches do not take each other's beams for ever (a
sliding window's case is in test_sliding_window.py). Each run ends with the same tokens as
the request alone in a roomy pool, and the pool whole."""
import pytest
from helpers import NARROW, assert_pool_whole

from engine import LLM, BeamSearchParams, SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def drive(llm: LLM, requests: list, max_steps: int = 600) -> dict:
    """requests: (id, prompt, params, the step it arrives at); the finished outputs by id."""
    engine, done, step = llm.engine, {}, 0
    last = max(r[3] for r in requests)
    while step < max_steps and (engine.has_unfinished() or step <= last):
        for rid, prompt, params, at in requests:
            if at == step:
                engine.add_request(rid, list(prompt), params)
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        step += 1
    assert not engine.has_unfinished(), f"still running after {max_steps} steps: {sorted(done)} finished"
    return done


def tokens(out) -> list:
    return [s.tokens for s in out.sequences] if hasattr(out, "sequences") else [o.token_ids for o in out.outputs]


def alone(prompt, params) -> list:
    with LLM(model=NARROW, kv_cache_memory=64 << 20, page_size=4096, enable_prefix_caching=False) as roomy:
        return tokens(drive(roomy, [("x", prompt, params, 0)])["x"])


CASES = {
    "one beam beside a plain request": (
        dict(kv_cache_memory=360 * 4096, max_num_seqs=2, max_num_batched_tokens=8, enable_prefix_caching=False),
        [("beam", [452, 245, 330, 5, 6, 7], BeamSearchParams(2, 6, ignore_eos=True), 1),
         ("plain", [*range(11, 23), 31, 346, 481, 302, 148, 496, 76, 486, 170, 158, 159], greedy(8), 2)]),
    "an idle beam beside a cached prefix": (
        dict(kv_cache_memory=480 * 4096, max_num_seqs=2, max_num_batched_tokens=8, enable_prefix_caching=True),
        [("p", P := [250, 383, 348, 402, 87, 368, 63, 348, 446, 489, 82, 408, 240, 37, 224, 188, 33, 44, 55, 66, 77,
                     88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199, 210, 221, 232, 243, 254], greedy(1), 0),
         ("q", [7, 8, 9, 10, 11], greedy(10), 10),
         ("beam", [329, 176, 97, 170, 304, 99, 396, 270, 437, 207], BeamSearchParams(2, 6, ignore_eos=True), 10),
         ("p2", P, greedy(2), 10)]),
    "lpm with two beam searches": (
        dict(kv_cache_memory=64 << 20, max_num_seqs=3, max_num_batched_tokens=32, enable_prefix_caching=True,
             scheduling_policy="lpm"),
        [("a", [234, 322, 114, 251, 411, 147, 259, 133, 55, 65, 421], BeamSearchParams(3, 9, ignore_eos=True), 0),
         ("c", [*range(11, 23), 216, 307, 426, 51, 134, 245, 204, 123, 233, 446, 318, 483, 253, 37, 294, 76],
          BeamSearchParams(3, 15, ignore_eos=True), 0),
         ("b", [*range(11, 23), 354, 272, 303, 50, 220, 248], greedy(13), 3)]),
    "two beam searches in a pool the wider one fills": (  # each took the other's beams for ever
        dict(kv_layout="interleaved", page_size=8192, kv_cache_memory=405 * 8192, max_num_seqs=4,
             max_num_batched_tokens=16, enable_prefix_caching=False),
        [("a", [*range(11, 23), 360, 328, 323, 337], BeamSearchParams(3, 8, ignore_eos=True), 0),
         ("b", [*range(11, 23), 99, 92, 222, 351, 225, 259, 74, 327, 434, 180, 457, 495, 145],
          BeamSearchParams(2, 9, ignore_eos=True), 3)]),
}


@pytest.mark.parametrize("case", CASES)
def test_requests_that_pass_the_check_finish_with_their_own_tokens(case):
    options, requests = CASES[case]
    with LLM(model=NARROW, **{"kv_layout": "per_layer", "page_size": 4096, **options}) as llm:
        done = drive(llm, requests)
        for rid, prompt, params, _ in requests:
            assert tokens(done[rid]) == alone(prompt, params), rid
        assert_pool_whole(llm)
