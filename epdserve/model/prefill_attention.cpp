// Causal prefill attention on AVX-512: one sequence's new query tokens against every position
// of its context, read in place from the paged KV cache (rope_write_kv has written the new
// tokens' K/V there), with grouped-query attention's shared K/V loaded once per KV head.
//
//   prefill_attention   out[i, h] = softmax(scale * q[i, h] . K[:p_i]) V[:p_i], where p_i =
//                       ctx_len - q_len + i + 1 positions are visible to query token i
//
// Two phases. First each KV head's keys and values are packed, block by block of BK
// positions, in the layout the products read (keys transposed, d-major; values row-major;
// in bfloat16 both interleaved in pairs for AVX512_BF16's dot product). Then each task (one
// KV head, BQ query positions, its G query heads: G * BQ rows) runs flash attention's loop
// (Dao et al., 2022) over the key blocks up to its last position: S = Q K^T in register
// tiles of RM rows x BK keys, the causal mask, the online softmax (running max and sum per
// row), then O += P V in tiles of RM rows x head_dim. The arithmetic is float32 (FMA); in
// bfloat16 Q, K, V and P are rounded to bfloat16 and multiplied in pairs with float32 sums,
// as PyTorch's CPU flash attention does. Sums run in another order than PyTorch's: results
// differ in the last bits.
// Compiled for AVX-512 (F, BW, BF16) by the target pragma below, not by the build's flags:
// layer_ops calls it only on CPUs with those features (kernels.prefill_attention_isa).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>
#include <algorithm>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma,amx-tile,amx-bf16")

#include "avx512.h"

namespace {

using epdserve_avx512::exp16;
using epdserve_avx512::load16;
using epdserve_avx512::store16;

// How the products run: float32 FMAs, AVX512_BF16 pair dot products, or AMX tiles.
enum class Isa { F32, BF16, AMX };

constexpr int64_t BQ = 32;  // query positions per task
constexpr int64_t BK = 64;  // key positions per block: 4 vectors of 16
constexpr int64_t KV = BK / 16;
const float NEG_INF = -std::numeric_limits<float>::infinity();

// Where one KV head's packed blocks sit: BK positions each, zero past the context.
// float32: keys [D][BK], values [BK][D]. bfloat16 (as uint16): keys [D/2][BK][2] (two
// dimensions of a key side by side), values [BK/2][D][2] (two positions of a dimension).
struct Packed {
  void* k;
  void* v;
  int64_t block_elems;  // BK * D
};

// n values (a multiple of 16) as float32, or as bfloat16 bits (rounded to nearest even; a
// float32 below bfloat16's smallest normal becomes 0).
template <typename T>
void row_f32(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
}
void row_bf16(const c10::BFloat16* src, uint16_t* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(uint16_t)); }
void row_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
}

// One KV head's block of positions [first, first + n) into kdst and vdst (Packed's layout).
template <bool BF16, typename C>
void pack_block(const C* kc, const C* vc, const int64_t* table, int64_t block_size, int64_t KH, int64_t D,
                int64_t h, int64_t first, int64_t n, void* kdst, void* vdst) {
  std::memset(kdst, 0, BK * D * (BF16 ? 2 : 4));
  std::memset(vdst, 0, BK * D * (BF16 ? 2 : 4));
  alignas(64) float f[128];
  alignas(64) uint16_t b[128];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = first + j, slot = table[pos / block_size] * block_size + pos % block_size;
    const C* krow = kc + (slot * KH + h) * D;
    const C* vrow = vc + (slot * KH + h) * D;
    if (BF16) {
      row_bf16(krow, b, D);
      uint32_t pairs[64];  // the key's dimension pairs, each to its row of the block
      std::memcpy(pairs, b, D * sizeof(uint16_t));
      for (int64_t p = 0; p < D / 2; ++p) static_cast<uint32_t*>(kdst)[p * BK + j] = pairs[p];
      row_bf16(vrow, b, D);
      uint16_t* v = static_cast<uint16_t*>(vdst) + (j / 2) * D * 2 + j % 2;
      for (int64_t d = 0; d < D; ++d) v[d * 2] = b[d];
    } else {
      row_f32(krow, f, D);
      for (int64_t d = 0; d < D; ++d) static_cast<float*>(kdst)[d * BK + j] = f[d];
      row_f32(vrow, static_cast<float*>(vdst) + j * D, D);
    }
  }
}

