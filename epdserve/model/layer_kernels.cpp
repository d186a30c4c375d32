// The small per-layer operations of a decoder step, fused, for CPUs with AVX2 and FMA.
//
// At decode batch 1 a step of SmolLM2-135M is ~50% weight matmuls and ~50% the ~150 small
// PyTorch operators per layer around them (RMSNorm's 7, RoPE's 14, the block gathers, the
// attention mask, SDPA's set-up), each costing a few microseconds of dispatch for a few
// hundred flops. These operators replace them:
//   rms_norm            transformers' LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps)), after
//                       the residual add it takes (vLLM's fused_add_rms_norm)
//   silu_mul            SwiGLU's silu(gate) * up
//   rope_write_kv       rotate-half RoPE on Q and K in place, then K and V into their slots
//   paged_decode_attention
//                       one query token per sequence against its blocks of the paged cache
//                       (a few rows: each row's positions split over the threads, merged)
//   decode_layer        a whole layer of a decode-only step on the ones above
// Arithmetic in float32; storage float32 or bfloat16 (a float32 model's bfloat16 GEMM inputs
// and outputs, a bfloat16 model, a bfloat16 KV cache), rounded as PyTorch rounds. The RoPE
// arithmetic is the same two products and one sum as the PyTorch code (compiled with
// -ffp-contract=off, so no FMA contraction), hence bit-identical; the reductions (RMSNorm's
// mean, attention's dot products and softmax) sum in another order than PyTorch's, and
// SiLU's exp is another polynomial: they differ in the last bits.
// silu_mul runs layer_kernels_avx512.cpp's variant on CPUs with AVX-512.
// Built with quant_kernels.cpp into one library by epdserve/model/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace epdserve_avx512 {  // layer_kernels_avx512.cpp
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out);
void attend_row(const float* q, int64_t qs1, const float* kc, const float* vc, const int64_t* table,
                int64_t block_size, int64_t p0, int64_t n, int64_t Hq, int64_t Hkv, int64_t D, float scale, float* out,
                float* top, float* total, float* scratch);
}

namespace {

// Whether this CPU runs the AVX-512 variants (layer_kernels_avx512.cpp).
bool avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}

float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Float32 or bfloat16 storage, float32 arithmetic: 8 lanes loaded as float32, stored with
// PyTorch's rounding to bfloat16 (to nearest even, NaN to 0x7FC0).
__m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// v's lanes rounded to bfloat16, each in the upper 16 bits of its 32 (lower bits zero).
__m256i bf16_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return r;
}

void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
void store8(c10::BFloat16* p, __m256 v) {
  const __m256i r = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// v rounded to bfloat16 and back when `bf16` (a bfloat16 model's PyTorch operators round
// each intermediate result), else v.
__m256 round_if(__m256 v, bool bf16) {
  return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)) : v;
}

// sum_i a[i] * b[i] for n a multiple of 8 (b float32 or bfloat16).
template <typename B>
float dot(const float* a, const B* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  return hsum8(acc);
}

// e^x for x <= 0 (8 lanes): 2^k * e^r with k = round(x / ln 2), |r| <= ln 2 / 2, e^r by
// its degree-6 Taylor polynomial (relative error < 2e-7, about an ulp of float32, like
// Cephes' expf); underflows to 0 below -87.
__m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145752f), x);  // ln 2 split in two for precision
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// s[0..n) <- e^(s - max s), the max subtracted as every stable softmax does; returns the
// max, and their sum in *sum (the softmax is s / sum).
float exp_scores(float* s, int64_t n, float* sum) {
  float top = s[0];
  for (int64_t p = 1; p < n; ++p) top = std::max(top, s[p]);
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 vsum = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= n; p += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + p), vtop));
    _mm256_storeu_ps(s + p, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  *sum = hsum8(vsum);
  for (; p < n; ++p) *sum += (s[p] = std::exp(s[p] - top));
  return top;
}

