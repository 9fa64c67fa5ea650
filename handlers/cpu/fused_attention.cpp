// Attention for compiled encoder graphs on AVX-512 CPUs: softmax(q k^T * scale + mask) v, one (batch, head) at a
// time, whole, in registers and L1. PyTorch's CPU flash kernel cuts each head into blocks of 32 queries and calls two
// small GEMMs per block: at head size 32 and a few hundred tokens those calls cost more than their arithmetic.
// Built by handlers/cpu/fused_attention.py with the machine's compiler (-march=native) and registered as
// torch.ops.pt2_handlers.fused_attention.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "fused_attention needs AVX-512 (F and BW); handlers/cpu/fused_attention.py builds it only where the CPU has them"
#endif

namespace {

constexpr int64_t kRows = 4;  // queries per block: 4 x 2 accumulators keep the FMA pipes busy

struct Args {
  const void *q, *k, *v, *mask;
  void* out;
  int64_t S, L, D;                        // queries, keys, head size
  int64_t qs[3], ks[3], vs[3], os[3];     // strides in elements: batch, head, row (the last dim is contiguous)
  int64_t ms[4];                          // mask strides: batch, head, query, key (0 where broadcast)
  float scale;
  int mask_kind;                          // 0 none, 1 bool (true attends), 2 float32 added to the scores
  bool q_bf16, k_bf16, v_bf16, out_bf16;  // else float32
};

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float load(bool bf16, const void* p, int64_t i) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline int64_t round_up(int64_t n, int64_t width) { return (n + width - 1) / width * width; }

// e^x for x <= 0 (scores less their row's maximum; -inf for masked keys gives exactly 0), 16 at a time:
// 2^(x log2 e) as a power of two (scalef) times a polynomial for the fraction (relative error ~1e-7).
inline __m512 exp_nonpositive(__m512 x) {
  // below -160 (base 2) the power underflows to 0 exactly, and -inf takes no NaN on the way
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-160.0f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180686e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503334e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, whole);
}

// The keys one head computes, and the bias added to their scores: 0 or the mask's value, -inf where a key must not
// be attended to. When the mask is the same for every query (a padding mask, the usual case) the bias is one row
// for the whole head and the keys past the last attended one are skipped: they would contribute exactly nothing.
struct Keys {
  int64_t used;    // keys [0, used) are read
  int64_t padded;  // used rounded up to the block width; keys [used, padded) are zeros with a bias of -inf
  bool per_query;  // the mask varies across queries: each row's bias is read from it (row_bias)
};

// The L mask entries of one row from element ``at`` as scores' biases: a bool mask's false -> -inf, true -> 0; a
// float mask's values as they are.
void mask_row_as_bias(const Args& a, int64_t at, float* bias) {
  const int64_t step = a.ms[3];
  if (a.mask_kind == 1) {
    const bool* m = static_cast<const bool*>(a.mask) + at;
    for (int64_t j = 0; j < a.L; j++) bias[j] = m[j * step] ? 0.0f : -INFINITY;
  } else {
    const float* m = static_cast<const float*>(a.mask) + at;
    for (int64_t j = 0; j < a.L; j++) bias[j] = m[j * step];
  }
}

Keys plan_keys(const Args& a, int64_t b, int64_t h, int64_t width, float* bias) {
  const int64_t L = a.L;
  Keys keys{L, 0, a.mask_kind != 0 && a.ms[2] != 0};
  if (a.mask_kind == 0 || keys.per_query) {
    std::fill(bias, bias + L, 0.0f);
  } else {
    mask_row_as_bias(a, b * a.ms[0] + h * a.ms[1], bias);
    while (keys.used > 0 && bias[keys.used - 1] == -INFINITY) keys.used--;
  }
  keys.padded = round_up(keys.used, width);
  std::fill(bias + keys.used, bias + keys.padded, -INFINITY);
  return keys;
}

