// y = x @ W^T straight from GGUF weight blocks (Q4_1, Q8_0), for CPUs with AVX2 and FMA.
//
// W [N, K] is stored as blocks of 32 weights along K (ggml's block size):
//   Q4_1: qs uint8 [N, K/32, 16], scales and mins float32 [N, K/32]; w = d * q + m with
//         q in 0..15, byte j holding q[j] in its low nibble and q[j + 16] in its high one
//         (ggml's block_q4_1 order);
//   Q8_0: qs int8 [N, K/32, 32], scales float32 [N, K/32]; w = d * q.
// Each thread takes a range of output rows. For every 3 rows it dequantizes them once into
// a float buffer (L1-sized: 3 * K floats) and then takes their dot products with every row
// of x, 4 x rows at a time, so the dequantization is paid once per weight whatever the
// batch M, and each weight load feeds 4 FMAs. Batches of 1-3 rows take a bufferless path
// (fused_row). Both prefetch the weight stream ahead of them (prefetch_ahead): a decode
// GEMV reads every weight once, from memory, and a core's own misses in flight bounded it.
// The library is built for AVX2 + FMA; on a CPU with AVX-512, fused_row runs 16 lanes wide
// instead of 8 (compiled for "avx512f", chosen at run time): half the instructions per
// weight, the same products summed in another order. (16-lane tiles measured slower than
// the 8-lane ones at 4-256 rows on a 2-core Xeon, so the tiles stay AVX2.)
// Q4_1 in bit planes (int32 qs: quant_planes.cpp, AVX-512) is dispatched from quant_mm and
// dequantize by its dtype.
// Built with layer_kernels.cpp into one library by epdserve/model/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <tuple>
#include <vector>

namespace epdserve_avx512 {  // quant_planes.cpp: Q4_1 in bit planes
void planes_matmul(const float* x, int64_t M, int64_t K, const int32_t* qs, const at::Half* d, const at::Half* m,
                   int64_t N, float* out);
void planes_dequantize(const int32_t* qs, const at::Half* d, const at::Half* m, int64_t N, int64_t K, float* out);
}  // namespace epdserve_avx512

namespace {

constexpr int64_t kBlock = 32;

// The 32 quants of block b of a weight row as 4 x 8 floats, in weight order.
template <bool Q4>
void block_quants(const uint8_t* row, int64_t b, __m256 q[4]) {
  if constexpr (Q4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, low);                     // q[0..15]
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);  // q[16..31]
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
  } else {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + kBlock * b + 8 * i));
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
  }
}

// The weight stream ahead of block b of a row: its quants 2 KB on and, every 16 blocks, its
// scales and mins. With the hardware's prefetch alone a core read ~5 GB/s of blocks (its
// L1 misses in flight bound it); with these, SmolLM2-135M's decode GEMVs on 2 threads went
// from 8.7 to 5.4 ms a token (AMX Xeon).
template <bool Q4>
inline void prefetch_ahead(const uint8_t* row, const float* d, const float* m, int64_t b) {
  _mm_prefetch(reinterpret_cast<const char*>(row) + (Q4 ? 16 : kBlock) * b + 2048, _MM_HINT_T0);
  if (b % 16 == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(d + b) + 2048, _MM_HINT_T0);
    if (Q4) _mm_prefetch(reinterpret_cast<const char*>(m + b) + 2048, _MM_HINT_T0);
  }
}

// Dequantize one row (nb blocks) into w[nb * 32]. mul then add, not fma: the same two
// roundings as gguf.quants' numpy dequantization, so w equals the float32 weights exactly.
template <bool Q4>
void dequant_row(const uint8_t* row, const float* d, const float* m, int64_t nb, float* w) {
  for (int64_t b = 0; b < nb; ++b) {
    if (b % 2 == 0) prefetch_ahead<Q4>(row, d, m, b);
    __m256 q[4];
    block_quants<Q4>(row, b, q);
    const __m256 vd = _mm256_set1_ps(d[b]);
    for (int i = 0; i < 4; ++i) {
      __m256 v = _mm256_mul_ps(vd, q[i]);
      if constexpr (Q4) v = _mm256_add_ps(v, _mm256_set1_ps(m[b]));
      _mm256_storeu_ps(w + kBlock * b + 8 * i, v);
    }
  }
}

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[j, i] = dot(w[i], x[j]) for NT weight rows w (stride K) and MT rows of x (stride K);
// out has row stride ldo. 3 x 4 keeps 12 accumulators, 3 weights and 1 x in the 16 ymm
// registers; it measured ~20% faster than 2 x 4, 4 x 3 or 3 x 3 at M = 32 and 64.
template <int NT, int MT>
void tile(const float* w, const float* x, int64_t K, float* out, int64_t ldo) {
  __m256 acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NT];
    for (int i = 0; i < NT; ++i) wv[i] = _mm256_loadu_ps(w + i * K + k);
    for (int j = 0; j < MT; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * K + k);
      for (int i = 0; i < NT; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) out[j * ldo + i] = hsum(acc[i][j]);
}

