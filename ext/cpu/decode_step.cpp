// torch.ops.vkv.decode_layers, last_logits and the stage clock: every decoder layer of a decode
// step of a few rows in one call, the layers of a one-row step in one parallel region.
#include "attention.h"
#include "norms.h"
#include "ops.h"
#include "panels.h"
#include "rope.h"

namespace vkv {

// ---------------------------------------------------------------------------------------------
// Every decoder layer of a decode step of a few rows, in one call: at one row the Python between
// a layer's nine kernels (and a dispatch for each) cost as much as some of the kernels, and a
// call per layer still cost the step a Python loop and 30 dispatches of 25 arguments. The same
// kernels as the layer-by-layer path, in the same order, so the arithmetic is identical. Per layer:
//
//   x, residual = add_rms_norm(x, residual)   (layer 0: residual = x, no add)
//   q, k, v = x W_qkv^T (+ b)   rope_store    attention    x = attn W_o^T
//   x, residual = add_rms_norm(x, residual)   x = silu_and_mul(x W_gu^T) W_down^T
//
// x and residual are [rows, hidden] fp32, updated in place: x ends as the last layer's output.
// The weights are the projections' panels (linear_panels), or a GGUF file's blocks (`project`:
// Linear's int8-x arithmetic; a qkv in two types as qkv_weights' head and qkv_tails' tail), a list entry per layer, as are the
// caches; the step's intermediates are allocated once and reused by every layer. Given `logits`
// (and rows, the final norm's weight, the LM head's panels), the call ends with last_logits, the
// final norm under the layers' eps (one rms_norm_eps in a Llama config): each return from a call
// that streamed the weights leaves the Python after it on cold caches, so one call a step, not two
// (measured: benchmarks/results/cpu/design_choices.json, "logits_in_the_step_call").
struct DecodeStep {  // what every layer of the step reads, and its intermediates
  const at::Tensor &positions, &cos_sin, &block_table, &token_seq, &q_start, &q_len, &ctx_len;
  int64_t block_size;
  double eps, scale;
  at::Tensor qkv, q, k, v, attended, h, gate_up, act;
};

// Where a decode step's time goes (benchmarks/bench_decode_stages.py): with the clock on
// (`time_decode_stages(true)`), decode_layers adds each stage's microseconds to its sum, read (and
// cleared) by `decode_stage_times`, with the steps run and those that ran in one parallel region
// (layers_in_one_region); off, a stage costs the test of one flag. The sums are atomic: engines of
// several models in one process step on threads of their own.
enum Stage { kContext, kNorms, kQkv, kRope, kAttention, kO, kGateUp, kDown, kPick, kEmbed, kStages };
constexpr const char* kStageNames[kStages] = {"context prefetch", "norms", "qkv", "rope", "attention", "o",
                                              "gate_up", "down", "pick", "next embedding"};
std::atomic<bool> stage_clock_on{false};
std::atomic<double> stage_us[kStages];
std::atomic<int64_t> stage_steps{0}, region_steps{0};

struct StageClock {
  bool on = stage_clock_on.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point last = on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  void lap(Stage stage) {  // the time since the last lap (or the start) was `stage`'s
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    stage_us[stage].fetch_add(std::chrono::duration<double, std::micro>(now - last).count(), std::memory_order_relaxed);
    last = now;
  }
};

void time_decode_stages(bool on) { stage_clock_on.store(on); }

c10::Dict<std::string, double> decode_stage_times(bool reset) {
  c10::Dict<std::string, double> out;
  for (int i = 0; i < kStages; ++i)
    out.insert(kStageNames[i], reset ? stage_us[i].exchange(0.0) : stage_us[i].load());
  out.insert("steps", static_cast<double>(reset ? stage_steps.exchange(0) : stage_steps.load()));
  out.insert("steps in one region", static_cast<double>(reset ? region_steps.exchange(0) : region_steps.load()));
  return out;
}

// The first keys and values the layer's attention will read, asked into L2 before the layer's
// attention (at most kContextPrefetch bytes of each cache): the step's first layer's as it starts,
// a later layer's in the down projection of the layer before (Note [The next layer's context ...]).
// The step's weights have streamed through the caches since the last step wrote them, so attention
// waited on memory for them, a miss at a time: about a third of its time in decode. Prefetched here
// they arrive while the norm and the qkv projection run. (Each key's heads must lie side by side,
// as in every layout; else no prefetch.) The threads split the keys: a thread's prefetches wait on
// its own line-fill buffers once they are full. (Measured: benchmarks/results/cpu/design_choices.json,
// "context_prefetch".)
constexpr int64_t kContextPrefetch = 128 << 10;
constexpr int64_t kContextGrain = 64;  // keys a thread prefetches at least

// The step's sequences as prefetch_keys walks them (raw: gathered once a call by StepPlan).
struct StepKeys {
  const int32_t* ctx;  // each sequence's keys
  const int32_t* table;
  int64_t table_stride, block_size, seqs;
};
StepKeys step_keys(const DecodeStep& s) {
  return {s.ctx_len.data_ptr<int32_t>(), s.block_table.data_ptr<int32_t>(), s.block_table.stride(0), s.block_size,
          s.q_start.size(0)};
}

// A layer's two caches as prefetch_keys reads them (strides in bytes); `row`, a key's heads in
// bytes, is 0 where the layout does not allow the prefetch (a key's heads not side by side).
struct ContextRef {
  const char* base[2];
  int64_t s_block[2], s_row[2], row;
};
ContextRef context_ref(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  ContextRef c{};
  const at::Tensor* caches[2] = {&k_cache, &v_cache};
  for (const at::Tensor* t : caches)
    if (t->stride(2) != t->size(3) || t->stride(3) != 1 || t->sizes() != k_cache.sizes()) return c;
  const int64_t bytes = k_cache.element_size();
  for (int i = 0; i < 2; ++i) {
    c.base[i] = static_cast<const char*>(caches[i]->data_ptr());
    c.s_block[i] = caches[i]->stride(0) * bytes;
    c.s_row[i] = caches[i]->stride(1) * bytes;
  }
  c.row = k_cache.size(2) * k_cache.size(3) * bytes;
  return c;
}

// The keys prefetch_context asks for: the step's, sequence after sequence, as far as the cap.
int64_t context_keys(const StepKeys& k, const ContextRef& c) {
  if (c.row == 0) return 0;
  int64_t keys = 0;
  for (int64_t b = 0; b < k.seqs; ++b) keys += k.ctx[b];
  return std::min(keys, kContextPrefetch / c.row);
}

// A prefetch into L2 that the compiler keeps: a loop of nothing but _mm_prefetch (a builtin without
// side effects) may be deleted whole, and GCC deleted prefetch_keys' once its addresses came from raw
// pointers instead of calls (the region's disassembly showed the claims' loop with no prefetch;
// "prefetch_kept" in benchmarks/results/cpu/design_choices.json).
VKV_INLINE void prefetch_kept_t1(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Keys [lo, hi) of them, into L2.
void prefetch_keys(const StepKeys& k, const ContextRef& c, int64_t lo, int64_t hi) {
  int64_t first = 0, b = 0;  // key i is sequence b's key i - first
  for (int64_t i = lo; i < hi; ++i) {
    while (i - first >= k.ctx[b]) first += k.ctx[b++];
    const int64_t key = i - first, block = k.table[b * k.table_stride + key / k.block_size];
    for (int j = 0; j < 2; ++j) {
      const char* at = c.base[j] + block * c.s_block[j] + key % k.block_size * c.s_row[j];
      for (int64_t o = 0; o < c.row; o += 64) prefetch_kept_t1(at + o);
    }
  }
}

void prefetch_context(const StepKeys& k, const ContextRef& c) {
  at::parallel_for(0, context_keys(k, c), kContextGrain, [&](int64_t lo, int64_t hi) { prefetch_keys(k, c, lo, hi); });
}

// Note [The next layer's context, asked for in this layer's down projection]
// Rationale: prefetch_context at a layer's start was a stage of its own, both threads waiting on
// their line-fill buffers while no weights streamed: 0.13-0.21 ms of a decode step on the Intel
// Xeon (the stage clock, bf16 and fp32). The threads of a one-row projection end apart (a few
// microseconds; the first waits for the other at the region's end).
// Approach: the next layer's keys are asked for inside this layer's down projection's region, in
// claims of kContextGrain keys taken by each thread once its share of the panels is done (so the
// thread done first takes most). The keys are the same: the next layer's cache rows below the step's
// new one, which that layer's rope_store writes. Only the first layer asks at its start.
// Implementation: NextContext (the claims), run by linear_panels_then; decode_layer. Asked for
// in the gate/up projection's region instead, the keys are evicted by the down stream.
// Limitations: the scalar build and steps of several rows were not measured; they ask the same
// way (each thread after its share). Measured: benchmarks/results/cpu/design_choices.json,
// "next_context_in_down".
struct NextContext {
  NextContext(const StepKeys& step, const ContextRef& caches)
      : step(step), caches(caches), keys(context_keys(step, caches)) {}
  StepKeys step;
  ContextRef caches;
  int64_t keys;
  std::atomic<int64_t> next{0};
  void run() {
    for (int64_t lo; (lo = next.fetch_add(kContextGrain, std::memory_order_relaxed)) < keys;)
      prefetch_keys(step, caches, lo, std::min(keys, lo + kContextGrain));
  }
};

// Note [The o projection's weights asked for while attention runs]
// Rationale: a one-sequence decode step's attention is one work item (decode_parts: under 256
// keys) on one thread, while the other thread waits and the memory bus idles; then the o
// projection, the smallest, starts cold on both threads and reads slower than the larger ones.
// Approach: one parallel region for both. Thread 0 runs attention; thread 1 asks for the o weight's
// panels into its L2, from the last panel down, until attention is done (at most all but
// 1 / kWarmShare of them); then the two split the panels so that thread 1 takes the warm ones and
// half of the cold ones less 1 / kWarmGiven of the warm count, which thread 0 takes instead
// (thread 1 still reads the warm ones, at L2's rate). Each column is computed as linear_panels computes it, whatever the
// split: the same bits. One region instead of attention inline and o's own also saves a fork and
// a join.
// Limitations: two threads only (more take the path before), one row; measured on an Intel Xeon
// only (benchmarks/results/cpu/design_choices.json, "o_warmed_during_attention").
// If attention throws, thread 1 still sees `done` and both skip the projection; the error rethrows.
constexpr int64_t kWarmShare = 4;  // thread 1 asks for at most (kWarmShare - 1) / kWarmShare of the panels
constexpr int64_t kWarmGiven = 4;  // thread 0 takes 1 / kWarmGiven of the warm count in cold panels

// Waits until ready() is true: spinning (a pause an iteration) for kSpinMicros, longer than a stage
// waits when each thread has a core of its own, then giving the core away between tests, so that
// a thread sharing its core (more threads than cores: other processes, several engines on one
// host) lets the thread it waits for run instead of spinning out its time slice.
constexpr int64_t kSpinMicros = 50;
template <typename Ready>
void wait_until(Ready ready) {
  std::chrono::steady_clock::time_point until;  // (the clock read only once a wait is not short)
  for (int64_t i = 1; !ready(); ++i) {
    _mm_pause();
    if (i % 256 == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (i == 256) {
        until = now + std::chrono::microseconds(kSpinMicros);
      } else if (now > until) {
        while (!ready()) std::this_thread::yield();
        return;
      }
    }
  }
}

// A projection's weight as a thread's share of it runs: vkv's panels, or a GGUF file's blocks
// (BlocksRef: groups of eight interleaved rows, or four rows), in units a share is counted in.
// A GgufStack's second part (q and k in one type, v in another) is its tail: rows N.. of the
// projection's outputs, units after the head's.
struct StepWeight {
  PanelsRef panels{};
  BlocksRef blocks{}, tail{};
  bool is_blocks = false, has_tail = false;
  int64_t units() const {
    return is_blocks ? blocks_units(blocks) + (has_tail ? blocks_units(tail) : 0) : panels.P;
  }
  int64_t unit_bytes() const { return is_blocks ? blocks.unit_bytes : panels.K * kPanel * (panels.bf16 ? 2 : 4); }
  const char* bytes() const { return static_cast<const char*>(is_blocks ? static_cast<const void*>(blocks.w) : panels.w); }
};

StepWeight step_weight(const at::Tensor& w, const std::optional<at::Tensor>& tail = std::nullopt) {
  StepWeight sw;
  sw.is_blocks = w.scalar_type() == at::kByte;
  if (sw.is_blocks)
    sw.blocks = blocks_ref(w);
  else
    sw.panels = panels_ref(w);
  if (tail) {
    sw.tail = blocks_ref(*tail);
    sw.has_tail = true;
  }
  return sw;
}

#if defined(VKV_VEC)
// One row over panels [lo, hi) of fp32 or bf16 panels, on the calling thread (row_over_panels).
void panels_range(const float* x, const PanelsRef& panels, int64_t N, const float* bias, float* out, int64_t lo,
                  int64_t hi) {
  if (panels.bf16)
    row_over_panels(x, panels.K, static_cast<const c10::BFloat16*>(panels.w), N, bias, out, lo, hi);
  else
    row_over_panels(x, panels.K, static_cast<const float*>(panels.w), N, bias, out, lo, hi);
}

// One row x against units [lo, hi) of the weight, on the calling thread, into out (N outputs).
void weight_range(const float* x, const StepWeight& w, int64_t N, const float* bias, float* out, int64_t lo,
                  int64_t hi) {
  if (w.is_blocks && w.has_tail) {
    const int64_t head = blocks_units(w.blocks);
    if (lo < std::min(hi, head)) blocks_range(x, w.blocks, bias, out, lo, std::min(hi, head));
    if (std::max(lo, head) < hi)
      blocks_range(x, w.tail, bias ? bias + w.blocks.N : nullptr, out + w.blocks.N, std::max(lo, head) - head, hi - head);
    return;
  }
  if (w.is_blocks) return blocks_range(x, w.blocks, bias, out, lo, hi);
  panels_range(x, w.panels, N, bias, out, lo, hi);
}

// The gate/up projection's units [lo, hi) of the gate and the same of the up, with silu folded in,
// into act (I outputs): panels as gate_up_silu_share; blocks into gate_up's [2 I] first, then
// silu(gate) * up as silu_and_mul computes it.
void gate_up_silu_range(const float* x, const StepWeight& w, float* gate_up, float* act, int64_t I, int64_t lo,
                        int64_t hi) {
  if (!w.is_blocks) return gate_up_silu_share(x, w.panels, act, lo, hi);
  const int64_t unit = w.blocks.unit;
  blocks_range(x, w.blocks, nullptr, gate_up, lo, hi);
  blocks_range(x, w.blocks, nullptr, gate_up, I / unit + lo, I / unit + hi);
  const float* __restrict gate = gate_up;
  const float* __restrict up = gate_up + I;
#pragma omp simd
  for (int64_t j = lo * unit; j < hi * unit; ++j) act[j] = silu_times<float>(gate[j], up[j]);
}
#endif

// Thread t's share (of 2) of P panels: the ones at::parallel_for gives it.
std::pair<int64_t, int64_t> share_of(int64_t t, int64_t P) {
  const int64_t chunk = (P + 1) / 2, lo = std::min(P, t * chunk);
  return {lo, std::min(P, lo + chunk)};
}

// attention_then_o's state, shared by its two threads.
struct AttendThenO {
  std::atomic<bool> done{false};
  std::atomic<int64_t> warm{-1};  // the panels thread 1 asked for, once it stops
  std::exception_ptr failed;      // attention's error (thread 0's), rethrown by the caller
};

#if defined(VKV_VEC)
// Thread t's part of it, in a region of two threads (`solo`: one thread runs both parts): thread 0
// runs attend() (attention, after rope_store in the one region), while thread 1 asks for o's
// panels; then each its share of o, attended [K] into h [N] (fp32).
template <typename Attend>
void attend_then_o_part(int64_t t, bool solo, AttendThenO& st, Attend attend, const StepWeight& o,
                        const float* attended, float* h, int64_t N) {
  const int64_t P = o.units(), panel_bytes = o.unit_bytes();
  const char* weights = o.bytes();
  if (t == 0) {
    try {
      attend();
    } catch (...) {
      st.failed = std::current_exception();
    }
    st.done.store(true, std::memory_order_release);
    if (solo) st.warm.store(0, std::memory_order_release);
  } else {
    int64_t n = 0;
    for (int64_t p = P - 1; p >= P / kWarmShare && !st.done.load(std::memory_order_acquire); --p, ++n)
      for (int64_t b = 0; b < panel_bytes && !st.done.load(std::memory_order_relaxed); b += 64)
        _mm_prefetch(weights + p * panel_bytes + b, _MM_HINT_T1);
    wait_until([&] { return st.done.load(std::memory_order_acquire); });
    st.warm.store(n, std::memory_order_release);
  }
  int64_t n;
  wait_until([&] { return (n = st.warm.load(std::memory_order_acquire)) >= 0; });
  if (st.failed) return;
  const int64_t split = std::min(P, (P - n + 1) / 2 + n / kWarmGiven);
  const int64_t a = t == 0 ? 0 : split, b = t == 0 ? (solo ? P : split) : P;
  weight_range(attended, o, N, nullptr, h, a, b);
}

#endif

// Whether attention_then_o applies: one row of one sequence whose attention is one work item, two
// threads, fp32 or bf16 panels, the vector build.
bool attend_then_o_applies(const DecodeStep& s, const at::Tensor& o_weight) {
#if !defined(VKV_VEC)
  return false;  // (the scalar build's panels have no row_over_panels)
#else
  return s.h.size(0) == 1 && s.q_start.size(0) == 1 && at::get_num_threads() == 2 && !at::in_parallel_region() &&
         decode_parts(s.ctx_len.data_ptr<int32_t>()[0], 1, 2) < 2 &&
         (o_weight.scalar_type() == at::kFloat || o_weight.scalar_type() == at::kBFloat16);
#endif
}

bool attention_then_o(DecodeStep& s, const at::Tensor& o_weight, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      StageClock& clock) {
  if (!attend_then_o_applies(s, o_weight)) return false;
#if defined(VKV_VEC)
  AttendThenO st;
  const StepWeight o = step_weight(o_weight);
  auto attend = [&] {
    attention(s.q, k_cache, v_cache, s.block_table, s.block_size, s.q_start, s.q_len, s.ctx_len, s.scale, s.attended);
    clock.lap(kAttention);
  };
  at::parallel_for(0, 2, 1, [&](int64_t lo, int64_t hi) {
    attend_then_o_part(lo, hi == 2 && lo == 0, st, attend, o, s.attended.data_ptr<float>(), s.h.data_ptr<float>(),
                       s.h.size(1));
  });
  if (st.failed) std::rethrow_exception(st.failed);
  clock.lap(kO);
#endif
  return true;
}

// A layer's input norm of one row: x, residual = add_rms_norm(x, residual); the first layer's has no
// residual (residual = x, written out: as ATen's copy_ it dispatched cold each step, see next_inputs;
// "first_residual_written_out" in benchmarks/results/cpu/design_choices.json).
void input_norm_row(float* x, float* residual, int64_t H, bool first, const float* norm, double eps, float* row) {
  if (first) std::copy(x, x + H, residual);
  norm_row<float>(x, first ? nullptr : residual, norm, H, eps, row);
}

// The same over every row of x (as add_rms_norm runs its rows).
void input_norm_of(const DecodeStep& s, at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& norm) {
  const int64_t H = x.size(1);
  TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.numel() == H,
              "a layer's norm weight must be [hidden] fp32 contiguous");
  float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const float* w = norm.data_ptr<float>();
  at::parallel_for(0, x.size(0), 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t r = begin; r < end; ++r) input_norm_row(xp + r * H, rp + r * H, H, first, w, s.eps, row.data());
  });
}

