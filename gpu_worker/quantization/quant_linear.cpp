// Matmuls over weights that stay quantized: y = x W^T with W in GGML blocks (Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), group-wise int4 (GPTQ / AWQ / compressed-tensors,
// repacked at load) or FP8 e4m3 with block scales. fp32 activations and outputs.
//
// The GGML types multiply their integer codes and apply each sub-block's scale and offset
// after the sum (see "GGML: codes and scales" below). Where the CPU has AVX-512 VNNI,
// Q4_0, Q4_1 and Q8_0 (32-element blocks) go further: x too becomes integers (24 bits
// against a per-block scale, as bytes), and the codes times them are summed exactly by
// VNNI or AMX tiles ("exact integer dot products" below; 2x the float path at batch 1,
// 2.4x at 16 rows, 2x at 1024 on SmolLM2's shapes). int4 and FP8 work as follows.
// The weight is dequantized inside the matmul, a few rows at a time, never whole: a work
// item takes NR consecutive output rows (features). With few input rows (M <= MR) it
// dequantizes one block of each of its NR rows into a small buffer and multiplies it into
// register accumulators right away, so the weight streams through once (batch 1 is bound
// by that stream); with more rows it dequantizes its NR rows over the whole input width
// into a panel (L2-sized) and sweeps every MR-row tile of x over it, so each weight is
// decoded once per call whatever M is.
//
// Dequantized values are bitwise those of gguf.quants.dequantize (the same operations in
// the same order: d * q, then + m or - dmin * m, each rounded; built -ffp-contract=off).
//
// Batch-invariant by construction (the integer path: see its own note): output (m, n)
// is one chain of 8-lane FMAs over its input elements in ascending order (element k in
// lane k % 8), from zero, then a fixed lane tree. Both paths run that chain with the
// same dequantized values, whatever the tile a row lands in, the number of rows or
// threads, or which thread runs the work item; threads split output features, never a
// sum.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int MR = 3;  // input rows per tile
constexpr int NR = 4;  // output features per work item (3 x 4 accumulators + 3 x + 1 w)
constexpr int64_t ITEM_WEIGHTS = 1 << 15;  // weights per thread chunk at least

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // (exact, as the software conversion: every half is a float)
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// ---------------------------------------------------------------- GGML blocks
// Each type: BS elements per block of BYTES bytes; block(b, out) writes BS floats.

#ifdef __AVX2__
// 32 small integers (bytes of q) -> floats: out = d * q + m, d * q - m, or d * (q - c)
enum class Op { AddMin, SubMin, Center };

template <Op OP>
inline __m256 affine(__m256 q, __m256 d, __m256 m) {
  if constexpr (OP == Op::AddMin) return _mm256_add_ps(_mm256_mul_ps(d, q), m);
  else if constexpr (OP == Op::SubMin) return _mm256_sub_ps(_mm256_mul_ps(d, q), m);
  else return _mm256_mul_ps(d, _mm256_sub_ps(q, m));  // m: the centre c
}

template <Op OP>
inline void store32(__m256i q, float d, float m, float* out) {
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; ++i) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
    _mm256_storeu_ps(out + 8 * i, affine<OP>(f, dv, mv));
  }
}

// 16 bytes of nibbles -> 32 values: low nibbles first (elements 0-15), then high (16-31)
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i f = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), f), _mm_and_si128(v, f));
}

// bit i of a little-endian uint32 -> 0x10 in byte i (the fifth bits of Q5_0 / Q5_1)
inline __m256i fifth_bits(const uint8_t* qh_bytes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m256i spread = _mm256_shuffle_epi8(  // byte i <- byte i / 8 of qh
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

struct Q8_0 {
  static constexpr int BS = 32, BYTES = 34;
  static inline void block(const uint8_t* b, float* out) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
    }
  }
};

struct Q4_0 {
  static constexpr int BS = 32, BYTES = 18;
  static inline void block(const uint8_t* b, float* out) {
    store32<Op::Center>(nibbles32(b + 2), half_at(b), 8.0f, out);
  }
};

struct Q4_1 {
  static constexpr int BS = 32, BYTES = 20;
  static inline void block(const uint8_t* b, float* out) {
    store32<Op::AddMin>(nibbles32(b + 4), half_at(b), half_at(b + 2), out);
  }
};

struct Q5_0 {
  static constexpr int BS = 32, BYTES = 22;
  static inline void block(const uint8_t* b, float* out) {
    store32<Op::Center>(_mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)), half_at(b), 16.0f, out);
  }
};

struct Q5_1 {
  static constexpr int BS = 32, BYTES = 24;
  static inline void block(const uint8_t* b, float* out) {
    store32<Op::AddMin>(_mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4)), half_at(b), half_at(b + 2), out);
  }
};
#else
struct Q8_0 {
  static constexpr int BS = 32, BYTES = 34;
  static inline void block(const uint8_t* b, float* out) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
  }
};

// 4-bit halves of 16 bytes: element i < 16 is the low nibble of byte i, i >= 16 the high
// nibble of byte i - 16 (every 32-element GGML block of 4 bits)
inline void nibbles32(const uint8_t* qs, uint8_t* q) {
  for (int i = 0; i < 16; ++i) {
    q[i] = qs[i] & 0x0F;
    q[i + 16] = qs[i] >> 4;
  }
}

struct Q4_0 {
  static constexpr int BS = 32, BYTES = 18;
  static inline void block(const uint8_t* b, float* out) {
    const float d = half_at(b);
    uint8_t q[32];
    nibbles32(b + 2, q);
    for (int i = 0; i < 32; ++i) out[i] = d * (static_cast<float>(q[i]) - 8.0f);
  }
};

struct Q4_1 {
  static constexpr int BS = 32, BYTES = 20;
  static inline void block(const uint8_t* b, float* out) {
    const float d = half_at(b), m = half_at(b + 2);
    uint8_t q[32];
    nibbles32(b + 4, q);
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]) + m;
  }
};

// the fifth bits of a 32-element block, bit i of a little-endian uint32 for element i
inline void fifth_bits(const uint8_t* qh_bytes, uint8_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int i = 0; i < 32; ++i) q[i] |= static_cast<uint8_t>(((qh >> i) & 1u) << 4);
}

struct Q5_0 {
  static constexpr int BS = 32, BYTES = 22;
  static inline void block(const uint8_t* b, float* out) {
    const float d = half_at(b);
    uint8_t q[32];
    nibbles32(b + 6, q);
    fifth_bits(b + 2, q);
    for (int i = 0; i < 32; ++i) out[i] = d * (static_cast<float>(q[i]) - 16.0f);
  }
};

struct Q5_1 {
  static constexpr int BS = 32, BYTES = 24;
  static inline void block(const uint8_t* b, float* out) {
    const float d = half_at(b), m = half_at(b + 2);
    uint8_t q[32];
    nibbles32(b + 8, q);
    fifth_bits(b + 4, q);
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>(q[i]) + m;
  }
};
#endif

// Q4_K / Q5_K: eight 32-element sub-blocks, each with a 6-bit scale and min packed in 12
// bytes (sub-blocks 0-3 in the low 6 bits of bytes 0-7, 4-7 split over bytes 8-11 and
// the top 2 bits of bytes 0-7)
inline void k_scales(const uint8_t* s, float d, float dmin, float* dsub, float* dm) {
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    dsub[j] = d * static_cast<float>(sc);
    dm[j] = dmin * static_cast<float>(mn);
  }
}

#ifdef __AVX2__
// Q4_K / Q5_K: 32 bytes of qs per pair of sub-blocks (2c: low nibbles, 2c + 1: high);
// Q5_K's fifth bit of sub-block j, element i, is bit j of qh[i]
template <bool FIVE>
inline void k_block(const uint8_t* b, float* out) {
  float dsub[8], dm[8];
  k_scales(b + 4, half_at(b), half_at(b + 2), dsub, dm);
  const uint8_t* qs = b + (FIVE ? 48 : 16);
  const __m256i f = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  __m256i qh = _mm256_setzero_si256();
  if constexpr (FIVE) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  for (int c = 0; c < 4; ++c) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
    __m256i lo = _mm256_and_si256(v, f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
    if constexpr (FIVE) {
      const __m128i s0 = _mm_cvtsi32_si128(2 * c), s1 = _mm_cvtsi32_si128(2 * c + 1);
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s0), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s1), one), 4));
    }
    store32<Op::SubMin>(lo, dsub[2 * c], dm[2 * c], out + 64 * c);
    store32<Op::SubMin>(hi, dsub[2 * c + 1], dm[2 * c + 1], out + 64 * c + 32);
  }
}

struct Q4_K {
  static constexpr int BS = 256, BYTES = 144;
  static inline void block(const uint8_t* b, float* out) { k_block<false>(b, out); }
};

struct Q5_K {
  static constexpr int BS = 256, BYTES = 176;
  static inline void block(const uint8_t* b, float* out) { k_block<true>(b, out); }
};

// 32 values of q (0-63) in two 16-element sub-blocks: out = dsub * (q - 32)
inline void q6_store(__m256i q, float d0, float d1, float* out) {
  const __m256 c = _mm256_set1_ps(32.0f);
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  const __m256 ds[2] = {_mm256_set1_ps(d0), _mm256_set1_ps(d1)};
  for (int i = 0; i < 4; ++i) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
    _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(ds[i / 2], _mm256_sub_ps(f, c)));
  }
}

struct Q6_K {
  static constexpr int BS = 256, BYTES = 210;
  static inline void block(const uint8_t* b, float* out) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);  // 16 scales, one per 16
    const float d = half_at(b + 208);
    float dsub[16];
    for (int j = 0; j < 16; ++j) dsub[j] = d * static_cast<float>(sc[j]);
    const __m256i f = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {  // two halves of 128 elements: 64 bytes of ql, 32 of qh
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i low[4] = {_mm256_and_si256(l0, f), _mm256_and_si256(l1, f),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), f),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), f)};
      for (int g = 0; g < 4; ++g) {  // elements 32g .. 32g + 32 of the half
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), three);
        const __m256i q = _mm256_or_si256(low[g], _mm256_slli_epi16(high, 4));
        const int s = (128 * h + 32 * g) / 16;
        q6_store(q, dsub[s], dsub[s + 1], out + 128 * h + 32 * g);
      }
    }
  }
};
#else
struct Q4_K {
  static constexpr int BS = 256, BYTES = 144;
  static inline void block(const uint8_t* b, float* out) {
    float dsub[8], dm[8];
    k_scales(b + 4, half_at(b), half_at(b + 2), dsub, dm);
    const uint8_t* qs = b + 16;
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c low nibbles, 2c + 1 high
      const uint8_t* q = qs + 32 * c;
      float* o = out + 64 * c;
      const float d0 = dsub[2 * c], m0 = dm[2 * c], d1 = dsub[2 * c + 1], m1 = dm[2 * c + 1];
      for (int i = 0; i < 32; ++i) o[i] = d0 * static_cast<float>(q[i] & 0x0F) - m0;
      for (int i = 0; i < 32; ++i) o[32 + i] = d1 * static_cast<float>(q[i] >> 4) - m1;
    }
  }
};

struct Q5_K {
  static constexpr int BS = 256, BYTES = 176;
  static inline void block(const uint8_t* b, float* out) {
    float dsub[8], dm[8];
    k_scales(b + 4, half_at(b), half_at(b + 2), dsub, dm);
    const uint8_t* qh = b + 16;  // bit j of byte i: sub-block j, element i
    const uint8_t* qs = b + 48;
    for (int c = 0; c < 4; ++c) {
      const uint8_t* q = qs + 32 * c;
      float* o = out + 64 * c;
      const int j0 = 2 * c, j1 = 2 * c + 1;
      for (int i = 0; i < 32; ++i) {
        const int h = (qh[i] >> j0) & 1;
        o[i] = dsub[j0] * static_cast<float>((q[i] & 0x0F) | (h << 4)) - dm[j0];
      }
      for (int i = 0; i < 32; ++i) {
        const int h = (qh[i] >> j1) & 1;
        o[32 + i] = dsub[j1] * static_cast<float>((q[i] >> 4) | (h << 4)) - dm[j1];
      }
    }
  }
};

