// Fused mixture-of-experts MLP for CPU (fp32): routing groups, gate|up, SiLU * up, down
// and the weighted sum over each token's experts in one call per layer.
//
// Batch-invariant by construction: every output element is one dot product over a fixed
// number of lanes, reduced in a fixed order, with the same per-lane arithmetic whether its
// row runs in a tile of TR rows or alone. So a token's result depends on its own row, its
// experts and the weights only, never on how many other rows went to the same expert,
// how tiles fall or how many threads run.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int TR = 4;  // rows per tile
constexpr int TC = 3;  // output columns per tile (4 x 3 accumulators + 3 weights + 1 row: 16 registers)

// Sum of 8 lanes in one fixed order (the AVX2 path's: pairs, pairs of pairs, halves).
inline float reduce8(const float* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#ifdef __AVX2__
// out[r][c] = dot(x[r], w[c]) over n, for R rows: 8 lanes, lane l summing elements
// l, l + 8, ... with one FMA each, then the lanes in a fixed order. The per-lane arithmetic
// is the same for any R, so a row gets the same bits in a full tile or alone.
template <int R>
inline void dot_tile(const float* const* x, const float* const* w, int64_t n, float out[][TC]) {
  __m256 acc[R][TC];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int c = 0; c < TC; ++c) acc[r][c] = _mm256_setzero_ps();
  auto step = [&](auto load) {
    __m256 wv[TC];
#pragma GCC unroll 3
    for (int c = 0; c < TC; ++c) wv[c] = load(w[c]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xv = load(x[r]);
#pragma GCC unroll 3
      for (int c = 0; c < TC; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  };
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) step([k](const float* p) { return _mm256_loadu_ps(p + k); });
  if (k < n) {  // the tail, zero-filled: x * 0 adds nothing
    alignas(32) int32_t m[8];
    for (int l = 0; l < 8; ++l) m[l] = k + l < n ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
    step([k, mask](const float* p) { return _mm256_maskload_ps(p + k, mask); });
  }
  // each row's TC sums at once, in reduce8's order: pairs, then pairs of pairs, then halves
  static_assert(TC == 3, "the reduction below packs three columns");
  alignas(16) float sums[4];
  for (int r = 0; r < R; ++r) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]),
                                    _mm256_hadd_ps(acc[r][2], acc[r][2]));
    _mm_store_ps(sums, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    for (int c = 0; c < TC; ++c) out[r][c] = sums[c];
  }
}
#else
template <int R>
inline void dot_tile(const float* const* x, const float* const* w, int64_t n, float out[][TC]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TC; ++c) {
      float lanes[8] = {};
      for (int64_t k = 0; k < n; ++k) lanes[k % 8] += x[r][k] * w[c][k];
      out[r][c] = reduce8(lanes);
    }
}
#endif

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// For every expert e and each of its pairs q (start[e] .. start[e + 1]):
// store(q, c, dot(row(q), w_e[c])) for c < cols, w_e = w + e * cols * n ([cols, n]).
// Work items are (expert, block of RB pairs, TC columns), in parallel, columns varying
// fastest: a block's rows stay in L2 while its TC weight rows sit in L1 and the block is
// swept TR pairs at a time (then one at a time). The last column tile repeats its last
// column and drops the copy.
template <class Row, class Store>
void project(const std::vector<int64_t>& start, const float* w, int64_t cols, int64_t n,
             Row row, Store store) {
  constexpr int64_t RB = 64;
  struct Block { int64_t e, begin, end; };
  std::vector<Block> blocks;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e)
    for (int64_t q = start[e]; q < start[e + 1]; q += RB)
      blocks.push_back({e, q, std::min(q + RB, start[e + 1])});
  const int64_t col_tiles = (cols + TC - 1) / TC;
  const int64_t items = static_cast<int64_t>(blocks.size()) * col_tiles;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const Block& b = blocks[it / col_tiles];
      const int64_t c0 = (it % col_tiles) * TC;
      const float* we = w + b.e * cols * n;
      const float* wc[TC];
      for (int c = 0; c < TC; ++c) wc[c] = we + std::min<int64_t>(c0 + c, cols - 1) * n;
      const int ncols = static_cast<int>(std::min<int64_t>(TC, cols - c0));
      float out[TR][TC];
      const float* xr[TR];
      int64_t q = b.begin;
      for (; q + TR <= b.end; q += TR) {
        for (int r = 0; r < TR; ++r) xr[r] = row(q + r);
        dot_tile<TR>(xr, wc, n, out);
        for (int r = 0; r < TR; ++r)
          for (int c = 0; c < ncols; ++c) store(q + r, c0 + c, out[r][c]);
      }
      for (; q < b.end; ++q) {
        xr[0] = row(q);
        dot_tile<1>(xr, wc, n, out);
        for (int c = 0; c < ncols; ++c) store(q, c0 + c, out[0][c]);
      }
    }
  });
}

}  // namespace