// Query i's bias where the mask varies across queries; keys [L, padded) get -inf.
void row_bias(const Args& a, int64_t b, int64_t h, int64_t i, int64_t padded, float* bias) {
  mask_row_as_bias(a, b * a.ms[0] + h * a.ms[1] + i * a.ms[2], bias);
  std::fill(bias + a.L, bias + padded, -INFINITY);
}

// The bias rows of a block of kRows queries from i0 (rows past S repeat the last query, so every row is finite):
// the head's own row, or each query's, written to rows_buffer.
void block_biases(const Args& a, int64_t b, int64_t h, int64_t i0, const Keys& keys, const float* head_bias,
                  float* rows_buffer, const float* biases[kRows]) {
  for (int64_t r = 0; r < kRows; r++) {
    if (!keys.per_query) {
      biases[r] = head_bias;
      continue;
    }
    float* row = rows_buffer + r * keys.padded;
    row_bias(a, b, h, std::min(i0 + r, a.S - 1), keys.padded, row);
    biases[r] = row;
  }
}

// One 16-wide block of a row's scores: the products times scale plus the bias, kept and folded into the row's max.
inline void finish_scores(__m512 products, float scale, const float* bias, float* scores, __m512& top) {
  const __m512 s = _mm512_fmadd_ps(products, _mm512_set1_ps(scale), _mm512_loadu_ps(bias));
  _mm512_storeu_ps(scores, s);
  top = _mm512_max_ps(top, s);
}

// Row scores s[0, n) with maximum top -> unnormalized probabilities e^(s - top), written by put(j, e) 16 at a time;
// returns 1 / their sum, 0 where the query attends to nothing (its probabilities all 0).
template <typename Put>
float exponentiate(const float* s, int64_t n, __m512 top, Put put) {
  const float row_top = _mm512_reduce_max_ps(top);
  const __m512 shift = _mm512_set1_ps(row_top == -INFINITY ? 0.0f : row_top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
    put(j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return row_top == -INFINITY ? 0.0f : 1.0f / _mm512_reduce_add_ps(sum);
}

// 16 output values (one query, 16 of its head's dims) times 1 / the row's sum, in the output's dtype.
inline void store16(const Args& a, int64_t at, __m512 values) {
  if (a.out_bf16) {
    uint16_t* out = static_cast<uint16_t*>(a.out) + at;
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(values));
#else
    alignas(64) float row[16];
    _mm512_store_ps(row, values);
    for (int d = 0; d < 16; d++) out[d] = float_to_bf16(row[d]);
#endif
  } else {
    _mm512_storeu_ps(static_cast<float*>(a.out) + at, values);
  }
}

void zero_head(const Args& a, int64_t b, int64_t h) {  // a head whose every query attends to nothing
  for (int64_t i = 0; i < a.S; i++)
    for (int64_t d = 0; d < a.D; d += 16) store16(a, b * a.os[0] + h * a.os[1] + i * a.os[2] + d, _mm512_setzero_ps());
}

// c[r] = sum over t < n of a[r * a_stride + t] * b[t * b_stride + (0..15)], for kRows rows of a: one 16-wide column
// block of a small matrix product (queries x keys^T, then probabilities x values).
inline void rows_times_block(const float* a, int64_t a_stride, const float* b, int64_t b_stride, int64_t n,
                             __m512* c) {
  for (int64_t r = 0; r < kRows; r++) c[r] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t++) {
    const __m512 column = _mm512_loadu_ps(b + t * b_stride);
    for (int64_t r = 0; r < kRows; r++) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * a_stride + t]), column, c[r]);
  }
}