struct Q6_K {
  static constexpr int BS = 256, BYTES = 210;
  static inline void block(const uint8_t* b, float* out) {
    const uint8_t* ql = b;        // 128 bytes: low 4 bits
    const uint8_t* qh = b + 128;  // 64 bytes: high 2 bits
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);  // 16 scales, one per 16
    const float d = half_at(b + 208);
    float dsub[16];
    for (int j = 0; j < 16; ++j) dsub[j] = d * static_cast<float>(sc[j]);
    for (int h = 0; h < 2; ++h) {  // two halves of 128 elements
      const uint8_t* l = ql + 64 * h;
      const uint8_t* hb = qh + 32 * h;
      float* o = out + 128 * h;
      for (int e = 0; e < 128; ++e) {
        const int low = e < 64 ? (l[e] & 0x0F) : (l[e - 64] >> 4);
        const int high = (hb[e % 32] >> (2 * (e / 32))) & 3;
        o[e] = dsub[(128 * h + e) / 16] * (static_cast<float>(low | (high << 4)) - 32.0f);
      }
    }
  }
};
#endif

template <class T>
struct GgmlRows {  // a weight of GGML blocks: row n is row_bytes bytes
  static constexpr int BS = T::BS, BYTES = T::BYTES;
  const uint8_t* w;
  int64_t row_bytes;
  inline void operator()(int64_t n, int64_t blk, float* out) const {
    T::block(w + n * row_bytes + blk * T::BYTES, out);
  }
};

// ---------------------------------------------------------------- repacked formats

// Group-wise int4: row n holds K/2 bytes (element k in byte k / 2, the low nibble for even
// k); w = (q - zero) * scale with one (scale, zero) per ``group`` elements of a row.
struct Int4Rows {
  static constexpr int BS = 32;
  const uint8_t* qs;
  const float* scales;
  const float* zeros;
  int64_t K, groups, group;
  inline void operator()(int64_t n, int64_t blk, float* out) const {
    const uint8_t* q = qs + n * (K / 2) + blk * 16;
    const int64_t g = blk * 32 / group;  // group is a multiple of 32
    const float s = scales[n * groups + g], z = zeros[n * groups + g];
#ifdef __AVX2__
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), f = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, f), hi = _mm_and_si128(_mm_srli_epi16(v, 4), f);
    store32<Op::Center>(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)), s, z, out);
#else
    for (int i = 0; i < 16; ++i) {
      out[2 * i] = s * (static_cast<float>(q[i] & 0x0F) - z);
      out[2 * i + 1] = s * (static_cast<float>(q[i] >> 4) - z);
    }
#endif
  }
};

// FP8 e4m3fn bits -> float: the 7 low bits shifted into a float32's exponent and mantissa
// read 2^-120 times the value (normal and subnormal alike), so one exact multiply by
// 2^120 gives it (0x7F, e4m3fn's NaN, reads 480).
inline float e4m3(uint8_t v) {
  uint32_t bits = static_cast<uint32_t>(v & 0x7F) << 20;
  float f;
  std::memcpy(&f, &bits, 4);
  f *= 1.329227995784916e36f;  // 2^120
  return (v & 0x80) ? -f : f;
}

// FP8 weight [N, K] with scales [ceil(N / bn), ceil(K / bk)]: per tensor (bn = N, bk = K),
// per channel (bn = 1) or per block (128 x 128, ``weight_block_size``); bk % 32 == 0.
struct Fp8Rows {
  static constexpr int BS = 32;
  const uint8_t* w;
  const float* scales;
  int64_t K, scale_cols, bn, bk;
  inline void operator()(int64_t n, int64_t blk, float* out) const {
    const uint8_t* q = w + n * K + blk * 32;
    const float s = scales[(n / bn) * scale_cols + blk * 32 / bk];
#ifdef __AVX2__
    const __m256 sv = _mm256_set1_ps(s), two120 = _mm256_set1_ps(1.329227995784916e36f);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)));
      const __m256 mag = _mm256_mul_ps(
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20)), two120);
      const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24));
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_or_ps(mag, sign), sv));
    }
#else
    for (int i = 0; i < 32; ++i) out[i] = e4m3(q[i]) * s;
#endif
  }
};

// ---------------------------------------------------------------- the tile

#ifdef __AVX2__
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {  // fixed tree: (l0 + l4, l1 + l5, ...), then pairs
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#else
struct Vec {
  float l[8];
};
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec v;
  std::memcpy(v.l, p, sizeof v.l);
  return v;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < 8; ++i) c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
inline float vsum(Vec v) {  // the same tree as the AVX2 one
  float s[4], t[2];
  for (int i = 0; i < 4; ++i) s[i] = v.l[i] + v.l[i + 4];
  t[0] = s[0] + s[2];
  t[1] = s[1] + s[3];
  return t[0] + t[1];
}
#endif

// acc[r][j] += x[r][k .. k + len) * w[j][k .. k + len), 8 lanes, k ascending (len % 8 == 0;
// x rows and w rows are already offset to the first element)
template <int R>
inline void tile_fma(const float* const* x, const float* const* w, int64_t len, Vec (&acc)[MR][NR]) {
  for (int64_t k = 0; k < len; k += 8) {
    Vec xv[MR];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) xv[r] = vload(x[r] + k);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const Vec wv = vload(w[j] + k);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) acc[r][j] = vfma(xv[r], wv, acc[r][j]);
    }
  }
}

template <int R>
inline void tile_store(Vec (&acc)[MR][NR], int nvalid, float* const* y, int64_t n0) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nvalid; ++j) y[r][n0 + j] = vsum(acc[r][j]);
}

inline void zero_acc(Vec (&acc)[MR][NR]) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = vzero();
}

// Few rows: one block of each of the NR rows at a time, straight into the accumulators.
template <class D, int R>
void few_rows(const D& deq, const float* x, int64_t ldx, int64_t K, int64_t n0, int nvalid,
              float* y, int64_t ldy) {
  alignas(32) float buf[NR][D::BS];
  const float* xr[MR];
  float* yr[MR];
  for (int r = 0; r < MR; ++r) {
    xr[r] = x + (r < R ? r : 0) * ldx;
    yr[r] = y + (r < R ? r : 0) * ldy;
  }
  const float* wr[NR];
  for (int j = 0; j < NR; ++j) wr[j] = buf[j];
  Vec acc[MR][NR];
  zero_acc(acc);
  const int64_t nb = K / D::BS;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < NR; ++j) deq(n0 + std::min(j, nvalid - 1), b, buf[j]);
    const float* xb[MR];
    for (int r = 0; r < MR; ++r) xb[r] = xr[r] + b * D::BS;
    tile_fma<R>(xb, wr, D::BS, acc);
  }
  tile_store<R>(acc, nvalid, yr, n0);
}

template <int R>
void panel_tile(const float* x, int64_t ldx, const float* const* wr, int64_t K, int64_t n0, int nvalid,
                float* y, int64_t ldy) {
  const float* xr[MR];
  float* yr[MR];
  for (int r = 0; r < MR; ++r) {
    xr[r] = x + (r < R ? r : 0) * ldx;
    yr[r] = y + (r < R ? r : 0) * ldy;
  }
  Vec acc[MR][NR];
  zero_acc(acc);
  tile_fma<R>(xr, wr, K, acc);
  tile_store<R>(acc, nvalid, yr, n0);
}

template <class D>
void linear(const D& deq, const float* x, int64_t M, int64_t K, int64_t N, float* y, int64_t ldy) {
  if (M == 0 || N == 0) return;
  const int64_t items = (N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, ITEM_WEIGHTS / (NR * K));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> panel;
    if (M > MR) panel.resize(NR * K);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = item * NR;
      const int nvalid = static_cast<int>(std::min<int64_t>(NR, N - n0));
      if (M <= MR) {
        if (M == 1) few_rows<D, 1>(deq, x, K, K, n0, nvalid, y, ldy);
        else if (M == 2) few_rows<D, 2>(deq, x, K, K, n0, nvalid, y, ldy);
        else few_rows<D, 3>(deq, x, K, K, n0, nvalid, y, ldy);
        continue;
      }
      const int64_t nb = K / D::BS;
      const float* wr[NR];
      for (int j = 0; j < NR; ++j) {
        float* row = panel.data() + j * K;
        wr[j] = row;
        const int64_t n = n0 + std::min(j, nvalid - 1);
        for (int64_t b = 0; b < nb; ++b) deq(n, b, row + b * D::BS);
      }
      int64_t m = 0;
      for (; m + MR <= M; m += MR) panel_tile<MR>(x + m * K, K, wr, K, n0, nvalid, y + m * ldy, ldy);
      if (M - m == 2) panel_tile<2>(x + m * K, K, wr, K, n0, nvalid, y + m * ldy, ldy);
      else if (M - m == 1) panel_tile<1>(x + m * K, K, wr, K, n0, nvalid, y + m * ldy, ldy);
    }
  });
}

template <class D>
torch::Tensor dequantize_rows(const D& deq, int64_t N, int64_t K) {
  auto out = torch::empty({N, K}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  const int64_t nb = K / D::BS;
  at::parallel_for(0, N, std::max<int64_t>(1, ITEM_WEIGHTS / K), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) deq(n, b, o + n * K + b * D::BS);
  });
  return out;
}

// ---------------------------------------------------------------- GGML: codes and scales
// The GGML types' matmul reads each sub-block of SB weights as w = a * q + c: q the small
// integer codes the block stores, a and c the sub-block's scale and offset exactly as
// gguf.quants computes them (Q4_1: d and m; Q4_0: d and -8d; Q4_K: d * sc and -dmin * m;
// Q6_K: d * sc and -32 d * sc; Q8_0: d, no offset). It sums
//     y = sum over sub-blocks of  a * (x . q) + c * (sum of x)
// (llama.cpp's factoring) instead of multiplying dequantized weights: converting a code
// to a float is one instruction where dequantizing it is three more, and batch 1 was
// bound by that, not by reading the weights (28 ms of a 33 ms step on SmolLM2's Q4_1).
// The values differ from the dequantized product's by float rounding (the tests hold both
// to float64's product).
//
// Batch-invariant as the other kernels: output (m, n) is the fixed lane tree of one chain
// of LANES-wide FMAs of x and the scaled codes a * q (each one rounded product) in
// ascending k from zero, plus the offsets: fma(c, s, .) over the sub-blocks in ascending
// order from zero, s the lanes of x's sub-block summed in a fixed order. Few rows compute
// it from the codes in registers, many rows from a panel holding the same scaled codes:
// the same operations either way.