// acc[j] += d[b] * (the quants of block b . x row j's block b), for MT rows of x.
template <bool Q4, int MT>
inline void block_dot(const uint8_t* row, const float* d, const float* x, int64_t K, int64_t b, __m256* acc) {
  __m256 q[4];
  block_quants<Q4>(row, b, q);
  const __m256 vd = _mm256_broadcast_ss(d + b);
  for (int j = 0; j < MT; ++j) {
    const float* xb = x + j * K + kBlock * b;
    __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
    for (int i = 1; i < 4; ++i) t = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xb + 8 * i), t);
    acc[j] = _mm256_fmadd_ps(vd, t, acc[j]);
  }
}

// Under 4 rows of x there is too little work per weight to amortise a dequantization
// buffer; instead, per block, sum_i w_i x_i = d (q . x) + m sum(x): the quants need no
// scaling, one FMA per block applies d, and m . xsum (xsum [MT, nb]: each x row's block
// sums, shared by every weight row) is added at the end, 8 blocks an FMA (summed one block
// at a time, that chain of dependent scalar FMAs took as long as the quants' products).
// Two accumulators per x row (even and odd blocks) keep the FMA's latency off the loop.
template <bool Q4, int MT>
void fused_row(const uint8_t* row, const float* d, const float* m, int64_t nb, const float* x, int64_t K,
               const float* xsum, float* out, int64_t ldo) {
  __m256 acc[2][MT];
  for (int j = 0; j < MT; ++j) acc[0][j] = acc[1][j] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    prefetch_ahead<Q4>(row, d, m, b);
    block_dot<Q4, MT>(row, d, x, K, b, acc[0]);
    block_dot<Q4, MT>(row, d, x, K, b + 1, acc[1]);
  }
  if (b < nb) block_dot<Q4, MT>(row, d, x, K, b, acc[0]);
  for (int j = 0; j < MT; ++j) {
    __m256 sum = _mm256_add_ps(acc[0][j], acc[1][j]);
    if constexpr (Q4)
      for (int64_t c = 0; c < nb; c += 8) {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nb - c)), lanes);
        sum = _mm256_fmadd_ps(_mm256_maskload_ps(m + c, k), _mm256_maskload_ps(xsum + j * nb + c, k), sum);
      }
    out[j * ldo] = hsum(sum);
  }
}

// The quants of block b of a weight row as 2 x 16 floats, in weight order.
template <bool Q4>
__attribute__((target("avx512f"))) void block_quants512(const uint8_t* row, int64_t b, __m512& q0, __m512& q1) {
  if constexpr (Q4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m128i low = _mm_set1_epi8(0x0F);
    q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));                     // q[0..15]
    q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));  // q[16..31]
  } else {
    const __m128i* qb = reinterpret_cast<const __m128i*>(row + kBlock * b);
    q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb)));
    q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb + 1)));
  }
}

// acc[j] += d[b] * (the quants of block b . x row j's block b), for MT rows of x.
template <bool Q4, int MT>
__attribute__((target("avx512f"), always_inline)) inline void block_dot512(const uint8_t* row, const float* d,
                                                                           const float* x, int64_t K, int64_t b,
                                                                           __m512* acc) {
  __m512 q0, q1;
  block_quants512<Q4>(row, b, q0, q1);
  const __m512 vd = _mm512_set1_ps(d[b]);
  for (int j = 0; j < MT; ++j) {
    const float* xb = x + j * K + kBlock * b;
    const __m512 t = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)));
    acc[j] = _mm512_fmadd_ps(vd, t, acc[j]);
  }
}