// float32 math (16-wide FMAs), for float32 inputs or a head size that is not a multiple of 32. D % 16 == 0.
void head_fp32(const Args& a, int64_t b, int64_t h, std::vector<float>& buffer) {
  const int64_t S = a.S, D = a.D, Lmax = round_up(a.L, 16);
  buffer.resize(Lmax + kRows * Lmax + 2 * Lmax * D + kRows * Lmax + kRows * D);
  float *head_bias = buffer.data(), *rows_bias = head_bias + Lmax, *kt = rows_bias + kRows * Lmax;
  const Keys keys = plan_keys(a, b, h, 16, head_bias);
  const int64_t Lp = keys.padded;
  if (Lp == 0) return zero_head(a, b, h);
  float *vf = kt + Lp * D, *s = vf + Lp * D, *qf = s + kRows * Lp;
  for (int64_t j = 0; j < Lp; j++) {  // keys transposed [D][Lp], values [Lp][D], zero past the keys used
    const int64_t ko = b * a.ks[0] + h * a.ks[1] + j * a.ks[2], vo = b * a.vs[0] + h * a.vs[1] + j * a.vs[2];
    for (int64_t d = 0; d < D; d++) {
      kt[d * Lp + j] = j < keys.used ? load(a.k_bf16, a.k, ko + d) : 0.0f;
      vf[j * D + d] = j < keys.used ? load(a.v_bf16, a.v, vo + d) : 0.0f;
    }
  }
  const float* biases[kRows];
  for (int64_t i0 = 0; i0 < S; i0 += kRows) {
    const int64_t rows = std::min(kRows, S - i0);
    for (int64_t r = 0; r < kRows; r++) {
      const int64_t qo = b * a.qs[0] + h * a.qs[1] + std::min(i0 + r, S - 1) * a.qs[2];
      for (int64_t d = 0; d < D; d++) qf[r * D + d] = load(a.q_bf16, a.q, qo + d) * a.scale;
    }
    block_biases(a, b, h, i0, keys, head_bias, rows_bias, biases);
    __m512 top[kRows];
    for (int64_t r = 0; r < kRows; r++) top[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Lp; j += 16) {
      __m512 c[kRows];
      rows_times_block(qf, D, kt + j, Lp, D, c);
      for (int64_t r = 0; r < kRows; r++) finish_scores(c[r], 1.0f, biases[r] + j, s + r * Lp + j, top[r]);
    }
    float inverse[kRows];
    for (int64_t r = 0; r < kRows; r++) {
      float* row = s + r * Lp;
      inverse[r] = exponentiate(row, Lp, top[r], [row](int64_t j, __m512 e) { _mm512_storeu_ps(row + j, e); });
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 o[kRows];
      rows_times_block(s, Lp, vf + d0, D, Lp, o);
      for (int64_t r = 0; r < rows; r++)
        store16(a, b * a.os[0] + h * a.os[1] + (i0 + r) * a.os[2] + d0, _mm512_mul_ps(o[r], _mm512_set1_ps(inverse[r])));
    }
  }
}

#if defined(__AVX512BF16__)
// One head's keys as pairs along d [D/2][Lp], zero past the keys used: the layout bf16 products (and AMX) read.
void stage_keys(const Args& a, int64_t b, int64_t h, const Keys& keys, uint32_t* kp) {
  const int64_t Lp = keys.padded, pairs = a.D / 2;
  const uint16_t* k = static_cast<const uint16_t*>(a.k);
  for (int64_t j = 0; j < Lp; j++) {
    const bool used = j < keys.used;
    const uint32_t* key_pairs = reinterpret_cast<const uint32_t*>(k + b * a.ks[0] + h * a.ks[1] + j * a.ks[2]);
    for (int64_t p = 0; p < pairs; p++) kp[p * Lp + j] = used ? key_pairs[p] : 0u;
  }
}

// Permutations of two rows of 32 bf16 into their pairs: [0 of the first, 0 of the second, 1 of the first, ...].
struct RowPairs {
  __m512i first, second;  // dims 0-15, dims 16-31
  RowPairs() {
    alignas(64) uint16_t low[32], high[32];
    for (int t = 0; t < 16; t++) {
      low[2 * t] = t, low[2 * t + 1] = 32 + t;
      high[2 * t] = 16 + t, high[2 * t + 1] = 48 + t;
    }
    first = _mm512_load_si512(low), second = _mm512_load_si512(high);
  }
  // bf16 rows even and odd (D of each) -> D pairs at out
  void interleave(const uint16_t* even, const uint16_t* odd, int64_t D, uint32_t* out) const {
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i e = _mm512_loadu_si512(even + d), o = _mm512_loadu_si512(odd + d);
      _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(e, first, o));
      _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(e, second, o));
    }
  }
};

