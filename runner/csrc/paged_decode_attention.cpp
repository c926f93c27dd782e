// Paged attention for the CPU, decode and extend: each new query token attends in place to its
// request's KV slots in the paged pool (no gather, no mask, no padding). Built at first use by
// runner/cpu_kernels.py (torch.utils.cpp_extension, -O3 -march=native) and registered as
// torch.ops.rollout_cpu.paged_decode_attention and .paged_extend_attention.
//
// Work item = (new token, KV head). Its `group` query heads share that head's K/V rows, so each K/V
// row is read once per item and reused for every query head of the group (the GQA saving). A decode
// token sees all of its request's slots; new token j of an extend sees the cached prefix and new
// tokens 0..j (causal). Two passes over those slots: scores q.k for every key (fp32), then a softmax
// over them and the weighted sum of V rows. Accumulation is fp32 whatever the cache dtype (fp32 or
// bf16; bf16 is widened to fp32 exactly). 16-lane vectors (lanes.h: AVX-512, or AVX2 + FMA) over a
// compile-time head_dim; threads are torch's OpenMP team on the calling thread (the pool every torch CPU
// op uses). Without AVX-512 or AVX2 the loader keeps torch's ops and never builds this.
//
// Long bf16 extends can go to torch's flash SDPA instead (`extend_via_sdpa`, below): on a CPU with AMX its
// bf16 GEMMs run on the tile unit, which this per-token loop cannot use. The Python side turns that on
// (runner/cpu_kernels.py, set_extend_sdpa_min_tokens) where it pays.
//
// Not here: sliding windows, soft caps, sinks, fp16 caches. The Python side routes those to SDPA.
// The Tensor class and the few ops used, not all of ATen.h: ~5 s less compile per file.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_copy.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include "lanes.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace rollout_lanes;

// ---- head_dim = 16 * NV; query heads of a group in chunks of GC heads (for_head_chunks, below says how many),
// each chunk's q rows (or accumulators) and the current K (or V) row held in vector registers where they fit.

// e^x for x <= 0 (scores minus their max) on 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by a
// degree-6 Taylor polynomial (relative error < 2e-7 on that interval), 2^n by the exponent bits.
// Inputs below -87 are clamped there (e^-87 ~ 1.6e-38, the smallest normal fp32).
inline V16 exp_nonpos16(V16 x) {
  x = vmax(x, vset1(-87.0f));
  const V16 n = vfloor(vfmadd(x, vset1(1.44269504088896341f), vset1(0.5f)));
  V16 r = vfnmadd(n, vset1(0.693145751953125f), x);
  r = vfnmadd(n, vset1(1.42860682030941723212e-6f), r);
  V16 p = vset1(1.0f / 720.0f);
  p = vfmadd(p, r, vset1(1.0f / 120.0f));
  p = vfmadd(p, r, vset1(1.0f / 24.0f));
  p = vfmadd(p, r, vset1(1.0f / 6.0f));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vmul(p, vexp2i(n));
}

// Slots are scattered through the pool (decode steps interleave requests), so the hardware
// prefetcher cannot follow a request's rows: fetch the row kPrefetch tokens ahead by hand. 32 rows keep
// enough misses in flight: bench/decode_attention.py, 16 requests, 14/2 heads, bf16, on a Zen 5, 2048 keys
// 1.29-1.56 -> 1.13-1.20 ms a layer and 4096 keys 2.73-3.49 -> 2.25-2.46 ms against 8 rows (64: no better).
constexpr int64_t kPrefetch = 32;
template <int NV, typename T>
inline void prefetch_row(const T* p) {
  constexpr int kBytes = NV * 16 * static_cast<int>(sizeof(T));
  for (int off = 0; off < kBytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T0);
}

#if defined(ROLLOUT_LANES_AVX512)
// vsum of 3 or 4 vectors at once, each by vsum's own tree (lane i + lane i + 8, then + 4, + 2, + 1), so every
// sum has vsum's bits: the 4 trees share their shuffles and adds (11 vector ops for 4 sums instead of ~28).
// Lane 4k of the result holds vector k's sum.
inline V16 vsum4(V16 v0, V16 v1, V16 v2, V16 v3) {
  const V16 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x44), _mm512_shuffle_f32x4(v0, v1, 0xEE));
  const V16 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(v2, v3, 0x44), _mm512_shuffle_f32x4(v2, v3, 0xEE));
  // quarter k: s8_k[0:4] + s8_k[4:8]
  const V16 y = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
  const V16 z = _mm512_add_ps(y, _mm512_permute_ps(y, _MM_SHUFFLE(3, 2, 3, 2)));  // lanes 0, 1: + lanes 2, 3
  return _mm512_add_ps(z, _mm512_movehdup_ps(z));                                 // lane 0: + lane 1
}
#endif