// fused_row, 16 lanes (m . xsum 16 blocks an FMA).
template <bool Q4, int MT>
__attribute__((target("avx512f"))) void fused_row512(const uint8_t* row, const float* d, const float* m,
                                                     int64_t nb, const float* x, int64_t K, const float* xsum,
                                                     float* out, int64_t ldo) {
  __m512 acc[2][MT];
  for (int j = 0; j < MT; ++j) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    prefetch_ahead<Q4>(row, d, m, b);
    block_dot512<Q4, MT>(row, d, x, K, b, acc[0]);
    block_dot512<Q4, MT>(row, d, x, K, b + 1, acc[1]);
  }
  if (b < nb) block_dot512<Q4, MT>(row, d, x, K, b, acc[0]);
  for (int j = 0; j < MT; ++j) {
    __m512 sum = _mm512_add_ps(acc[0][j], acc[1][j]);
    if constexpr (Q4)
      for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 k = static_cast<__mmask16>(nb - b >= 16 ? 0xFFFF : (1u << (nb - b)) - 1u);
        sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + b), _mm512_maskz_loadu_ps(k, xsum + j * nb + b), sum);
      }
    out[j * ldo] = _mm512_reduce_add_ps(sum);
  }
}

const bool kAvx512 = __builtin_cpu_supports("avx512f");

// One weight row against M < 4 rows of x, by the widest code this CPU runs.
template <bool Q4, int MT>
void dot_row(const uint8_t* row, const float* d, const float* m, int64_t nb, const float* x, int64_t K,
             const float* xsum, float* out, int64_t ldo) {
  if (kAvx512) fused_row512<Q4, MT>(row, d, m, nb, x, K, xsum, out, ldo);
  else fused_row<Q4, MT>(row, d, m, nb, x, K, xsum, out, ldo);
}


template <int NT>
void rows_times_x(const float* w, const float* x, int64_t M, int64_t K, float* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + 4 <= M; j += 4) tile<NT, 4>(w, x + j * K, K, out + j * ldo, ldo);
  switch (M - j) {
    case 3: tile<NT, 3>(w, x + j * K, K, out + j * ldo, ldo); break;
    case 2: tile<NT, 2>(w, x + j * K, K, out + j * ldo, ldo); break;
    case 1: tile<NT, 1>(w, x + j * K, K, out + j * ldo, ldo); break;
  }
}

// out [M, N] = x [M, K] @ W^T for W given by its blocks (see the top of the file).
template <bool Q4>
void matmul(const float* x, int64_t M, int64_t K, const uint8_t* qs, const float* d, const float* m,
            int64_t N, float* out) {
  const int64_t nb = K / kBlock, row_bytes = nb * (Q4 ? 16 : kBlock);
  // Grains: enough rows per task that a task's work dwarfs OpenMP's fork cost.
  if (M < 4) {
    std::vector<float> xsum(Q4 ? M * nb : 0, 0.0f);  // Q8_0 has no mins to multiply
    if constexpr (Q4)
      for (int64_t i = 0; i < M * K; ++i) xsum[i / kBlock] += x[i];
    at::parallel_for(0, N, 96, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* row = qs + n * row_bytes;
        const float* mn = Q4 ? m + n * nb : nullptr;
        if (M == 1) dot_row<Q4, 1>(row, d + n * nb, mn, nb, x, K, xsum.data(), out + n, N);
        else if (M == 2) dot_row<Q4, 2>(row, d + n * nb, mn, nb, x, K, xsum.data(), out + n, N);
        else dot_row<Q4, 3>(row, d + n * nb, mn, nb, x, K, xsum.data(), out + n, N);
      }
    });
    return;
  }
  constexpr int64_t kRows = 3;
  at::parallel_for(0, (N + kRows - 1) / kRows, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kRows * K);
    for (int64_t group = begin; group < end; ++group) {
      const int64_t n = kRows * group, nt = std::min(kRows, N - n);
      for (int64_t i = 0; i < nt; ++i)
        dequant_row<Q4>(qs + (n + i) * row_bytes, d + (n + i) * nb, Q4 ? m + (n + i) * nb : nullptr, nb,
                        w.data() + i * K);
      if (nt == kRows) rows_times_x<kRows>(w.data(), x, M, K, out + n, N);
      else for (int64_t i = 0; i < nt; ++i) rows_times_x<1>(w.data() + i * K, x, M, K, out + n + i, N);
    }
  });
}

enum class Layout { kQ8_0, kQ4_1, kPlanes };

