// Row-wise fp32 CPU ops of a decoder layer, one call each instead of a handful of torch
// ops (see row_ops.py for why). Every output row depends on its own input row only and
// is computed by the same instructions whatever the batch size, the row's position in it
// or the thread count: rows are split between threads, never a row's sum. Built with
// -ffp-contract=off, so a multiply and an add stay two roundings everywhere.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int LANES = 16;  // partial sums of a row's squares: element i goes to lane i % 16
constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;  // below this a step's rows run on one thread

// f(r) for each row r < n: split between threads only for a step of at least
// PARALLEL_ELEMENTS elements and more than one thread (an OpenMP region whose `if` is
// false still costs a team start: ~4 us per call, 0.6 ms of a batch-1 decode step)
template <class F>
inline void for_rows(int64_t n, int64_t elements, F&& f) {
#ifdef _OPENMP
  if (elements >= PARALLEL_ELEMENTS && omp_get_max_threads() > 1) {
#pragma omp parallel for
    for (int64_t r = 0; r < n; ++r) f(r);
    return;
  }
#endif
  for (int64_t r = 0; r < n; ++r) f(r);
}

// Sum of squares in a fixed order: 16 running lanes, then a fixed pairwise tree.
inline float sum_squares(const float* x, int64_t d) {
  float acc[LANES] = {0.0f};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
    for (int j = 0; j < LANES; ++j) {
      float v = x[i + j];
      acc[j] += v * v;
    }
  }
  for (int j = 0; i + j < d; ++j) {
    float v = x[i + j];
    acc[j] += v * v;
  }
  for (int width = LANES / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return acc[0];
}

// out = (x * rsqrt(mean(x^2) + eps)) * w, as HF's LlamaRMSNorm in fp32.
inline void norm_row(const float* x, const float* w, float eps, int64_t d, float* out) {
  float var = sum_squares(x, d) / static_cast<float>(d);
  float rstd = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < d; ++i) {
    float v = x[i] * rstd;
    out[i] = v * w[i];
  }
}

// exp(x) from a fixed range reduction and polynomial (Cephes' expf, within 2 ulp), as
// plain IEEE operations (min, max, floor, +, -, *, exact integer conversions): the AVX2
// loop below and this scalar form give every element the same bits, so an element's
// result never depends on where it sits (libm's scalar exp and torch's vector exp differ
// from each other in the last bit).
constexpr float EXP_LO = -87.3365447505531f, EXP_HI = 88.0f;  // 2^n stays a normal float
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float P0 = 1.9875691500e-4f, P1 = 1.3981999507e-3f, P2 = 8.3334519073e-3f,
                P3 = 4.1665795894e-2f, P4 = 1.6666665459e-1f, P5 = 5.0000001201e-1f;

inline float exp_fixed(float x) {
  x = x > EXP_LO ? x : EXP_LO;  // (as _mm256_max_ps / _mm256_min_ps, NaN included)
  x = x < EXP_HI ? x : EXP_HI;
  float fx = std::floor(x * LOG2E + 0.5f);
  float r = x - fx * LN2_HI;
  r = r - fx * LN2_LO;
  float z = r * r;
  float y = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5;
  y = y * z + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;  // 2^fx, fx in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

inline float silu_times(float g, float u) { return (g / (1.0f + exp_fixed(-g))) * u; }

// out[i] = silu(g[i]) * u[i] for i < n: 8 at a time where AVX2 is built in, the rest
// (and every element without AVX2) through the scalar form of the same operations.
inline void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 lo = _mm256_set1_ps(EXP_LO), hi = _mm256_set1_ps(EXP_HI), one = _mm256_set1_ps(1.0f);
  const __m256 half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    __m256 gv = _mm256_loadu_ps(g + i);
    __m256 x = _mm256_xor_ps(gv, sign);  // -g
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), half));
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(LN2_HI)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(LN2_LO)));
    __m256 z = _mm256_mul_ps(r, r);
    __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(P0), r), _mm256_set1_ps(P1));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(P2));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(P3));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(P4));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(P5));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), r), one);
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = silu_times(g[i], u[i]);
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat, what, ": fp32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": [rows, width] with contiguous rows");
}

// RoPE's cos or sin table of a step: [n, dim], or [n, 1, dim] as RotaryEmbedding.tables
// gives it for every layer (one row per token either way), rows contiguous
void check_table(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, what, ": fp32 CPU tables only");
  TORCH_CHECK((t.dim() == 2 || (t.dim() == 3 && t.size(1) == 1)) && t.stride(-1) == 1, what,
              ": cos/sin [n, dim] or [n, 1, dim] with contiguous rows");
}

}  // namespace

