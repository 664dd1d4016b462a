#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>

// Decode attention straight off the paged KV cache (CPU, fp32); see cpu_decode.py.
//
// q [B, H, D]; caches [NB, BS, KVH, D]; tables [B, MB] int64; lens [B] int64 -> [B, H, D].
// One sequence per task: a K pass in memory order (each token's row holds every KV
// head, so a block is read as one contiguous slab) writes scores for all query heads,
// then an exact softmax, then a V pass in the same order. Each KV byte is read from
// memory once per pass and nothing is copied; GQA maps query head i to KV head i / G.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && kc.dtype() == torch::kFloat32 && vc.dtype() == torch::kFloat32);
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous());
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64);
  tables = tables.contiguous(); lens = lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kc.size(1), KVH = kc.size(2), MB = tables.size(1);
  TORCH_CHECK(kc.size(3) == D && H % KVH == 0 && vc.sizes() == kc.sizes());
  const int64_t G = H / KVH;
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B);
  if (B == 0) return torch::empty_like(q);
  TORCH_CHECK(lens.min().item<int64_t>() >= 1 && lens.max().item<int64_t>() <= MB * BS,
              "context length out of range");
  TORCH_CHECK(tables.min().item<int64_t>() >= 0 && tables.max().item<int64_t>() < kc.size(0),
              "block id out of range");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(H * D), mx(H), sum(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = lp[b];
      s.resize(n * H);
      const int64_t* tab = tp + b * MB;
      const float* qb = qp + b * H * D;
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (int64_t t = 0; t < n; ++t) {
        const float* kt = kp + (tab[t / BS] * BS + t % BS) * KVH * D;
        float* st = s.data() + t * H;
        for (int64_t hq = 0; hq < H; ++hq) {
          const float* kr = kt + (hq / G) * D;
          const float* qr = qb + hq * D;
          float dot = 0.f;
          #pragma omp simd reduction(+:dot)
          for (int64_t i = 0; i < D; ++i) dot += qr[i] * kr[i];
          st[hq] = dot * sc;
          mx[hq] = std::max(mx[hq], st[hq]);
        }
      }
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t hq = 0; hq < H; ++hq) {
          float e = std::exp(s[t * H + hq] - mx[hq]);
          s[t * H + hq] = e;
          sum[hq] += e;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const float* vt = vp + (tab[t / BS] * BS + t % BS) * KVH * D;
        const float* st = s.data() + t * H;
        for (int64_t hq = 0; hq < H; ++hq) {
          const float* vr = vt + (hq / G) * D;
          float* a = acc.data() + hq * D;
          const float p = st[hq];
          #pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += p * vr[i];
        }
      }
      float* ob = op + b * H * D;
      for (int64_t hq = 0; hq < H; ++hq) {
        const float inv = 1.f / sum[hq];
        for (int64_t i = 0; i < D; ++i) ob[hq * D + i] = acc[hq * D + i] * inv;
      }
    }
  });
  return out;
}
