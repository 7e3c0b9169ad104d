// Decode attention over the torch runner's paged KV cache, read in place, and the causal
// attention of a prompt chunk (the llama.cpp runner's float32 torch prefill; below), for
// fp32 on x86 CPUs with AVX2 and FMA (built into the same library as native_gemm.cpp).
//
// The eager path gathers each row's blocks into one tensor (index_select) and runs SDPA
// over it: per layer and step it copies the whole context, at ~1.4 GB/s effective on a
// 2-core AVX2 EPYC (a decode step grew ~32 us per context token). Here each (row, context
// split) reads its keys and values where they are, a token's KV heads together (one
// contiguous run) and its values prefetched while the scores are computed: the scores of
// every head, their softmax (max, then exp with an AVX2 polynomial), then the weighted
// values. Splits of 64+ tokens of one row's context (flash-decoding) are merged by their
// maxima and sums, so a single row still uses every thread. A row's result depends only on
// its own query and context (the split count follows the row's own length), never on the
// other rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "native_simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t MIN_SPLIT = 64;  // context tokens per split at least

struct Shape {
  int64_t rows, heads, kv_heads, group, dim, block, width;
};

// out[0 : 8 W] = sum over tokens i of p[i] * rows[i][j0 : j0 + 8 W] (W registers).
template <int W>
inline void weigh(const float* p, const float* const* rows, int64_t n, int64_t j0, float* out) {
  __m256 o[W];
#pragma GCC unroll 8
  for (int j = 0; j < W; ++j) o[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const float* v = rows[i] + j0;
    const __m256 pw = _mm256_set1_ps(p[i]);
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) o[j] = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 8 * j), o[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < W; ++j) _mm256_storeu_ps(out + 8 * j, o[j]);
}

// Per-thread scratch: the context's row pointers into the K and V caches.
std::vector<const float*>& row_ptrs(int which, int64_t n) {
  thread_local std::vector<const float*> ptrs[2];
  ptrs[which].resize(n);
  return ptrs[which];
}