// x [a, b, d] or [a, d] (the last dim contiguous, any other strides), w [d] -> the
// normalised rows, contiguous [a * b, d].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat, "rms_norm: fp32 CPU tensors only");
  TORCH_CHECK((x.dim() == 3 || x.dim() == 2) && x.stride(-1) == 1, "rms_norm: x [a, b, d] or [a, d] with contiguous rows");
  const bool flat = x.dim() == 2;
  const int64_t a = x.size(0), b = flat ? 1 : x.size(1), d = x.size(-1), sa = x.stride(0), sb = flat ? 0 : x.stride(1);
  TORCH_CHECK(w.is_contiguous() && w.numel() == d && w.scalar_type() == torch::kFloat, "rms_norm: weight [d] fp32");
  auto out = torch::empty({a * b, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(a * b, a * b * d, [&](int64_t r) { norm_row(xp + (r / b) * sa + (r % b) * sb, wp, e, d, op + r * d); });
  return out;
}

// x += h * scale (h alone where scale is 1), in place; returns rms_norm(x, w, eps).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor h, double scale, torch::Tensor w, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(h, "add_rms_norm");
  TORCH_CHECK(x.is_contiguous() && h.sizes() == x.sizes(), "add_rms_norm: x contiguous, h of its shape");
  const int64_t n = x.size(0), d = x.size(1), sh = h.stride(0);
  TORCH_CHECK(w.is_contiguous() && w.numel() == d && w.scalar_type() == torch::kFloat,
              "add_rms_norm: weight [d] fp32");
  auto out = torch::empty({n, d}, x.options());
  float* xp = x.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps), s = static_cast<float>(scale);
  const bool scaled = scale != 1.0;
  for_rows(n, n * d, [&](int64_t r) {
    float* xr = xp + r * d;
    const float* hr = hp + r * sh;
    if (scaled) {
      for (int64_t i = 0; i < d; ++i) {
        float v = hr[i] * s;
        xr[i] = xr[i] + v;
      }
    } else {
      for (int64_t i = 0; i < d; ++i) xr[i] = xr[i] + hr[i];
    }
    norm_row(xr, wp, e, d, op + r * d);
  });
  return out;
}

// x [n, heads, dim] (last dim contiguous, any other strides), cos/sin [n, dim] or
// [n, 1, dim] (rows contiguous) -> x rotated by each row's position, contiguous [n, heads, dim]:
// x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]) (as HF).
namespace {
// out [n, heads, dim] (contiguous) = x's rows rotated (x: head h of row r at r * sn + h * sh)
void rotate_heads(const float* xp, int64_t sn, int64_t sh, int64_t n, int64_t heads, int64_t dim,
                  const torch::Tensor& cos, const torch::Tensor& sin, float* op) {
  const int64_t half = dim / 2, sc = cos.stride(0), ss = sin.stride(0);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for_rows(n, n * heads * dim, [&](int64_t r) {
    const float* c = cp + r * sc;
    const float* s = sp + r * ss;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = xp + r * sn + h * sh;
      float* o = op + (r * heads + h) * dim;
      for (int64_t i = 0; i < half; ++i) {
        float a = xr[i] * c[i];
        float b = -xr[i + half] * s[i];
        o[i] = a + b;
      }
      for (int64_t i = half; i < dim; ++i) {
        float a = xr[i] * c[i];
        float b = xr[i - half] * s[i];
        o[i] = a + b;
      }
    }
  });
}
}  // namespace

torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat, "rope: fp32 CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope: x [n, heads, even dim]");
  check_table(cos, "rope");
  check_table(sin, "rope");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.size(0) == n && cos.size(-1) == dim && sin.sizes() == cos.sizes(), "rope: cos/sin [n, dim]");
  auto out = torch::empty({n, heads, dim}, x.options());
  rotate_heads(x.data_ptr<float>(), x.stride(0), x.stride(1), n, heads, dim, cos, sin, out.data_ptr<float>());
  return out;
}

// qkv [n, (heads + 2 kv_heads) * dim] (rows contiguous, any row stride: the fused
// projection) -> (q [n, heads, dim], k [n, kv_heads, dim], v [n, kv_heads, dim]): q and
// k rotated as rope rotates them, v a view of qkv's last part: one call where splitting,
// reshaping and two rope calls took seven ops.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv(torch::Tensor qkv, torch::Tensor cos,
                                                                 torch::Tensor sin, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "rope_qkv");
  check_table(cos, "rope_qkv");
  check_table(sin, "rope_qkv");
  const int64_t n = qkv.size(0), dim = cos.size(-1);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "rope_qkv: qkv [n, (heads + 2 kv_heads) * dim]");
  TORCH_CHECK(cos.size(0) == n && sin.sizes() == cos.sizes(), "rope_qkv: cos/sin [n, dim]");
  auto q = torch::empty({n, heads, dim}, qkv.options());
  auto k = torch::empty({n, kv_heads, dim}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  rotate_heads(xp, qkv.stride(0), dim, n, heads, dim, cos, sin, q.data_ptr<float>());
  rotate_heads(xp + heads * dim, qkv.stride(0), dim, n, kv_heads, dim, cos, sin, k.data_ptr<float>());
  auto v = qkv.as_strided({n, kv_heads, dim}, {qkv.stride(0), dim, 1}, qkv.storage_offset() + (heads + kv_heads) * dim);
  return {q, k, v};
}

