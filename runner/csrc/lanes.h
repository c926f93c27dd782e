// 16-lane fp32 vectors over fp32 or bf16 memory, shared by the CPU kernels (AVX-512 F, BW, VL):
// masked loads that widen bf16 exactly, stores that round to bf16 as c10::BFloat16 does (nearest even,
// NaN -> 0x7FC0), the value such a store would keep, and the mask of the last, partial vector.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "the CPU kernels need AVX-512 (F, BW, VL); runner/cpu_kernels.py does not build them without it"
#endif

namespace rollout_lanes {

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {  // bf16 is the top half of an fp32: exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m256i to_bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }

inline __m512 round_like(__m512 v, float) { return v; }
inline __m512 round_like(__m512 v, c10::BFloat16) {  // the value a bf16 store would keep, as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

}  // namespace rollout_lanes