// A projection in a step: vkv's panels (fp32 or bf16, [P, K, panel width]), or a GGUF file's blocks
// (blocks_type's views: linear_blocks, Linear's int8-x arithmetic), with a tail of blocks in
// another type for its last rows (StepWeight's tail) as Linear runs a GgufStack: each part alone.
void project(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, at::Tensor out,
             const std::optional<at::Tensor>& tail = std::nullopt) {
  if (tail) {
    const int64_t head = blocks_rows(w), rows = blocks_rows(*tail);
    TORCH_CHECK(head + rows == out.size(1), "a projection's head and tail rows are its outputs");
    at::Tensor first = out.new_empty({out.size(0), head}), second = out.new_empty({out.size(0), rows});
    linear_blocks(x, w, bias ? std::optional<at::Tensor>(bias->narrow(0, 0, head)) : std::nullopt, first);
    linear_blocks(x, *tail, bias ? std::optional<at::Tensor>(bias->narrow(0, head, rows)) : std::nullopt, second);
    out.narrow(1, 0, head).copy_(first);
    out.narrow(1, head, rows).copy_(second);
    return;
  }
  if (w.scalar_type() == at::kByte) return linear_blocks(x, w, bias, out);
  linear_panels(x, w, bias, out);
}

// The inputs such a weight multiplies: K of panels [P, K, width], of blocks (blocks_ref's K), or of
// an embedding's rows [N, K].
int64_t weight_inputs(const at::Tensor& w) { return w.scalar_type() == at::kByte ? blocks_inputs(w) : w.size(1); }