// One row over context tokens [t0, t1), every head: the maxima, sums and unnormalised
// outputs into m[heads], l[heads], acc[heads * dim]. Tokens are visited in cache order with
// all their KV heads together (a token's keys are one contiguous run), and its values are
// prefetched meanwhile, so the memory is read as a stream, not as strided slices.
void attend_split(const Shape& s, const float* q, const float* kc, const float* vc,
                  const int64_t* table, int64_t t0, int64_t t1, float scale, float softcap,
                  float* m, float* l, float* acc, std::vector<float>& scores) {
  const int64_t n = t1 - t0, g = s.group, d = s.dim, stride = s.kv_heads * d;
  const int64_t heads = s.heads;
  scores.resize(heads * n);
  // token t's row of a cache: its block's base (from the table, once a block) + its offset
  std::vector<const float*>& rows_k = row_ptrs(0, n), &rows_v = row_ptrs(1, n);
  for (int64_t t = t0; t < t1;) {
    const int64_t b = t / s.block, end = std::min(t1, (b + 1) * s.block);
    const int64_t base = (table[b] * s.block - b * s.block) * stride;
    for (; t < end; ++t) {
      rows_k[t - t0] = kc + base + t * stride;
      rows_v[t - t0] = vc + base + t * stride;
    }
  }
  const int64_t lines = stride * 4 / 64;  // cache lines of one token's values
  // Scores, 4 tokens at a time per head: four independent chains, summed together.
  const __m128 scale4 = _mm_set1_ps(scale);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int64_t x = 0; x < 4; ++x)
      for (int64_t c = 0; c < lines; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(rows_v[i + x]) + 64 * c, _MM_HINT_T0);
        if (i + 8 <= n)
          _mm_prefetch(reinterpret_cast<const char*>(rows_k[i + 4 + x]) + 64 * c, _MM_HINT_T0);
      }
    for (int64_t kvh = 0; kvh < s.kv_heads; ++kvh) {
      const float* k0 = rows_k[i] + kvh * d; const float* k1 = rows_k[i + 1] + kvh * d;
      const float* k2 = rows_k[i + 2] + kvh * d; const float* k3 = rows_k[i + 3] + kvh * d;
      for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h) {
        const float* qh = q + h * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < d; j += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + j);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + j), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + j), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + j), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + j), a3);
        }
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_storeu_ps(scores.data() + h * n + i,
                      _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(t),
                                            _mm256_extractf128_ps(t, 1)), scale4));
      }
    }
  }
  for (; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* k = rows_k[i] + (h / g) * d;
      const float* qh = q + h * d;
      __m256 a0 = _mm256_setzero_ps();
      for (int64_t j = 0; j < d; j += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), _mm256_loadu_ps(k + j), a0);
      scores[h * n + i] = hsum(a0) * scale;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* p = scores.data() + h * n;
    if (softcap > 0.f)
      for (int64_t j = 0; j < n; ++j) p[j] = std::tanh(p[j] / softcap) * softcap;
    m[h] = *std::max_element(p, p + n);
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* p = scores.data() + h * n;
    const __m256 mh = _mm256_set1_ps(m[h]);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + i), mh));
      _mm256_storeu_ps(p + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; i < n; ++i) total += (p[i] = std::exp(p[i] - m[h]));
    l[h] = total;
  }
  // The weighted values, up to 64 output dims at a time held in registers.
  for (int64_t h = 0; h < heads; ++h) {
    const float* p = scores.data() + h * n;
    const int64_t off = (h / g) * d;
    for (int64_t j0 = 0; j0 < d; j0 += 64) {
      float* out = acc + h * d + j0;
      switch (std::min<int64_t>(64, d - j0) / 8) {
        case 8: weigh<8>(p, rows_v.data(), n, off + j0, out); break;
        case 7: weigh<7>(p, rows_v.data(), n, off + j0, out); break;
        case 6: weigh<6>(p, rows_v.data(), n, off + j0, out); break;
        case 5: weigh<5>(p, rows_v.data(), n, off + j0, out); break;
        case 4: weigh<4>(p, rows_v.data(), n, off + j0, out); break;
        case 3: weigh<3>(p, rows_v.data(), n, off + j0, out); break;
        case 2: weigh<2>(p, rows_v.data(), n, off + j0, out); break;
        default: weigh<1>(p, rows_v.data(), n, off + j0, out); break;
      }
    }
  }
}

// ---- Causal prefill: one sequence's prompt chunk over its cached past and itself ----
//
// The llama.cpp runner's float32 torch prefill (long prompts, handed to llama.cpp) spent
// ~25-40% of its time in SDPA's CPU flash kernel, which runs a head size of 64 at ~60-100
// GFLOP/s on a 2-core AVX2 EPYC. Here, flash attention with register tiles: each work unit
// is 48 query rows of one head; for each block of 128 keys, the scores of 6 rows x 16 keys
// a tile (keys read from a transposed copy in panels of 16), an online softmax per row, then
// the weighted values 6 rows x 16 columns a tile. Units go to threads from a shared
// counter, the most-seeing (last) rows first, since causal units differ in work. The
// products run at the GEMM's speed; the softmax was 15-20% of the time, its exp ~11%, so
// q carries log2(e) in its scale and the weights are 2^x (exp2_256: four vector ops fewer
// than exp), the rows' corrections eight at a time: 3-7% less time, as close to float64.

constexpr int MR = 6;     // query rows a register tile
constexpr int NR = 16;    // keys, or value columns, a register tile
constexpr int KB = 128;   // keys a block
constexpr int QB = 48;    // query rows a work unit (8 tiles)
static_assert(QB % 8 == 0, "softmax_block corrects rows eight at a time");

