"""LoRA adapters (engine/worker/lora.py): greedy output equals transformers + peft for each adapter;
a batch mixing adapters and the base model equals each alone; pages are named by adapter;
max_loras bounds the adapters of a step; what does not fit is refused by name."""
import json
import shutil

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.worker.lora import LoRABatch
from helpers import PROMPTS, assert_pool_whole, peft_adapter

N = 10
GREEDY = SamplingParams(temperature=0, max_tokens=N)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters: every projection at rank 8; q and v only at rank 4 with rsLoRA scaling.
    Each with its transformers + peft greedy tokens on the first three prompts."""
    from engine.models import load_tokenizer
    tok = load_tokenizer(None)
    ids = [tok.encode(p) for p in PROMPTS[:3]]
    root = tmp_path_factory.mktemp("lora")
    made = {"all": peft_adapter(root / "all", seed=1),
            "qv": peft_adapter(root / "qv", seed=2, r=4, targets=("q_proj", "v_proj"), rslora=True)}
    refs = {}
    with torch.no_grad():
        for name, model in made.items():
            refs[name] = [model.generate(input_ids=torch.tensor([i]), max_new_tokens=N, do_sample=False,
                                         pad_token_id=0)[0, len(i):].tolist() for i in ids]
            with model.disable_adapter():
                refs[None] = [model.generate(input_ids=torch.tensor([i]), max_new_tokens=N, do_sample=False,
                                             pad_token_id=0)[0, len(i):].tolist() for i in ids]
    requests = {"all": LoRARequest("all", 1, str(root / "all")), "qv": LoRARequest("qv", 2, str(root / "qv")), None: None}
    return ids, requests, refs, root


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_equals_transformers_peft_and_changes_the_output(adapters):
    ids, requests, refs, _ = adapters
    assert refs["all"] != refs[None] and refs["qv"] != refs[None]  # the adapters matter
    llm = LLM(enable_lora=True, max_loras=2)
    for name in ("all", "qv", None):
        assert tokens(llm.generate(ids, GREEDY, use_tqdm=False, lora_request=requests[name])) == refs[name], name
        one = llm.generate(ids[:1], GREEDY, use_tqdm=False, lora_request=requests[name])  # a step of one row
        assert tokens(one) == refs[name][:1], name
    assert_pool_whole(llm)


@pytest.mark.parametrize("kv_layout", ["per_layer", "paged"])
def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(adapters, kv_layout):
    """Six requests over two adapters and the base in one batch, with n=2 forks and chunked
    prefill (rows of one sequence in two steps), equal the references; the pages of one
    prompt are cached three times, once per adapter."""
    ids, requests, refs, _ = adapters
    llm = LLM(enable_lora=True, max_loras=2, kv_layout=kv_layout, max_num_batched_tokens=24)
    names = ["all", "qv", None, "qv", "all", None]
    prompts = [ids[i % 3] for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N, n=2), use_tqdm=False,
                        lora_request=[requests[n] for n in names])
    for i, (name, out) in enumerate(zip(names, outs)):
        assert [c.token_ids for c in out.outputs] == [refs[name][i % 3]] * 2, (i, name)
    assert_pool_whole(llm)


def test_pages_are_named_by_adapter(adapters):
    """A prompt the base model cached is not a hit for an adapter (its K/V differ), and is one
    for the same adapter again; the output is the adapter's either way."""
    ids, requests, refs, _ = adapters
    llm = LLM(enable_lora=True, page_size=4096, kv_cache_memory=16 << 20)
    long = ids[2] * 4  # a few pages of prompt
    base = llm.generate([long], GREEDY, use_tqdm=False)
    kv = llm.engine.kv.prefix_cache
    before = kv.hits
    first = llm.generate([long], GREEDY, use_tqdm=False, lora_request=requests["all"])
    assert kv.hits == before
    again = llm.generate([long], GREEDY, use_tqdm=False, lora_request=requests["all"])
    assert kv.hits > before
    assert tokens(first) == tokens(again) != tokens(base)
    fresh = LLM(enable_lora=True, enable_prefix_caching=False, page_size=4096, kv_cache_memory=16 << 20)
    assert tokens(fresh.generate([long], GREEDY, use_tqdm=False, lora_request=requests["all"])) == tokens(first)


