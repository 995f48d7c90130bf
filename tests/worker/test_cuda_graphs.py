"""The CPU side of decode graphs and of the FlexAttention backend: which steps a graph takes,
when the engine runs eagerly and says why, the capture sizes, and FlexAttention serving the
engine's layouts (torch's unfused path) with sdpa's tokens. The graphs themselves are captured
and compared with eager steps on a GPU (tests/worker/test_gpu.py)."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.worker.cuda_graphs import DecodeGraphs, capture_sizes, why_eager
from helpers import assert_pool_whole


def test_capture_sizes_are_vllms_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_why_a_step_runs_eagerly():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert why_eager(cuda, False, "flash", 1, False) is None
    assert why_eager(cuda, False, "flex", 1, False) is None
    assert why_eager(cpu, False, "native", 1, False) == "not a CUDA device"
    assert why_eager(cuda, True, "flash", 1, False) == "enforce_eager"
    assert "not captured" in why_eager(cuda, False, "sdpa", 1, False)
    assert why_eager(cuda, False, "flash", 2, False) == "tensor parallelism"
    assert why_eager(cuda, False, "flash", 1, True).startswith("sleep mode")


def test_enforce_eager_is_vllms_flag():
    import argparse

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_cli_args(p.parse_args(["--enforce-eager", "--device", "cpu"])).enforce_eager
    assert not EngineConfig.from_cli_args(p.parse_args(["--device", "cpu"])).enforce_eager


@pytest.mark.parametrize("layout, kernel", [("per_layer", "native"), ("paged", "native"), ("paged", "flex")])
def test_a_buckets_static_batch_padded_with_the_last_sequence_gives_the_eager_tokens(layout, kernel):
    """What a graph replays, run eagerly on the CPU: steps of 5 sequences down to 1 copied into
    the static batch of the bucket above (8, 4, 4, 2, 1), the padding rows the last sequence
    again (they write what it writes where it writes it); the same tokens as plain steps, every
    decode step through the buckets, and the pool whole afterwards."""
    prompts = [[1 + (i * 11 + j) % 400 for j in range(n)] for i, n in enumerate((3, 17, 9, 30, 5))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 4, 7, 2, 12)]
    outs = {}
    for static in (False, True):
        llm = LLM(model="random:smollm2-135m", device="cpu", attention_backend=kernel, kv_layout=layout,
                  max_num_seqs=8, kv_cache_memory=16 << 20)
        runner = llm.engine.core.runner
        if static:
            runner.graphs = runner._capture(capture_sizes(8))
            assert isinstance(runner.graphs, DecodeGraphs) and not runner.graphs.graphs  # nothing captured off a GPU
        outs[static] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if static:
            assert runner.graphs.replays >= 11  # every decode step (the longest request's 11 after its first token)
        assert_pool_whole(llm)
        llm.engine.close()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("layout, block_size", [("paged", 16)])
def test_flex_serves_the_engines_layouts_with_sdpas_tokens(layout, block_size):
    """FlexAttention named on the CPU (unfused there) over the block table:
    prompts of several lengths (prefill chunks on sdpa, decodes in one flex call per layer),
    the same greedy tokens as sdpa, and the pool whole afterwards."""
    prompts = [[1 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((5, 40, 23))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for kernel in ("sdpa", "flex"):
        llm = LLM(model="random:smollm2-135m", device="cpu", attention_backend=kernel, kv_layout=layout,
                  block_size=block_size, max_num_batched_tokens=32,  # chunks: decodes beside prefills
                  kv_cache_memory=8 << 20)  # (the unfused path reads all of it)
        assert llm.engine.platform()["decode"] == "eager (not a CUDA device)"
        outs[kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_whole(llm)
        llm.engine.close()
    assert outs["flex"] == outs["sdpa"]


def test_flex_is_not_chosen_on_the_cpu_unless_named():
    llm = LLM(model="random:smollm2-135m", device="cpu", kv_layout="paged")
    assert llm.engine.attention.name != "flex"
    llm.engine.close()
    with pytest.raises(ValueError, match="reads every row of the cache"):  # unmapped rows of a virtual one
        LLM(model="random:smollm2-135m", device="cpu", kv_layout="per_layer", attention_backend="flex")
    with pytest.raises(ValueError, match="power of two rows, 16 or more"):
        LLM(model="random:smollm2-135m", device="cpu", kv_layout="paged", attention_backend="flex", block_size=8)
