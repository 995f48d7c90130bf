"""A GGUF file served as it is stored (quantization="gguf"): the bundled model's Q4_1 projections
and Q8_0 embedding stay in their blocks, every served type loads as the matrices transformers'
loader gives, and the engine scores and generates as the dequantized checkpoint does; a Q4_K_M
file's Q4_K and Q6_K matrices stay in theirs; a file cut short is refused by name."""
import pytest
import torch

import ext
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.gguf_weights import GgufStack, GgufWeight, read_gguf
from engine.models.gguf_weights import unpermute_rows
from engine.models.linear import Linear
from engine.models.loader import bundled_gguf, checkpoint_dir, load_config, read_checkpoint
from helpers import k_quant_blocks, k_quant_model, one_call_equals_layer_by_layer

pytestmark = pytest.mark.skipif(ext.cpu_kernels() is None, reason=f"CPU kernels unavailable: {ext.cpu_kernels_error()}")


def every_type_gguf(path, hidden=256, inter=512, heads=4, kv=2, layers=2, vocab=320):
    """A small Llama GGUF written by gguf-py whose matrices are every type vkv serves in its
    blocks (Q8_0 embedding, tied; Q4_K q and up, Q4_1 k, Q6_K v and down, Q4_0 o, Q8_0 gate), its
    norms F32: what transformers' GGUF loader reads in two seconds where the bundled file takes
    twelve."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q, GGUFWriter, quants
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("context_length", 128), ("embedding_length", hidden), ("block_count", layers),
                       ("feed_forward_length", inter), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv), ("rope.dimension_count", hidden // heads), ("vocab_size", vocab)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    rng, g = np.random.default_rng(0), torch.Generator().manual_seed(0)

    def add(name, kind, rows, cols):
        data = (k_quant_blocks(kind.name, rows, cols, g) if kind in (Q.Q4_K, Q.Q6_K)
                else quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.05, kind))
        writer.add_tensor(name, data, raw_dtype=kind)

    add("token_embd.weight", Q.Q8_0, vocab, hidden)
    writer.add_tensor("output_norm.weight", rng.standard_normal(hidden, dtype=np.float32))
    kv_rows = kv * hidden // heads
    for n in range(layers):
        for name, kind, rows, cols in (("attn_q", Q.Q4_K, hidden, hidden), ("attn_k", Q.Q4_1, kv_rows, hidden),
                                       ("attn_v", Q.Q6_K, kv_rows, hidden), ("attn_output", Q.Q4_0, hidden, hidden),
                                       ("ffn_gate", Q.Q8_0, inter, hidden), ("ffn_up", Q.Q4_K, inter, hidden),
                                       ("ffn_down", Q.Q6_K, hidden, inter)):
            add(f"blk.{n}.{name}.weight", kind, rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{n}.{name}.weight", rng.standard_normal(hidden, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return path


def test_the_files_blocks_are_the_matrices_transformers_loads(tmp_path):
    """Every tensor by its Hugging Face name, q and k rows un-permuted as transformers does:
    each block matrix of every served type dequantizes to transformers' fp32 tensor exactly (the
    tied LM head left to the embedding). vkv's GGUF conversion writes these tensors
    (loader._save_tensors), so this is also what a converted checkpoint holds."""
    from transformers import AutoModelForCausalLM
    path = every_type_gguf(tmp_path / "every_type.gguf")
    blocks = read_gguf(path, 4, 2)
    state = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert set(state) - set(blocks) == {"lm_head.weight"} and set(blocks) <= set(state)
    assert {w.type_name for w in blocks.values() if isinstance(w, GgufWeight)} == {"Q8_0", "Q4_0", "Q4_1", "Q4_K",
                                                                                    "Q6_K"}
    for name, value in blocks.items():
        plain = value.dequantized() if isinstance(value, GgufWeight) else value
        assert torch.equal(plain, state[name]), name


def test_a_truncated_file_is_refused_by_name_before_anything_is_converted(tmp_path, monkeypatch):
    """A GGUF cut short (a download stopped early) fails its conversion naming the tensor that runs
    past the file's end, and leaves no converted directory for the next start to take."""
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path / "cache"))
    path = every_type_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="tensor 'blk.1.ffn_norm.weight': bytes .* past the file's end"):
        checkpoint_dir(str(path))
    assert not list((tmp_path / "cache" / "models").glob("cut-*/config.json"))