// {hsum8(a[0]), ..., hsum8(a[3])}: one reduction tree for four accumulators.
__m128 hsum4x8(const __m256* a) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Decode attention's two products for NQ query heads that share one KV head (grouped-query
// attention): each key and value row is loaded (and converted) once for all of them. What
// bounds them is memory: the rows come from DRAM once a step, so `attend` prefetches them
// (SmolLM2-135M at batch 32, context 420, 2 threads: 0.99 -> 0.72 ms a layer with a float32
// cache, 0.92 -> 0.59 bfloat16; a decode step 67 -> 59 ms, bfloat16 GEMMs and cache), into
// L2 rather than L1: a core tracks few L1 misses at once, and with those alone the strided
// rows came at 9-12 GB/s on a 2-core Zen 4 (30 layers, batch 32, context 320: 47 -> 30 ms
// float32, 32 -> 18 bfloat16; batch 1, context 2,048: 12 -> 7 ms).
//
// s[g * n + j] = dot(q + g * D, key row rows[j]) * scale for g < NQ and j < 4 (D a
// multiple of 8): 4 x NQ independent FMA chains, reduced four at a time.
template <int NQ, typename B>
void scores4(const float* q, const B* base, const int64_t* rows, int64_t D, float scale, float* s, int64_t n) {
  __m256 acc[NQ][4];
  for (int g = 0; g < NQ; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    __m256 k[4];
    for (int j = 0; j < 4; ++j) k[j] = load8(base + rows[j] + i);
    for (int g = 0; g < NQ; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * D + i);
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_fmadd_ps(qv, k[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NQ; ++g) _mm_storeu_ps(s + g * n, _mm_mul_ps(hsum4x8(acc[g]), _mm_set1_ps(scale)));
}

// out[g * D + i .. + 8W) = sum_p w[g * n + p] * value row rows[p] from i, for g < NQ: the
// NQ x W accumulators stay in registers across all positions (compile-time sizes: with a
// run-time slice width the compiler kept them on the stack, every FMA a store and a reload).
template <int NQ, int W, typename B>
void weighted_slice(const float* w, const B* base, const int64_t* rows, int64_t n, int64_t D, int64_t i, float* out) {
  __m256 acc[NQ][W];
  for (int g = 0; g < NQ; ++g)
    for (int j = 0; j < W; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t p = 0; p < n; ++p) {
    __m256 v[W];
    for (int j = 0; j < W; ++j) v[j] = load8(base + rows[p] + i + 8 * j);
    for (int g = 0; g < NQ; ++g) {
      const __m256 wp = _mm256_broadcast_ss(w + g * n + p);
      for (int j = 0; j < W; ++j) acc[g][j] = _mm256_fmadd_ps(wp, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < NQ; ++g)
    for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + g * D + i + 8 * j, acc[g][j]);
}

// out[g * D + 0..D) = sum_p w[g * n + p] * value row rows[p] for g < NQ, D a multiple of 8,
// in slices of 16 floats (then 8).
template <int NQ, typename B>
void weighted_sums(const float* w, const B* base, const int64_t* rows, int64_t n, int64_t D, float* out) {
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) weighted_slice<NQ, 2>(w, base, rows, n, D, i, out);
  for (; i < D; i += 8) weighted_slice<NQ, 1>(w, base, rows, n, D, i, out);
}

// Every 64-byte line of one row of D elements into the cache.
template <typename B>
void prefetch_row(const B* row, int64_t D) {
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(B)); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + off, _MM_HINT_T1);
}

// Attention of NQ query heads (q: NQ x D floats, contiguous) over n positions of one KV
// head (rows: their offsets in the caches), unnormalized: out (NQ x D) = sum_p e^(s_p - top)
// v_p, with top[g] the largest score and total[g] = sum_p e^(s_p - top); scores: NQ x n
// scratch. (The attention is out / total; parts over several ranges of positions merge.)
template <int NQ, typename B>
void attend(const float* q, const B* kc, const B* vc, const int64_t* rows, int64_t n, int64_t D, float scale,
            float* scores, float* out, float* top, float* total) {
  int64_t p = 0;
  for (; p + 4 <= n; p += 4) {
    // Keys 32 positions ahead, and these positions' values, which the weighted sums read next.
    for (int j = 0; j < 4 && p + 32 + j < n; ++j) prefetch_row(kc + rows[p + 32 + j], D);
    for (int j = 0; j < 4; ++j) prefetch_row(vc + rows[p + j], D);
    scores4<NQ>(q, kc, rows + p, D, scale, scores + p, n);
  }
  for (; p < n; ++p)
    for (int g = 0; g < NQ; ++g) scores[g * n + p] = dot(q + g * D, kc + rows[p], D) * scale;
  for (int g = 0; g < NQ; ++g) top[g] = exp_scores(scores + g * n, n, total + g);
  weighted_sums<NQ>(scores, vc, rows, n, D, out);
}

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == dim, name, " must be a float32 tensor of ", dim, " dims");
}