void decode_layer(DecodeStep& s, at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& input_norm,
                  const at::Tensor& post_norm, const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_tail,
                  const std::optional<at::Tensor>& qkv_bias,
                  const at::Tensor& o_weight, const at::Tensor& gate_up_weight, const at::Tensor& down_weight,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor* next_k_cache,
                  const at::Tensor* next_v_cache) {
  StageClock clock;
  if (first) prefetch_context(step_keys(s), context_ref(k_cache, v_cache));  // (a later layer's: in the down before)
  clock.lap(kContext);
  input_norm_of(s, x, residual, first, input_norm);
  clock.lap(kNorms);
  project(x, qkv_weight, qkv_bias, s.qkv, qkv_tail);
  clock.lap(kQkv);
  rope_store(s.q, s.k, s.v, s.positions, s.cos_sin, k_cache, v_cache, s.block_table, s.block_size, s.token_seq);
  clock.lap(kRope);
  if (!attention_then_o(s, o_weight, k_cache, v_cache, clock)) {
    attention(s.q, k_cache, v_cache, s.block_table, s.block_size, s.q_start, s.q_len, s.ctx_len, s.scale, s.attended);
    clock.lap(kAttention);
    project(s.attended.view({x.size(0), -1}), o_weight, std::nullopt, s.h);
    clock.lap(kO);
  }
  add_rms_norm(s.h, residual, post_norm, s.eps);
  clock.lap(kNorms);
  if (!gate_up_silu(s.h, gate_up_weight, s.act)) {
    project(s.h, gate_up_weight, std::nullopt, s.gate_up);
    silu_and_mul(s.gate_up, s.act);
  }
  clock.lap(kGateUp);
  if (next_k_cache && down_weight.scalar_type() != at::kByte) {
    NextContext next(step_keys(s), context_ref(*next_k_cache, *next_v_cache));
    linear_panels_then(s.act, down_weight, std::nullopt, x, &next);
  } else {
    project(s.act, down_weight, std::nullopt, x);
  }
  clock.lap(kDown);
}