// The codes kernels' vectors: 16 lanes where the compiler targets AVX-512 (kernels.py
// adds its flags where torch found it), else the 8 lanes of Vec. The lane count is part
// of the summation order, so of the bits: one machine's binary gives one answer.
#ifdef __AVX512F__
constexpr int LANES = 16;
using CV = __m512;
inline CV cv_zero() { return _mm512_setzero_ps(); }
inline CV cv_load(const float* p) { return _mm512_loadu_ps(p); }
inline CV cv_fma(CV a, CV b, CV c) { return _mm512_fmadd_ps(a, b, c); }
inline CV cv_add(CV a, CV b) { return _mm512_add_ps(a, b); }
inline CV cv_mul(CV a, CV b) { return _mm512_mul_ps(a, b); }
inline CV cv_set1(float v) { return _mm512_set1_ps(v); }
inline void cv_store(float* p, CV v) { _mm512_storeu_ps(p, v); }
template <bool SIGNED>
inline CV cv_codes(const uint8_t* q) {  // 16 codes -> 16 floats
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}
inline float cv_sum(CV v) {  // fixed tree: halves added lane by lane, then Vec's tree
  return vsum(_mm256_add_ps(_mm512_castps512_ps256(v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}
#else
constexpr int LANES = 8;
using CV = Vec;
inline CV cv_zero() { return vzero(); }
inline CV cv_load(const float* p) { return vload(p); }
inline CV cv_fma(CV a, CV b, CV c) { return vfma(a, b, c); }
inline float cv_sum(CV v) { return vsum(v); }
#ifdef __AVX2__
inline CV cv_add(CV a, CV b) { return _mm256_add_ps(a, b); }
inline CV cv_mul(CV a, CV b) { return _mm256_mul_ps(a, b); }
inline CV cv_set1(float v) { return _mm256_set1_ps(v); }
inline void cv_store(float* p, CV v) { _mm256_storeu_ps(p, v); }
template <bool SIGNED>
inline CV cv_codes(const uint8_t* q) {  // 8 codes -> 8 floats
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}
#else
inline CV cv_add(CV a, CV b) {
  for (int i = 0; i < 8; ++i) a.l[i] += b.l[i];
  return a;
}
inline CV cv_mul(CV a, CV b) {
  for (int i = 0; i < 8; ++i) a.l[i] *= b.l[i];
  return a;
}
inline CV cv_set1(float v) {
  CV r;
  for (int i = 0; i < 8; ++i) r.l[i] = v;
  return r;
}
inline void cv_store(float* p, CV v) { std::memcpy(p, v.l, sizeof v.l); }
template <bool SIGNED>
inline CV cv_codes(const uint8_t* q) {
  CV r;
  for (int i = 0; i < 8; ++i)
    r.l[i] = SIGNED ? static_cast<float>(static_cast<int8_t>(q[i])) : static_cast<float>(q[i]);
  return r;
}
#endif
#endif

// Each type: BS elements per block of BYTES bytes, sub-blocks of SB; codes(b, q, a, c)
// writes the block's BS codes (bytes; int8 where SIGNED) and each sub-block's a and c.
#ifdef __AVX2__
inline void put32(uint8_t* q, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v); }
#else
inline void put32(uint8_t* q, const uint8_t* v) { std::memcpy(q, v, 32); }
// (the scalar nibbles32 / fifth_bits write into a buffer)
#endif

// Codes straight into registers (DIRECT types: no buffer) where the vectors are wide
// enough: 16 bytes of nibbles as elements 0-15 (low nibbles) and 16-31 (high), or LANES
// bytes of a sub-block's low or high nibbles.
#ifdef __AVX2__
constexpr bool DIRECT_CODES = true;
#ifdef __AVX512F__
inline void nibble_vecs(const uint8_t* qs, CV* qf) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i f = _mm512_set1_epi32(0x0F);
  qf[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, f));
  qf[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
template <bool HIGH>
inline CV half_bytes(const uint8_t* q) {  // LANES bytes -> their low (or high) nibbles
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_cvtepi32_ps(HIGH ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
}
#else
inline void nibble_vecs(const uint8_t* qs, CV* qf) {
  const __m256i f = _mm256_set1_epi32(0x0F);
  const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  qf[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, f));
  qf[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, f));
  qf[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
  qf[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}
template <bool HIGH>
inline CV half_bytes(const uint8_t* q) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  return _mm256_cvtepi32_ps(HIGH ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
}
#endif
#else
constexpr bool DIRECT_CODES = false;
inline void nibble_vecs(const uint8_t*, CV*) {}
template <bool HIGH>
inline CV half_bytes(const uint8_t*) { return cv_zero(); }
#endif

struct Q4_0c {
  static constexpr int BS = 32, BYTES = 18, SB = 32;
  static constexpr bool HAS_C = true, SIGNED = false, DIRECT = DIRECT_CODES;
  static constexpr int MIN_AT = -1;  // (gather_coefs: no stored min; c = C_OF_A * a)
  static constexpr float C_OF_A = -8.0f;
  static inline void codes(const uint8_t* b, uint8_t* q, float* a, float* c) {
    const float d = half_at(b);
#ifdef __AVX2__
    put32(q, nibbles32(b + 2));
#else
    nibbles32(b + 2, q);
#endif
    a[0] = d;
    c[0] = -8.0f * d;
  }
  static inline void coefs(const uint8_t* b, float* a, float* c) {
    a[0] = half_at(b);
    c[0] = -8.0f * a[0];
  }
  static inline void vecs(const uint8_t* b, int, CV* qf) { nibble_vecs(b + 2, qf); }
};

struct Q4_1c {
  static constexpr int BS = 32, BYTES = 20, SB = 32;
  static constexpr bool HAS_C = true, SIGNED = false, DIRECT = DIRECT_CODES;
  static constexpr int MIN_AT = 2;  // (gather_coefs: c is the half after a)
  static inline void codes(const uint8_t* b, uint8_t* q, float* a, float* c) {
#ifdef __AVX2__
    put32(q, nibbles32(b + 4));
#else
    nibbles32(b + 4, q);
#endif
    a[0] = half_at(b);
    c[0] = half_at(b + 2);
  }
  static inline void coefs(const uint8_t* b, float* a, float* c) {
    a[0] = half_at(b);
    c[0] = half_at(b + 2);
  }
  static inline void vecs(const uint8_t* b, int, CV* qf) { nibble_vecs(b + 4, qf); }
};

struct Q5_0c {
  static constexpr int BS = 32, BYTES = 22, SB = 32;
  static constexpr bool HAS_C = true, SIGNED = false, DIRECT = false;
  static inline void codes(const uint8_t* b, uint8_t* q, float* a, float* c) {
    const float d = half_at(b);
#ifdef __AVX2__
    put32(q, _mm256_or_si256(nibbles32(b + 6), fifth_bits(b + 2)));
#else
    nibbles32(b + 6, q);
    fifth_bits(b + 2, q);
#endif
    a[0] = d;
    c[0] = -16.0f * d;
  }
};

struct Q5_1c {
  static constexpr int BS = 32, BYTES = 24, SB = 32;
  static constexpr bool HAS_C = true, SIGNED = false, DIRECT = false;
  static inline void codes(const uint8_t* b, uint8_t* q, float* a, float* c) {
#ifdef __AVX2__
    put32(q, _mm256_or_si256(nibbles32(b + 8), fifth_bits(b + 4)));
#else
    nibbles32(b + 8, q);
    fifth_bits(b + 4, q);
#endif
    a[0] = half_at(b);
    c[0] = half_at(b + 2);
  }
};

struct Q8_0c {
  static constexpr int BS = 32, BYTES = 34, SB = 32;
  static constexpr bool HAS_C = false, SIGNED = true, DIRECT = true;
  static constexpr int MIN_AT = -1;  // (gather_coefs: no c)
  static inline void codes(const uint8_t* b, uint8_t* q, float* a, float*) {
    std::memcpy(q, b + 2, 32);
    a[0] = half_at(b);
  }
  static inline void coefs(const uint8_t* b, float* a, float*) { a[0] = half_at(b); }
  static inline void vecs(const uint8_t* b, int, CV* qf) {
    for (int g = 0; g < 32 / LANES; ++g) qf[g] = cv_codes<true>(b + 2 + LANES * g);
  }
};

// Q4_K / Q5_K: eight sub-blocks of 32; bytes 32c .. 32c + 32 of qs hold sub-block 2c in
// their low nibbles and 2c + 1 in their high ones (Q5_K: the fifth bit of sub-block j,
// element i, is bit j of qh[i])
template <bool FIVE>
struct KQuant {
  static constexpr int BS = 256, BYTES = FIVE ? 176 : 144, SB = 32;
  static constexpr bool HAS_C = true, SIGNED = false, DIRECT = DIRECT_CODES && !FIVE;
  static inline void coefs(const uint8_t* b, float* a, float* c) {
    float dm[8];
    k_scales(b + 4, half_at(b), half_at(b + 2), a, dm);
    for (int j = 0; j < 8; ++j) c[j] = -dm[j];
  }
  static inline void vecs(const uint8_t* b, int s, CV* qf) {  // (Q4_K)
    const uint8_t* q = b + 16 + 32 * (s / 2);
    for (int g = 0; g < 32 / LANES; ++g) qf[g] = (s & 1) ? half_bytes<true>(q + LANES * g) : half_bytes<false>(q + LANES * g);
  }
  static inline void codes(const uint8_t* b, uint8_t* q, float* a, float* c) {
    float dm[8];
    k_scales(b + 4, half_at(b), half_at(b + 2), a, dm);
    for (int j = 0; j < 8; ++j) c[j] = -dm[j];
    const uint8_t* qs = b + (FIVE ? 48 : 16);
#ifdef __AVX2__
    const __m256i f = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256i qh = _mm256_setzero_si256();
    if constexpr (FIVE) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * k));
      __m256i lo = _mm256_and_si256(v, f), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), f);
      if constexpr (FIVE) {
        const __m128i s0 = _mm_cvtsi32_si128(2 * k), s1 = _mm_cvtsi32_si128(2 * k + 1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s0), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s1), one), 4));
      }
      put32(q + 64 * k, lo);
      put32(q + 64 * k + 32, hi);
    }
#else
    const uint8_t* qh = b + 16;
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 32; ++i) {
        const uint8_t v = qs[32 * k + i];
        q[64 * k + i] = static_cast<uint8_t>((v & 0x0F) | (FIVE ? ((qh[i] >> (2 * k)) & 1) << 4 : 0));
        q[64 * k + 32 + i] = static_cast<uint8_t>((v >> 4) | (FIVE ? ((qh[i] >> (2 * k + 1)) & 1) << 4 : 0));
      }
#endif
  }
};
using Q4_Kc = KQuant<false>;
using Q5_Kc = KQuant<true>;

// Q6_K: sixteen sub-blocks of 16, codes 0-63 (w = d * sc * (q - 32)); element e of half
// h: low 4 bits from ql (byte e % 64 of the half, high nibble for e >= 64), top 2 bits
// from bits 2 (e / 32) of qh byte e % 32
struct Q6_Kc {
  static constexpr int BS = 256, BYTES = 210, SB = 16;
  static constexpr bool HAS_C = true, SIGNED = false, DIRECT = false;
  static inline void codes(const uint8_t* b, uint8_t* q, float* a, float* c) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int j = 0; j < 16; ++j) {
      a[j] = d * static_cast<float>(sc[j]);
      c[j] = -32.0f * a[j];
    }
#ifdef __AVX2__
    const __m256i f = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i low[4] = {_mm256_and_si256(l0, f), _mm256_and_si256(l1, f),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), f),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), f)};
      for (int g = 0; g < 4; ++g) {
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g)), three);
        put32(q + 128 * h + 32 * g, _mm256_or_si256(low[g], _mm256_slli_epi16(high, 4)));
      }
    }
#else
    for (int h = 0; h < 2; ++h) {
      const uint8_t* l = b + 64 * h;
      const uint8_t* hb = b + 128 + 32 * h;
      for (int e = 0; e < 128; ++e) {
        const int low = e < 64 ? (l[e] & 0x0F) : (l[e - 64] >> 4);
        const int high = (hb[e % 32] >> (2 * (e / 32))) & 3;
        q[128 * h + e] = static_cast<uint8_t>(low | (high << 4));
      }
    }
#endif
  }
};

// lanes of x's sub-block of SB elements summed: ((x0 + x1) + x2) + x3 over its lane groups
template <int SB>
inline CV sub_sum(const float* x) {
  CV s = cv_load(x);
#pragma GCC unroll 4
  for (int g = 1; g < SB / LANES; ++g) s = cv_add(s, cv_load(x + LANES * g));
  return s;
}

// Types whose blocks are one sub-block that starts with its fp16 scale a (and, MIN_AT 2,
// its fp16 c right after): gather_coefs reads sixteen blocks' a and c at once (one
// gather of the leading 32 bits, two fp16 conversions, exact as half_at's) where coefs
// took a scalar load and conversion per value, the largest part of decoding a block.
template <class T, class = void>
struct Gathers : std::false_type {};
#ifdef __AVX512F__
template <class T>
struct Gathers<T, std::void_t<decltype(T::MIN_AT)>> : std::bool_constant<T::DIRECT && T::BS == T::SB> {};

