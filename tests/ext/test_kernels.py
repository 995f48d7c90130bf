"""The native CPU kernels against their torch references: attention on random mixed batches
(prefill chunks and decodes, GQA, every layout's addressing, fp32 and bf16), the rotary
embedding and K/V store byte for byte, the fused norm and activation; and no kernel reads a
byte past a sequence's context (unmapped host pages would kill the process)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ext
from engine.models import ops
from engine.worker.attention import StepAttention
from helpers import ROOT, TESTS, child_env, k_quant_blocks, make_batch

pytestmark = pytest.mark.skipif(ext.cpu_kernels() is None, reason=f"CPU kernels unavailable: {ext.cpu_kernels_error()}")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
# Random draws a property test makes: all of them under this machine's own build; a quarter in
# the children that run this file again under each other ISA's build (every test still runs
# there, on fewer draws: the other builds share the source, and their cost is the suite's longest)
SHARE = 4 if os.environ.get("VKV_OTHER_ISA_RUN") else 1
F32, BF16 = torch.float32, torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def randn(*shape, dtype):
    """Normal values as a cache of `dtype` holds them (fp8 has no randn of its own); wide enough
    to reach fp8's subnormals and, for e4m3, its saturation."""
    x = torch.randn(*shape)
    return (x * 4).clamp(-448, 448).to(dtype) if dtype in (E4M3, E5M2) else x.to(dtype)


@settings(max_examples=60 // SHARE, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), layout=st.sampled_from(["interleaved", "per_layer", "paged"]),
       dtypes=st.sampled_from([(F32, F32), (BF16, BF16), (F32, BF16), (F32, E4M3), (F32, E5M2), (BF16, E4M3),
                               (BF16, E5M2)]),  # (activations, cache)
       heads=st.sampled_from([(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 3, 32), (4, 2, 256)]))
