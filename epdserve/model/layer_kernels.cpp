// The small per-layer operations of a decoder step, fused, for CPUs with AVX2 and FMA.
//
// At decode batch 1 a step of SmolLM2-135M is ~50% weight matmuls and ~50% the ~150 small
// PyTorch operators per layer around them (RMSNorm's 7, RoPE's 14, the block gathers, the
// attention mask, SDPA's set-up), each costing a few microseconds of dispatch for a few
// hundred flops. These three operators replace them:
//   rms_norm            transformers' LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps))
//   rope_write_kv       rotate-half RoPE on Q and K in place, then K and V into their slots
//   paged_decode_attention
//                       one query token per sequence against its blocks of the paged cache
//   decode_layer        a whole layer of a decode-only step on the three above
// Float32 only. The RoPE arithmetic is the same two products and one sum as the PyTorch
// code (compiled with -ffp-contract=off, so no FMA contraction), hence bit-identical;
// the reductions (RMSNorm's mean, attention's dot products and softmax) sum in another
// order than PyTorch's and differ in the last bits.
// Built with quant_kernels.cpp into one library by epdserve/model/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum_i a[i] * b[i] for n a multiple of 8.
float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum8(acc);
}

// out[j] = dot(q, base + rows[j]) * scale for j < 4: four independent FMA chains, where one
// dot product at a time waits on its single accumulator's latency.
void dot4(const float* q, const float* base, const int64_t* rows, int64_t n, float scale, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(base + rows[j] + i), acc[j]);
  }
  for (int j = 0; j < 4; ++j) out[j] = hsum8(acc[j]) * scale;
}

// out[0..D) = sum_p w[p] * base[rows[p] + 0..D), D a multiple of 8. Each 32-float slice of
// out stays in 4 registers across all positions: accumulating in memory instead made every
// position wait on a store and a reload (~8x slower at 256 positions).
void weighted_sum(const float* w, const float* base, const int64_t* rows, int64_t n, int64_t D, float* out) {
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t p = 0; p < n; ++p) {
      const __m256 wp = _mm256_broadcast_ss(w + p);
      const float* v = base + rows[p] + i;
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(wp, _mm256_loadu_ps(v + 8 * j), acc[j]);
    }
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + i + 8 * j, acc[j]);
  }
  for (; i < D; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; ++p) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(w + p), _mm256_loadu_ps(base + rows[p] + i), acc);
    _mm256_storeu_ps(out + i, acc);
  }
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

// s[0..n) <- softmax(s), subtracting the max first as every stable softmax does.
void softmax(float* s, int64_t n) {
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
  float sum = hsum8(vsum);
  for (; p < n; ++p) sum += (s[p] = std::exp(s[p] - top));
  const float inv = 1.0f / sum;
  for (p = 0; p < n; ++p) s[p] *= inv;
}

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == dim, name, " must be a float32 tensor of ", dim, " dims");
}

void check_long(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == dim && t.is_contiguous(), name,
              " must be a contiguous int64 tensor of ", dim, " dims");
}

// x [T, H] -> w * (x * rsqrt(mean(x^2, -1) + eps)), w [H]; H a multiple of 8.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "x", 2);
  check_float(weight, "weight", 1);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.size(0) == H && H % 8 == 0, "weight must be [H] with H (", H, ") a multiple of 8");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty({T, H}, x.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * H;
      const float r = 1.0f / std::sqrt(dot(row, row, H) / static_cast<float>(H) + static_cast<float>(eps));
      for (int64_t i = 0; i < H; ++i) op[t * H + i] = wp[i] * (row[i] * r);
    }
  });
  return out;
}