// The offset coefficients c of 16 blocks whose scales are a: the stored mins (min(), read
// only for a type that stores one), C_OF_A * a, or zero for a type without an offset
template <class T, class Min>
inline __m512 offset_coefs(__m512 a, Min&& min) {
  if constexpr (T::MIN_AT == 2) return min();
  else if constexpr (T::HAS_C) return _mm512_mul_ps(_mm512_set1_ps(T::C_OF_A), a);
  else return _mm512_setzero_ps();
}

// lane i of a, c: the coefficients of the block at base + off[i] (c zero without one)
template <class T>
inline void coef_vectors(const uint8_t* base, __m512i off, __m512& a, __m512& c) {
  const __m512i dw = _mm512_i32gather_epi32(off, base, 1);
  a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dw));
  c = offset_coefs<T>(a, [&] { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw, 16))); });
}

// a[i], c[i]: the coefficients of the block at base + off[i], i < 16
template <class T>
inline void gather_coefs(const uint8_t* base, __m512i off, float* a, float* c) {
  __m512 av, cv;
  coef_vectors<T>(base, off, av, cv);
  _mm512_storeu_ps(a, av);
  if constexpr (T::HAS_C) _mm512_storeu_ps(c, cv);
}
#endif

constexpr int CMR = 3;  // input rows per tile of the codes kernels' panel path

// Up to FEW input rows take the codes-in-registers path, which decodes each block once for
// all of them: 6 where AVX-512's 32 vector registers hold 6 x NR accumulators (a
// speculative verify of 4 drafts is 5 rows; the panel path cost those twice a row's time),
// else CMR. More rows go through the panels (codes_many).
#ifdef __AVX512F__
constexpr int FEW = 6;
#else
constexpr int FEW = CMR;
#endif

// A row's offsets for the NR = 4 outputs of a work item, in one register: o[j] += c[j] * s
// is one 4-wide FMA (each lane one fused multiply-add, as std::fma computes it).
static_assert(NR == 4, "an Offs holds the NR outputs' offsets");
#ifdef __AVX2__
using Offs = __m128;
inline Offs offs_zero() { return _mm_setzero_ps(); }
inline Offs offs_fma(const float* c4, float s, Offs o) { return _mm_fmadd_ps(_mm_loadu_ps(c4), _mm_set1_ps(s), o); }
inline float offs_at(Offs o, int j) {
  alignas(16) float v[4];
  _mm_store_ps(v, o);
  return v[j];
}
#else
struct Offs {
  float v[4];
};
inline Offs offs_zero() { return Offs{}; }
inline Offs offs_fma(const float* c4, float s, Offs o) {
  for (int j = 0; j < 4; ++j) o.v[j] = std::fma(c4[j], s, o.v[j]);
  return o;
}
inline float offs_at(Offs o, int j) { return o.v[j]; }
#endif

// offs[r] += c4 * (row r's sum over sub-block s): the NR outputs of each row at once
template <int R, int A>
inline void add_offsets(const float* c4, const float* sums, int64_t ns, int64_t s, Offs (&offs)[A]) {
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) offs[r] = offs_fma(c4, sums[r * ns + s], offs[r]);
}

// One sub-block (SB elements from x's column k0) of R rows against the NR outputs:
// acc[r][j] += x[r] * (a_j q_j) lane by lane, LANES at a time in ascending order (the
// scaled codes a_j q_j from code(j, qf)), and offs[r][j] += c_j * (x[r]'s sum over the
// sub-block), the NR outputs' offsets in one 4-wide FMA. a4 and c4: this sub-block's a_j
// and c_j for the NR outputs (contiguous); sums: x's sub-block sums, row r at r * ns.
template <class T, int R, int A, class Code>
inline void sub_block(const float* x, int64_t ldx, int64_t k0, const float* sums, int64_t ns, int64_t s,
                      const Code& code, const float* c4, CV (&acc)[A][NR], Offs (&offs)[A]) {
  constexpr int G = T::SB / LANES;
  // up to CMR rows keep x's vectors in registers beside the accumulators; more rows
  // (AVX-512 only) leave the registers to their accumulators and reload x from L1
  constexpr bool HOLD = R <= CMR;
  CV xs[HOLD ? R : 1][G];
  if constexpr (HOLD) {
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) xs[r][g] = cv_load(x + r * ldx + k0 + LANES * g);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) {
    CV qf[G];
    code(j, qf);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        if constexpr (HOLD) acc[r][j] = cv_fma(xs[r][g], qf[g], acc[r][j]);
        else acc[r][j] = cv_fma(cv_load(x + r * ldx + k0 + LANES * g), qf[g], acc[r][j]);
      }
    }
  }
  if constexpr (T::HAS_C) add_offsets<R>(c4, sums, ns, s, offs);
}

template <int R, int A>
inline void codes_store(CV (&acc)[A][NR], Offs (&offs)[A], int nvalid, float* y, int64_t ldy, int64_t n0) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nvalid; ++j) y[r * ldy + n0 + j] = cv_sum(acc[r][j]) + offs_at(offs[r], j);
}

template <int A>
inline void codes_zero(CV (&acc)[A][NR], Offs (&offs)[A]) {
  for (int r = 0; r < A; ++r) {
    offs[r] = offs_zero();
    for (int j = 0; j < NR; ++j) acc[r][j] = cv_zero();
  }
}

// x's sum over each of its rows' sub-blocks: sums[r * ns + s] (lanes added in a fixed
// order, then the fixed lane tree), the factor of each offset c
template <int SB>
std::vector<float> sub_block_sums(const float* x, int64_t M, int64_t K) {
  const int64_t ns = K / SB;
  std::vector<float> sums(M * ns);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t s = 0; s < ns; ++s) sums[r * ns + s] = cv_sum(sub_sum<SB>(x + r * K + s * SB));
  return sums;
}

// Few rows (M <= FEW): one block of each of the NR outputs at a time, codes in registers.
constexpr int GATHER_ROWS = 4;
template <class T, int R>
void codes_few_rows(const uint8_t* w, int64_t row_bytes, const float* x, const float* sums, int64_t K,
                    int64_t n0, int nvalid, float* y, int64_t ldy) {
  constexpr int NS = T::BS / T::SB;
  alignas(64) uint8_t q[NR][T::BS];
  float a[NR][NS], c[NR][NS], at[NS][NR], ct[NS][NR];
  CV acc[FEW][NR];
  Offs offs[FEW];
  codes_zero(acc, offs);
  const int64_t nb = K / T::BS, ns = K / T::SB;
  const uint8_t* rows[NR];
  for (int j = 0; j < NR; ++j) rows[j] = w + (n0 + std::min(j, nvalid - 1)) * row_bytes;
#ifdef __AVX512F__
  // Gathers<T>: four blocks' coefficients of the NR outputs in one gather, already in
  // at/ct's layout (block-major, NR outputs side by side); element 4i + j: block i, output j
  alignas(64) float at4[4][NR], ct4[4][NR];
  __m512i off4 = _mm512_setzero_si512();
  constexpr bool GATHER = Gathers<T>::value && R <= GATHER_ROWS;
  if constexpr (GATHER) {
    alignas(64) int32_t o[16];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < NR; ++j) o[4 * i + j] = static_cast<int32_t>((rows[j] - rows[0]) + i * T::BYTES);
    off4 = _mm512_load_si512(o);
  }
#endif
  const float (*atp)[NR] = at;  // this block's at and ct (at4's or at's rows)
  const float (*ctp)[NR] = ct;
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < NR; ++j)
      // two work items ahead (the next 2 NR rows are contiguous after these), at this
      // block's offset (past the matrix: harmless): the stream arrives before it is read
      __builtin_prefetch(rows[j] + 2 * NR * row_bytes + b * T::BYTES);
#ifdef __AVX512F__
    if constexpr (GATHER) {
      if (b % 4 == 0) {  // four whole blocks gathered; a last group of fewer, one by one
        if (b + 4 <= nb) {
          gather_coefs<T>(rows[0] + b * T::BYTES, off4, &at4[0][0], &ct4[0][0]);
        } else {
          for (int64_t i = 0; i < nb - b; ++i)
            for (int j = 0; j < NR; ++j) T::coefs(rows[j] + (b + i) * T::BYTES, &at4[i][j], &ct4[i][j]);
        }
      }
      atp = &at4[b % 4];
      ctp = &ct4[b % 4];
    } else
#endif
    {
      for (int j = 0; j < NR; ++j) {
        if constexpr (T::DIRECT) T::coefs(rows[j] + b * T::BYTES, a[j], c[j]);
        else T::codes(rows[j] + b * T::BYTES, q[j], a[j], c[j]);
      }
      for (int sb = 0; sb < NS; ++sb)
        for (int j = 0; j < NR; ++j) {
          at[sb][j] = a[j][sb];
          ct[sb][j] = c[j][sb];
        }
    }
    for (int sb = 0; sb < NS; ++sb) {
      const int64_t k0 = b * T::BS + sb * T::SB;
      if constexpr (T::DIRECT) {
        sub_block<T, R>(x, K, k0, sums, ns, b * NS + sb, [&](int j, CV* qf) {
          T::vecs(rows[j] + b * T::BYTES, sb, qf);
          const CV aj = cv_set1(atp[sb][j]);
          for (int g = 0; g < T::SB / LANES; ++g) qf[g] = cv_mul(qf[g], aj);
        }, ctp[sb], acc, offs);
      } else {
        sub_block<T, R>(x, K, k0, sums, ns, b * NS + sb, [&](int j, CV* qf) {
          const CV aj = cv_set1(at[sb][j]);
          for (int g = 0; g < T::SB / LANES; ++g)
            qf[g] = cv_mul(cv_codes<T::SIGNED>(q[j] + sb * T::SB + LANES * g), aj);
        }, ct[sb], acc, offs);
      }
    }
  }
  codes_store<R>(acc, offs, nvalid, y, ldy, n0);
}

// Many rows (M > FEW): a work item decodes PANEL outputs' scaled codes a * q over the whole
// width (exactly the values the few-row path computes; the panel stays in L2) and their
// offsets c, then sweeps it with tiles of TR input rows by TC outputs: each tile's TR rows
// of x stay in L1 while it crosses the panel, so x streams from memory once per PANEL
// outputs (not once per NR: at 512 rows and more x outgrew L2 and the kernel ran at a
// quarter of oneDNN's speed). Each accumulator takes its LANES-wide FMAs in ascending k,
// as sub_block's; the offsets are the same fma chains over the sub-blocks, from zero,
// computed LANES outputs at a time (each lane one fused multiply-add, as offs_fma's);
// output = the lane tree of the accumulator + the offset, as codes_store.
#ifdef __AVX512F__
constexpr int TR = 6, TC = 4;  // 24 accumulators + 6 x vectors + 1 panel vector of AVX-512's 32
#else
constexpr int TR = CMR, TC = NR;  // 12 + 3 + 1 of AVX2's 16
#endif
constexpr int PANEL = 32;  // outputs per many-row work item (a multiple of TC and LANES)
constexpr int64_t X_BLOCK = 1 << 20;  // bytes of x per block of rows (half an L2)
static_assert(PANEL % TC == 0 && PANEL % LANES == 0, "the panel splits into tiles and vectors");

// The scaled codes of outputs n0 .. n0 + count into panel rows of K floats (rows past
// count: zero, their outputs never stored) and each output's offsets, ct[s * PANEL + j].
template <class T>
void decode_panel(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int count, float* panel,
                  float* ct) {
  constexpr int NS = T::BS / T::SB;
  const int64_t nb = K / T::BS;
  alignas(64) uint8_t q[T::BS];
  float ab[NS], cb[NS];
#ifdef __AVX512F__
  // Gathers<T>: the offsets of sixteen consecutive blocks of a row
  const __m512i blocks16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(T::BYTES));
