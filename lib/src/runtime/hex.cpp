#include "kvcal/runtime/hex.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <numeric>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "runtime/checks.h"

namespace kvcal::runtime {

using detail::fail;
using detail::require;

namespace {

// Rows ahead of the one being decoded whose codes are requested early: a
// block's codes are a few kilobytes, too short for the hardware prefetcher
// to ramp up on by itself. (Prefetching past the end is harmless.)
constexpr std::int64_t kPrefetchRows = 6;
inline void prefetch(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 3);
#else
  (void)p;
#endif
}

// One binary16 -> float in the hot loops (the F16C instruction when present).
inline float h2f(half_bits h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// The decode kernels: explicit AVX-512 or AVX2 code where the build has it
// (the compiler does not vectorise the nibble unpacking well), with plain
// loops as the portable fallback. Each returns bit-for-bit what its fallback
// computes up to the order of the float additions.
#if defined(__AVX512F__)
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

float dot(const float* a, const float* b, std::int64_t n) {
  std::int64_t i = 0;
  float s = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = hsum(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float w, const float* x, float* y, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += w * x[i];
}

// 2-bit rows: byte i holds channels 4i..4i+3 (bits 0-1, 2-3, 4-5, 6-7); w and
// acc are phase-major in four runs of run = dim / 4.
inline float dot_crumbs(const std::uint8_t* row, const float* w, std::int64_t run) {
  std::int64_t i = 0;
  float s = 0;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __m512i three = _mm512_set1_epi32(3);
  for (; i + 16 <= run; i += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, three)), _mm512_loadu_ps(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 2), three)),
                         _mm512_loadu_ps(w + run + i), a1);
    a2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 4), three)),
                         _mm512_loadu_ps(w + 2 * run + i), a2);
    a3 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 6)), _mm512_loadu_ps(w + 3 * run + i), a3);
  }
  s = hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const __m256i three = _mm256_set1_epi32(3);
  for (; i + 8 <= run; i += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, three)), _mm256_loadu_ps(w + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 2), three)),
                         _mm256_loadu_ps(w + run + i), a1);
    a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4), three)),
                         _mm256_loadu_ps(w + 2 * run + i), a2);
    a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 6)), _mm256_loadu_ps(w + 3 * run + i), a3);
  }
  s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; i < run; ++i) {
    const unsigned b = row[i];
    s += w[i] * static_cast<float>(b & 3u) + w[run + i] * static_cast<float>((b >> 2) & 3u) +
         w[2 * run + i] * static_cast<float>((b >> 4) & 3u) + w[3 * run + i] * static_cast<float>(b >> 6);
  }
  return s;
}

inline void axpy_crumbs(float a, const std::uint8_t* row, float* acc, std::int64_t run) {
  std::int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 av = _mm512_set1_ps(a);
  const __m512i three = _mm512_set1_epi32(3);
  for (; i + 16 <= run; i += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
    for (int k = 0; k < 4; ++k) {
      const __m512i c =
          k == 3 ? _mm512_srli_epi32(b, 6) : _mm512_and_si512(_mm512_srl_epi32(b, _mm_cvtsi32_si128(2 * k)), three);
      float* dst = acc + k * run + i;
      _mm512_storeu_ps(dst, _mm512_fmadd_ps(av, _mm512_cvtepi32_ps(c), _mm512_loadu_ps(dst)));
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 av = _mm256_set1_ps(a);
  const __m256i three = _mm256_set1_epi32(3);
  for (; i + 8 <= run; i += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
    for (int k = 0; k < 4; ++k) {
      const __m256i c =
          k == 3 ? _mm256_srli_epi32(b, 6) : _mm256_and_si256(_mm256_srl_epi32(b, _mm_cvtsi32_si128(2 * k)), three);
      float* dst = acc + k * run + i;
      _mm256_storeu_ps(dst, _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(c), _mm256_loadu_ps(dst)));
    }
  }
#endif
  for (; i < run; ++i) {
    const unsigned b = row[i];
    acc[i] += a * static_cast<float>(b & 3u);
    acc[run + i] += a * static_cast<float>((b >> 2) & 3u);
    acc[2 * run + i] += a * static_cast<float>((b >> 4) & 3u);
    acc[3 * run + i] += a * static_cast<float>(b >> 6);
  }
}

// 4-bit rows: byte i holds channel 2i (low nibble) and 2i+1 (high nibble);
// w and acc are phase-major: [even channels | odd channels], run = dim / 2.
inline float dot_nibbles(const std::uint8_t* row, const float* w, std::int64_t run) {
  const float* w1 = w + run;
  std::int64_t i = 0;
  float s = 0;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(0xf);
  for (; i + 16 <= run; i += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), _mm512_loadu_ps(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), _mm512_loadu_ps(w1 + i), a1);
  }
  s = hsum(_mm512_add_ps(a0, a1));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(0xf);
  for (; i + 8 <= run; i += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, low)), _mm256_loadu_ps(w + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_loadu_ps(w1 + i), a1);
  }
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < run; ++i) s += w[i] * static_cast<float>(row[i] & 0xfu) + w1[i] * static_cast<float>(row[i] >> 4);
  return s;
}

inline void axpy_nibbles(float a, const std::uint8_t* row, float* acc, std::int64_t run) {
  float* acc1 = acc + run;
  std::int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 av = _mm512_set1_ps(a);
  const __m512i low = _mm512_set1_epi32(0xf);
  for (; i + 16 <= run; i += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
    _mm512_storeu_ps(acc + i,
                     _mm512_fmadd_ps(av, _mm512_cvtepi32_ps(_mm512_and_si512(b, low)), _mm512_loadu_ps(acc + i)));
    _mm512_storeu_ps(acc1 + i,
                     _mm512_fmadd_ps(av, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), _mm512_loadu_ps(acc1 + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 av = _mm256_set1_ps(a);
  const __m256i low = _mm256_set1_epi32(0xf);
  for (; i + 8 <= run; i += 8) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
    _mm256_storeu_ps(acc + i,
                     _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(_mm256_and_si256(b, low)), _mm256_loadu_ps(acc + i)));
    _mm256_storeu_ps(acc1 + i,
                     _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), _mm256_loadu_ps(acc1 + i)));
  }