// Note [A one-row step's layers in one parallel region]
// Rationale: a one-row decode step of a 30-layer model opened 120 parallel regions (qkv, attention
// with o, gate/up, down, per layer), the norms and rope between them on one thread. Each region's
// threads start microseconds after it is asked for and it returns microseconds after its last
// thread ends: a few per cent of a projection with the bus idle.
// Approach: one region for all the layers of a step, its two threads stepping through the stages
// together and meeting at a spinning barrier (Pair: a counter a thread; each waits for the other's
// to reach its own) where a fork and a join were. The norms stay on thread 0; rope moves into
// thread 0's part of the attention stage, so thread 1 asks for o's panels from that stage's start.
// Each projection's thread takes the panels at::parallel_for gave it and computes each column as
// before: the same bits (tests/test_cpu_paths.py holds the step to the layer-by-layer path).
// A wait spins for 50 us, then gives the core away between tests (wait_until): with more threads
// than cores (two engine processes on two cores) barriers that only spin spend each time slice
// spinning on a thread that cannot run. (Measured: benchmarks/results/cpu/design_choices.json,
// "layers_in_one_region".)
// Implementation: layers_in_one_region, called by decode_layers each step; attend_then_o_part and
// gate_up_silu_range are per-thread bodies that the region-a-stage path runs too, weight_range runs
// a thread's share of the other projections (share_of), over panels or GGUF blocks (StepWeight: a
// share counted in panels, or in groups of rows, each thread rounding x to int8 blocks itself). A
// thread that throws marks the pair broken, so the other leaves at its next barrier;
// at::parallel_for rethrows.
// Limitations: exactly two threads, one row of one sequence whose attention is one work item (under
// 256 keys: decode_parts), fp32 or bf16 panels or every projection in GGUF blocks (blocks_type's
// views; a qkv of two types as a head and a tail), the vector build; elsewhere decode_layer's path.
struct Pair {
  struct alignas(64) Count {
    std::atomic<int64_t> n{0};
  };
  Count count[2];
  std::atomic<bool> broken{false};
  bool meet(int64_t t) {  // false once the other thread has failed
    const int64_t mine = count[t].n.load(std::memory_order_relaxed) + 1;
    count[t].n.store(mine, std::memory_order_release);
    wait_until([&] {
      return count[1 - t].n.load(std::memory_order_acquire) >= mine || broken.load(std::memory_order_relaxed);
    });
    return !broken.load(std::memory_order_acquire);
  }
};


// Note [A step's plan, gathered once a call]
// Rationale: between two stages of the one region a step's weights stream through every cache, so
// each stage began by reading cold what it reads of its tensors (a TensorImpl, its storage, the
// sizes and strides its op's checks compare) and ran its op's own code around the kernel (checks,
// dtype dispatch, vectors, a nested parallel_for): rope_store took several times as long as a
// second call at once, and attention() a fifth more than its arithmetic (attend_item).
// Approach: decode_layers gathers once a call what the region's stages read (each layer's panels,
// norms, bias and caches; the step's buffers, positions, block table and rotary table) into one
// plan of raw pointers, strides and sizes, and each stage calls its kernel's own body on it:
// norm_row, RopeRows::row, attend_item, row_over_panels, gate_up_silu_share, prefetch_keys. So the
// same bits (tests/test_cpu_paths.py holds the step to the layer-by-layer path). What the ops
// checked every layer is checked once a call (shapes, dtypes, KV heads, block size: plan_of, which
// leaves a step that fails them to decode_layer's path and its ops' errors) and once a step (the
// blocks its keys lie in, before the region: check_keys; its row, inside it: check_row).
// Measured: benchmarks/results/cpu/design_choices.json, "step_plan".
// Implementation: plan_of builds it (nullopt where the one region cannot run); layers_in_one_region
// reads it; rope and attend are the plan's cache-type instances (rope_of, attend_of).
// Limitations: the one region only (one row of one sequence, two threads, fp32 activations); the
// layer-by-layer path and steps of several rows still call the ops on tensors.
struct LayerPlan {
  const float *input_norm, *post_norm, *qkv_bias;
  StepWeight qkv, o, gate_up, down;
  void *k, *v;           // the caches' data
  int64_t sk[3], sv[3];  // their strides (block, row, head), in elements
  ContextRef context;
};