// S[RM][BK] = Q[RM][D] K^T for one key block: float32 FMAs, or bfloat16 pairs.
template <bool BF16, int RM>
void qk_tile(const void* q, const void* k, float* s, int64_t D) {
  __m512 acc[RM][KV];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < KV; ++c) acc[r][c] = _mm512_setzero_ps();
  if (BF16) {
    const uint32_t* qp = static_cast<const uint32_t*>(q);  // a row's dimension pairs
    const uint16_t* kp = static_cast<const uint16_t*>(k);
    for (int64_t p = 0; p < D / 2; ++p) {
      __m512bh kv[KV];
      for (int c = 0; c < KV; ++c)
        kv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + p * BK * 2 + c * 32));
      for (int r = 0; r < RM; ++r) {
        const __m512bh qr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(qp[r * D / 2 + p])));
        for (int c = 0; c < KV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qr, kv[c]);
      }
    }
  } else {
    const float* qp = static_cast<const float*>(q);
    const float* kp = static_cast<const float*>(k);
    for (int64_t d = 0; d < D; ++d) {
      __m512 kv[KV];
      for (int c = 0; c < KV; ++c) kv[c] = _mm512_loadu_ps(kp + d * BK + c * 16);
      for (int r = 0; r < RM; ++r) {
        const __m512 qr = _mm512_set1_ps(qp[r * D + d]);
        for (int c = 0; c < KV; ++c) acc[r][c] = _mm512_fmadd_ps(qr, kv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < KV; ++c) _mm512_storeu_ps(s + r * BK + c * 16, acc[r][c]);
}

// O[RM][D] += P[RM][BK] V for one key block (ND = D / 16 vectors a row).
template <bool BF16, int RM, int ND>
void pv_tile(const void* p, const void* v, float* o) {
  constexpr int64_t D = ND * 16;
  __m512 acc[RM][ND];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + c * 16);
  if (BF16) {
    const uint32_t* pp = static_cast<const uint32_t*>(p);  // a row's position pairs
    const uint16_t* vp = static_cast<const uint16_t*>(v);
    for (int64_t j = 0; j < BK / 2; ++j) {
      __m512bh vv[ND];
      for (int c = 0; c < ND; ++c)
        vv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + j * D * 2 + c * 32));
      for (int r = 0; r < RM; ++r) {
        const __m512bh pr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pp[r * BK / 2 + j])));
        for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, vv[c]);
      }
    }
  } else {
    const float* pp = static_cast<const float*>(p);
    const float* vp = static_cast<const float*>(v);
    for (int64_t j = 0; j < BK; ++j) {
      __m512 vv[ND];
      for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(vp + j * D + c * 16);
      for (int r = 0; r < RM; ++r) {
        const __m512 pr = _mm512_set1_ps(pp[r * BK + j]);
        for (int c = 0; c < ND; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

// AMX (bfloat16 tiles of 16 rows x 64 bytes, float32 sums): tiles 0-3 hold 16 x 16 sums,
// 4 the left operand, 5 the right. The operands are the bfloat16 layouts above: a Q or P row
// is 32 dimension or position pairs a tile row; a packed K or V tile row is 16 keys (or
// dimensions) x 2.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
};

// Linux hands out AMX's tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

#define EPD_DP4(A_PTR, A_STRIDE, B_PTR, B_STEP, B_STRIDE)                   \
  _tile_loadd(4, (A_PTR), (A_STRIDE));                                      \
  _tile_loadd(5, (B_PTR), (B_STRIDE)); _tile_dpbf16ps(0, 4, 5);            \
  _tile_loadd(5, (B_PTR) + (B_STEP), (B_STRIDE)); _tile_dpbf16ps(1, 4, 5); \
  _tile_loadd(5, (B_PTR) + 2 * (B_STEP), (B_STRIDE)); _tile_dpbf16ps(2, 4, 5); \
  _tile_loadd(5, (B_PTR) + 3 * (B_STEP), (B_STRIDE)); _tile_dpbf16ps(3, 4, 5)

// S[16][BK] = Q[16][D] K^T on tiles.
void qk_amx(const uint16_t* q, const uint16_t* k, float* s, int64_t D) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t step = 0; step < D / 32; ++step) {  // 32 dimensions (16 pairs) a step
    EPD_DP4(q + step * 32, D * 2, k + step * 16 * BK * 2, 32, BK * 4);
  }
  _tile_stored(0, s, BK * 4); _tile_stored(1, s + 16, BK * 4);
  _tile_stored(2, s + 32, BK * 4); _tile_stored(3, s + 48, BK * 4);
}

// O[16][D] += P[16][BK] V on tiles, 64 dimensions at a time.
void pv_amx(const uint16_t* p, const uint16_t* v, float* o, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_loadd(0, o + d0, D * 4); _tile_loadd(1, o + d0 + 16, D * 4);
    _tile_loadd(2, o + d0 + 32, D * 4); _tile_loadd(3, o + d0 + 48, D * 4);
    for (int64_t step = 0; step < BK / 32; ++step) {  // 32 positions (16 pairs) a step
      EPD_DP4(p + step * 32, BK * 2, v + step * 16 * D * 2 + d0 * 2, 32, D * 4);
    }
    _tile_stored(0, o + d0, D * 4); _tile_stored(1, o + d0 + 16, D * 4);
    _tile_stored(2, o + d0 + 32, D * 4); _tile_stored(3, o + d0 + 48, D * 4);
  }
}

