#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <map>
#include <string>
#include <algorithm>
#include <tuple>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CANDOR_AVX2 1
#endif

// Attention straight off the paged KV cache (CPU, fp32), for any query row: a decode's
// one token or each token of a prefill chunk; see cpu_kernel_backend.py.
//
// q [B, H, D]; caches [NB, BS, KVH, D]; tables [S, MB] int64; row_seq [B] int64 (row b
// reads table row_seq[b]; empty: table b); lens [B] int64 (row b attends keys
// 0..lens[b]-1 of its table: its position + 1); window (0: none; else each row sees only
// its last `window` keys, itself included); softcap (0: none; else scores become
// softcap * tanh(score / softcap), as Gemma 2's)  -> (out [B, H, D], lse [B, H]).
//
// Consecutive rows whose tables start with the same block (a prefill chunk's rows, or
// decodes sharing a cached prefix) form a tile of up to 16 rows (fewer when that leaves a
// thread without a tile); one row alone is a tile of one. A tile walks its keys in chunks
// small enough for L1 (each K or V row read once per chunk for all its rows that attend
// it), two rows at a time where their tables name the same blocks for the chunk (each
// K/V vector loaded once for both). For each row the arithmetic is fixed by its own keys alone: a K pass in key order
// writes that row's scores for all query heads (eight keys at a time: each key's dot
// product is lane-wise FMAs over the head, then one fixed add tree for its eight lanes,
// whichever of the eight slots the key lands in), then an exact softmax per head, then a
// V pass in key order (one FMA per key, from zero). Which tile a row lands in, how many
// rows share it, where its keys fall into chunks and groups and which thread runs it
// never change a row's operations or their order, so a row's result is bitwise the same
// alone or batched, as a decode or inside any prefill chunk (batch invariance: the
// deterministic mode relies on it; the build uses -ffp-contract=off so the compiler cannot
// fuse differently in different call sites). GQA maps query head i to KV head i / G. The
// log-sum-exp lets a caller merge this result with attention over other keys (the cascade
// path's shared prefix).
//
// Built with AVX2+FMA when the machine has them (cpu_extension.py names the build by ISA);
// the portable loops below are the fallback and the reference for the vector code. Where
// the build also targets AVX-512 (cpu_extension.wide_flags), a pair's two rows share
// 16-lane vectors (row a's 8 lanes low, row b's high) and the softmax takes 16 scores at a
// time: every lane does the AVX2 code's operations, so the results are the same bits.

namespace {

// Gemma 2's attention soft-capping, applied to the scaled scores before the softmax.
inline void soft_cap(float* s, int64_t count, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < count; ++i) s[i] = std::tanh(s[i] / cap) * cap;
}

inline const float* row(const float* cache, const int64_t* tab, int64_t t, int64_t BS, int64_t width) {
  return cache + (tab[t / BS] * BS + t % BS) * width;
}

// Offsets (in floats, from the cache's start) of token rows a..b-1 of a table, block by
// block: one division per call instead of one per key.
inline void key_offsets(const int64_t* tab, int64_t a, int64_t b, int64_t BS, int64_t width, int64_t* out) {
  int64_t blk = a / BS, o = a % BS;
  for (int64_t t = a; t < b; ++t) {
    out[t - a] = (tab[blk] * BS + o) * width;
    if (++o == BS) o = 0, ++blk;
  }
}

// One query row of a tile: its block table, keys lo..n-1; its scores start at s + off
// (H * (n - lo) floats).
struct RowSpan {
  const int64_t* tab;
  int64_t lo, n, off;
};

inline void key_range(const RowSpan* rs, int64_t R, int64_t& tlo, int64_t& thi) {
  tlo = rs[0].lo;
  thi = rs[0].n;
  for (int64_t i = 1; i < R; ++i) {
    tlo = std::min(tlo, rs[i].lo);
    thi = std::max(thi, rs[i].n);
  }
}

// Keys per chunk: a chunk's K (or V) rows, all heads (at least 8 keys), stay in L1 while
// every row of the tile uses them, and are read in memory order: ~16 KB, or ~32 KB for
// attend_tile_grouped, whose calls per chunk cost more to set up (measured on SmolLM2's
// shapes: 16 keys a chunk made its 2k prefill 1.15x slower than 40).
inline int64_t chunk_keys(int64_t width, bool grouped = false) {
  return std::max<int64_t>(8, (grouped ? 8192 : 4096) / width / 8 * 8);
}

#ifdef CANDOR_AVX2
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

// Lane k: the sum of a[k]'s eight lanes, always by the tree ((0+1)+(2+3)) + ((4+5)+(6+7)),
// whichever lane k lands in: eight horizontal sums for the price of about one each.
inline __m256 sum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
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

#ifdef __AVX512F__
// exp256's operations on 16 lanes (each lane's value is exp256's for it)
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Lanes of four pair accumulators (A[j]: key j's lanes, one query vector's 8 in the low
// half, the other's in the high) summed by sum8's tree ((0+1)+(2+3)) + ((4+5)+(6+7)),
// 16 lanes at a time: the low vector's four keys, then the high one's (dot2x4's order).
inline __m256 sum8_pairs(const __m512* A) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_ps(A[0], A[1], 0x88), _mm512_shuffle_ps(A[0], A[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_ps(A[2], A[3], 0x88), _mm512_shuffle_ps(A[2], A[3], 0xDD));
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x88), _mm512_shuffle_ps(s01, s23, 0xDD));
  return _mm512_castps512_ps256(
      _mm512_add_ps(_mm512_shuffle_f32x4(t, t, 0x88), _mm512_shuffle_f32x4(t, t, 0xDD)));
}
#endif

// Softmax of one head's n scores in place; returns their sum (max already subtracted).
inline float softmax_row(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
#ifdef __AVX512F__
  // sixteen at a time, the sum still eight lanes wide: the low half's eight, then the high's
  for (const __m512 m16 = _mm512_set1_ps(mx); t + 16 <= n; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m16));
    _mm512_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps(e, 1));
  }
#endif
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

