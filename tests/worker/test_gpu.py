"""On a CUDA GPU only (skipped elsewhere): every GPU kernel present over every layout it reads
equals the sdpa reference on the device, and the engine generates the same greedy tokens with
each of them as with the reference, over VMM-backed KV memory."""
import pytest
import torch

import vmm
from engine import LLM, SamplingParams
from engine.worker.attention import StepAttention, pick_attention
from engine.models.ops import rope_table
from helpers import assert_pool_whole, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(vmm.cuda_unavailable_reason() is not None,
                                                  reason=f"no GPU: {vmm.cuda_unavailable_reason()}")]
KERNELS = ["flash", "flash-attn", "flash-attn-4", "flex"]


def usable(kernel: str, layout: str) -> bool:
    try:
        pick_attention(kernel, torch.device("cuda"), torch.bfloat16, layout, 128, 256)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layout", ["interleaved", "per_layer"])
def test_gpu_kernels_equal_the_reference_over_virtual_kv(kernel, layout):
    if not usable(kernel, layout):
        pytest.skip(f"{kernel} is not available here")
    from engine.kv.manager import KVManager
    from engine.kv.virtual import VirtualLayout
    from engine.models.config import ModelConfig
    from engine.request.sequence import Sequence

    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=4, num_heads=32,
                      num_kv_heads=8, head_dim=128)
    kv = KVManager(VirtualLayout(cfg, layout, 4, 2048, torch.bfloat16, vmm.CudaBackend(), 256, tile_rows=128))
    seqs = [(1, 700), (300, 300), (1, 1), (57, 1200)]
    held = [Sequence("r", 0, [1] * c, SamplingParams(), 0.0) for _, c in seqs]
    for s, (_, c) in zip(held, seqs):
        kv.admit(s)
        assert kv.ensure_mapped(s, c)
        table, rows = kv.layout.block_table([s], [c])
        for cache in kv.layout.k_caches + kv.layout.v_caches:
            cache[table[0][0], :c] = torch.randn(c, 8, 128, dtype=torch.bfloat16, device="cuda")
    batch = make_batch(seqs, *kv.layout.block_table(held, [c for _, c in seqs]), device="cuda")
    cos_sin = rope_table(1.0 / 10000 ** (torch.arange(0, 128, 2).float() / 128), 2048, torch.bfloat16, "cuda")
    tokens = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(tokens, h, 128, dtype=torch.bfloat16, device="cuda") for h in (32, 8, 8))
    want = StepAttention("sdpa", kv.layout.k_caches, kv.layout.v_caches, batch, cos_sin)(1, q.clone(), k.clone(), v.clone())
    got = StepAttention(kernel, kv.layout.k_caches, kv.layout.v_caches, batch, cos_sin)(1, q.clone(), k.clone(), v.clone())
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    kv.close()


@pytest.mark.parametrize("kernel", KERNELS)
def test_greedy_tokens_match_the_reference_kernel_on_the_gpu(kernel):
    if not usable(kernel, "interleaved"):
        pytest.skip(f"{kernel} is not available here")
    prompts = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is"]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    outs = {}
    for name in ("sdpa", kernel):
        llm = LLM(model="random:smollm2-135m", device="cuda", dtype="bfloat16", attention_backend=name,
                  kv_cache_memory=1 << 30)  # random weights: a GPU box need not hold the bundled package
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert_pool_whole(llm)
        llm.engine.close()
    same = sum(a[:6] == b[:6] for a, b in zip(outs["sdpa"], outs[kernel]))
    assert same == len(prompts), outs  # bf16 kernels may part ways late; the first tokens must agree


def test_the_default_kv_budget_leaves_room_for_a_worst_case_step():
    """Without kv_cache_memory the pool is sized after a profile run: a full step of
    max_num_batched_tokens runs after the pool took its share, with structured outputs' masks
    built on the logits' device."""
    llm = LLM(model="random:smollm2-135m", device="cuda", max_num_batched_tokens=2048, gpu_memory_utilization=0.9)
    prompts = [[1 + i % 500] * 1000 for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    guided = llm.generate(["Answer yes or no:"], SamplingParams(max_tokens=4, structured_outputs={"choice": ["yes", "no"]}),
                          use_tqdm=False)[0].outputs[0]
    assert guided.finish_reason == "stop" and guided.text in ("yes", "no")
    assert_pool_whole(llm)


@pytest.mark.parametrize("layout, kernel, block_size", [("interleaved", "flash", 16), ("per_layer", "flash", 16),
                                                        ("per_layer", "flex", 16), ("paged", "flex", 16),
                                                        ("paged", "flex", 128)])
def test_decode_graphs_give_the_eager_steps_tokens(layout, kernel, block_size):
    """Decode steps replayed as CUDA graphs (the default on a GPU) give the tokens eager steps
    give: five sequences of different lengths, so steps of 5, then fewer, pad up to a bucket
    (8, 4, 2, 1) with copies of their last sequence; the pool is whole afterwards."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is", "Once upon a time in a land",
               "1, 2, 3,"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 9, 17, 3, 30)]
    outs = {}
    for eager in (True, False):
        llm = LLM(model="random:smollm2-135m", device="cuda", dtype="bfloat16", attention_backend=kernel,
                  kv_layout=layout, block_size=block_size, kv_cache_memory=1 << 30, max_num_seqs=8,
                  enforce_eager=eager)
        assert ("CUDA graphs" in llm.engine.platform()["decode"]) != eager, llm.engine.platform()["decode"]
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_whole(llm)
        llm.engine.close()
    assert [len(t) for t in outs[False]] == [24, 9, 17, 3, 30]
    same = sum(a[:8] == b[:8] for a, b in zip(outs[True], outs[False]))
    assert same == len(prompts), outs  # bf16 GEMMs of another row count may part ways late


def test_graphs_are_off_where_a_step_reads_the_host():
    """sdpa reads the block table on the host: its engine runs eagerly and says why."""
    llm = LLM(model="random:smollm2-135m", device="cuda", attention_backend="sdpa", kv_cache_memory=1 << 30)
    assert llm.engine.platform()["decode"].startswith("eager (attention 'sdpa'")
    llm.engine.close()