#undef EPD_DP4

// The online softmax of one row's block of scores: s[0..BK) scaled, positions past `last`
// masked, the running max m and sum l updated; the row's P written (float32 over s, or
// bfloat16 to p16) and its output o[0..D) rescaled. A row that sees none of the block
// gets P = 0 and keeps m, l and o.
template <bool BF16, int ND>
void softmax_row(float* s, uint16_t* p16, int64_t last, float scale, float& m, float& l, float* o) {
  __m512 x[KV];
  __mmask16 keep[KV];
  __m512 top = _mm512_set1_ps(NEG_INF);
  for (int c = 0; c < KV; ++c) {
    const int64_t visible = std::min<int64_t>(std::max<int64_t>(last + 1 - c * 16, 0), 16);
    keep[c] = static_cast<__mmask16>((1u << visible) - 1u);
    x[c] = _mm512_loadu_ps(s + c * 16);
    top = _mm512_mask_max_ps(top, keep[c], top, x[c]);
  }
  const float m_new = last < 0 ? m : std::max(m, _mm512_reduce_max_ps(top) * scale);  // (scale > 0)
  const float alpha = m_new == m ? 1.0f : std::exp(m - m_new);  // 0 on the first block (m = -inf)
  const __m512 vscale = _mm512_set1_ps(scale), neg_m = _mm512_set1_ps(-m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < KV; ++c) {
    x[c] = _mm512_maskz_mov_ps(keep[c], exp16(_mm512_fmadd_ps(x[c], vscale, neg_m)));
    sum = _mm512_add_ps(sum, x[c]);
    if (!BF16) _mm512_storeu_ps(s + c * 16, x[c]);
  }
  if (BF16)
    for (int c = 0; c < KV; c += 2)
      _mm512_storeu_si512(p16 + c * 16, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(x[c + 1], x[c])));
  if (last < 0) return;
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  if (alpha != 1.0f)
    for (int c = 0; c < ND; ++c) store16(o + c * 16, _mm512_mul_ps(load16(o + c * 16), _mm512_set1_ps(alpha)));
}