#endif
  for (; i < run; ++i) {
    acc[i] += a * static_cast<float>(row[i] & 0xfu);
    acc1[i] += a * static_cast<float>(row[i] >> 4);
  }
}

// A mask built by the caller is checked like one read from a file: equal row
// degrees (row i starts at i * d1), columns in range and strictly ascending.
void check_mask(const Mask& m) {
  require(m.rows >= 1 && m.cols >= 1 && m.row_degree >= 1 && m.row_degree <= m.cols,
          "the expander mask's shape or row degree is out of range");
  require(m.nnz() == m.rows * m.row_degree && static_cast<std::int64_t>(m.indptr.size()) == m.rows + 1,
          "the expander mask's indptr/indices sizes do not match rows x row_degree");
  for (std::int64_t i = 0; i < m.rows; ++i) {
    if (m.indptr[static_cast<std::size_t>(i)] != i * m.row_degree)
      fail("the expander mask's rows do not all have row_degree entries (row " + std::to_string(i) + ")");
    for (std::int64_t e = 0; e < m.row_degree; ++e) {
      const std::int32_t c = m.indices[static_cast<std::size_t>(i * m.row_degree + e)];
      const bool ascending = e == 0 || c > m.indices[static_cast<std::size_t>(i * m.row_degree + e - 1)];
      if (c < 0 || c >= m.cols || !ascending)
        fail("the expander mask's row " + std::to_string(i) + " has a column out of range, repeated or unsorted");
    }
  }
}

bool finite_halves(const half_bits* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    if ((x[i] & 0x7c00u) == 0x7c00u) return false;
  return true;
}

void softmax_rows(float* s, std::int64_t rows, std::int64_t n, std::int64_t stride) {
  for (std::int64_t j = 0; j < rows; ++j) {
    float* r = s + j * stride;
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t t = 0; t < n; ++t) m = std::max(m, r[t]);
    float z = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      r[t] = std::exp(r[t] - m);
      z += r[t];
    }
    const float inv = 1.0f / z;
    for (std::int64_t t = 0; t < n; ++t) r[t] *= inv;
  }
}

// Per-thread scratch of the decode paths (no allocation per block).
struct Scratch {
  std::vector<float> qd, bias, kmin, row, acc, base, sparse, params, codes;
  float* get(std::vector<float>& v, std::int64_t n) {
    if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
    return v.data();
  }
};
thread_local Scratch scratch;

// Scores and value accumulation over plain fp16 rows.
void fp16_scores(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k, std::int64_t tokens,
                 std::int64_t dim, std::int64_t token_stride, float scale, float* s, std::int64_t s_stride) {
  float* row = scratch.get(scratch.row, dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    halves_to_floats(k + t * token_stride, dim, row);
    for (std::int64_t j = 0; j < nq; ++j) s[j * s_stride + t] = scale * dot(q + j * q_stride, row, dim);
  }
}

void fp16_accumulate(const float* p, std::int64_t nq, std::int64_t p_stride, const half_bits* v, std::int64_t tokens,
                     std::int64_t dim, std::int64_t token_stride, float* out, std::int64_t out_stride) {
  float* row = scratch.get(scratch.row, dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    halves_to_floats(v + t * token_stride, dim, row);
    for (std::int64_t j = 0; j < nq; ++j) axpy(p[j * p_stride + t], row, out + j * out_stride, dim);
  }
}

}  // namespace

// ---------------------------------------------------------------- options

HexOptions hex_method(const std::string& name, const HexOptions& base) {
  HexOptions o = base;
  if (name == "fp16") {
    o.bits = 0;
    o.expander = o.heavy_hitters = o.recent = false;
    return o;
  }
  struct Row {
    const char* prefix;
    bool expander, hh;
  };
  for (const Row r :
       {Row{"kcvt", false, false}, Row{"h2o", false, true}, Row{"expander", true, false}, Row{"hex", true, true}}) {
    const std::string p = r.prefix;
    if (name.size() == p.size() + 1 && name.compare(0, p.size(), p) == 0 && name.back() >= '2' && name.back() <= '4') {
      o.bits = name.back() - '0';
      o.expander = r.expander;
      o.heavy_hitters = o.recent = r.hh;
      return o;
    }
  }
  fail("unknown method '" + name + "' (known: fp16, kcvt2|3|4, h2o2|3|4, expander2|3|4, hex2|3|4, h2o-evict)");
}

void check_options(const HexOptions& o) {
  require(o.block >= 1 && o.block <= 65535, "block size must be in [1, 65535], got " + std::to_string(o.block));
  require(o.bits == 0 || (o.bits >= 2 && o.bits <= 4), "bits must be 0, 2, 3 or 4, got " + std::to_string(o.bits));
  require(std::isfinite(o.hh_ratio) && o.hh_ratio >= 0 && o.hh_ratio <= 1,
          "heavy-hitter ratio must be in [0, 1], got " + std::to_string(o.hh_ratio));
  require(o.recent_window >= 0, "recent window must be >= 0, got " + std::to_string(o.recent_window));
  require(std::isfinite(o.sparsity) && o.sparsity > 0 && o.sparsity <= 1,
          "expander sparsity must be in (0, 1], got " + std::to_string(o.sparsity));
}

// ---------------------------------------------------------------- blocks

HexBlockView HexBlock::view() const {
  HexBlockView b;
  b.tokens = tokens;
  b.head_dim = head_dim;
  b.bits = bits;
  b.kept_rows = bits == 0 ? tokens : static_cast<std::int32_t>(kept_index.size());
  b.kept_index = kept_index.empty() ? nullptr : kept_index.data();
  b.k_kept = k_kept.data();
  b.v_kept = v_kept.data();
  b.row_bytes = bits == 0 ? 0 : static_cast<std::int32_t>(packed_bytes(head_dim, bits));
  b.k_codes = k_codes.data();
  b.v_codes = v_codes.data();
  b.k_params = k_params.data();
  b.v_params = v_params.data();
  b.mask_degree = mask ? static_cast<std::int32_t>(mask->row_degree) : 0;
  b.mask_indices = mask ? mask->indices.data() : nullptr;
  b.k_sparse = k_sparse.data();
  b.v_sparse = v_sparse.data();
  return b;
}

