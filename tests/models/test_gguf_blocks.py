"""A GGUF file served as it is stored (quantization="gguf"): the bundled model's Q4_1 projections
and Q8_0 embedding stay in their blocks, load as the same matrices transformers' loader gives,
and the engine scores and generates as the dequantized checkpoint does."""
import pytest
import torch

import ext
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.gguf_weights import GgufWeight, read_gguf
from engine.models.loader import bundled_gguf, checkpoint_dir, load_config, read_checkpoint

pytestmark = pytest.mark.skipif(ext.cpu_kernels() is None, reason=f"CPU kernels unavailable: {ext.cpu_kernels_error()}")


def test_the_files_blocks_are_the_matrices_transformers_loads():
    """Every tensor by its Hugging Face name, q and k rows un-permuted as transformers does:
    each block matrix dequantizes to the converted checkpoint's fp32 tensor exactly."""
    cfg = load_config(None)
    blocks = read_gguf(bundled_gguf(), cfg.num_heads, cfg.num_kv_heads)
    state, _ = read_checkpoint(checkpoint_dir(None))
    assert set(blocks) == set(state)
    kinds = {w.type_name for w in blocks.values() if isinstance(w, GgufWeight)}
    assert kinds == {"Q4_1", "Q8_0"}
    for name, value in blocks.items():
        plain = value.dequantized() if isinstance(value, GgufWeight) else value
        assert torch.equal(plain, state[name]), name


def test_served_in_blocks_it_scores_and_generates_as_the_dequantized_model():
    """Teacher-forced logprobs of one text under both: the same fp32 values, summed in another
    order (each block's products, then its scale and offset), so they agree to fp32's
    accumulation error over 30 layers, far below any near-tie; greedy text the same."""
    text = "The capital of France is Paris. It is known for the Eiffel Tower and"
    score = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, logprobs=0)
    outs = []
    for quantization in ("gguf", None):
        llm = LLM(quantization=quantization, kv_cache_memory=32 << 20, max_model_len=256)
        outs.append(llm.generate([text], score)[0])
        if quantization:
            assert "GGUF Q4_1 blocks" in llm.stats().platform["gemm"]
    blocks, plain = outs
    assert blocks.outputs[0].token_ids == plain.outputs[0].token_ids
    pairs = [(a[t].logprob, b[t].logprob) for t, a, b in
             zip(blocks.prompt_token_ids[1:], blocks.prompt_logprobs[1:], plain.prompt_logprobs[1:])]
    assert max(abs(a - b) for a, b in pairs) < 1e-3


@pytest.mark.parametrize("settings, message", [
    ({"model": "random:tiny"}, "serves a .gguf file"),
    ({"quantization": "awq"}, "unknown quantization"),
    ({"enable_sleep_mode": True}, "enable_sleep_mode"),
    ({"enable_lora": True}, "LoRA"),
])
def test_what_blocks_cannot_serve_yet_is_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"quantization": "gguf", **settings})