// One head's values as pairs along keys [Lp/2][D] (bf16) or rows [Lp][D] (float32), zero past the keys used.
template <bool kBf16Values>
void stage_values(const Args& a, int64_t b, int64_t h, const Keys& keys, uint32_t* vp) {
  const int64_t D = a.D;
  float* vf = reinterpret_cast<float*>(vp);
  const RowPairs pairing;
  uint16_t value_rows[2][512];
  for (int64_t j = 0; j < keys.padded; j++) {
    const bool used = j < keys.used;
    const int64_t vo = b * a.vs[0] + h * a.vs[1] + j * a.vs[2];
    if (!kBf16Values) {
      float* row = vf + j * D;
      if (used) {
        std::memcpy(row, static_cast<const float*>(a.v) + vo, D * sizeof(float));
      } else {
        std::fill(row, row + D, 0.0f);
      }
      continue;
    }
    if (used) {
      std::memcpy(value_rows[j & 1], static_cast<const uint16_t*>(a.v) + vo, D * 2);
    } else {
      std::memset(value_rows[j & 1], 0, D * 2);
    }
    if (j & 1) pairing.interleave(value_rows[0], value_rows[1], D, vp + (j / 2) * D);
  }
}

// Queries and keys in bf16 (two products per lane and instruction, exact, summed in float32), float32 softmax. Values
// in bf16 too (kBf16Values): probabilities rounded to bf16 for the same instruction, as SDPA does in bf16. Values in
// float32 (an int8 model's value projection kept in float): float32 probabilities times float32 values, as SDPA would
// compute them once it promoted the rest. D % 32 == 0.
template <bool kBf16Values>
void head_bf16(const Args& a, int64_t b, int64_t h, std::vector<float>& buffer) {
  const int64_t S = a.S, D = a.D, Lmax = round_up(a.L, 32), pairs = D / 2;
  buffer.resize(Lmax + kRows * Lmax + Lmax * D / 2 + Lmax * D + kRows * Lmax + kRows * Lmax / 2 + kRows * pairs);
  float *head_bias = buffer.data(), *rows_bias = head_bias + Lmax;
  const Keys keys = plan_keys(a, b, h, 32, head_bias);
  const int64_t Lp = keys.padded;
  if (Lp == 0) return zero_head(a, b, h);
  // keys as pairs along d [D/2][Lp]; values as pairs along keys [Lp/2][D] (bf16) or rows [Lp][D] (float32); scores;
  // probabilities as pairs (bf16 values); queries as pairs
  uint32_t* kp = reinterpret_cast<uint32_t*>(rows_bias + kRows * Lmax);
  uint32_t* vp = kp + pairs * Lp;
  float* vf = reinterpret_cast<float*>(vp);
  float* s = vf + (kBf16Values ? Lp * D / 2 : Lp * D);
  uint32_t* pp = reinterpret_cast<uint32_t*>(s + kRows * Lp);
  uint32_t* qp = pp + kRows * Lp / 2;
  stage_keys(a, b, h, keys, kp);
  stage_values<kBf16Values>(a, b, h, keys, vp);
  const float* biases[kRows];
  for (int64_t i0 = 0; i0 < S; i0 += kRows) {
    const int64_t rows = std::min(kRows, S - i0);
    for (int64_t r = 0; r < kRows; r++) {
      const int64_t qo = b * a.qs[0] + h * a.qs[1] + std::min(i0 + r, S - 1) * a.qs[2];
      std::memcpy(qp + r * pairs, static_cast<const uint16_t*>(a.q) + qo, D * 2);
    }
    block_biases(a, b, h, i0, keys, head_bias, rows_bias, biases);
    __m512 top[kRows];
    for (int64_t r = 0; r < kRows; r++) top[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < Lp; j += 32) {
      __m512 c[kRows][2];
      for (int64_t r = 0; r < kRows; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * Lp + j);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * Lp + j + 16);
        for (int64_t r = 0; r < kRows; r++) {
          const __m512bh query = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + p]));
          c[r][0] = _mm512_dpbf16_ps(c[r][0], query, k0);
          c[r][1] = _mm512_dpbf16_ps(c[r][1], query, k1);
        }
      }
      for (int64_t r = 0; r < kRows; r++) {
        finish_scores(c[r][0], a.scale, biases[r] + j, s + r * Lp + j, top[r]);
        finish_scores(c[r][1], a.scale, biases[r] + j + 16, s + r * Lp + j + 16, top[r]);
      }
    }
    float inverse[kRows];
    for (int64_t r = 0; r < kRows; r++) {
      float* row = s + r * Lp;
      uint16_t* probabilities = reinterpret_cast<uint16_t*>(pp + r * Lp / 2);
      inverse[r] = exponentiate(row, Lp, top[r], [row, probabilities](int64_t j, __m512 e) {
        if (kBf16Values) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(probabilities + j), (__m256i)_mm512_cvtneps_pbh(e));
        } else {
          _mm512_storeu_ps(row + j, e);
        }
      });
    }
    if (!kBf16Values) {
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 o[kRows];
        rows_times_block(s, Lp, vf + d0, D, Lp, o);
        for (int64_t r = 0; r < rows; r++)
          store16(a, b * a.os[0] + h * a.os[1] + (i0 + r) * a.os[2] + d0,
                  _mm512_mul_ps(o[r], _mm512_set1_ps(inverse[r])));
      }
      continue;
    }
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      __m512 o[kRows][2];
      for (int64_t r = 0; r < kRows; r++) o[r][0] = o[r][1] = _mm512_setzero_ps();
      for (int64_t m = 0; m < Lp / 2; m++) {
        const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + m * D + d0);
        const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + m * D + d0 + 16);
        for (int64_t r = 0; r < kRows; r++) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * Lp / 2 + m]));
          o[r][0] = _mm512_dpbf16_ps(o[r][0], p, v0);
          o[r][1] = _mm512_dpbf16_ps(o[r][1], p, v1);
        }
      }
      for (int64_t r = 0; r < rows; r++) {
        const int64_t at = b * a.os[0] + h * a.os[1] + (i0 + r) * a.os[2] + d0;
        store16(a, at, _mm512_mul_ps(o[r][0], _mm512_set1_ps(inverse[r])));
        store16(a, at + 16, _mm512_mul_ps(o[r][1], _mm512_set1_ps(inverse[r])));
      }
    }
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// On CPUs with AMX (Sapphire Rapids and later) the two products run on tiles: 16 queries at once, one instruction per
// 16 x 16 block of scores (32 dims) and per 16 queries x 16 dims of output (32 keys); the softmax between them is the
// AVX-512 code above. Same layouts, same roundings as head_bf16: bf16 inputs, float32 sums, bf16 probabilities for
// bf16 values (float32 values: float32 probabilities, FMAs). At MiniLM's 8 x 128 tokens a call took a third of the
// AVX-512 path's time.
#define PT2_HANDLERS_AMX 1
constexpr int64_t kTileRows = 16;  // queries per block: a tile's rows

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte layout
  uint8_t palette = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 scores (16 queries x 16 keys, float32), 1 queries (16 x 32 dims, bf16), 2 keys (16 dim pairs x 16 keys),
