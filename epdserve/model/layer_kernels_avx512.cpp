// AVX-512 variants of layer_kernels.cpp's elementwise kernels, which call them on CPUs with
// AVX-512 F/BW/DQ/VL: the same arithmetic lane for lane (bit-identical results), 16 lanes an
// instruction instead of 8. On a CPU whose AVX-512 runs as two 256-bit halves (AMD Zen 4)
// that is the same work in half the instructions, so never slower than the AVX2 code.
//
//   silu_mul            SwiGLU's silu(gate) * up (layer_kernels.cpp's silu_mul)
//   attend_row          decode attention of one row over a range of its positions, every
//                       KV head at once, a float32 cache (layer_kernels.cpp's
//                       paged_decode_attention): not the same arithmetic as its 8-lane
//                       attend (one pass, an online softmax), see there

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")

#include "avx512.h"

namespace epdserve_avx512 {
namespace {

template <typename In, typename Out>
void silu_mul_rows(const In* gp, Out* op, int64_t T, int64_t I) {
  const bool bf16 = std::is_same<In, c10::BFloat16>::value;
  const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const In* row = gp + t * 2 * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 g = load16(row + i);
        const __m512 e = exp16(_mm512_or_ps(g, sign));  // e^-|g|
        // g / (1 + e^-g) for g >= 0; g e^g / (1 + e^g) below, as layer_kernels.cpp's silu_mul.
        const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
        const __m512 silu = _mm512_div_ps(num, _mm512_add_ps(one, e));
        store16(op + t * I + i, _mm512_mul_ps(bf16 ? round_bf16(silu) : silu, load16(row + I + i)));
      }
    }
  });
}

constexpr int kChunk = 16;  // positions a step of attend_row: one score per lane
constexpr int kAhead = 2;  // steps attend_row prefetches (1: 10-20 % slower, 3: no faster)

// v[j]'s 16 lanes summed into lane j: a transpose and add in four rounds (45 instructions for
// 16 dot products, against 4 each by horizontal sums).
inline __attribute__((always_inline)) __m512 sum_lanes(const __m512* v) {
  __m512 u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)  // lanes 4l .. 4l + 3: v[2i] and v[2i+1]'s partial sums, interleaved
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // lane 4l + k: v[4i + k]'s sum over 128-bit lane l
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

// The 64-byte lines of [p, p + bytes) into L2.
void prefetch_range(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T1);
}

// Lane j: (q . keys[j * stride ..]) * scale for the lanes of `valid`, -inf in the others (16 key
// rows of D floats; those of the other lanes are read, not used).
__m512 chunk_scores(const float* q, const float* keys, int64_t stride, __mmask16 valid, int64_t D, float scale) {
  __m512 acc[kChunk];
  for (int j = 0; j < kChunk; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int j = 0; j < kChunk; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + j * stride + i), acc[j]);
  }
  return _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, sum_lanes(acc),
                            _mm512_set1_ps(scale));
}

// out[g][0..D) = out[g] * alpha[g] + sum_{j < m} p[g][j] values[j * stride ..] for the NQ query
// heads of one KV head, W 16-float slices at a time: each value row loaded once for all of
// them, NQ x W independent FMA chains (3 alone waited on the FMA's latency).
template <int NQ, int W>
void weigh_values(const float* values, int64_t stride, int m, const float* p, const float* alpha, int64_t D,
                  float* out) {
  for (int64_t i = 0; i < D; i += 16 * W) {
    __m512 acc[NQ][W];
    for (int g = 0; g < NQ; ++g)
      for (int w = 0; w < W; ++w) {
        const __m512 before = _mm512_loadu_ps(out + g * D + i + 16 * w);
        acc[g][w] = _mm512_mul_ps(before, _mm512_set1_ps(alpha[g]));
      }
    for (int j = 0; j < m; ++j) {
      __m512 v[W];
      for (int w = 0; w < W; ++w) v[w] = _mm512_loadu_ps(values + j * stride + i + 16 * w);
      for (int g = 0; g < NQ; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * kChunk + j]);
        for (int w = 0; w < W; ++w) acc[g][w] = _mm512_fmadd_ps(pj, v[w], acc[g][w]);
      }
    }
    for (int g = 0; g < NQ; ++g)
      for (int w = 0; w < W; ++w) _mm512_storeu_ps(out + g * D + i + 16 * w, acc[g][w]);
  }
}

template <int W>
void weigh_slices(int nq, const float* values, int64_t stride, int m, const float* p, const float* alpha, int64_t D,
                  float* out) {
  if (nq == 4) return weigh_values<4, W>(values, stride, m, p, alpha, D, out);
  if (nq == 3) return weigh_values<3, W>(values, stride, m, p, alpha, D, out);
  if (nq == 2) return weigh_values<2, W>(values, stride, m, p, alpha, D, out);
  weigh_values<1, W>(values, stride, m, p, alpha, D, out);
}

