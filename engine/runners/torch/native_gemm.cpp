// fp32 linear layers on x86 CPUs with AVX2 and FMA, for the torch runner
// (native_gemm.py beside it builds and loads this file).
//
// The weight is packed once into panels of 16 output features, k-major ([P, K, 16]), so
// one row streams each panel once at memory speed and a 6 x 16 register tile of a
// many-row product runs at the FMA units' speed. Every output is one FMA chain over
// k = 0..K-1 from zero, then + bias: a row's bits do not depend on the other rows, the
// row count, the tiling or the thread count (the torch runner's batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>
#include <torch/library.h>

namespace {
constexpr int64_t NR = 16;

template <int MR>
inline void tile(const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc,
                 int64_t ncols, const float* bias) {
  // Named accumulators (an array makes gcc keep them on the stack every iteration).
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const float* a0 = a; const float* a1 = a + lda; const float* a2 = a + 2 * lda;
  const float* a3 = a + 3 * lda; const float* a4 = a + 4 * lda; const float* a5 = a + 5 * lda;
#define GS_ROW(i) if constexpr (MR > i) { __m256 ai = _mm256_broadcast_ss(a##i + k); \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0); c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1); }
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0 = _mm256_loadu_ps(b + k * NR);
    __m256 b1 = _mm256_loadu_ps(b + k * NR + 8);
    GS_ROW(0) GS_ROW(1) GS_ROW(2) GS_ROW(3) GS_ROW(4) GS_ROW(5)
  }
#undef GS_ROW
  __m256 r[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  alignas(32) float tmp[NR];
  for (int i = 0; i < MR; ++i) {
    if (ncols == NR) {
      if (bias) {
        r[i][0] = _mm256_add_ps(r[i][0], _mm256_loadu_ps(bias));
        r[i][1] = _mm256_add_ps(r[i][1], _mm256_loadu_ps(bias + 8));
      }
      _mm256_storeu_ps(c + i * ldc, r[i][0]);
      _mm256_storeu_ps(c + i * ldc + 8, r[i][1]);
    } else {  // the last panel's real features only (the bias holds no more)
      _mm256_store_ps(tmp, r[i][0]); _mm256_store_ps(tmp + 8, r[i][1]);
      for (int64_t j = 0; j < ncols; ++j) c[i * ldc + j] = bias ? tmp[j] + bias[j] : tmp[j];
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*);
constexpr TileFn TILES[7] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};
constexpr int64_t MR = 6;
}  // namespace

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack: 2-D float32 weight");
  auto w = weight.contiguous();
  int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto padded = at::zeros({P * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, NR, K}).transpose(1, 2).contiguous();  // [P, K, NR]
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == packed.size(1),
              "linear: float32 input with ", packed.size(1), " features expected");
  auto a = x.reshape({-1, x.size(-1)}).contiguous();
  int64_t M = a.size(0), K = a.size(1), P = packed.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, a.options());
  const float* ap = a.data_ptr<float>();
  const float* bp = packed.data_ptr<float>();
  float* cp = out.data_ptr<float>();
  at::Tensor bias_c;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat, "linear: bias");
    bias_c = bias->contiguous();
  }
  const float* biasp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  // Panels split across threads; each thread runs its panels in groups that stay in L2 while
  // every row passes them.
  const int64_t group = std::max<int64_t>(1, (256 * 1024) / (K * NR * 4));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      int64_t g1 = std::min(p1, g0 + group);
      for (int64_t m = 0; m < M; m += MR) {
        int64_t rows = std::min(MR, M - m);
        for (int64_t p = g0; p < g1; ++p) {
          int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
          TILES[rows](ap + m * K, K, bp + p * K * NR, K, cp + m * N + n0, N, ncols,
                      biasp ? biasp + n0 : nullptr);
        }
      }
    }
  });
  return out.view(sizes);
}

