// 16-lane fp32 vectors over fp32 or bf16 memory, shared by the CPU kernels, on AVX-512 (F, BW, VL: one
// zmm register) or on AVX2 + FMA (two ymm halves): loads that widen bf16 exactly, stores that round to
// bf16 as c10::BFloat16 does (nearest even, NaN -> 0x7FC0), the value such a store would keep, the
// arithmetic the kernels use, and the live leading lanes of the last, partial vector.
//
// The kernels are written once against this header (V16, Mask, v* functions). Lane for lane both ISAs
// compute the same IEEE operations, and the horizontal sums and maxima reduce in one fixed tree (halves
// of 8, 4, 2, then 1 lanes) on both, so the two builds are meant to give the same bits (a build is one
// ISA, so no test compares them on one machine; each is tested against torch where it runs). What
// differs is speed: AVX2 has half the width and half the registers.
//
// Not here: fp16, other widths, ARM.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ROLLOUT_LANES_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ROLLOUT_LANES_AVX2 1
#else
#error "the CPU kernels need AVX-512 (F, BW, VL) or AVX2 with FMA; runner/cpu_kernels.py does not build them without"
#endif

namespace rollout_lanes {

// The last steps of the fixed reduction tree, from 8 lanes: 8 -> 4 (lane i + lane i + 4) -> 2 -> 1.
inline float hsum8(__m256 a) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
inline float hmax8(__m256 a) {
  const __m128 b = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(c, _mm_movehdup_ps(c)));
}

#if defined(ROLLOUT_LANES_AVX512)

using V16 = __m512;
using Mask = __mmask16;  // bit i: lane i is live

inline Mask all_lanes() { return static_cast<Mask>(0xFFFF); }
inline Mask lanes(int64_t left) {
  return left >= 16 ? static_cast<Mask>(0xFFFF) : static_cast<Mask>((1u << left) - 1u);
}

inline V16 vset1(float x) { return _mm512_set1_ps(x); }
inline V16 vzero() { return _mm512_setzero_ps(); }
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline V16 vfloor(V16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for integral n in the normal exponent range, by the exponent bits.
inline V16 vexp2i(V16 n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// Lanes outside m keep a.
inline V16 vmask_max(V16 a, Mask m, V16 b) { return _mm512_mask_max_ps(a, m, a, b); }
inline V16 vmask_add(V16 a, Mask m, V16 b) { return _mm512_mask_add_ps(a, m, a, b); }

// The fixed reduction tree: 16 -> 8 (lane i + lane i + 8), then hsum8 / hmax8.
inline __m256 upper8(V16 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
inline float vsum(V16 v) { return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), upper8(v))); }
inline float vmaxall(V16 v) { return hmax8(_mm256_max_ps(_mm512_castps512_ps256(v), upper8(v))); }

inline V16 load16(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
inline V16 load16(const c10::BFloat16* p, Mask m) {  // bf16 is the top half of an fp32: exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Each lane's bf16 bits (round to nearest even, NaN -> 0x7FC0), in the low half of its 32 bits.
inline __m512i bf16_bits32(V16 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

inline void store16(float* p, V16 v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, V16 v, Mask m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits32(v)));
}

inline V16 round_like(V16 v, float) { return v; }
inline V16 round_like(V16 v, c10::BFloat16) {  // the value a bf16 store would keep, as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits32(v), 16));
}

#else  // AVX2 + FMA: lanes 0-7 in lo, 8-15 in hi

struct V16 {
  __m256 lo, hi;
};
struct Mask {
  int n;  // lanes 0 .. n-1 are live (the kernels' masks are all prefixes)
};

inline Mask all_lanes() { return Mask{16}; }
inline Mask lanes(int64_t left) { return Mask{left >= 16 ? 16 : static_cast<int>(left)}; }

inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vfnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 vfloor(V16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)};
}
inline __m256 exp2i8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline V16 vexp2i(V16 n) { return {exp2i8(n.lo), exp2i8(n.hi)}; }

// All-ones 32-bit lanes for the live lanes of each half.
inline __m256i live8(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline V16 vblend(V16 a, Mask m, V16 b) {  // b on live lanes, a elsewhere
  return {_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(live8(m.n))),
          _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(live8(m.n - 8)))};
}
inline V16 vmask_max(V16 a, Mask m, V16 b) { return vblend(a, m, vmax(a, b)); }
inline V16 vmask_add(V16 a, Mask m, V16 b) { return vblend(a, m, vadd(a, b)); }

inline float vsum(V16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }  // the same tree as the AVX-512 path
inline float vmaxall(V16 v) { return hmax8(_mm256_max_ps(v.lo, v.hi)); }

inline V16 load16(const float* p, Mask m) {
  if (m.n >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  // maskload reads only the live lanes (no access past the row's end) and zeroes the rest.
  return {_mm256_maskload_ps(p, live8(m.n)), _mm256_maskload_ps(p + 8, live8(m.n - 8))};
}
inline __m256 widen8(__m128i bits16) {  // 8 bf16 -> 8 fp32, exact
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits16), 16));
}
inline V16 load16(const c10::BFloat16* p, Mask m) {
  if (m.n >= 16) {
    return {widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  // No 16-bit masked load before AVX-512: the live lanes through a zeroed buffer (only a row's tail).
  alignas(32) uint16_t buf[16] = {0};
  std::memcpy(buf, p, static_cast<size_t>(m.n > 0 ? m.n : 0) * sizeof(uint16_t));
  return {widen8(_mm_load_si128(reinterpret_cast<const __m128i*>(buf))),
          widen8(_mm_load_si128(reinterpret_cast<const __m128i*>(buf + 8)))};
}

inline __m256i bf16_bits32_8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline __m256i bf16_bits16(V16 v) {  // the 16 lanes' bf16 bits, in lane order
  // packus interleaves the halves per 128-bit lane (lo0-3 hi0-3 lo4-7 hi4-7); the permute restores order.
  // Every value is <= 0xFFFF, so the unsigned saturation never changes one.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits32_8(v.lo), bf16_bits32_8(v.hi)), 0xD8);
}

inline void store16(float* p, V16 v, Mask m) {
  if (m.n >= 16) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
    return;
  }
  _mm256_maskstore_ps(p, live8(m.n), v.lo);
  _mm256_maskstore_ps(p + 8, live8(m.n - 8), v.hi);
}
inline void store16(c10::BFloat16* p, V16 v, Mask m) {
  const __m256i bits = bf16_bits16(v);
  if (m.n >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
    return;
  }
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), bits);
  std::memcpy(p, buf, static_cast<size_t>(m.n > 0 ? m.n : 0) * sizeof(uint16_t));
}

inline V16 round_like(V16 v, float) { return v; }
inline V16 round_like(V16 v, c10::BFloat16) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits32_8(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits32_8(v.hi), 16))};
}

#endif

// Full 16-lane load and store of fp32 (no mask).
inline V16 vloadu(const float* p) { return load16(p, all_lanes()); }
inline void vstoreu(float* p, V16 v) { store16(p, v, all_lanes()); }

}  // namespace rollout_lanes