std::int64_t hex_block_bytes(const HexBlockView& b) {
  const std::int64_t d = b.head_dim, kept = b.kept_rows, quant = b.quant_rows();
  if (b.bits == 0) return kept * d * 2 * 2;
  std::int64_t bytes = kept * 2 + kept * d * 2 * 2;
  if (quant > 0) {
    bytes += 2 * quant * b.row_bytes;                                 // key and value codes
    bytes += d * static_cast<std::int64_t>(sizeof(QuantParams));      // key groups (channels)
    bytes += quant * static_cast<std::int64_t>(sizeof(QuantParams));  // value groups (tokens)
    bytes += 2 * quant * b.mask_degree * 2;                           // fp16 expander entries, K and V
  }
  return bytes;
}

namespace {

// hex_compress_block without its argument checks: HexLayerCache has already
// checked the mask (constructor) and the keys and values (append).
HexBlock compress_checked_block(const half_bits* k, const half_bits* v, std::int64_t tokens, std::int64_t dim,
                                std::int64_t stride, const std::uint8_t* keep_rows, std::shared_ptr<const Mask> mask,
                                int bits) {
  HexBlock b;
  b.tokens = static_cast<std::int32_t>(tokens);
  b.head_dim = static_cast<std::int32_t>(dim);
  b.bits = bits;
  const auto copy_row = [&](std::vector<half_bits>& dst, const half_bits* src) {
    dst.insert(dst.end(), src, src + dim);
  };
  if (bits == 0) {
    for (std::int64_t t = 0; t < tokens; ++t) {
      copy_row(b.k_kept, k + t * stride);
      copy_row(b.v_kept, v + t * stride);
    }
    return b;
  }
  if (mask) b.mask = std::move(mask);
  const std::int64_t d1 = b.mask ? b.mask->row_degree : 0;
  std::vector<std::int64_t> quant_tokens;
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (keep_rows && keep_rows[t]) {
      b.kept_index.push_back(static_cast<std::uint16_t>(t));
      copy_row(b.k_kept, k + t * stride);
      copy_row(b.v_kept, v + t * stride);
    } else {
      quant_tokens.push_back(t);
    }
  }
  const auto nq = static_cast<std::int64_t>(quant_tokens.size());
  if (nq == 0) {
    b.mask.reset();
    return b;
  }
  // Gather the quantized rows contiguously and mark the expander's entries.
  std::vector<half_bits> kq(static_cast<std::size_t>(nq * dim)), vq(kq.size());
  std::vector<std::uint8_t> skip(kq.size(), 0);
  for (std::int64_t q = 0; q < nq; ++q) {
    const std::int64_t t = quant_tokens[static_cast<std::size_t>(q)];
    std::copy(k + t * stride, k + t * stride + dim, kq.begin() + q * dim);
    std::copy(v + t * stride, v + t * stride + dim, vq.begin() + q * dim);
    for (std::int64_t j = 0; j < d1; ++j) {
      const std::int32_t c = b.mask->indices[static_cast<std::size_t>(t * d1 + j)];
      skip[static_cast<std::size_t>(q * dim + c)] = 1;
      b.k_sparse.push_back(kq[static_cast<std::size_t>(q * dim + c)]);
      b.v_sparse.push_back(vq[static_cast<std::size_t>(q * dim + c)]);
    }
  }
  const std::uint8_t* skip_p = d1 > 0 ? skip.data() : nullptr;
  b.k_params.resize(static_cast<std::size_t>(dim));
  for (std::int64_t c = 0; c < dim; ++c)
    b.k_params[static_cast<std::size_t>(c)] =
        quant_params(kq.data() + c, nq, dim, bits, skip_p ? skip_p + c : nullptr, dim);
  b.v_params.resize(static_cast<std::size_t>(nq));
  for (std::int64_t q = 0; q < nq; ++q)
    b.v_params[static_cast<std::size_t>(q)] =
        quant_params(vq.data() + q * dim, dim, 1, bits, skip_p ? skip_p + q * dim : nullptr, 1);
  const std::int64_t row_bytes = packed_bytes(dim, bits);
  b.k_codes.assign(static_cast<std::size_t>(nq * row_bytes), 0);
  b.v_codes.assign(b.k_codes.size(), 0);
  std::vector<std::uint8_t> kc(static_cast<std::size_t>(dim)), vc(kc.size());
  for (std::int64_t q = 0; q < nq; ++q) {
    const QuantParams vp = b.v_params[static_cast<std::size_t>(q)];
    for (std::int64_t c = 0; c < dim; ++c) {
      const auto i = static_cast<std::size_t>(q * dim + c);
      // The expander's entries are stored in fp16; their codes are 0, so
      // that decode corrects them with (x - min) and needs no code lookup.
      const bool masked = skip[i] != 0;
      kc[static_cast<std::size_t>(c)] =
          masked ? std::uint8_t{0}
                 : quantize_value(half_to_float(kq[i]), b.k_params[static_cast<std::size_t>(c)], bits);
      vc[static_cast<std::size_t>(c)] = masked ? std::uint8_t{0} : quantize_value(half_to_float(vq[i]), vp, bits);
    }
    pack_codes(kc.data(), dim, bits, b.k_codes.data() + q * row_bytes);
    pack_codes(vc.data(), dim, bits, b.v_codes.data() + q * row_bytes);
  }
  return b;
}

}  // namespace

HexBlock hex_compress_block(const half_bits* k, const half_bits* v, std::int64_t tokens, std::int64_t dim,
                            std::int64_t stride, const std::uint8_t* keep_rows, std::shared_ptr<const Mask> mask,
                            int bits) {
  require(tokens >= 1 && tokens <= 65535, "a block holds 1..65535 tokens, got " + std::to_string(tokens));
  require(dim >= 1 && stride >= dim, "bad head_dim or token stride");
  require(bits == 0 || (bits >= 2 && bits <= 4), "bits must be 0, 2, 3 or 4");
  for (std::int64_t t = 0; t < tokens; ++t)
    if (!finite_halves(k + t * stride, dim) || !finite_halves(v + t * stride, dim))
      fail("non-finite key or value at block token " + std::to_string(t));
  if (mask) {
    require(mask->rows >= tokens && mask->cols == dim, "the expander mask's shape does not fit the block");
    check_mask(*mask);
  }
  return compress_checked_block(k, v, tokens, dim, stride, keep_rows, std::move(mask), bits);
}