#ifdef __AVX512F__
// The softmax of NH heads' n scores each (head h at s + h * n) in place: each head's max
// (over 16-lane vectors in four chains: a max is the same whatever the order) and sum
// (total[h]), each head exactly softmax_row's operations, the heads interleaved so that
// their sums' chains of dependent adds overlap (one head alone waits on each add).
template <int NH>
inline void softmax_heads(float* s, int64_t n, float* mx, float* total) {
  for (int h = 0; h < NH; ++h) {
    const float* sh = s + h * n;
    __m512 m[4];
    for (auto& v : m) v = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 64 <= n; t += 64)
      for (int i = 0; i < 4; ++i) m[i] = _mm512_max_ps(m[i], _mm512_loadu_ps(sh + t + 16 * i));
    for (; t + 16 <= n; t += 16) m[0] = _mm512_max_ps(m[0], _mm512_loadu_ps(sh + t));
    float x = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
    for (; t < n; ++t) x = std::max(x, sh[t]);
    mx[h] = x;
  }
  __m512 m16[NH];
  __m256 acc[NH];
  for (int h = 0; h < NH; ++h) m16[h] = _mm512_set1_ps(mx[h]), acc[h] = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      float* sh = s + h * n;
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sh + t), m16[h]));
      _mm512_storeu_ps(sh + t, e);
      acc[h] = _mm256_add_ps(acc[h], _mm512_castps512_ps256(e));
      acc[h] = _mm256_add_ps(acc[h], _mm512_extractf32x8_ps(e, 1));
    }
  for (int h = 0; h < NH; ++h) {
    float* sh = s + h * n;
    int64_t u = t;
    for (; u + 8 <= n; u += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sh + u), _mm512_castps512_ps256(m16[h])));
      _mm256_storeu_ps(sh + u, e);
      acc[h] = _mm256_add_ps(acc[h], e);
    }
    float sum = hsum(acc[h]);
    for (; u < n; ++u) sum += (sh[u] = std::exp(sh[u] - mx[h]));
    total[h] = sum;
  }
}
#endif

// One query head (qh) against eight keys' vectors of that head (k[0..7]): lane k is key
// k's dot product, each a lane-wise multiply then FMAs over the head in order, then sum8.
template <int V>
inline __m256 dot8(const float* qh, const float* const* k) {
  __m256 acc[8];
  const __m256 q0 = _mm256_loadu_ps(qh);
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(k[j]));
  for (int i = 1; i < V; ++i) {
    const __m256 qi = _mm256_loadu_ps(qh + i * 8);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[j] + i * 8), acc[j]);
  }
  return sum8(acc);
}

// Two query rows' head vectors (qa, qb) against four keys' vectors (k[0..3]): lanes 0-3
// are qa's dot products with keys 0-3, lanes 4-7 qb's, each by exactly dot8's operations
// (a lane's value never depends on the other lanes), with each K vector loaded once for
// both rows: loads, not FMAs, bound dot8 on a tile of many rows.
template <int V>
inline __m256 dot2x4(const float* qa, const float* qb, const float* const* k) {
  __m256 acc[8];
  {
    const __m256 a = _mm256_loadu_ps(qa), b = _mm256_loadu_ps(qb);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_loadu_ps(k[j]);
      acc[j] = _mm256_mul_ps(a, kv);
      acc[4 + j] = _mm256_mul_ps(b, kv);
    }
  }
  for (int i = 1; i < V; ++i) {
    const __m256 a = _mm256_loadu_ps(qa + i * 8), b = _mm256_loadu_ps(qb + i * 8);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = _mm256_loadu_ps(k[j] + i * 8);
      acc[j] = _mm256_fmadd_ps(a, kv, acc[j]);
      acc[4 + j] = _mm256_fmadd_ps(b, kv, acc[4 + j]);
    }
  }
  return sum8(acc);
}

// One row's scores (query head qh) for keys [a, b) of a chunk whose key offsets start at
// key c (ko[t - c]): dst[t] = score of key t.
template <int V>
inline void score_row(const float* qh, const float* base, const int64_t* ko, int64_t c, float* dst, int64_t a,
                      int64_t b, __m256 scale) {
  for (int64_t t = a; t < b; t += 8) {
    const int64_t n8 = std::min<int64_t>(8, b - t);
    const float* kp[8];
    for (int i = 0; i < 8; ++i) kp[i] = base + ko[t - c + std::min<int64_t>(i, n8 - 1)];
    const __m256 r = _mm256_mul_ps(dot8<V>(qh, kp), scale);
    if (n8 == 8) {
      _mm256_storeu_ps(dst + t, r);
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, r);
      std::copy(tmp, tmp + n8, dst + t);
    }
  }
}

// Two rows on one table (query heads qa, qb), keys [a, b) of both, four at a time.
#ifndef __AVX512F__
template <int V>
inline void score_pair(const float* qa, const float* qb, const float* base, const int64_t* ko, int64_t c,
                       float* da, float* db, int64_t a, int64_t b, __m256 scale) {
  for (int64_t t = a; t < b; t += 4) {
    const int64_t n4 = std::min<int64_t>(4, b - t);
    const float* kp[4];
    for (int i = 0; i < 4; ++i) kp[i] = base + ko[t - c + std::min<int64_t>(i, n4 - 1)];
    const __m256 r = _mm256_mul_ps(dot2x4<V>(qa, qb, kp), scale);
    if (n4 == 4) {
      _mm_storeu_ps(da + t, _mm256_castps256_ps128(r));
      _mm_storeu_ps(db + t, _mm256_extractf128_ps(r, 1));
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, r);
      std::copy(tmp, tmp + n4, da + t);
      std::copy(tmp + 4, tmp + 4 + n4, db + t);
    }
  }
}

#else
// Where the build targets AVX-512 (cpu_extension.wide_flags): the pair's two rows side by
// side in 16-lane vectors, row a's 8 lanes low and row b's high, so one FMA does both
// rows' (each K vector broadcast to both halves, each query row loaded once per call):
// every lane takes exactly dot2x4's operations (lanes never mix), then sum8 on the halves.
template <int V>
inline void score_pair(const float* qa, const float* qb, const float* base, const int64_t* ko, int64_t c,
                       float* da, float* db, int64_t a, int64_t b, __m256 scale) {
  __m512 q[V];
  for (int i = 0; i < V; ++i)
    q[i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(qa + i * 8)), _mm256_loadu_ps(qb + i * 8), 1);
  for (int64_t t = a; t < b; t += 4) {
    const int64_t n4 = std::min<int64_t>(4, b - t);
    const float* kp[4];
    for (int i = 0; i < 4; ++i) kp[i] = base + ko[t - c + std::min<int64_t>(i, n4 - 1)];
    __m512 acc[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_mul_ps(q[0], _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[j])));