def test_the_bundled_checkpoint_is_its_files_blocks_dequantized():
    """The bundled model converted once (checkpoint_dir): its Q4_1 projections and Q8_0 embedding
    in fp32, names and values as its blocks give them, and no separate LM head (tied)."""
    cfg = load_config(None)
    blocks = read_gguf(bundled_gguf(), cfg.num_heads, cfg.num_kv_heads)
    state, _ = read_checkpoint(checkpoint_dir(None))
    assert set(blocks) == set(state) and "lm_head.weight" not in state
    assert {w.type_name for w in blocks.values() if isinstance(w, GgufWeight)} == {"Q4_1", "Q8_0"}
    for name, value in blocks.items():
        plain = value.dequantized() if isinstance(value, GgufWeight) else value
        assert torch.equal(plain, state[name]), name


def test_a_files_k_quant_matrices_stay_in_their_blocks_and_multiply_as_the_format_defines(tmp_path):
    """What a Q4_K_M file holds (the bundled model's rows are too short for k-quants: 576 is not a
    multiple of 256): a Llama q projection at Q4_K and a v projection at Q6_K, written by gguf-py,
    come back in their blocks (rows interleaved by eight), the q rows un-permuted whole; each Linear
    over the file's rows gives x W^T with W gguf-py's dequantization within fp32's accumulation
    bound, and over the interleaved rows (x as int8 blocks) within rounding x's bound."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    g = torch.Generator().manual_seed(5)
    q, v = k_quant_blocks("Q4_K", 16, 512, g), k_quant_blocks("Q6_K", 8, 512, g)
    writer = GGUFWriter(tmp_path / "k.gguf", "llama")
    writer.add_tensor("blk.0.attn_q.weight", q, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.0.attn_v.weight", v, raw_dtype=GGMLQuantizationType.Q6_K)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    state = read_gguf(tmp_path / "k.gguf", num_heads=4, num_kv_heads=2)
    for name, raw, kind, heads in (("q_proj", q, "Q4_K", 4), ("v_proj", v, "Q6_K", None)):
        weight = state[f"model.layers.0.self_attn.{name}.weight"]
        assert isinstance(weight, GgufWeight) and weight.type_name == kind and weight.k == 512 and weight.by_eight
        exact = quants.dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)
        if heads:
            exact = exact[unpermute_rows(len(exact), heads)]
        assert torch.equal(weight.dequantized().double(), torch.from_numpy(exact))
        x = torch.randn(3, 512, generator=g)
        for held, how in ((weight.plain(), "float32 arithmetic"), (weight, "int8 activations, integer sums")):
            linear = Linear(512, len(exact))
            linear.hold_gguf(held)
            assert linear.pack() == f"GGUF {kind} blocks, unpacked a super-block at a time ({how})"
            for rows in (x[:1], x):  # decode's one row, and a prefill's several
                got, want = linear(rows).double(), rows.double() @ torch.from_numpy(exact).T
                terms, u = 512 + 3, 2.0 ** -24
                step = torch.zeros_like(rows.double()) if held is not weight else (
                    rows.double().view(-1, 16, 32).abs().amax(-1, keepdim=True) / 127 * (0.5 + 2.0 ** -14)
                ).expand(-1, 16, 32).reshape(-1, 512)
                bound = step @ torch.from_numpy(np.abs(exact)).T + terms * u / (1 - terms * u) * (
                    (rows.double().abs() + step) @ torch.from_numpy(np.abs(exact)).T)
                assert ((got - want).abs() <= bound).all(), (kind, how)


TEXT = ("The capital of France is Paris. It is known for the Eiffel Tower and the Louvre, the world's most visited "
        "art museum. The city lies on the Seine, in the north of the country, and has been a centre of finance, "
        "diplomacy, commerce, fashion and science for centuries. About two million people live in the city itself, "
        "and more than twelve million in its metropolitan area. Its public transport network, the Metro, opened in "
        "1900 and carries several million passengers a day.")


def test_served_in_blocks_it_scores_and_generates_as_the_dequantized_model(monkeypatch):
    """Teacher-forced logprobs of 103 tokens of text and 8 greedy tokens after it, in blocks and
    dequantized. With x in fp32 (every weight as the format defines it, summed in another order)
    they agree to fp32's accumulation error over 30 layers: 3e-5 here, bound 1e-3. As served (x as
    int8 blocks, llama.cpp's arithmetic) rounding x moves each logprob by 0.055 on average (0.24 at
    most) and the text's perplexity by 0.06% (0.42% over 5,108 held-out tokens: gguf_blocks.json):
    bound 0.1 and 1%; greedy tokens the same either way (a near tie could flip one; none here)."""
    import math

    from engine.models.gguf_weights import GgufWeight
    score = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0)
    blocks = LLM(quantization="gguf", kv_cache_memory=32 << 20, max_model_len=256)
    assert "GGUF Q4_1 blocks, unpacked in registers (int8 activations" in blocks.stats().platform["gemm"]
    served = blocks.generate([TEXT], score, use_tqdm=False)[0]
    monkeypatch.setattr(GgufWeight, "quantizes_x", property(lambda self: False))
    exact = blocks.generate([TEXT], score, use_tqdm=False)[0]
    plain = LLM(quantization="dequantize", kv_cache_memory=32 << 20, max_model_len=256).generate([TEXT], score, use_tqdm=False)[0]

    def logprobs(out):
        return [lp[t].logprob for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]

    assert exact.outputs[0].token_ids == served.outputs[0].token_ids == plain.outputs[0].token_ids
    assert max(abs(a - b) for a, b in zip(logprobs(exact), logprobs(plain))) < 1e-3
    moved = [abs(a - b) for a, b in zip(logprobs(served), logprobs(plain))]
    assert len(moved) == 103 and sum(moved) / len(moved) < 0.1
    assert abs(math.exp((sum(logprobs(plain)) - sum(logprobs(served))) / len(moved)) - 1) < 0.01


def test_a_q4_k_m_layout_decodes_in_one_call_as_layer_by_layer_and_scores_as_its_dequantized_model(tmp_path):
    """A model laid out as a Q4_K_M file (helpers.k_quant_model): its k-quants interleaved by eight
    meet x as int8 blocks; layer 0's qkv holds Q4_K q and k beside a Q6_K v, a GgufStack that
    decode_layers takes as a head and a tail. One-row steps run every layer in one native call (in
    one parallel region on the vector builds) and give the layer-by-layer path's tokens and
    logprobs to the bit; teacher-forced logprobs are within rounding x of the dequantized model's
    (transformers' GGUF loader, fp32): 0.1 on average, 1% in perplexity."""
    import math
    path = k_quant_model(tmp_path / "q4_k_m.gguf")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(model=path, quantization="gguf", kv_cache_memory=16 << 20, max_model_len=256)
        model = llm.engine.model
        gemm = llm.stats().platform["gemm"]
        assert "GGUF Q4_K + Q6_K blocks" in gemm and "every layer in one native call" in gemm, gemm
        assert isinstance(model.model.layers[0].self_attn.qkv_proj.gguf, GgufStack)
        assert isinstance(model.model.layers[1].self_attn.qkv_proj.gguf, GgufWeight)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

        def run():
            out = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
            return [(t, lp[t].logprob) for t, lp in zip(out.token_ids, out.logprobs)]

        one_call_equals_layer_by_layer(model, run, in_one_region=True)
        score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        served = llm.generate([TEXT], score, use_tqdm=False)[0]
        exact = LLM(model=path, quantization="dequantize", kv_cache_memory=16 << 20, max_model_len=256).generate([TEXT], score, use_tqdm=False)[0]
    finally:
        torch.set_num_threads(threads)

    def logprobs(out):
        return [lp[t].logprob for t, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]

    moved = [abs(a - b) for a, b in zip(logprobs(served), logprobs(exact))]
    assert len(moved) == 103 and 0 < sum(moved) / len(moved) < 0.1
    assert abs(math.exp((sum(logprobs(exact)) - sum(logprobs(served))) / len(moved)) - 1) < 0.01


def test_several_steps_a_call_over_blocks_pick_the_tokens_single_steps_pick(monkeypatch):
    """Multi-step decode over blocks (num_scheduler_steps=8): each step's layers, its logits from
    the blocks LM head and the next step's embedding row from the blocks embedding in one native
    call, the tokens that single steps pick."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    one = LLM(quantization="gguf", kv_cache_memory=16 << 20)
    several = LLM(quantization="gguf", kv_cache_memory=16 << 20, num_scheduler_steps=8)
    assert one.engine.model.decode and several.engine.model.multi_step
    want = one.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
    model, ran = several.engine.model, []
    steps = model.greedy_steps
    monkeypatch.setattr(model, "greedy_steps", lambda *args: ran.append(steps(*args)) or ran[-1])
    assert several.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert [tokens.shape[0] for tokens in ran] == [8, 8, 3]  # the prompt's step, then 8 + 8 + 3 in three calls


@pytest.mark.parametrize("settings, message", [
    ({"model": "random:tiny"}, "serves a .gguf file"),
    ({"quantization": "awq"}, "unknown quantization"),
    ({"enable_sleep_mode": True}, "enable_sleep_mode"),
    ({"enable_lora": True}, "LoRA"),
])
def test_what_blocks_cannot_serve_yet_is_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"quantization": "gguf", **settings})


def test_the_default_keeps_a_files_blocks_where_they_serve_and_dequantizes_elsewhere(tmp_path):
    """quantization's default (EngineConfig.gguf_blocks): the bundled Q4_1 file in its blocks on
    the CPU; dequantized with LoRA, sleep mode, two ranks, fp16 arithmetic, by name, or for a
    file whose matrices are mostly of a type without a kernel (F16 here; Q5_K alike), which the
    cached conversion dequantizes once rather than every start. bf16 over blocks computes in fp32
    everywhere (a CPU with native bf16 once took bf16 there and lost the one-call decode step)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    assert EngineConfig().gguf_blocks and EngineConfig(quantization="gguf").gguf_blocks
    # bf16 over blocks computes in fp32 on every CPU (their kernels take fp32 x), native bf16 or not
    bf16 = EngineConfig(dtype="bfloat16")
    assert bf16.gguf_blocks and bf16.compute_dtype == torch.float32 and bf16.kv_dtype == torch.bfloat16
    for settings in ({"enable_lora": True}, {"enable_sleep_mode": True}, {"tensor_parallel_size": 2},
                     {"dtype": "float16"}, {"quantization": "dequantize"}, {"model": "random:tiny"}):
        assert not EngineConfig(**settings).gguf_blocks, settings
    rng = np.random.default_rng(0)
    for name, kind, served in (("f16", "F16", False), ("q8", "Q8_0", True)):
        writer = GGUFWriter(str(tmp_path / f"{name}.gguf"), "llama")
        values = rng.standard_normal((64, 64)).astype(np.float32)
        writer.add_tensor("blk.0.attn_q.weight", quants.quantize(values, GGMLQuantizationType[kind]),
                          raw_dtype=GGMLQuantizationType[kind])
        writer.add_tensor("rope_freqs.weight", np.ones(32, np.float32))  # (llama.cpp's Llama 3: skipped)
        for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
            step()
        writer.close()
        assert EngineConfig(model=str(tmp_path / f"{name}.gguf")).gguf_blocks == served, name
    assert list(read_gguf(tmp_path / "q8.gguf", num_heads=4, num_kv_heads=2)) == ["model.layers.0.self_attn.q_proj.weight"]