struct StepPlan {
  std::vector<LayerPlan> layers;
  StepKeys keys;  // (keys.ctx: the step's context length, moved on each step, as is pos)
  const int32_t *q_start, *q_len, *token_seq;
  const int64_t* pos;
  const void* cos_sin;
  int64_t s_cs, cs_rows, table_blocks, cache_blocks;
  float *x, *residual, *qkv, *attended, *h, *gate_up, *act;
  int64_t H, heads, kv_heads, D, I;
  double eps, scale;
  void (*rope)(const StepPlan&, const LayerPlan&);
  void (*attend)(const StepPlan&, const LayerPlan&, std::vector<float>& buf, std::vector<float>& wide);
  std::vector<float> row, buf, wide;  // thread 0's scratch
};

#if defined(VKV_VEC)
template <typename C, typename CS>
void rope_of(const StepPlan& p, const LayerPlan& l) {
  const int64_t nq = p.heads * p.D, nk = p.kv_heads * p.D, w = nq + 2 * nk;  // q, k, v: views of qkv
  const RopeRows<float, C, CS> rows{p.qkv, p.qkv + nq, p.qkv + nq + nk, w, p.D, w, p.D, w, p.D, p.heads, p.kv_heads,
                                    p.D, p.pos, p.token_seq, p.keys.table, p.keys.table_stride, p.keys.block_size,
                                    static_cast<const CS*>(p.cos_sin), p.s_cs, static_cast<C*>(l.k),
                                    static_cast<C*>(l.v), l.sk[0], l.sk[1], l.sk[2], l.sv[0], l.sv[1], l.sv[2]};
  rows.row(0);
}

// attention_impl's one work item (decode_parts: under 256 keys), as it runs it.
template <typename C>
void attend_of(const StepPlan& p, const LayerPlan& l, std::vector<float>& buf, std::vector<float>& wide) {
  const Rows<C> K{static_cast<const C*>(l.k), l.sk[0], l.sk[1], l.sk[2], p.keys.table, p.keys.table_stride,
                  p.keys.block_size};
  const Rows<C> V{static_cast<const C*>(l.v), l.sv[0], l.sv[1], l.sv[2], p.keys.table, p.keys.table_stride,
                  p.keys.block_size};
  const int64_t nq = p.heads * p.D, w = nq + 2 * p.kv_heads * p.D;
  const Item it{0, 0, 1, 0, p.keys.ctx[0], -1};
  const int previous = blas().local_threads ? blas().local_threads(1) : 0;  // (as attention_impl)
  attend_item<float, C>(it, p.qkv, w, p.D, K, V, p.q_start, p.q_len, p.keys.ctx, p.kv_heads, p.heads / p.kv_heads,
                        p.D, static_cast<float>(p.scale), p.attended, nq, p.D, nullptr, buf, wide);
  if (blas().local_threads) blas().local_threads(previous);
}
#endif