// 3 probabilities (16 queries x 32 keys, bf16), 4-5 values (16 key pairs x 16 dims), 6-7 outputs (16 x 16, float32).
TileConfig attention_tiles() {
  TileConfig config;
  config.palette = 1;
  for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
  return config;
}

// Linux lets a process use AMX's tile data only once it asks (arch_prctl); torch's oneDNN asks the same way when it
// first needs AMX. A refusal (an old kernel) leaves the AVX-512 path.
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                      18 /* XFEATURE_XTILEDATA */) == 0;
  return granted;
}

// This thread's tiles configured for attention while it lives; the caller's configuration put back after (torch's
// AMX kernels may keep theirs loaded between calls and would not reload it).
class AttentionTiles {
 public:
  AttentionTiles() {
    static const TileConfig mine = attention_tiles();
    _tile_storeconfig(&saved_);
    _tile_loadconfig(&mine);
  }
  ~AttentionTiles() {
    if (saved_.palette == 0) {
      _tile_release();
    } else {
      _tile_loadconfig(&saved_);
    }
  }
  AttentionTiles(const AttentionTiles&) = delete;
  AttentionTiles& operator=(const AttentionTiles&) = delete;

 private:
  TileConfig saved_;
};

// bf16 -> float32, 16 at a time (exact: a bf16 is a float32's top half)
inline __m512 bf16_to_float16x(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// x as the sum of two bf16 numbers (high = x rounded, low = what rounding left, rounded): their products with another
// such pair, less the low x low term, are float32's to about 2^-16 where bf16's alone are good to 2^-8.
inline void split_bf16(__m512 x, uint16_t* high, uint16_t* low) {
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(high), rounded);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(low),
                      (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, bf16_to_float16x(rounded))));
}