def test_native_attention_equals_the_reference_on_random_batches(data, layout, dtypes, heads):
    """(fp32, bf16) is bf16 KV under fp32 arithmetic, the CPU's bf16 path without native bf16;
    fp8 caches are kv_cache_dtype="fp8_e4m3" / "fp8_e5m2", decoded by the kernel as it loads."""
    (dtype, cache_dtype), (hq, hkv, dim) = dtypes, heads
    seqs = data.draw(st.lists(st.integers(1, 300).flatmap(
        lambda ctx: st.tuples(st.integers(1, min(ctx, 70)), st.just(ctx))), min_size=1, max_size=6))
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    layers = 2
    if layout == "paged":
        block_size, num_blocks = 16, sum(-(-c // 16) for _, c in seqs) + 3
        k_caches = [randn(num_blocks, block_size, hkv, dim, dtype=cache_dtype) for _ in range(layers)]
        v_caches = [randn(num_blocks, block_size, hkv, dim, dtype=cache_dtype) for _ in range(layers)]
        free = torch.randperm(num_blocks).tolist()
        table = [[free.pop() for _ in range(-(-c // 16))] for _, c in seqs]
    else:
        block_size, slots = 320, len(seqs) + 2
        if layout == "interleaved":  # every layer's K and V in one row: strided views
            rows = randn(slots, block_size, layers, 2, hkv, dim, dtype=cache_dtype)
            k_caches, v_caches = [rows[:, :, l, 0] for l in range(layers)], [rows[:, :, l, 1] for l in range(layers)]
        else:
            k_caches = [randn(slots, block_size, hkv, dim, dtype=cache_dtype) for _ in range(layers)]
            v_caches = [randn(slots, block_size, hkv, dim, dtype=cache_dtype) for _ in range(layers)]
        table = [[s] for s in torch.randperm(slots)[:len(seqs)].tolist()]
    batch = make_batch(seqs, table, block_size)
    tokens = sum(q for q, _ in seqs)
    q, k, v = (torch.randn(tokens, h, dim, dtype=dtype) for h in (hq, hkv, hkv))
    cos_sin = ops.rope_table(1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), 400, dtype, "cpu")
    reference_caches = ([c.clone() for c in k_caches], [c.clone() for c in v_caches])
    want = StepAttention("sdpa", *reference_caches, batch, cos_sin)(1, q.clone(), k.clone(), v.clone())
    got = StepAttention("native", k_caches, v_caches, batch, cos_sin)(1, q.clone(), k.clone(), v.clone())
    tolerance = 1e-4 if dtype == F32 and cache_dtype != dtype else TOLERANCE[dtype]  # both read the same rounded K, V
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)
    for mine, theirs in zip((k_caches[1], v_caches[1]), reference_caches):  # stored alike, bit for bit
        assert torch.equal(mine.view(torch.uint8), theirs[1].view(torch.uint8))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("query_heads", [9, 48])  # 3 query heads a KV head: the vector rows; 16: the GEMM
def test_a_nan_query_poisons_its_own_head_alone(dtype, query_heads):
    """The softmax holds each probability rounded to the activations' type in fp32 (attend_item's
    Pf), in a loop that vectorizes: a NaN score stays NaN through it, any payload (0x7fffffff in
    fp32; bf16 holds its own), on both read paths, and a NaN in one head reaches no other."""
    torch.manual_seed(0)
    keys, kv_heads, dim = 130, 3, 64
    k_cache, v_cache = (torch.randn(1, 256, kv_heads, dim).to(dtype) for _ in range(2))
    batch = make_batch([(1, keys)], [[0]], 256)
    q = torch.randn(1, query_heads, dim).to(dtype)
    q[0, 0, 5] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32).to(dtype)  # a NaN, all payload
    q[0, 1, 7] = float("nan")
    out = torch.empty_like(q)
    torch.ops.vkv.attention(q, k_cache, v_cache, batch.block_table, 256, batch.q_start, batch.q_len, batch.ctx_len,
                            dim ** -0.5, out)
    assert out[0, :2].isnan().all()
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, 2:].float().transpose(0, 1), *(c[0, :keys].float().repeat_interleave(query_heads // kv_heads, 1)
                                            [:, 2:].transpose(0, 1) for c in (k_cache, v_cache)))
    torch.testing.assert_close(out[0, 2:].float(), want[:, 0], atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("query_heads", [1, 16])  # a few rows: the vector loads; many: the widened GEMM
def test_every_fp8_value_decodes_exactly_and_stores_saturate(cache_dtype, query_heads):
    """Attention over one key returns its value row: a row holding every fp8 byte comes back as
    torch decodes it, bit for bit, NaN and infinity too (a NaN came back as 480 or 114,688), on
    both of the kernel's read paths. Stores round like torch and saturate at the format's
    largest value (e5m2 alone would give inf)."""
    codes = torch.arange(256, dtype=torch.uint8)
    v_cache = codes.view(cache_dtype).reshape(1, 1, 1, 256)
    k_cache = torch.zeros(1, 1, 1, 256, dtype=cache_dtype)
    batch = make_batch([(1, 1)], [[0]], 1)
    q, out = torch.randn(1, query_heads, 256), torch.empty(1, query_heads, 256)
    torch.ops.vkv.attention(q, k_cache, v_cache, batch.block_table, 1, batch.q_start, batch.q_len, batch.ctx_len,
                            0.0625, out)
    torch.testing.assert_close(out[0], v_cache[0, 0].float().expand(query_heads, 256), rtol=0, atol=0, equal_nan=True)
    big = torch.tensor([[[1e6] * 2 + [-1e6] * 2 + [3.0e-3, -7.1e-5, 0.33, 1e-9]]]).expand(1, 1, 8)
    k, v = big.clone(), big.clone()
    k_cache, v_cache = (torch.zeros(1, 4, 1, 8, dtype=cache_dtype) for _ in range(2))
    cos_sin = torch.cat([torch.ones(4, 4), torch.zeros(4, 4)], 1)  # position 0: no rotation
    torch.ops.vkv.rope_store(torch.zeros(1, 1, 8), k, v, torch.tensor([0]), cos_sin, k_cache, v_cache,
                             batch.block_table, 4, torch.tensor([0], dtype=torch.int32))
    top = torch.finfo(cache_dtype).max
    assert torch.equal(v_cache[0, 0, 0].float(), big[0, 0].clamp(-top, top).to(cache_dtype).float())
    assert v_cache[0, 0, 0].float().abs().max() == top


@pytest.mark.parametrize("cache_dtype", [F32, BF16])
def test_a_bf16_rope_table_under_fp32_rows_rotates_as_its_widened_copy(cache_dtype):
    """decode_layers runs fp32 rows over a bf16 model's bf16 table (no widened copy a step): the
    kernel widens each value as it reads it, so q, k and the stored rows equal, bit for bit,
    those rotated by the table widened to fp32 first."""
    torch.manual_seed(0)
    table = ops.rope_table(1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64), 50, BF16, "cpu")
    positions, seq = torch.tensor([3, 17, 49]), torch.zeros(3, dtype=torch.int32)
    batch = make_batch([(3, 50)], [[0]], 64)
    q, k, v = torch.randn(3, 9, 64), torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    results = []
    for cos_sin in (table, table.float()):
        qq, kk = q.clone(), k.clone()
        caches = [torch.zeros(1, 64, 3, 64, dtype=cache_dtype) for _ in range(2)]
        torch.ops.vkv.rope_store(qq, kk, v, positions, cos_sin, *caches, batch.block_table, 64, seq)
        results.append((qq, kk, *caches))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert not torch.equal(results[0][0], q)  # rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_and_activation_equal_their_references(dtype):
    torch.manual_seed(0)
    for rows, hidden in ((1, 576), (37, 576), (5, 960)):
        x, residual, weight = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype), \
            torch.rand(hidden, dtype=dtype)
        for r in (None, residual):
            got, got_r = ops.add_rms_norm(x.clone(), None if r is None else r.clone(), weight, 1e-5, True)
            want, want_r = ops.add_rms_norm(x.clone(), None if r is None else r.clone(), weight, 1e-5, False)
            torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
            assert torch.equal(got_r, want_r)
        gate_up = torch.randn(rows, 2 * hidden, dtype=dtype) * 4
        torch.testing.assert_close(ops.silu_and_mul(gate_up, True), ops.silu_and_mul(gate_up, False),
                                   atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("weights", [F32, BF16])
def test_the_panel_gemm_equals_f_linear(weights):
    """The panel GEMM at every step size (decode's single rows, register tiles of every height,
    panels cut short by an odd N, a bias) against F.linear over the same weight values."""
    from engine.models.linear import Linear
    torch.manual_seed(0)
    for k, n, bias in ((576, 960, False), (64, 37, True), (1536, 576, False), (200, 100, True)):
        panels = Linear(k, n, bias=bias)
        torch.nn.init.normal_(panels.weight, std=k ** -0.5)
        w = panels.weight.data.to(weights).float()  # the values the kernel multiplies by
        panels.weight.data = w.clone()
        if bias:
            torch.nn.init.normal_(panels.bias)
        assert panels.pack_panels(weights).startswith("vkv panel GEMM")
        for m in (1, 2, 3, 4, 5, 7, 12, 13, 32, 71, 200):
            x = torch.randn(m, k)
            want = torch.nn.functional.linear(x, w, panels.bias)
            got = panels(x)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            # a row alone (decode's one-row paths: two streams, or one prefetched non-temporally)
            # sums as it does inside any batch, bit for bit: a sequence's output never depends on its batch
            assert torch.equal(panels(x[-1:]), got[-1:])


def test_bf16_rows_over_bf16_panels_are_dot_products_within_fp32s_bound_or_refused():
    """With AVX512-BF16 (bf16_dot), bf16 x over bf16 panels runs in the CPU's bf16 dot products
    (ext/cpu/panels.h, Note [bf16 steps in bf16 dot products]): every product exact in fp32, so
    each output lies within fp32 summation's bound of the exact sum, gamma_(K+1) * sum |x| |w| +
    the bias's rounding (gamma_n = n u / (1 - n u), u = 2^-24), at every tile height, K blocks
    (K past 512, odd K's last pair) and N cut short; a bf16 out holds those sums rounded to nearest
    even. Without it, bf16 x is refused by name."""
    from engine.models.linear import Linear
    torch.manual_seed(0)
    x = torch.randn(13, 64).bfloat16()
    weights = Linear(64, 33)
    weights.pack_panels(BF16)
    out = torch.empty(13, 33)
    if not torch.ops.vkv.bf16_dot():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            torch.ops.vkv.linear_panels(x, weights.panels, None, out)
        return
    with pytest.raises(RuntimeError, match="bf16 x needs bf16 panels"):
        torch.ops.vkv.linear_panels(x, torch.zeros(2, 64, torch.ops.vkv.panel_width()), None, out)
    for k, n, bias in ((576, 960, False), (1025, 70, True), (63, 33, True), (2, 32, False)):
        layer = Linear(k, n, bias=bias)
        torch.nn.init.normal_(layer.weight, std=k ** -0.5)
        if bias:
            torch.nn.init.normal_(layer.bias)
        w = layer.weight.data.bfloat16()
        layer.weight.data = w.float()
        layer.pack_panels(BF16)
        b = layer.bias.detach() if bias else None
        for m in (1, 5, 12, 13, 25, 200):
            x = torch.randn(m, k).bfloat16()
            got = torch.empty(m, n)
            torch.ops.vkv.linear_panels(x, layer.panels, b, got)
            exact = x.double() @ w.double().T + (b.double() if bias else 0)
            terms = k + 1
            gamma = terms * 2.0 ** -24 / (1 - terms * 2.0 ** -24)
            bound = gamma * (x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0))
            assert ((got.double() - exact).abs() <= bound).all(), (k, n, m)
            rounded = torch.empty(m, n, dtype=BF16)  # bf16 out: the same sums, rounded as torch rounds
            torch.ops.vkv.linear_panels(x, layer.panels, b, rounded)
            assert torch.equal(rounded, got.bfloat16()), (k, n, m)


@pytest.mark.parametrize("given", [F32, BF16, torch.float16])
@pytest.mark.parametrize("panel", [F32, BF16])
def test_written_panels_are_torchs_rounding_transposed(given, panel):
    """write_panels against w.to(panel dtype) transposed into [P, K, width] by torch: whole panels
    (their 8 x 8 tiles), a K past a multiple of 8, rows starting and ending inside a panel, the
    bf16 rounding's ties, infinities and NaN."""
    width = torch.ops.vkv.panel_width()
    for n, k, row in ((4 * width, 48, 0), (3 * width, 61, 0), (width + 5, 40, 3), (2 * width - 7, 16, width + 2)):
        w = torch.randn(n, k) * 100
        if given == F32:  # halfway between two bf16 numbers: to the even one
            w[::3, ::5] = w[::3, ::5].bfloat16().float()
            w[::3, ::5].view(torch.int32).add_(0x8000)
        w[1, 2], w[2, 3], w[3, 4], w[-1, -1] = float("inf"), float("-inf"), float("nan"), 3e38
        w = w.to(given)
        panels = torch.full((-(-(row + n) // width), k, width), 7.0, dtype=panel)
        torch.ops.vkv.write_panels(panels, w, row)
        want = torch.full((panels.shape[0] * width, k), 7.0, dtype=panel)
        want[row:row + n] = w.float().to(panel)
        want = want.view(panels.shape[0], width, k).transpose(1, 2).contiguous()
        bits = torch.int16 if panel == BF16 else torch.int32  # (a NaN's bits: torch's vector and scalar
        assert torch.equal(panels.isnan(), want.isnan())     # conversions differ; any NaN will do)
        assert torch.equal(panels.view(bits)[~want.isnan()], want.view(bits)[~want.isnan()])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 7])
def test_gguf_blocks_unpack_to_the_formats_definition(kind, rows):
    """linear_gguf against x times gguf-py's `dequantize` of the same blocks (the format's
    definition), in fp64: within fp32's accumulation bound gamma_{k+2} sum|x||w| (each weight
    rounded once as the format defines it, then summed); dequantize_gguf's rows equal the
    oracle's bit for bit."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    qtype = GGMLQuantizationType[kind]
    n, k = 37, 576 if kind[-1] != "K" else 768  # n not a multiple of the kernel's 4 rows; k 18 blocks, or 3 super-blocks
    g = torch.Generator().manual_seed(rows)
    if kind[-1] == "K":
        blocks = k_quant_blocks(kind, n, k, g)
    else:
        w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).numpy()
        w[3] = 0.0  # an all-zero row: scale 0
        blocks = quants.quantize(w, qtype)
    exact = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float64))
    raw = torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    out = torch.empty(rows, n)
    torch.ops.vkv.linear_gguf(x, raw, int(qtype), bias, out)
    reference = x.double() @ exact.T + bias.double()
    u, terms = 2.0 ** -24, k + 2
    bound = terms * u / (1 - terms * u) * (x.double().abs() @ exact.abs().T + bias.double().abs())
    assert ((out.double() - reference).abs() <= bound).all()
    picked = torch.tensor([0, n - 1, 3, 3])
    rows_out = torch.empty(4, k)
    torch.ops.vkv.dequantize_gguf(raw, int(qtype), picked, rows_out)
    assert torch.equal(rows_out.double(), exact[picked])


# Each interleaved kind's outputs in the test below, kept for the other ISAs' runs to compare with:
# VNNI's dpbusd, AVX2's maddubs + madd and the scalar loop sum the same integers (no pair saturates),
# so every build gives the same bits (PARENT_BITS: the file a child reads them from).
BITS: dict[str, torch.Tensor] = {}
PARENT_BITS = "VKV_TEST_PARENT_GGUF_BITS"


@pytest.mark.parametrize("kind, by_eight", [(kind, by_eight) for kind in ("Q8_0", "Q4_0", "Q4_1")
                                             for by_eight in (False, True)] + [("Q4_K", True), ("Q6_K", True)],
                         ids=lambda v: {False: "rows", True: "interleaved"}.get(v, v) if isinstance(v, bool) else v)
def test_gguf_blocks_times_int8_activations_stay_within_the_quantization_step(kind, by_eight):
    """linear_gguf with quantize_x: each row of x as int8 blocks of 32 (d = max|x| / 127, q = x / d
    rounded), summed in integers. Against x times gguf-py's `dequantize` in fp64, the error is at
    most what rounding x moves, d (1/2 + 2^-14) per element (the 2^-14 for d's and 1/d's own
    rounding, 127 ulps at most), times |w|, plus fp32's accumulation bound over the terms. A row's
    output is the same bit for bit alone or in any batch, and a NaN in a row makes that row, alone,
    NaN. The same with the rows interleaved by eight (GgufWeight.interleaved), whose lookups
    (dequantize_gguf) give the oracle's rows and which `plain` turns back into the file's bytes;
    Q4_K and Q6_K (3 super-blocks a row) only so (Note [K-quants interleaved by eight]): Q4_K's
    six-bit scales and mins unpacked to bytes, 32 more per eight rows and super-block."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from engine.models.gguf_weights import GgufWeight
    qtype = GGMLQuantizationType[kind]
    n, k = (40 if by_eight else 37), (576 if kind[-1] != "K" else 768)
    g = torch.Generator().manual_seed(5)
    if kind[-1] == "K":
        blocks = k_quant_blocks(kind, n, k, g)
    else:
        w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)).numpy()
        w[3] = 0.0
        blocks = quants.quantize(w, qtype)
    exact = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float64))
    raw = torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8)
    if by_eight:
        weight = GgufWeight(raw, int(qtype), k).interleaved()
        extra = n // 8 * k // 256 * 32 if kind == "Q4_K" else 0
        assert weight.by_eight and weight.rows.numel() == raw.numel() + extra and torch.equal(weight.plain().rows, raw)
        raw = weight.rows
        picked = torch.tensor([0, n - 1, 3, 9, 17])
        rows_out = torch.empty(5, k)
        torch.ops.vkv.dequantize_gguf(raw, int(qtype), picked, rows_out)
        assert torch.equal(rows_out.double(), exact[picked])
    x, bias = torch.randn(9, k, generator=g), torch.randn(n, generator=g)
    x[0, :32] *= 1000  # one block's step far wider than the others'
    x[1, 32:64] = 0.0  # a block of zeros: d = 0
    x[2] = torch.randint(-3, 4, (k,), generator=g).float() / 8  # values on the grid: exactly representable
    out = torch.empty(9, n)
    torch.ops.vkv.linear_gguf(x, raw, int(qtype), bias, out, True)
    xb = x.double().view(9, k // 32, 32)
    half_step = (xb.abs().amax(-1, keepdim=True) / 127 * (0.5 + 2.0 ** -14)).expand_as(xb).reshape(9, k)
    u, terms = 2.0 ** -24, k + 3
    gamma = terms * u / (1 - terms * u)
    bound = half_step @ exact.abs().T + gamma * ((x.double().abs() + half_step) @ exact.abs().T + bias.double().abs())
    reference = x.double() @ exact.T + bias.double()
    assert ((out.double() - reference).abs() <= bound).all()
    assert (out.double() - reference).abs().max() > 1e-3  # (x is rounded: not the fp32 path's error)
    for rows in (slice(4, 5), slice(2, 4), slice(0, 3), slice(5, 9)):  # (every count of a tile's rows of x)
        alone = torch.empty(rows.stop - rows.start, n)
        torch.ops.vkv.linear_gguf(x[rows].contiguous(), raw, int(qtype), bias, alone, True)
        assert torch.equal(alone, out[rows])
    if by_eight and os.environ.get(PARENT_BITS):  # (in another ISA's run: the same bits as the parent's build)
        assert torch.equal(out, torch.load(os.environ[PARENT_BITS])[kind]), kind
    if by_eight:
        BITS[kind] = out.clone()
    x[4, 100] = float("nan")
    torch.ops.vkv.linear_gguf(x, raw, int(qtype), bias, out, True)
    assert out[4].isnan().all() and not out[torch.arange(9) != 4].isnan().any()
    with pytest.raises(RuntimeError, match="Q8_0, Q4_0 and Q4_1 weights, or any"):
        q4k = torch.from_numpy(k_quant_blocks("Q4_K", 4, 256, g)).view(torch.uint8)
        torch.ops.vkv.linear_gguf(torch.zeros(1, 256), q4k, 12, None, torch.empty(1, 4), True)


def test_gguf_blocks_of_the_wrong_shape_or_type_are_refused():
    raw = torch.zeros(4, 20, dtype=torch.uint8)  # 4 rows of one Q4_1 block
    out = torch.empty(1, 4)
    torch.ops.vkv.linear_gguf(torch.zeros(1, 32), raw, 3, None, out)
    for x, kind, message in ((torch.zeros(1, 64), 3, "blocks of its type"), (torch.zeros(1, 32), 13, "GGUF type 13"),
                             (torch.zeros(1, 32), 8, "blocks of its type")):
        with pytest.raises(RuntimeError, match=message):
            torch.ops.vkv.linear_gguf(x, raw, kind, None, out)
    with pytest.raises(RuntimeError, match="row 4 of 4"):
        torch.ops.vkv.dequantize_gguf(raw, 3, torch.tensor([4]), torch.empty(1, 32))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_last_logits_in_one_call_equal_the_steps_they_replace(dtype):
    """After decode_layers (fp32 x and residual), `last_logits` gives what the model's Python took
    a dozen operations for: rows picked, rounded to the model's dtype, the last norm, the LM head
    over panels, logits rounded as that dtype holds them. Bit for bit."""
    from engine.models.linear import Linear
    torch.manual_seed(0)
    hidden, vocab = 576, 1000
    head = Linear(hidden, vocab, bias=False)
    torch.nn.init.normal_(head.weight, std=hidden ** -0.5)
    head.pack_panels(dtype)
    norm = torch.rand(hidden).to(dtype)
    for rows, picked in ((1, [0]), (5, [4]), (7, [0, 3, 6]), (12, list(range(12)))):
        x, residual = torch.randn(rows, hidden), torch.randn(rows, hidden)
        index = torch.tensor(picked)
        h, _ = ops.add_rms_norm(x.to(dtype)[index], residual.to(dtype)[index], norm, 1e-5, True)
        want = head(h.float()).to(dtype).float()
        got = torch.empty(len(picked), vocab)
        torch.ops.vkv.last_logits(x, residual, index, norm, 1e-5, head.panels, dtype == BF16, got)
        assert torch.equal(got, want)
    # rows out of range, or a norm of the other dtype, are refused by name (the rows are read natively)
    x, residual = torch.randn(3, hidden), torch.randn(3, hidden)
    for index in (torch.tensor([3]), torch.tensor([-1]), torch.tensor([0, 1 << 40])):
        with pytest.raises(RuntimeError, match="out of range"):
            torch.ops.vkv.last_logits(x, residual, index, norm, 1e-5, head.panels, dtype == BF16,
                                      torch.empty(len(index), vocab))
    with pytest.raises(RuntimeError, match="final norm"):
        torch.ops.vkv.last_logits(x, residual, torch.tensor([0]), norm.to(F32 if dtype == BF16 else BF16), 1e-5,
                                  head.panels, dtype == BF16, torch.empty(1, vocab))


@settings(max_examples=80 // SHARE, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 9), n=st.integers(1, 300), ties=st.booleans(),
       special=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 299),
                                  st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0])),
                        max_size=4))