#pragma GCC unroll 16
    for (int i = 1; i < V; ++i)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        acc[j] = _mm512_fmadd_ps(q[i], _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[j] + i * 8)), acc[j]);
    const __m256 r = _mm256_mul_ps(sum8_pairs(acc), scale);  // dot2x4's order: row a's keys 0-3, then row b's
    const __mmask8 keys = (1u << n4) - 1;
    _mm_mask_storeu_ps(da + t, keys, _mm256_castps256_ps128(r));
    _mm_mask_storeu_ps(db + t, keys, _mm256_extractf128_ps(r, 1));
  }
}
#endif

// o[0 .. 8N) += sum over keys t in [a, b) of p[t] * v_t, one FMA per key in key order, the
// accumulators in registers (ko[t - c]: key t's vector).
template <int N>
inline void accumulate(float* o, const float* base, const int64_t* ko, int64_t c, const float* p, int64_t a,
                       int64_t b) {
  __m256 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm256_loadu_ps(o + i * 8);
  for (int64_t t = a; t < b; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const float* v = base + ko[t - c];
    for (int i = 0; i < N; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i * 8), acc[i]);
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(o + i * 8, acc[i]);
}

// The same for two rows on one table over keys both attend (oa/pa, ob/pb): each V vector
// loaded once for both, each row's operations exactly accumulate's.
template <int N>
inline void accumulate2(float* oa, float* ob, const float* base, const int64_t* ko, int64_t c, const float* pa,
                        const float* pb, int64_t a, int64_t b) {
  __m256 xa[N], xb[N];
  for (int i = 0; i < N; ++i) xa[i] = _mm256_loadu_ps(oa + i * 8), xb[i] = _mm256_loadu_ps(ob + i * 8);
  for (int64_t t = a; t < b; ++t) {
    const __m256 wa = _mm256_set1_ps(pa[t]), wb = _mm256_set1_ps(pb[t]);
    const float* v = base + ko[t - c];
    for (int i = 0; i < N; ++i) {
      const __m256 x = _mm256_loadu_ps(v + i * 8);
      xa[i] = _mm256_fmadd_ps(wa, x, xa[i]);
      xb[i] = _mm256_fmadd_ps(wb, x, xb[i]);
    }
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(oa + i * 8, xa[i]), _mm256_storeu_ps(ob + i * 8, xb[i]);
}

// A head's V accumulators, at most eight registers at a time (lanes are independent).
template <int V>
inline void accumulate_head(float* o, const float* base, const int64_t* ko, int64_t c, const float* p, int64_t a,
                            int64_t b) {
  if constexpr (V <= 8) {
    accumulate<V>(o, base, ko, c, p, a, b);
  } else {
    accumulate<8>(o, base, ko, c, p, a, b);
    accumulate_head<V - 8>(o + 64, base + 64, ko, c, p, a, b);
  }
}

// Two rows' heads, four registers of each at a time.
#ifndef __AVX512F__
template <int V>
inline void accumulate_head2(float* oa, float* ob, const float* base, const int64_t* ko, int64_t c, const float* pa,
                             const float* pb, int64_t a, int64_t b) {
  if constexpr (V <= 4) {
    accumulate2<V>(oa, ob, base, ko, c, pa, pb, a, b);
  } else {
    accumulate2<4>(oa, ob, base, ko, c, pa, pb, a, b);
    accumulate_head2<V - 4>(oa + 32, ob + 32, base + 32, ko, c, pa, pb, a, b);
  }
}

#else
// AVX-512: both rows' whole heads in V 16-lane registers (row a low, row b high), each V
// vector broadcast to both halves: per lane accumulate's FMA per key in key order.
template <int V>
inline void accumulate_head2(float* oa, float* ob, const float* base, const int64_t* ko, int64_t c, const float* pa,
                             const float* pb, int64_t a, int64_t b) {
  __m512 acc[V];
  for (int i = 0; i < V; ++i)
    acc[i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(oa + i * 8)), _mm256_loadu_ps(ob + i * 8), 1);
  for (int64_t t = a; t < b; ++t) {
    const __m512 w = _mm512_mask_broadcastss_ps(_mm512_set1_ps(pa[t]), 0xFF00, _mm_load_ss(pb + t));
    const float* v = base + ko[t - c];
    for (int i = 0; i < V; ++i) acc[i] = _mm512_fmadd_ps(w, _mm512_broadcast_f32x8(_mm256_loadu_ps(v + i * 8)), acc[i]);
  }
  for (int i = 0; i < V; ++i) {
    _mm256_storeu_ps(oa + i * 8, _mm512_castps512_ps256(acc[i]));
    _mm256_storeu_ps(ob + i * 8, _mm512_extractf32x8_ps(acc[i], 1));
  }
}
#endif

#ifdef __AVX512F__
// GQA grouping (AVX-512, G >= 2): the G query heads of a KV head read its K and V vectors
// together, so each load feeds several FMAs and, more to the point, enough independent
// accumulators are in flight that the FMAs are not waiting on each other's latency (one
// head alone keeps 4-8 chains, half of what two FMA ports at four cycles need). Every
// lane still does exactly the operations dot8 / accumulate do for it, in the same order,
// so the results are the same bits as the one-head-at-a-time code.

// Two query vectors side by side, 8 dims of each per 16-lane vector (a's low, b's high):
// dst[i], i < V.
template <int V>
inline void pack_pair(float* dst, const float* a, const float* b) {
  for (int i = 0; i < V; ++i) {
    _mm256_storeu_ps(dst + i * 16, _mm256_loadu_ps(a + i * 8));
    _mm256_storeu_ps(dst + i * 16 + 8, _mm256_loadu_ps(b + i * 8));
  }
}