// qkv [T, (Hq + 2 Hkv) D] (rows of Q heads, K heads, V heads): RoPE with the rows
// positions[t] of cos, sin [P, D] on the Q and K heads in place; then each row's K and V
// heads into slot slot_mapping[t] of k_cache, v_cache [slots, Hkv, D].
void rope_write_kv(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads) {
  check_float(qkv, "qkv", 2);
  check_float(cos, "cos", 2);
  check_float(sin, "sin", 2);
  check_float(k_cache, "k_cache", 3);
  check_float(v_cache, "v_cache", 3);
  check_long(positions, "positions", 1);
  check_long(slot_mapping, "slot_mapping", 1);
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && k_cache.is_contiguous()
              && v_cache.is_contiguous(), "qkv, cos, sin and the caches must be contiguous");
  const int64_t T = qkv.size(0), slots = k_cache.size(0), kv_heads = k_cache.size(1), D = k_cache.size(2);
  const int64_t P = cos.size(0), half = D / 2, width = qkv.size(1);
  TORCH_CHECK(width == (num_heads + 2 * kv_heads) * D, "qkv has ", width, " columns, not (", num_heads,
              " + 2 x ", kv_heads, ") x ", D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(1) == D && v_cache.sizes() == k_cache.sizes(),
              "cos, sin must be [P, D] and the caches equal in shape");
  TORCH_CHECK(positions.size(0) == T && slot_mapping.size(0) == T, "positions and slot_mapping need T entries");
  float* base = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P && slot[t] >= 0 && slot[t] < slots, "row ", t, ": position ", pos[t],
                " or slot ", slot[t], " out of range");
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = base + t * width;
      const float *c = cp + pos[t] * D, *s = sp + pos[t] * D;
      for (int64_t h = 0; h < num_heads + kv_heads; ++h) {
        float* x = row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          // x * cos + cat(-x2, x1) * sin, product by product as PyTorch evaluates it.
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
      const int64_t n = kv_heads * D;
      std::copy(row + num_heads * D, row + num_heads * D + n, kc + slot[t] * n);
      std::copy(row + num_heads * D + n, row + num_heads * D + 2 * n, vc + slot[t] * n);
    }
  });
}

// q [B, Hq, D] (last dim contiguous), k_cache, v_cache [slots, Hkv, D], block_tables
// [B, max_blocks] and ctx_lens [B] (int64): softmax(q k^T * scale) v over the first
// ctx_lens[b] positions of sequence b, position p at slot block_tables[b, p / block_size]
// * block_size + p % block_size; query head h reads KV head h / (Hq / Hkv). -> [B, Hq, D].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t block_size,
                                  double scale) {
  check_float(q, "q", 3);
  check_float(k_cache, "k_cache", 3);
  check_float(v_cache, "v_cache", 3);
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
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = Hq / Hkv, qs0 = q.stride(0), qs1 = q.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, hk = task % Hkv, n = lens[b];
      const int64_t* table = tables + b * max_blocks;
      rows.resize(n);  // offset of position p's K (and V) head hk in the caches
      for (int64_t j = 0, p = 0; p < n; ++j)
        for (int64_t slot = table[j] * block_size; slot < (table[j] + 1) * block_size && p < n; ++slot, ++p)
          rows[p] = (slot * Hkv + hk) * D;
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qp + b * qs0 + (hk * group + g) * qs1;
        float* s = scores.data() + g * n;
        int64_t p = 0;
        for (; p + 4 <= n; p += 4) dot4(qg, kc, rows.data() + p, D, sc, s + p);
        for (; p < n; ++p) s[p] = dot(qg, kc + rows[p], D) * sc;
      }
      for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * n, n);
      for (int64_t g = 0; g < group; ++g)
        weighted_sum(scores.data() + g * n, vc, rows.data(), n, D, op + (b * Hq + hk * group + g) * D);
    }
  });
  return out;
}

// x [M, K] @ W^T for a projection given as its tensors: [W [N, K]] (float32, or bfloat16:
// x cast to it and the result back) or the GGUF blocks [qs, scales] (Q8_0) / [qs, scales,
// mins] (Q4_1) of quant_kernels.cpp's quant_mm.
at::Tensor project(const at::Tensor& x, at::TensorList w) {
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
  check_float(layer_cache, "layer_cache", 5);
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const int64_t B = x.size(0), block_size = layer_cache.size(2), kv_heads = layer_cache.size(3), D = layer_cache.size(4);
  at::Tensor qkv = project(rms_norm(x, input_norm, eps), qkv_w);
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  const at::Tensor k_cache = layer_cache[0].view({-1, kv_heads, D}), v_cache = layer_cache[1].view({-1, kv_heads, D});
  rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads);
  const at::Tensor q = qkv.narrow(1, 0, num_heads * D).view({B, num_heads, D});
  const at::Tensor attn = paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size,
                                                 1.0 / std::sqrt(static_cast<double>(D)));
  x.add_(project(attn.view({B, num_heads * D}), o_w));
  const at::Tensor gate_up = project(rms_norm(x, post_norm, eps), gate_up_w);
  const int64_t inner = gate_up.size(1) / 2;
  x.add_(project(at::silu(gate_up.narrow(1, 0, inner)).mul_(gate_up.narrow(1, inner, inner)), down_w));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(epdserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
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
}