// scores_chunk and values_chunk are forced inline: with the decode's chunks of up to 8 heads compiled
// beside them, GCC left the extend's chunk-of-4 calls out of line, and a 1024-token fp32 extend (one request,
// 14/2 heads, 2-core Xeon) took 12.7-13.4 ms against 9.3-10.6 ms inlined.
template <int NV, int GC, typename T>
__attribute__((always_inline)) inline void scores_chunk(const float* __restrict q, const T* __restrict k_base, int64_t slot_stride,
                  const int64_t* __restrict slots, int64_t len, float* __restrict scores,
                  const T* __restrict v_base) {  // v_base: also prefetch these V rows (nullptr: not)
  V16 qv[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) qv[g][j] = vloadu(q + g * NV * 16 + j * 16);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetch < len) {
      prefetch_row<NV>(k_base + slots[t + kPrefetch] * slot_stride);
      if (v_base) prefetch_row<NV>(v_base + slots[t + kPrefetch] * slot_stride);
    }
    const T* k = k_base + slots[t] * slot_stride;
    V16 kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = load16(k + j * 16, all_lanes());
    V16 a[GC];
    for (int g = 0; g < GC; ++g) {
      a[g] = vmul(qv[g][0], kv[0]);
      for (int j = 1; j < NV; ++j) a[g] = vfmadd(qv[g][j], kv[j], a[g]);
    }
#if defined(ROLLOUT_LANES_AVX512)
    if constexpr (GC >= 5) {  // two sets of 4 sums (decode chunks of up to 8 heads)
      alignas(64) float s[32];
      _mm512_store_ps(s, vsum4(a[0], a[1], a[2], a[3]));
      _mm512_store_ps(s + 16, vsum4(a[4 % GC], GC >= 6 ? a[5 % GC] : vzero(), GC >= 7 ? a[6 % GC] : vzero(),
                                    GC >= 8 ? a[7 % GC] : vzero()));
      for (int g = 0; g < GC; ++g) scores[g * len + t] = s[4 * g];
      continue;
    } else if constexpr (GC >= 3) {
      alignas(64) float s[16];
      _mm512_store_ps(s, vsum4(a[0], a[1], a[2], GC == 4 ? a[GC - 1] : vzero()));
      for (int g = 0; g < GC; ++g) scores[g * len + t] = s[4 * g];
      continue;
    }
#endif
    for (int g = 0; g < GC; ++g) scores[g * len + t] = vsum(a[g]);
  }
}

template <int NV, int GC, typename T>
__attribute__((always_inline)) inline void values_chunk(const T* __restrict v_base, int64_t slot_stride, const int64_t* __restrict slots, int64_t len,
                  const float* __restrict probs, float* __restrict acc) {
  V16 av[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) av[g][j] = vzero();
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetch < len) prefetch_row<NV>(v_base + slots[t + kPrefetch] * slot_stride);
    const T* v = v_base + slots[t] * slot_stride;
    V16 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(v + j * 16, all_lanes());
    for (int g = 0; g < GC; ++g) {
      const V16 p = vset1(probs[g * len + t]);
      for (int j = 0; j < NV; ++j) av[g][j] = vfmadd(p, vv[j], av[g][j]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) vstoreu(acc + g * NV * 16 + j * 16, av[g][j]);
}

