#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>
#include <tuple>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CANDOR_AVX2 1
#endif

// Decode attention straight off the paged KV cache (CPU, fp32); see cpu_decode.py.
//
// q [B, H, D]; caches [NB, BS, KVH, D]; tables [B, MB] int64; lens [B] int64;
// window (0: none; else each query sees only its last `window` keys, itself included);
// softcap (0: none; else scores become softcap * tanh(score / softcap), as Gemma 2's)
//   -> (out [B, H, D], lse [B, H]).
// One sequence per task: a K pass in memory order (each token's row holds every KV
// head, so a block is read as one contiguous slab) writes scores for all query heads,
// then an exact softmax per head, then a V pass in the same order. Each KV byte comes from memory once per pass and nothing is copied; GQA
// maps query head i to KV head i / G. The log-sum-exp lets a caller merge this result
// with attention over other keys (the cascade path's shared prefix).
//
// Built with AVX2+FMA when the machine has them (cpu_decode.py names the build by ISA);
// the portable loops below are the fallback and the reference for the vector code.

namespace {

// Gemma 2's attention soft-capping, applied to the scaled scores before the softmax.
inline void soft_cap(float* s, int64_t count, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < count; ++i) s[i] = std::tanh(s[i] / cap) * cap;
}

inline const float* row(const float* cache, const int64_t* tab, int64_t t, int64_t BS, int64_t width) {
  return cache + (tab[t / BS] * BS + t % BS) * width;
}

#ifdef CANDOR_AVX2
// Rows are KVH * D floats (a few KB) in blocks scattered over the cache; the hardware
// prefetchers stop at 4 KB pages, so each pass asks for row t + AHEAD explicitly.
constexpr int64_t AHEAD = 2;
inline void prefetch_row(const float* cache, const int64_t* tab, int64_t t, int64_t n, int64_t BS,
                         int64_t width) {
  if (t >= n) return;
  const char* r = reinterpret_cast<const char*>(row(cache, tab, t, BS, width));
  for (int64_t off = 0; off < width * 4; off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for softmax inputs (x <= 0): Cody-Waite range reduction and a degree-6
// polynomial (Cephes expf), within ~2 ulp of expf. Inputs below -87 give exp(-87)
// (1.6e-38) rather than underflowing: negligible next to the row's max term, exp(0).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Walks rows lo..n-1 of a cache in memory order (a row holds every KV head) and calls
// f(t - lo, kh, x) with KV head kh's V = D / 8 vectors of row t loaded in x.
template <int V, class F>
inline void for_each_head_row(const float* cache, const int64_t* tab, int64_t lo, int64_t n,
                              int64_t BS, int64_t KVH, F&& f) {
  const int64_t width = KVH * V * 8;
  for (int64_t t = lo; t < n; ++t) {
    prefetch_row(cache, tab, t + AHEAD, n, BS, width);
    const float* r = row(cache, tab, t, BS, width);
    for (int64_t kh = 0; kh < KVH; ++kh) {
      __m256 x[V];
      for (int i = 0; i < V; ++i) x[i] = _mm256_loadu_ps(r + kh * V * 8 + i * 8);
      f(t - lo, kh, x);
    }
  }
}

// Scores of every query head against its KV head's keys lo..n-1: s[hq * m + t - lo].
template <int V>
void k_pass(const float* q, const float* kc, const int64_t* tab, int64_t lo, int64_t n, int64_t BS,
            int64_t KVH, int64_t G, float sc, float* s) {
  const int64_t m = n - lo;
  for_each_head_row<V>(kc, tab, lo, n, BS, KVH, [&](int64_t t, int64_t kh, const __m256* k) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t hq = kh * G + g;
      const float* qh = q + hq * V * 8;
      __m256 a0 = _mm256_mul_ps(k[0], _mm256_loadu_ps(qh));
      __m256 a1 = _mm256_setzero_ps();
      for (int i = 1; i < V; ++i) {
        if (i & 1) a1 = _mm256_fmadd_ps(k[i], _mm256_loadu_ps(qh + i * 8), a1);
        else a0 = _mm256_fmadd_ps(k[i], _mm256_loadu_ps(qh + i * 8), a0);
      }
      s[hq * m + t] = hsum(_mm256_add_ps(a0, a1)) * sc;
    }
  });
}

// out[hq] = sum_t p[hq, t] * v[t, hq / G], V rows in memory order with the H x D
// accumulators in L1: a strided per-head walk instead defeats the prefetchers and costs
// ~1.5x on a DRAM-resident cache.
template <int V>
void v_pass(const float* vc, const int64_t* tab, int64_t lo, int64_t n, int64_t BS, int64_t KVH,
            int64_t G, const float* p, const float* inv_sum, float* out) {
  const int64_t H = KVH * G, m = n - lo;
  std::fill(out, out + H * V * 8, 0.f);
  for_each_head_row<V>(vc, tab, lo, n, BS, KVH, [&](int64_t t, int64_t kh, const __m256* v) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t hq = kh * G + g;
      const __m256 w = _mm256_set1_ps(p[hq * m + t]);
      float* o = out + hq * V * 8;
      for (int i = 0; i < V; ++i) _mm256_storeu_ps(o + i * 8, _mm256_fmadd_ps(w, v[i], _mm256_loadu_ps(o + i * 8)));
    }
  });
  for (int64_t hq = 0; hq < H; ++hq) {
    const __m256 inv = _mm256_set1_ps(inv_sum[hq]);
    float* o = out + hq * V * 8;
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(o + i * 8, _mm256_mul_ps(_mm256_loadu_ps(o + i * 8), inv));
  }
}

