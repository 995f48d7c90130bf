"""The GPU attention calls, checked without a GPU: each library call the engine makes is
replaced by a pure-torch model of its documented contract, fed the exact arguments the engine
builds for every layout and for mixed prefill/decode batches, and must give what the sdpa
reference gives. FlashAttention-4's contract also loads whole 128-row tiles past each
sequence's length, which must be mapped and finite. The built-in op's schema is checked on
meta tensors, so a torch upgrade that changes it fails here first.

On a machine with CUDA (benchmarks/gpu_suite.py runs these there), the same batches also run
through the real kernels on CUDA tensors (test_the_real_kernels_on_cuda_give_what_sdpa_gives):
PyTorch's built-in flash op, and flash-attn and flash-attn-4 where installed. A kernel that is
installed and fails is a failure, not a skip; only a missing GPU, a missing package, or a GPU
the library itself does not support (flash-attn-4 before Hopper) skips, with the reason.
FlexAttention runs here as it is (torch's unfused path on the CPU), so its cases call the
library itself, on the CPU and, compiled, on CUDA."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.worker import attention, attention_step
from engine.worker.attention import StepAttention
from engine.models.ops import rope_table
from helpers import ROOT, TESTS, child_env, make_batch

pytestmark = pytest.mark.contracts  # benchmarks/gpu_suite.py runs these on a GPU, the real kernels too
HQ, HKV, D = 6, 2, 64
COS_SIN = rope_table(1.0 / 10000 ** (torch.arange(0, D, 2).float() / D), 1024, torch.float32, "cpu")


def causal_sdpa(q, k, v):
    return attention_step.sdpa_sequence(q, k, v)


def flash_varlen_contract(q, k_flat, v_flat, cu_seqlens_q, k_starts, max_q, max_k, seqused_k, tile=1):
    """FlashAttention's varlen call with seqused_k: sequence b's queries are rows cu_seqlens_q[b]
    .. [b+1]; its keys are seqused_k[b] rows from k_starts[b]; causal is bottom-right aligned.
    With tile > 1, the loads cover whole tiles past the used length, as FA-4's TMA does."""
    assert q.stride(-1) == k_flat.stride(-1) == v_flat.stride(-1) == 1
    assert cu_seqlens_q.dtype == k_starts.dtype == seqused_k.dtype == torch.int32
    assert len(k_starts) == len(cu_seqlens_q) == len(seqused_k) + 1
    out = torch.empty_like(q)
    for b in range(len(seqused_k)):
        qs, qe, ks, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(k_starts[b]), int(seqused_k[b])
        assert qe - qs <= max_q and n <= max_k
        loaded = -(-n // tile) * tile
        assert torch.isfinite(k_flat[ks:ks + loaded]).all() and torch.isfinite(v_flat[ks:ks + loaded]).all()
        out[qs:qe] = causal_sdpa(q[qs:qe], k_flat[ks:ks + n], v_flat[ks:ks + n])
    return out


def fa4_contract(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 seqused_k=None, causal=False, num_splits=0, **unused):
    assert causal and num_splits == 1 and not unused
    return flash_varlen_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                 tile=128), None