// x [N, H]; weights [N, K] (fp32 routing weights); chosen [N, K] (int64 expert ids);
// w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; this rank holds experts
// first .. first + E - 1 (others contribute nothing here). Returns [N, H].
torch::Tensor fused_moe(torch::Tensor x, torch::Tensor weights, torch::Tensor chosen,
                        torch::Tensor w13, torch::Tensor w2, int64_t first) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w13.scalar_type() == torch::kFloat &&
              w2.scalar_type() == torch::kFloat && weights.scalar_type() == torch::kFloat,
              "fused_moe: float32 only");
  TORCH_CHECK(chosen.scalar_type() == torch::kLong, "fused_moe: int64 expert ids");
  x = x.contiguous();
  weights = weights.contiguous();
  chosen = chosen.contiguous();
  TORCH_CHECK(w13.is_contiguous() && w2.is_contiguous(), "fused_moe: contiguous weights");
  const int64_t N = x.size(0), H = x.size(1), K = chosen.size(1);
  const int64_t E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == H && w2.size(2) == I && w13.size(2) == H,
              "fused_moe: weight shapes");

  const int64_t* ids = chosen.data_ptr<int64_t>();
  // (token * K + slot) pairs grouped by local expert, tokens ascending within one
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t p = 0; p < N * K; ++p) {
    const int64_t e = ids[p] - first;
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> pairs(start[E]);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < N * K; ++p) {
      const int64_t e = ids[p] - first;
      if (e >= 0 && e < E) pairs[fill[e]++] = p;
    }
  }
  const int64_t P = start[E];
  auto gu = torch::empty({P, 2 * I}, x.options());        // gate|up, pair order
  auto h = torch::empty({P, I}, x.options());             // silu(gate) * up
  auto y = torch::empty({N * K, H}, x.options());         // each pair's weighted output
  const float* xp = x.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* gup = gu.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  project(start, w13.data_ptr<float>(), 2 * I, H,
          [&](int64_t q) { return xp + (pairs[q] / K) * H; },
          [&](int64_t q, int64_t c, float v) { gup[q * 2 * I + c] = v; });
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      for (int64_t j = 0; j < I; ++j)
        hp[q * I + j] = silu(gup[q * 2 * I + j]) * gup[q * 2 * I + I + j];
  });
  project(start, w2.data_ptr<float>(), H, I,
          [&](int64_t q) { return hp + q * I; },
          [&](int64_t q, int64_t c, float v) { yp[pairs[q] * H + c] = v * wp[pairs[q]]; });

  // each token's sum over its experts in ascending expert order (as HF's index_add_)
  auto out = torch::zeros({N, H}, x.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(K);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t s = 0; s < K; ++s) slots[s] = s;
      std::sort(slots.begin(), slots.end(),
                [&](int64_t a, int64_t b) { return ids[n * K + a] < ids[n * K + b]; });
      float* o = op + n * H;
      for (int64_t s : slots) {
        const int64_t e = ids[n * K + s] - first;
        if (e < 0 || e >= E) continue;
        const float* src = yp + (n * K + s) * H;
        for (int64_t c = 0; c < H; ++c) o[c] += src[c];
      }
    }
  });
  return out;
}