// NP packed pairs of query vectors (qp: V 16-lane vectors each, one after the other)
// against keys [a, b) of one KV head, four keys at a time: pair p's scores to da[p] (its
// low vector's) and db[p] (its high one's; none when null).
template <int V, int NP>
inline void score_packed(const float* qp, const float* base, const int64_t* ko, int64_t c, float* const* da,
                         float* const* db, int64_t a, int64_t b, __m256 scale) {
  // (the loops unrolled whole, so the accumulators stay in registers through the sums)
  for (int64_t t = a; t < b; t += 4) {
    const int64_t n4 = std::min<int64_t>(4, b - t);
    const float* kp[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) kp[i] = base + ko[t - c + std::min<int64_t>(i, n4 - 1)];
    __m512 acc[NP][4];
    {
      __m512 qv[NP];
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) qv[p] = _mm512_loadu_ps(qp + p * V * 16);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512 k = _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[j]));
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) acc[p][j] = _mm512_mul_ps(qv[p], k);
      }
    }
#pragma GCC unroll 16
    for (int i = 1; i < V; ++i) {
      __m512 qv[NP];
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) qv[p] = _mm512_loadu_ps(qp + (p * V + i) * 16);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512 k = _mm512_broadcast_f32x8(_mm256_loadu_ps(kp[j] + i * 8));
#pragma GCC unroll 4
        for (int p = 0; p < NP; ++p) acc[p][j] = _mm512_fmadd_ps(qv[p], k, acc[p][j]);
      }
    }
    const __mmask8 keys = (1u << n4) - 1;
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      const __m256 r = _mm256_mul_ps(sum8_pairs(acc[p]), scale);
      _mm_mask_storeu_ps(da[p] + t, keys, _mm256_castps256_ps128(r));
      if (db[p]) _mm_mask_storeu_ps(db[p] + t, keys, _mm256_extractf128_ps(r, 1));
    }
  }
}

// Up to three pairs (12 accumulators; the 4 keys' vectors and 3 query vectors stay in
// registers).
template <int V>
inline void score_pairs(const float* qp, int64_t np, const float* base, const int64_t* ko, int64_t c,
                        float* const* da, float* const* db, int64_t a, int64_t b, __m256 scale) {
  switch (np) {
    case 3: return score_packed<V, 3>(qp, base, ko, c, da, db, a, b, scale);
    case 2: return score_packed<V, 2>(qp, base, ko, c, da, db, a, b, scale);
    default: return score_packed<V, 1>(qp, base, ko, c, da, db, a, b, scale);
  }
}

// o[n][0 .. 16 W) += sum over keys t in [a, b) of p[n][t] * v_t for NQ query vectors n of
// one KV head: accumulate's one FMA per key in key order per lane, 16 lanes at a time,
// each V vector loaded once for all NQ.
template <int W, int NQ>
inline void accumulate_many(float* const* o, const float* const* p, const float* base, const int64_t* ko,
                            int64_t c, int64_t a, int64_t b) {
  __m512 acc[NQ][W];
#pragma GCC unroll 6
  for (int n = 0; n < NQ; ++n)
#pragma GCC unroll 4
    for (int i = 0; i < W; ++i) acc[n][i] = _mm512_loadu_ps(o[n] + i * 16);
  for (int64_t t = a; t < b; ++t) {
    const float* v = base + ko[t - c];
    __m512 x[W];
#pragma GCC unroll 4
    for (int i = 0; i < W; ++i) x[i] = _mm512_loadu_ps(v + i * 16);
#pragma GCC unroll 6
    for (int n = 0; n < NQ; ++n) {
      const __m512 w = _mm512_set1_ps(p[n][t]);
#pragma GCC unroll 4
      for (int i = 0; i < W; ++i) acc[n][i] = _mm512_fmadd_ps(w, x[i], acc[n][i]);
    }
  }
#pragma GCC unroll 6
  for (int n = 0; n < NQ; ++n)
#pragma GCC unroll 4
    for (int i = 0; i < W; ++i) _mm512_storeu_ps(o[n] + i * 16, acc[n][i]);
}

template <int W>
inline void accumulate_group(float* const* o, const float* const* p, int64_t nq, const float* base,
                             const int64_t* ko, int64_t c, int64_t a, int64_t b) {
  switch (nq) {
    case 6: return accumulate_many<W, 6>(o, p, base, ko, c, a, b);
    case 5: return accumulate_many<W, 5>(o, p, base, ko, c, a, b);
    case 4: return accumulate_many<W, 4>(o, p, base, ko, c, a, b);
    case 3: return accumulate_many<W, 3>(o, p, base, ko, c, a, b);
    case 2: return accumulate_many<W, 2>(o, p, base, ko, c, a, b);
    default: return accumulate_many<W, 1>(o, p, base, ko, c, a, b);
  }
}

// Up to six query vectors' outputs (o[n], 16 V16 dims) over keys [a, b) of one KV head,
// 64 dims at a time (at most 24 accumulators).
template <int V16>
inline void accumulate_heads(float* const* o, const float* const* p, int64_t nq, const float* base,
                             const int64_t* ko, int64_t c, int64_t a, int64_t b) {
  float* os[6];
  for (int d = 0; d < V16; d += 4) {
    for (int64_t n = 0; n < nq; ++n) os[n] = o[n] + d * 16;
    switch (std::min(4, V16 - d)) {
      case 4: accumulate_group<4>(os, p, nq, base + d * 16, ko, c, a, b); break;
      case 3: accumulate_group<3>(os, p, nq, base + d * 16, ko, c, a, b); break;
      case 2: accumulate_group<2>(os, p, nq, base + d * 16, ko, c, a, b); break;
      default: accumulate_group<1>(os, p, nq, base + d * 16, ko, c, a, b); break;
    }
  }
}
#endif

// Whether two block tables name the same blocks for keys [lo, hi).
inline bool same_blocks(const int64_t* x, const int64_t* y, int64_t lo, int64_t hi, int64_t BS) {
  if (x == y) return true;
  for (int64_t i = lo / BS; i <= (hi - 1) / BS; ++i)
    if (x[i] != y[i]) return false;
  return true;
}

// Row j of a tile within a chunk of keys [c0, c1), and row j + 1 with it (two) when its
// table names the same blocks for the keys either attends there (a prefill chunk's next
// row, or a decode on the same cached prefix): each one's keys in the chunk
// ([a, b) and [a2, b2)), the keys both attend ([both_a, both_b)), and c, the first key
// whose offset ko holds (ko[t - c]: key t's, for every key either row attends).
struct Rows {
  int64_t j;
  bool two;
  int64_t a, b, a2, b2, both_a, both_b, c;
  bool joint() const { return two && both_a < both_b; }
};