void hex_dequantize_block(const HexBlockView& b, float* k, float* v) {
  const std::int64_t d = b.head_dim;
  std::int64_t kept = 0, q = 0;
  for (std::int64_t t = 0; t < b.tokens; ++t) {
    float* kr = k + t * d;
    float* vr = v + t * d;
    if (b.bits == 0 || (kept < b.kept_rows && b.kept_index[kept] == t)) {
      halves_to_floats(b.k_kept + kept * d, d, kr);
      halves_to_floats(b.v_kept + kept * d, d, vr);
      ++kept;
      continue;
    }
    for (std::int64_t c = 0; c < d; ++c) {
      kr[c] = dequantize_value(packed_code(b.k_codes + q * b.row_bytes, c, b.bits), b.k_params[c]);
      vr[c] = dequantize_value(packed_code(b.v_codes + q * b.row_bytes, c, b.bits), b.v_params[q]);
    }
    for (std::int64_t j = 0; j < b.mask_degree; ++j) {
      const std::int32_t c = b.mask_indices[t * b.mask_degree + j];
      kr[c] = half_to_float(b.k_sparse[q * b.mask_degree + j]);
      vr[c] = half_to_float(b.v_sparse[q * b.mask_degree + j]);
    }
    ++q;
  }
}

namespace {

// Slot of channel c in the phase-major order of a packed row: for 4 bits the
// even channels then the odd ones, for 2 bits channels 4i, 4i+1, 4i+2, 4i+3
// in four runs. 3-bit rows (and odd widths) keep channel order.
struct Phases {
  int bits;
  std::int64_t dim, per, run;
  Phases(int b, std::int64_t d) : bits(b), dim(d) {
    const bool split = (b == 4 && d % 2 == 0) || (b == 2 && d % 4 == 0);
    per = split ? 8 / b : 1;
    run = d / per;
  }
  std::int64_t slot(std::int64_t c) const { return per == 1 ? c : (c % per) * run + c / per; }
};

// Eight 3-bit codes from three bytes.
inline std::uint32_t triple(const std::uint8_t* b) {
  return b[0] | (static_cast<std::uint32_t>(b[1]) << 8) | (static_cast<std::uint32_t>(b[2]) << 16);
}

// A row in channel order as floats: 3-bit codes eight at a time (three bytes
// hold eight codes), other widths code by code.
inline void unpack_row(const std::uint8_t* row, const Phases& ph, float* out) {
  std::int64_t c = 0;
  if (ph.bits == 3) {
    for (; c + 8 <= ph.dim; c += 8) {
      const std::uint32_t v = triple(row + c / 8 * 3);
      for (int k = 0; k < 8; ++k) out[c + k] = static_cast<float>((v >> (3 * k)) & 7u);
    }
  }
  for (; c < ph.dim; ++c) out[c] = static_cast<float>(packed_code(row, c, ph.bits));
}

// Dot product and axpy over a row in channel order (3-bit and odd widths).
inline float dot_row(const std::uint8_t* row, const float* w, const Phases& ph) {
#if defined(__AVX2__) && defined(__FMA__)
  if (ph.bits == 3) {
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), seven = _mm256_set1_epi32(7);
    __m256 acc = _mm256_setzero_ps();
    std::int64_t c = 0;
    for (; c + 8 <= ph.dim; c += 8) {
      const __m256i v = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(triple(row + c / 8 * 3))), shifts), seven);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_loadu_ps(w + c), acc);
    }
    float s = hsum(acc);
    for (; c < ph.dim; ++c) s += w[c] * static_cast<float>(packed_code(row, c, 3));
    return s;
  }
#endif
  float* codes = scratch.get(scratch.codes, ph.dim);
  unpack_row(row, ph, codes);
  return dot(w, codes, ph.dim);
}

inline void axpy_row(float a, const std::uint8_t* row, float* acc, const Phases& ph) {
#if defined(__AVX2__) && defined(__FMA__)
  if (ph.bits == 3) {
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), seven = _mm256_set1_epi32(7);
    const __m256 av = _mm256_set1_ps(a);
    std::int64_t c = 0;
    for (; c + 8 <= ph.dim; c += 8) {
      const __m256i v = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(triple(row + c / 8 * 3))), shifts), seven);
      _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(v), _mm256_loadu_ps(acc + c)));
    }
    for (; c < ph.dim; ++c) acc[c] += a * static_cast<float>(packed_code(row, c, 3));
    return;
  }
#endif
  float* codes = scratch.get(scratch.codes, ph.dim);
  unpack_row(row, ph, codes);
  axpy(a, codes, acc, ph.dim);
}

// sum_slot w[slot] * code(slot) over one packed row (w in phase-major order).
inline float dot_codes(const std::uint8_t* row, const float* w, const Phases& ph) {
  float s = 0;
  if (ph.per == 2) {
    s = dot_nibbles(row, w, ph.run);
  } else if (ph.per == 4) {
    s = dot_crumbs(row, w, ph.run);
  } else {
    s = dot_row(row, w, ph);
  }
  return s;
}

// acc[slot] += a * code(slot) over one packed row.
inline void axpy_codes(float a, const std::uint8_t* row, float* acc, const Phases& ph) {
  if (ph.per == 2) {
    axpy_nibbles(a, row, acc, ph.run);
  } else if (ph.per == 4) {
    axpy_crumbs(a, row, acc, ph.run);
  } else {
    axpy_row(a, row, acc, ph);
  }
}

}  // namespace