// ---- Weights kept in their quantised form (GGUF's Q4_1, Q8_0, ...), expanded in registers.
//
// Many fp32 weights are exactly a small integer times a per-32-block scale, plus a
// per-block offset: the model was loaded from a quantised file and dequantised
// (w = fp32(d * q) + m, as gguf's dequantiser computes it). Such a weight is packed as
// its 4- or 8-bit integers and the blocks' scales, and each k of a panel is expanded back
// to those very fp32 values in registers (fma(d, q, m): one rounding, as the dequantiser's
// two where d * q is exact) before the same one FMA chain per output runs:
// a product's bits equal the fp32 panels' (native_gemm.py checks every block at packing),
// while a decode step reads 6 or 9 bits a weight instead of 32.
//
// Layout, per panel of 16 output features: 4 bits: [P, K, 8] bytes, byte j holding feature
// j's q in its low nibble and feature j + 8's in its high one, and scales [P, K / 32, 2, 16]
// (16 d's then 16 m's); 8 bits: [P, K, 16] int8 and scales [P, K / 32, 16] (m = 0).
// The file is compiled with -ffp-contract=off: the arithmetic is the one written.
namespace {
constexpr int64_t QB = 32;  // k per quantisation block

// d and m for one block of 32 values with q in [0, 15] (m = 0 and q in [-127, 127] for 8
// bits) such that fma(d, q, m) gives every value exactly; false where none does. (Where d * q
// is exact, as for an fp16 d and a 4-bit q, that is the dequantiser's fp32(d * q) + m.)
bool fit_block(const float* v, int bits, float* d_out, float* m_out, int8_t* q_out) {
  float lo = v[0], hi = v[0], amax = 0.f;
  for (int i = 0; i < QB; ++i) {
    if (!std::isfinite(v[i])) return false;
    lo = std::min(lo, v[i]); hi = std::max(hi, v[i]); amax = std::max(amax, std::fabs(v[i]));
  }
  const float m = bits == 4 ? lo : 0.f;
  const int qmin = bits == 4 ? 0 : -127, qmax = bits == 4 ? 15 : 127;
  // The scale is an fp16 (Q4_1, Q4_0, Q8_0) or a product of small numbers (K-quants),
  // estimated from the range (Q4_1: q spans 0..15) or the largest magnitude (Q4_0: -8 d;
  // Q8_0: 127 d): each estimate rounded to fp16, then itself and its fp32 neighbours.
  const float bases[2] = {bits == 4 ? (hi - lo) / 15.f : amax / 127.f, amax / 8.f};
  float cands[12];
  int n = 0;
  for (int b = 0; b < (bits == 4 ? 2 : 1); ++b) {
    const float e = bases[b];
    const float up1 = std::nextafter(e, INFINITY), dn1 = std::nextafter(e, 0.f);
    cands[n++] = static_cast<float>(c10::Half(e));
    cands[n++] = e; cands[n++] = dn1; cands[n++] = up1;
    cands[n++] = std::nextafter(dn1, 0.f); cands[n++] = std::nextafter(up1, INFINITY);
  }
  for (int c = 0; c < n; ++c) {
    const float d = cands[c];
    if (!(d >= 0.f) || !std::isfinite(d)) continue;
    bool ok = true;
    for (int i = 0; i < QB && ok; ++i) {
      const float r = d > 0.f ? std::nearbyint((v[i] - m) / d) : 0.f;
      if (r < qmin || r > qmax) { ok = false; break; }
      // as expand() computes it; == takes -0 for +0 (Q4_0's zeros under a negative d), which
      // no FMA chain from +0 can tell apart
      const float back = bits == 4 ? std::fma(d, r, m) : d * r;
      ok = back == v[i];
      q_out[i] = static_cast<int8_t>(r);
    }
    if (ok) { *d_out = d; *m_out = m; return true; }
  }
  return false;
}

// One k of a panel: its 16 weights as fp32, from the block's scales (pointing at the 16 d's).
template <int BITS>
inline void expand(const uint8_t* q, int64_t k, const float* sc, __m256& b0, __m256& b1) {
  if constexpr (BITS == 4) {
    int64_t word; std::memcpy(&word, q + k * 8, 8);
    const __m256i w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(word));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xF)));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(sc), lo, _mm256_loadu_ps(sc + 16));
    b1 = _mm256_fmadd_ps(_mm256_loadu_ps(sc + 8), hi, _mm256_loadu_ps(sc + 24));
  } else {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k * 16));
    b0 = _mm256_mul_ps(_mm256_loadu_ps(sc), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w)));
    b1 = _mm256_mul_ps(_mm256_loadu_ps(sc + 8),
                       _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(w, 8))));
  }
}

template <int BITS> constexpr int64_t QBYTES = BITS == 4 ? 8 : 16;   // bytes of one k
template <int BITS> constexpr int64_t SCALES = BITS == 4 ? 32 : 16;  // floats of one block

// A panel expanded into fp32 [K, 16] (for many rows: the fp32 tiles then run over it).
template <int BITS>
void expand_panel(const uint8_t* q, const float* sc, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    __m256 b0, b1;
    expand<BITS>(q, k, sc + (k / QB) * SCALES<BITS>, b0, b1);
    _mm256_storeu_ps(out + k * NR, b0);
    _mm256_storeu_ps(out + k * NR + 8, b1);
  }
}