// float32 values as two bf16 halves, each in pairs along keys [Lp/2][D] (as stage_values lays out bf16
// values), zero past the keys used: for AMX, which multiplies bf16 only.
void stage_split_values(const Args& a, int64_t b, int64_t h, const Keys& keys, uint32_t* high_pairs,
                        uint32_t* low_pairs) {
  const int64_t D = a.D;
  const RowPairs pairing;
  alignas(64) uint16_t high[2][512], low[2][512];
  for (int64_t j = 0; j < keys.padded; j++) {
    const float* row = static_cast<const float*>(a.v) + b * a.vs[0] + h * a.vs[1] + j * a.vs[2];
    for (int64_t d = 0; d < D; d += 16)
      split_bf16(j < keys.used ? _mm512_loadu_ps(row + d) : _mm512_setzero_ps(), high[j & 1] + d, low[j & 1] + d);
    if (j & 1) {
      pairing.interleave(high[0], high[1], D, high_pairs + (j / 2) * D);
      pairing.interleave(low[0], low[1], D, low_pairs + (j / 2) * D);
    }
  }
}

template <bool kBf16Values>
void head_amx(const Args& a, int64_t b, int64_t h, std::vector<float>& buffer) {
  const int64_t S = a.S, D = a.D, Lmax = round_up(a.L, 32), pairs = D / 2;
  buffer.resize(Lmax + Lmax * D / 2 + Lmax * D + kTileRows * Lmax * 2 + kTileRows * D / 2 + kTileRows * 32);
  float* head_bias = buffer.data();
  const Keys keys = plan_keys(a, b, h, 32, head_bias);
  if (keys.per_query) return head_bf16<kBf16Values>(a, b, h, buffer);  // a bias row per query: rare, 4 rows at a time
  const int64_t Lp = keys.padded;
  if (Lp == 0) return zero_head(a, b, h);
  // keys as head_bf16 stages them; values: bf16 pairs [Lp/2][D] (vh), and float32 values' low halves after them (vl);
  // scores [16][Lp] float32; probabilities [16][Lp] bf16 (ph), float32 values' low halves after them (pl); queries
  // [16][D] bf16; outputs [16][32] float32
  uint32_t* kp = reinterpret_cast<uint32_t*>(head_bias + Lmax);
  uint32_t* vh = kp + pairs * Lp;
  uint32_t* vl = vh + Lp * D / 2;
  float* s = reinterpret_cast<float*>(vl + Lp * D / 2);
  uint16_t* ph = reinterpret_cast<uint16_t*>(s + kTileRows * Lp);
  uint16_t* pl = ph + kTileRows * Lp;
  uint16_t* q = pl + kTileRows * Lp;
  float* o = reinterpret_cast<float*>(q + kTileRows * D);
  stage_keys(a, b, h, keys, kp);
  if (kBf16Values) {
    stage_values<true>(a, b, h, keys, vh);
  } else {
    stage_split_values(a, b, h, keys, vh, vl);
  }
  const uint16_t* queries = static_cast<const uint16_t*>(a.q);
  for (int64_t i0 = 0; i0 < S; i0 += kTileRows) {
    // rows past S repeat the last query; each row of a tile product depends on its own row only, so what those rows
    // (and the probability rows never written for them) hold reaches no output
    const int64_t rows = std::min(kTileRows, S - i0);
    for (int64_t r = 0; r < kTileRows; r++)
      std::memcpy(q + r * D, queries + b * a.qs[0] + h * a.qs[1] + std::min(i0 + r, S - 1) * a.qs[2], D * 2);
    for (int64_t j = 0; j < Lp; j += 16) {
      _tile_zero(0);
      for (int64_t c = 0; c < D; c += 32) {
        _tile_loadd(1, q + c, D * 2);
        _tile_loadd(2, kp + (c / 2) * Lp + j, Lp * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, s + j, Lp * 4);
    }
    float inverse[kTileRows];
    for (int64_t r = 0; r < rows; r++) {
      float* row = s + r * Lp;
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < Lp; j += 16) finish_scores(_mm512_loadu_ps(row + j), a.scale, head_bias + j, row + j, top);
      uint16_t *high = ph + r * Lp, *low = pl + r * Lp;
      inverse[r] = exponentiate(row, Lp, top, [high, low](int64_t j, __m512 e) {
        if (kBf16Values) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + j), (__m256i)_mm512_cvtneps_pbh(e));
        } else {
          split_bf16(e, high + j, low + j);
        }
      });
    }
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      // tiles 6 and 7 sum 16 dims each: probabilities (3; low halves 0) times values (4 and 1; low halves 5 and 2)
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t m = 0; m < Lp; m += 32) {
        _tile_loadd(3, ph + m, Lp * 2);
        _tile_loadd(4, vh + (m / 2) * D + d0, D * 4);
        _tile_loadd(1, vh + (m / 2) * D + d0 + 16, D * 4);
        _tile_dpbf16ps(6, 3, 4);
        _tile_dpbf16ps(7, 3, 1);
        if (!kBf16Values) {
          _tile_loadd(0, pl + m, Lp * 2);
          _tile_loadd(5, vl + (m / 2) * D + d0, D * 4);
          _tile_loadd(2, vl + (m / 2) * D + d0 + 16, D * 4);
          _tile_dpbf16ps(6, 3, 5);
          _tile_dpbf16ps(7, 3, 2);
          _tile_dpbf16ps(6, 0, 4);
          _tile_dpbf16ps(7, 0, 1);
        }
      }
      _tile_stored(6, o, 32 * 4);
      _tile_stored(7, o + 16, 32 * 4);
      for (int64_t r = 0; r < rows; r++) {
        const int64_t at = b * a.os[0] + h * a.os[1] + (i0 + r) * a.os[2] + d0;
        store16(a, at, _mm512_mul_ps(_mm512_loadu_ps(o + r * 32), _mm512_set1_ps(inverse[r])));
        store16(a, at + 16, _mm512_mul_ps(_mm512_loadu_ps(o + r * 32 + 16), _mm512_set1_ps(inverse[r])));
      }
    }
  }
}
#endif