#endif
  for (int j = 0; j < PANEL; ++j) {
    float* prow = panel + j * K;
    if (j >= count) {
      std::fill(prow, prow + K, 0.0f);
      if constexpr (T::HAS_C)
        for (int64_t s = 0; s < nb * NS; ++s) ct[s * PANEL + j] = 0.0f;
      continue;
    }
    const uint8_t* row = w + (n0 + j) * row_bytes;
#ifdef __AVX512F__
    if constexpr (Gathers<T>::value) {  // sixteen blocks' coefficients at a time
      alignas(64) float a16[16], c16[16];
      for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t n = std::min<int64_t>(16, nb - b0);
        if (n == 16) {
          gather_coefs<T>(row + b0 * T::BYTES, blocks16, a16, c16);
        } else {
          for (int64_t i = 0; i < n; ++i) T::coefs(row + (b0 + i) * T::BYTES, a16 + i, c16 + i);
        }
        for (int64_t i = 0; i < n; ++i) {
          const int64_t b = b0 + i;
          CV qf[T::SB / LANES];
          T::vecs(row + b * T::BYTES, 0, qf);
          const CV ab = cv_set1(a16[i]);
          for (int g = 0; g < T::SB / LANES; ++g) cv_store(prow + b * T::BS + LANES * g, cv_mul(qf[g], ab));
          if constexpr (T::HAS_C) ct[b * PANEL + j] = c16[i];
        }
      }
      continue;
    }
#endif
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * T::BYTES;
      float* out = prow + b * T::BS;
      if constexpr (T::DIRECT) {
        T::coefs(blk, ab, cb);
        for (int sb = 0; sb < NS; ++sb) {
          CV qf[T::SB / LANES];
          T::vecs(blk, sb, qf);
          for (int g = 0; g < T::SB / LANES; ++g)
            cv_store(out + sb * T::SB + LANES * g, cv_mul(qf[g], cv_set1(ab[sb])));
        }
      } else {
        T::codes(blk, q, ab, cb);
        for (int e = 0; e < T::BS; e += LANES)
          cv_store(out + e, cv_mul(cv_codes<T::SIGNED>(q + e), cv_set1(ab[e / T::SB])));
      }
      if constexpr (T::HAS_C)
        for (int sb = 0; sb < NS; ++sb) ct[(b * NS + sb) * PANEL + j] = cb[sb];
    }
  }
}

// o[r * PANEL + j] = the offsets of R rows (sums: row r's sub-block sums at r * ns) for
// the panel's outputs: fma(c_sj, sum_rs, .) over s ascending from zero (zero without c)
template <class T, int R>
void panel_offsets(const float* sums, int64_t ns, const float* ct, float* o) {
  constexpr int V = PANEL / LANES;
  CV acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = cv_zero();
  if constexpr (T::HAS_C) {
    for (int64_t s = 0; s < ns; ++s) {
      CV c[V];
      for (int v = 0; v < V; ++v) c[v] = cv_load(ct + s * PANEL + v * LANES);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const CV sv = cv_set1(sums[r * ns + s]);
        for (int v = 0; v < V; ++v) acc[r][v] = cv_fma(c[v], sv, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) cv_store(o + r * PANEL + v * LANES, acc[r][v]);
}

// cv_sum of LANES accumulators at once, result l from acc[l]: each stage of the lane tree
// (halves, quarters, then pairs) for every accumulator in one add, the same adds of the
// same lanes in the same order as cv_sum's, so bitwise its results
#ifdef __AVX512F__
inline CV cv_sums(const CV* acc) {
  __m512 u[8], s[4];
  for (int p = 0; p < 8; ++p)  // lanes i + lanes i + 8 of accumulators 2p, 2p + 1
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)  // then i + (i + 4): 128-bit chunk c of s[q] is accumulator 4q + c
    s[q] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * q], u[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * q], u[2 * q + 1], 0xDD));
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], 0x44), _mm512_shuffle_ps(s[0], s[1], 0xEE));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_ps(s[2], s[3], 0x44), _mm512_shuffle_ps(s[2], s[3], 0xEE));
  // lane 4c + p: accumulator 4p + c
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, 0x88), _mm512_shuffle_ps(t01, t23, 0xDD));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), r);
}
#elif defined(__AVX2__)
inline CV cv_sums(const CV* acc) {
  __m256 s[4];
  for (int q = 0; q < 4; ++q)  // lanes i + lanes i + 4: chunk c of s[q] is accumulator 2q + c
    s[q] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * q], acc[2 * q + 1], 0x20),
                         _mm256_permute2f128_ps(acc[2 * q], acc[2 * q + 1], 0x31));
  const __m256 t01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
  const __m256 t23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
  // lane 4c + p: accumulator 2p + c
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, 0x88), _mm256_shuffle_ps(t01, t23, 0xDD));
  return _mm256_permutevar8x32_ps(r, _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
}
#else
inline CV cv_sums(const CV* acc) {
  CV r;
  for (int l = 0; l < LANES; ++l) r.l[l] = cv_sum(acc[l]);
  return r;
}
#endif

// R rows of x (row r at x + r * K) against the panel's first count outputs, TC at a time;
// each tile's accumulators wait in accs (row r's output j at r * PANEL + j) to be summed
// LANES outputs at a time
template <int R>
void panel_rows(const float* x, int64_t K, const float* panel, const float* o, int count, float* y,
                int64_t ldy, CV* accs) {
  for (int c0 = 0; c0 < count; c0 += TC) {
    const float* p = panel + c0 * K;
    CV acc[R][TC];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < TC; ++j) acc[r][j] = cv_zero();
    for (int64_t k = 0; k < K; k += LANES) {
      CV xv[R];
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) xv[r] = cv_load(x + r * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < TC; ++j) {
        const CV wv = cv_load(p + j * K + k);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) acc[r][j] = cv_fma(xv[r], wv, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < TC; ++j) accs[r * PANEL + c0 + j] = acc[r][j];
  }
  for (int r = 0; r < R; ++r)
    for (int c0 = 0; c0 < count; c0 += LANES) {
      const CV v = cv_add(cv_sums(accs + r * PANEL + c0), cv_load(o + r * PANEL + c0));
      if (c0 + LANES <= count) {
        cv_store(y + r * ldy + c0, v);
      } else {
        alignas(64) float part[LANES];
        cv_store(part, v);
        std::copy(part, part + (count - c0), y + r * ldy + c0);
      }
    }
}

// the last M % TR rows: one instance per count
template <class T, int R = 1>
void panel_tail(int64_t M, const float* x, const float* sums, int64_t ns, int64_t K, const float* panel,
                const float* ct, float* o, int count, float* y, int64_t ldy, CV* accs) {
  if constexpr (R + 1 < TR) {
    if (M > R) return panel_tail<T, R + 1>(M, x, sums, ns, K, panel, ct, o, count, y, ldy, accs);
  }
  panel_offsets<T, R>(sums, ns, ct, o);
  panel_rows<R>(x, K, panel, o, count, y, ldy, accs);
}

template <class T>
void codes_many(const uint8_t* w, int64_t row_bytes, const float* x, const float* sums, int64_t M, int64_t K,
                int64_t N, float* y, int64_t ldy) {
  const int64_t items = (N + PANEL - 1) / PANEL, ns = K / T::SB;
  const int64_t grain = std::max<int64_t>(1, ITEM_WEIGHTS / (PANEL * K));
  // rows in blocks of about X_BLOCK bytes of x, which stay in L2 while a thread's panels
  // (decoded again for each block) sweep them
  const int64_t rows = std::max<int64_t>(TR, X_BLOCK / (K * 4) / TR * TR);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(PANEL * K), ct(ns * PANEL), o(TR * PANEL);
    std::vector<CV> accs(TR * PANEL, cv_zero());
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      const int64_t m1 = std::min(M, m0 + rows);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t n0 = item * PANEL;
        const int count = static_cast<int>(std::min<int64_t>(PANEL, N - n0));
        decode_panel<T>(w, row_bytes, K, n0, count, panel.data(), ct.data());
        int64_t m = m0;
        for (; m + TR <= m1; m += TR) {
          panel_offsets<T, TR>(sums + m * ns, ns, ct.data(), o.data());
          panel_rows<TR>(x + m * K, K, panel.data(), o.data(), count, y + m * ldy + n0, ldy, accs.data());
        }
        if (m < m1)
          panel_tail<T>(m1 - m, x + m * K, sums + m * ns, ns, K, panel.data(), ct.data(), o.data(), count,
                        y + m * ldy + n0, ldy, accs.data());
      }
    }
  });
}

// codes_few_rows with R = M (1 <= M <= FEW): one instance per row count
template <class T, int R = 1>
void codes_few(int64_t M, const uint8_t* w, int64_t row_bytes, const float* x, const float* sums, int64_t K,
               int64_t n0, int nvalid, float* y, int64_t ldy) {
  if constexpr (R < FEW) {
    if (M > R) return codes_few<T, R + 1>(M, w, row_bytes, x, sums, K, n0, nvalid, y, ldy);
  }
  codes_few_rows<T, R>(w, row_bytes, x, sums, K, n0, nvalid, y, ldy);
}

// ---------------------------------------------------------------------------------------
// GGML Q4_0 / Q4_1 / Q8_0 on exact integer dot products (AVX-512 VNNI; AMX tiles for many
// rows). Each row of x is split, per block of 32, into a power-of-two scale s = 2^(e - 7)
// (every |x| of the block below 2^e) and an integer X = round(x / s * 65536) (|X| < 2^23),
//     x = s * X / 65536 + r,   |r| <= s / 131072 = 2^(e - 24):
// the block's largest value's own fp32 resolution. A block's sum of codes q times X is an
// integer, exact whatever instruction adds it in whatever order. Three digits hold X:
// D0 = X >> 16 (a signed byte) and its next two bytes D1, D2, with sums S_j = sum q D_j.
// Then per block, ascending, every output takes
//     Q4:    f = fma(S2, 2^-16, fma(S1, 2^-8, S0))     t = f * s
//     Q8_0:  f = fma(fma(S2, 2^-8, S1), 2^-8, S0)      t = f * s
//     acc = fma(t, d, acc);  acc = fma(c, xsum, acc)   (c, xsum: types with an offset;
//                                                        xsum: sub_block_sums' block sum)
// Q4's inner fma is exact (|S0 + S1 / 256| < 2^16 with 8 bits of fraction), so its f is
// sum q X / 65536 rounded once, and any other exact way to that value gives its bits.
// Q4's many-row path takes one: halves, X = 4096 H + L with H = 16 H1 + H0 and
// L = 16 L1 + L0 (H1 a signed byte, L1 a byte, H0 and L0 nibbles). 16 q is still a byte,
// so one AMX TDP over a whole 64-byte tile row ([H1 | H0] against [16 q ; q]) gives
// SH = sum q H and another SL = sum q L, and
//     f' = fma(SL, 2^-12, SH) = 16 f,   t = f' * (s / 16)   (the same t, bit for bit)
// two TDPs and tile stores a block where the digits take three, and fewer vector steps.
// The few-row path (VPDPBUSD, one tile of 16 outputs with its codes in registers) and the
// many-row path (AMX TDPB*D on 16 x 16 tiles) so give a row bitwise the same result
// alone, in any batch, at any thread count. Integer products cost a quarter of the float
// ones per instruction, and AMX does 16 x 16 x 64 of them per instruction: 16-row decode
// and prefill steps go several times faster than the float kernel's, while batch 1 stays
// bound by the weight stream (the codes need no conversion to float).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define CANDOR_INT_DOTS 1
constexpr int NT = 16;          // outputs per tile (lanes)
constexpr int FEW_INT = 8;      // rows up to which the VNNI path beats a tile's fixed cost
constexpr int64_t INT_CODES_BLOCK = 1 << 20;  // bytes of staged codes per group of output tiles (L2)
constexpr int64_t INT_GROUP_ROWS = 64;  // rows from which the AMX path groups output tiles

template <class T> struct IntDots : std::false_type {};
template <> struct IntDots<Q4_0c> : std::true_type {};
template <> struct IntDots<Q4_1c> : std::true_type {};
template <> struct IntDots<Q8_0c> : std::true_type {};

