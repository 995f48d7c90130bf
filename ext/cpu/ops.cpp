// vkv's CPU kernels, registered here as torch.ops.vkv.*, one file a family (ops.h lists them); each has a pure-torch reference in
// engine/ops.py that the tests hold it to.
//
//   attention            one call per layer for the whole batch (prefill chunks and decode
//                        tokens mixed): each sequence's K/V rows are read where they lie,
//                        through a block table (a virtual slot is one block as long as the
//                        slot), never past the sequence's context length
//   rope_store           rotary embedding of q and k in the activation dtype, and k, v stored
//                        at their positions
//   add_rms_norm         residual += x; x = rmsnorm(residual) * weight (the first layer's
//                        norm has no residual)
//   silu_and_mul         silu(gate) * up over a fused [gate | up] projection
//   linear_panels        x W^T: register tiles over W packed in column panels; at a few rows
//                        (decode) each thread streams its panels once, at memory bandwidth;
//                        bf16 x over bf16 panels in AVX512-BF16's dot products (bf16_dot)
//   write_panels         rows of a weight into its panels, rounded to the panels' type on the way
//   decode_layers        every decoder layer of a few-row step, the kernels above in one call,
//                        then (given `logits`) last_logits, and (given `tokens`) several greedy
//                        steps in a row
//   last_logits          the model's last norm and the LM head over the rows that sample
//   row_max              each row's maximum and its first index, as torch.max(x, -1) (greedy)
//   greedy_pick          row_max of h's logits under fp32 panels, from their bf16 copy and a bound
//   lora_segments        out[rows] += (x[rows] A^T) B for each LoRA adapter's segment of rows
//   linear_gguf          x W^T, W in a GGUF file's blocks, unpacked in registers; with quantize_x,
//                        x's rows as int8 blocks and integer sums (llama.cpp's arithmetic)
//   dequantize_gguf      rows of such a W, as fp32 (a quantized embedding's lookups)
//   fma_rate             the fp32 FMA rate this build's vectors reach on every thread: the
//                        arithmetic ceiling the benchmarks hold GEMMs to (benchmarks/roofline.py)
//
// Compiled once per machine by ext/__init__.py with -O3 -march=native -ffp-contract=off
// -fopenmp-simd (the elementwise kernels round like torch's ops; the dot products ask for fma
// or a simd reduction explicitly); VKV_CPU_ISA=avx2|scalar adds -mno-avx512f|-mno-avx, and the
// vector layer below (`Vec`) follows what the compiler was allowed.
// Floats are fp32 or bf16 (activations, cache); a cache may be narrower than the activations
// (bf16 KV where the CPU computes in fp32; fp8 KV, e4m3 or e5m2, under either: kv_cache_dtype).
// Every accumulation is fp32.

#include <torch/library.h>

#include "common.h"
#include "ops.h"

namespace vkv {

std::string isa() { return VKV_ISA; }

// GFLOP/s of fp32 FMAs in this build's widest vector (the scalar build: a multiply and an add,
// 2 flops as one FMA's), on each of at::get_num_threads() threads at once: each runs 12
// independent chains (more than any x86 core's FMA latency times its FMA issue width) for
// `iterations` steps. Measured, not computed from a clock and a count of units: /proc/cpuinfo's
// clock is not the boost clock the cores run at, and a core's FMA units may be narrower than its
// widest vector (Zen 4 runs a 512-bit FMA on both of its 256-bit units).
double fma_rate(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "fma_rate: iterations > 0");
#if defined(VKV_VEC)
  using R = typename Vec::R;
  constexpr int64_t kLanes = Vec::W;
  auto fma = [](R a, R b, R c) { return Vec::fmadd(a, b, c); };
  auto set1 = [](float x) { return Vec::set1(x); };
#else
  using R = float;
  constexpr int64_t kLanes = 1;
  auto fma = [](R a, R b, R c) { return a * b + c; };  // (without FMA instructions std::fma is a libm call)
  auto set1 = [](float x) { return x; };
#endif
  const int threads = at::get_num_threads();
  std::vector<float> sink(threads, 0.f);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const R b = set1(0.999999f), c = set1(1e-6f);
      R a0 = set1(0), a1 = set1(1), a2 = set1(2), a3 = set1(3), a4 = set1(4), a5 = set1(5);
      R a6 = set1(6), a7 = set1(7), a8 = set1(8), a9 = set1(9), a10 = set1(10), a11 = set1(11);
      for (int64_t i = 0; i < iterations; ++i) {
        a0 = fma(a0, b, c), a1 = fma(a1, b, c), a2 = fma(a2, b, c), a3 = fma(a3, b, c);
        a4 = fma(a4, b, c), a5 = fma(a5, b, c), a6 = fma(a6, b, c), a7 = fma(a7, b, c);
        a8 = fma(a8, b, c), a9 = fma(a9, b, c), a10 = fma(a10, b, c), a11 = fma(a11, b, c);
      }
      const R all[12] = {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11};
      float sum = 0.f;  // (kept, so the chains are not optimized away)
      for (const R& a : all) sum += reinterpret_cast<const float*>(&a)[0];
      sink[t] = sum;
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const float s : sink) TORCH_CHECK(std::isfinite(s), "fma_rate: chains overflowed");
  return static_cast<double>(threads) * iterations * 12 * kLanes * 2 / seconds / 1e9;
}

}  // namespace vkv

