// Attention for compiled encoder graphs on AVX-512 CPUs: softmax(q k^T * scale + mask) v, one (batch, head) at a
// time, whole, in registers and L1. PyTorch's CPU flash kernel cuts each head into blocks of 32 queries and calls two
// small GEMMs per block: at head size 32 and a few hundred tokens those calls cost more than their arithmetic.
// Built by handlers/fused_attention.py with the machine's compiler (-march=native) and registered as
// torch.ops.pt2_handlers.fused_attention.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "fused_attention needs AVX-512 (F and BW); handlers/fused_attention.py builds it only where the CPU has them"
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

// e^x for x <= 0 (scores less their row's maximum), 16 at a time: 2^(x log2 e) as an exponent and a polynomial for
// the fraction (relative error ~1e-7).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6180686e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503334e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(power));
}

// Row i's scores s[0, L) -> probabilities in place, 0 for masked keys and up to Lp (a multiple of 16; s has room);
// returns 1 / their sum (0 where every key is masked).
float softmax_row(const Args& a, int64_t b, int64_t h, int64_t i, float* s, int64_t L, int64_t Lp) {
  const __m512 minus_infinity = _mm512_set1_ps(-INFINITY);
  for (int64_t j = L; j < Lp; j++) s[j] = -INFINITY;
  if (a.mask_kind != 0) {
    const int64_t at = b * a.ms[0] + h * a.ms[1] + i * a.ms[2], step = a.ms[3];
    if (a.mask_kind == 1) {
      const bool* m = static_cast<const bool*>(a.mask) + at;
      if (step == 1) {  // the usual layout: one row of the mask per query
        for (int64_t j = 0; j < L; j++) s[j] = m[j] ? s[j] : -INFINITY;
      } else {
        for (int64_t j = 0; j < L; j++) s[j] = m[j * step] ? s[j] : -INFINITY;
      }
    } else {
      const float* m = static_cast<const float*>(a.mask) + at;
      for (int64_t j = 0; j < L; j++) s[j] += m[j * step];
    }
  }
  __m512 top = minus_infinity;
  for (int64_t j = 0; j < Lp; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
  const float row_top = _mm512_reduce_max_ps(top);
  if (row_top == -INFINITY) {
    for (int64_t j = 0; j < Lp; j++) s[j] = 0.0f;
    return 0.0f;
  }
  const __m512 shift = _mm512_set1_ps(row_top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < Lp; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    // masked keys (-inf) to 0 exactly, not e^-87
    const __mmask16 live = _mm512_cmp_ps_mask(x, minus_infinity, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(x, shift)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

void store_row(const Args& a, int64_t at, const float* values, int64_t n) {
  if (a.out_bf16) {
    uint16_t* out = static_cast<uint16_t*>(a.out) + at;
    for (int64_t d = 0; d < n; d++) out[d] = float_to_bf16(values[d]);
  } else {
    std::memcpy(static_cast<float*>(a.out) + at, values, n * sizeof(float));
  }
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
  const int64_t S = a.S, L = a.L, D = a.D, Lp = (L + 15) & ~int64_t{15};
  buffer.resize(2 * Lp * D + kRows * Lp + kRows * D);
  float *kt = buffer.data(), *vf = kt + Lp * D, *s = vf + Lp * D, *qf = s + kRows * Lp;
  for (int64_t j = 0; j < Lp; j++) {  // keys transposed [D][Lp], values [Lp][D], zero past L
    const int64_t ko = b * a.ks[0] + h * a.ks[1] + j * a.ks[2], vo = b * a.vs[0] + h * a.vs[1] + j * a.vs[2];
    for (int64_t d = 0; d < D; d++) {
      kt[d * Lp + j] = j < L ? load(a.k_bf16, a.k, ko + d) : 0.0f;
      vf[j * D + d] = j < L ? load(a.v_bf16, a.v, vo + d) : 0.0f;
    }
  }
  for (int64_t i0 = 0; i0 < S; i0 += kRows) {
    const int64_t rows = std::min(kRows, S - i0);
    for (int64_t r = 0; r < kRows; r++) {
      const int64_t qo = b * a.qs[0] + h * a.qs[1] + (i0 + std::min(r, rows - 1)) * a.qs[2];
      for (int64_t d = 0; d < D; d++) qf[r * D + d] = load(a.q_bf16, a.q, qo + d) * a.scale;
    }
    for (int64_t j = 0; j < Lp; j += 16) {
      __m512 c[kRows];
      rows_times_block(qf, D, kt + j, Lp, D, c);
      for (int64_t r = 0; r < kRows; r++) _mm512_storeu_ps(s + r * Lp + j, c[r]);
    }
    float inverse[kRows];
    for (int64_t r = 0; r < rows; r++) {
      inverse[r] = softmax_row(a, b, h, i0 + r, s + r * Lp, L, Lp);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512 o[kRows];
      rows_times_block(s, Lp, vf + d0, D, Lp, o);
      for (int64_t r = 0; r < rows; r++) {
        float row[16];
        _mm512_storeu_ps(row, _mm512_mul_ps(o[r], _mm512_set1_ps(inverse[r])));
        store_row(a, b * a.os[0] + h * a.os[1] + (i0 + r) * a.os[2] + d0, row, 16);
      }
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 dot products (two products per lane and instruction), float32 sums and softmax. D % 32 == 0.
void row_as_bf16(bool bf16, const void* p, int64_t at, int64_t D, uint16_t* row) {
  if (bf16) {
    std::memcpy(row, static_cast<const uint16_t*>(p) + at, D * 2);
    return;
  }
  const float* f = static_cast<const float*>(p) + at;
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(f + d)));
}

void head_bf16(const Args& a, int64_t b, int64_t h, std::vector<float>& buffer) {
  const int64_t S = a.S, L = a.L, D = a.D, Lp = (L + 31) & ~int64_t{31}, pairs = D / 2;
  buffer.resize(Lp * D + kRows * Lp + kRows * Lp / 2 + kRows * pairs + D);
  // keys as pairs along d [D/2][Lp], values as pairs along keys [Lp/2][D], scores, probabilities as pairs, queries
  uint32_t* kp = reinterpret_cast<uint32_t*>(buffer.data());
  uint32_t* vp = kp + pairs * Lp;
  float* s = reinterpret_cast<float*>(vp + Lp / 2 * D);
  uint32_t* pp = reinterpret_cast<uint32_t*>(s + kRows * Lp);
  uint32_t* qp = pp + kRows * Lp / 2;
  uint16_t key_row[512], value_rows[2][512];
  alignas(64) uint16_t low[32], high[32];
  for (int t = 0; t < 16; t++) {
    low[2 * t] = t, low[2 * t + 1] = 32 + t;
    high[2 * t] = 16 + t, high[2 * t + 1] = 48 + t;
  }
  const __m512i low_pairs = _mm512_load_si512(low), high_pairs = _mm512_load_si512(high);
  for (int64_t j = 0; j < Lp; j++) {
    if (j < L) {
      row_as_bf16(a.k_bf16, a.k, b * a.ks[0] + h * a.ks[1] + j * a.ks[2], D, key_row);
      row_as_bf16(a.v_bf16, a.v, b * a.vs[0] + h * a.vs[1] + j * a.vs[2], D, value_rows[j & 1]);
    } else {
      std::memset(key_row, 0, D * 2);
      std::memset(value_rows[j & 1], 0, D * 2);
    }
    const uint32_t* key_pairs = reinterpret_cast<const uint32_t*>(key_row);
    for (int64_t p = 0; p < pairs; p++) kp[p * Lp + j] = key_pairs[p];
    if (j & 1) {  // interleave rows j-1 and j: [d0 of j-1, d0 of j, d1 of j-1, ...]
      uint32_t* out = vp + (j / 2) * D;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i even = _mm512_loadu_si512(value_rows[0] + d), odd = _mm512_loadu_si512(value_rows[1] + d);
        _mm512_storeu_si512(out + d, _mm512_permutex2var_epi16(even, low_pairs, odd));
        _mm512_storeu_si512(out + d + 16, _mm512_permutex2var_epi16(even, high_pairs, odd));
      }
    }
  }
  for (int64_t i0 = 0; i0 < S; i0 += kRows) {
    const int64_t rows = std::min(kRows, S - i0);
    for (int64_t r = 0; r < kRows; r++) {
      const int64_t qo = b * a.qs[0] + h * a.qs[1] + (i0 + std::min(r, rows - 1)) * a.qs[2];
      row_as_bf16(a.q_bf16, a.q, qo, D, reinterpret_cast<uint16_t*>(qp + r * pairs));
    }
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
      const __m512 scale = _mm512_set1_ps(a.scale);
      for (int64_t r = 0; r < kRows; r++) {
        _mm512_storeu_ps(s + r * Lp + j, _mm512_mul_ps(c[r][0], scale));
        _mm512_storeu_ps(s + r * Lp + j + 16, _mm512_mul_ps(c[r][1], scale));
      }
    }
    float inverse[kRows] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t r = 0; r < kRows; r++) {
      float* scores = s + r * Lp;
      if (r < rows) {
        inverse[r] = softmax_row(a, b, h, i0 + r, scores, L, Lp);
      } else {
        for (int64_t j = 0; j < Lp; j++) scores[j] = 0.0f;
      }
      uint16_t* probabilities = reinterpret_cast<uint16_t*>(pp + r * Lp / 2);
      for (int64_t j = 0; j < Lp; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probabilities + j),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores + j)));
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
        float row[32];
        _mm512_storeu_ps(row, _mm512_mul_ps(o[r][0], _mm512_set1_ps(inverse[r])));
        _mm512_storeu_ps(row + 16, _mm512_mul_ps(o[r][1], _mm512_set1_ps(inverse[r])));
        store_row(a, b * a.os[0] + h * a.os[1] + (i0 + r) * a.os[2] + d0, row, 32);
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
// return it.
at::Tensor fused_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                           const std::optional<at::Tensor>& mask, double scale) {
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
#if defined(__AVX512BF16__)
  const bool bf16_dots = D % 32 == 0 && (a.q_bf16 || a.k_bf16 || a.v_bf16);
#else
  const bool bf16_dots = false;
#endif
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t t = begin; t < end; t++) {
#if defined(__AVX512BF16__)
      if (bf16_dots) {
        head_bf16(a, t / H, t % H, buffer);
        continue;
      }
#endif
      head_fp32(a, t / H, t % H, buffer);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pt2_handlers, m) {
  m.def("fused_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pt2_handlers, CPU, m) { m.impl("fused_attention", fused_attention); }