// For the 6 rows r of a tile: out[r][0 : 16] (+)= sum over x < n of a[r][x] b[x][0 : 16],
// rows of a `a_row` apart, of b `b_row`, of out `out_row`. The scores are q (a) times a
// panel of keys (b: [D][16]); the weighted values are the weights (a) times the values.
template <bool Accumulate>
inline void tile_6x16(const float* a, int64_t a_row, const float* b, int64_t b_row, int64_t n,
                      float* out, int64_t out_row) {
  __m256 c[MR][2];
  for (int r = 0; r < MR; ++r) {
    c[r][0] = Accumulate ? _mm256_loadu_ps(out + r * out_row) : _mm256_setzero_ps();
    c[r][1] = Accumulate ? _mm256_loadu_ps(out + r * out_row + 8) : _mm256_setzero_ps();
  }
#pragma GCC unroll 4
  for (int64_t x = 0; x < n; ++x) {
    const __m256 b0 = _mm256_loadu_ps(b + x * b_row);
    const __m256 b1 = _mm256_loadu_ps(b + x * b_row + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 w = _mm256_broadcast_ss(a + r * a_row + x);
      c[r][0] = _mm256_fmadd_ps(w, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(w, b1, c[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * out_row, c[r][0]);
    _mm256_storeu_ps(out + r * out_row + 8, c[r][1]);
  }
}

// One key block's scores of a unit's rows (row r: s + r * KB, its first seen[r] keys
// visible) folded into their running maxima m, sums l and unnormalised outputs acc (D a
// row); the scores become the weights. The rows' maxima first, then their corrections
// 2^(m - top) eight rows at a time, then each row's weights.
template <int D>
inline void softmax_block(float* sc, const int64_t* seen, int64_t rows, int64_t n16,
                          float* m, float* l, float* acc, float* corr) {
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = sc + r * KB;
    if (seen[r] <= 0) {  // a row before this block's keys: nothing to add
      std::fill(s, s + n16, 0.f);
      corr[r] = 0.f;  // the difference m - top below: none
      continue;
    }
    for (int64_t j = seen[r]; j < n16; ++j) s[j] = NEG_INF;
    __m256 mx = _mm256_set1_ps(NEG_INF);
    for (int64_t j = 0; j < n16; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    const float top = std::max(m[r], hmax(mx));
    corr[r] = m[r] == NEG_INF ? -126.f : m[r] - top;  // a first block: nothing to correct
    m[r] = top;
  }
  for (int64_t r = 0; r < rows; r += 8)  // the last eight stay within corr: rows <= QB
    _mm256_storeu_ps(corr + r, exp2_256(_mm256_loadu_ps(corr + r)));
  for (int64_t r = 0; r < rows; ++r) {
    if (seen[r] <= 0) continue;
    float* s = sc + r * KB;
    const __m256 topv = _mm256_set1_ps(m[r]);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n16; j += 8) {
      const __m256 e = exp2_256(_mm256_sub_ps(_mm256_loadu_ps(s + j), topv));
      _mm256_storeu_ps(s + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    for (int64_t j = seen[r]; j < n16; ++j) s[j] = 0.f;  // exp2_256 floors at 2^-125, not 0
    const float c = corr[r];
    l[r] = l[r] * c + hsum(sum);
    if (c != 1.f)
      for (int d = 0; d < D; ++d) acc[r * D + d] *= c;
  }
}

// q [1, H, L, D] at positions past .. past + L - 1, k / v [1, KVH, past + L, D] (query head
// h reads KV head h / (H / KVH)), out [1, L, H, D] contiguous.
template <int D>
void causal_prefill_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         float scale, at::Tensor& out) {
  const int64_t H = q.size(1), L = q.size(2), KVH = k.size(1), S = k.size(2);
  const int64_t group = H / KVH, past = S - L, panels = (S + NR - 1) / NR;
  // The keys in panels of 16, [KVH][panel][D][16], zero past S; kept between calls (fresh
  // pages cost here: see blocked_attention.py's _workspace).
  thread_local std::vector<float> kt;
  kt.resize(std::max<size_t>(kt.size(), KVH * panels * D * NR));
  float* const ktp = kt.data();  // the workers below see their own thread_locals, not this
  const float* kp = k.data_ptr<float>();
  const int64_t kh = k.stride(1), ks = k.stride(2);
  at::parallel_for(0, KVH * panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* panel = ktp + p * D * NR;
      const int64_t h = p / panels, s0 = p % panels * NR;
      for (int64_t j = 0; j < NR; ++j)
        for (int d = 0; d < D; ++d)
          panel[d * NR + j] = s0 + j < S ? kp[h * kh + (s0 + j) * ks + d] : 0.f;
    }
  });
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float qscale = scale * 1.44269504088896341f;  // scores in log2 units
  const int64_t qh = q.stride(1), ql = q.stride(2), vh = v.stride(1), vs = v.stride(2);
  float* op = out.data_ptr<float>();
  const int64_t blocks = (L + QB - 1) / QB, units = H * blocks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> qs, sc, acc, m, l, corr;
    thread_local std::vector<int64_t> seen;
    qs.resize(QB * D), sc.resize(QB * KB), acc.resize(QB * D), m.resize(QB), l.resize(QB);
    corr.resize(QB), seen.resize(QB);
    for (int64_t u; (u = next.fetch_add(1)) < units;) {
      const int64_t b = blocks - 1 - u / H, h = u % H, kvh = h / group;
      const int64_t i0 = b * QB, n = std::min<int64_t>(QB, L - i0);
      const int64_t rows = (n + MR - 1) / MR * MR;  // a last tile's extra rows are zeros
      for (int64_t r = 0; r < rows; ++r)
        for (int d = 0; d < D; ++d)
          qs[r * D + d] = r < n ? qp[h * qh + (i0 + r) * ql + d] * qscale : 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t kend = past + i0 + n;  // the keys the unit's last row sees
      const float* ktb = ktp + kvh * panels * D * NR;
      for (int64_t k0 = 0; k0 < kend; k0 += KB) {
        const int64_t kn = std::min<int64_t>(KB, kend - k0), kn16 = (kn + NR - 1) / NR * NR;
        // a tile's rows see keys before past + i0 + r0 + MR only: nothing later is computed
        auto tile_keys = [&](int64_t r0) {
          return std::clamp<int64_t>(past + i0 + r0 + MR - k0, 0, kn);
        };
        for (int64_t r0 = 0; r0 < rows; r0 += MR)
          for (int64_t j0 = 0; j0 < tile_keys(r0); j0 += NR)
            tile_6x16<false>(qs.data() + r0 * D, D, ktb + (k0 + j0) * D, NR, D,
                             sc.data() + r0 * KB + j0, KB);
        for (int64_t r = 0; r < rows; ++r)
          seen[r] = r < n ? std::min<int64_t>(kn, past + i0 + r + 1 - k0) : 0;
        softmax_block<D>(sc.data(), seen.data(), rows, kn16, m.data(), l.data(), acc.data(),
                         corr.data());
        const float* vb = vp + kvh * vh + k0 * vs;
        for (int64_t r0 = 0; r0 < rows; r0 += MR)
          for (int d0 = 0; d0 < D; d0 += NR)
            tile_6x16<true>(sc.data() + r0 * KB, KB, vb + d0, vs, tile_keys(r0),
                            acc.data() + r0 * D + d0, D);
      }
      for (int64_t r = 0; r < n; ++r) {
        float* o = op + ((i0 + r) * H + h) * D;
        const float inv = 1.f / l[r];
        for (int d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
      }
    }
  });
}

}  // namespace