// The plan of a step's layers (Note [A step's plan, gathered once a call]), or nullopt where the
// one region does not run: more rows or sequences, other than two threads, weights other than fp32
// or bf16 panels or (every projection) GGUF blocks of the step's shapes, an intermediate size off
// the panel width (or the blocks' unit), the scalar build.
std::optional<StepPlan> plan_of(const DecodeStep& s, at::Tensor& x, at::Tensor& residual, at::TensorList input_norms,
                                at::TensorList post_norms, at::TensorList qkv_weights,
                                const c10::List<std::optional<at::Tensor>>& qkv_tails,
                                const c10::List<std::optional<at::Tensor>>& qkv_biases, at::TensorList o_weights,
                                at::TensorList gate_up_weights, at::TensorList down_weights,
                                at::TensorList k_caches, at::TensorList v_caches) {
#if !defined(VKV_VEC)
  return std::nullopt;
#else
  const int64_t L = static_cast<int64_t>(input_norms.size()), H = x.size(1);
  // one row of one sequence (its index tensors one entry each, read through raw pointers below)
  if (x.size(0) != 1 || s.q_start.numel() != 1 || s.q_len.numel() != 1 || s.ctx_len.numel() != 1 ||
      s.positions.numel() != 1 || s.token_seq.numel() != 1 || s.token_seq.data_ptr<int32_t>()[0] != 0 ||
      at::get_num_threads() != 2 || at::in_parallel_region())
    return std::nullopt;
  auto panels_ok = [](const at::Tensor& w) { return w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16; };
  // or every projection in GGUF blocks, each of the shape its step needs, the gate's units apart from the up's
  const int64_t I = s.act.size(1), nqkv = s.qkv.size(1), nq = s.q.size(1) * s.q.size(2);
  auto blocks_ok = [&](const at::Tensor& qkv, const std::optional<at::Tensor>& tail, const at::Tensor& o,
                       const at::Tensor& gate_up, const at::Tensor& down) {
    for (const at::Tensor* w : {&qkv, &o, &gate_up, &down, tail ? &*tail : &qkv})
      if (w->scalar_type() != at::kByte || w->dim() != 3 || !w->is_contiguous()) return false;
    const BlocksRef a = blocks_ref(qkv), b = blocks_ref(o), c = blocks_ref(gate_up), d = blocks_ref(down);
    const int64_t tail_n = tail ? blocks_ref(*tail).N : 0;
    return a.K == H && a.N + tail_n == nqkv && (!tail || blocks_ref(*tail).K == H) && b.K == nq && b.N == H &&
           c.K == H && c.N == 2 * I && I % c.unit == 0 && d.K == I && d.N == H;
  };
  auto norm_ok = [&](const at::Tensor& w) {
    return w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == H;
  };
  const at::ScalarType cache = k_caches[0].scalar_type();
  for (int64_t i = 0; i < L; ++i) {
    const std::optional<at::Tensor> bias = qkv_biases.get(i);
    const bool panels = panels_ok(qkv_weights[i]) && !qkv_tails.get(i) && panels_ok(o_weights[i]) &&
                        panels_ok(down_weights[i]) && gate_up_silu_applies(s.h, gate_up_weights[i], s.act);
    if (!(panels || blocks_ok(qkv_weights[i], qkv_tails.get(i), o_weights[i], gate_up_weights[i], down_weights[i])) ||
        !norm_ok(input_norms[i]) || !norm_ok(post_norms[i]) ||
        (bias && (bias->scalar_type() != at::kFloat || !bias->is_contiguous())) ||
        k_caches[i].scalar_type() != cache || v_caches[i].scalar_type() != cache ||
        k_caches[i].sizes() != v_caches[i].sizes() || k_caches[i].size(0) != k_caches[0].size(0) ||
        k_caches[i].size(2) != s.k.size(1) || s.block_size < 1 || s.block_size > k_caches[i].size(1))
      return std::nullopt;  // (kv heads and block size as rope_store and check_step held them)
    check_cache(s.q, k_caches[i], "k_cache");
    check_cache(s.q, v_caches[i], "v_cache");
  }
  if (!(s.cos_sin.scalar_type() == at::kFloat || s.cos_sin.scalar_type() == at::kBFloat16) || s.k.size(1) < 1 ||
      s.q.size(2) % 2 != 0 || s.cos_sin.size(1) != s.q.size(2) || s.block_table.dim() != 2 || s.block_table.size(0) < 1 ||
      s.block_table.stride(1) != 1)
    return std::nullopt;
  StepPlan p;
  p.layers.reserve(L);
  for (int64_t i = 0; i < L; ++i) {
    const std::optional<at::Tensor> bias = qkv_biases.get(i);
    const at::Tensor &k = k_caches[i], &v = v_caches[i];
    p.layers.push_back({input_norms[i].data_ptr<float>(), post_norms[i].data_ptr<float>(),
                        bias ? bias->data_ptr<float>() : nullptr, step_weight(qkv_weights[i], qkv_tails.get(i)),
                        step_weight(o_weights[i]),
                        step_weight(gate_up_weights[i]), step_weight(down_weights[i]), k.data_ptr(), v.data_ptr(),
                        {k.stride(0), k.stride(1), k.stride(2)}, {v.stride(0), v.stride(1), v.stride(2)},
                        context_ref(k, v)});
  }
  p.keys = step_keys(s);
  p.q_start = s.q_start.data_ptr<int32_t>();
  p.q_len = s.q_len.data_ptr<int32_t>();
  p.token_seq = s.token_seq.data_ptr<int32_t>();
  p.pos = s.positions.data_ptr<int64_t>();
  p.cos_sin = s.cos_sin.data_ptr();
  p.s_cs = s.cos_sin.stride(0);
  p.cs_rows = s.cos_sin.size(0);
  p.table_blocks = s.block_table.size(1);
  p.cache_blocks = k_caches[0].size(0);
  p.x = x.data_ptr<float>();
  p.residual = residual.data_ptr<float>();
  p.qkv = s.qkv.data_ptr<float>();
  p.attended = s.attended.data_ptr<float>();
  p.h = s.h.data_ptr<float>();
  p.gate_up = s.gate_up.data_ptr<float>();
  p.act = s.act.data_ptr<float>();
  p.I = I;
  p.H = H;
  p.heads = s.q.size(1);
  p.kv_heads = s.k.size(1);
  p.D = s.q.size(2);
  p.eps = s.eps;
  p.scale = s.scale;
  const bool bf16_table = s.cos_sin.scalar_type() == at::kBFloat16;
  dispatch(at::kFloat, cache, "decode_layers", [&](auto, auto c) {
    using C = decltype(c);
    p.rope = bf16_table ? &rope_of<C, c10::BFloat16> : &rope_of<C, float>;
    p.attend = &attend_of<C>;
  });
  p.row.resize(H);
  return p;
#endif
}

// The keys a step reads lie inside the block table and their blocks inside the caches (what
// check_step held for attention): before the region, whose context prefetch reads the table.
void check_keys(const StepPlan& p) {
  check_row_blocks(p.keys.table, p.table_blocks, p.keys.block_size, p.keys.ctx[0], p.cache_blocks);
}

// The step's row lies inside the rotary table and its keys (what rope_store and attention checked
// each layer): checked where the first layer's rope and attention read them, once a step.
void check_row(const StepPlan& p) {
  const int64_t pos = p.pos[0], ctx = p.keys.ctx[0];
  TORCH_CHECK(pos >= 0 && pos < p.cs_rows, "position ", pos, " is past the rotary table's ", p.cs_rows, " rows");
  TORCH_CHECK(p.q_start[0] == 0 && p.q_len[0] == 1 && pos < ctx, "sequence 0: its query at position ", pos, " and ",
              ctx, " keys do not fit one query row");
}

bool layers_in_one_region(StepPlan& p) {
#if !defined(VKV_VEC)
  return false;
#else
  if (decode_parts(p.keys.ctx[0], 1, 2) >= 2) return false;  // (attention past one work item)
  check_keys(p);
  const int64_t L = static_cast<int64_t>(p.layers.size());
  std::deque<NextContext> context;  // layer i's first keys and values: layer 0's asked for as the step starts,
  for (const LayerPlan& l : p.layers)  // layer i's in the down projection of layer i - 1
    context.emplace_back(p.keys, l.context);
  std::deque<AttendThenO> attend(L);
  Pair pair;
  bool solo = false;
  at::parallel_for(0, 2, 1, [&](int64_t lo, int64_t hi) {
    if (hi - lo == 2) {  // one thread ran the whole range: decode_layer's path instead
      solo = true;
      return;
    }
    const int64_t t = lo;
    StageClock clock;  // thread 0's: each stage ends when both threads are done with it
    clock.on &= t == 0;
    try {
      context[0].run();
      clock.lap(kContext);
      for (int64_t i = 0; i < L; ++i) {
        const LayerPlan& l = p.layers[i];
        if (t == 0) input_norm_row(p.x, p.residual, p.H, i == 0, l.input_norm, p.eps, p.row.data());
        if (!pair.meet(t)) return;
        clock.lap(kNorms);
        const auto [qlo, qhi] = share_of(t, l.qkv.units());
        weight_range(p.x, l.qkv, (p.heads + 2 * p.kv_heads) * p.D, l.qkv_bias, p.qkv, qlo, qhi);
        if (!pair.meet(t)) return;
        clock.lap(kQkv);
        auto rope_then_attend = [&] {
          if (i == 0) check_row(p);
          p.rope(p, l);
          clock.lap(kRope);
          p.attend(p, l, p.buf, p.wide);
          clock.lap(kAttention);
        };
        attend_then_o_part(t, false, attend[i], rope_then_attend, l.o, p.attended, p.h, p.H);
        if (t == 0 && attend[i].failed) std::rethrow_exception(attend[i].failed);
        if (!pair.meet(t)) return;
        clock.lap(kO);
        if (t == 0) norm_row<float>(p.h, p.residual, l.post_norm, p.H, p.eps, p.row.data());
        if (!pair.meet(t)) return;
        clock.lap(kNorms);
        const auto [glo, ghi] = share_of(t, l.gate_up.units() / 2);
        gate_up_silu_range(p.h, l.gate_up, p.gate_up, p.act, p.I, glo, ghi);
        if (!pair.meet(t)) return;
        clock.lap(kGateUp);
        const auto [dlo, dhi] = share_of(t, l.down.units());
        weight_range(p.act, l.down, p.H, nullptr, p.x, dlo, dhi);
        if (i + 1 < L) context[i + 1].run();
        if (!pair.meet(t)) return;
        clock.lap(kDown);
      }
    } catch (...) {
      pair.broken.store(true, std::memory_order_release);
      throw;
    }
  });
  return !solo;
#endif
}

