// Q4_1 weights in bit planes, for CPUs with AVX-512 F/BW/DQ/VL: quant_kernels.cpp's quant_mm
// and dequantize call these for blocks in this layout (quant.py's to_planes packs them).
//
// Layout, per group of 16 weight rows R and block b (32 weights along K, 8 groups of 4):
//   qs int32 [N/16, K/32, 4, 16]: word j of row r holds 8 nibbles; nibble 4h + k (bits
//     16h + 4k .. 16h + 4k + 3) is bit plane k of the block's weights 4g .. 4g + 3, g = 2j + h:
//     its bit i is bit k of q[4g + i];
//   scales (d), mins (m) float16 [N/16, K/32, 16]: the GGUF's own fp16 values.
// So a block is 20 bytes, as in the GGUF (the other layout holds d and m as float32: 24).
//
// Decode (1-3 rows of x): the 16 rows of a group sit in the 16 lanes. For each 4 weights of x
// a table holds the 16 sums of their subsets; each plane's nibble indexes it (vpermps), so one
// instruction adds 4 weights' bits for 16 rows; the planes are weighed 1, 2, 4, 8 once per
// block. Against the nibble-to-float conversions of quant_kernels.cpp's fused_row512 this
// measured ~1.45x the weights per second on a Zen 4 core in cache (8 -> 5.5 cycles a row's
// block), where that kernel could not keep up with the memory.
// Larger batches dequantize a group once into a [K, 16] buffer (w = d * q + m, gguf's two
// roundings) and multiply it by x an outer product at a time, broadcasting x.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")

namespace epdserve_avx512 {
namespace {

constexpr int64_t kLanes = 16, kBlock = 32, kWords = 4;  // rows a group, weights a block, words a row's block

// tables [K/4, 16]: entry p of table g is the sum of x[4g + i] over the bits i of p.
void subset_sums(const float* x, int64_t K, float* tables) {
  for (int64_t g = 0; g < K / 4; ++g) {
    const float* xg = x + 4 * g;
    __m512 t = _mm512_maskz_mov_ps(0xAAAA, _mm512_set1_ps(xg[0]));
    t = _mm512_mask_add_ps(t, 0xCCCC, t, _mm512_set1_ps(xg[1]));
    t = _mm512_mask_add_ps(t, 0xF0F0, t, _mm512_set1_ps(xg[2]));
    t = _mm512_mask_add_ps(t, 0xFF00, t, _mm512_set1_ps(xg[3]));
    _mm512_storeu_ps(tables + kLanes * g, t);
  }
}

__m512 halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[j, 0..15] = the group's 16 rows . x row j, for MT rows of x: tables [MT, K/4, 16],
// xsum [MT, nb] (each x row's block sums, for the mins).
template <int MT>
void lut_group(const int32_t* w, const at::Half* d, const at::Half* m, int64_t nb, const float* tables,
               const float* xsum, float* out, int64_t ldo) {
  const int64_t groups = nb * kBlock / 4;
  __m512 acc[MT];
  for (int j = 0; j < MT; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const char* ahead = reinterpret_cast<const char*>(w + (b * kWords) * kLanes) + 2048;  // 8 blocks on
    for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    if (b % 2 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(d + b * kLanes) + 512, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + b * kLanes) + 512, _MM_HINT_T0);
    }
    __m512 planes[MT][4];
    for (int j = 0; j < MT; ++j)
      for (int k = 0; k < 4; ++k) planes[j][k] = _mm512_setzero_ps();
    for (int word = 0; word < kWords; ++word) {
      __m512i v = _mm512_loadu_si512(w + (b * kWords + word) * kLanes);
      for (int h = 0; h < 2; ++h) {
        const int64_t g = b * 8 + 2 * word + h;
        for (int k = 0; k < 4; ++k) {
          for (int j = 0; j < MT; ++j)
            planes[j][k] = _mm512_add_ps(planes[j][k],
                                         _mm512_permutexvar_ps(v, _mm512_loadu_ps(tables + (j * groups + g) * kLanes)));
          v = _mm512_srli_epi32(v, 4);
        }
      }
    }
    const __m512 dv = halves(d + b * kLanes), mv = halves(m + b * kLanes);
    for (int j = 0; j < MT; ++j) {
      __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(2.0f), planes[j][1], planes[j][0]);
      t = _mm512_fmadd_ps(_mm512_set1_ps(4.0f), planes[j][2], t);
      t = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), planes[j][3], t);
      acc[j] = _mm512_fmadd_ps(dv, t, acc[j]);
      acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[j * nb + b]), acc[j]);
    }
  }
  for (int j = 0; j < MT; ++j) _mm512_storeu_ps(out + j * ldo, acc[j]);
}

// Each 16-bit half of v: a 4 x 4 bit matrix, bit 4k + i (plane k, weight i), transposed in place
// (two delta swaps) to bit 4i + k: nibble i is then q of weight i.
__m512i transpose_nibbles(__m512i v) {
  constexpr int kXor3 = 0x96;  // a ^ b ^ c
  __m512i t = _mm512_and_si512(_mm512_xor_si512(v, _mm512_srli_epi32(v, 3)), _mm512_set1_epi32(0x0A0A0A0A));
  v = _mm512_ternarylogic_epi32(v, t, _mm512_slli_epi32(t, 3), kXor3);
  t = _mm512_and_si512(_mm512_xor_si512(v, _mm512_srli_epi32(v, 6)), _mm512_set1_epi32(0x00CC00CC));
  return _mm512_ternarylogic_epi32(v, t, _mm512_slli_epi32(t, 6), kXor3);
}