// Up to 4 rows straight from a quantised panel: each k expanded once for all the rows.
template <int MR, int BITS>
void qtile(const float* a, int64_t lda, const uint8_t* q, const float* sc, int64_t K, float* c,
           int64_t ldc, int64_t ncols, const float* bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00;
  const float* a0 = a; const float* a1 = a + lda; const float* a2 = a + 2 * lda;
  const float* a3 = a + 3 * lda;
#define GS_ROW(i) if constexpr (MR > i) { __m256 ai = _mm256_broadcast_ss(a##i + k); \
    c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0); c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1); }
  for (int64_t k0 = 0; k0 < K; k0 += QB) {
    const float* s = sc + (k0 / QB) * SCALES<BITS>;
    for (int64_t k = k0; k < k0 + QB; ++k) {
      __m256 b0, b1;
      expand<BITS>(q, k, s, b0, b1);
      GS_ROW(0) GS_ROW(1) GS_ROW(2) GS_ROW(3)
    }
  }
#undef GS_ROW
  __m256 r[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
  alignas(32) float tmp[NR];
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(tmp, r[i][0]); _mm256_store_ps(tmp + 8, r[i][1]);
    for (int64_t j = 0; j < ncols; ++j) c[i * ldc + j] = bias ? tmp[j] + bias[j] : tmp[j];
  }
}

// One row over 4 quantised panels at once: a lone row has only two chains a panel, which
// would wait on the FMA's latency; four panels' eight chains do not (each output is still
// one chain over k in order).
template <int BITS>
void qrow4(const float* a, const uint8_t* q, int64_t qstride, const float* sc, int64_t sstride,
           int64_t K, float* c, int64_t ncols_last, const float* bias) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00;
#define GS_PANEL(p) { __m256 b0, b1; expand<BITS>(q + p * qstride, k, s + p * sstride, b0, b1); \
    c##p##0 = _mm256_fmadd_ps(ai, b0, c##p##0); c##p##1 = _mm256_fmadd_ps(ai, b1, c##p##1); }
  for (int64_t k0 = 0; k0 < K; k0 += QB) {
    const float* s = sc + (k0 / QB) * SCALES<BITS>;
    for (int64_t k = k0; k < k0 + QB; ++k) {
      const __m256 ai = _mm256_broadcast_ss(a + k);
      GS_PANEL(0) GS_PANEL(1) GS_PANEL(2) GS_PANEL(3)
    }
  }
#undef GS_PANEL
  __m256 r[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
  alignas(32) float tmp[NR];
  for (int p = 0; p < 4; ++p) {
    const int64_t ncols = p == 3 ? ncols_last : NR;
    _mm256_store_ps(tmp, r[p][0]); _mm256_store_ps(tmp + 8, r[p][1]);
    for (int64_t j = 0; j < ncols; ++j) c[p * NR + j] = bias ? tmp[j] + bias[p * NR + j] : tmp[j];
  }
}

template <int BITS>
using QTileFn = void (*)(const float*, int64_t, const uint8_t*, const float*, int64_t, float*,
                         int64_t, int64_t, const float*);
template <int BITS>
constexpr QTileFn<BITS> QTILES[5] = {nullptr, qtile<1, BITS>, qtile<2, BITS>, qtile<3, BITS>,
                                     qtile<4, BITS>};
constexpr int64_t QDIRECT = 4;  // rows up to which the panels are expanded per k in registers

template <int BITS>
void qlinear(const float* ap, int64_t M, int64_t K, const uint8_t* qp, const float* sp,
             int64_t P, int64_t N, float* cp, const float* biasp) {
  const int64_t qstride = K * QBYTES<BITS>, sstride = (K / QB) * SCALES<BITS>;
  if (M <= QDIRECT) {
    at::parallel_for(0, P, M == 1 ? 4 : 1, [&](int64_t p0, int64_t p1) {
      int64_t p = p0;
      if (M == 1)
        for (; p + 4 <= p1; p += 4)
          qrow4<BITS>(ap, qp + p * qstride, qstride, sp + p * sstride, sstride, K, cp + p * NR,
                      std::min(NR, N - (p + 3) * NR), biasp ? biasp + p * NR : nullptr);
      for (; p < p1; ++p) {
        const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
        QTILES<BITS>[M](ap, K, qp + p * qstride, sp + p * sstride, K, cp + n0, N, ncols,
                        biasp ? biasp + n0 : nullptr);
      }
    });
    return;
  }
  const int64_t group = std::max<int64_t>(1, (256 * 1024) / (K * NR * 4));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> buf;
    buf.resize(group * K * NR);
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      const int64_t g1 = std::min(p1, g0 + group);
      for (int64_t p = g0; p < g1; ++p)
        expand_panel<BITS>(qp + p * qstride, sp + p * sstride, K, buf.data() + (p - g0) * K * NR);
      for (int64_t m = 0; m < M; m += MR) {
        const int64_t rows = std::min(MR, M - m);
        for (int64_t p = g0; p < g1; ++p) {
          const int64_t n0 = p * NR, ncols = std::min(NR, N - n0);
          TILES[rows](ap + m * K, K, buf.data() + (p - g0) * K * NR, K, cp + m * N + n0, N,
                      ncols, biasp ? biasp + n0 : nullptr);
        }
      }
    }
  });
}
}  // namespace