// One task: query positions [q0, q0 + nq) of the sequence's new tokens, the G query heads
// of KV head h, rows ordered position-major (row r: position q0 + r / G, head h G + r % G).
// q: [q_len, H, D] with row stride q_stride; out: [q_len, H, D] contiguous.
template <Isa ISA, int ND, typename Q, typename O>
void attend_task(const Q* q, int64_t q_stride, O* out, const Packed& kv, int64_t H, int64_t h, int64_t G,
                 int64_t q0, int64_t nq, int64_t cached, float scale) {
  constexpr int64_t D = ND * 16;
  constexpr bool BF16 = ISA != Isa::F32;
  // Rows a product takes: a tile's 16, or RM x max(KV, ND) accumulators of the 32 registers.
  constexpr int RM = ISA == Isa::AMX ? 16 : ND <= 4 ? 4 : 2;
  const int64_t rows = G * nq, padded = (rows + RM - 1) / RM * RM;
  auto head = [&](int64_t r) { return h * G + std::min(r, rows - 1) % G; };  // padding rows: the last row's
  auto position = [&](int64_t r) { return q0 + std::min(r, rows - 1) / G; };
  std::vector<float> qf(BF16 ? 0 : padded * D), o(padded * D, 0.0f), s(padded * BK);
  std::vector<uint16_t> q16(BF16 ? padded * D : 0), p16(BF16 ? padded * BK : 0);
  std::vector<float> m(padded, NEG_INF), l(padded, 0.0f);
  for (int64_t r = 0; r < padded; ++r) {
    const Q* src = q + position(r) * q_stride + head(r) * D;
    if (BF16) row_bf16(src, &q16[r * D], D); else row_f32(src, &qf[r * D], D);
  }
  const int64_t elem = BF16 ? 2 : 4;
  if (ISA == Isa::AMX) {
    const TileConfig config;
    _tile_loadconfig(&config);
  }
  for (int64_t b = 0; b * BK < cached + q0 + nq; ++b) {  // up to the last row's position
    const char* kb = static_cast<const char*>(kv.k) + b * kv.block_elems * elem;
    const char* vb = static_cast<const char*>(kv.v) + b * kv.block_elems * elem;
    for (int64_t r = 0; r < padded; r += RM) {
      if (ISA == Isa::AMX) qk_amx(&q16[r * D], reinterpret_cast<const uint16_t*>(kb), &s[r * BK], D);
      else qk_tile<BF16, RM>(BF16 ? static_cast<const void*>(&q16[r * D]) : &qf[r * D], kb, &s[r * BK], D);
    }
    for (int64_t r = 0; r < padded; ++r)  // (the last key of the block that row r sees)
      softmax_row<BF16, ND>(&s[r * BK], BF16 ? &p16[r * BK] : nullptr, cached + position(r) - b * BK, scale,
                            m[r], l[r], &o[r * D]);
    for (int64_t r = 0; r < padded; r += RM) {
      if (ISA == Isa::AMX) pv_amx(&p16[r * BK], reinterpret_cast<const uint16_t*>(vb), &o[r * D], D);
      else pv_tile<BF16, RM, ND>(BF16 ? static_cast<const void*>(&p16[r * BK]) : &s[r * BK], vb, &o[r * D]);
    }
  }
  if (ISA == Isa::AMX) _tile_release();
  for (int64_t r = 0; r < rows; ++r) {
    O* dst = out + (position(r) * H + head(r)) * D;
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    for (int c = 0; c < ND; ++c) store16(dst + c * 16, _mm512_mul_ps(_mm512_loadu_ps(&o[r * D + c * 16]), inv));
  }
}