std::array<int64_t, 3> row_strides(const at::Tensor& t) {  // [B, H, S, D] -> batch, head, row; 0 where broadcast
  std::array<int64_t, 3> out{};
  for (int i = 0; i < 3; i++) out[i] = t.size(i) == 1 ? 0 : t.stride(i);
  return out;
}

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// q [B, H, S, D], k and v [B, H, L, D] (bf16 or float32, each its own), mask broadcastable to [B, H, S, L]
// (bool: true attends; or added to the scores) -> [B, S, H, D] in q's dtype, as transformers' attention functions
// return it. AMX tiles where the CPU has them and ``amx`` allows.
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::optional<at::Tensor>& mask, double scale, bool allow_amx) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "fused_attention: q, k, v must be 4-D");
  const int64_t B = query.size(0), H = query.size(1), S = query.size(2), D = query.size(3), L = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B && key.size(1) == H && value.size(1) == H &&
              value.size(2) == L && key.size(3) == D && value.size(3) == D, "fused_attention: shapes do not match");
  TORCH_CHECK(D % 16 == 0 && D <= 512, "fused_attention: head size must be a multiple of 16, at most 512");
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == at::kFloat || is_bf16(*t), "fused_attention: bf16 or float32 only");
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  at::Tensor out = at::empty({B, S, H, D}, q.options());
  at::Tensor m;
  Args a{};
  if (mask.has_value()) {
    m = *mask;
    TORCH_CHECK(m.dim() <= 4, "fused_attention: the mask has more than 4 dims");
    while (m.dim() < 4) m = m.unsqueeze(0);
    m = m.scalar_type() == at::kBool ? m : m.to(at::kFloat);
    m = m.expand({B, H, S, L});
    for (int i = 0; i < 4; i++) a.ms[i] = m.size(i) == 1 ? 0 : m.stride(i);
    a.mask = m.data_ptr();
    a.mask_kind = m.scalar_type() == at::kBool ? 1 : 2;
  }
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr(), a.out = out.data_ptr();
  a.S = S, a.L = L, a.D = D;
  const auto qs = row_strides(q), ks = row_strides(k), vs = row_strides(v);
  for (int i = 0; i < 3; i++) a.qs[i] = qs[i], a.ks[i] = ks[i], a.vs[i] = vs[i];
  a.os[0] = out.stride(0), a.os[1] = out.stride(2), a.os[2] = out.stride(1);
  a.scale = static_cast<float>(scale);
  a.q_bf16 = is_bf16(q), a.k_bf16 = is_bf16(k), a.v_bf16 = is_bf16(v), a.out_bf16 = is_bf16(out);
  // bf16 dot products only for what is bf16 already: a float32 input is never rounded (SDPA would promote the rest)