void check_long(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == dim && t.is_contiguous(), name,
              " must be a contiguous int64 tensor of ", dim, " dims");
}

// f(T{}) with T the C++ type of `t`'s dtype: float32 or bfloat16, else an error naming `name`.
template <typename F>
void with_type(const at::Tensor& t, const char* name, F f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16, not ", t.scalar_type());
  f(c10::BFloat16{});
}

// Each row of x: first x += delta when delta is given (in x's dtype, as PyTorch's add_),
// then the norm of the row into op.
template <typename In, typename Delta, typename Out>
void rms_norm_rows(In* xp, const Delta* dp, const In* wp, Out* op, int64_t T, int64_t H, float eps) {
  const bool bf16 = std::is_same<In, c10::BFloat16>::value;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      In* row = xp + t * H;
      if (dp != nullptr)
        for (int64_t i = 0; i < H; i += 8) store8(row + i, _mm256_add_ps(load8(row + i), load8(dp + t * H + i)));
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < H; i += 8) acc = _mm256_fmadd_ps(load8(row + i), load8(row + i), acc);
      const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(hsum8(acc) / static_cast<float>(H) + eps));
      for (int64_t i = 0; i < H; i += 8)  // weight * (x * r), x * r in the model's dtype
        store8(op + t * H + i, _mm256_mul_ps(load8(wp + i), round_if(_mm256_mul_ps(load8(row + i), r), bf16)));
    }
  });
}

// x [T, H] -> w * (x * rsqrt(mean(x^2, -1) + eps)), w [H] in x's dtype, H a multiple of 8;
// the result in out_dtype (default x's): a float32 model's norm can feed bfloat16 GEMMs
// without a cast of its own. A bfloat16 x follows transformers' LlamaRMSNorm: float32
// statistics, x * rsqrt rounded to bfloat16, then the weight's product rounded. With
// delta [T, H] (float32 or bfloat16), x (contiguous) is first updated in place to x + delta:
// a residual add and the next norm in one pass (vLLM's fused_add_rms_norm).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::optional<at::ScalarType> out_dtype,
                    const c10::optional<at::Tensor>& delta) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.scalar_type() == x.scalar_type(),
              "x must be [T, H] and weight [H] of x's dtype");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.size(0) == H && H % 8 == 0, "weight must be [H] with H (", H, ") a multiple of 8");
  TORCH_CHECK(!delta || (delta->sizes() == x.sizes() && x.is_contiguous()),
              "delta must be x's shape, and x contiguous (it is updated in place)");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const at::Tensor dc = delta ? delta->contiguous() : at::Tensor();
  at::Tensor out = at::empty({T, H}, x.options().dtype(out_dtype.value_or(x.scalar_type())));
  with_type(xc, "x", [&](auto in) {
    using In = decltype(in);
    with_type(out, "out_dtype", [&](auto o) {
      using Out = decltype(o);
      if (!delta) return rms_norm_rows(xc.data_ptr<In>(), static_cast<const float*>(nullptr), wc.data_ptr<In>(),
                                       out.data_ptr<Out>(), T, H, static_cast<float>(eps));
      with_type(dc, "delta", [&](auto d) {
        rms_norm_rows(xc.data_ptr<In>(), dc.data_ptr<decltype(d)>(), wc.data_ptr<In>(), out.data_ptr<Out>(), T, H,
                      static_cast<float>(eps));
      });
    });
  });
  return out;
}

