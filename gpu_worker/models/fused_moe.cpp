// Fused mixture-of-experts MLP for CPU (fp32): routing groups, gate|up, SiLU * up, down
// and the weighted sum over each token's experts in one call per layer.
//
// Each projection runs as outer-product tiles: 16 output columns of one expert are first
// transposed into a k-major panel ([n][16], see project), so one input element times the
// 16 columns is two vector FMAs, and a tile of up to TR rows x 16 columns keeps its
// 2 * TR sums in registers, reading each weight once per tile (the dot-product tile this
// replaces needed a horizontal reduction per output and lost to MKL at prefill sizes).
//
// Batch-invariant by construction: every output element is one chain of FMAs over its
// input elements in ascending order, starting from zero, in its own vector lane. The
// chain is the same whether its row runs in a tile of TR rows or alone and whichever lane
// or thread computes it, so a token's result depends on its own row, its experts and the
// weights only, never on how many other rows went to the same expert, how tiles fall or
// how many threads run. (Built with -ffp-contract=off: the scalar code's multiplies and
// adds stay unfused wherever the compiler puts them.)
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int TR = 6;   // rows per tile at most (6 x 2 accumulators + 2 weights + 1 input)
constexpr int TC = 16;  // output columns per tile
constexpr int64_t RB = 96;  // rows per work item: they stay in L2 while its tiles sweep them

#ifdef __AVX2__
// Row i of an R-row tile, one input element: its broadcast times the two weight vectors.
template <int I, int R>
inline void fma_row(const float* x, int64_t k, __m256 w0, __m256 w1, __m256& a, __m256& b) {
  if constexpr (I < R) {
    const __m256 v = _mm256_broadcast_ss(x + k);
    a = _mm256_fmadd_ps(v, w0, a);
    b = _mm256_fmadd_ps(v, w1, b);
  }
}

// out[r][0 .. ncols) = sum over k of x[r][k] * panel[k][c], for R rows and a panel of
// 16 columns ([n][16], contiguous; ncols < 16 only in the last panel of a matrix).
template <int R>
inline void outer_tile(const float* const* x, const float* panel, int64_t n, int ncols,
                       float* const* out) {
  // named accumulators (an array of them GCC keeps in memory, storing every step)
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0,
         b3 = a0, a4 = a0, b4 = a0, a5 = a0, b5 = a0;
  const float* xs[TR];
  for (int r = 0; r < TR; ++r) xs[r] = x[r < R ? r : 0];
  const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3], *x4 = xs[4], *x5 = xs[5];
  for (int64_t k = 0; k < n; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * TC), w1 = _mm256_load_ps(panel + k * TC + 8);
    fma_row<0, R>(x0, k, w0, w1, a0, b0);
    fma_row<1, R>(x1, k, w0, w1, a1, b1);
    fma_row<2, R>(x2, k, w0, w1, a2, b2);
    fma_row<3, R>(x3, k, w0, w1, a3, b3);
    fma_row<4, R>(x4, k, w0, w1, a4, b4);
    fma_row<5, R>(x5, k, w0, w1, a5, b5);
  }
  const __m256 acc[TR][2] = {{a0, b0}, {a1, b1}, {a2, b2}, {a3, b3}, {a4, b4}, {a5, b5}};
  alignas(32) float buf[TC];
  for (int r = 0; r < R; ++r) {
    if (ncols == TC) {
      _mm256_storeu_ps(out[r], acc[r][0]);
      _mm256_storeu_ps(out[r] + 8, acc[r][1]);
      continue;
    }
    _mm256_store_ps(buf, acc[r][0]);
    _mm256_store_ps(buf + 8, acc[r][1]);
    std::copy(buf, buf + ncols, out[r]);
  }
}
#else
template <int R>
inline void outer_tile(const float* const* x, const float* panel, int64_t n, int ncols,
                       float* const* out) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < ncols; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < n; ++k) acc = std::fma(x[r][k], panel[k * TC + c], acc);
      out[r][c] = acc;
    }
}
#endif

using TileFn = void (*)(const float* const*, const float*, int64_t, int, float* const*);
constexpr TileFn TILES[TR + 1] = {nullptr, outer_tile<1>, outer_tile<2>, outer_tile<3>,
                                  outer_tile<4>, outer_tile<5>, outer_tile<6>};