void hex_block_scores(const HexBlockView& b, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                      float* scores, std::int64_t s_stride) {
  const std::int64_t d = b.head_dim, d1 = b.mask_degree, nqr = b.quant_rows();
  if (b.bits == 0) {
    fp16_scores(q, nq, q_stride, b.k_kept, b.tokens, d, d, scale, scores, s_stride);
    return;
  }
  const Phases ph(b.bits, d);
  Scratch& sc = scratch;
  float* qd = sc.get(sc.qd, nq * d);  // [nq][slot]: scale * q_c * delta_c
  float* bias = sc.get(sc.bias, nq);  // scale * q . min
  float* kmin = sc.get(sc.kmin, d);
  float* row = sc.get(sc.row, d);
  float* sparse = sc.get(sc.sparse, nqr * d1);
  if (nqr > 0) {
    // The key groups' (delta, min) pairs in one conversion, then split.
    float* params = sc.get(sc.params, 2 * d);
    static_assert(sizeof(QuantParams) == 2 * sizeof(half_bits), "QuantParams is two packed halves");
    halves_to_floats(reinterpret_cast<const half_bits*>(b.k_params), 2 * d, params);
    for (std::int64_t c = 0; c < d; ++c) kmin[c] = params[2 * c + 1];
    for (std::int64_t j = 0; j < nq; ++j) {
      const float* qj = q + j * q_stride;
      for (std::int64_t c = 0; c < d; ++c) qd[j * d + ph.slot(c)] = scale * qj[c] * params[2 * c];
      bias[j] = scale * dot(qj, kmin, d);
    }
    if (d1 > 0) halves_to_floats(b.k_sparse, nqr * d1, sparse);
  }
  std::int64_t kept = 0, qr = 0;
  for (std::int64_t t = 0; t < b.tokens; ++t) {
    if (kept < b.kept_rows && b.kept_index[kept] == t) {
      halves_to_floats(b.k_kept + kept * d, d, row);
      for (std::int64_t j = 0; j < nq; ++j) scores[j * s_stride + t] = scale * dot(q + j * q_stride, row, d);
      ++kept;
      continue;
    }
    const std::uint8_t* codes = b.k_codes + qr * b.row_bytes;
    prefetch(codes + kPrefetchRows * b.row_bytes);
    const std::int32_t* cols = b.mask_indices + t * d1;
    const float* xs = sparse + qr * d1;
    for (std::int64_t j = 0; j < nq; ++j) {
      const float* qj = q + j * q_stride;
      float s = bias[j] + dot_codes(codes, qd + j * d, ph);
      // Expander entries (code 0): the stored value replaces min_c.
      for (std::int64_t e = 0; e < d1; ++e) s += scale * qj[cols[e]] * (xs[e] - kmin[cols[e]]);
      scores[j * s_stride + t] = s;
    }
    ++qr;
  }
}

void hex_block_accumulate(const HexBlockView& b, const float* p, std::int64_t nq, std::int64_t p_stride, float* out,
                          std::int64_t out_stride) {
  const std::int64_t d = b.head_dim, d1 = b.mask_degree, nqr = b.quant_rows();
  if (b.bits == 0) {
    fp16_accumulate(p, nq, p_stride, b.v_kept, b.tokens, d, d, out, out_stride);
    return;
  }
  const Phases ph(b.bits, d);
  Scratch& sc = scratch;
  float* acc = sc.get(sc.acc, nq * d);  // [nq][slot]: sum_t p_t delta_t code_tc
  float* base = sc.get(sc.base, nq);    // sum_t p_t min_t
  float* row = sc.get(sc.row, d);
  float* sparse = sc.get(sc.sparse, nqr * d1);
  std::fill(acc, acc + nq * d, 0.0f);
  std::fill(base, base + nq, 0.0f);
  if (d1 > 0 && nqr > 0) halves_to_floats(b.v_sparse, nqr * d1, sparse);
  std::int64_t kept = 0, qr = 0;
  for (std::int64_t t = 0; t < b.tokens; ++t) {
    if (kept < b.kept_rows && b.kept_index[kept] == t) {
      halves_to_floats(b.v_kept + kept * d, d, row);
      for (std::int64_t j = 0; j < nq; ++j) axpy(p[j * p_stride + t], row, out + j * out_stride, d);
      ++kept;
      continue;
    }
    const QuantParams vp = b.v_params[qr];
    const float vmin = h2f(vp.min), vdelta = h2f(vp.delta);
    const std::uint8_t* codes = b.v_codes + qr * b.row_bytes;
    prefetch(codes + kPrefetchRows * b.row_bytes);
    const std::int32_t* cols = b.mask_indices + t * d1;
    const float* xs = sparse + qr * d1;
    for (std::int64_t j = 0; j < nq; ++j) {
      const float w = p[j * p_stride + t];
      base[j] += w * vmin;
      axpy_codes(w * vdelta, codes, acc + j * d, ph);
      float* oj = out + j * out_stride;
      for (std::int64_t e = 0; e < d1; ++e) oj[cols[e]] += w * (xs[e] - vmin);
    }
    ++qr;
  }
  for (std::int64_t j = 0; j < nq; ++j) {
    float* oj = out + j * out_stride;
    const float* aj = acc + j * d;
    for (std::int64_t c = 0; c < d; ++c) oj[c] += base[j] + aj[ph.slot(c)];
  }
}

void attend_fp16(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k, const half_bits* v,
                 std::int64_t tokens, std::int64_t dim, std::int64_t token_stride, float scale, float* out,
                 std::int64_t out_stride, float* probs) {
  require(tokens >= 1 && dim >= 1 && nq >= 1, "attention needs at least one token, channel and query");
  std::vector<float> local;
  float* p = probs;
  if (!p) {
    local.resize(static_cast<std::size_t>(nq * tokens));
    p = local.data();
  }
  fp16_scores(q, nq, q_stride, k, tokens, dim, token_stride, scale, p, tokens);
  softmax_rows(p, nq, tokens, tokens);
  for (std::int64_t j = 0; j < nq; ++j) std::fill(out + j * out_stride, out + j * out_stride + dim, 0.0f);
  fp16_accumulate(p, nq, tokens, v, tokens, dim, token_stride, out, out_stride);
}

// ---------------------------------------------------------------- layer cache