def test_max_loras_bounds_the_adapters_of_a_step(adapters, monkeypatch):
    ids, requests, refs, _ = adapters
    seen = []
    of = LoRABatch.of

    def spy(loras, starts, lengths, native=False):
        seen.append({a.name for a in loras if a is not None})
        return of(loras, starts, lengths, native)

    monkeypatch.setattr(LoRABatch, "of", staticmethod(spy))
    llm = LLM(enable_lora=True, max_loras=1)
    names = ["all", "qv", None, "qv", "all", None]
    outs = llm.generate([ids[i % 3] for i in range(6)], GREEDY, use_tqdm=False,
                        lora_request=[requests[n] for n in names])
    assert tokens(outs) == [refs[n][i % 3] for i, n in enumerate(names)]
    assert max(map(len, seen)) == 1 and len(set().union(*seen)) == 2
    assert_pool_whole(llm)


def test_adapters_in_memory_are_bounded_least_recently_used_first(adapters):
    ids, requests, refs, _ = adapters
    llm = LLM(enable_lora=True, max_loras=1, max_cpu_loras=1)
    for name in ("all", "qv", "all"):
        assert tokens(llm.generate(ids[:1], GREEDY, use_tqdm=False, lora_request=requests[name])) == refs[name][:1]
        assert llm.engine.list_loras() == [name]
    assert llm.engine.loras.loads == 3  # "all" was dropped for "qv", then read again


def write_adapter(path, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 8, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_what_does_not_fit_is_refused_by_name(adapters, tmp_path):
    ids, requests, _, root = adapters
    llm = LLM(enable_lora=True, max_lora_rank=4)

    def refused(lora, match):
        with pytest.raises(ValueError, match=match):
            llm.generate(ids[:1], GREEDY, use_tqdm=False, lora_request=lora)
    refused(requests["all"], "rank 8 .* exceeds max_lora_rank 4")
    refused(LoRARequest("gone", 3, str(tmp_path / "nowhere")), "'gone'.*no adapter_config.json")
    empty = tmp_path / "no-weights"
    empty.mkdir()
    shutil.copy(root / "qv" / "adapter_config.json", empty)
    refused(LoRARequest("empty", 4, str(empty)), "no adapter_model.safetensors")
    a, b = torch.zeros(4, 576), torch.zeros(576, 4)
    gpt2 = write_adapter(tmp_path / "gpt2", {"target_modules": ["c_attn"]}, {})
    refused(LoRARequest("gpt2", 5, gpt2), "target module 'c_attn' is not one this")
    regex = write_adapter(tmp_path / "regex", {"target_modules": ".*"},
                          {"base_model.model.model.layers.0.self_attn.c_attn.lora_A.weight": a,
                           "base_model.model.model.layers.0.self_attn.c_attn.lora_B.weight": b})
    refused(LoRARequest("regex", 6, regex), "target module 'c_attn' is not one this")
    other = write_adapter(tmp_path / "other", {"target_modules": ["q_proj"]},
                          {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 512),
                           "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b})
    refused(LoRARequest("other", 7, other), "another base model")
    dora = write_adapter(tmp_path / "dora", {"use_dora": True}, {})
    refused(LoRARequest("dora", 8, dora), "DoRA")
    # configs that are not PEFT's (each loaded before, one of them a 500 on the server, one NaN logits later)
    weights = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 576),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(576, 2)}
    for i, (config, words) in enumerate([({"r": 0}, "r must be an integer >= 1"), ({"r": -1}, "r must be"),
                                         ({"r": "8"}, "r must be"), ({"r": 99999999}, "rank 99999999 .* exceeds"),
                                         ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number"),
                                         ({"lora_alpha": -2}, "lora_alpha must be"), ({"use_rslora": "yes"}, "use_rslora"),
                                         ({"target_modules": [1]}, "target module 1")]):
        path = write_adapter(tmp_path / f"bad{i}", {"r": 2, **config}, weights)
        refused(LoRARequest(f"bad{i}", 20 + i, path), words)
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "adapter_config.json").write_text("[1, 2]")
    refused(LoRARequest("listed", 40, str(listed)), "must be a JSON object, not list")
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "adapter_config.json").write_text('{"r": 2, "pad": "' + "x" * (2 << 20) + '"}')
    refused(LoRARequest("huge", 41, str(huge)), "adapter_config.json is over")
    nan = write_adapter(tmp_path / "nan", {"r": 2}, {**weights, "base_model.model.model.layers.0.self_attn.q_proj."
                                                     "lora_B.weight": torch.full((576, 2), float("nan"))})
    refused(LoRARequest("nan", 42, nan), "not finite")
    refused(LoRARequest("tilde", 43, "~no-such-user-of-vkv/adapter"), "names no home directory")
    assert llm.engine.list_loras() == [] and not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LLM().generate(ids[:1], GREEDY, use_tqdm=False, lora_request=requests["qv"])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, "x")
    with pytest.raises(ValueError, match="enable_lora with tensor_parallel_size"):
        LLM(enable_lora=True, tensor_parallel_size=2)