// Softmax of one head's n scores in place; returns their sum (max already subtracted).
inline float softmax_row(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; t < n; ++t) sum += (s[t] = std::exp(s[t] - mx));
  return sum;
}

inline float row_max(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  float mx = hmax(m);
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

template <int V>
void decode_one(const float* q, const float* kc, const float* vc, const int64_t* tab, int64_t lo,
                int64_t n, int64_t BS, int64_t KVH, int64_t G, float sc, float cap, float* s,
                float* sum, float* out, float* lse) {
  const int64_t H = KVH * G, m = n - lo;
  k_pass<V>(q, kc, tab, lo, n, BS, KVH, G, sc, s);
  soft_cap(s, H * m, cap);
  for (int64_t hq = 0; hq < H; ++hq) {
    const float mx = row_max(s + hq * m, m);
    sum[hq] = softmax_row(s + hq * m, m, mx);
    lse[hq] = mx + std::log(sum[hq]);
    sum[hq] = 1.f / sum[hq];
  }
  v_pass<V>(vc, tab, lo, n, BS, KVH, G, s, sum, out);
}
#endif

// Portable path: any head_dim, no vector ISA assumed.
void decode_one_generic(const float* q, const float* kc, const float* vc, const int64_t* tab,
                        int64_t lo, int64_t n, int64_t BS, int64_t KVH, int64_t G, int64_t D,
                        float sc, float cap, float* s, float* sum, float* out, float* lse) {
  const int64_t H = KVH * G, width = KVH * D, m = n - lo;
  for (int64_t t = lo; t < n; ++t) {
    const float* kt = row(kc, tab, t, BS, width);
    for (int64_t hq = 0; hq < H; ++hq) {
      const float* kr = kt + (hq / G) * D;
      const float* qr = q + hq * D;
      float dot = 0.f;
      for (int64_t i = 0; i < D; ++i) dot += qr[i] * kr[i];
      s[hq * m + t - lo] = dot * sc;
    }
  }
  soft_cap(s, H * m, cap);
  for (int64_t hq = 0; hq < H; ++hq) {
    float* sh = s + hq * m;
    const float mx = *std::max_element(sh, sh + m);
    float total = 0.f;
    for (int64_t t = 0; t < m; ++t) total += (sh[t] = std::exp(sh[t] - mx));
    lse[hq] = mx + std::log(total);
    sum[hq] = 1.f / total;
  }
  std::fill(out, out + H * D, 0.f);
  for (int64_t t = lo; t < n; ++t) {
    const float* vt = row(vc, tab, t, BS, width);
    for (int64_t hq = 0; hq < H; ++hq) {
      const float* vr = vt + (hq / G) * D;
      const float p = s[hq * m + t - lo];
      float* o = out + hq * D;
      for (int64_t i = 0; i < D; ++i) o[i] += p * vr[i];
    }
  }
  for (int64_t hq = 0; hq < H; ++hq)
    for (int64_t i = 0; i < D; ++i) out[hq * D + i] *= sum[hq];
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                                                      torch::Tensor tables, torch::Tensor lens, double scale,
                                                      int64_t window, double softcap) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && kc.dtype() == torch::kFloat32 && vc.dtype() == torch::kFloat32);
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous());
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64);
  tables = tables.contiguous(); lens = lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kc.size(1), KVH = kc.size(2), MB = tables.size(1);
  TORCH_CHECK(kc.size(3) == D && H % KVH == 0 && vc.sizes() == kc.sizes());
  const int64_t G = H / KVH;
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({B, H}, q.options());
  if (B == 0) return {out, lse};
  TORCH_CHECK(lens.min().item<int64_t>() >= 1 && lens.max().item<int64_t>() <= MB * BS,
              "context length out of range");
  TORCH_CHECK(tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < kc.size(0),
              "block id out of range");
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lp[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      s.resize((n - lo) * H);
      const float* qb = qp + b * H * D;
      const int64_t* tab = tp + b * MB;
      float* ob = op + b * H * D;
      float* lb = lsep + b * H;
#ifdef CANDOR_AVX2
      if (D == 64) { decode_one<8>(qb, kp, vp, tab, lo, n, BS, KVH, G, sc, cap, s.data(), sum.data(), ob, lb); continue; }
      if (D == 128) { decode_one<16>(qb, kp, vp, tab, lo, n, BS, KVH, G, sc, cap, s.data(), sum.data(), ob, lb); continue; }
      if (D == 32) { decode_one<4>(qb, kp, vp, tab, lo, n, BS, KVH, G, sc, cap, s.data(), sum.data(), ob, lb); continue; }
      if (D == 16) { decode_one<2>(qb, kp, vp, tab, lo, n, BS, KVH, G, sc, cap, s.data(), sum.data(), ob, lb); continue; }
#endif
      decode_one_generic(qb, kp, vp, tab, lo, n, BS, KVH, G, D, sc, cap, s.data(), sum.data(), ob, lb);
    }
  });
  return {out, lse};
}