// silu(gate) * up for gate_up [T, 2I] (gate the first I columns, up the last), I a multiple
// of 8, into [T, I] of out_dtype (default gate_up's). silu(g) = g * sigmoid(g), sigmoid by
// exp_nonpositive of -|g| (an ulp-level difference from PyTorch's, as RMSNorm's sum has);
// a bfloat16 gate_up rounds silu's result before the product, as PyTorch's bfloat16 ops do.
template <typename In, typename Out>
void silu_mul_rows(const In* gp, Out* op, int64_t T, int64_t I) {
  const bool bf16 = std::is_same<In, c10::BFloat16>::value;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const In* row = gp + t * 2 * I;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 g = load8(row + i);
        const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // e^-|g|
        // g / (1 + e^-g) as PyTorch's silu for g >= 0; g e^g / (1 + e^g) below, e^g <= 1 not overflowing.
        const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
        const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(one, e));
        store8(op + t * I + i, _mm256_mul_ps(round_if(silu, bf16), load8(row + I + i)));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 16 == 0, "gate_up must be [T, 2I] with I a multiple of 8");
  const at::Tensor gc = gate_up.contiguous();
  const int64_t T = gc.size(0), I = gc.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gc.options().dtype(out_dtype.value_or(gc.scalar_type())));
  if (avx512() && I % 16 == 0) {  // the same results, 16 lanes at a time
    with_type(gc, "gate_up", [](auto) {});  // (the dtype checks)
    with_type(out, "out_dtype", [](auto) {});
    epdserve_avx512::silu_mul(gc, out);
    return out;
  }
  with_type(gc, "gate_up", [&](auto in) {
    with_type(out, "out_dtype", [&](auto o) { silu_mul_rows(gc.data_ptr<decltype(in)>(), out.data_ptr<decltype(o)>(), T, I); });
  });
  return out;
}

template <typename S, typename A, typename C>
void rope_rows(S* base, const int64_t* pos, const int64_t* slot, const A* cp, const A* sp, C* kc, C* vc,
               int64_t T, int64_t width, int64_t num_heads, int64_t kv_heads, int64_t D) {
  const bool bf16 = std::is_same<A, c10::BFloat16>::value;
  const int64_t half = D / 2;
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(D);
    for (int64_t t = begin; t < end; ++t) {
      S* row = base + t * width;
      const A *c = cp + pos[t] * D, *s = sp + pos[t] * D;
      for (int64_t h = 0; h < num_heads + 2 * kv_heads; ++h) {
        S* x = row + h * D;
        float* y = rotated.data();
        if (h < num_heads + kv_heads) {
          // x * cos + cat(-x2, x1) * sin, product by product as PyTorch evaluates it.
          for (int64_t i = 0; i < half; i += 8) {
            const __m256 a = load8(x + i), b = load8(x + half + i);
            store8(y + i, round_if(_mm256_sub_ps(round_if(_mm256_mul_ps(a, load8(c + i)), bf16),
                                                 round_if(_mm256_mul_ps(b, load8(s + i)), bf16)), bf16));
            store8(y + half + i, round_if(_mm256_add_ps(round_if(_mm256_mul_ps(b, load8(c + half + i)), bf16),
                                                        round_if(_mm256_mul_ps(a, load8(s + half + i)), bf16)), bf16));
          }
          for (int64_t i = 0; i < D; i += 8) store8(x + i, load8(y + i));
        } else {
          for (int64_t i = 0; i < D; i += 8) store8(y + i, load8(x + i));
        }
        if (h >= num_heads) {  // K and V heads, from their float32 values, into the cache's dtype
          const bool key = h < num_heads + kv_heads;
          C* dst = (key ? kc : vc) + (slot[t] * kv_heads + (key ? h - num_heads : h - num_heads - kv_heads)) * D;
          for (int64_t i = 0; i < D; i += 8) store8(dst + i, load8(y + i));
        }
      }
    }
  });
}

// qkv [T, (Hq + 2 Hkv) D] (rows of Q heads, K heads, V heads): RoPE with the rows
// positions[t] of cos, sin [P, D] on the Q and K heads in place; then each row's K and V
// heads into slot slot_mapping[t] of k_cache, v_cache [slots, Hkv, D]. D a multiple of 16;
// each of qkv, cos / sin (the model's dtype: a bfloat16 one rounds each product and sum)
// and the caches float32 or bfloat16.
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads) {
  check_long(positions, "positions", 1);
  check_long(slot_mapping, "slot_mapping", 1);
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && k_cache.dim() == 3, "qkv, cos must be 2-D and the caches 3-D");
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous()
              && v_cache.is_contiguous(), "qkv, cos, sin and the caches must be contiguous");
  const int64_t T = qkv.size(0), slots = k_cache.size(0), kv_heads = k_cache.size(1), D = k_cache.size(2);
  const int64_t P = cos.size(0), width = qkv.size(1);
  TORCH_CHECK(width == (num_heads + 2 * kv_heads) * D, "qkv has ", width, " columns, not (", num_heads,
              " + 2 x ", kv_heads, ") x ", D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.scalar_type() == sin.scalar_type() && cos.size(1) == D && D % 16 == 0
              && v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "cos, sin must be [P, D] of one dtype, D a multiple of 16, and the caches equal in shape and dtype");
  TORCH_CHECK(positions.size(0) == T && slot_mapping.size(0) == T, "positions and slot_mapping need T entries");
  const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P && slot[t] >= 0 && slot[t] < slots, "row ", t, ": position ", pos[t],
                " or slot ", slot[t], " out of range");
  with_type(qkv, "qkv", [&](auto s) {
    with_type(cos, "cos", [&](auto a) {
      with_type(k_cache, "k_cache", [&](auto c) {
        using S = decltype(s);
        using A = decltype(a);
        using C = decltype(c);
        rope_rows(qkv.data_ptr<S>(), pos, slot, cos.data_ptr<A>(), sin.data_ptr<A>(), k_cache.data_ptr<C>(),
                  v_cache.data_ptr<C>(), T, width, num_heads, kv_heads, D);
      });
    });
  });
}

