"""Sampling, stopping, streaming text, and bad input on the offline API."""
import pytest

from engine import LLM, SamplingParams
from engine.core.output_processor import OutputProcessor
from engine.request.detokenizer import IncrementalDetokenizer
from engine.request.inputs import Prompt
from engine.request.outputs import RequestOutputKind, top_of
from engine.request.sequence import Sequence
from engine.sample.sampler import Sampled
from engine.sched.step import SeqOutput
from helpers import assert_pool_whole


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Tell me a story about a dragon", p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["Hello there", "Tell me a story about a dragon", "Count: 1, 2,"],
                         [SamplingParams(temperature=1.0, max_tokens=25), p,
                          SamplingParams(temperature=0.5, max_tokens=5)], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone
    other = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate("Tell me a story about a dragon", other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_completions_and_logprobs(llm):
    out = llm.generate("My favourite colour is", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                                                logprobs=2), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for token, lp in zip(o.token_ids, o.logprobs):
            top = top_of(lp, 2)
            assert next(iter(lp)) == token and len(top) == 2 and all(v <= 0 for _, v in top)
            assert top[0][1] >= top[1][1] and (token not in dict(top) or dict(top)[token] == lp[token].logprob)
    assert_pool_whole(llm)


def test_max_tokens_min_tokens_and_stop_strings(llm):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("The capital of France is", p, use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    stop = full.text.strip().split()[1]
    cut = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.text.startswith(cut.text)
    # as vLLM: no stop string ends a completion before min_tokens (nor eos, below)
    late = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                                   stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert late.token_ids == full.token_ids and late.finish_reason == "length"
    say = [{"role": "user", "content": "Say OK."}]
    baseline = llm.chat(say, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert baseline.finish_reason == "stop" and baseline.token_ids[-1] == llm.tokenizer.eos_token_id
    least = len(baseline.token_ids) + 4
    held = llm.chat(say, SamplingParams(temperature=0, min_tokens=least, max_tokens=least + 10),
                    use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= least and held.token_ids[:len(baseline.token_ids) - 1] == baseline.token_ids[:-1]
    assert llm.tokenizer.eos_token_id not in held.token_ids[:least - 1]


def test_the_token_that_stops_a_completion_is_kept_out_of_its_text(llm):
    """vLLM's rule, as for stop strings: `stop_token_ids=['.']` ended "Paris." and a chat turn
    with skip_special_tokens=False ended "...<|im_end|>" (a review's reproducer)."""
    dot = llm.tokenizer.encode(".", add_special_tokens=False)[0]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("The capital of France is", p, use_tqdm=False)[0].outputs[0]
    assert dot in full.token_ids  # the case: the greedy answer has a full stop
    cut = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[dot]),
                       use_tqdm=False)[0].outputs[0]
    by_string = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=["."]),
                             use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == dot and cut.text == by_string.text
    say = [{"role": "user", "content": "Say OK."}]
    turn = llm.chat(say, SamplingParams(temperature=0, max_tokens=30, skip_special_tokens=False),
                    use_tqdm=False)[0].outputs[0]
    assert turn.token_ids[-1] == llm.tokenizer.eos_token_id and not turn.text.endswith(llm.tokenizer.eos_token)


def test_streamed_completions_keep_their_index_when_best_of_is_n():
    """best_of == n chooses nothing: each completion keeps its index from the first delta to the
    final output (ranking them by cum_logprob at the end swapped their last tokens)."""
    from engine.request.outputs import RequestOutputKind
    tiny = LLM(model="random:tiny", kv_cache_memory=8 << 20)
    for seed in range(4):
        params = dict(temperature=1.0, seed=seed, n=2, best_of=2, max_tokens=6, ignore_eos=True)
        final = tiny.generate([[5, 6, 7, 8]], SamplingParams(**params), use_tqdm=False)[0]
        tiny.engine.add_request(f"d{seed}", [5, 6, 7, 8], SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
        streamed = {}
        while tiny.engine.has_unfinished():
            for out in tiny.engine.step():
                for c in out.outputs:
                    streamed.setdefault(c.index, []).extend(c.token_ids)
        assert streamed == {c.index: c.token_ids for c in final.outputs}


def test_chat_answers_sensibly(llm):
    # (asked as `make run` asks it: without "Answer in one sentence." the first token is a near tie,
    # "The" 0.08 nats above "L" in fp32, which the default's int8 activations tip the other way)
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                   SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_multibyte_text_streams_whole_characters(llm):
    tok = llm.tokenizer
    text = "Größe: 世界 🎉🚀 naïve — ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("ending", ["length", "eos", "stop_token_ids"])
@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_a_completion_cut_inside_a_character_ends_with_the_text_its_tokens_decode_to(llm, kind, ending):
    """max_tokens, EOS or a stop token may end a completion between the byte tokens of one
    character: the held-back bytes come out at the end, as decoding its tokens shows them (a
    replacement character), not dropped; a stop token's own text stays out (vLLM's rule); streamed
    deltas add up to the same text."""
    tok = llm.tokenizer
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    stop = tok.encode(".", add_special_tokens=False)[0]
    eos = tok.eos_token_id
    params = SamplingParams(max_tokens=cut if ending == "length" else 64, output_kind=kind, skip_special_tokens=False,
                            stop_token_ids=[stop] if ending == "stop_token_ids" else None)
    generated = ids[:cut] + ([] if ending == "length" else [eos if ending == "eos" else stop])
    processor, seq = OutputProcessor(tok, eos_ids=(eos,)), Sequence("r", 0, [1, 2, 3], params, 0.0)
    processor.add("r", Prompt([1, 2, 3]), params)
    last = len(generated) - 1
    texts = [processor.process([SeqOutput(seq, [Sampled(t)], (ending if ending == "length" else "stop")
                                          if i == last else None)])[0][0].outputs[0].text
             for i, t in enumerate(generated)]
    want = tok.decode(ids[:cut])
    assert want.endswith("\ufffd")
    assert (texts[-1] if kind is RequestOutputKind.CUMULATIVE else "".join(texts)) == want


@pytest.mark.parametrize("bad", [
    dict(prompt=""), dict(prompt=[[]]), dict(prompt=[10 ** 9]),
    dict(prompt="hi " * 3000), dict(params=dict(max_tokens=0)), dict(params=dict(max_tokens=5000)),
    dict(params=dict(temperature=-1)), dict(params=dict(temperature=1e39)), dict(params=dict(temperature=1e300)),
    dict(params=dict(top_p=0)), dict(params=dict(top_p=1.5)),
    dict(params=dict(n=0)), dict(params=dict(min_tokens=9, max_tokens=3)),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(llm, bad):
    with pytest.raises(ValueError):
        llm.generate(bad.get("prompt", "Hello"), SamplingParams(**bad.get("params", {})), use_tqdm=False)
    assert_pool_whole(llm)
    assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_bad_prompt_in_a_batch_refuses_the_whole_batch_before_running(llm):
    before = llm.stats().requests_finished
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["fine", "x " * 5000], SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.stats().requests_finished == before
    assert_pool_whole(llm)


def test_unknown_model_and_bad_options_fail_clearly():
    with pytest.raises(FileNotFoundError, match="unknown model"):
        LLM(model="/no/such/model")
    with pytest.raises(ValueError, match="kv_layout"):
        LLM(kv_layout="striped")
    with pytest.raises(ValueError, match="preset"):
        LLM(model="random:gpt-7")


def test_request_larger_than_the_whole_kv_budget_is_refused():
    small = LLM(kv_layout="interleaved", kv_cache_memory=20 * 65536)  # 28 tokens
    with pytest.raises(ValueError, match="KV budget"):
        small.generate("Hello " * 10, SamplingParams(max_tokens=100), use_tqdm=False)
    assert small.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_random_preset_runs():
    llm = LLM(model="random:tiny", kv_layout="per_layer")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert_pool_whole(llm)


@pytest.mark.parametrize("options", [dict(kv_layout="per_layer", num_scheduler_steps=4),
                                     dict(kv_layout="interleaved", kv_offloading_size=0.01, map_ahead_tokens=16),
                                     dict(kv_layout="paged", enable_prefix_caching=False)],
                         ids=["multi-step", "host-tier-map-ahead", "paged"])
def test_a_dropped_engine_and_its_kv_memory_are_freed_by_reference_count_alone(options):
    """No cycle holds an engine or its KV manager (engine/kv/lookup.py make_room, manager.Offload):
    its pages go back when the last reference goes, not at the cyclic collector's next full
    pass, which a steady workload may not see for minutes."""
    import gc
    import weakref
    llm = LLM(model="random:tiny", **options)
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=9, ignore_eos=True), use_tqdm=False)
    engine, kv = weakref.ref(llm.engine), weakref.ref(llm.engine.kv)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert engine() is None and kv() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("kv_layout", ["interleaved", "per_layer", "paged"])
def test_sleep_releases_the_kv_memory_and_wake_up_changes_nothing(kv_layout):
    import os
    llm = LLM(kv_layout=kv_layout, kv_cache_memory=64 << 20)
    kv, greedy = llm.engine.kv, SamplingParams(temperature=0, max_tokens=12)
    views = [t.data_ptr() for t in (*kv.layout.k_caches, *kv.layout.v_caches)]

    def committed() -> int:
        if kv_layout == "paged":
            return sum(t.untyped_storage().nbytes() for t in (*kv.layout.k_caches, *kv.layout.v_caches))
        return os.fstat(kv.pool.backend.fd).st_blocks * 512

    before = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    full = committed()
    assert full >= 0.99 * (64 << 20)
    llm.engine.add_request("in-flight", "Hello", greedy)
    with pytest.raises(RuntimeError, match="in flight"):
        llm.sleep()
    llm.engine.abort("in-flight")
    with pytest.raises(ValueError, match="level 2"):
        llm.sleep(level=2)
    llm.sleep()
    assert llm.is_sleeping() and committed() <= 0.2 * full
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate(["x"], greedy, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    if kv_layout != "paged":  # the virtual ranges, and every view into them, never moved
        assert [t.data_ptr() for t in (*kv.layout.k_caches, *kv.layout.v_caches)] == views
        assert committed() == 0  # each page is created when a request first maps it
    else:
        assert committed() >= 0.99 * full
    after = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
    assert 0 < committed() <= full
    assert_pool_whole(llm)


@pytest.mark.parametrize("created", [0, 3])
def test_a_page_the_system_cannot_give_after_a_wake_fails_the_request_clearly_and_leaks_nothing(monkeypatch, created):
    """Pages come back at their first use after a wake (vmm.PagePool.restore_memory): when the
    system has no memory for one (at admission: 0 created; mid-decode: 3), the request fails with
    vmm.NoMemory at once (not a wait for room that would never come), nothing stays held, and
    once memory is there again the engine answers as before."""
    import vmm
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096) as llm:
        before = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].token_ids
        llm.sleep()
        llm.wake_up()
        backend, made = llm.engine.kv.pool.backend, []
        create = backend.create_page

        def short_of_memory():
            if len(made) >= created:
                raise vmm.PoolExhausted("cannot commit a host page: No space left on device")
            made.append(1)
            return create()

        monkeypatch.setattr(backend, "create_page", short_of_memory)
        with pytest.raises(vmm.NoMemory, match="No space left"):
            llm.generate(["The capital of France is"], greedy, use_tqdm=False)
        assert_pool_whole(llm)
        assert not llm.engine.kv.handles
        monkeypatch.setattr(backend, "create_page", create)
        assert llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].token_ids == before
        assert_pool_whole(llm)