// gate_up [n, 2 * inter] (rows contiguous, any row stride: the fused gate|up projection)
// -> silu(gate) * up, contiguous [n, inter]; silu(g) = g / (1 + exp(-g)).
torch::Tensor silu_mul(torch::Tensor gate_up, int64_t inter) {
  check_rows(gate_up, "silu_mul");
  const int64_t n = gate_up.size(0), sg = gate_up.stride(0);
  TORCH_CHECK(gate_up.size(1) == 2 * inter, "silu_mul: gate_up [n, 2 * inter]");
  auto out = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(n, n * inter, [&](int64_t r) {
    const float* g = gp + r * sg;
    silu_mul_row(g, g + inter, op + r * inter, inter);
  });
  return out;
}

namespace {

// The largest value of x[0..n) ignoring NaN (-inf where there is none), and whether a NaN
// was seen. max is exact, so the lanes' order cannot change the value.
inline float row_max(const float* x, int64_t n, bool* nan) {
  float m = -std::numeric_limits<float>::infinity();
  bool seen_nan = false;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 mv = _mm256_set1_ps(m), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mv = _mm256_max_ps(v, mv);  // (a NaN v yields mv: ignored here, flagged above)
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  for (float lane : lanes) m = lane > m ? lane : m;
  seen_nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    if (x[i] != x[i]) seen_nan = true;
    else if (x[i] > m) m = x[i];
  }
  *nan = seen_nan;
  return m;
}

// The first index of x[0..n) holding m (m NaN: the first NaN); n when none does.
inline int64_t first_index(const float* x, int64_t n, float m) {
  const bool want_nan = m != m;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    int mask = _mm256_movemask_ps(want_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, mv, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
  }
#endif
  for (; i < n; ++i) {
    if (want_nan ? x[i] != x[i] : x[i] == m) return i;
  }
  return n;
}

}  // namespace

// logits [n, vocab] (rows contiguous, any row stride) -> (each row's max, the index of its
// first occurrence), as torch.max(dim=-1) on CPU (a NaN counts as the max: the first
// NaN's index), in two vectorised passes where torch's indexed max runs one scalar pass.
std::tuple<torch::Tensor, torch::Tensor> row_argmax(torch::Tensor logits) {
  check_rows(logits, "row_argmax");
  const int64_t n = logits.size(0), vocab = logits.size(1), sl = logits.stride(0);
  TORCH_CHECK(vocab > 0, "row_argmax: an empty row has no max");
  auto best = torch::empty({n}, logits.options());
  auto index = torch::empty({n}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  float* bp = best.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  for_rows(n, n * vocab, [&](int64_t r) {
    const float* x = lp + r * sl;
    bool nan = false;
    float m = row_max(x, vocab, &nan);
    if (nan) m = std::numeric_limits<float>::quiet_NaN();
    ip[r] = first_index(x, vocab, m);
    bp[r] = x[ip[r]];  // (equal to m; its own sign of zero, its own NaN)
  });
  return {best, index};
}

// Where the layer kernels live and their exact types (the static_cast fails to compile
// if a kernel's type changes without its string), for a C++ caller in another module:
// gpu_worker/models/layer_loop.cpp, which casts each address back only where its own
// string for the kernel is the same.
#define CANDOR_KERNEL(fn, ...) {#fn, {reinterpret_cast<int64_t>(static_cast<__VA_ARGS__>(&fn)), #__VA_ARGS__}}
std::map<std::string, std::tuple<int64_t, std::string>> kernel_abi() {
  return {
      CANDOR_KERNEL(rms_norm, torch::Tensor (*)(torch::Tensor, torch::Tensor, double)),
      CANDOR_KERNEL(add_rms_norm, torch::Tensor (*)(torch::Tensor, torch::Tensor, double, torch::Tensor, double)),
      CANDOR_KERNEL(rope_qkv, std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> (*)(
                                  torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t)),
      CANDOR_KERNEL(silu_mul, torch::Tensor (*)(torch::Tensor, int64_t)),
  };
}