// std::vector's storage on 64 bytes (an AMX tile row that straddles two cache lines loads
// at less than half speed: 1024 rows of gate_up 15.5 -> 13.9 ms), left uninitialized by
// resize (the writer fills it; zeroing first cost 2.5% of a 2k-token prefill)
template <class V>
struct Aligned64 {
  using value_type = V;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  V* allocate(size_t n) { return static_cast<V*>(::operator new(n * sizeof(V), std::align_val_t(64))); }
  void deallocate(V* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    if constexpr (sizeof...(A) == 0) ::new (static_cast<void*>(p)) U;
    else ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
template <class V>
using AlignedVector = std::vector<V, Aligned64<V>>;

// Q4's many-row path takes X as halves, the rest as three digits (see the note)
template <class T>
constexpr bool HALVES = !std::is_same_v<T, Q8_0c>;

// x's integers, row by row (Mp: M, or for the tiles M rounded up to 16, padding rows zero),
// in planes: halves, two of 2K bytes a row with 64 a block, [H1 | H0] and [L1 | L0]; or
// three of K bytes, D0 (signed), D1, D2. A row's planes lie side by side (one allocation a
// call, as a few-row call is tens of microseconds; planes one after another put a row's
// two tiles a multiple of 128 KB apart, the same L2 sets: gate_up 13.0 -> 15.5 ms). Each
// block's scale s [Mp, nb], and (Q8_0's few-row path) each block's sum of D0
struct Digits {
  int64_t M, Mp, nb;
  int64_t width, block, stride;  // bytes: a plane's per row and per block, a row's (all planes)
  AlignedVector<uint8_t> bytes;
  std::vector<float> scale;
  std::vector<int32_t> d0sum;
  const uint8_t* at(int p, int64_t row, int64_t b) const { return bytes.data() + row * stride + p * width + b * block; }
  uint8_t* at(int p, int64_t row, int64_t b) { return bytes.data() + row * stride + p * width + b * block; }
};

inline void store_bytes(uint8_t* p, __m512i v) {  // each lane's low byte
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
}

// 16 values of row m's block b (a = x / s, |a| < 128) as X = round(a * 2^16), |X| < 2^23,
// into the planes (h: which half of the block's 32)
inline void store_digits(Digits& g, bool halves, int64_t m, int64_t b, int h, __m512 a) {
  const __m512i X = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(65536.0f))),
                                     _mm512_set1_epi32((1 << 23) - 1));
  const __m512i nibble = _mm512_set1_epi32(15);
  store_bytes(g.at(0, m, b) + 16 * h, _mm512_srai_epi32(X, 16));
  if (halves) {
    store_bytes(g.at(0, m, b) + 32 + 16 * h, _mm512_and_si512(_mm512_srai_epi32(X, 12), nibble));
    store_bytes(g.at(1, m, b) + 16 * h, _mm512_srli_epi32(X, 4));
    store_bytes(g.at(1, m, b) + 32 + 16 * h, _mm512_and_si512(X, nibble));
  } else {
    store_bytes(g.at(1, m, b) + 16 * h, _mm512_srli_epi32(X, 8));
    store_bytes(g.at(2, m, b) + 16 * h, X);
  }
}

inline Digits split_digits(const float* x, int64_t M, int64_t K, bool tiles, bool halves, bool d0sums) {
  Digits g;
  g.M = M, g.Mp = tiles ? (M + 15) / 16 * 16 : M, g.nb = K / 32;
  g.width = halves ? 2 * K : K, g.block = halves ? 64 : 32;
  const int planes = halves ? 2 : 3;
  g.stride = planes * g.width;
  g.bytes.resize(g.Mp * g.stride);  // (uninitialized: every block is written below)
  std::memset(g.bytes.data() + M * g.stride, 0, (g.Mp - M) * g.stride);
  g.scale.assign(g.Mp * g.nb, 0.0f);
  if (d0sums) g.d0sum.assign(M * g.nb, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < g.nb; ++b) {
      const float* xb = x + m * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const bool finite = std::isfinite(amax);
      if (!finite || amax < 0x1p-100f) {  // digits zero (values under 2^-100 count as zero)
        for (int p = 0; p < planes; ++p) std::memset(g.at(p, m, b), 0, g.block);
        if (!finite) g.scale[m * g.nb + b] = std::numeric_limits<float>::quiet_NaN();  // the row's outputs: NaN
        continue;
      }
      int e;
      std::frexp(amax, &e);  // amax < 2^e
      const float s = std::ldexp(1.0f, e - 7);
      g.scale[m * g.nb + b] = s;
      const __m512 inv = _mm512_set1_ps(1.0f / s);  // a power of two: x * inv is exact
      store_digits(g, halves, m, b, 0, _mm512_mul_ps(v0, inv));
      store_digits(g, halves, m, b, 1, _mm512_mul_ps(v1, inv));
      if (d0sums) {
        int32_t t = 0;
        for (int i = 0; i < 32; ++i) t += static_cast<int8_t>(g.at(0, m, b)[i]);
        g.d0sum[m * g.nb + b] = t;
      }
    }
  return g;
}

// 64-byte vectors of a 16-output tile's block in VNNI order (four of Q4's nibble bytes per
// lane, or four of Q8_0's codes), and where a GGML block's first code byte is
template <class T>
constexpr int CODE_VECS = std::is_same_v<T, Q8_0c> ? 8 : 4;
template <class T>
constexpr int CODES_AT = std::is_same_v<T, Q4_1c> ? 4 : 2;  // a GGML block's first code byte

// the codes of block b of outputs n0 .. n0 + 15 (row j at w + off[j]) as VNNI rows: lane j
// of c[i] holds codes 4i .. 4i + 3 of output j; its d and c (zero without c) per lane
template <class T>
inline void tile_codes(const uint8_t* w, __m512i off, int64_t b, __m512i* c, __m512& d, __m512& cv) {
  const uint8_t* blk = w + b * T::BYTES;
  coef_vectors<T>(blk, off, d, cv);
  if constexpr (std::is_same_v<T, Q8_0c>) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) c[i] = _mm512_i32gather_epi32(off, blk + CODES_AT<T> + 4 * i, 1);
  } else {
    const __m512i lo = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // byte j: element j (low nibble) and 16 + j (high)
      const __m512i g = _mm512_i32gather_epi32(off, blk + CODES_AT<T> + 4 * i, 1);
      c[i] = _mm512_and_si512(g, lo);
      c[4 + i] = _mm512_and_si512(_mm512_srli_epi16(g, 4), lo);
    }
  }
}

// outputs' row offsets for a tile starting at n0 with nvalid outputs (the rest repeat the
// first row: read, never stored)
inline __m512i tile_offsets(int64_t row_bytes, int nvalid) {
  const __m512i j = _mm512_min_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                     _mm512_set1_epi32(nvalid - 1));
  return _mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
}

// The packed layout (ggml_pack, made once at load): a tile of 16 outputs' block b is
// 16 * BYTES bytes at (tile * nb + b) * 16 * BYTES, already in VNNI order: CODE_VECS
// vectors of 64 bytes (lane j of vector i: output j's code bytes 4i .. 4i + 3, as
// tile_codes gathers them: for Q4 each byte still holds two codes), then the 16 outputs'
// d as halves and (Q4_1) their m. So a tile's codes are plain loads of one contiguous
// stream where the GGML rows take a gather per vector from sixteen rows. (The prefetch
// ahead may name bytes past the weight's end: a prefetch never faults.)

template <class T>
inline void packed_codes(const uint8_t* p, __m512i* c, __m512& d, __m512& cv) {
  const uint8_t* h = p + 64 * CODE_VECS<T>;
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  cv = offset_coefs<T>(d, [&] { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32))); });
  if constexpr (std::is_same_v<T, Q8_0c>) {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) c[i] = _mm512_loadu_si512(p + 64 * i);
  } else {
    const __m512i lo = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m512i g = _mm512_loadu_si512(p + 64 * i);
      c[i] = _mm512_and_si512(g, lo);
      c[4 + i] = _mm512_and_si512(_mm512_srli_epi16(g, 4), lo);
    }
  }
}

// The layout, piece by piece: move(packed, block, bytes) for each piece of row n's block b
// (a GGML block at ``block``) and where it sits in the packed weight (either side const:
// the one read from)
template <class T, class P, class B, class Move>
inline void block_pieces(P* packed, int64_t nb, int64_t n, int64_t b, B* block, Move&& move) {
  P* p = packed + ((n / NT) * nb + b) * NT * T::BYTES;
  const int64_t j = n % NT;
  for (int i = 0; i < CODE_VECS<T>; ++i) move(p + 64 * i + 4 * j, block + CODES_AT<T> + 4 * i, 4);
  P* h = p + 64 * CODE_VECS<T>;
  move(h + 2 * j, block, 2);
  if constexpr (T::MIN_AT == 2) move(h + 32 + 2 * j, block + 2, 2);
}

// GGML rows [N, row_bytes] -> the packed layout [ceil(N / 16), nb * 16 * BYTES] (outputs
// past N: zero codes and scales)
template <class T>
void pack_rows(const uint8_t* w, int64_t row_bytes, int64_t N, uint8_t* out) {
  const int64_t nb = row_bytes / T::BYTES, tiles = (N + NT - 1) / NT;
  std::memset(out, 0, tiles * nb * NT * T::BYTES);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b)
      block_pieces<T>(out, nb, n, b, w + n * row_bytes + b * T::BYTES,
                      [](uint8_t* to, const uint8_t* from, int bytes) { std::memcpy(to, from, bytes); });
}

// ids' rows of a packed weight back as GGML rows [len(ids), row_bytes] (pack_rows undone)
template <class T>
void unpack_rows(const uint8_t* packed, int64_t nb, const int64_t* ids, int64_t n, uint8_t* out) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t b = 0; b < nb; ++b)
      block_pieces<T>(packed, nb, ids[r], b, out + (r * nb + b) * T::BYTES,
                      [](const uint8_t* from, uint8_t* to, int bytes) { std::memcpy(to, from, bytes); });
}

// Where a tile's codes come from: the GGML rows (gathers) ...
template <class T>
struct RowsTile {
  const uint8_t* wt;
  __m512i off;
  const uint8_t* next;  // the tile after next, fetched a share per block (sixteen rows
  int64_t ahead, share;  // read side by side are more streams than the prefetchers follow)
  RowsTile(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t nb, int64_t n0, int nvalid)
      : wt(w + n0 * row_bytes), off(tile_offsets(row_bytes, nvalid)), next(wt + 2 * NT * row_bytes),
        ahead(n0 + 3 * NT <= N ? NT * row_bytes : 0), share((ahead + nb - 1) / nb) {}
  void prefetch(int64_t b) const {
    for (int64_t at = b * share; at < std::min(ahead, (b + 1) * share); at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T0);
  }
  void codes(int64_t b, __m512i* c, __m512& d, __m512& cv) const { tile_codes<T>(wt, off, b, c, d, cv); }
};

// ... or the packed layout (plain loads, one stream)
constexpr int64_t PACKED_AHEAD = 8192;  // bytes
template <class T>
struct PackedTile {
  const uint8_t* p;
  PackedTile(const uint8_t* packed, int64_t nb, int64_t n0) : p(packed + n0 * nb * T::BYTES) {}
  // the stream a fixed distance ahead, into L2 (measured on SmolLM2's layers from memory:
  // 1.5x the rows' gathers at batch 1; without it the packed stream was slower than they)
  void prefetch(int64_t b) const {
    const uint8_t* q = p + b * NT * T::BYTES + PACKED_AHEAD;
    for (int64_t at = 0; at < NT * T::BYTES; at += 64) _mm_prefetch(reinterpret_cast<const char*>(q + at), _MM_HINT_T1);
  }
  void codes(int64_t b, __m512i* c, __m512& d, __m512& cv) const { packed_codes<T>(p + b * NT * T::BYTES, c, d, cv); }
};