// Attention of nq <= 3 query heads (qbuf) of one KV head over n positions (rows: offsets of
// the head's rows from kc, vc), as `attend` computes it, into out, top, total.
template <typename C>
void attend_heads(int nq, const float* qbuf, const C* kc, const C* vc, const int64_t* rows, int64_t n, int64_t D,
                  float sc, float* scores, float* out, float* top, float* total) {
  if (nq == 3) attend<3>(qbuf, kc, vc, rows, n, D, sc, scores, out, top, total);
  else if (nq == 2) attend<2>(qbuf, kc, vc, rows, n, D, sc, scores, out, top, total);
  else attend<1>(qbuf, kc, vc, rows, n, D, sc, scores, out, top, total);
}

// Each row of a decode step is a task; where they are too few to give every thread two,
// each one's positions are split into `splits` ranges, attended separately and merged (flash
// decoding: Dao et al., 2023). A task reads its positions' rows of every KV head: with AVX-512,
// a float32 cache and D a multiple of 16 by layer_kernels_avx512.cpp's attend_row, a
// position's row of all heads one contiguous read (SmolLM2-135M, 30 layers, 2 threads of a
// Zen 4, medians of 5 alternated runs against `attend` a task per KV head: batch 32 at
// context 320 30.3 -> 27.2 ms, batch 8 at 1,024 28.4 -> 20.2, batch 1 at 2,048 7.4 -> 5.6;
// with a bfloat16 cache it ran 1.3x slower than `attend`), else by `attend` a KV head at a
// time.
template <typename C>
void decode_attention_rows(const float* qp, const C* kc, const C* vc, float* op, const int64_t* tables,
                           const int64_t* lens, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t max_blocks,
                           int64_t block_size, int64_t qs0, int64_t qs1, float sc) {
  const int64_t group = Hq / Hkv, threads = at::get_num_threads();
  const bool wide = std::is_same<C, float>::value && avx512() && D % 16 == 0;
  int64_t shortest = lens[0];
  for (int64_t b = 1; b < B; ++b) shortest = std::min(shortest, lens[b]);
  const int64_t splits = std::max<int64_t>(1, std::min((2 * threads + B - 1) / B, shortest / 64));
  // Each query head's part per range: its unnormalized output, largest score and sum.
  const int64_t kept = splits > 1 ? B * Hq * splits : 0;
  std::vector<float> parts(kept * D), tops(kept), totals(kept);
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qbuf(3 * D), top(Hq), total(Hq), out(Hq * D), scratch(wide ? 16 * D : 0);
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, part = task % splits;
      const int64_t chunk = (lens[b] + splits - 1) / splits, p0 = part * chunk;
      const int64_t n = std::max<int64_t>(0, std::min(lens[b], p0 + chunk) - p0);
      const int64_t* table = tables + b * max_blocks;
      if (n == 0) {  // (a range past a shorter row's end)
        std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
        std::fill(total.begin(), total.end(), 0.0f);
        std::fill(out.begin(), out.end(), 0.0f);
      } else if (wide) {
        epdserve_avx512::attend_row(qp + b * qs0, qs1, reinterpret_cast<const float*>(kc),
                                    reinterpret_cast<const float*>(vc), table, block_size, p0, n, Hq, Hkv, D, sc,
                                    out.data(), top.data(), total.data(), scratch.data());
      } else {
        scores.resize(3 * n);
        rows.resize(n);  // offset of position p0 + i's row [Hkv, D] in the caches
        for (int64_t i = 0, blk = p0 / block_size, at = p0 % block_size; i < n; ++i) {
          rows[i] = (table[blk] * block_size + at) * Hkv * D;
          if (++at == block_size) at = 0, ++blk;
        }
        for (int64_t hk = 0; hk < Hkv; ++hk) {  // (KV head hk: its rows at kc + hk * D, vc + hk * D)
          for (int64_t g0 = 0; g0 < group; g0 += 3) {  // up to 3 query heads of this KV head at a time
            const int nq = static_cast<int>(std::min<int64_t>(3, group - g0));
            const int64_t h0 = hk * group + g0;
            for (int g = 0; g < nq; ++g)
              std::copy(qp + b * qs0 + (h0 + g) * qs1, qp + b * qs0 + (h0 + g) * qs1 + D, qbuf.begin() + g * D);
            attend_heads(nq, qbuf.data(), kc + hk * D, vc + hk * D, rows.data(), n, D, sc, scores.data(),
                         out.data() + h0 * D, top.data() + h0, total.data() + h0);
          }
        }
      }
      for (int64_t h = 0; h < Hq; ++h) {
        const int64_t at = (b * Hq + h) * splits + part;
        if (splits == 1) {  // the whole attention: normalized into its place
          for (int64_t i = 0; i < D; ++i) op[at * D + i] = out[h * D + i] / total[h];
          continue;
        }
        std::copy(out.begin() + h * D, out.begin() + (h + 1) * D, parts.begin() + at * D);
        tops[at] = top[h];
        totals[at] = total[h];
      }
    }
  });
  for (int64_t bh = 0; bh < (splits > 1 ? B * Hq : 0); ++bh) {  // out = sum_r e^(top_r - top) part_r / sum_r e^(top_r - top) total_r
    float top = -std::numeric_limits<float>::infinity(), total = 0.0f;
    for (int64_t r = 0; r < splits; ++r) top = std::max(top, tops[bh * splits + r]);
    float* o = op + bh * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t r = 0; r < splits; ++r) {
      const float w = std::exp(tops[bh * splits + r] - top);
      total += w * totals[bh * splits + r];
      const float* part = parts.data() + (bh * splits + r) * D;
      for (int64_t i = 0; i < D; ++i) o[i] += w * part[i];
    }
    for (int64_t i = 0; i < D; ++i) o[i] /= total;
  }
}