// Calls f(rows) for each row, or pair of rows on one table, of a tile with keys in
// [c0, c1), after filling ko with those keys' offsets.
template <class F>
inline void for_each_rows(const RowSpan* rs, int64_t R, int64_t c0, int64_t c1, int64_t BS, int64_t width,
                          int64_t* ko, F&& f) {
  for (int64_t j = 0; j < R;) {
    const int64_t a = std::max(c0, rs[j].lo), b = std::min(c1, rs[j].n);
    bool two = j + 1 < R;
    const int64_t a2 = two ? std::max(c0, rs[j + 1].lo) : a, b2 = two ? std::min(c1, rs[j + 1].n) : b;
    const int64_t lo = std::min(a, a2), hi = std::max(b, b2);
    two = two && (lo >= hi || same_blocks(rs[j].tab, rs[j + 1].tab, lo, hi, BS));
    const Rows r = two ? Rows{j, true, a, b, a2, b2, std::max(a, a2), std::min(b, b2), lo}
                       : Rows{j, false, a, b, a, b, a, b, a};
    const int64_t hi1 = two ? hi : b;
    if (r.c < hi1) {
      key_offsets(rs[j].tab, r.c, hi1, BS, width, ko);
      f(r);
    }
    j += two ? 2 : 1;
  }
}

// An exact softmax per row and head (the scores become weights); each row's log-sum-exp
// and the reciprocal of its sum.
inline void softmax_rows(const RowSpan* rs, int64_t R, int64_t H, float cap, float* s, float* sum, float* lse) {
  for (int64_t j = 0; j < R; ++j) {
    const int64_t m = rs[j].n - rs[j].lo;
    float* sj = s + rs[j].off;
    soft_cap(sj, H * m, cap);
#ifdef __AVX512F__
    for (int64_t h0 = 0; h0 < H; h0 += 3) {  // three heads at a time
      float mx[3], total[3];
      switch (std::min<int64_t>(3, H - h0)) {
        case 3: softmax_heads<3>(sj + h0 * m, m, mx, total); break;
        case 2: softmax_heads<2>(sj + h0 * m, m, mx, total); break;
        default: softmax_heads<1>(sj + h0 * m, m, mx, total); break;
      }
      for (int64_t i = 0; i < std::min<int64_t>(3, H - h0); ++i) {
        lse[j * H + h0 + i] = mx[i] + std::log(total[i]);
        sum[j * H + h0 + i] = 1.f / total[i];
      }
    }
#else
    for (int64_t hq = 0; hq < H; ++hq) {
      const float mx = row_max(sj + hq * m, m);
      const float total = softmax_row(sj + hq * m, m, mx);
      lse[j * H + hq] = mx + std::log(total);
      sum[j * H + hq] = 1.f / total;
    }
#endif
  }
}

// Each of n output vectors scaled by its row's 1 / sum.
template <int V>
inline void normalise(float* out, const float* sum, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const __m256 inv = _mm256_set1_ps(sum[k]);
    float* o = out + k * V * 8;
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(o + i * 8, _mm256_mul_ps(_mm256_loadu_ps(o + i * 8), inv));
  }
}

#ifdef __AVX512F__
// attend_tile with the G query heads of each KV head taken together (see "GQA grouping"):
// the same chunks, pairs and key order, the same operations per lane. qpack holds the
// tile's query vectors packed in pairs: for each row and KV head its heads two by two
// ((G + 1) / 2 pairs, the last one's high half a copy when G is odd), then for each row
// but the last, with the next row, head by head (G pairs).
template <int V>
void attend_tile_grouped(const float* q, const float* kc, const float* vc, const RowSpan* rs, int64_t R,
                         int64_t BS, int64_t KVH, int64_t G, __m256 scale, float cap, float* s, float* sum,
                         float* out, float* lse, int64_t* ko, float* qpack, int64_t tlo, int64_t thi) {
  const int64_t H = KVH * G, D = V * 8, width = KVH * D, KC = chunk_keys(width, true), NPS = (G + 1) / 2;
  const int64_t PAIR = V * 16;  // floats per packed pair
  auto scores = [&](int64_t j, int64_t hq) { return s + rs[j].off + hq * (rs[j].n - rs[j].lo) - rs[j].lo; };
  auto qrow = [&](int64_t j, int64_t hq) { return q + (j * H + hq) * D; };
  float* joint_pack = qpack + R * KVH * NPS * PAIR;
  for (int64_t j = 0; j < R; ++j)
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int64_t p = 0; p < NPS; ++p) {
        const int64_t g = kh * G + 2 * p;
        pack_pair<V>(qpack + ((j * KVH + kh) * NPS + p) * PAIR, qrow(j, g), qrow(j, std::min(g + 1, kh * G + G - 1)));
      }
      if (j + 1 < R)
        for (int64_t g = 0; g < G; ++g)
          pack_pair<V>(joint_pack + ((j * KVH + kh) * G + g) * PAIR, qrow(j, kh * G + g), qrow(j + 1, kh * G + g));
    }
  // n packed pairs from qp against keys [a, b), three at a time; dest(p, da, db) names
  // pair p's two score rows
  auto score_in_threes = [&](const float* qp, int64_t n, auto dest, const float* base, int64_t c, int64_t a,
                             int64_t b) {
    if (a >= b) return;
    for (int64_t p0 = 0; p0 < n; p0 += 3) {
      const int64_t np = std::min<int64_t>(3, n - p0);
      float *da[3], *db[3];
      for (int64_t p = 0; p < np; ++p) dest(p0 + p, da[p], db[p]);
      score_pairs<V>(qp + p0 * PAIR, np, base, ko, c, da, db, a, b, scale);
    }
  };
  // one row's heads of KV head kh (two by two; the last pair's high half unused when G is odd)
  auto score_heads = [&](int64_t j, int64_t kh, const float* base, int64_t c, int64_t a, int64_t b) {
    score_in_threes(qpack + (j * KVH + kh) * NPS * PAIR, NPS, [&](int64_t p, float*& da, float*& db) {
      const int64_t g = 2 * p;
      da = scores(j, kh * G + g);
      db = g + 1 < G ? scores(j, kh * G + g + 1) : nullptr;
    }, base, c, a, b);
  };
  // rows j and j + 1, each head of KV head kh, over keys both attend
  auto score_joint = [&](int64_t j, int64_t kh, const float* base, int64_t c, int64_t a, int64_t b) {
    score_in_threes(joint_pack + (j * KVH + kh) * G * PAIR, G, [&](int64_t g, float*& da, float*& db) {
      da = scores(j, kh * G + g);
      db = scores(j + 1, kh * G + g);
    }, base, c, a, b);
  };
  for (int64_t c0 = tlo; c0 < thi; c0 += KC)
    for_each_rows(rs, R, c0, std::min(thi, c0 + KC), BS, width, ko, [&](const Rows& r) {
      for (int64_t kh = 0; kh < KVH; ++kh) {
        const float* base = kc + kh * D;
        if (!r.joint()) {
          score_heads(r.j, kh, base, r.c, r.a, r.b);
          if (r.two) score_heads(r.j + 1, kh, base, r.c, r.a2, r.b2);
          continue;
        }
        score_joint(r.j, kh, base, r.c, r.both_a, r.both_b);
        // the keys only one of the two attends
        score_heads(r.j, kh, base, r.c, r.a, std::min(r.b, r.both_a));
        score_heads(r.j, kh, base, r.c, std::max(r.a, r.both_b), r.b);
        score_heads(r.j + 1, kh, base, r.c, r.a2, std::min(r.b2, r.both_a));
        score_heads(r.j + 1, kh, base, r.c, std::max(r.a2, r.both_b), r.b2);
      }
    });
  softmax_rows(rs, R, H, cap, s, sum, lse);
  // V pass: rows' heads (one row's, or a pair's over the keys both attend) six at a time
  auto accumulate_rows = [&](int64_t j, int64_t rows, int64_t kh, const float* base, int64_t c, int64_t a,
                             int64_t b) {
    if (a >= b) return;
    for (int64_t n0 = 0; n0 < rows * G; n0 += 6) {
      const int64_t nq = std::min<int64_t>(6, rows * G - n0);
      float* o[6];
      const float* p[6];
      for (int64_t n = 0; n < nq; ++n) {
        const int64_t row = j + (n0 + n) / G, hq = kh * G + (n0 + n) % G;
        o[n] = out + (row * H + hq) * D;
        p[n] = scores(row, hq);
      }
      accumulate_heads<V / 2>(o, p, nq, base, ko, c, a, b);
    }
  };
  std::fill(out, out + R * H * D, 0.f);
  for (int64_t c0 = tlo; c0 < thi; c0 += KC)
    for_each_rows(rs, R, c0, std::min(thi, c0 + KC), BS, width, ko, [&](const Rows& r) {
      for (int64_t kh = 0; kh < KVH; ++kh) {
        const float* base = vc + kh * D;
        if (!r.joint()) {
          accumulate_rows(r.j, 1, kh, base, r.c, r.a, r.b);
          if (r.two) accumulate_rows(r.j + 1, 1, kh, base, r.c, r.a2, r.b2);
          continue;
        }
        accumulate_rows(r.j, 1, kh, base, r.c, r.a, r.both_a);
        accumulate_rows(r.j + 1, 1, kh, base, r.c, r.a2, r.both_a);
        accumulate_rows(r.j, 2, kh, base, r.c, r.both_a, r.both_b);
        accumulate_rows(r.j, 1, kh, base, r.c, r.both_b, r.b);
        accumulate_rows(r.j + 1, 1, kh, base, r.c, r.both_b, r.b2);
      }
    });
  normalise<V>(out, sum, R * H);
}
#endif