def test_the_server_serves_adapters_by_model_name(adapters):
    """--lora-modules: /v1/models lists each adapter with its base as parent; a request's
    `model` picks the adapter (its greedy text is the offline one); the runtime routes answer
    only when allowed, behind the key, and refuse what does not load."""
    import httpx
    from helpers import serving

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.serving.loop.async_engine import AsyncEngine
    from engine.serving.options import ServerOptions
    from engine.serving.api.server import build_app

    ids, requests, refs, root = adapters
    key, auth = "k", {"Authorization": "Bearer k"}
    engine = AsyncEngine(LLMEngine(EngineConfig(enable_lora=True, max_loras=2, kv_cache_memory=64 << 20)))
    text = lambda name: engine.tokenizer.decode(refs[name][0])
    body = lambda model: {"model": model, "prompt": ids[0], "max_tokens": N, "temperature": 0}
    try:
        app = build_app(engine, "base", ServerOptions(api_key=key, allow_runtime_lora_updating=True),
                        adapters={"all": str(root / "all")})
        with serving(app) as url, httpx.Client(base_url=url, headers=auth, timeout=60) as http:
            cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
            assert cards["all"]["parent"] == "base" and cards["base"]["parent"] is None
            for model, ref in (("all", "all"), ("base", None)):
                got = http.post("/v1/completions", json=body(model)).json()
                assert got["model"] == model and got["choices"][0]["text"] == text(ref)
            assert http.post("/v1/completions", json=body("qv")).status_code == 404
            load = {"lora_name": "qv", "lora_path": str(root / "qv")}
            assert httpx.post(url + "/v1/load_lora_adapter", json=load).status_code == 401  # no key
            assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
            assert http.post("/v1/load_lora_adapter", json=load).status_code == 400  # taken
            got = http.post("/v1/chat/completions", json={"model": "qv", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
            assert got.status_code == 200 and got.json()["model"] == "qv"
            assert http.post("/v1/completions", json=body("qv")).json()["choices"][0]["text"] == text("qv")
            bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(root / "nope")})
            assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 200
            assert http.post("/v1/completions", json=body("qv")).status_code == 404
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"}).status_code == 404
        closed = build_app(engine, "base", ServerOptions())
        with serving(closed) as url:
            assert httpx.post(url + "/v1/load_lora_adapter", json=load).status_code == 404
    finally:
        engine.shutdown()