// Softmax of each of `group` rows of `len` scores, in place (unnormalized: e^(s - max)); returns
// the row sums' reciprocals in inv_sum.
inline void softmax_rows(float* scores, int64_t len, int group, float* inv_sum) {
  for (int g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    V16 mv = vset1(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) mv = vmax(mv, vloadu(sg + t));
    const Mask tail = lanes(len - t);
    mv = vmask_max(mv, tail, load16(sg + t, tail));
    const V16 m = vset1(vmaxall(mv));
    V16 sum = vzero();
    for (t = 0; t + 16 <= len; t += 16) {
      const V16 p = exp_nonpos16(vsub(vloadu(sg + t), m));
      vstoreu(sg + t, p);
      sum = vadd(sum, p);
    }
    const V16 p = exp_nonpos16(vsub(load16(sg + t, tail), m));
    store16(sg + t, p, tail);
    sum = vmask_add(sum, tail, p);
    inv_sum[g] = 1.0f / vsum(sum);
  }
}

// f(std::integral_constant<int, GC>, g0) for each chunk g0 .. g0 + GC - 1 (GC <= kMax) of the group's heads:
// GC is a compile-time constant, so a chunk's rows live in registers (or, past what the registers hold, in
// L1), and each chunk is one pass over the keys. How many heads a chunk takes, per kind of step:
// - AVX2 has 16 ymm registers, and a V16 is two of them: chunks of 2 heads there, both kinds (a 16 x 512-key
//   decode, 14 q / 2 KV heads, head_dim 64, fp32, measured on a 2-core EPYC on one thread: 1.17-1.44 ms
//   against 1.23-2.33 ms with chunks of 4 over three runs each, noisy).
// - AVX-512, decode: up to 8 heads, so a GQA group of up to 8 reads each request's K and V rows once instead
//   of once per chunk of 4; what spills is q, reloaded from L1. bench/decode_attention.py on a 2-core Xeon,
//   16 requests: 14/2 heads, head_dim 64, bf16 0.34 / 2.76 / 6.48 -> 0.31 / 2.00 / 4.58 ms a layer at
//   576 / 2048 / 4096 keys, fp32 0.79 / 4.29 -> 0.59 / 2.87 at 576 / 2048; head_dim 128 with 12/2 heads
//   0.92 / 5.52 -> 0.66 / 4.40, 16/2 1.07 / 5.71 -> 1.01 / 4.51; 32/8 (groups of 4) unchanged.
// - AVX-512, extend: chunks of 4. A new token's keys are few and recently written (in cache), so the pass
//   is compute-bound and the spills cost more than the second read: fp32 0.69 / 10.1 / 41.0 ms at 256 /
//   1024 / 2048 tokens with chunks of 4 against 0.89 / 13.2 / 52.7 with 8 (one request, 14/2 heads).
// Chunking changes no bits: each head's dot products and weighted sums run in the same order in any chunk.
#if defined(ROLLOUT_LANES_AVX512)
constexpr int kMaxGCDecode = 8;
constexpr int kMaxGCExtend = 4;
#else
constexpr int kMaxGCDecode = 2;
constexpr int kMaxGCExtend = 2;
#endif
template <int kMax, typename F>
inline void for_head_chunks(int group, F&& f) {
  for (int g0 = 0; g0 < group; g0 += kMax) {
    switch (group - g0 < kMax ? group - g0 : kMax) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      // Unreachable when kMax is smaller (the 1 only keeps those instances valid).
      case 3: f(std::integral_constant<int, 3 <= kMax ? 3 : 1>{}, g0); break;
      case 4: f(std::integral_constant<int, 4 <= kMax ? 4 : 1>{}, g0); break;
      case 5: f(std::integral_constant<int, 5 <= kMax ? 5 : 1>{}, g0); break;
      case 6: f(std::integral_constant<int, 6 <= kMax ? 6 : 1>{}, g0); break;
      case 7: f(std::integral_constant<int, 7 <= kMax ? 7 : 1>{}, g0); break;
      default: f(std::integral_constant<int, kMax>{}, g0); break;
    }
  }
}