// q [B, Hq, D] (last dim contiguous), k_cache, v_cache [slots, Hkv, D], block_tables
// [B, max_blocks] and ctx_lens [B] (int64): softmax(q k^T * scale) v over the first
// ctx_lens[b] positions of sequence b, position p at slot block_tables[b, p / block_size]
// * block_size + p % block_size; query head h reads KV head h / (Hq / Hkv). -> [B, Hq, D].
// The caches float32 or bfloat16 (--kv-cache-dtype), read as float32; q and the result float32.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t block_size,
                                  double scale) {
  check_float(q, "q", 3);
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache, v_cache must be [slots, Hkv, D] of one dtype");
  check_long(block_tables, "block_tables", 2);
  check_long(ctx_lens, "ctx_lens", 1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "the caches must be contiguous and equal in shape");
  TORCH_CHECK(q.stride(2) == 1, "q's last dim must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t slots = k_cache.size(0), Hkv = k_cache.size(1), max_blocks = block_tables.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D % 8 == 0 && Hkv > 0 && Hq % Hkv == 0,
              "head dims differ, D is not a multiple of 8, or Hq is not a multiple of Hkv");
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.size(0) == B && block_size > 0, "one table and length per row");
  const int64_t *tables = block_tables.data_ptr<int64_t>(), *lens = ctx_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= max_blocks * block_size, "row ", b, ": context ", lens[b],
                " outside its block table");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tables[b * max_blocks + j] >= 0 && (tables[b * max_blocks + j] + 1) * block_size <= slots,
                  "row ", b, ": block ", tables[b * max_blocks + j], " outside the cache");
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options());
  with_type(k_cache, "k_cache", [&](auto c) {
    decode_attention_rows(q.data_ptr<float>(), k_cache.data_ptr<decltype(c)>(), v_cache.data_ptr<decltype(c)>(),
                          out.data_ptr<float>(), tables, lens, B, Hq, Hkv, D, max_blocks, block_size, q.stride(0),
                          q.stride(1), static_cast<float>(scale));
  });
  return out;
}