// A tile's rows, keys in chunks: for each chunk and KV head, every row of the tile that
// attends keys of the chunk takes them (rows that share blocks read them from L1). A row
// sees its own keys in key order, whatever tile it is in and however its keys fall into
// chunks and groups of eight: its scores (each key's dot product, one per lane of dot8)
// and its V sums (one FMA per key in order, from zero) never depend on either.
template <int V>
void attend_tile(const float* q, const float* kc, const float* vc, const RowSpan* rs, int64_t R, int64_t BS,
                 int64_t KVH, int64_t G, float sc, float cap, float* s, float* sum, float* out, float* lse,
                 int64_t* ko, float* qpack) {
  const int64_t H = KVH * G, D = V * 8, width = KVH * D, KC = chunk_keys(width);
  const __m256 scale = _mm256_set1_ps(sc);
  int64_t tlo, thi;
  key_range(rs, R, tlo, thi);
  auto scores = [&](int64_t j, int64_t hq) {  // [t]: row j's score (then weight) of key t for head hq
    return s + rs[j].off + hq * (rs[j].n - rs[j].lo) - rs[j].lo;
  };
#ifdef __AVX512F__
  if constexpr (V % 2 == 0) {
    if (G >= 2) {
      attend_tile_grouped<V>(q, kc, vc, rs, R, BS, KVH, G, scale, cap, s, sum, out, lse, ko, qpack, tlo, thi);
      return;
    }
  }
#endif
  // K pass: each row's scores against its own keys; two rows on one table (a prefill
  // chunk's) take the keys both attend together.
  for (int64_t c0 = tlo; c0 < thi; c0 += KC)
    for_each_rows(rs, R, c0, std::min(thi, c0 + KC), BS, width, ko, [&](const Rows& r) {
      for (int64_t kh = 0; kh < KVH; ++kh)
        for (int64_t g = 0; g < G; ++g) {
          const float* base = kc + kh * D;
          const int64_t hq = kh * G + g;
          const float* q1 = q + (r.j * H + hq) * D;
          const float* q2 = q1 + H * D;  // row j + 1's, when r.two
          if (!r.joint()) {
            score_row<V>(q1, base, ko, r.c, scores(r.j, hq), r.a, r.b, scale);
            if (r.two) score_row<V>(q2, base, ko, r.c, scores(r.j + 1, hq), r.a2, r.b2, scale);
            continue;
          }
          float *d1 = scores(r.j, hq), *d2 = scores(r.j + 1, hq);
          score_pair<V>(q1, q2, base, ko, r.c, d1, d2, r.both_a, r.both_b, scale);
          // the keys only one of the two attends
          score_row<V>(q1, base, ko, r.c, d1, r.a, std::min(r.b, r.both_a), scale);
          score_row<V>(q1, base, ko, r.c, d1, std::max(r.a, r.both_b), r.b, scale);
          score_row<V>(q2, base, ko, r.c, d2, r.a2, std::min(r.b2, r.both_a), scale);
          score_row<V>(q2, base, ko, r.c, d2, std::max(r.a2, r.both_b), r.b2, scale);
        }
    });
  softmax_rows(rs, R, H, cap, s, sum, lse);
  // V pass: out[hq] = sum_t p[hq, t] * v[t, hq / G], in the same chunks; each row's keys
  // in key order (a pair's keys before and after those both attend, alone).
  std::fill(out, out + R * H * D, 0.f);
  for (int64_t c0 = tlo; c0 < thi; c0 += KC)
    for_each_rows(rs, R, c0, std::min(thi, c0 + KC), BS, width, ko, [&](const Rows& r) {
      for (int64_t kh = 0; kh < KVH; ++kh)
        for (int64_t g = 0; g < G; ++g) {
          const float* base = vc + kh * D;
          const int64_t hq = kh * G + g;
          float* o1 = out + (r.j * H + hq) * D;
          float* o2 = o1 + H * D;  // row j + 1's, when r.two
          const float* p1 = scores(r.j, hq);
          if (!r.joint()) {
            accumulate_head<V>(o1, base, ko, r.c, p1, r.a, r.b);
            if (r.two) accumulate_head<V>(o2, base, ko, r.c, scores(r.j + 1, hq), r.a2, r.b2);
            continue;
          }
          const float* p2 = scores(r.j + 1, hq);
          accumulate_head<V>(o1, base, ko, r.c, p1, r.a, r.both_a);
          accumulate_head<V>(o2, base, ko, r.c, p2, r.a2, r.both_a);
          accumulate_head2<V>(o1, o2, base, ko, r.c, p1, p2, r.both_a, r.both_b);
          accumulate_head<V>(o1, base, ko, r.c, p1, r.both_b, r.b);
          accumulate_head<V>(o2, base, ko, r.c, p2, r.both_b, r.b2);
        }
    });
  normalise<V>(out, sum, R * H);
}
#endif