template <int kMax, int NV, typename T>
void attend_simd(const float* q, const T* k_base, const T* v_base, int64_t slot_stride, const int64_t* slots,
                 int64_t len, int group, float* scores, float* acc, float* inv_sum, bool extend) {
  constexpr int D = NV * 16;
  // The first head chunk's pass over the keys also prefetches the V rows the weighted sums read next
  // (bench/decode_attention.py and a 16 x 1024 extend on a Zen 5: bf16 extend 139-143 -> 106-115 ms a layer,
  // fp32 extend 154-159 -> 128-135, bf16 decode at 576 keys 0.27 -> 0.22 ms); not for an fp32 decode, whose
  // rows are twice as long: there it measured ~5% slower at 2048 keys.
  const T* v_ahead = (extend || sizeof(T) == 2) ? v_base : nullptr;
  for_head_chunks<kMax>(group, [&](auto gc, int g0) {
    scores_chunk<NV, decltype(gc)::value, T>(q + g0 * D, k_base, slot_stride, slots, len, scores + g0 * len,
                                             g0 == 0 ? v_ahead : nullptr);
  });
  softmax_rows(scores, len, group, inv_sum);
  for_head_chunks<kMax>(group, [&](auto gc, int g0) {
    values_chunk<NV, decltype(gc)::value, T>(v_base, slot_stride, slots, len, scores + g0 * len, acc + g0 * D);
  });
  for (int g = 0; g < group; ++g)
    for (int d = 0; d < D; ++d) acc[g * D + d] *= inv_sum[g];
}
template <int kMax, int D, typename T>
inline void attend_one(const float* q, const T* k_base, const T* v_base, int64_t slot_stride, const int64_t* slots,
                       int64_t len, int group, float* scores, float* acc, float* inv_sum, bool extend) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16 lanes");
  attend_simd<kMax, D / 16, T>(q, k_base, v_base, slot_stride, slots, len, group, scores, acc, inv_sum, extend);
}

// Token t of the step (q row t) belongs to request tok_req[t] and sees that request's first tok_len[t]
// slots: for decode one token per request seeing all seq_len slots; for an extend of n new tokens on
// top of seq_len - n cached ones, new token j sees seq_len - n + j + 1 (causal, prefix included).
template <int kMax, int D, typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
         const int64_t* extend_lens, double scale, at::Tensor& out) {
  const int64_t bs = seq_lens.numel(), num_tokens = q.size(0), hq = q.size(1), hkv = k_cache.size(1);
  const int group = static_cast<int>(hq / hkv);
  const int64_t slot_stride = k_cache.stride(0);  // the same for v_cache (checked by the caller)
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* r2t = req_to_token.data_ptr<int64_t>();
  const int64_t r2t_stride = req_to_token.stride(0);
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  std::vector<int64_t> tok_req, tok_len;  // the requests' lengths and slots were checked (check_requests)
  tok_req.reserve(num_tokens);
  tok_len.reserve(num_tokens);
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t n = extend_lens ? extend_lens[b] : 1;
    for (int64_t j = 0; j < n; ++j) {
      tok_req.push_back(b);
      tok_len.push_back(lens[b] - n + j + 1);
    }
  }
  const int64_t items = num_tokens * hkv;
  // OpenMP directly, not at::parallel_for: the team is the calling thread's own setting, the one
  // torch.set_num_threads gave it (at::parallel_for's first call per thread in an extension re-applies
  // the process-wide default, undoing a per-thread setting such as the scheduler's one thread).
  // It is torch's own libgomp (the extension links the already-loaded libgomp.so.1). Items differ
  // in length: dynamic scheduling; each item's result does not depend on which thread runs it.
#pragma omp parallel if (items > 1)
  {
    std::vector<float> qf(group * D), acc(group * D), inv_sum(group), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t = item / hkv, h = item % hkv;
      const int64_t b = tok_req[t], len = tok_len[t];
      const T* qt = qp + (t * hq + h * group) * D;  // q is [num_tokens, hq, D] contiguous
      for (int i = 0; i < group * D; i += 16)
        vstoreu(qf.data() + i, vmul(load16(qt + i, all_lanes()), vset1(fscale)));
      scores.resize(static_cast<size_t>(group) * len);
      attend_one<kMax, D, T>(qf.data(), kp + h * D, vp + h * D, slot_stride, r2t + rows[b] * r2t_stride, len, group,
                       scores.data(), acc.data(), inv_sum.data(), extend_lens != nullptr);
      T* ot = op + (t * hq + h * group) * D;
      for (int i = 0; i < group * D; i += 16) store16(ot + i, vloadu(acc.data() + i), all_lanes());
    }
  }
}