def test_a_client_with_nothing_running_gets_a_seat_from_the_one_holding_them_all():
    """Client A's burst holds every seat; client B's one request runs within two steps (a
    sequence of A's is preempted, and recomputed later: A's outputs do not change)."""
    burst = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5 + i] * 20 for i in range(12)]
    with LLM(model="random:tiny", max_num_seqs=4, kv_cache_memory=8 << 20, page_size=4096) as alone:
        want = [o.outputs[0].token_ids for o in alone.generate(prompts, burst, use_tqdm=False)]
    with LLM(model="random:tiny", max_num_seqs=4, kv_cache_memory=8 << 20, page_size=4096) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"a{i}", prompt, burst, group="A")
        done = {}
        for _ in range(3):
            done |= {o.request_id: o for o in engine.step() if o.finished}
        assert [s.group for s in engine.scheduler.queues.running] == ["A"] * 4
        engine.add_request("b", [9] * 20, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), group="B")
        steps, first = 0, None
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            if first is None and any(o.request_id == "b" and o.outputs[0].token_ids for o in outs):
                first = steps
            done |= {o.request_id: o for o in outs if o.finished}
        assert first is not None and first <= 2, first
        assert engine.scheduler.num_preemptions >= 1
        assert [done[f"a{i}"].outputs[0].token_ids for i in range(12)] == want
        assert_pool_whole(llm)