#ifdef __AVX2__
// dst[k][0 .. 8) = rows[0 .. 8)[k] for k < n: eight rows of length n into n 8-lane
// groups of a panel (row stride TC); pure data movement, 8 x 8 blocks in registers.
// Each row's line 16 rows further on is prefetched as it goes: the next panel's weights
// (the next 16 weight rows lie right after these), so they stream in while this panel's
// tiles run. (Past the last expert that address is no weight; a prefetch never faults,
// and it is computed as an integer, not as a pointer past the end.)
inline void transpose_rows(const float* const* rows, int64_t n, float* dst) {
  const uintptr_t ahead = static_cast<uintptr_t>(16 * n) * sizeof(float);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    if (k % 16 == 0)
      for (int c = 0; c < 8; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(rows[c] + k) + ahead),
                     _MM_HINT_T1);
    const __m256 r0 = _mm256_loadu_ps(rows[0] + k), r1 = _mm256_loadu_ps(rows[1] + k),
                 r2 = _mm256_loadu_ps(rows[2] + k), r3 = _mm256_loadu_ps(rows[3] + k),
                 r4 = _mm256_loadu_ps(rows[4] + k), r5 = _mm256_loadu_ps(rows[5] + k),
                 r6 = _mm256_loadu_ps(rows[6] + k), r7 = _mm256_loadu_ps(rows[7] + k);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
                 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
                 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)),
                 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
                 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)),
                 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)),
                 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)),
                 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2)),
                 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)),
                 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    float* d = dst + k * TC;
    _mm256_store_ps(d + 0 * TC, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_store_ps(d + 1 * TC, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_store_ps(d + 2 * TC, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_store_ps(d + 3 * TC, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_store_ps(d + 4 * TC, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_store_ps(d + 5 * TC, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_store_ps(d + 6 * TC, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_store_ps(d + 7 * TC, _mm256_permute2f128_ps(s3, s7, 0x31));
  }
  for (; k < n; ++k)
    for (int c = 0; c < 8; ++c) dst[k * TC + c] = rows[c][k];
}
#else
inline void transpose_rows(const float* const* rows, int64_t n, float* dst) {
  for (int64_t k = 0; k < n; ++k)
    for (int c = 0; c < 8; ++c) dst[k * TC + c] = rows[c][k];
}
#endif

// For every expert e and each of its pairs q (start[e] .. start[e + 1]):
// out(q)[c] = sum over k of row(q)[k] * w_e[c][k] for c < cols, w_e = w + e * cols * n
// ([cols, n], HF's layout). Work items are (expert, block of RB pairs, 16 columns), in
// parallel, columns varying fastest. An item first transposes its 16 weight rows (16
// x n contiguous floats, read in one sequential sweep: at decode sizes the step is bound
// by streaming the experts' weights) into a k-major panel [n][16] (rows past the
// matrix's last are zeros), then cuts its block into tiles of at most TR rows, as even
// as possible (a tile's size changes no bit of its rows' results).
template <class Row, class Out>
void project(const std::vector<int64_t>& start, const float* w, int64_t cols, int64_t n,
             Row row, Out out) {
  struct Block { int64_t e, begin, end; };
  std::vector<Block> blocks;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(start.size()); ++e)
    for (int64_t q = start[e]; q < start[e + 1]; q += RB)
      blocks.push_back({e, q, std::min(q + RB, start[e + 1])});
  const int64_t col_tiles = (cols + TC - 1) / TC;
  const int64_t items = static_cast<int64_t>(blocks.size()) * col_tiles;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const float* xr[TR];
    float* outr[TR];
    const float* wr[TC];
    std::vector<float> storage(n * TC + 8), zeros(n, 0.f);
    float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 31) & ~uintptr_t(31));
    for (int64_t it = begin; it < end; ++it) {
      const Block& b = blocks[it / col_tiles];
      const int64_t c0 = (it % col_tiles) * TC;
      const int ncols = static_cast<int>(std::min<int64_t>(TC, cols - c0));
      for (int c = 0; c < TC; ++c) wr[c] = c < ncols ? w + (b.e * cols + c0 + c) * n : zeros.data();
      transpose_rows(wr, n, panel);
      transpose_rows(wr + 8, n, panel + 8);
      const int64_t rows = b.end - b.begin, tiles = (rows + TR - 1) / TR;
      int64_t q = b.begin;
      for (int64_t t = 0; t < tiles; ++t) {
        const int r = static_cast<int>((rows * (t + 1)) / tiles - (rows * t) / tiles);
        for (int i = 0; i < r; ++i) {
          xr[i] = row(q + i);
          outr[i] = out(q + i) + c0;
        }
        TILES[r](xr, panel, n, ncols, outr);
        q += r;
      }
    }
  });
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

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
          [&](int64_t q) { return gup + q * 2 * I; });
  at::parallel_for(0, P, 16, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q)
      for (int64_t j = 0; j < I; ++j)
        hp[q * I + j] = silu(gup[q * 2 * I + j]) * gup[q * 2 * I + I + j];
  });
  project(start, w2.data_ptr<float>(), H, I,
          [&](int64_t q) { return hp + q * I; },
          [&](int64_t q) { return yp + pairs[q] * H; });

  // each token's sum over its experts in ascending expert order (as HF's index_add_),
  // each expert's output scaled by its routing weight first (as HF: h * weight)
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
        const float scale = wp[n * K + s];
        for (int64_t c = 0; c < H; ++c) o[c] += src[c] * scale;
      }
    }
  });
  return out;
}