// Decode and extend compile separately, each with its own head chunks (for_head_chunks).
template <int D, typename T>
void run_kind(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& r2t,
              const at::Tensor& rows, const at::Tensor& lens, const int64_t* ext, double scale, at::Tensor& out) {
  if (ext != nullptr)
    run<kMaxGCExtend, D, T>(q, k, v, r2t, rows, lens, ext, scale, out);
  else
    run<kMaxGCDecode, D, T>(q, k, v, r2t, rows, lens, ext, scale, out);
}

template <typename T>
bool dispatch_dim(int64_t d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& r2t, const at::Tensor& rows, const at::Tensor& lens, const int64_t* ext,
                  double scale, at::Tensor& out) {
  switch (d) {
    case 16: run_kind<16, T>(q, k, v, r2t, rows, lens, ext, scale, out); return true;
    case 32: run_kind<32, T>(q, k, v, r2t, rows, lens, ext, scale, out); return true;
    case 64: run_kind<64, T>(q, k, v, r2t, rows, lens, ext, scale, out); return true;
    case 80: run_kind<80, T>(q, k, v, r2t, rows, lens, ext, scale, out); return true;
    case 96: run_kind<96, T>(q, k, v, r2t, rows, lens, ext, scale, out); return true;
    case 128: run_kind<128, T>(q, k, v, r2t, rows, lens, ext, scale, out); return true;
    case 256: run_kind<256, T>(q, k, v, r2t, rows, lens, ext, scale, out); return true;
    default: return false;
  }
}

// The arguments' shapes, dtypes and layouts (extend_lens: nullptr for decode).
void check_args(const char* name, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                const at::Tensor* extend_lens) {
  TORCH_CHECK(q.device().is_cpu(), name, ": q must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), name, ": q must be contiguous [num_tokens, hq, head_dim]");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), name,
              ": k_cache and v_cache must both be [slots, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(), name,
              ": q, k_cache and v_cache must share one dtype");
  const int64_t d = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d, name, ": head_dim of q and the cache differ");
  TORCH_CHECK(q.size(1) % hkv == 0, name, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == d && v_cache.strides() == k_cache.strides(), name,
              ": the caches' (kv_heads, head_dim) rows must be contiguous, same strides");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.stride(1) == 1, name,
              ": req_to_token must be int64 with contiguous rows");
  const int64_t bs = seq_lens.numel();
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.is_contiguous() && seq_lens.is_contiguous() && req_pool_indices.numel() == bs &&
                  (extend_lens != nullptr || bs == q.size(0)),
              name, ": req_pool_indices and seq_lens must be contiguous int64 [bs]");
  if (extend_lens != nullptr)
    TORCH_CHECK(extend_lens->scalar_type() == at::kLong && extend_lens->is_contiguous() && extend_lens->numel() == bs,
                name, ": extend_lens must be contiguous int64 [bs]");
}

// Each request's lengths, pool row and slots (ext: nullptr for decode, one new token each), and that the new
// tokens add up to q's num_tokens rows. A slot outside the pool would read out of bounds: one sequential pass
// over each request's slots first (small against the attention), so the step fails cleanly instead.
void check_requests(const char* name, int64_t num_tokens, const at::Tensor& k_cache, const at::Tensor& req_to_token,
                    const at::Tensor& req_pool_indices, const at::Tensor& seq_lens, const int64_t* ext) {
  const int64_t bs = seq_lens.numel(), num_slots = k_cache.size(0);
  const int64_t max_context = req_to_token.size(1), num_rows = req_to_token.size(0);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* r2t = req_to_token.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_context, name, ": seq_lens[", b, "] = ", lens[b], " is outside [1, ",
                max_context, "]");
    TORCH_CHECK(rows[b] >= 0 && rows[b] < num_rows, name, ": req_pool_indices[", b, "] = ", rows[b],
                " is outside [0, ", num_rows, ")");
    const int64_t n = ext ? ext[b] : 1;
    TORCH_CHECK(n >= 1 && n <= lens[b], name, ": extend_lens[", b, "] = ", n, " is outside [1, seq_lens[", b, "] = ",
                lens[b], "]");
    const int64_t* slots = r2t + rows[b] * req_to_token.stride(0);
    bool in_pool = true;
    for (int64_t t = 0; t < lens[b]; ++t) in_pool &= (slots[t] >= 0) & (slots[t] < num_slots);
    TORCH_CHECK(in_pool, name, ": request ", b, " has a KV slot outside the pool [0, ", num_slots, ")");
    total += n;
  }
  TORCH_CHECK(total == num_tokens, name, ": q has ", num_tokens, " rows but the requests' new tokens sum to ", total);
}