// Portable path: any head_dim, no vector ISA assumed; the same passes in the same order.
void attend_tile_generic(const float* q, const float* kc, const float* vc, const RowSpan* rs, int64_t R,
                         int64_t BS, int64_t KVH, int64_t G, int64_t D, float sc, float cap, float* s,
                         float* sum, float* out, float* lse) {
  const int64_t H = KVH * G, width = KVH * D;
  int64_t tlo, thi;
  key_range(rs, R, tlo, thi);
  for (int64_t t = tlo; t < thi; ++t) {
    for (int64_t j = 0; j < R; ++j) {
      if (t < rs[j].lo || t >= rs[j].n) continue;
      const float* kt = row(kc, rs[j].tab, t, BS, width);
      const int64_t m = rs[j].n - rs[j].lo;
      for (int64_t hq = 0; hq < H; ++hq) {
        const float* kr = kt + (hq / G) * D;
        const float* qr = q + (j * H + hq) * D;
        float dot = 0.f;
        for (int64_t i = 0; i < D; ++i) dot += qr[i] * kr[i];
        s[rs[j].off + hq * m + t - rs[j].lo] = dot * sc;
      }
    }
  }
  for (int64_t j = 0; j < R; ++j) {
    const int64_t m = rs[j].n - rs[j].lo;
    float* sj = s + rs[j].off;
    soft_cap(sj, H * m, cap);
    for (int64_t hq = 0; hq < H; ++hq) {
      float* sh = sj + hq * m;
      const float mx = *std::max_element(sh, sh + m);
      float total = 0.f;
      for (int64_t t = 0; t < m; ++t) total += (sh[t] = std::exp(sh[t] - mx));
      lse[j * H + hq] = mx + std::log(total);
      sum[j * H + hq] = 1.f / total;
    }
  }
  std::fill(out, out + R * H * D, 0.f);
  for (int64_t t = tlo; t < thi; ++t) {
    for (int64_t j = 0; j < R; ++j) {
      if (t < rs[j].lo || t >= rs[j].n) continue;
      const float* vt = row(vc, rs[j].tab, t, BS, width);
      const int64_t m = rs[j].n - rs[j].lo;
      for (int64_t hq = 0; hq < H; ++hq) {
        const float* vr = vt + (hq / G) * D;
        const float p = s[rs[j].off + hq * m + t - rs[j].lo];
        float* o = out + (j * H + hq) * D;
        for (int64_t i = 0; i < D; ++i) o[i] += p * vr[i];
      }
    }
  }
  for (int64_t j = 0; j < R; ++j)
    for (int64_t hq = 0; hq < H; ++hq)
      for (int64_t i = 0; i < D; ++i) out[(j * H + hq) * D + i] *= sum[j * H + hq];
}

void attend(const float* q, const float* kc, const float* vc, const RowSpan* rs, int64_t R, int64_t BS,
            int64_t KVH, int64_t G, int64_t D, float sc, float cap, float* s, float* sum, float* out, float* lse,
            int64_t* ko, float* qpack) {
#ifdef CANDOR_AVX2
  switch (D) {  // the head sizes the vector code is instantiated for
    case 16: return attend_tile<2>(q, kc, vc, rs, R, BS, KVH, G, sc, cap, s, sum, out, lse, ko, qpack);
    case 32: return attend_tile<4>(q, kc, vc, rs, R, BS, KVH, G, sc, cap, s, sum, out, lse, ko, qpack);
    case 64: return attend_tile<8>(q, kc, vc, rs, R, BS, KVH, G, sc, cap, s, sum, out, lse, ko, qpack);
    case 80: return attend_tile<10>(q, kc, vc, rs, R, BS, KVH, G, sc, cap, s, sum, out, lse, ko, qpack);
    case 96: return attend_tile<12>(q, kc, vc, rs, R, BS, KVH, G, sc, cap, s, sum, out, lse, ko, qpack);
    case 128: return attend_tile<16>(q, kc, vc, rs, R, BS, KVH, G, sc, cap, s, sum, out, lse, ko, qpack);
    default: break;
  }
#endif
  attend_tile_generic(q, kc, vc, rs, R, BS, KVH, G, D, sc, cap, s, sum, out, lse);
}

// Whether every value of a contiguous CPU int64 tensor lies in [lo, hi): one plain pass.
// (Each layer calls the kernel with the step's tables; six aten reductions and .item()
// calls per call cost more than scanning the few thousand ids.)
inline bool all_within(const torch::Tensor& t, int64_t lo, int64_t hi) {
  const int64_t* p = t.data_ptr<int64_t>();
  return std::all_of(p, p + t.numel(), [&](int64_t v) { return v >= lo && v < hi; });
}