struct HexLayerCache::Impl {
  std::int64_t heads = 0, dim = 0;
  HexOptions opt;
  std::shared_ptr<const Mask> mask;
  std::int64_t tokens = 0;      // appended so far
  std::int64_t compressed = 0;  // tokens in blocks
  std::vector<double> score;    // heavy-hitter scores by position
  struct Head {
    std::vector<HexBlock> blocks;
    std::vector<half_bits> res_k, res_v;  // residual rows (and in full mode the source of every block before them)
  };
  std::vector<Head> head;

  // Which tokens of the block starting at `start` stay in fp16.
  std::vector<std::uint8_t> keep_rows(std::int64_t start) const {
    const std::int64_t n = opt.block;
    std::vector<std::uint8_t> keep(static_cast<std::size_t>(n), 0);
    if (opt.recent)
      for (std::int64_t t = std::max<std::int64_t>(0, tokens - opt.recent_window - start); t < n; ++t)
        keep[static_cast<std::size_t>(t)] = 1;
    if (opt.heavy_hitters && opt.hh_ratio > 0) {
      const auto h = static_cast<std::int64_t>(std::ceil(opt.hh_ratio * static_cast<double>(n) - 1e-9));
      std::vector<std::int64_t> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      const auto s = [&](std::int64_t t) {
        const auto p = static_cast<std::size_t>(start + t);
        return p < score.size() ? score[p] : 0.0;
      };
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return s(a) > s(b); });
      for (std::int64_t i = 0; i < h && i < n; ++i) {
        const std::int64_t t = order[static_cast<std::size_t>(i)];
        if (s(t) > 0) keep[static_cast<std::size_t>(t)] = 1;
      }
    }
    return keep;
  }

  HexBlock compress(const Head& hd, const std::vector<std::uint8_t>& keep, std::int64_t offset) const {
    const half_bits* k = hd.res_k.data() + offset * dim;
    const half_bits* v = hd.res_v.data() + offset * dim;
    return compress_checked_block(k, v, opt.block, dim, dim, keep.data(), opt.expander ? mask : nullptr, opt.bits);
  }

  // Compresses the full blocks waiting in the residual buffers.
  // Compresses the full blocks waiting in the residual buffers. Strong
  // guarantee: the new blocks are built aside and committed with operations
  // that cannot throw, so a failure (bad_alloc) leaves the cache as it was.
  void flush() {
    const std::int64_t n = opt.block;
    const std::int64_t waiting = tokens - compressed;
    const std::int64_t new_blocks = waiting / n;
    if (new_blocks == 0) return;
    const auto H = static_cast<std::size_t>(heads);
    std::vector<std::vector<HexBlock>> built(H);
    if (opt.mode == HexMode::append) {
      for (std::int64_t b = 0; b < new_blocks; ++b) {
        const auto keep = keep_rows(compressed + b * n);
        for (std::size_t h = 0; h < H; ++h) built[h].push_back(compress(head[h], keep, b * n));
      }
      for (std::size_t h = 0; h < H; ++h) head[h].blocks.reserve(head[h].blocks.size() + built[h].size());
      // Commit: nothing below throws.
      for (std::size_t h = 0; h < H; ++h) {
        Head& hd = head[h];
        for (HexBlock& blk : built[h]) hd.blocks.push_back(std::move(blk));
        hd.res_k.erase(hd.res_k.begin(), hd.res_k.begin() + new_blocks * n * dim);
        hd.res_v.erase(hd.res_v.begin(), hd.res_v.begin() + new_blocks * n * dim);
      }
      compressed += new_blocks * n;
      return;
    }
    // Full mode: every block again, from the fp16 source kept in res_k/res_v.
    const std::int64_t blocks = (compressed + new_blocks * n) / n;
    for (std::int64_t b = 0; b < blocks; ++b) {
      const auto keep = keep_rows(b * n);
      for (std::size_t h = 0; h < H; ++h) built[h].push_back(compress(head[h], keep, b * n));
    }
    for (std::size_t h = 0; h < H; ++h) head[h].blocks.swap(built[h]);
    compressed += new_blocks * n;
  }

  // Offset of the residual (uncompressed) rows inside res_k/res_v.
  std::int64_t residual_offset() const { return opt.mode == HexMode::full ? compressed : 0; }
};

HexLayerCache::HexLayerCache(std::int64_t kv_heads, std::int64_t head_dim, const HexOptions& options,
                             std::shared_ptr<const Mask> mask)
    : impl_(std::make_unique<Impl>()) {
  check_options(options);
  require(kv_heads >= 1 && head_dim >= 1, "a layer cache needs at least one KV head and one channel");
  if (options.expander && options.bits != 0) {
    require(mask != nullptr, "the expander method needs a mask");
    require(mask->rows == options.block && mask->cols == head_dim,
            "the mask's shape " + std::to_string(mask->rows) + "x" + std::to_string(mask->cols) +
                " does not match block x head_dim = " + std::to_string(options.block) + "x" + std::to_string(head_dim));
    check_mask(*mask);
  }
  impl_->heads = kv_heads;
  impl_->dim = head_dim;
  impl_->opt = options;
  impl_->mask = std::move(mask);
  impl_->head.resize(static_cast<std::size_t>(kv_heads));
}
HexLayerCache::~HexLayerCache() = default;
HexLayerCache::HexLayerCache(HexLayerCache&&) noexcept = default;
HexLayerCache& HexLayerCache::operator=(HexLayerCache&&) noexcept = default;