template <Isa ISA, int ND, typename Q, typename C, typename O>
void attend(const Q* q, int64_t q_stride, const C* kc, const C* vc, const int64_t* table, O* out, int64_t q_len,
            int64_t ctx_len, int64_t block_size, int64_t H, int64_t KH, float scale) {
  constexpr int64_t D = ND * 16;
  constexpr bool BF16 = ISA != Isa::F32;
  const int64_t blocks = (ctx_len + BK - 1) / BK, elem = BF16 ? 2 : 4, G = H / KH;
  std::vector<char> kbuf(KH * blocks * BK * D * elem), vbuf(KH * blocks * BK * D * elem);
  auto packed = [&](int64_t h) {
    return Packed{kbuf.data() + h * blocks * BK * D * elem, vbuf.data() + h * blocks * BK * D * elem, BK * D};
  };
  at::parallel_for(0, KH * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / blocks, b = t % blocks;
      const Packed p = packed(h);
      pack_block<BF16>(kc, vc, table, block_size, KH, D, h, b * BK, std::min(BK, ctx_len - b * BK),
                       static_cast<char*>(p.k) + b * BK * D * elem, static_cast<char*>(p.v) + b * BK * D * elem);
    }
  });
  // Tasks longest first (the last query blocks see the most keys), taken by whichever
  // thread is free: a causal prefill's work is a triangle.
  const int64_t q_blocks = (q_len + BQ - 1) / BQ, tasks = KH * q_blocks, cached = ctx_len - q_len;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t qb = q_blocks - 1 - t / KH, h = t % KH;
    attend_task<ISA, ND>(q, q_stride, out, packed(h), H, h, G, qb * BQ, std::min(BQ, q_len - qb * BQ), cached,
                          scale);
  }
}

template <typename F>
void with_type(const at::Tensor& t, const char* name, F f) {
  if (t.scalar_type() == at::kFloat) return f(float{});
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16, not ", t.scalar_type());
  f(c10::BFloat16{});
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_table, int64_t ctx_len, int64_t block_size, double scale,
                             c10::string_view isa) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [q_len, heads, head_dim] "
              "with each row's heads contiguous");
  const int64_t q_len = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.size(2) == D && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [slots, kv_heads, head_dim] of one dtype");
  const int64_t KH = k_cache.size(1);
  TORCH_CHECK(H % KH == 0 && H / KH <= 8, "heads must be a multiple (at most 8x) of kv_heads");
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128, not ", D);
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "block_table must be contiguous [n] int64");
  TORCH_CHECK(q_len >= 1 && q_len <= ctx_len && block_table.size(0) * block_size >= ctx_len,
              "ctx_len must cover q_len and fit the block table");
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(0);
  for (int64_t b = 0; b < (ctx_len + block_size - 1) / block_size; ++b)
    TORCH_CHECK(table[b] >= 0 && (table[b] + 1) * block_size <= slots, "block ", table[b], " is out of the cache");
  const Isa how = isa == "avx512" ? Isa::F32 : isa == "avx512_bf16" ? Isa::BF16 : Isa::AMX;
  TORCH_CHECK(how != Isa::AMX || isa == "amx", "isa must be avx512, avx512_bf16 or amx, not ", isa);
  TORCH_CHECK(how != Isa::AMX || amx_permitted(), "the kernel may not use AMX: Linux refused its tile state");
  at::Tensor out = at::empty({q_len, H, D}, q.options().dtype(how == Isa::F32 ? at::kFloat : at::kBFloat16));
  with_type(q, "q", [&](auto qt) {
    using Q = decltype(qt);
    with_type(k_cache, "k_cache", [&](auto ct) {
      using C = decltype(ct);
      with_type(out, "out", [&](auto ot) {
        using O = decltype(ot);
        const auto run = [&](auto isa_c, auto nd) {
          attend<decltype(isa_c)::value, decltype(nd)::value>(
              q.data_ptr<Q>(), q.stride(0), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), table, out.data_ptr<O>(),
              q_len, ctx_len, block_size, H, KH, static_cast<float>(scale));
        };
        using N4 = std::integral_constant<int, 4>;
        using N8 = std::integral_constant<int, 8>;
        const auto with_isa = [&](auto isa_c) { D == 64 ? run(isa_c, N4{}) : run(isa_c, N8{}); };
        if (how == Isa::F32) with_isa(std::integral_constant<Isa, Isa::F32>{});
        else if (how == Isa::BF16) with_isa(std::integral_constant<Isa, Isa::BF16>{});
        else with_isa(std::integral_constant<Isa, Isa::AMX>{});
      });
    });
  });
  return out;
}

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(epdserve, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int ctx_len, "
        "int block_size, float scale, str isa) -> Tensor");
  m.impl("prefill_attention", c10::DispatchKey::CPU, TORCH_FN(prefill_attention));
}