// After the layers (decode_layers ends with it): the model's last norm and the LM head over the rows
// that sample (in Python the dozen small operations it replaces cost about 0.3 ms a step, run on
// caches the weights just streamed through). rows: int64 indices into x and residual; out:
// [rows, vocab] fp32. With bf16 (the model computes in bf16) every value is rounded where the
// layer-by-layer path's bf16 tensors round it: x and residual, the norm's output, the logits.
// So both paths give the same logits, to the bit.
// The last norm's output over the rows that sample, fp32 (what the LM head multiplies), into out:
// [rows, hidden]. Row by row with norm_row, add_rms_norm's own body, on copies of the rows (in bf16
// with `bf16`, rounded as .to(bf16) rounds), into a tensor decode_layers allocates once, instead of
// five ATen index_selects and casts dispatched on cold caches ("final_hidden_written_out" in
// benchmarks/results/cpu/design_choices.json).
template <typename T>
void final_hidden_impl(const at::Tensor& x, const at::Tensor& residual, const int64_t* rows, int64_t R,
                       const at::Tensor& norm, double eps, float* out) {
  const int64_t H = x.size(1);
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>();
  const T* w = norm.data_ptr<T>();
  std::vector<T> h(H), r(H);
  std::vector<float> row(H);
  for (int64_t i = 0; i < R; ++i) {
    const float *xr = xp + rows[i] * H, *rr = rp + rows[i] * H;
    for (int64_t j = 0; j < H; ++j) {
      store(h.data() + j, xr[j]);
      store(r.data() + j, rr[j]);
    }
    norm_row<T>(h.data(), r.data(), w, H, eps, row.data());
    for (int64_t j = 0; j < H; ++j) out[i * H + j] = load(h[j]);
  }
}

void final_hidden(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& rows, const at::Tensor& norm,
                  double eps, bool bf16, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && residual.sizes() == x.sizes() &&
              residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "x and residual: [rows, hidden] fp32 contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows: [n] int64");
  TORCH_CHECK(norm.dim() == 1 && norm.is_contiguous() && norm.size(0) == x.size(1) &&
              norm.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat),
              "the final norm: [hidden], bf16 under bf16 and fp32 otherwise");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows.size(0) &&
              out.size(1) == x.size(1), "out: [rows, hidden] fp32");
  const int64_t* idx = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < x.size(0), "rows: index ", idx[i], " is out of range for ", x.size(0), " rows");
  if (bf16)
    final_hidden_impl<c10::BFloat16>(x, residual, idx, rows.size(0), norm, eps, out.data_ptr<float>());
  else
    final_hidden_impl<float>(x, residual, idx, rows.size(0), norm, eps, out.data_ptr<float>());
}

void last_logits(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& rows, const at::Tensor& norm,
                 double eps, const at::Tensor& panels, bool bf16, at::Tensor out) {
  at::Tensor h = x.new_empty({rows.numel(), x.size(1)});
  final_hidden(x, residual, rows, norm, eps, bf16, h);
  project(h, panels, std::nullopt, out);
  if (bf16) out.copy_(out.to(at::kBFloat16));
}

// Multi-step decode's next inputs, written out: each row's token embedding into x (a bf16 embedding
// widens exactly, a GGUF one unpacks as dequantize_gguf's lookup did), positions and context
// lengths one on. As ATen ops
// (index_select, copy_, two add_) each op's dispatch ran cold, after a step's weights had streamed
// through the caches: many times what the same ops take in a loop of their own
// (benchmarks/results/cpu/design_choices.json, "next_inputs_written_out").
void next_inputs(const at::Tensor& embed, const int64_t* token, at::Tensor& x, const at::Tensor& pos,
                 const at::Tensor& ctx) {
  const int64_t M = x.size(0), H = x.size(1);
  float* out = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    TORCH_CHECK(token[r] >= 0 && token[r] < (embed.scalar_type() == at::kByte ? blocks_rows(embed) : embed.size(0)),
                "a picked token past the embedding's rows");
    if (embed.scalar_type() == at::kByte) {
      blocks_row(embed, token[r], out + r * H);
    } else if (embed.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* e = embed.data_ptr<c10::BFloat16>() + token[r] * embed.stride(0);
      for (int64_t h = 0; h < H; ++h) out[r * H + h] = load(e[h]);
    } else {
      const float* e = embed.data_ptr<float>() + token[r] * embed.stride(0);
      std::copy(e, e + H, out + r * H);
    }
  }
  int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i) ++p[i];
  int32_t* c = ctx.data_ptr<int32_t>();
  for (int64_t i = 0; i < ctx.numel(); ++i) ++c[i];
}