void HexLayerCache::append(const half_bits* k, const half_bits* v, std::int64_t n, std::int64_t head_stride,
                           std::int64_t token_stride) {
  Impl& m = *impl_;
  require(n >= 0, "negative token count");
  require(n <= 1 || token_stride >= m.dim, "token stride smaller than head_dim");
  for (std::int64_t h = 0; h < m.heads; ++h)
    for (std::int64_t i = 0; i < n; ++i) {
      const half_bits* kr = k + h * head_stride + i * token_stride;
      const half_bits* vr = v + h * head_stride + i * token_stride;
      if (!finite_halves(kr, m.dim) || !finite_halves(vr, m.dim))
        fail("non-finite key or value (head " + std::to_string(h) + ", token " + std::to_string(m.tokens + i) + ")");
    }
  // Room first (may throw, changes nothing), then the rows (cannot throw).
  for (auto& hd : m.head) {
    hd.res_k.reserve(hd.res_k.size() + static_cast<std::size_t>(n * m.dim));
    hd.res_v.reserve(hd.res_v.size() + static_cast<std::size_t>(n * m.dim));
  }
  const std::size_t before = m.head.front().res_k.size();
  for (std::int64_t h = 0; h < m.heads; ++h) {
    auto& hd = m.head[static_cast<std::size_t>(h)];
    for (std::int64_t i = 0; i < n; ++i) {
      const half_bits* kr = k + h * head_stride + i * token_stride;
      const half_bits* vr = v + h * head_stride + i * token_stride;
      hd.res_k.insert(hd.res_k.end(), kr, kr + m.dim);
      hd.res_v.insert(hd.res_v.end(), vr, vr + m.dim);
    }
  }
  m.tokens += n;
  try {
    m.flush();
  } catch (...) {  // undo: the cache is as before the call
    m.tokens -= n;
    for (auto& hd : m.head) {
      hd.res_k.resize(before);
      hd.res_v.resize(before);
    }
    throw;
  }
}

void HexLayerCache::observe(const float* attn, std::int64_t heads, std::int64_t tokens, std::int64_t head_stride) {
  Impl& m = *impl_;
  require(heads >= 0 && tokens >= 0, "negative attention shape");
  // Checked before anything is added: a rejected call leaves the scores as they were.
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t t = 0; t < tokens; ++t)
      require(std::isfinite(attn[h * head_stride + t]), "non-finite attention weight");
  if (static_cast<std::int64_t>(m.score.size()) < tokens) m.score.resize(static_cast<std::size_t>(tokens), 0.0);
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t t = 0; t < tokens; ++t) m.score[static_cast<std::size_t>(t)] += attn[h * head_stride + t];
}

