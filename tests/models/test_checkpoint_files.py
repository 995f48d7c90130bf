"""Nothing in a checkpoint directory can stop the engine or change its tokens without a word
(a review's reproducers): the weight files an index names and no others, only regular files
(a FIFO blocked the process for good), config.json checked and named, non-finite weights
refused, a damaged cached conversion converted again, a GGUF's cache keyed by its bytes, a
weights update from disk that would need another config refused, and the disk tier's namespace
taken from the bytes the engine loaded."""
import json
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from helpers import bundled_dir

from engine import LLM, SamplingParams
from engine.models import loader
from engine.models.config import ModelConfig
from engine.models.presets import PRESETS
from engine.models.weights import checkpoint_shapes

SHAPE = dict(PRESETS["tiny"], num_hidden_layers=2)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [[(7 * j) % 200 + 5 for j in range(40)]]


def tensors(seed: int, shape: dict = SHAPE) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: 1 + 0.1 * torch.randn(s, generator=g) if len(s) == 1 else torch.randn(s, generator=g) / s[1] ** 0.5
            for name, s in checkpoint_shapes(ModelConfig.from_hf(shape)).items()}


def checkpoint(path, seed: int = 0, shape: dict = SHAPE, files: dict | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint at path: config.json and model.safetensors (or `files`: {file name: tensors})."""
    path.mkdir(parents=True, exist_ok=True)
    ts = tensors(seed, shape)
    (path / "config.json").write_text(json.dumps(shape))
    for name, part in (files or {"model.safetensors": ts}).items():
        save_file(part, str(path / name))
    return ts


def greedy(model: str, **opts) -> list[int]:
    with LLM(model=model, kv_cache_memory=8 << 20, **opts) as llm:
        return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_an_index_names_the_weight_files_and_no_other_file_is_read(tmp_path):
    ts = checkpoint(tmp_path / "ref")
    names = sorted(ts)
    halves = {"model-00001-of-00002.safetensors": {n: ts[n] for n in names[::2]},
              "model-00002-of-00002.safetensors": {n: ts[n] for n in names[1::2]}}
    d = tmp_path / "sharded"
    checkpoint(d, files=halves)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    stale = {n: t + 1 for n, t in list(ts.items())[:3]}  # an earlier save's shard, left behind
    save_file(stale, str(d / "model-00001-of-00003.safetensors"))
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(d / "consolidated.safetensors"))
    assert greedy(str(d)) == greedy(str(tmp_path / "ref"))
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        loader.read_checkpoint(d)


def test_a_tensor_in_two_files_and_a_fifo_are_refused_by_name(tmp_path):
    ts = checkpoint(tmp_path / "two")
    save_file({"model.norm.weight": ts["model.norm.weight"] * 2}, str(tmp_path / "two" / "extra.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight.*two files"):
        loader.read_checkpoint(tmp_path / "two")
    checkpoint(tmp_path / "fifo")
    os.mkfifo(tmp_path / "fifo" / "z.safetensors")
    done = []
    reader = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, loader.read_checkpoint,
                                                                        tmp_path / "fifo")), daemon=True)
    reader.start()
    reader.join(10)
    assert done and "z.safetensors: not a regular file" in str(done[0].value)


@pytest.mark.parametrize("config,message", [
    ([1, 2], "a JSON object"),
    ({k: v for k, v in SHAPE.items() if k != "num_attention_heads"}, "num_attention_heads"),
    (dict(SHAPE, num_attention_heads=0), "num_attention_heads"),
    (dict(SHAPE, num_hidden_layers="2"), "num_hidden_layers"),
    (dict(SHAPE, rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(SHAPE, num_hidden_layers=10_000_000), "num_hidden_layers: 10000000, expected an integer"),
    (dict(SHAPE, num_hidden_layers=3000), "num_hidden_layers: 3000 layers, the weights hold 2"),
])
def test_a_bad_config_is_refused_naming_the_file_and_the_field(tmp_path, config, message):
    checkpoint(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as caught:
        LLM(model=str(tmp_path / "m"), kv_cache_memory=8 << 20)
    assert "config.json" in str(caught.value)


def test_non_finite_weights_are_refused_at_load_and_in_an_update(tmp_path):
    ts = checkpoint(tmp_path / "nan")
    ts["model.layers.1.mlp.down_proj.weight"][3, 4] = float("nan")
    save_file(ts, str(tmp_path / "nan" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight.*not finite"):
        LLM(model=str(tmp_path / "nan"), kv_cache_memory=8 << 20)
    good = checkpoint(tmp_path / "good")
    with LLM(model=str(tmp_path / "good"), kv_cache_memory=8 << 20) as llm:
        with pytest.raises(ValueError, match="model.norm.weight.*not finite"):
            llm.update_weights_from_tensor({**good, "model.norm.weight": torch.full((64,), float("inf"))})
        assert llm.engine.weights_version == 0


def test_an_update_from_disk_needing_another_config_is_refused(tmp_path):
    checkpoint(tmp_path / "tied")
    untied = dict(SHAPE, tie_word_embeddings=False)
    checkpoint(tmp_path / "untied", 1, untied)
    checkpoint(tmp_path / "theta", 1, dict(SHAPE, rope_theta=500000.0))
    with LLM(model=str(tmp_path / "tied"), kv_cache_memory=8 << 20) as llm:
        before = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for name, field in (("untied", "tie_word_embeddings"), ("theta", "rope_theta")):
            with pytest.raises(ValueError, match=f"{field}"):
                llm.update_weights_from_disk(str(tmp_path / name))
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
        assert llm.engine.weights_version == 0


def test_a_gguf_conversion_is_cached_by_its_bytes_and_a_damaged_one_is_done_again(tmp_path, monkeypatch):
    monkeypatch.setenv("VKV_TOKENIZER", str(bundled_dir()))  # (the bundled model's conversion, in the real cache)
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for f, byte in ((a, b"\1"), (b, b"\2")):  # same name, same size, other bytes
        f.parent.mkdir()
        f.write_bytes(byte * 4096)
    converted = []

    def convert(path, out, weights):  # stands in for transformers' conversion: a checkpoint per source
        converted.append(path)
        checkpoint(out, seed=path.read_bytes()[0])

    monkeypatch.setattr(loader, "_convert", convert)
    assert loader.checkpoint_dir(str(a)) != loader.checkpoint_dir(str(b))
    assert converted == [a, b]
    out = loader.checkpoint_dir(str(a))
    (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:1000])  # truncated
    assert greedy(str(a), quantization="dequantize") == greedy(str(tmp_path / "cache" / "models" / out.name))  # converted again
    assert converted == [a, b, a]


def test_the_disk_tier_namespace_is_the_loaded_bytes_and_the_weights_dtype(tmp_path, monkeypatch, own_weights):
    checkpoint(tmp_path / "m")
    opts = dict(kv_cache_memory=8 << 20, page_size=4096, kv_offloading_path=str(tmp_path / "disk"))
    rewrite = loader.read_checkpoint

    def read_then_rewrite(path):  # a trainer saves its next weights in place right after the read
        state, digest = rewrite(path)
        checkpoint(path, seed=1)
        return state, digest

    monkeypatch.setattr(loader, "read_checkpoint", read_then_rewrite)
    with LLM(model=str(tmp_path / "m"), **opts) as llm:
        old_space = llm.engine.kv.namespace
    monkeypatch.setattr(loader, "read_checkpoint", rewrite)
    with LLM(model=str(tmp_path / "m"), **opts) as llm:  # the seed-1 weights: another namespace
        assert llm.engine.kv.namespace != old_space
    import ext
    monkeypatch.setattr(ext, "bf16_gemm", lambda: (False, "an AVX2 CPU, simulated"))
    spaces = set()
    for dtype in ("float32", "bfloat16"):  # both compute in fp32 here: the weights' dtype differs
        with LLM(model=str(tmp_path / "m"), dtype=dtype, kv_cache_dtype="fp8", **opts) as llm:
            assert llm.engine.config.compute_dtype == torch.float32
            spaces.add(llm.engine.kv.namespace)
    assert len(spaces) == 2


def test_a_checked_file_is_read_again_unhashed_and_a_file_written_since_is_hashed_again(tmp_path, monkeypatch):
    """A weight file this process has read, checked and left unchanged is read again without
    hashing or checking it (loader._CHECKED); one rewritten in place, the same size, gives its new
    values and a new fingerprint; one written less than SETTLED seconds before its read is never
    remembered (a rewrite in the same clock tick would keep its identity)."""
    import hashlib
    checkpoint(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    state, digest = loader.read_checkpoint(tmp_path / "m")  # just written: hashed, not remembered
    assert loader._identity(os.stat(f)) not in loader._CHECKED
    monkeypatch.setattr(loader, "SETTLED", 0.0)
    assert loader.read_checkpoint(tmp_path / "m")[1] == digest
    assert loader._identity(os.stat(f)) in loader._CHECKED
    hashed, real = [], hashlib.sha256
    monkeypatch.setattr(loader.hashlib, "sha256", lambda *a: hashed.append(a) or real(*a))
    again, same = loader.read_checkpoint(tmp_path / "m")
    assert same == digest and len(hashed) == 2  # (the fingerprint and config.json's digest; not the weights)
    assert all(torch.equal(again[name], state[name]) for name in state)
    monkeypatch.undo()
    assert same == loader.weights_fingerprint(str(tmp_path / "m"))
    monkeypatch.setattr(loader, "SETTLED", 0.0)
    size = f.stat().st_size
    new = checkpoint(tmp_path / "m", seed=1)  # rewritten in place, the same size
    assert f.stat().st_size == size
    changed, other = loader.read_checkpoint(tmp_path / "m")
    assert other != digest and all(torch.equal(changed[name], new[name]) for name in new)
