"""Code written in vLLM's idiom runs against vkv unchanged: the offline API's outputs (logprobs
per position as dict[int, Logprob] with rank and decoded_token, prompt logprobs that start with
None, stop_reason) and the server's /tokenize, /detokenize and /version, read the way vLLM's own
examples and clients read them."""
import httpx
import pytest

from engine import LLM, SamplingParams  # as `from vllm import LLM, SamplingParams`
from engine.serving.options import ServerOptions
from helpers import NARROW, async_engine, served

KEY = "sk-idiom"


@pytest.fixture(scope="module")
def llm():
    with LLM(model=NARROW, kv_cache_memory=32 << 20) as llm:
        yield llm


def test_sample_and_prompt_logprobs_read_as_vllms(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate(["The capital of France is"], params)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token_id, logprobs in zip(completion.token_ids, completion.logprobs):
        chosen = logprobs[token_id]  # vLLM's out.outputs[0].logprobs[i][token_id].logprob
        total += chosen.logprob
        assert next(iter(logprobs)) == token_id  # the sampled token first, as vLLM inserts it
        assert chosen.decoded_token == tokenizer.decode([token_id])
        top = sorted((lp.rank, lp.logprob) for t, lp in logprobs.items() if lp.rank <= 3)
        assert [rank for rank, _ in top] == [1, 2, 3] and len(logprobs) in (3, 4)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        if len(logprobs) == 4:  # not among the top 3: its rank is past them, its logprob below theirs
            assert chosen.rank > 3 and chosen.logprob <= top[-1][1]
        else:
            assert chosen.logprob == top[chosen.rank - 1][1]
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token_id, logprobs in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert next(iter(logprobs)) == token_id and logprobs[token_id].rank >= 1 and len(logprobs) in (2, 3)


def test_greedy_tokens_are_rank_one_and_stop_reason_names_the_stop(llm):
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True))[0]
    assert all(lp[t].rank == 1 and len(lp) == 1 for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))
    text = out.outputs[0].text
    assert out.outputs[0].stop_reason is None and out.outputs[0].finish_reason == "length"
    stop = text[len(text) // 2:][:2]
    if stop.strip():
        got = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8, stop=[stop]))[0].outputs[0]
        assert got.finish_reason == "stop" and got.stop_reason == stop and stop not in got.text
    token = out.outputs[0].token_ids[2]
    got = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[token]))[0].outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == token


@pytest.fixture(scope="module")
def server():
    engine = async_engine(model=NARROW)
    with served(engine, "m", ServerOptions(api_key=KEY)) as base:
        yield base, engine


def test_tokenize_detokenize_and_version_answer_as_vllms(server):
    base, engine = server
    auth = {"authorization": f"Bearer {KEY}"}
    tokenizer = engine.tokenizer
    answer = httpx.post(f"{base}/tokenize", json={"model": "m", "prompt": "Hello world", "return_token_strs": True},
                        headers=auth).json()
    assert answer["tokens"] == tokenizer.encode("Hello world") and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == engine.max_model_len
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    bare = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False},
                      headers=auth).json()
    assert bare["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False) and bare["token_strs"] is None
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=auth).json()
    want = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    back = httpx.post(f"{base}/detokenize", json={"model": "m", "tokens": answer["tokens"]}, headers=auth).json()
    assert back == {"prompt": tokenizer.decode(answer["tokens"])}
    assert httpx.get(f"{base}/version").json()["version"]


@pytest.mark.parametrize("path, body, status, says", [
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "token ids must be in"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                   "continue_final_message": True}, 400, "cannot both be true"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "does not exist"),
])
def test_bad_tokenize_requests_are_refused_by_name(server, path, body, status, says):
    base, _ = server
    answer = httpx.post(base + path, json=body, headers={"authorization": f"Bearer {KEY}"})
    assert answer.status_code == status and says in answer.json()["error"]["message"], answer.text
    assert httpx.post(base + path, json=body).status_code == 401  # behind the key