def with_kvcache_contract(q, k_cache, v_cache, cache_seqlens=None, cache_batch_idx=None, block_table=None,
                          causal=False, **unused):
    """flash_attn_with_kvcache: q [batch, q_len, H, D]; keys of batch row b are the first
    cache_seqlens[b] rows of k_cache[cache_batch_idx[b]], or of its blocks in block_table[b]."""
    assert causal and not unused and (cache_batch_idx is None) != (block_table is None)
    assert q.dim() == 4 and k_cache.stride(-1) == 1 and cache_seqlens.dtype == torch.int32
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        if block_table is None:
            keys, values = k_cache[int(cache_batch_idx[b]), :n], v_cache[int(cache_batch_idx[b]), :n]
        else:
            blocks = block_table[b, :-(-n // k_cache.shape[1])].long()
            keys, values = (c[blocks].flatten(0, 1)[:n] for c in (k_cache, v_cache))
        visible = min(q.shape[1], n)  # query rows aligned to positions before 0 see nothing
        out[b, q.shape[1] - visible:] = causal_sdpa(q[b, q.shape[1] - visible:], keys, values)
    return out


def caches(layout: str, seqs, block_size: int):
    torch.manual_seed(len(seqs))
    if layout == "paged":
        blocks = sum(-(-c // block_size) for _, c in seqs) + 2
        k, v = (torch.randn(blocks, block_size, HKV, D) for _ in range(2))
        order = torch.randperm(blocks).tolist()
        return [k], [v], [[order.pop() for _ in range(-(-c // block_size))] for _, c in seqs], block_size
    rows = 512
    if layout == "interleaved":
        whole = torch.randn(len(seqs) + 1, rows, 3, 2, HKV, D)
        k, v = whole[:, :, 1, 0], whole[:, :, 1, 1]
    else:
        k, v = (torch.randn(len(seqs) + 1, rows, HKV, D) for _ in range(2))
    return [k], [v], [[s] for s in torch.randperm(len(seqs) + 1)[:len(seqs)].tolist()], rows


BATCHES = [[(1, 40), (1, 300), (1, 7)], [(17, 17), (1, 200), (64, 100), (1, 1)], [(200, 450)]]


@pytest.mark.parametrize("seqs", BATCHES)
@pytest.mark.parametrize("kernel, layout", [("flash", "interleaved"), ("flash", "per_layer"),
                                            ("flash-attn-4", "interleaved"), ("flash-attn-4", "per_layer"),
                                            ("flash-attn", "interleaved"), ("flash-attn", "per_layer"),
                                            ("flash-attn", "paged"), ("flex", "interleaved"), ("flex", "per_layer"),
                                            ("flex", "paged")])
def test_the_engine_calls_each_library_as_its_contract_says(monkeypatch, kernel, layout, seqs):
    monkeypatch.setattr(attention, "flash_varlen", flash_varlen_contract)
    monkeypatch.setattr(attention, "library", {"flash-attn": lambda _: with_kvcache_contract,
                                               "flash-attn-4": lambda _: fa4_contract}.get(kernel, attention.library))
    block_size = 256 if layout == "paged" else 0  # flash-attn's block tables want multiples of 256 rows
    k_caches, v_caches, table, rows = caches(layout, seqs, block_size)
    if kernel == "flash-attn-4":  # whole tiles of every sequence are finite, as the KV cache leaves them
        for cache in k_caches + v_caches:
            cache[:, max(c for _, c in seqs):] = 0
    batch = make_batch(seqs, table, rows)
    tokens = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(tokens, h, D) for h in (HQ, HKV, HKV))
    reference = ([c.clone() for c in k_caches], [c.clone() for c in v_caches])
    want = StepAttention("sdpa", *reference, batch, COS_SIN, paged=layout == "paged")(0, q.clone(), k.clone(), v.clone())
    got = StepAttention(kernel, k_caches, v_caches, batch, COS_SIN, paged=layout == "paged")(0, q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", BATCHES)
@pytest.mark.parametrize("kernel, layout", [("flash", "interleaved"), ("flash", "per_layer"),
                                            ("flash-attn-4", "interleaved"), ("flash-attn-4", "per_layer"),
                                            ("flash-attn", "interleaved"), ("flash-attn", "per_layer"),
                                            ("flash-attn", "paged"), ("flex", "interleaved"), ("flex", "per_layer"),
                                            ("flex", "paged")])
def test_the_real_kernels_on_cuda_give_what_sdpa_gives(kernel, layout, seqs):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the contracts above stand in for the kernels")
    if kernel != "flash" and attention.library(kernel) is None:
        pytest.skip(f"{kernel} is not installed")
    if kernel == "flash-attn-4" and attention.fa4_support(D, torch.cuda.get_device_capability())[0] == 0:
        pytest.skip(f"flash-attn-4 does not run here: {attention.fa4_support(D, torch.cuda.get_device_capability())[1]}")
    block_size = 256 if layout == "paged" else 0
    k_caches, v_caches, table, rows = caches(layout, seqs, block_size)
    if kernel == "flash-attn-4":
        for cache in k_caches + v_caches:
            cache[:, max(c for _, c in seqs):] = 0
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    k_caches, v_caches = [c.to(**cuda) for c in k_caches], [c.to(**cuda) for c in v_caches]
    batch = make_batch(seqs, table, rows, device="cuda")
    tokens = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(tokens, h, D, **cuda) for h in (HQ, HKV, HKV))
    cos_sin = COS_SIN.to(**cuda)
    reference = ([c.clone() for c in k_caches], [c.clone() for c in v_caches])
    want = StepAttention("sdpa", *reference, batch, cos_sin, paged=layout == "paged")(0, q.clone(), k.clone(), v.clone())
    got = StepAttention(kernel, k_caches, v_caches, batch, cos_sin, paged=layout == "paged")(0, q, k, v)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)  # bf16: 2^-8 per value, summed


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_flex_reads_blocks_shared_by_several_sequences_at_their_place(device):
    """A prefix's blocks (and a fork's) sit in several sequences' tables at the same place: the
    block mask finds each block's place once for all of them. Two sequences share their first
    two blocks, a third shares none; all decode over the block table in random order."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    torch.manual_seed(3)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    block, blocks = 16, 12
    k_caches, v_caches = ([torch.randn(blocks, block, HKV, D, dtype=dtype, device=device)] for _ in range(2))
    order = torch.randperm(blocks).tolist()
    shared = [order.pop(), order.pop()]
    table = [shared + [order.pop()], shared + [order.pop(), order.pop()], [order.pop()]]
    seqs = [(1, 40), (1, 60), (1, 9)]
    batch = make_batch(seqs, table, block, device=device)
    q, k, v = (torch.randn(len(seqs), h, D, dtype=dtype, device=device) for h in (HQ, HKV, HKV))
    cos_sin = COS_SIN.to(device=device, dtype=dtype)
    # the new rows land in each sequence's own last block, so sdpa and flex may share nothing else
    reference = ([c.clone() for c in k_caches], [c.clone() for c in v_caches])
    want = StepAttention("sdpa", *reference, batch, cos_sin, paged=True)(0, q.clone(), k.clone(), v.clone())
    got = StepAttention("flex", k_caches, v_caches, batch, cos_sin, paged=True)(0, q, k, v)
    tol = 2e-2 if device == "cuda" else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_flash_attention_4_tiles_are_mapped_and_zeroed_by_the_kv_cache():
    """The KV cache the engine builds for flash-attn-4 maps whole 128-row tiles and zeroes new
    pages; a contract that loads whole tiles from host pages mapped only as far as needed
    would die on an unmapped byte (a child process, so a fault fails this test only)."""
    script = textwrap.dedent("""
        import torch, vmm
        from engine.worker import attention
        from engine.worker.attention import StepAttention
        from engine.kv.manager import KVManager
        from engine.kv.virtual import VirtualLayout
        from engine.models.config import ModelConfig
        from engine.request.sampling_params import SamplingParams
        from engine.request.sequence import Sequence
        from helpers import make_batch
        from test_attention_contracts import COS_SIN, fa4_contract
        attention.library = lambda _: fa4_contract
        cfg = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=6,
                          num_kv_heads=2, head_dim=64)
        for layout in ("interleaved", "per_layer"):
            kv = KVManager(VirtualLayout(cfg, layout, 3, 1024, torch.float32, vmm.HostBackend(4096), 3000, tile_rows=128))
            seqs = [(1, 5), (130, 130), (1, 300)]
            held = [Sequence("r", 0, [1] * ctx, SamplingParams(), 0.0) for _, ctx in seqs]
            for s, (_, ctx) in zip(held, seqs):
                kv.admit(s)
                assert kv.ensure_mapped(s, ctx)
            batch = make_batch(seqs, *kv.layout.block_table(held, [c for _, c in seqs]))
            tokens = sum(q for q, _ in seqs)
            q, k, v = torch.randn(tokens, 6, 64), torch.randn(tokens, 2, 64), torch.randn(tokens, 2, 64)
            out = StepAttention("flash-attn-4", kv.layout.k_caches, kv.layout.v_caches, batch, COS_SIN)(1, q, k, v)
            assert torch.isfinite(out).all()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=str(Path(__file__).parent), env=child_env(str(TESTS)))
    assert done.returncode == 0 and "ok" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_the_builtin_flash_op_still_takes_the_engines_arguments():
    """torch.ops.aten._flash_attention_forward on meta tensors, with the shapes, dtypes and
    keyword arguments the flash kernel passes: a schema change in torch fails here."""
    meta = dict(device="meta")
    q = torch.empty(7, 8, 128, dtype=torch.bfloat16, **meta)
    k = torch.empty(4 * 512, 2, 128, dtype=torch.bfloat16, **meta)
    cu_q = torch.empty(4, dtype=torch.int32, **meta)
    starts = torch.empty(4, dtype=torch.int32, **meta)
    used = torch.empty(3, dtype=torch.int32, **meta)
    out = torch.ops.aten._flash_attention_forward(q, k, k, cu_q, starts, 5, 300, 0.0, True, False, seqused_k=used)
    assert out[0].shape == q.shape and out[0].dtype == q.dtype


def test_the_gpu_suite_explains_itself_and_refuses_without_a_gpu():
    suite = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py")]
    shown = subprocess.run(suite + ["--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "--out" in shown.stdout and "attention" in shown.stdout
    if not torch.cuda.is_available():
        refused = subprocess.run(suite + ["--out", "/nonexistent"], capture_output=True, text=True)
        assert refused.returncode == 2 and "no CUDA GPU" in refused.stderr


def test_flash_attention_4_is_admitted_only_where_the_library_runs_with_its_own_tile():
    """The library's head-size rule and KV tile (flash_attn/cute/interface.py), per GPU."""
    assert attention.fa4_support(64, (9, 0)) == (128, None)
    assert attention.fa4_support(128, (9, 0)) == (128, None)
    assert attention.fa4_support(256, (9, 0)) == (80, None)
    assert attention.fa4_support(128, (10, 0)) == (128, None)
    for head_dim, capability in ((256, (10, 0)), (100, (9, 0)), (264, (9, 0)), (64, (8, 0))):
        tile, why = attention.fa4_support(head_dim, capability)
        assert tile == 0 and why, (head_dim, capability)
    assert attention.tile_rows("flash", 64, torch.device("cpu")) == 1