// q [rows, heads, dim]; caches [blocks, block, kv_heads, dim]; tables [rows, width];
// seq_lens [rows]: row r attends to its tokens [max(0, len - window), len) (window 0: all).
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && tables.dim() == 2 && seq_lens.dim() == 1,
              "paged_decode: q [rows, heads, dim], caches [blocks, block, kv_heads, dim], "
              "tables [rows, width], seq_lens [rows]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: int64 tables and seq_lens");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "paged_decode: contiguous caches");
  const Shape s{q.size(0), q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2),
                q.size(2), k_cache.size(1), tables.size(1)};
  TORCH_CHECK(s.dim == k_cache.size(3) && s.dim % 8 == 0 && s.heads % s.kv_heads == 0 &&
                  tables.size(0) == s.rows && seq_lens.size(0) == s.rows,
              "paged_decode: head dim a multiple of 8, heads a multiple of kv heads");
  auto qc = q.contiguous();
  auto tc = tables.contiguous();
  auto lc = seq_lens.contiguous();
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.rows; ++r)
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= s.width * s.block, "paged_decode: a row's length "
                "is outside its table");
  // Splits per row: by the row's own visible length only.
  std::vector<int64_t> first(s.rows), splits(s.rows), unit0(s.rows + 1, 0);
  for (int64_t r = 0; r < s.rows; ++r) {
    first[r] = window > 0 ? std::max<int64_t>(0, lp[r] - window) : 0;
    splits[r] = std::max<int64_t>(1, (lp[r] - first[r]) / MIN_SPLIT);
    splits[r] = std::min<int64_t>(splits[r], 16);
    unit0[r + 1] = unit0[r] + splits[r];
  }
  const int64_t units = unit0[s.rows], heads = s.heads, d = s.dim;
  std::vector<float> m(units * heads), l(units * heads), acc(units * heads * d);
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> scores;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t r = std::upper_bound(unit0.begin(), unit0.end(), u) - unit0.begin() - 1;
      const int64_t part = u - unit0[r];
      const int64_t n = lp[r] - first[r], chunk = (n + splits[r] - 1) / splits[r];
      const int64_t t0 = first[r] + part * chunk, t1 = std::min(lp[r], t0 + chunk);
      float* mu = m.data() + u * heads;
      float* lu = l.data() + u * heads;
      float* au = acc.data() + u * heads * d;
      if (t0 >= t1) {
        std::fill(mu, mu + heads, -std::numeric_limits<float>::infinity());
        std::fill(lu, lu + heads, 0.f);
        std::fill(au, au + heads * d, 0.f);
        continue;
      }
      attend_split(s, qp + r * s.heads * d, kp, vp, tp + r * s.width, t0, t1,
                   static_cast<float>(scale), static_cast<float>(softcap), mu, lu, au, scores);
    }
  });
  auto out = at::empty({s.rows, s.heads, d}, q.options());
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < splits[r]; ++p)
        top = std::max(top, m[(unit0[r] + p) * heads + h]);
      float total = 0.f;
      float* o = op + (r * heads + h) * d;
      std::fill(o, o + d, 0.f);
      for (int64_t p = 0; p < splits[r]; ++p) {
        const int64_t u = unit0[r] + p;
        const float w = l[u * heads + h] > 0.f ? std::exp(m[u * heads + h] - top) : 0.f;
        total += w * l[u * heads + h];
        const float* a = acc.data() + (u * heads + h) * d;
        for (int64_t j = 0; j < d; ++j) o[j] += w * a[j];
      }
      for (int64_t j = 0; j < d; ++j) o[j] /= total;
    }
  }
  return out;
}