def test_the_native_segments_kernel_equals_the_torch_reference():
    """lora_segments: short segments row by row, long ones through torch's GEMM, rows not in any
    segment untouched; held to engine/worker/lora.py's reference."""
    import ext
    from engine.worker.lora import reference
    if ext.cpu_kernels() is None:
        pytest.skip(f"no CPU kernels: {ext.cpu_kernels_error()}")
    g = torch.Generator().manual_seed(0)
    x, out = torch.randn(40, 96, generator=g), torch.randn(40, 130, generator=g)
    ranks, bounds = [8, 3, 24, 1], [0, 1, 2, 5, 7, 30, 33, 34]  # rows 1, 5-6 and 34-39 in none
    a = [torch.randn(r, 96, generator=g) for r in ranks]
    b = [torch.randn(r, 130, generator=g) for r in ranks]
    want = out.clone()
    reference(x, want, a, b, bounds)
    got = out.clone()
    torch.ops.vkv.lora_segments(x, got, a, b, bounds)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[34:], out[34:]) and torch.equal(got[5:7], out[5:7])
    with pytest.raises(RuntimeError, match="B must be"):
        torch.ops.vkv.lora_segments(x, got, a[:1], [b[1]], bounds[:2])


def test_vkv_generate_runs_with_an_adapter_and_refuses_lora_flags_that_would_do_nothing(adapters, capsys):
    """`vkv generate --enable-lora --lora PATH` gives the adapter's tokens; --enable-lora without
    an adapter (or --lora without --enable-lora) is refused rather than ignored."""
    from engine.cli import main
    from engine.models import load_tokenizer
    ids, _, refs, root = adapters
    prompt = load_tokenizer(None).decode(ids[0])  # (PROMPTS[0], which encodes back to ids[0])
    assert load_tokenizer(None).encode(prompt) == ids[0]
    main(["generate", "--enable-lora", "--lora", str(root / "all"), "--max-tokens", str(N), "--json", prompt])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["outputs"][0]["token_ids"] == refs["all"][0]
    for argv in (["generate", "--enable-lora", "hi"], ["generate", "--lora", str(root / "all"), "hi"]):
        with pytest.raises(SystemExit, match="lora"):
            main(argv)


def test_malformed_adapter_files_are_refused_by_name(tmp_path):
    """A review's reproducers escaped as RecursionError, ZeroDivisionError, IndexError,
    OverflowError and MemoryError (a 500 from the server, not a 400 naming the adapter)."""
    import json

    from safetensors.torch import save_file

    from engine.models.config import ModelConfig
    from engine.request.lora_request import LoRARequest
    from engine.worker.lora import load_adapter

    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    good = {key + "A.weight": torch.ones(2, 16), key + "B.weight": torch.ones(16, 2)}

    def adapter(name, config, tensors=None):
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        if tensors is not None:
            save_file(tensors, str(path / "adapter_model.safetensors"))
        return LoRARequest(name, 1, str(path))

    cases = [adapter("deep", "[" * 100_000 + "]" * 100_000, good),
             adapter("rank0", {"r": 2}, {key + "A.weight": torch.ones(0, 16), key + "B.weight": torch.ones(16, 0)}),
             adapter("scalar", {"r": 2}, {key + "A.weight": torch.tensor(1.0), key + "B.weight": torch.ones(16, 2)}),
             adapter("bigint", '{"r": 2, "lora_alpha": ' + "9" * 400 + "}", good),
             adapter("sparse", {"r": 2})]
    with open(tmp_path / "sparse" / "adapter_model.safetensors", "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: no disk used
    for request in cases:
        with pytest.raises(ValueError, match=f"LoRA adapter {request.lora_name!r}"):
            load_adapter(request, cfg, 8, torch.device("cpu"), torch.float32)
    assert load_adapter(adapter("good", {"r": 2}, good), cfg, 8, torch.device("cpu"), torch.float32).rank == 2