// a block's f (see the note): from the digits' sums, or (Q4's halves) 16 f from SH, SL
template <class T>
inline __m512 digits_sum(__m512i s0, __m512i s1, __m512i s2) {
  const __m512 q = _mm512_set1_ps(1.0f / 256.0f);
  if constexpr (HALVES<T>)
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), _mm512_set1_ps(1.0f / 65536.0f),
                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), q, _mm512_cvtepi32_ps(s0)));
  return _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(s2), q, _mm512_cvtepi32_ps(s1)), q, _mm512_cvtepi32_ps(s0));
}
inline __m512 halves_sum(__m512i sh, __m512i sl) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sl), _mm512_set1_ps(1.0f / 4096.0f), _mm512_cvtepi32_ps(sh));
}

template <bool HAS_C>
inline __m512 int_combine(__m512 acc, __m512 f, float s, __m512 d, __m512 cv, float xsum) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(f, _mm512_set1_ps(s)), d, acc);
  if constexpr (HAS_C) acc = _mm512_fmadd_ps(cv, _mm512_set1_ps(xsum), acc);
  return acc;
}

inline void store_tile_row(float* y, __m512 v, int nvalid) {
  _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << nvalid) - 1u), v);
}

inline int32_t word_at(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// R rows (R <= FEW_INT) against one tile of outputs, codes in registers
template <class T, int R, class Src>
void int_few_tile(const Src& src, const Digits& g, int64_t m0, const float* sums, int64_t n0, int nvalid, float* y,
                  int64_t ldy) {
  constexpr bool Q8 = std::is_same_v<T, Q8_0c>;
  const int64_t nb = g.nb;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    src.prefetch(b);
    __m512i c[8];
    __m512 d, cv;
    src.codes(b, c, d, cv);
    __m512i cu[8];  // codes as unsigned bytes for D0 (signed): Q8_0's shifted by 128
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) cu[i] = Q8 ? _mm512_xor_si512(c[i], _mm512_set1_epi8(static_cast<char>(0x80))) : c[i];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const auto digit = [&](int p, int at) { return _mm512_set1_epi32(word_at(g.at(p, row, b) + at)); };
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512(), s2 = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        s0 = _mm512_dpbusd_epi32(s0, cu[i], digit(0, 4 * i));
        s1 = _mm512_dpbusd_epi32(s1, digit(1, 4 * i), c[i]);
        s2 = _mm512_dpbusd_epi32(s2, digit(2, 4 * i), c[i]);
      }
      if constexpr (Q8) s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(128 * g.d0sum[row * nb + b]));
      const __m512 f = digits_sum<T>(s0, s1, s2);
      acc[r] = int_combine<T::HAS_C>(acc[r], f, g.scale[row * nb + b], d, cv, T::HAS_C ? sums[row * nb + b] : 0.0f);
    }
  }
  for (int r = 0; r < R; ++r) store_tile_row(y + (m0 + r) * ldy + n0, acc[r], nvalid);
}

template <class T, int R = 1, class Src>
void int_few(int64_t rows, const Src& src, const Digits& g, int64_t m0, const float* sums, int64_t n0, int nvalid,
             float* y, int64_t ldy) {
  if constexpr (R < FEW_INT) {
    if (rows > R) return int_few<T, R + 1>(rows, src, g, m0, sums, n0, nvalid, y, ldy);
  }
  int_few_tile<T, R>(src, g, m0, sums, n0, nvalid, y, ldy);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define CANDOR_AMX 1
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use AMX tiles (Linux asks for the permission once);
// CANDOR_CPU_AMX=0 keeps every row count on the VNNI path (the same bits: a check)
inline bool amx_usable() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-int8") || !__builtin_cpu_supports("amx-tile")) return false;
    if (const char* env = std::getenv("CANDOR_CPU_AMX"); env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

// Q4: tiles 0-1 SH, SL (16 rows x 16 int32); 2-3 the rows' [H1 | H0] and [L1 | L0] (16 x
// 64 bytes); 4 a block of 16 outputs' codes, [16 q ; q] (16 VNNI rows x 64 bytes).
// Q8_0: tiles 0-2 S0, S1, S2; 3-5 the rows' D0, D1, D2 (16 x 32 bytes); 6 the codes
// (8 VNNI rows x 64 bytes)
template <class T>
constexpr int64_t CODE_TILE = HALVES<T> ? 1024 : 512;  // staged bytes of a block's codes

template <class T>
inline void amx_configure() {
  TileConfig cfg;
  if constexpr (HALVES<T>) {
    for (int t = 0; t < 5; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  } else {
    for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 3; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 32;
    cfg.rows[6] = 8, cfg.colsb[6] = 64;
  }
  _tile_loadconfig(&cfg);
}

// a block's codes staged for tile 4 / 6 (c: the VNNI vectors of the block)
template <class T>
inline void stage_codes(const __m512i* c, uint8_t* out) {
  for (int i = 0; i < 8; ++i) {
    if constexpr (HALVES<T>) {
      _mm512_storeu_si512(out + 64 * i, _mm512_slli_epi16(c[i], 4));  // (bytes 0 .. 15: no carry)
      _mm512_storeu_si512(out + 512 + 64 * i, c[i]);
    } else {
      _mm512_storeu_si512(out + 64 * i, c[i]);
    }
  }
}

// a block's integer sums for rows mt .. mt + 15 into the accumulator tiles, from its
// staged codes
template <class T>
inline void amx_block(const Digits& g, int64_t mt, int64_t b, const uint8_t* codes) {
  if constexpr (HALVES<T>) {
    _tile_loadd(2, g.at(0, mt, b), g.stride);
    _tile_loadd(3, g.at(1, mt, b), g.stride);
    _tile_loadd(4, codes, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbuud(1, 3, 4);
  } else {
    _tile_loadd(3, g.at(0, mt, b), g.stride);
    _tile_loadd(4, g.at(1, mt, b), g.stride);
    _tile_loadd(5, g.at(2, mt, b), g.stride);
    _tile_loadd(6, codes, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_dpbssd(0, 3, 6);
    _tile_dpbusd(1, 4, 6);
    _tile_dpbusd(2, 5, 6);
  }
}

template <class T>
inline void amx_store(int32_t (*s)[256]) {
  _tile_stored(0, s[0], 64);
  _tile_stored(1, s[1], 64);
  if constexpr (!HALVES<T>) _tile_stored(2, s[2], 64);
}

// rows mt .. mt + 15 against the tile of outputs at n0, whose blocks' codes wait in codes
// (b * CODE_TILE bytes) and scales in dv, cv (b * 16 floats); sc and xs: each block's
// row scales and sums, [nb, Mp]. Software-pipelined: block b's products go to the tiles
// while block b - 1's, stored to the other half of sbuf, are combined.
template <class T>
void amx_tile_rows(const Digits& g, int64_t mt, const float* sc, const float* xs, const uint8_t* codes,
                   const float* dv, const float* cv, int64_t n0, int nvalid, float* y, int64_t ldy) {
  const int64_t nb = g.nb, Mp = g.Mp;
  alignas(64) int32_t sbuf[2][3][16 * 16];
  __m512 acc[16];  // (registers: a lambda capturing it kept it on the stack, 1024 rows of gate_up 13.9 -> 12.5 ms)
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b <= nb; ++b) {
    if (b < nb) amx_block<T>(g, mt, b, codes + b * CODE_TILE<T>);
    if (b > 0) {  // block b - 1's sums into the accumulators
      const int32_t(&s)[3][256] = sbuf[(b - 1) & 1];
      const __m512 d = _mm512_load_ps(dv + (b - 1) * 16), c = _mm512_load_ps(cv + (b - 1) * 16);
      const float* scb = sc + (b - 1) * Mp + mt;
      const float* xsb = xs + (b - 1) * Mp + mt;
#pragma GCC unroll 16
      for (int r = 0; r < 16; ++r) {
        const __m512i s0 = _mm512_load_si512(s[0] + 16 * r), s1 = _mm512_load_si512(s[1] + 16 * r);
        const __m512 f = HALVES<T> ? halves_sum(s0, s1) : digits_sum<T>(s0, s1, _mm512_load_si512(s[2] + 16 * r));
        acc[r] = int_combine<T::HAS_C>(acc[r], f, scb[r], d, c, xsb[r]);
      }
    }
    if (b < nb) amx_store<T>(sbuf[b & 1]);
  }
  const int rows = static_cast<int>(std::min<int64_t>(16, g.M - mt));
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r)
    if (r < rows) store_tile_row(y + (mt + r) * ldy + n0, acc[r], nvalid);
}
#endif

// packed: the weight in the packed layout (ggml_pack), or null: w's GGML rows
template <class T>
void int_linear(const uint8_t* w, int64_t row_bytes, const uint8_t* packed, const float* x, const float* sums,
                int64_t M, int64_t K, int64_t N, float* y, int64_t ldy) {
#ifdef CANDOR_AMX
  const bool tiles_path = M > FEW_INT && amx_usable();
#else
  constexpr bool tiles_path = false;
#endif
  const Digits g = split_digits(x, M, K, tiles_path, tiles_path && HALVES<T>, !tiles_path && std::is_same_v<T, Q8_0c>);
  const int64_t tiles = (N + NT - 1) / NT, nb = K / 32;
  const int64_t grain = std::max<int64_t>(1, ITEM_WEIGHTS / (NT * K));
  const auto with_tile = [&](int64_t n0, int nvalid, auto&& f) {  // f(the tile's source)
    if (packed != nullptr) return f(PackedTile<T>(packed, nb, n0));
    return f(RowsTile<T>(w, row_bytes, N, nb, n0, nvalid));
  };
#ifdef CANDOR_AMX
  if (tiles_path) {
    std::vector<float> sc(nb * g.Mp, 0.0f), xs(nb * g.Mp, 0.0f);  // [nb, Mp]: a block's rows together
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        sc[b * g.Mp + m] = HALVES<T> ? g.scale[m * nb + b] / 16 : g.scale[m * nb + b];  // (halves: 16 f)
        if constexpr (T::HAS_C) xs[b * g.Mp + m] = sums[m * nb + b];
      }
    // Past INT_GROUP_ROWS rows a group of output tiles has its codes staged once (L2-sized);
    // then each tile of 16 rows, whose digits stay in L1, passes over every output tile of
    // the group: the code tiles stream from L2 (512 bytes a block) where rows-inner streamed
    // three digit tiles (1.5 KB a block) per output tile. 1024 rows: gate_up 19-21 -> 15-17
    // ms, qkv 6.0 -> 5.5. Fewer rows keep one tile's codes in L1 (group 1: rows inner).
    const int64_t group = M > INT_GROUP_ROWS ? std::max<int64_t>(1, INT_CODES_BLOCK / (nb * CODE_TILE<T>)) : 1;
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      amx_configure<T>();
      const int64_t most = std::min(group, end - begin);
      AlignedVector<uint8_t> codes(most * nb * CODE_TILE<T>);
      AlignedVector<float> dv(most * nb * 16), cv(most * nb * 16);
      float *da = dv.data(), *ca = cv.data();
      for (int64_t t0 = begin; t0 < end; t0 += group) {
        const int64_t t1 = std::min(end, t0 + group);
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t n0 = t * NT, at = (t - t0) * nb;
          with_tile(n0, static_cast<int>(std::min<int64_t>(NT, N - n0)), [&](const auto& src) {
            for (int64_t b = 0; b < nb; ++b) {
              __m512i c[8];
              __m512 d, c_;
              src.codes(b, c, d, c_);
              stage_codes<T>(c, codes.data() + (at + b) * CODE_TILE<T>);
              _mm512_store_ps(da + (at + b) * 16, d);
              _mm512_store_ps(ca + (at + b) * 16, c_);
            }
          });
        }
        for (int64_t mt = 0; mt < M; mt += 16)
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t n0 = t * NT, at = (t - t0) * nb;
            amx_tile_rows<T>(g, mt, sc.data(), xs.data(), codes.data() + at * CODE_TILE<T>, da + at * 16, ca + at * 16,
                             n0, static_cast<int>(std::min<int64_t>(NT, N - n0)), y, ldy);
          }
      }
      _tile_release();
    });
    return;
  }