// [q, scales] for ``weight`` in ``bits`` (4 or 8), or [] if some block has no exact form.
std::vector<at::Tensor> pack_quantized(const at::Tensor& weight, int64_t bits) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && (bits == 4 || bits == 8),
              "pack_quantized: 2-D float32 weight, 4 or 8 bits");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR, KB = K / QB;
  if (K % QB != 0 || N == 0) return {};
  auto q = at::zeros({P, K, bits == 4 ? 8 : 16}, w.options().dtype(at::kByte));
  auto sc = at::zeros({P, KB, bits == 4 ? 32 : 16}, w.options());
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = sc.data_ptr<float>();
  std::atomic<bool> exact{true};
  // by panels: features j and j + 8 of a panel share their bytes
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    int8_t qb[QB];
    for (int64_t n = p0 * NR; n < std::min(N, p1 * NR); ++n) {
      if (!exact.load(std::memory_order_relaxed)) return;
      const int64_t p = n / NR, j = n % NR;
      for (int64_t b = 0; b < KB; ++b) {
        float d, m;
        if (!fit_block(wp + n * K + b * QB, static_cast<int>(bits), &d, &m, qb)) {
          exact = false;
          return;
        }
        float* s = sp + (p * KB + b) * (bits == 4 ? 32 : 16);
        if (bits == 4) {
          s[j] = d; s[16 + j] = m;
          for (int i = 0; i < QB; ++i)
            qp[(p * K + b * QB + i) * 8 + j % 8] |= static_cast<uint8_t>(qb[i] << (j < 8 ? 0 : 4));
        } else {
          s[j] = d;
          for (int i = 0; i < QB; ++i) qp[(p * K + b * QB + i) * 16 + j] = static_cast<uint8_t>(qb[i]);
        }
      }
    }
  });
  if (!exact) return {};
  return {q, sc};
}

// The dense [N, K] weight back from its quantised panels.
at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t bits, int64_t N) {
  const int64_t P = q.size(0), K = q.size(1);
  auto out = at::empty({P, K, NR}, scales.options());
  for (int64_t p = 0; p < P; ++p) {
    const uint8_t* qp = q.data_ptr<uint8_t>() + p * q.stride(0);
    const float* sp = scales.data_ptr<float>() + p * scales.stride(0);
    float* op = out.data_ptr<float>() + p * K * NR;
    if (bits == 4) expand_panel<4>(qp, sp, K, op); else expand_panel<8>(qp, sp, K, op);
  }
  return out.transpose(1, 2).reshape({P * NR, K}).narrow(0, 0, N).contiguous();
}

at::Tensor linear_quantized(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            int64_t bits, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == q.size(1) &&
              q.is_contiguous() && scales.is_contiguous() && (bits == 4 || bits == 8),
              "linear_quantized: float32 input with ", q.size(1), " features expected");
  auto a = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = a.size(0), K = a.size(1), P = q.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = at::empty({M, N}, a.options());
  at::Tensor bias_c;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat, "linear: bias");
    bias_c = bias->contiguous();
  }
  const float* biasp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  if (M == 0) return out.view(sizes);
  if (bits == 4)
    qlinear<4>(a.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), P, N,
               out.data_ptr<float>(), biasp);
  else
    qlinear<8>(a.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), P, N,
               out.data_ptr<float>(), biasp);
  return out.view(sizes);
}

TORCH_LIBRARY(genserve_gemm, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("pack_quantized(Tensor weight, int bits) -> Tensor[]");
  m.def("dequantize(Tensor q, Tensor scales, int bits, int n) -> Tensor");
  m.def("linear_quantized(Tensor x, Tensor q, Tensor scales, int bits, int n, Tensor? bias) -> Tensor");
  m.impl("pack", c10::DispatchKey::CPU, TORCH_FN(pack));
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
  m.impl("pack_quantized", c10::DispatchKey::CPU, TORCH_FN(pack_quantized));
  m.impl("dequantize", c10::DispatchKey::CPU, TORCH_FN(dequantize));
  m.impl("linear_quantized", c10::DispatchKey::CPU, TORCH_FN(linear_quantized));
}