// The kernel over checked arguments -> [num_tokens, hq, D] in q's dtype.
at::Tensor run_kernel(const char* name, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      const int64_t* ext, double scale) {
  const int64_t d = q.size(2);
  auto out = at::empty_like(q);
  bool ok = false;
  if (q.scalar_type() == at::kFloat) {
    ok = dispatch_dim<float>(d, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    ok = dispatch_dim<c10::BFloat16>(d, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext,
                                     scale, out);
  } else {
    TORCH_CHECK(false, name, ": dtype ", q.scalar_type(), " not supported (float32, bfloat16)");
  }
  TORCH_CHECK(ok, name, ": head_dim ", d, " not compiled (16, 32, 64, 80, 96, 128, 256)");
  return out;
}

at::Tensor attend(const char* name, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                  const at::Tensor* extend_lens, double scale) {
  check_args(name, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_lens);
  const int64_t* ext = extend_lens != nullptr ? extend_lens->data_ptr<int64_t>() : nullptr;
  check_requests(name, q.size(0), k_cache, req_to_token, req_pool_indices, seq_lens, ext);
  return run_kernel(name, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext, scale);
}

// q: [bs, hq, D]; k_cache, v_cache: [slots, hkv, D] with contiguous (hkv, D) rows; req_to_token:
// [max_reqs, max_context] int64; req_pool_indices, seq_lens: [bs] int64 (seq_lens >= 1, counting
// this step's token, whose K/V is already in the pool) -> [bs, hq, D] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, double scale) {
  return attend("paged_decode_attention", q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, nullptr,
                scale);
}

// bf16 extends of at least this many new tokens go to torch's SDPA; 0: none do (the default, until the
// Python side sets it: it knows whether the CPU has AMX, which ATen's C++ API does not say).
std::atomic<int64_t> g_sdpa_min_tokens{0};
// An extend after a cached prefix needs a [new tokens, seq_len] mask (SDPA's causal flag aligns the top-left
// corner, not the bottom-right); SDPA widens it to a bf16 mask of the same shape. Above this many elements
// (a 2048-token chunk after 6k cached tokens: 16 MB of bools, 32 MB widened) the kernel keeps the request
// instead of allocating that. Masked, SDPA still beat the kernel on the Xeon: a 2048-token chunk after 2048
// / 4096 cached tokens 56 / 85 ms against 126 / 220 ms, 300 new after 6000 cached 13 vs 42 ms (14/2 heads).
constexpr int64_t kSdpaMaxMaskElements = int64_t{1} << 24;

bool takes_sdpa(int64_t new_tokens, int64_t seq_len, int64_t min_tokens) {
  return min_tokens > 0 && new_tokens >= min_tokens &&
         (new_tokens == seq_len || new_tokens * seq_len <= kSdpaMaxMaskElements);
}

int64_t set_extend_sdpa_min_tokens(int64_t min_tokens) {
  TORCH_CHECK(min_tokens >= 0, "set_extend_sdpa_min_tokens: min_tokens must be >= 0 (0: never), got ", min_tokens);
  return g_sdpa_min_tokens.exchange(min_tokens);
}

// Request b's extend through torch's flash SDPA: its K/V rows gathered out of the pool ([seq_len, hkv, D],
// a small copy against the attention), its queries [n, hq, D] as one [1, hq, n, D] batch with GQA, causal
// from position seq_len - n (the cached prefix fully visible: a boolean mask when there is one). Writes
// out's rows [offset, offset + n). fp32 accumulation inside; the probabilities are rounded to bf16 before
// they weight V (SDPA's bf16 path, HF's too), so rows differ from the kernel's by bf16 rounding.
void extend_via_sdpa(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* slots,
                     int64_t seq_len, int64_t n, int64_t offset, double scale, at::Tensor& out) {
  const auto opts = at::TensorOptions().dtype(at::kLong);
  const at::Tensor idx = at::from_blob(const_cast<int64_t*>(slots), {seq_len}, opts);
  const at::Tensor k = k_cache.index_select(0, idx).transpose(0, 1).unsqueeze(0);  // [1, hkv, seq_len, D]
  const at::Tensor v = v_cache.index_select(0, idx).transpose(0, 1).unsqueeze(0);
  const at::Tensor qb = q.narrow(0, offset, n).transpose(0, 1).unsqueeze(0);  // [1, hq, n, D]
  const int64_t prefix = seq_len - n;
  std::optional<at::Tensor> mask;
  if (prefix > 0) {  // query j sees keys 0 .. prefix + j
    const at::Tensor keys = at::arange(seq_len, opts);
    const at::Tensor last = at::arange(prefix, seq_len, opts).unsqueeze(1);  // [n, 1]
    mask = keys.unsqueeze(0).le(last);  // [n, seq_len] bool
  }
  const at::Tensor o = at::scaled_dot_product_attention(qb, k, v, mask, 0.0, /*is_causal=*/prefix == 0, scale,
                                                        /*enable_gqa=*/true);  // [1, hq, n, D]
  out.narrow(0, offset, n).copy_(o.squeeze(0).transpose(0, 1));
}