#endif
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NT;
      const int nvalid = static_cast<int>(std::min<int64_t>(NT, N - n0));
      with_tile(n0, nvalid, [&](const auto& src) {
        for (int64_t m0 = 0; m0 < M; m0 += FEW_INT)
          int_few<T>(std::min<int64_t>(FEW_INT, M - m0), src, g, m0, sums, n0, nvalid, y, ldy);
      });
    }
  });
}
#endif

template <class T>
void codes_linear(const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, int64_t N, float* y,
                  int64_t ldy, const uint8_t* packed = nullptr) {  // packed: see int_linear
  if (M == 0 || N == 0) return;
  const int64_t ns = K / T::SB;
  const std::vector<float> sums = T::HAS_C ? sub_block_sums<T::SB>(x, M, K) : std::vector<float>(M * ns);
#ifdef CANDOR_INT_DOTS
  if constexpr (IntDots<T>::value) return int_linear<T>(w, row_bytes, packed, x, sums.data(), M, K, N, y, ldy);
#endif
  if (M > FEW) return codes_many<T>(w, row_bytes, x, sums.data(), M, K, N, y, ldy);
  const int64_t items = (N + NR - 1) / NR;
  const int64_t grain = std::max<int64_t>(1, ITEM_WEIGHTS / (NR * K));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = item * NR;
      codes_few<T>(M, w, row_bytes, x, sums.data(), K, n0, static_cast<int>(std::min<int64_t>(NR, N - n0)), y, ldy);
    }
  });
}

// GGML type ids (ggml.h's enum ggml_type)
enum GgmlType : int64_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
                          T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

template <class F>
auto with_ggml(int64_t type, const uint8_t* w, int64_t row_bytes, F&& f) {
  switch (type) {
    case T_Q4_0: return f(GgmlRows<Q4_0>{w, row_bytes});
    case T_Q4_1: return f(GgmlRows<Q4_1>{w, row_bytes});
    case T_Q5_0: return f(GgmlRows<Q5_0>{w, row_bytes});
    case T_Q5_1: return f(GgmlRows<Q5_1>{w, row_bytes});
    case T_Q8_0: return f(GgmlRows<Q8_0>{w, row_bytes});
    case T_Q4_K: return f(GgmlRows<Q4_K>{w, row_bytes});
    case T_Q5_K: return f(GgmlRows<Q5_K>{w, row_bytes});
    case T_Q6_K: return f(GgmlRows<Q6_K>{w, row_bytes});
  }
  TORCH_CHECK(false, "ggml type ", type, " has no kernel");
}

template <class F>
auto with_codes(int64_t type, F&& f) {
  switch (type) {
    case T_Q4_0: return f(Q4_0c{});
    case T_Q4_1: return f(Q4_1c{});
    case T_Q5_0: return f(Q5_0c{});
    case T_Q5_1: return f(Q5_1c{});
    case T_Q8_0: return f(Q8_0c{});
    case T_Q4_K: return f(Q4_Kc{});
    case T_Q5_K: return f(Q5_Kc{});
    case T_Q6_K: return f(Q6_Kc{});
  }
  TORCH_CHECK(false, "ggml type ", type, " has no kernel");
}

int64_t block_elements(int64_t type) {
  return with_ggml(type, nullptr, 0, [](auto d) { return static_cast<int64_t>(decltype(d)::BS); });
}

void check_x_out(const torch::Tensor& x, const torch::Tensor& out, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x: a contiguous float32 [M, K] tensor");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == torch::kFloat32 && out.size(0) == x.size(0) &&
                  out.size(1) == N && out.stride(1) == 1,
              "out: float32 [M, N] with unit column stride");
}

}  // namespace

// out[M, N] = x[M, K] @ W^T for W's GGML blocks ``w`` [N, K / BS * BYTES] (uint8)
void ggml_linear(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 blocks");
  check_x_out(x, out, w.size(0));
  const int64_t K = x.size(1), bs = block_elements(type);
  TORCH_CHECK(K % bs == 0, "K=", K, " is not a multiple of the block size ", bs);
  with_codes(type, [&](auto codes) {
    using T = decltype(codes);
    TORCH_CHECK(w.size(1) == K / bs * T::BYTES, "w: ", w.size(1), " bytes per row, not ", K / bs * T::BYTES,
                " (K=", K, ")");
    codes_linear<T>(w.data_ptr<uint8_t>(), w.size(1), x.data_ptr<float>(), x.size(0), K, w.size(0),
                    out.data_ptr<float>(), out.stride(0));
    return 0;
  });
}

// Whether GGML type ``type`` has the packed layout here (Q4_0 / Q4_1 / Q8_0 where the
// integer dot products are built: ggml_pack, ggml_linear_packed)
bool ggml_packs(int64_t type) {
#ifdef CANDOR_INT_DOTS
  return with_codes(type, [](auto codes) { return IntDots<decltype(codes)>::value; });
#else
  return with_codes(type, [](auto) { return false; });
#endif
}

// W's GGML blocks [N, K / 32 * BYTES] -> the packed layout [ceil(N / 16), K / 32 * 16 * BYTES]
torch::Tensor ggml_pack(torch::Tensor w, int64_t type) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 blocks");
  TORCH_CHECK(ggml_packs(type), "ggml type ", type, " has no packed layout on this CPU");
#ifdef CANDOR_INT_DOTS
  return with_codes(type, [&](auto codes) {
    using T = decltype(codes);
    torch::Tensor out;
    if constexpr (IntDots<T>::value) {
      TORCH_CHECK(w.size(1) % T::BYTES == 0, "w: rows of whole blocks");
      out = torch::empty({(w.size(0) + NT - 1) / NT, w.size(1) * NT}, w.options());
      pack_rows<T>(w.data_ptr<uint8_t>(), w.size(1), w.size(0), out.data_ptr<uint8_t>());
    }
    return out;
  });
#else
  return torch::Tensor();
#endif
}

// out[M, N] = x[M, K] @ W^T for W packed by ggml_pack: the same bits as ggml_linear on
// W's GGML blocks
void ggml_linear_packed(torch::Tensor x, torch::Tensor packed, int64_t type, int64_t N, torch::Tensor out) {
  TORCH_CHECK(ggml_packs(type), "ggml type ", type, " has no packed layout on this CPU");
  check_x_out(x, out, N);
#ifdef CANDOR_INT_DOTS
  with_codes(type, [&](auto codes) {
    using T = decltype(codes);
    if constexpr (IntDots<T>::value) {
      const int64_t M = x.size(0), K = x.size(1);
      TORCH_CHECK(K % T::BS == 0 && packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 &&
                      packed.is_contiguous() && packed.size(0) == (N + NT - 1) / NT &&
                      packed.size(1) == K / T::BS * NT * T::BYTES,
                  "packed: uint8 [", (N + NT - 1) / NT, ", ", K / T::BS * NT * T::BYTES, "] for N=", N, ", K=", K);
      codes_linear<T>(nullptr, 0, x.data_ptr<float>(), M, K, N, out.data_ptr<float>(), out.stride(0),
                      packed.data_ptr<uint8_t>());
    }
    return 0;
  });
#endif
}

// x[M, K] @ W^T as a new [M, N] tensor for W packed by ggml_pack: ggml_linear_packed
// with x last, so functools.partial(ggml_apply_packed, packed, type, N) is the layer's
// x -> y with nothing left to look up per call (gpu_worker/models/layer_program.py)
torch::Tensor ggml_apply_packed(torch::Tensor packed, int64_t type, int64_t N, torch::Tensor x) {
  auto out = torch::empty({x.size(0), N}, x.options());
  ggml_linear_packed(x, packed, type, N, out);
  return out;
}

// Rows ``ids`` (int64, each below N) of a weight packed by ggml_pack with N rows, as
// GGML rows [len(ids), K / 32 * BYTES]: an embedding's lookups, and any reader of blocks
torch::Tensor ggml_unpack_rows(torch::Tensor packed, int64_t type, torch::Tensor ids, int64_t N, int64_t K) {
  TORCH_CHECK(ggml_packs(type), "ggml type ", type, " has no packed layout on this CPU");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "ids: int64 [n]");
  ids = ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(ip, ip + ids.numel(), [&](int64_t i) { return i >= 0 && i < N; }), "row id out of range");
#ifdef CANDOR_INT_DOTS
  return with_codes(type, [&](auto codes) {
    using T = decltype(codes);
    torch::Tensor out;
    if constexpr (IntDots<T>::value) {
      const int64_t nb = K / T::BS;
      TORCH_CHECK(K % T::BS == 0 && packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 &&
                      packed.is_contiguous() && packed.size(0) == (N + NT - 1) / NT && packed.size(1) == nb * NT * T::BYTES,
                  "packed: uint8 [", (N + NT - 1) / NT, ", ", nb * NT * T::BYTES, "] for N=", N, ", K=", K);
      out = torch::empty({ids.numel(), nb * T::BYTES}, packed.options());
      unpack_rows<T>(packed.data_ptr<uint8_t>(), nb, ip, ids.numel(), out.data_ptr<uint8_t>());
    }
    return out;
  });
#else
  return torch::Tensor();
#endif
}

torch::Tensor ggml_dequantize(torch::Tensor w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w: contiguous uint8 blocks");
  return with_ggml(type, w.data_ptr<uint8_t>(), w.size(1),
                   [&](auto deq) { return dequantize_rows(deq, w.size(0), K); });
}

void int4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, torch::Tensor zeros, int64_t group,
                 torch::Tensor out) {
  check_x_out(x, out, qs.size(0));
  const int64_t K = x.size(1);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.size(1) * 2 == K, "qs: uint8 [N, K/2]");
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group ", group, " must be a multiple of 32 dividing K=", K);
  TORCH_CHECK(scales.is_contiguous() && zeros.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
                  zeros.scalar_type() == torch::kFloat32 && scales.numel() == qs.size(0) * (K / group) &&
                  zeros.numel() == scales.numel(),
              "scales, zeros: float32 [N, K / group]");
  Int4Rows deq{qs.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), K, K / group, group};
  linear(deq, x.data_ptr<float>(), x.size(0), K, qs.size(0), out.data_ptr<float>(), out.stride(0));
}

torch::Tensor int4_dequantize(torch::Tensor qs, torch::Tensor scales, torch::Tensor zeros, int64_t group) {
  const int64_t K = qs.size(1) * 2;
  Int4Rows deq{qs.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), K, K / group, group};
  return dequantize_rows(deq, qs.size(0), K);
}

void fp8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales, int64_t bn, int64_t bk, torch::Tensor out) {
  check_x_out(x, out, w.size(0));
  const int64_t K = x.size(1);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) == K, "w: uint8 [N, K] (e4m3 bits)");
  TORCH_CHECK(bk % 32 == 0 && K % 32 == 0, "fp8: K and the scale block's width must be multiples of 32");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.dim() == 2,
              "scales: float32 [N / bn, K / bk]");
  Fp8Rows deq{w.data_ptr<uint8_t>(), scales.data_ptr<float>(), K, scales.size(1), bn, bk};
  linear(deq, x.data_ptr<float>(), x.size(0), K, w.size(0), out.data_ptr<float>(), out.stride(0));
}

torch::Tensor fp8_dequantize(torch::Tensor w, torch::Tensor scales, int64_t bn, int64_t bk) {
  Fp8Rows deq{w.data_ptr<uint8_t>(), scales.data_ptr<float>(), w.size(1), scales.size(1), bn, bk};
  return dequantize_rows(deq, w.size(0), w.size(1));
}

// Where ggml_apply_packed lives and its exact type, for a C++ caller in another module
// (gpu_worker/models/layer_loop.cpp; see row_ops.cpp's kernel_abi)
#define CANDOR_KERNEL(fn, ...) {#fn, {reinterpret_cast<int64_t>(static_cast<__VA_ARGS__>(&fn)), #__VA_ARGS__}}
std::map<std::string, std::tuple<int64_t, std::string>> kernel_abi() {
  return {
      CANDOR_KERNEL(ggml_apply_packed, torch::Tensor (*)(torch::Tensor, int64_t, int64_t, torch::Tensor)),
  };
}