// x [M, K] @ W^T for a projection given as its tensors: [W [N, K]] (float32, or bfloat16:
// x cast to it and the result back; a bfloat16 W in oneDNN's packed layout by oneDNN, as
// linear.py packs it) or the GGUF blocks [qs, scales] (Q8_0) / [qs, scales, mins] (Q4_1) of
// quant_kernels.cpp's quant_mm.
at::Tensor project(const at::Tensor& x, at::TensorList w) {
  if (w.size() == 1 && w[0].is_mkldnn()) {
    static const auto packed_mm = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                          c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
    return packed_mm.call(x.to(w[0].scalar_type()), w[0], c10::nullopt, "none", c10::List<c10::optional<at::Scalar>>(),
                          c10::nullopt).to(x.scalar_type());
  }
  if (w.size() == 1 && w[0].scalar_type() == x.scalar_type()) return at::linear(x, w[0]);
  if (w.size() == 1) return at::linear(x.to(w[0].scalar_type()), w[0]).to(x.scalar_type());
  static const auto quant_mm = c10::Dispatcher::singleton().findSchemaOrThrow("epdserve::quant_mm", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&)>();
  return quant_mm.call(x, w[0], w[1], w.size() == 3 ? c10::optional<at::Tensor>(w[2]) : c10::nullopt);
}

// One decoder layer for a step whose B rows are all decode tokens, x [B, H] updated in
// place: x += o(attention(rope(qkv(rms(x))))); x += down(silu(gate) * up)(rms(x)), the
// order of LlamaModel.forward's per-layer code, with one call from Python instead of ~35
// (at batch 1, ~2 ms of a ~13 ms step). layer_cache [2, blocks, block_size, Hkv, D].
void decode_layer(at::Tensor x, const at::Tensor& input_norm, const at::Tensor& post_norm, at::TensorList qkv_w,
                  const c10::optional<at::Tensor>& qkv_bias, at::TensorList o_w, at::TensorList gate_up_w,
                  at::TensorList down_w, const at::Tensor& layer_cache, const at::Tensor& positions,
                  const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t num_heads, double eps) {
  check_float(x, "x", 2);
  TORCH_CHECK(layer_cache.dim() == 5 && x.is_contiguous(), "layer_cache must be 5-D and x contiguous");
  const int64_t B = x.size(0), block_size = layer_cache.size(2), kv_heads = layer_cache.size(3), D = layer_cache.size(4);
  at::Tensor qkv = project(rms_norm(x, input_norm, eps, c10::nullopt, c10::nullopt), qkv_w);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  const at::Tensor k_cache = layer_cache[0].view({-1, kv_heads, D}), v_cache = layer_cache[1].view({-1, kv_heads, D});
  rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads);
  const at::Tensor q = qkv.narrow(1, 0, num_heads * D).view({B, num_heads, D});
  const at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size,
                                                 1.0 / std::sqrt(static_cast<double>(D)));
  const at::Tensor h = rms_norm(x, post_norm, eps, c10::nullopt, project(attn.view({B, num_heads * D}), o_w));
  x.add_(project(silu_mul(project(h, gate_up_w), c10::nullopt), down_w));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(epdserve, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor weight, float eps, ScalarType? out_dtype=None, Tensor? delta=None) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("silu_mul(Tensor gate_up, ScalarType? out_dtype=None) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
        "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads) -> ()");
  m.impl("rope_write_kv", c10::DispatchKey::CPU, TORCH_FN(rope_write_kv));
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor ctx_lens, int block_size, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("decode_layer(Tensor(a!) x, Tensor input_norm, Tensor post_norm, Tensor[] qkv, Tensor? qkv_bias, "
        "Tensor[] o, Tensor[] gate_up, Tensor[] down, Tensor(b!) layer_cache, Tensor positions, Tensor cos, "
        "Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor ctx_lens, int num_heads, float eps) -> ()");
  m.impl("decode_layer", c10::DispatchKey::CPU, TORCH_FN(decode_layer));
  // (weights in oneDNN's packed layout make the dispatcher pick the MkldnnCPU key)
  m.impl("decode_layer", c10::DispatchKey::MkldnnCPU, TORCH_FN(decode_layer));
}
