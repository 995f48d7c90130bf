"""EngineCore alone (sequences and tokens in, what each did out; no requests, no text): built
from one rank's parts as LLMEngine builds it, it decodes what the whole engine decodes, aborts by
request id, and gives every page back."""
import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.models import load_tokenizer
from engine.request.sequence import Sequence
from engine.request.structured import Grammars
from engine.worker.rank import build_rank

PROMPTS = [[1, 2, 3, 4, 5, 6], [9, 8, 7], list(range(10, 40))]


@pytest.fixture
def core():
    config = EngineConfig(model="random:tiny", kv_cache_memory=8 << 20, max_num_batched_tokens=16)
    rank = build_rank(config)
    tokenizer = load_tokenizer(config.model)
    eos = rank.model_config.eos_token_ids or (tokenizer.eos_token_id,)
    core = EngineCore(config, rank.kv, rank.model, rank.attention, rank.max_model_len, eos,
                      Grammars(tokenizer, rank.model_config.vocab_size))
    yield core
    core.close()
    rank.kv.close()


def test_the_core_decodes_what_the_whole_engine_decodes(core):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seqs = [Sequence(f"r{i}", 0, list(p), params, 0.0, group=f"r{i}") for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        core.add(seq)
    steps = 0
    while core.has_unfinished():
        out = core.step()
        assert out is not None and out.seqs
        steps += 1
    assert steps > 3  # a 30-token prompt in chunks of 16 beside the others' decodes
    with LLM(model="random:tiny", kv_cache_memory=8 << 20) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                             use_tqdm=False)]
    assert [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)] == want
    assert all(s.finish_reason == "length" for s in seqs)
    core.kv.audit()
    assert core.kv.capacity.free_now + core.kv.capacity.spare == core.kv.capacity.total


def test_an_abort_ends_every_sequence_of_its_request_and_frees_its_pages(core):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    a, b = Sequence("a", 0, [1, 2, 3], params, 0.0), Sequence("b", 0, [4, 5, 6], params, 0.0)
    core.add(a)
    core.add(b)
    core.step()
    core.abort("a")
    assert a.finish_reason == "abort" and a.kv is None and b.kv is not None
    core.step()
    assert len(b.token_ids) == 5 and len(a.token_ids) == 4
    core.abort("b")
    assert not core.has_unfinished()
    core.kv.audit()
