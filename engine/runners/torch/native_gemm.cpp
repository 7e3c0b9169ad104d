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

TORCH_LIBRARY(genserve_gemm, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.impl("pack", c10::DispatchKey::CPU, TORCH_FN(pack));
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(linear));
}