// q [1, heads, L, dim] (any strides but the last), k / v [1, kv_heads, past + L, dim]:
// causal attention of a prompt chunk at positions past .. past + L - 1, [1, L, heads, dim].
at::Tensor causal_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == 1 &&
                  k.size(0) == 1, "causal_prefill: q [1, H, L, D], k and v [1, KVH, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat, "causal_prefill: float32 only");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "causal_prefill: the last dimension must be contiguous");
  TORCH_CHECK(k.size(3) == q.size(3) && q.size(1) % k.size(1) == 0 && k.size(2) >= q.size(2),
              "causal_prefill: head sizes, head groups or lengths do not match");
  const int64_t D = q.size(3);
  auto out = at::empty({1, q.size(2), q.size(1), D}, q.options());
  if (D == 64)
    causal_prefill_into<64>(q, k, v, static_cast<float>(scale), out);
  else if (D == 128)
    causal_prefill_into<128>(q, k, v, static_cast<float>(scale), out);
  else
    TORCH_CHECK(false, "causal_prefill: head size ", D, " (64 or 128 only)");
  return out;
}

TORCH_LIBRARY(genserve_attention, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, "
        "Tensor seq_lens, float scale, int window, float softcap) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
  m.def("causal_prefill(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.impl("causal_prefill", c10::DispatchKey::CPU, TORCH_FN(causal_prefill));
}