// Checks the blocks' dtypes and shapes (see the top of the file and quant_planes.cpp);
// returns (N, K/32, layout).
std::tuple<int64_t, int64_t, Layout> check_blocks(const at::Tensor& qs, const at::Tensor& scales,
                                                  const c10::optional<at::Tensor>& mins) {
  if (qs.scalar_type() == at::kInt) {
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"),
                "Q4_1 in bit planes needs AVX-512 F/BW/DQ/VL");
    TORCH_CHECK(qs.dim() == 4 && qs.size(2) == 4 && qs.size(3) == 16, "planes qs must be int32 [N/16, K/32, 4, 16]");
    const int64_t groups = qs.size(0), nb = qs.size(1);
    TORCH_CHECK(mins.has_value() && scales.sizes() == at::IntArrayRef({groups, nb, 16}) &&
                mins->sizes() == scales.sizes() && scales.scalar_type() == at::kHalf &&
                mins->scalar_type() == at::kHalf, "planes scales and mins must be float16 [N/16, K/32, 16]");
    return {groups * 16, nb, Layout::kPlanes};
  }
  const bool q4 = qs.scalar_type() == at::kByte;
  TORCH_CHECK(q4 || qs.scalar_type() == at::kChar, "qs must be uint8 (Q4_1), int8 (Q8_0) or int32 (Q4_1 planes)");
  TORCH_CHECK(q4 == mins.has_value(), "Q4_1 needs mins, Q8_0 takes none");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == (q4 ? 16 : 32), "qs has the wrong shape");
  const int64_t N = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(scales.sizes() == at::IntArrayRef({N, nb}) && scales.scalar_type() == at::kFloat,
              "scales must be float32 [N, K/32]");
  if (q4) TORCH_CHECK(mins->sizes() == scales.sizes() && mins->scalar_type() == at::kFloat,
                      "mins must be float32 [N, K/32]");
  return {N, nb, q4 ? Layout::kQ4_1 : Layout::kQ8_0};
}

// The float32 weight [N, K] of the blocks, exactly as gguf.quants dequantizes them.
at::Tensor dequantize(const at::Tensor& qs, const at::Tensor& scales, const c10::optional<at::Tensor>& mins) {
  int64_t N, nb;
  Layout layout;
  std::tie(N, nb, layout) = check_blocks(qs, scales, mins);  // plain variables: lambdas capture them
  const bool q4 = layout == Layout::kQ4_1;
  const at::Tensor qc = qs.contiguous(), dc = scales.contiguous();
  const at::Tensor mc = mins.has_value() ? mins->contiguous() : at::Tensor();
  at::Tensor out = at::empty({N, nb * kBlock}, scales.options().dtype(at::kFloat));
  if (layout == Layout::kPlanes) {
    epdserve_avx512::planes_dequantize(qc.data_ptr<int32_t>(), dc.data_ptr<at::Half>(), mc.data_ptr<at::Half>(), N,
                                       nb * kBlock, out.data_ptr<float>());
    return out;
  }
  const uint8_t* qp = static_cast<const uint8_t*>(qc.data_ptr());
  const float* dp = dc.data_ptr<float>();
  const float* mp = q4 ? mc.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = qs.size(1) * qs.size(2);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (q4) dequant_row<true>(qp + n * row_bytes, dp + n * nb, mp + n * nb, nb, op + n * nb * kBlock);
      else dequant_row<false>(qp + n * row_bytes, dp + n * nb, nullptr, nb, op + n * nb * kBlock);
    }
  });
  return out;
}

// x [M, K] float32, qs [N, K/32, 16] uint8 (Q4_1) or [N, K/32, 32] int8 (Q8_0),
// scales [N, K/32] float32, mins [N, K/32] float32 (Q4_1) or None (Q8_0) -> [M, N].
at::Tensor quant_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& mins) {
  int64_t N, nb;
  Layout layout;
  std::tie(N, nb, layout) = check_blocks(qs, scales, mins);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == nb * kBlock, "x has ", K, " columns but the weight has ", nb * kBlock);
  const at::Tensor xc = x.contiguous(), qc = qs.contiguous(), dc = scales.contiguous();
  const at::Tensor mc = mins.has_value() ? mins->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  if (layout == Layout::kPlanes) {
    epdserve_avx512::planes_matmul(xp, M, K, qc.data_ptr<int32_t>(), dc.data_ptr<at::Half>(), mc.data_ptr<at::Half>(),
                                   N, out.data_ptr<float>());
    return out;
  }
  const uint8_t* qp = static_cast<const uint8_t*>(qc.data_ptr());
  if (layout == Layout::kQ4_1) matmul<true>(xp, M, K, qp, dc.data_ptr<float>(), mc.data_ptr<float>(), N, out.data_ptr<float>());
  else matmul<false>(xp, M, K, qp, dc.data_ptr<float>(), nullptr, N, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY(epdserve, m) {
  m.def("quant_mm(Tensor x, Tensor qs, Tensor scales, Tensor? mins) -> Tensor");
  m.impl("quant_mm", c10::DispatchKey::CPU, TORCH_FN(quant_mm));
  m.def("dequantize(Tensor qs, Tensor scales, Tensor? mins) -> Tensor");
  m.impl("dequantize", c10::DispatchKey::CPU, TORCH_FN(dequantize));
}