void HexLayerCache::attend(const float* q, std::int64_t q_heads, float scale, float* out, float* probs) const {
  const Impl& m = *impl_;
  require(q_heads >= m.heads && q_heads % m.heads == 0, "query heads must be a multiple of KV heads");
  require(m.tokens >= 1, "attention over an empty cache");
  const std::int64_t group = q_heads / m.heads, d = m.dim, S = m.tokens;
  // Exceptions (bad_alloc) must not leave the OpenMP region: the first one is
  // kept and rethrown after it.
  std::exception_ptr failure;
#pragma omp parallel for schedule(static) if (m.heads > 1 && S * d * group > (1 << 16))
  for (std::int64_t h = 0; h < m.heads; ++h) {
    try {
      attend_head(m, h, q, group, scale, out, probs);
    } catch (...) {
#pragma omp critical(kvcal_hex_attend)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

void HexLayerCache::attend_head(const Impl& m, std::int64_t h, const float* q, std::int64_t group, float scale,
                                float* out, float* probs) {
  const std::int64_t d = m.dim, S = m.tokens;
  {
    const Impl::Head& hd = m.head[static_cast<std::size_t>(h)];
    const float* qh = q + h * group * d;
    float* oh = out + h * group * d;
    std::vector<float> local;
    float* p;
    if (probs) {
      p = probs + h * group * S;
    } else {
      local.resize(static_cast<std::size_t>(group * S));
      p = local.data();
    }
    std::int64_t pos = 0;
    for (const HexBlock& b : hd.blocks) {
      hex_block_scores(b.view(), qh, group, d, scale, p + pos, S);
      pos += b.tokens;
    }
    const std::int64_t off = m.residual_offset();
    fp16_scores(qh, group, d, hd.res_k.data() + off * d, S - pos, d, d, scale, p + pos, S);
    softmax_rows(p, group, S, S);
    for (std::int64_t j = 0; j < group; ++j) std::fill(oh + j * d, oh + (j + 1) * d, 0.0f);
    pos = 0;
    for (const HexBlock& b : hd.blocks) {
      hex_block_accumulate(b.view(), p + pos, group, S, oh, d);
      pos += b.tokens;
    }
    fp16_accumulate(p + pos, group, S, hd.res_v.data() + off * d, S - pos, d, d, oh, d);
  }
}

std::int64_t HexLayerCache::tokens() const { return impl_->tokens; }
std::int64_t HexLayerCache::compressed_tokens() const { return impl_->compressed; }
std::int64_t HexLayerCache::bytes() const {
  std::int64_t total = 0;
  for (const auto& hd : impl_->head)
    for (const HexBlock& b : hd.blocks) total += b.bytes();
  total += (impl_->tokens - impl_->compressed) * impl_->dim * 2 * 2 * impl_->heads;
  return total;
}
std::int64_t HexLayerCache::fp16_bytes() const { return impl_->tokens * impl_->dim * 2 * 2 * impl_->heads; }
const HexOptions& HexLayerCache::options() const { return impl_->opt; }
std::vector<HexBlockView> HexLayerCache::blocks(std::int64_t head) const {
  require(head >= 0 && head < impl_->heads, "head index out of range");
  std::vector<HexBlockView> out;
  for (const HexBlock& b : impl_->head[static_cast<std::size_t>(head)].blocks) out.push_back(b.view());
  return out;
}

// ---------------------------------------------------------------- H2O eviction

struct H2OEvictCache::Impl {
  std::int64_t heads = 0, q_heads = 0, dim = 0;
  double budget = 0;
  std::int64_t tokens = 0;
  struct Head {
    std::vector<half_bits> k, v;  // every token (the simulation keeps them; evicted ones are never read)
    std::vector<std::uint8_t> kept;
    std::vector<double> score;
    std::int64_t kept_count = 0;
  };
  std::vector<Head> head;

  std::int64_t limit() const {
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(budget * static_cast<double>(tokens) - 1e-9)));
  }
  void evict() {
    const std::int64_t lim = limit();
    const std::int64_t recent = (lim + 1) / 2;  // half the budget for the most recent tokens
    for (Head& hd : head) {
      if (hd.kept_count <= lim) continue;
      // Candidates: kept tokens outside the recent window, lowest score first (older first on ties).
      std::vector<std::int64_t> cand;
      for (std::int64_t t = 0; t < tokens - recent; ++t)
        if (hd.kept[static_cast<std::size_t>(t)]) cand.push_back(t);
      const auto sc = [&](std::int64_t t) {
        return static_cast<std::size_t>(t) < hd.score.size() ? hd.score[static_cast<std::size_t>(t)] : 0.0;
      };
      std::stable_sort(cand.begin(), cand.end(), [&](std::int64_t a, std::int64_t b) { return sc(a) < sc(b); });
      for (std::size_t i = 0; i < cand.size() && hd.kept_count > lim; ++i) {
        hd.kept[static_cast<std::size_t>(cand[i])] = 0;
        --hd.kept_count;
      }
    }
  }
};

H2OEvictCache::H2OEvictCache(std::int64_t kv_heads, std::int64_t q_heads, std::int64_t head_dim, double budget)
    : impl_(std::make_unique<Impl>()) {
  require(kv_heads >= 1 && head_dim >= 1 && q_heads >= kv_heads && q_heads % kv_heads == 0,
          "bad H2O cache shape (query heads must be a multiple of KV heads)");
  require(std::isfinite(budget) && budget > 0 && budget <= 1, "H2O budget must be in (0, 1]");
  impl_->heads = kv_heads;
  impl_->q_heads = q_heads;
  impl_->dim = head_dim;
  impl_->budget = budget;
  impl_->head.resize(static_cast<std::size_t>(kv_heads));
}
H2OEvictCache::~H2OEvictCache() = default;
H2OEvictCache::H2OEvictCache(H2OEvictCache&&) noexcept = default;
H2OEvictCache& H2OEvictCache::operator=(H2OEvictCache&&) noexcept = default;

void H2OEvictCache::append(const half_bits* k, const half_bits* v, std::int64_t n, std::int64_t head_stride,
                           std::int64_t token_stride) {
  Impl& m = *impl_;
  require(n >= 0, "negative token count");
  require(n <= 1 || token_stride >= m.dim, "token stride smaller than head_dim");
  for (std::int64_t h = 0; h < m.heads; ++h)
    for (std::int64_t i = 0; i < n; ++i)
      require(finite_halves(k + h * head_stride + i * token_stride, m.dim) &&
                  finite_halves(v + h * head_stride + i * token_stride, m.dim),
              "non-finite key or value");
  for (std::int64_t h = 0; h < m.heads; ++h) {
    auto& hd = m.head[static_cast<std::size_t>(h)];
    for (std::int64_t i = 0; i < n; ++i) {
      const half_bits* kr = k + h * head_stride + i * token_stride;
      const half_bits* vr = v + h * head_stride + i * token_stride;
      hd.k.insert(hd.k.end(), kr, kr + m.dim);
      hd.v.insert(hd.v.end(), vr, vr + m.dim);
      hd.kept.push_back(1);
    }
    hd.kept_count += n;
  }
  m.tokens += n;
  m.evict();
}

void H2OEvictCache::observe(const float* attn, std::int64_t tokens, std::int64_t head_stride) {
  Impl& m = *impl_;
  const std::int64_t group = m.q_heads / m.heads;
  require(tokens >= 0, "negative attention shape");
  for (std::int64_t j = 0; j < m.q_heads; ++j)
    for (std::int64_t t = 0; t < tokens; ++t)
      require(std::isfinite(attn[j * head_stride + t]), "non-finite attention weight");
  for (std::int64_t j = 0; j < m.q_heads; ++j) {
    auto& sc = m.head[static_cast<std::size_t>(j / group)].score;
    if (static_cast<std::int64_t>(sc.size()) < tokens) sc.resize(static_cast<std::size_t>(tokens), 0.0);
    for (std::int64_t t = 0; t < tokens; ++t) sc[static_cast<std::size_t>(t)] += attn[j * head_stride + t];
  }
}

void H2OEvictCache::attend(const float* q, float scale, float* out, float* probs) const {
  const Impl& m = *impl_;
  require(m.tokens >= 1, "attention over an empty cache");
  const std::int64_t group = m.q_heads / m.heads, d = m.dim, S = m.tokens;
  if (probs) std::fill(probs, probs + m.q_heads * S, 0.0f);
  for (std::int64_t h = 0; h < m.heads; ++h) {
    const auto& hd = m.head[static_cast<std::size_t>(h)];
    std::vector<half_bits> k, v;
    std::vector<std::int64_t> pos;
    for (std::int64_t t = 0; t < S; ++t)
      if (hd.kept[static_cast<std::size_t>(t)]) {
        k.insert(k.end(), hd.k.begin() + t * d, hd.k.begin() + (t + 1) * d);
        v.insert(v.end(), hd.v.begin() + t * d, hd.v.begin() + (t + 1) * d);
        pos.push_back(t);
      }
    const auto n = static_cast<std::int64_t>(pos.size());
    std::vector<float> p(static_cast<std::size_t>(group * n));
    attend_fp16(q + h * group * d, group, d, k.data(), v.data(), n, d, d, scale, out + h * group * d, d, p.data());
    if (probs)
      for (std::int64_t j = 0; j < group; ++j)
        for (std::int64_t i = 0; i < n; ++i)
          probs[(h * group + j) * S + pos[static_cast<std::size_t>(i)]] = p[static_cast<std::size_t>(j * n + i)];
  }
}

std::int64_t H2OEvictCache::tokens() const { return impl_->tokens; }
std::int64_t H2OEvictCache::kept(std::int64_t head) const {
  require(head >= 0 && head < impl_->heads, "head index out of range");
  return impl_->head[static_cast<std::size_t>(head)].kept_count;
}
std::int64_t H2OEvictCache::bytes() const {
  std::int64_t n = 0;
  for (const auto& hd : impl_->head) n += hd.kept_count;
  return n * impl_->dim * 2 * 2;
}
std::int64_t H2OEvictCache::fp16_bytes() const { return impl_->tokens * impl_->dim * 2 * 2 * impl_->heads; }

}  // namespace kvcal::runtime