def test_the_greedy_row_max_equals_torch_max(rows, n, ties, special):
    """The sampler's native row_max gives torch.max(x, -1): each row's maximum and the first index
    holding it, NaN (at the first NaN) where a row has one; ties, infinities and signed zeros
    included, and rows that span the kernel's 64-wide second pass and its tail."""
    from engine.sample.sampler import row_max
    x = torch.randn(rows, n)
    if ties:
        x = x.round()  # many equal maxima
    for r, c, value in special:
        x[r % rows, c % n] = value
    got_values, got_indices = row_max(x)
    want_values, want_indices = x.max(-1)
    assert torch.equal(got_indices, want_indices)
    assert torch.equal(got_values.isnan(), want_values.isnan())
    kept = ~want_values.isnan()
    assert torch.equal(got_values[kept], want_values[kept])
    nothing = torch.full((rows, n), float("-inf"))  # a row that allows no token: -inf, at index 0
    assert torch.equal(row_max(nothing)[1], torch.zeros(rows, dtype=torch.long))


def greedy_pick_on(threads: int, h: torch.Tensor, head, rounded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_pick's (values, indices) for h over a packed LM head, run on `threads` threads."""
    values, indices = torch.empty(h.shape[0]), torch.empty(h.shape[0], dtype=torch.long)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.ops.vkv.greedy_pick(h, head.panels, head.pick, head.pick_bounds, head.pick_scales, rounded,
                                  torch.empty(h.shape[0], head.panels_n), values, indices)
    finally:
        torch.set_num_threads(before)
    return values, indices


@settings(max_examples=80 // SHARE, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(1, 4), n=st.integers(1, 2048), k=st.sampled_from([1, 8, 64, 200]), seed=st.integers(0, 1 << 30),
       twins=st.lists(st.tuples(st.integers(0, 299), st.integers(0, 299), st.sampled_from(["same", "ulp", "below bf16"])),
                      max_size=6),
       rivals=st.integers(0, 5), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       special=st.sampled_from([None, "nan h", "inf weight", "nan weight"]),
       kind=st.sampled_from(["fp32", "bf16 weights", "bf16 logits"]), far_twin=st.booleans(),
       threads=st.sampled_from([1, 2, 3]))
def test_the_greedy_pick_from_half_the_bytes_is_row_max_of_the_logits(rows, n, k, seed, twins, rivals, scale,
                                                                      special, kind, far_twin, threads):
    """greedy_pick (multi-step decode's token) reads a copy of the LM head in half the bytes (bf16
    beside fp32 panels; int8 and a scale a row beside bf16 ones), bounds each logit's distance to
    the full pass's, and recomputes the tokens that may win: its token is row_max's over the whole
    logits (bf16 logits: rounded to bf16 first, as the bf16 model rounds them), to the index (ties:
    the first), with rows that are exact
    twins, one ulp apart, or apart by less than bf16 can see, and with rivals of the winner that bf16
    may rank above it (with the bound taken as 0, such rivals change the token in about half of the
    cases); and non-finite rows are computed whole. The passes over the vocabulary are split over
    the threads (1, 2 or 3 here), each over its own run of panels: a twin of the winner half the
    vocabulary away lies in another thread's run, and the first of the two must still win."""
    from engine.models.linear import Linear
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    for a, b, how in twins:
        a, b = a % n, b % n
        w[b] = w[a] if how == "same" else torch.nextafter(w[a], torch.full_like(w[a], float("inf"))) \
            if how == "ulp" else w[a] + w[a].abs() * 2.0 ** -12  # the same bf16 rounding, another fp32 row
    h = torch.randn(rows, k, generator=gen) * scale
    top = int((h[0] @ w.T).argmax())
    for j in range(min(rivals, n - 1)):  # the winner's row, each weight moved by about 2^-9 of itself
        w[(top + 1 + j) % n] = w[top] * (1 + 2.0 ** -9 * torch.randn(k, generator=gen))
    if far_twin and n > 1:
        w[(top + n // 2) % n] = w[top]
    if special == "nan h":
        h[0, 0] = float("nan")
    elif special == "inf weight":
        w[n // 2, 0] = float("inf")
    elif special == "nan weight":
        w[n // 3, 0] = float("nan")
    head = Linear(k, n)
    head.weight.data = w
    head.pack_panels(torch.float32 if kind == "fp32" else torch.bfloat16)
    head.pack_pick()
    rounded = kind == "bf16 logits"
    full = torch.empty(rows, n)
    torch.ops.vkv.linear_panels(h, head.panels, None, full)
    if rounded:
        full = full.bfloat16().float()
    want_values, want_indices = full.max(-1)
    values, indices = greedy_pick_on(threads, h, head, rounded)
    assert torch.equal(indices, want_indices)
    assert torch.equal(values.isnan(), want_values.isnan())
    kept = ~want_values.isnan()
    assert torch.equal(values[kept], want_values[kept])



@pytest.mark.parametrize("kind", ["fp32", "bf16 weights", "bf16 logits"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_greedy_pick_takes_the_first_of_twins_in_two_threads_runs(kind, threads):
    """greedy_pick splits the vocabulary into one run of panels a thread and combines the runs'
    picks: of two equal winners in different runs, the one of lower index is the pick, as in
    row_max, whichever run holds it, and whatever the number of threads."""
    from engine.models.linear import Linear
    n, k = 1000, 64
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        w, h = torch.randn(n, k, generator=gen), torch.randn(2, k, generator=gen)
        top = int((h[0] @ w.T).argmax())
        w[(top + n // 2) % n] = w[top]  # after top or before it, by the seed
        head = Linear(k, n)
        head.weight.data = w
        head.pack_panels(torch.float32 if kind == "fp32" else torch.bfloat16)
        head.pack_pick()
        full = torch.empty(2, n)
        torch.ops.vkv.linear_panels(h, head.panels, None, full)
        if kind == "bf16 logits":
            full = full.bfloat16().float()
        want_values, want_indices = full.max(-1)
        values, indices = greedy_pick_on(threads, h, head, kind == "bf16 logits")
        assert torch.equal(indices, want_indices) and torch.equal(values, want_values), (seed, top)


@pytest.mark.parametrize("kind", ["fp32", "bf16 weights", "bf16 logits"])
def test_the_greedy_pick_of_a_zero_hidden_state_is_the_first_token(kind):
    """A zero hidden state makes every logit 0 and every bound 0: each token's lower bound is its
    upper bound is the floor, and the pick must still be row_max's, the first token, on any
    number of threads (a candidate test of `>` instead of `>=` would find none)."""
    from engine.models.linear import Linear
    head = Linear(64, 300)
    head.weight.data = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    head.pack_panels(torch.float32 if kind == "fp32" else torch.bfloat16)
    head.pack_pick()
    for threads in (1, 2, 3):
        values, indices = greedy_pick_on(threads, torch.zeros(2, 64), head, kind == "bf16 logits")
        assert indices.tolist() == [0, 0] and values.tolist() == [0.0, 0.0], (threads, indices, values)


def test_the_greedy_pick_refuses_outputs_of_the_wrong_shape():
    """The pick writes one value and one index a row: outputs of another size or type are refused
    before a byte is written (an index tensor one row short was written past its end)."""
    from engine.models.linear import Linear
    head = Linear(16, 100)
    head.weight.data = torch.randn(100, 16)
    head.pack_panels(torch.float32)
    head.pack_pick()
    h = torch.randn(2, 16)
    for best, picked in ((torch.empty(0), torch.empty(2, dtype=torch.long)),
                         (torch.empty(2), torch.empty(1, dtype=torch.long)),
                         (torch.empty(2), torch.empty(2)), (torch.empty(2, dtype=torch.long), torch.empty(2, dtype=torch.long))):
        with pytest.raises(RuntimeError, match="best: \\[rows\\] fp32, picked: \\[rows\\] int64"):
            torch.ops.vkv.greedy_pick(h, head.panels, head.pick, head.pick_bounds, head.pick_scales, False,
                                      torch.empty(2, 100), best, picked)

def test_attention_reads_nothing_past_each_context():
    """A real virtual KV cache on the host backend maps pages only as far as each sequence has
    grown; touching an unmapped byte is a SIGSEGV. The kernel runs in a child process so a stray
    read fails this test instead of killing the suite."""
    script = textwrap.dedent("""
        import torch, vmm
        from engine.worker.attention import StepAttention
        from engine.kv.manager import KVManager
        from engine.kv.virtual import VirtualLayout
        from engine.models.config import ModelConfig
        from engine.models.ops import rope_table
        from engine.request.sequence import Sequence
        from engine.request.sampling_params import SamplingParams
        from helpers import make_batch
        cfg = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=6,
                          num_kv_heads=2, head_dim=64)
        for layout in ("interleaved", "per_layer"):
            kv = KVManager(VirtualLayout(cfg, layout, 4, 1024, torch.float32, vmm.HostBackend(4096), 2000))
            seqs = [(1, 5), (300, 300), (1, 700), (37, 37)]
            held = [Sequence("r", 0, [1] * ctx, SamplingParams(), 0.0) for _, ctx in seqs]
            for s, (_, ctx) in zip(held, seqs):
                kv.admit(s)
                assert kv.ensure_mapped(s, ctx)  # pages up to the context, no further
            batch = make_batch(seqs, *kv.layout.block_table(held, [c for _, c in seqs]))
            tokens = sum(q for q, _ in seqs)
            q, k, v = torch.randn(tokens, 6, 64), torch.randn(tokens, 2, 64), torch.randn(tokens, 2, 64)
            cos_sin = rope_table(1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64), 1024, torch.float32, "cpu")
            out = StepAttention("native", kv.layout.k_caches, kv.layout.v_caches, batch, cos_sin)(2, q, k, v)
            assert torch.isfinite(out).all()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=str(TESTS), env=child_env())
    assert done.returncode == 0 and "ok" in done.stdout, (done.returncode, done.stderr[-2000:])


def other_isas() -> list[str]:
    """The kernel ISAs this machine can build besides its own (tests/prebuild.py's list, AVX-512
    through SIMDe included where its headers are missing: its test then says so)."""
    from prebuild import other_isas as isas
    return isas(buildable_only=False)


LEFT_OUT = ("other_isa", "without_the_native_kernels", "dead_builder", "only_an_error_in_the_source")


@pytest.mark.parametrize("isa", other_isas())
def test_every_other_isa_builds_and_equals_the_references(isa, tmp_path):
    """The kernels built for another ISA (VKV_CPU_ISA: on an AVX-512 machine the AVX2 and plain
    paths, on an AVX2 machine the plain one and the AVX-512 one emulated) pass this file's tests
    in a child process, GGUF blocks times int8 x giving this build's bits (BITS). Left out there:
    this test, the engine without kernels, and the two tests of the build's machinery (a one-op
    source of their own, whatever the ISA), named in LEFT_OUT and counted: a renamed test would
    otherwise run in every child (18 s each, seen)."""
    if isa == ext.EMULATED and ext.simde_include() is None:
        pytest.skip("SIMDe's headers are not installed (pip install simde-py)")
    if len(BITS) < 5:  # (this worker did not run them: once more, here)
        for kind in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
            test_gguf_blocks_times_int8_activations_stay_within_the_quantization_step(kind, True)
    torch.save(BITS, tmp_path / "bits.pt")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", " and ".join(f"not {name}" for name in LEFT_OUT)],
                          capture_output=True, text=True, cwd=str(ROOT),
                          env={**os.environ, "VKV_CPU_ISA": isa, "VKV_OTHER_ISA_RUN": "1",
                               PARENT_BITS: str(tmp_path / "bits.pt")})
    assert done.returncode == 0, (isa, done.stdout[-3000:], done.stderr[-2000:])
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]
    assert f"{len(other_isas()) + len(LEFT_OUT) - 1} deselected" in done.stdout, done.stdout[-1000:]


def test_a_dead_builder_or_a_deleted_library_is_built_past(tmp_path, monkeypatch):
    """A builder killed mid-build (Ctrl-C at start-up, a killed server or worker) leaves torch's
    lock file behind, on which torch's loader waits forever. The next start takes the flock
    (released by the kernel when its holder died), clears the stale lock, builds, and loads.
    Then a cache marked BUILT whose library was deleted (a cache cleaned by hand) is built again
    at the next start, instead of every start running the references from then on. (One cache
    for both: the second start finds the first's objects and only links.)"""
    sources = tmp_path / "src"  # the build's machinery over a source of one op (the kernels' own take 40 s)
    sources.mkdir()
    (sources / "ops.cpp").write_text('#include <torch/library.h>\n#include <string>\n'
                                     f'std::string isa() {{ return "{ext.kernel_isa()[0]}"; }}\n'
                                     'TORCH_LIBRARY(vkv, m) { m.def("isa() -> str", &isa); }\n')
    env = {**os.environ, "VKV_CACHE_DIR": str(tmp_path), "VKV_KERNEL_SOURCES": str(sources)}
    monkeypatch.setattr(ext, "SOURCES", sources)  # (the children's build folder, named here)
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path))
    build = ext.build_dir().name

    def start():
        return subprocess.run([sys.executable, "-c", "import ext; k = ext.cpu_kernels(); print(k.isa() if k else None)"],
                              capture_output=True, text=True, timeout=120, env=env)

    assert start().returncode == 0  # built once, as a first start builds it
    left = tmp_path / "ext" / build
    (left / "BUILT").unlink()
    (left / "lock").touch()  # what torch's FileBaton leaves when its holder is killed
    done = start()
    assert done.returncode == 0 and done.stdout.split() == [ext.kernel_isa()[0]], done.stderr[-2000:]
    assert "compiling" in done.stderr and (left / "BUILT").is_file() and not (left / "lock").exists()
    next(left.glob("*.so")).unlink()
    done = start()
    assert done.returncode == 0 and done.stdout.split() == [ext.kernel_isa()[0]], done.stderr[-2000:]
    assert (left / "BUILT").is_file() and any(left.glob("*.so"))


def test_only_an_error_in_the_source_keeps_a_build_from_being_tried_again(tmp_path, monkeypatch):
    """A start without a compiler (or with cc1plus killed, or the disk full) wrote a FAILED note
    that kept every later start on the torch references for good, compiler or not."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(ext, "_ninja_on_path", lambda: None)
    for output, remembered in (("/bin/sh: 1: c++: not found", False),
                               ("c++: fatal error: Killed signal terminated program cc1plus", False),
                               ("kernels.cpp:12:3: error: 'foo' was not declared in this scope", True)):
        def fails(**kwargs):
            raise RuntimeError(f"Error building extension 'vkv': {output}")

        monkeypatch.setattr(cpp_extension, "load", fails)
        build = tmp_path / output[:8].replace("/", "_").replace(" ", "_")
        with pytest.raises(RuntimeError, match="Error building"):
            ext._build(build, "scalar", [])
        assert (build / "FAILED").is_file() == remembered, output


def test_the_kernels_say_which_isa_they_were_built_for():
    assert ext.cpu_kernels().isa() == ext.kernel_isa()[0]


def test_the_fma_rate_counts_every_thread_and_refuses_no_work():
    """benchmarks/roofline.py's FMA peak: GFLOP/s over torch's threads, a positive finite rate
    (0.2 ms of chains here: a rate, not this machine's peak), and no iterations refused."""
    rate = torch.ops.vkv.fma_rate(100_000)
    assert 0.05 < rate < 1e5  # (a scalar build on a slow core to many AVX-512 cores)
    with pytest.raises(RuntimeError, match="iterations > 0"):
        torch.ops.vkv.fma_rate(0)


def test_the_engine_runs_without_the_native_kernels():
    """Where the kernels cannot be built, the engine picks the torch references."""
    script = ("from engine import LLM, SamplingParams\n"
              "llm = LLM(model='random:tiny', kv_cache_memory=1 << 22, page_size=4096)\n"
              "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
              "print(llm.stats().attention_backend, len(out[0].outputs[0].token_ids))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**__import__("os").environ, "VKV_NO_NATIVE": "1"})
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["sdpa", "3"], done.stderr[-2000:]


def test_rows_outside_the_tensors_are_refused_not_written():
    """rope_store and attention trusted their index tensors (a review's reproducers: SIGSEGV, a
    heap write past a cache, a strided positions tensor read as contiguous)."""
    if ext.cpu_kernels() is None:
        pytest.skip(ext.cpu_kernels_error())
    D, H = 8, 2
    cos_sin = torch.cat([torch.ones(16, D // 2), torch.zeros(16, D // 2)], 1)  # 16 positions
    kc, vc = torch.zeros(4, 4, H, D), torch.zeros(4, 4, H, D)  # 4 blocks of 4 rows
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    q, k, v = torch.randn(1, H, D), torch.randn(1, H, D), torch.randn(1, H, D)
    seq, i32 = torch.tensor([0], dtype=torch.int32), lambda *x: torch.tensor(x, dtype=torch.int32)
    store = torch.ops.vkv.rope_store
    for bad in (lambda: store(q, k, v, torch.tensor([1 << 40]), cos_sin, kc, vc, table, 4, seq),
                lambda: store(q, k, v, torch.tensor([0]), cos_sin, kc, vc, i32([1 << 30]).view(1, 1), 4, seq),
                lambda: store(q, k, v, torch.tensor([0]), cos_sin, kc, vc, table, 4, i32(1 << 30)),
                lambda: store(torch.randn(1, 64, D), torch.randn(1, 64, D), torch.randn(1, 64, D), torch.tensor([15]),
                              cos_sin, kc, vc, table, 4, seq),
                lambda: store(torch.randn(2, H, D), torch.randn(2, H, D), torch.randn(2, H, D),
                              torch.tensor([0, 9, 5, 9])[::2], cos_sin, kc, vc, table, 4, i32(0, 0))):
        with pytest.raises(RuntimeError):
            bad()
    out = torch.empty_like(q)
    attend = torch.ops.vkv.attention
    for bad in (lambda: attend(q, kc, vc, i32(1 << 28).view(1, 1), 4, i32(0), i32(1), i32(1), 1.0, out),
                lambda: attend(q, kc, vc, table, 4, i32(0), i32(1), i32(1 << 20), 1.0, out),
                lambda: attend(q, kc, vc, table, 1 << 22, i32(0), i32(1), i32(1), 1.0, out),
                lambda: attend(q, kc, vc, table, 4, i32(1 << 28), i32(1), i32(1), 1.0, out),
                lambda: attend(q, kc, vc, table, 4, i32(0, 0), i32(1), i32(1), 1.0, out)):
        with pytest.raises(RuntimeError):
            bad()
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0  # nothing was written
    attend(q, kc, vc, table, 4, i32(0), i32(1), i32(1), 1.0, out)  # and a good call still runs