#if defined(__AVX512BF16__)
  const bool bf16_scores = D % 32 == 0 && a.q_bf16 && a.k_bf16;
#else
  const bool bf16_scores = false;
#endif
#if defined(PT2_HANDLERS_AMX)
  const bool amx = allow_amx && bf16_scores && amx_granted();
#endif
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
#if defined(PT2_HANDLERS_AMX)
    if (amx) {
      const AttentionTiles tiles;
      for (int64_t t = begin; t < end; t++)
        a.v_bf16 ? head_amx<true>(a, t / H, t % H, buffer) : head_amx<false>(a, t / H, t % H, buffer);
      return;
    }
#endif
    for (int64_t t = begin; t < end; t++) {
#if defined(__AVX512BF16__)
      if (bf16_scores) {
        a.v_bf16 ? head_bf16<true>(a, t / H, t % H, buffer) : head_bf16<false>(a, t / H, t % H, buffer);
        continue;
      }
#endif
      head_fp32(a, t / H, t % H, buffer);
    }
  });
  return out;
}

at::Tensor fused_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& mask, double scale) {
  return attend(query, key, value, mask, scale, true);
}

// The same without AMX: the path CPUs without it take, for tests and benchmarks on CPUs with it.
at::Tensor fused_attention_avx512(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const std::optional<at::Tensor>& mask, double scale) {
  return attend(query, key, value, mask, scale, false);
}

// Which instructions a call with bf16 queries and keys (head size a multiple of 32) runs on this CPU.
std::string fused_attention_isa() {
#if defined(PT2_HANDLERS_AMX)
  if (amx_granted()) return "amx_bf16";
#endif
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#else
  return "avx512f";
#endif
}

}  // namespace

TORCH_LIBRARY(pt2_handlers, m) {
  m.def("fused_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.def("fused_attention_avx512(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.def("fused_attention_isa() -> str", fused_attention_isa);
}

TORCH_LIBRARY_IMPL(pt2_handlers, CPU, m) {
  m.impl("fused_attention", fused_attention);
  m.impl("fused_attention_avx512", fused_attention_avx512);
}