// wT [K, 16]: the group's weights, column k's 16 rows at wT + 16k, w = d * q + m (mul, then add).
void dequant_group(const int32_t* w, const at::Half* d, const at::Half* m, int64_t nb, float* wT) {
  const __m512i low = _mm512_set1_epi32(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 dv = halves(d + b * kLanes), mv = halves(m + b * kLanes);
    for (int word = 0; word < kWords; ++word) {
      // nibble 4h + i: q of weight 4(2 word + h) + i, the word's 8 weights in order
      const __m512i v = transpose_nibbles(_mm512_loadu_si512(w + (b * kWords + word) * kLanes));
      for (int n = 0; n < 8; ++n) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * n), low));
        _mm512_storeu_ps(wT + (b * kBlock + 8 * word + n) * kLanes, _mm512_add_ps(_mm512_mul_ps(dv, q), mv));
      }
    }
  }
}

// out[j, 0..15] = the group's 16 rows . x row j (wT^T x_j), for MT rows of x (row stride K).
template <int MT>
void outer_tile(const float* wT, const float* x, int64_t K, float* out, int64_t ldo) {
  __m512 acc[MT];
  for (int j = 0; j < MT; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wk = _mm512_loadu_ps(wT + k * kLanes);
    for (int j = 0; j < MT; ++j) acc[j] = _mm512_fmadd_ps(wk, _mm512_set1_ps(x[j * K + k]), acc[j]);
  }
  for (int j = 0; j < MT; ++j) _mm512_storeu_ps(out + j * ldo, acc[j]);
}

constexpr int kTile = 8;  // x rows an outer-product tile: 8 accumulators hide the FMA's latency

template <int MT>
void tail_tiles(int rows, const float* wT, const float* x, int64_t K, float* out, int64_t ldo) {
  if constexpr (MT > 0) {
    if (rows == MT) return outer_tile<MT>(wT, x, K, out, ldo);
    tail_tiles<MT - 1>(rows, wT, x, K, out, ldo);
  }
}

void outer_product(const float* wT, const float* x, int64_t M, int64_t K, float* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + kTile <= M; j += kTile) outer_tile<kTile>(wT, x + j * K, K, out + j * ldo, ldo);
  tail_tiles<kTile - 1>(static_cast<int>(M - j), wT, x + j * K, K, out + j * ldo, ldo);
}

}  // namespace

// out [M, N] = x [M, K] @ W^T, W in bit planes (see the top of the file); N a multiple of 16.
void planes_matmul(const float* x, int64_t M, int64_t K, const int32_t* qs, const at::Half* d, const at::Half* m,
                   int64_t N, float* out) {
  const int64_t nb = K / kBlock, R = N / kLanes, group_words = nb * kWords * kLanes, group_scales = nb * kLanes;
  if (M < 4) {  // (the outer products ran 0.6-0.75x as fast at 2 and 3 rows)
    std::vector<float> tables(M * K / 4 * kLanes), xsum(M * nb, 0.0f);
    for (int64_t j = 0; j < M; ++j) subset_sums(x + j * K, K, tables.data() + j * K / 4 * kLanes);
    for (int64_t i = 0; i < M * K; ++i) xsum[i / kBlock] += x[i];
    at::parallel_for(0, R, 6, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int32_t* w = qs + g * group_words;
        const at::Half *dg = d + g * group_scales, *mg = m + g * group_scales;
        float* o = out + g * kLanes;
        if (M == 1) lut_group<1>(w, dg, mg, nb, tables.data(), xsum.data(), o, N);
        else if (M == 2) lut_group<2>(w, dg, mg, nb, tables.data(), xsum.data(), o, N);
        else lut_group<3>(w, dg, mg, nb, tables.data(), xsum.data(), o, N);
      }
    });
    return;
  }
  at::parallel_for(0, R, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> wT(K * kLanes);
    for (int64_t g = begin; g < end; ++g) {
      dequant_group(qs + g * group_words, d + g * group_scales, m + g * group_scales, nb, wT.data());
      outer_product(wT.data(), x, M, K, out + g * kLanes, N);
    }
  });
}

// out [N, K] float32: the weights, exactly as gguf.quants dequantizes the GGUF's blocks.
void planes_dequantize(const int32_t* qs, const at::Half* d, const at::Half* m, int64_t N, int64_t K, float* out) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, N / kLanes, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> wT(K * kLanes);
    for (int64_t g = begin; g < end; ++g) {
      dequant_group(qs + g * nb * kWords * kLanes, d + g * nb * kLanes, m + g * nb * kLanes, nb, wT.data());
      for (int64_t r = 0; r < kLanes; ++r)
        for (int64_t k = 0; k < K; ++k) out[(g * kLanes + r) * K + k] = wT[k * kLanes + r];
    }
  });
}

}  // namespace epdserve_avx512

#pragma GCC pop_options