using namespace vkv;

TORCH_LIBRARY(vkv, m) {
  m.def("isa() -> str", &isa);  // which vector layer this build has
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int block_size, "
        "Tensor q_start, Tensor q_len, Tensor ctx_len, float scale, Tensor(a!) out) -> ()");
  m.def("rope_store(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor positions, Tensor cos_sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor block_table, int block_size, Tensor token_seq) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("decode_layers(Tensor(a!) x, Tensor(b!) residual, Tensor[] input_norms, Tensor[] post_norms, float eps, "
        "Tensor[] qkv_weights, Tensor?[] qkv_tails, Tensor?[] qkv_biases, Tensor[] o_weights, Tensor[] gate_up_weights, "
        "Tensor[] down_weights, int num_heads, int num_kv_heads, Tensor positions, Tensor cos_sin, "
        "Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, Tensor block_table, int block_size, Tensor token_seq, "
        "Tensor q_start, Tensor q_len, Tensor ctx_len, float scale, Tensor? rows=None, Tensor? final_norm=None, "
        "Tensor? lm_head=None, bool bf16=False, Tensor(e!)? logits=None, Tensor? embed=None, Tensor(f!)? tokens=None, "
        "Tensor? stop_ids=None, Tensor? pick=None, Tensor? pick_bounds=None, Tensor? pick_scales=None) -> ()");
  m.def("last_logits(Tensor x, Tensor residual, Tensor rows, Tensor norm, float eps, Tensor panels, bool bf16, "
        "Tensor(a!) out) -> ()");
  m.def("row_max(Tensor x, Tensor(a!) values, Tensor(b!) indices) -> ()");
  m.def("greedy_pick(Tensor h, Tensor panels, Tensor pick, Tensor pick_bounds, Tensor? pick_scales, bool bf16, "
        "Tensor(a!) logits, Tensor(b!) best, Tensor(c!) picked) -> ()");
  m.def("lora_segments(Tensor x, Tensor(a!) out, Tensor[] a, Tensor[] b, int[] bounds) -> ()");
  m.def("panel_width() -> int", &panel_width);  // output columns per panel of linear_panels' weights
  m.def("ahead_hint() -> str", &ahead_hint);  // how steps ask for the weights they read next
  m.def("time_decode_stages(bool on) -> ()", &time_decode_stages);  // decode_layers' stage clock
  m.def("decode_stage_times(bool reset) -> Dict(str, float)", &decode_stage_times);  // its sums (us), "steps"
  m.def("linear_panels(Tensor x, Tensor panels, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("bf16_dot() -> bool", &bf16_dot);  // whether linear_panels takes bf16 x (AVX512-BF16)
  m.def("write_panels(Tensor(a!) panels, Tensor w, int row) -> ()");
  m.def("linear_gguf(Tensor x, Tensor w, int type, Tensor? bias, Tensor(a!) out, bool quantize_x=False) -> ()");
  m.def("dequantize_gguf(Tensor w, int type, Tensor rows, Tensor(a!) out) -> ()");
  m.def("fma_rate(int iterations) -> float", &fma_rate);  // GFLOP/s of fp32 FMAs, every thread
}

TORCH_LIBRARY_IMPL(vkv, CPU, m) {
  m.impl("attention", &attention);
  m.impl("rope_store", &rope_store);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("decode_layers", &decode_layers);
  m.impl("last_logits", &last_logits);
  m.impl("row_max", &row_max);
  m.impl("greedy_pick", &greedy_pick);
  m.impl("lora_segments", &lora_segments);
  m.impl("linear_panels", &linear_panels);
  m.impl("write_panels", &write_panels);
  m.impl("linear_gguf", &linear_gguf);
  m.impl("dequantize_gguf", &dequantize_gguf);
}
