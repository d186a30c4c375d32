// 16-lane float32 helpers for the AVX-512 kernels (prefill_attention.cpp,
// layer_kernels_avx512.cpp). Included inside their `#pragma GCC target` region: the build's
// flags stay AVX2, and these are only called on CPUs with AVX-512 F/BW/DQ/VL.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace epdserve_avx512 {

// e^x for x <= 0: 2^k e^r, k = round(x / ln 2), e^r by its degree-6 Taylor polynomial
// (relative error < 2e-7, the same arithmetic as layer_kernels.cpp's 8-lane
// exp_nonpositive, lane for lane); ~0 (1.6e-38) below -87.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);  // ln 2 split in two for precision
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, k);
}

// v's lanes rounded to bfloat16 as PyTorch rounds (to nearest even, NaN to 0x7FC0), each in
// the upper 16 bits of its 32, the lower bits zero.
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_slli_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
}

// v rounded to bfloat16 and back.
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(bf16_bits(v)); }

// 16 float32 or bfloat16 values, as float32; stored with PyTorch's rounding to bfloat16.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}

}  // namespace epdserve_avx512
