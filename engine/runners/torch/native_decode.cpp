// A whole decode step of a Llama-shaped decoder in one call (native_decode.py says which
// models qualify). The compiled step spends about as long between its kernels as in them on
// a small model: ~30 inductor pieces, ~120 linear calls and 30 attention calls, each through
// Python. Here the same ATen ops the eager model runs (so the same bits: RMSNorm, rotary,
// SiLU, residual adds) and the same native linears and paged attention run back to back
// from C++.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const c10::optional<at::Tensor>& bias);
at::Tensor linear_quantized(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                            int64_t bits, int64_t N, const c10::optional<at::Tensor>& bias);
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& seq_lens, double scale,
                        int64_t window, double softcap);

namespace {

// Tensors of one layer in ``decode_step``'s list, in this order (native_decode.py).
enum Slot { IN_NORM, QKV_W, QKV_S, QKV_B, O_W, O_S, POST_NORM, GU_W, GU_S, DOWN_W, DOWN_S,
            K_CACHE, V_CACHE, LAYER_TENSORS };
// Ints of one layer: the four linears' bits (32 = fp32 panels) and the sliding window.
enum Int { QKV_BITS, O_BITS, GU_BITS, DOWN_BITS, WINDOW, LAYER_INTS };

c10::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

at::Tensor product(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                   int64_t bits, int64_t n, const at::Tensor& bias) {
  return bits == 32 ? linear(x, w, n, maybe(bias))
                    : linear_quantized(x, w, scales, bits, n, maybe(bias));
}

// transformers' LlamaRMSNorm in float32, op for op.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto variance = x.pow(2).mean(-1, true);
  return w * (x * at::rsqrt(variance + eps));
}

// apply_rotary_pos_emb for one of q/k: ``t`` [rows, heads, dim], cos/sin [rows, 1, dim].
at::Tensor rotary(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t h = t.size(-1) / 2;
  auto rotated = at::cat({-t.narrow(-1, h, h), t.narrow(-1, 0, h)}, -1);
  return t * cos + rotated * sin;
}

}  // namespace

// hidden [rows, hidden]: the step's input embeddings; cos/sin [rows, head_dim]; per layer
// LAYER_TENSORS tensors and LAYER_INTS ints; then the final norm's weight and the LM head's
// (weight, scales, bias). Empty tensors stand for absent ones. Returns logits [rows, vocab].
at::Tensor decode_step(const at::Tensor& hidden_in, const at::Tensor& cos_in,
                       const at::Tensor& sin_in, at::TensorList tensors, at::IntArrayRef ints,
                       const at::Tensor& slot_mapping, const at::Tensor& tables,
                       const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
                       int64_t head_dim, int64_t intermediate, int64_t head_bits,
                       int64_t vocab, double eps, double scale) {
  const int64_t layers = ints.size() / LAYER_INTS;
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * LAYER_TENSORS + 4 &&
                  static_cast<int64_t>(ints.size()) == layers * LAYER_INTS,
              "decode_step: ", LAYER_TENSORS, " tensors and ", LAYER_INTS,
              " ints a layer, then 4 tensors");
  const int64_t rows = hidden_in.size(0);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  auto cos = cos_in.view({rows, 1, head_dim});
  auto sin = sin_in.view({rows, 1, head_dim});
  at::Tensor hidden = hidden_in;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* t = tensors.data() + l * LAYER_TENSORS;
    const int64_t* n = ints.data() + l * LAYER_INTS;
    auto x = rms_norm(hidden, t[IN_NORM], eps);
    auto qkv = product(x, t[QKV_W], t[QKV_S], n[QKV_BITS], q_width + 2 * kv_width, t[QKV_B]);
    auto q = rotary(qkv.narrow(1, 0, q_width).view({rows, heads, head_dim}), cos, sin);
    auto k = rotary(qkv.narrow(1, q_width, kv_width).view({rows, kv_heads, head_dim}), cos, sin);
    auto v = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads, head_dim});
    t[K_CACHE].view({-1, kv_heads, head_dim}).index_copy_(0, slot_mapping, k);
    t[V_CACHE].view({-1, kv_heads, head_dim}).index_copy_(0, slot_mapping, v);
    auto attn = paged_decode(q, t[K_CACHE], t[V_CACHE], tables, seq_lens, scale, n[WINDOW], 0.0);
    hidden = hidden + product(attn.reshape({rows, q_width}), t[O_W], t[O_S], n[O_BITS],
                              hidden.size(1), at::Tensor());
    x = rms_norm(hidden, t[POST_NORM], eps);
    auto gate_up = product(x, t[GU_W], t[GU_S], n[GU_BITS], 2 * intermediate, at::Tensor());
    auto act = at::silu(gate_up.narrow(1, 0, intermediate)) *
               gate_up.narrow(1, intermediate, intermediate);
    hidden = hidden + product(act, t[DOWN_W], t[DOWN_S], n[DOWN_BITS], hidden.size(1),
                              at::Tensor());
  }
  const at::Tensor* f = tensors.data() + layers * LAYER_TENSORS;
  return product(rms_norm(hidden, f[0], eps), f[1], f[2], head_bits, vocab, f[3]);
}

TORCH_LIBRARY(genserve_decode, m) {
  m.def("decode_step(Tensor hidden, Tensor cos, Tensor sin, Tensor[] tensors, int[] ints, "
        "Tensor slot_mapping, Tensor tables, Tensor seq_lens, int heads, int kv_heads, "
        "int head_dim, int intermediate, int head_bits, int vocab, float eps, float scale) "
        "-> Tensor");
  m.impl("decode_step", c10::DispatchKey::CPU, TORCH_FN(decode_step));
}