// The step's new K and V rows ([n, KVH, D], each head contiguous) stored at their
// cache slots before any row attends: the write and the attention in one call, where
// two index_copy_ calls cost more than the copy.
inline void write_rows(torch::Tensor& kc, torch::Tensor& vc, const torch::Tensor& k, const torch::Tensor& v,
                       torch::Tensor slots) {
  const int64_t BS = kc.size(1), KVH = kc.size(2), D = kc.size(3), width = KVH * D;
  TORCH_CHECK(slots.is_cpu() && slots.dtype() == torch::kInt64 && slots.dim() == 1, "slots: int64 [n]");
  slots = slots.contiguous();
  const int64_t n = slots.size(0);
  for (const torch::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->is_cpu() && t->dtype() == torch::kFloat32 && t->dim() == 3 && t->size(0) == n &&
                    t->size(1) == KVH && t->size(2) == D && t->stride(2) == 1,
                "new K/V rows: fp32 [n, kv_heads, head_dim], each head contiguous");
  }
  TORCH_CHECK(all_within(slots, 0, kc.size(0) * BS), "slot out of range");
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* kp = kc.data_ptr<float>();
  float* vp = vc.data_ptr<float>();
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < KVH; ++h) {
      std::memcpy(kp + sp[i] * width + h * D, ks + i * k.stride(0) + h * k.stride(1), D * sizeof(float));
      std::memcpy(vp + sp[i] * width + h * D, vs + i * v.stride(0) + h * v.stride(1), D * sizeof(float));
    }
}

// Rows per tile: up to 16, but few enough that every thread gets a tile.
inline int64_t tile_rows(int64_t B, int64_t threads) {
  return std::max<int64_t>(1, std::min<int64_t>(16, (B + threads - 1) / threads));
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> paged_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                                                         torch::Tensor tables, torch::Tensor row_seq,
                                                         torch::Tensor lens, double scale, int64_t window,
                                                         double softcap, torch::Tensor k_new, torch::Tensor v_new,
                                                         torch::Tensor slots) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && kc.dtype() == torch::kFloat32 && vc.dtype() == torch::kFloat32);
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous());
  TORCH_CHECK(q.is_cpu() && kc.is_cpu() && vc.is_cpu() && tables.is_cpu() && lens.is_cpu() && row_seq.is_cpu());
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64 && row_seq.dtype() == torch::kInt64);
  tables = tables.contiguous(); lens = lens.contiguous(); row_seq = row_seq.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kc.size(1), KVH = kc.size(2), S = tables.size(0), MB = tables.size(1);
  TORCH_CHECK(kc.size(3) == D && H % KVH == 0 && vc.sizes() == kc.sizes());
  const int64_t G = H / KVH;
  if (slots.numel() > 0) write_rows(kc, vc, k_new, v_new, slots);
  const bool own_tables = row_seq.numel() == 0;
  TORCH_CHECK(lens.size(0) == B && (own_tables ? S == B : row_seq.size(0) == B));
  auto out = torch::empty_like(q);
  auto lse = torch::empty({B, H}, q.options());
  if (B == 0) return {out, lse};
  TORCH_CHECK(all_within(lens, 1, MB * BS + 1), "context length out of range");
  TORCH_CHECK(all_within(tables, 0, kc.size(0)), "block id out of range");
  TORCH_CHECK(own_tables || all_within(row_seq, 0, S), "row's table out of range");
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = own_tables ? nullptr : row_seq.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  auto tab = [&](int64_t b) { return tp + (own_tables ? b : sp[b]) * MB; };

  // Tiles: runs of consecutive rows whose tables start with the same block (a prefill
  // chunk's rows, or decodes sharing a cached prefix), so they share its K/V reads.
  const int64_t threads = at::get_num_threads();
  const int64_t R = tile_rows(B, threads);
  std::vector<int64_t> starts;
  for (int64_t b = 0; b < B;) {
    starts.push_back(b);
    int64_t e = b + 1;
    while (e < B && e - b < R && tab(e)[0] == tab(b)[0]) ++e;
    b = e;
  }
  starts.push_back(B);
  const int64_t T = static_cast<int64_t>(starts.size()) - 1;
  // Tiles dealt round-robin: a chunk's late rows (long contexts) spread over the threads.
  const int64_t workers = std::min<int64_t>(T, threads);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, sum(R * H);
    std::vector<RowSpan> rs(R);
    std::vector<int64_t> ko(chunk_keys(KVH * D, true));
    // attend_tile_grouped's packed queries, on a cache line (its 16-lane loads never split)
    std::vector<float> qpack_(R * KVH * ((G + 1) / 2 + G) * 2 * D + 16);
    float* qpack = qpack_.data() + (16 - reinterpret_cast<uintptr_t>(qpack_.data()) / 4 % 16) % 16;
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t k = w; k < T; k += workers) {
        const int64_t r0 = starts[k], n_rows = starts[k + 1] - r0;
        int64_t off = 0;
        for (int64_t j = 0; j < n_rows; ++j) {
          const int64_t n = lp[r0 + j];
          const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
          rs[j] = {tab(r0 + j), lo, n, off};
          off += (n - lo) * H;
        }
        s.resize(off);
        attend(qp + r0 * H * D, kp, vp, rs.data(), n_rows, BS, KVH, G, D, sc, cap, s.data(), sum.data(),
               op + r0 * H * D, lsep + r0 * H, ko.data(), qpack);
      }
    }
  });
  return {out, lse};
}

// Where paged_attention lives and its exact type, for a C++ caller in another module
// (gpu_worker/models/layer_loop.cpp; see row_ops.cpp's kernel_abi)
#define CANDOR_KERNEL(fn, ...) {#fn, {reinterpret_cast<int64_t>(static_cast<__VA_ARGS__>(&fn)), #__VA_ARGS__}}
std::map<std::string, std::tuple<int64_t, std::string>> kernel_abi() {
  return {
      CANDOR_KERNEL(paged_attention, std::tuple<torch::Tensor, torch::Tensor> (*)(
                                         torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                                         torch::Tensor, double, int64_t, double, torch::Tensor, torch::Tensor,
                                         torch::Tensor)),
  };
}