// Multi-step greedy decode (decode_layers given `tokens`, [steps, rows] int64, and the embedding):
// after each step's logits, every row takes its greedy token (row_max: torch.max's first maximal
// index) and, while steps remain, the next step runs on those tokens' embeddings one position on,
// with no return to Python between steps. Each step is the one-step call's arithmetic, so the tokens
// are the ones steps single calls pick. The rows' pages must be mapped for every step's position.
// The loop ends early once every row has picked one of `stop_ids`, or a row's logits are not
// finite (that row's token is then -2); the rows of `tokens` past the last step run are -1. Given
// `pick` and `pick_bounds` (fp32 arithmetic), each pick reads a bf16 copy of the LM head instead of
// the logits (greedy_pick: the same token, from half the bytes); `logits` then holds no logits.
void decode_layers(at::Tensor x, at::Tensor residual, at::TensorList input_norms, at::TensorList post_norms,
                   double eps, at::TensorList qkv_weights, const c10::List<std::optional<at::Tensor>>& qkv_tails,
                   const c10::List<std::optional<at::Tensor>>& qkv_biases, at::TensorList o_weights,
                   at::TensorList gate_up_weights, at::TensorList down_weights, int64_t num_heads, int64_t num_kv_heads, const at::Tensor& positions, const at::Tensor& cos_sin,
                   at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& block_table,
                   int64_t block_size, const at::Tensor& token_seq, const at::Tensor& q_start, const at::Tensor& q_len,
                   const at::Tensor& ctx_len, double scale, const std::optional<at::Tensor>& rows,
                   const std::optional<at::Tensor>& final_norm, const std::optional<at::Tensor>& lm_head, bool bf16,
                   std::optional<at::Tensor> logits, const std::optional<at::Tensor>& embed,
                   std::optional<at::Tensor> tokens, const std::optional<at::Tensor>& stop_ids,
                   const std::optional<at::Tensor>& pick, const std::optional<at::Tensor>& pick_bounds,
                   const std::optional<at::Tensor>& pick_scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == at::kFloat && x.is_contiguous() && residual.is_contiguous(),
              "x and residual: [rows, hidden] fp32 contiguous");  // (decode_layer copies and norms them in place)
  const size_t L = input_norms.size();
  TORCH_CHECK(L > 0 && post_norms.size() == L && qkv_weights.size() == L && qkv_tails.size() == L &&
                  qkv_biases.size() == L &&
              o_weights.size() == L && gate_up_weights.size() == L && down_weights.size() == L &&
              k_caches.size() == L && v_caches.size() == L, "one entry per layer in every list");
  const int64_t M = x.size(0), D = k_caches[0].size(3), nq = num_heads * D, nk = num_kv_heads * D;
  const int64_t inter = weight_inputs(down_weights[0]);
  const int64_t steps = tokens ? tokens->size(0) : 1;
  if (tokens) {
    TORCH_CHECK(logits && rows && rows->numel() == M && embed && weight_inputs(*embed) == x.size(1),
                "steps need logits for every row and the embedding");
    TORCH_CHECK(tokens->dim() == 2 && tokens->size(1) == M && tokens->scalar_type() == at::kLong &&
                tokens->is_contiguous(), "tokens: [steps, rows] int64 contiguous");
    TORCH_CHECK(!stop_ids || stop_ids->scalar_type() == at::kLong, "stop_ids: int64");
    TORCH_CHECK(!pick == !pick_bounds, "the pick's bf16 panels come with their bounds");
    TORCH_CHECK((embed->scalar_type() == at::kFloat || embed->scalar_type() == at::kBFloat16 ||
                 embed->scalar_type() == at::kByte) &&
                    embed->stride(1) == (embed->dim() == 3 ? embed->size(2) : 1) && positions.scalar_type() == at::kLong &&
                    ctx_len.scalar_type() == at::kInt,
                "steps: an fp32 or bf16 embedding with contiguous rows (or GGUF blocks), int64 positions, int32 context "
                "lengths");
    tokens->fill_(-1);
  }
  // the positions and context lengths move on each step: a copy, so the caller's stay as given
  const at::Tensor pos = steps > 1 ? positions.clone() : positions, ctx = steps > 1 ? ctx_len.clone() : ctx_len;
  DecodeStep s{pos, cos_sin, block_table, token_seq, q_start, q_len, ctx, block_size, eps, scale};
  s.qkv = x.new_empty({M, nq + 2 * nk});
  s.q = s.qkv.narrow(1, 0, nq).view({M, num_heads, D});
  s.k = s.qkv.narrow(1, nq, nk).view({M, num_kv_heads, D});
  s.v = s.qkv.narrow(1, nq + nk, nk).view({M, num_kv_heads, D});
  s.attended = x.new_empty({M, num_heads, D});
  s.h = x.new_empty({M, x.size(1)});
  s.gate_up = x.new_empty({M, 2 * inter});
  s.act = x.new_empty({M, inter});
  at::Tensor best = x.new_empty({M}), picked = x.new_empty({M}, x.options().dtype(at::kLong));
  at::Tensor hidden = x.new_empty({rows ? rows->numel() : 0, x.size(1)});  // the last norm's rows
  std::vector<char> stopped(M, 0);
  for (size_t i = 0; i < L; ++i)
    TORCH_CHECK(weight_inputs(down_weights[i]) == inter && k_caches[i].size(3) == D, "every layer has the same shapes");
  const int64_t* stop = stop_ids ? stop_ids->data_ptr<int64_t>() : nullptr;
  const int64_t num_stops = stop_ids ? stop_ids->numel() : 0;
  for (size_t i = 0; i < L; ++i)
    TORCH_CHECK(!qkv_tails.get(i) || qkv_weights[i].scalar_type() == at::kByte, "a qkv tail follows GGUF blocks");
  std::optional<StepPlan> plan = plan_of(s, x, residual, input_norms, post_norms, qkv_weights, qkv_tails, qkv_biases,
                                         o_weights, gate_up_weights, down_weights, k_caches, v_caches);
  for (int64_t step = 0; step < steps; ++step) {
    const bool one_region = plan && layers_in_one_region(*plan);
    if (!one_region)
      for (size_t i = 0; i < L; ++i) {
        const bool last = i + 1 == L;
        decode_layer(s, x, residual, i == 0, input_norms[i], post_norms[i], qkv_weights[i], qkv_tails.get(i),
                     qkv_biases.get(i),
                     o_weights[i], gate_up_weights[i], down_weights[i], k_caches[i], v_caches[i],
                     last ? nullptr : &k_caches[i + 1], last ? nullptr : &v_caches[i + 1]);
      }
    StageClock clock;
    if (clock.on) {
      stage_steps.fetch_add(1, std::memory_order_relaxed);
      if (one_region) region_steps.fetch_add(1, std::memory_order_relaxed);
    }
    if (!logits) return;
    TORCH_CHECK(rows && final_norm && lm_head, "logits need rows, the final norm and the LM head");
    if (tokens && pick) {  // only the pick is wanted: from half the LM head's bytes, exactly
      final_hidden(x, residual, *rows, *final_norm, eps, bf16, hidden);
      greedy_pick(hidden, *lm_head, *pick, *pick_bounds, pick_scales, bf16, *logits, best, picked);
    } else {
      last_logits(x, residual, *rows, *final_norm, eps, *lm_head, bf16, *logits);
      if (!tokens) return;
      row_max(*logits, best, picked);
    }
    const float* value = best.data_ptr<float>();
    int64_t* token = picked.data_ptr<int64_t>();
    bool finite = true, all_stopped = true;
    for (int64_t r = 0; r < M; ++r) {
      if (!std::isfinite(value[r])) {
        token[r] = -2;
        finite = false;
      }
      for (int64_t j = 0; j < num_stops && !stopped[r]; ++j) stopped[r] = token[r] == stop[j];
      all_stopped &= stopped[r] != 0;
    }
    std::copy(token, token + M, tokens->data_ptr<int64_t>() + step * M);
    clock.lap(kPick);
    if (!finite || all_stopped || step + 1 == steps) break;
    next_inputs(*embed, token, x, pos, ctx);
    clock.lap(kEmbed);
  }
}
}  // namespace vkv