void weigh(int nq, const float* values, int64_t stride, int m, const float* p, const float* alpha, int64_t D,
           float* out) {
  if (D % 64 == 0) return weigh_slices<4>(nq, values, stride, m, p, alpha, D, out);
  weigh_slices<1>(nq, values, stride, m, p, alpha, D, out);
}

// Positions [p, p + m) of a row, m <= 16, within one block: the slot of the first.
struct Chunk {
  int64_t slot;
  int m;
};

Chunk chunk_at(const int64_t* table, int64_t block_size, int64_t p, int64_t end) {
  const int64_t at = p % block_size;
  const int64_t m = std::min({int64_t{kChunk}, block_size - at, end - p});
  return {table[p / block_size] * block_size + at, static_cast<int>(m)};
}

}  // namespace

// One row's decode attention over its positions [p0, p0 + n), every KV head: position p at
// slot table[p / block_size] * block_size + p % block_size of kc, vc [slots, Hkv, D] (float32);
// query head h at q + h * qs1 reads KV head h / (Hq / Hkv). Unnormalized, as
// layer_kernels.cpp's attend: out [Hq, D] = sum_p e^(s_p - top) v_p, top[h] the largest score,
// total[h] = sum_p e^(s_p - top). One pass, up to 16 positions of a block a step with the
// softmax kept online (Milakov and Gimelshein, 2018); a step's keys (and values) of every KV
// head are one contiguous range, the next two steps' prefetched into L2 a KV head's share at
// a time. D a multiple of 16; scratch: 16 x D floats (a step of fewer than 16 positions' keys).
void attend_row(const float* q, int64_t qs1, const float* kc, const float* vc, const int64_t* table,
                int64_t block_size, int64_t p0, int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* out,
                float* top, float* total, float* scratch) {
  const int64_t group = Hq / Hkv, width = Hkv * D, end = p0 + n;
  std::fill(out, out + Hq * D, 0.0f);
  std::fill(top, top + Hq, -std::numeric_limits<float>::infinity());
  std::fill(total, total + Hq, 0.0f);
  float p[4 * kChunk], alpha[4];
  for (int64_t pos = p0; pos < end;) {
    const Chunk c = chunk_at(table, block_size, pos, end);
    const __mmask16 valid = static_cast<__mmask16>((1u << c.m) - 1);
    Chunk next[kAhead];
    int count = 0;
    for (int64_t ahead = pos + c.m; ahead < end && count < kAhead; ahead += next[count++].m)
      next[count] = chunk_at(table, block_size, ahead, end);
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      for (int k = 0; k < count; ++k) {
        const int64_t bytes = next[k].m * width * static_cast<int64_t>(sizeof(float));
        const int64_t lo = bytes * hk / Hkv / 64 * 64, hi = bytes * (hk + 1) / Hkv;
        prefetch_range(reinterpret_cast<const char*>(kc + next[k].slot * width) + lo, hi - lo);
        prefetch_range(reinterpret_cast<const char*>(vc + next[k].slot * width) + lo, hi - lo);
      }
      const float* keys = kc + c.slot * width + hk * D;
      int64_t stride = width;
      if (c.m < kChunk) {  // (chunk_scores reads 16 rows: not past this block)
        for (int j = 0; j < c.m; ++j) std::copy(keys + j * width, keys + j * width + D, scratch + j * D);
        keys = scratch, stride = D;
      }
      for (int64_t g0 = 0; g0 < group; g0 += 4) {  // up to 4 query heads of this KV head at a time
        const int nq = static_cast<int>(std::min<int64_t>(4, group - g0));
        const int64_t h0 = hk * group + g0;
        for (int g = 0; g < nq; ++g) {
          const __m512 s = chunk_scores(q + (h0 + g) * qs1, keys, stride, valid, D, scale);
          const float before = top[h0 + g], now = std::max(before, _mm512_reduce_max_ps(s));
          const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(now))));
          // (~0 at the first step, where before is -inf and the sums are 0)
          alpha[g] = now == before ? 1.0f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(before - now)));
          top[h0 + g] = now;
          total[h0 + g] = total[h0 + g] * alpha[g] + _mm512_reduce_add_ps(e);
          _mm512_storeu_ps(p + g * kChunk, e);
        }
        weigh(nq, vc + c.slot * width + hk * D, width, c.m, p, alpha, D, out + h0 * D);
      }
    }
    pos += c.m;
  }
}

// silu(gate) * up of gate_up [T, 2I] (contiguous, I a multiple of 16) into out [T, I];
// each float32 or bfloat16.
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  const auto run = [&](auto in, auto o) {
    silu_mul_rows(gate_up.data_ptr<decltype(in)>(), out.data_ptr<decltype(o)>(), T, I);
  };
  const bool in_bf16 = gate_up.scalar_type() == at::kBFloat16, out_bf16 = out.scalar_type() == at::kBFloat16;
  if (in_bf16) out_bf16 ? run(c10::BFloat16{}, c10::BFloat16{}) : run(c10::BFloat16{}, float{});
  else out_bf16 ? run(float{}, c10::BFloat16{}) : run(float{}, float{});
}

}  // namespace epdserve_avx512

#pragma GCC pop_options
