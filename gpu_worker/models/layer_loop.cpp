// A decoder's layers in one call: each layer's flat program (layer_program.py) as a C++
// loop over the kernels the program calls, found through the kernel modules' kernel_abi
// (their addresses and exact types), so every layer runs the same kernels with the same
// arguments in the same order as its program, and gives its bits. What it saves is the
// Python between them: ~20 calls a layer, ~1.5 ms of a batch-1 step over 30 layers.
// The GIL is released for the loop (the grammar thread runs meanwhile); no Python object
// is touched inside it.
#include <torch/extension.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace {

// Each type this loop casts a kernel's address to, and the same type as text (what the
// kernel modules' kernel_abi must say), from one spelling
#define KERNEL_TYPE(alias, ...) \
  using alias = __VA_ARGS__;    \
  constexpr const char* alias##_TEXT = #__VA_ARGS__;
KERNEL_TYPE(Norm, torch::Tensor (*)(torch::Tensor, torch::Tensor, double))
KERNEL_TYPE(AddNorm, torch::Tensor (*)(torch::Tensor, torch::Tensor, double, torch::Tensor, double))
KERNEL_TYPE(RopeQkv, std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> (*)(torch::Tensor, torch::Tensor,
                                                                                 torch::Tensor, int64_t, int64_t))
KERNEL_TYPE(SiluMul, torch::Tensor (*)(torch::Tensor, int64_t))
KERNEL_TYPE(Linear, torch::Tensor (*)(torch::Tensor, int64_t, int64_t, torch::Tensor))
KERNEL_TYPE(Attention, std::tuple<torch::Tensor, torch::Tensor> (*)(torch::Tensor, torch::Tensor, torch::Tensor,
                                                                    torch::Tensor, torch::Tensor, torch::Tensor,
                                                                    double, int64_t, double, torch::Tensor,
                                                                    torch::Tensor, torch::Tensor))

// per layer: its tensors, integers and reals, in this order
// (a linear layer without a bias has an empty tensor for it)
enum { NORM1, QKV, QKV_BIAS, O, O_BIAS, NORM2, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, TENSORS };
enum { QKV_TYPE, QKV_N, O_TYPE, O_N, GATE_UP_TYPE, GATE_UP_N, DOWN_TYPE, DOWN_N, HEADS, KV_HEADS, INTER, WINDOW, INTS };
enum { EPS1, EPS2, SOFTCAP, REALS };

}  // namespace

// The kernels this loop calls, in the order decoder_layers takes their addresses, with
// the type it casts each to (the kernel modules' kernel_abi must say the same, spaces
// aside)
std::vector<std::tuple<std::string, std::string>> kernel_types() {
  return {{"rms_norm", Norm_TEXT},   {"add_rms_norm", AddNorm_TEXT}, {"rope_qkv", RopeQkv_TEXT},
          {"silu_mul", SiluMul_TEXT}, {"ggml_apply_packed", Linear_TEXT}, {"paged_attention", Attention_TEXT}};
}

// x [n, hidden] (the residual stream, updated in place and returned) through every layer:
// x += mlp(add_rms_norm(x, o(attention(rope(qkv(rms_norm(x)))))))), the attention
// batch-invariant (every row from the cache after the step's K/V write: tables, row_seq,
// lens, slots as InvariantStep holds them). ``weights``, ``ints``, ``reals``: each
// layer's TENSORS, INTS and REALS; ``kernels``: the addresses of kernel_types' kernels.
torch::Tensor decoder_layers(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<int64_t> ints,
                             std::vector<double> reals, std::vector<torch::Tensor> k_caches,
                             std::vector<torch::Tensor> v_caches, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor tables, torch::Tensor row_seq, torch::Tensor lens, torch::Tensor slots,
                             double scale, std::vector<int64_t> kernels) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(v_caches.size() == k_caches.size() && weights.size() == static_cast<size_t>(layers * TENSORS) &&
                  ints.size() == static_cast<size_t>(layers * INTS) &&
                  reals.size() == static_cast<size_t>(layers * REALS) && kernels.size() == kernel_types().size(),
              "decoder_layers: ", layers, " layers' caches, but other counts of weights, integers, reals or kernels");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layers: x [n, hidden], contiguous");
  const auto rms_norm = reinterpret_cast<Norm>(kernels[0]);
  const auto add_rms_norm = reinterpret_cast<AddNorm>(kernels[1]);
  const auto rope_qkv = reinterpret_cast<RopeQkv>(kernels[2]);
  const auto silu_mul = reinterpret_cast<SiluMul>(kernels[3]);
  const auto linear = reinterpret_cast<Linear>(kernels[4]);
  const auto attention = reinterpret_cast<Attention>(kernels[5]);
  const int64_t n = x.size(0);
  pybind11::gil_scoped_release unlocked;
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* w = weights.data() + i * TENSORS;
    const int64_t* d = ints.data() + i * INTS;
    const double* r = reals.data() + i * REALS;
    // x W^T (+ b), as GgmlLinear.bind's function computes it
    auto project = [&](int weight, int type, torch::Tensor in) {
      auto y = linear(w[weight], d[type], d[type + 1], in);
      return w[weight + 1].numel() ? y.add_(w[weight + 1]) : y;
    };
    auto [q, k, v] = rope_qkv(project(QKV, QKV_TYPE, rms_norm(x, w[NORM1], r[EPS1])), cos, sin, d[HEADS],
                              d[KV_HEADS]);
    auto attended = std::get<0>(attention(q, k_caches[i], v_caches[i], tables, row_seq, lens, scale, d[WINDOW],
                                          r[SOFTCAP], k, v, slots));
    auto h = add_rms_norm(x, project(O, O_TYPE, attended.view({n, -1})), 1.0, w[NORM2], r[EPS2]);
    x.add_(project(DOWN, DOWN_TYPE, silu_mul(project(GATE_UP, GATE_UP_TYPE, h), d[INTER])));
  }
  return x;
}