// The same for an extend step: q: [num_tokens, hq, D], request b's extend_lens[b] new tokens in order
// (their K/V already in the pool, at positions seq_lens[b] - extend_lens[b] onwards), causal.
// bf16 requests with at least g_sdpa_min_tokens new tokens take extend_via_sdpa (unless their prefix mask
// would be over kSdpaMaxMaskElements); the rest the kernel (as a sub-batch of their rows when some took SDPA).
at::Tensor paged_extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                                  const at::Tensor& seq_lens, const at::Tensor& extend_lens, double scale) {
  const char* name = "paged_extend_attention";
  // The whole step is checked before any work, as for decode.
  check_args(name, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, &extend_lens);
  const int64_t* ext = extend_lens.data_ptr<int64_t>();
  check_requests(name, q.size(0), k_cache, req_to_token, req_pool_indices, seq_lens, ext);
  const int64_t bs = seq_lens.numel();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t min_tokens = q.scalar_type() == at::kBFloat16 ? g_sdpa_min_tokens.load() : 0;
  int64_t num_sdpa = 0;
  for (int64_t b = 0; b < bs; ++b) num_sdpa += takes_sdpa(ext[b], lens[b], min_tokens);
  if (num_sdpa == 0) return run_kernel(name, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, ext, scale);

  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  const int64_t* r2t = req_to_token.data_ptr<int64_t>();
  at::Tensor out = at::empty_like(q);
  std::vector<int64_t> kernel_reqs, kernel_rows;  // the requests (and their q rows) the kernel takes
  for (int64_t b = 0, offset = 0; b < bs; offset += ext[b], ++b) {
    if (takes_sdpa(ext[b], lens[b], min_tokens)) {
      extend_via_sdpa(q, k_cache, v_cache, r2t + rows[b] * req_to_token.stride(0), lens[b], ext[b], offset, scale,
                      out);
    } else {
      kernel_reqs.push_back(b);
      for (int64_t t = 0; t < ext[b]; ++t) kernel_rows.push_back(offset + t);
    }
  }
  if (!kernel_reqs.empty()) {
    const auto opts = at::TensorOptions().dtype(at::kLong);
    const at::Tensor req_idx = at::from_blob(kernel_reqs.data(), {static_cast<int64_t>(kernel_reqs.size())}, opts);
    const at::Tensor row_idx = at::from_blob(kernel_rows.data(), {static_cast<int64_t>(kernel_rows.size())}, opts);
    const at::Tensor sub_ext = extend_lens.index_select(0, req_idx);  // a subset of checked requests
    const at::Tensor sub = run_kernel(name, q.index_select(0, row_idx), k_cache, v_cache, req_to_token,
                                      req_pool_indices.index_select(0, req_idx), seq_lens.index_select(0, req_idx),
                                      sub_ext.data_ptr<int64_t>(), scale);
    out.index_copy_(0, row_idx, sub);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(rollout_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_lens, float scale) -> Tensor");
  m.def("set_extend_sdpa_min_tokens(int min_tokens) -> int");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_extend_attention", &paged_extend_attention);
}

TORCH_LIBRARY_IMPL(rollout_cpu, CompositeExplicitAutograd, m) {
  m.impl("set_extend_sdpa_min_tokens", &set_extend_sdpa_min_tokens);
}