def test_a_clients_past_requests_do_not_put_it_behind_a_newcomers_burst():
    """Fairness counts what a client had while it competes, not its whole history: A, back after
    40 requests with nothing left, is not queued behind B's burst of 30 (before: 17th of 31, after
    24 preemptions)."""
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model="random:tiny", kv_cache_memory=8 << 20, max_num_seqs=2) as llm:
        engine = llm.engine
        for i in range(40):
            engine.add_request(f"a{i}", [5, 6, 7, i + 8], p, group="A")
        while engine.has_unfinished():
            engine.step()
        engine.add_request("a-next", [5, 6, 7, 8], p, group="A")
        for i in range(30):
            engine.add_request(f"b{i}", [9, 10, 11, i + 12], p, group="B")
        order = []
        while engine.has_unfinished():
            order += [o.request_id for o in engine.step() if o.finished]
        assert order.index("a-next") <= 2 and engine.scheduler.num_preemptions == 0, order
        assert_pool_whole(llm)


@pytest.mark.parametrize("corrupt", [0, 3])
def test_a_sequence_scheduled_past_its_tokens_fails_its_request_alone(corrupt, caplog):
    """A running sequence with nothing left to compute (it would wait forever), or with more
    computed than it has (a step over negative rows: one such step once killed a test server's
    engine) is a bug, never expected: its own request fails with a plain message, the others'
    tokens do not change, and the pool is whole."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {"victim": [5, 6, 7, 8, 9], "other": [11, 12, 13]}
    with LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096) as llm:
        want = llm.generate([prompts["other"]], greedy, use_tqdm=False)[0].outputs[0].token_ids
        engine = llm.engine
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, greedy)
        done = {o.request_id: o for o in engine.step() if o.finished}
        victim = next(s for s in engine.scheduler.queues.running if s.request_id == "victim")
        victim.num_computed_tokens = len(victim) + corrupt
        for _ in range(20):
            done |= {o.request_id: o for o in engine.step() if o.finished}
            if not engine.has_unfinished():
                break
        assert done["victim"].outputs[0].finish_reason == "error"
        assert done["victim"].error == "internal error while scheduling this request"
        assert done["other"].outputs[0].token_ids == want
        assert "scheduling victim" in caplog.text
        assert_pool_whole(llm)


def test_max_tokens_none_generates_as_many_as_fit():
    """vLLM's max_tokens=None: up to max_model_len after the prompt; a prompt that leaves no room
    is refused by name."""
    with LLM(model="random:tiny", kv_cache_memory=1 << 20, page_size=4096, max_model_len=24) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None, ignore_eos=True, n=2), use_tqdm=False)[0]
        assert [len(c.token_ids) for c in out.outputs] == [20, 20]
        assert {c.finish_reason for c in out.outputs} == {"length"}
        with pytest.raises(ValueError, match="leaves no room"):
            llm.generate([list(range(5, 29))], SamplingParams(max_tokens=None), use_tqdm=False)
        with pytest.raises(ValueError, match="min_tokens"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=None, min_tokens=21), use_tqdm=False)
        assert_pool_whole(llm)
