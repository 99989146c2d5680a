// The HEX block contract: compression of one block of keys and values into
// fp16 rows, KCVT codes and expander entries (HEX Sec. 3; KCVT: keys grouped
// by channel, values by token), and decode (scores, value accumulation) over
// one block. The loops over codes and rows are the kernels of kernels_cpu.h.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvcal/runtime/hex.h"
#include "runtime/checks.h"
#include "runtime/hex/block.h"
#include "runtime/hex/entries_cpu.h"
#include "runtime/hex/kernels_cpu.h"
#include "runtime/hex/key_side.h"
#include "runtime/hex/runs.h"

namespace kvcal::runtime {

using detail::fail;
using detail::require;

namespace detail {

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
  for (std::int64_t j = 0; j < rows; ++j) softmax_row(s + j * stride, n);
}

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

}  // namespace detail

using namespace detail;  // NOLINT(google-build-using-namespace): the kernels and block helpers

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
  b.k_tiled = k_tiled;
  b.v_tiled = v_tiled;
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

const std::uint8_t* detail::key_rows(const HexBlockView& b, std::vector<std::uint8_t>& buf) {
  if (!b.k_tiled) return b.k_codes;
  require(b.row_bytes % KeyTileUnit(b.bits) == 0, "key tiles need rows of whole units (4 bytes, 3 for 3-bit codes)");
  buf.resize(static_cast<std::size_t>(b.quant_rows()) * static_cast<std::size_t>(b.row_bytes));
  key_tiles_to_rows(b.k_codes, b.quant_rows(), b.row_bytes, b.bits, buf.data());
  return buf.data();
}

void detail::tile_keys(HexBlock& b) {
  if (b.k_tiled || b.bits == 0 || b.k_codes.empty() || !key_tiles_layout(b.bits, b.head_dim)) return;
  const std::int64_t row_bytes = packed_bytes(b.head_dim, b.bits);
  std::vector<std::uint8_t> tiles(b.k_codes.size());
  rows_to_key_tiles(b.k_codes.data(), static_cast<std::int64_t>(b.k_codes.size()) / row_bytes, row_bytes, b.bits,
                    tiles.data());
  b.k_codes.swap(tiles);
  b.k_tiled = true;
}

const std::uint8_t* detail::value_rows(const HexBlockView& b, std::vector<std::uint8_t>& buf) {
  if (!b.v_tiled) return b.v_codes;
  buf.resize(static_cast<std::size_t>(b.quant_rows()) * static_cast<std::size_t>(b.row_bytes));
  value_tiles_to_rows(b.v_codes, b.quant_rows(), b.row_bytes, buf.data());
  return buf.data();
}

void detail::tile_values(HexBlock& b, int limbs) {
  if (b.v_tiled || b.bits == 0 || b.v_codes.empty() || !value_tiles_layout(b.bits, b.head_dim, limbs)) return;
  const std::int64_t row_bytes = packed_bytes(b.head_dim, b.bits);
  std::vector<std::uint8_t> tiles(b.v_codes.size());
  rows_to_value_tiles(b.v_codes.data(), static_cast<std::int64_t>(b.v_codes.size()) / row_bytes, row_bytes,
                      tiles.data());
  b.v_codes.swap(tiles);
  b.v_tiled = true;
}

void hex_dequantize_block(const HexBlockView& b, float* k, float* v) {
  const std::int64_t d = b.head_dim;
  std::vector<std::uint8_t> plain, plain_v;
  const std::uint8_t* k_codes = b.bits == 0 ? nullptr : key_rows(b, plain);
  const std::uint8_t* v_codes = b.bits == 0 ? nullptr : value_rows(b, plain_v);
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
      kr[c] = dequantize_value(packed_code(k_codes + q * b.row_bytes, c, b.bits), b.k_params[c]);
      vr[c] = dequantize_value(packed_code(v_codes + q * b.row_bytes, c, b.bits), b.v_params[q]);
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

// Per-thread scratch of the decode paths (no allocation per block).
struct Scratch {
  std::vector<float> qd, bias, kmin, params, sparse, qs, a, ws, kept, tmp, amax;
  std::vector<std::int8_t> w8;
  std::vector<std::int32_t> qi;
  template <class T>
  static T* get(std::vector<T>& v, std::int64_t n) {
    if (static_cast<std::int64_t>(v.size()) < n) v.resize(static_cast<std::size_t>(n));
    return v.data();
  }
};
thread_local Scratch scratch;

// The slot order the code kernels take a block's weights in: the integer
// kernels' (int_slots: 3-bit rows in the 4-bit order) or the float ones'.
struct CodeRows {
  bool int_dot;
  Slots slots;
  CodeRows(const HexBlockView& b, HexDot dot)
      : int_dot(dot != HexDot::float32 && int_dot_layout(b.bits, b.head_dim)),
        slots(int_dot ? int_slots(b.bits, b.head_dim) : Slots(b.bits, b.head_dim)) {}
};

// Calls f(first, count, quantized_index_of_first) for each run of quantized
// tokens between the kept ones, and g(t, kept_index) for each kept token, in
// token order (TokenRuns).
template <class Quant, class Kept>
void walk_tokens(const HexBlockView& b, Quant f, Kept g) {
  for (TokenRuns s{b.kept_index, b.kept_rows, b.tokens}; s.next();) {
    if (s.n > 0) f(s.t0, s.n, s.qr0);
    if (s.at_kept()) g(s.end, s.k);
  }
}

}  // namespace

const float* KeyEntries::prepare(const std::int32_t* m, std::int64_t deg, std::int64_t tokens, const float* qs,
                                 std::int64_t n, std::int64_t q_stride, std::int64_t dim, float scale) {
  if (m != mask || deg != d1 || qs != q || n != nq || q_stride != stride || tokens > rows) {
    mask = m, d1 = deg, q = qs, nq = n, stride = q_stride, rows = tokens;
    qk.resize(static_cast<std::size_t>(nq * rows * d1));
    idx.resize(static_cast<std::size_t>(rows * d1));
    // Written in order (entry-major: each entry's tokens in a row).
    for (std::int64_t e = 0; e < d1; ++e)
      for (std::int64_t t = 0; t < rows; ++t) idx[static_cast<std::size_t>(e * rows + t)] = m[t * d1 + e];
    entry_channels16(idx.data(), rows, rows, d1, idx16);
    entry_query_weights(q, nq, q_stride, dim, scale, idx.data(), d1 * rows, qk.data());
  }
  return qk.data();
}

float* ValueEntries::prepare(const std::int32_t* m, std::int64_t deg, std::int64_t tokens, std::int64_t n, float* o,
                             std::int64_t o_stride) {
  if (m != mask || deg != d1 || n != nq || o != out || o_stride != out_stride || tokens > rows) {
    flush();
    mask = m, d1 = deg, nq = n, out = o, out_stride = o_stride, rows = std::max(rows, tokens);
    sums.assign(static_cast<std::size_t>(nq * rows * d1), 0.0f);
  }
  return sums.data();
}

void ValueEntries::prepare_code(const Slots& sl, std::int64_t n, float* o, std::int64_t o_stride) {
  CodeSums& c = code;
  if (sl.dim == c.order.dim && sl.per == c.order.per && n == c.nq && o == c.out && o_stride == c.out_stride) return;
  flush();
  c.order = sl, c.nq = n, c.out = o, c.out_stride = o_stride;
  c.acc.assign(static_cast<std::size_t>(n * sl.dim), 0.0f);
  c.base.assign(static_cast<std::size_t>(n), 0.0f);
}

void ValueEntries::scale(std::int64_t j, float f) {
  const auto mul = [f](float* x, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) x[i] *= f;
  };
  if (mask && j < nq) mul(sums.data() + j * rows * d1, rows * d1);
  CodeSums& c = code;
  if (c.out && j < c.nq) {
    mul(c.acc.data() + j * c.order.dim, c.order.dim);
    c.base[static_cast<std::size_t>(j)] *= f;
  }
}

void ValueEntries::flush() {
  if (mask) {
    for (std::int64_t j = 0; j < nq; ++j) {
      const float* sj = sums.data() + j * rows * d1;
      float* oj = out + j * out_stride;
      for (std::int64_t e = 0; e < d1; ++e)  // the sums in order
        for (std::int64_t t = 0; t < rows; ++t) oj[mask[t * d1 + e]] += sj[e * rows + t];
    }
    std::fill(sums.begin(), sums.end(), 0.0f);
  }
  CodeSums& c = code;
  if (c.out) {
    const std::int64_t d = c.order.dim;
    for (std::int64_t j = 0; j < c.nq; ++j)
      add_slots(c.acc.data() + j * d, c.order, c.base[j], c.out + j * c.out_stride);
    std::fill(c.acc.begin(), c.acc.end(), 0.0f);
    std::fill(c.base.begin(), c.base.end(), 0.0f);
  }
}

// Scores: the packed rows through code_scores (one pass for the whole query
// group), then per token the bias q . min and the expander corrections.
void hex_block_scores(const HexBlockView& b, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                      float* scores, std::int64_t s_stride, HexDot dot) {
  KeyEntries ke;
  block_scores(b, q, nq, q_stride, scale, scores, s_stride, dot, ke);
}

void detail::block_scores(const HexBlockView& b, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                          float* scores, std::int64_t s_stride, HexDot dot, KeyEntries& ke, bool kept) {
  const std::int64_t d = b.head_dim, d1 = b.mask_degree, nqr = b.quant_rows();
  if (b.bits == 0) {
    half_scores(q, nq, q_stride, b.k_kept, b.tokens, d, d, scale, scores, s_stride);
    return;
  }
  const CodeRows cr(b, dot);
  const Slots& sl = cr.slots;
  Scratch& sc = scratch;
  float* qd = Scratch::get(sc.qd, nq * d);  // [nq][slot]: scale * q_c * delta_c
  float* bias = Scratch::get(sc.bias, nq);  // scale * q . min
  float* kmin = Scratch::get(sc.kmin, d);
  const std::int64_t T = b.tokens;
  float* sparse = Scratch::get(sc.sparse, T * d1);  // [entry][token]: 0 for kept tokens
  float* qs = Scratch::get(sc.qs, nq * nqr);        // [nq][quantized row]: the code part of the score
  // With integer dot products, the code part is scaled on its way into the
  // scores (one pass over them instead of two).
  const std::int32_t* qi = nullptr;  // [nq][quantized row]: the integer sums
  const float* ws = nullptr;         // per query: their scale
  if (nqr > 0) {
    static_assert(sizeof(QuantParams) == 2 * sizeof(half_bits), "QuantParams is two packed halves");
    const auto* kp = reinterpret_cast<const half_bits*>(b.k_params);
    const int limbs = cr.int_dot ? dot_limbs(dot) : 0;
    std::int8_t* w8 = cr.int_dot ? Scratch::get(sc.w8, nq * limbs * d) : nullptr;
    float* ws_out = cr.int_dot ? Scratch::get(sc.ws, nq) : nullptr;
    // int8: the key side in one pass where the target has one (the same
    // bytes and floats as the steps below).
    if (limbs != 1 || !key_weights_int8(kp, q, nq, q_stride, scale, sl, w8, ws_out, kmin, bias)) {
      // The key groups' (delta, min) pairs in one conversion, then split.
      float* params = Scratch::get(sc.params, 2 * d);
      halves_to_floats(kp, 2 * d, params);
      float* amax = Scratch::get(sc.amax, nq);
      key_weights(params, q, nq, q_stride, scale, sl, qd, kmin, bias, amax, Scratch::get(sc.tmp, 2 * d));
      if (cr.int_dot) quantize_rows(limbs, qd, nq, d, w8, ws_out, amax);
    }
    if (cr.int_dot) {
      // Fixed-point weights per query, integer dot products, one scaling.
      std::int32_t* qi_out = Scratch::get(sc.qi, nq * nqr);
      if (b.k_tiled)
        code_scores_int_tiles(b.k_codes, nqr, b.row_bytes, b.bits, d, limbs, w8, nq, limbs * d, qi_out, nqr);
      else
        code_scores_int(b.k_codes, nqr, b.row_bytes, b.bits, d, limbs, w8, nq, limbs * d, qi_out, nqr);
      qi = qi_out;
      ws = ws_out;
    } else {
      thread_local std::vector<std::uint8_t> plain;  // the rows of tiled keys
      code_scores(key_rows(b, plain), nqr, b.row_bytes, b.bits, d, qd, nq, d, qs, nqr);
    }
    // The expander's entries (code 0): the stored value x replaces min_c, so
    // a token's score gains sum_e scale q[c_e] (x_e - min[c_e]). Up to
    // kFusedEntries per token, key_run_scores below makes the differences
    // on its way; more, they are made here once per block, for every
    // query, entry-major at their tokens' places (0 at kept tokens), so
    // that the queries' passes cover the whole block at once. Either way
    // after the codes, which the block stores before its entries: the
    // block's key side is read in one sequential stream (see BlockStore).
    if (d1 > kFusedEntries) {
      walk_tokens(
          b,
          [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) {
            key_entry_diffs(kmin, d, b.mask_indices + t0 * d1, b.k_sparse + qr0 * d1, n, d1, sparse + t0, T);
          },
          [&](std::int64_t t, std::int64_t) {
            for (std::int64_t e = 0; e < d1; ++e) sparse[e * T + t] = 0.0f;
          });
    }
  }
  const float* qk = d1 > 0 && nqr > 0 ? ke.prepare(b.mask_indices, d1, b.tokens, q, nq, q_stride, d, scale) : nullptr;
  if (qk && d1 <= kFusedEntries) {
    // The quantized tokens in one fused pass (bias, code part, entries);
    // the kept tokens' scores are written below.
    key_run_scores(kmin, d, ke.idx.data(), ke.rows, ke.idx16.data(), b.k_sparse, b.kept_index, b.kept_rows, b.tokens,
                   d1, nq, bias, ws, qi, qi ? nullptr : qs, nqr, qk, ke.rows, scores, s_stride);
  } else {
    for (std::int64_t j = 0; j < nq; ++j) {
      float* sj = scores + j * s_stride;
      // bias + code part, then the entries' products in entry order (kept
      // tokens: 0 here, their own scores below).
      walk_tokens(
          b,
          [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) {
            const float bj = bias[j];
            if (qi) {
              const float wj = ws[j];
              const std::int32_t* qij = qi + j * nqr + qr0;
              for (std::int64_t i = 0; i < n; ++i) sj[t0 + i] = bj + wj * static_cast<float>(qij[i]);
            } else {
              const float* qsj = qs + j * nqr + qr0;
              for (std::int64_t i = 0; i < n; ++i) sj[t0 + i] = bj + qsj[i];
            }
          },
          [&](std::int64_t t, std::int64_t) { sj[t] = 0.0f; });
      if (qk) entry_scores(qk + j * ke.rows * d1, ke.rows, sparse, T, T, d1, sj);
    }
  }
  if (kept) kept_scores(&b, 1, q, nq, q_stride, scale, scores, s_stride);
}

// Accumulation: per token the weights p_t * delta_t of the packed rows, the
// bias sum p_t * min_t and the expander corrections; then code_accumulate
// over all packed rows at once.
void hex_block_accumulate(const HexBlockView& b, const float* p, std::int64_t nq, std::int64_t p_stride, float* out,
                          std::int64_t out_stride, HexDot dot) {
  ValueEntries ve;
  block_accumulate(b, p, nq, p_stride, out, out_stride, dot, ve);
  ve.flush();
}

void detail::block_accumulate(const HexBlockView& b, const float* p, std::int64_t nq, std::int64_t p_stride, float* out,
                              std::int64_t out_stride, HexDot dot, ValueEntries& ve, bool kept) {
  const std::int64_t d = b.head_dim, d1 = b.mask_degree, nqr = b.quant_rows();
  if (b.bits == 0) {
    half_accumulate(p, nq, p_stride, b.v_kept, b.tokens, d, d, out, out_stride);
    return;
  }
  const CodeRows cr(b, dot);
  const Slots& sl = cr.slots;
  Scratch& sc = scratch;
  // The code part in slot order and the bias, added up over the blocks.
  ve.prepare_code(sl, nq, out, out_stride);
  float* acc = ve.code.acc.data();          // [nq][slot]: sum_t p_t delta_t code_tc
  float* base = ve.code.base.data();        // sum_t p_t min_t
  float* a = Scratch::get(sc.a, nq * nqr);  // [nq][quantized row]: p_t delta_t
  const std::int64_t T = b.tokens;
  float* sparse = Scratch::get(sc.sparse, T * d1);   // [entry][token]: 0 for kept tokens
  float* params = Scratch::get(sc.params, 2 * nqr);  // (delta, min) per quantized row
  if (nqr > 0) halves_to_floats(reinterpret_cast<const half_bits*>(b.v_params), 2 * nqr, params);
  // The expander's entries: p_t (x_e - min_t) added to channel c_e, summed
  // per entry over the blocks (ve) and scattered once.
  float* sums = nullptr;
  float* amax = nullptr;  // max |a| per query, where the fused pass finds it
  const bool fused = d1 > 0 && d1 <= kFusedEntries && nqr > 0 && nq <= kRunQueries;
  if (fused) {
    // The quantized tokens in one fused pass (weights, bias sums, entry
    // sums).
    sums = ve.prepare(b.mask_indices, d1, b.tokens, nq, out, out_stride);
    amax = Scratch::get(sc.amax, nq);
    value_run_weights(params, b.v_sparse, b.kept_index, b.kept_rows, b.tokens, d1, nq, p, p_stride, a, nqr, sums,
                      ve.rows, base, amax);
  } else if (d1 > 0 && nqr > 0) {
    walk_tokens(
        b,
        [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) {
          value_entry_diffs(params + 2 * qr0, b.v_sparse + qr0 * d1, n, d1, sparse + t0, T);
        },
        [&](std::int64_t t, std::int64_t) {
          for (std::int64_t e = 0; e < d1; ++e) sparse[e * T + t] = 0.0f;
        });
    sums = ve.prepare(b.mask_indices, d1, b.tokens, nq, out, out_stride);
  }
  if (!fused) {
    walk_tokens(
        b,
        [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) {
          for (std::int64_t j = 0; j < nq; ++j) {
            const float* pj = p + j * p_stride + t0;
            base[j] += value_weights(params + 2 * qr0, pj, n, a + j * nqr + qr0);
          }
        },
        [](std::int64_t, std::int64_t) {});
    // The entries over the whole block (their differences are 0 at kept tokens).
    if (sums)
      for (std::int64_t j = 0; j < nq; ++j)
        group_axpy(p + j * p_stride, T, d1, sparse, T, sums + j * ve.rows * d1, ve.rows);
  }
  if (kept) kept_accumulate(&b, 1, p, nq, p_stride, out, out_stride);
  if (nqr > 0 && cr.int_dot) {
    const int limbs = dot_limbs(dot);
    std::int8_t* w8 = Scratch::get(sc.w8, nq * limbs * nqr);
    std::int32_t* ai = Scratch::get(sc.qi, nq * d);
    float* ws = Scratch::get(sc.ws, nq);
    quantize_rows(limbs, a, nq, nqr, w8, ws, amax);
    // The integer sums scaled into acc by the kernel itself (ai: scratch for
    // layouts the integer kernels do not take).
    if (b.v_tiled)
      code_accumulate_int_tiles_scaled(b.v_codes, nqr, b.row_bytes, b.bits, d, limbs, w8, nq, limbs * nqr, ws, acc, d,
                                       ai);
    else
      code_accumulate_int_scaled(b.v_codes, nqr, b.row_bytes, b.bits, d, limbs, w8, nq, limbs * nqr, ws, acc, d, ai);
    return;
  }
  if (nqr > 0) {
    thread_local std::vector<std::uint8_t> plain;  // the rows of tiled values
    code_accumulate(value_rows(b, plain), nqr, b.row_bytes, b.bits, d, a, nq, nqr, acc, d);
  }
}

// The kept tokens of blocks [0, n): their fp16 rows a run at a time, a run
// being the kept rows of consecutive blocks that lie back to back (as
// BlockStore keeps them), so that a decode pays the kernels' set-up once
// per run instead of once per block for a block's two or three kept rows.
// Calls f(k, v, rows, first) for each run, `first` its first row among the
// blocks' kept rows. Blocks without codes (bits 0) have no kept tokens here.
namespace {
template <class F>
void kept_runs(const HexBlockView* blocks, std::size_t n, F f) {
  const half_bits* k = nullptr;
  const half_bits* v = nullptr;
  std::int64_t rows = 0, first = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const HexBlockView& b = blocks[i];
    if (b.bits == 0 || b.kept_rows == 0) continue;
    const std::int64_t d = b.head_dim;
    if (rows > 0 && (b.k_kept != k + rows * d || b.v_kept != v + rows * d)) {
      f(k, v, rows, first);
      first += rows;
      rows = 0;
    }
    if (rows == 0) k = b.k_kept, v = b.v_kept;
    rows += b.kept_rows;
  }
  if (rows > 0) f(k, v, rows, first);
}
std::int64_t kept_total(const HexBlockView* blocks, std::size_t n) {
  std::int64_t total = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (blocks[i].bits != 0) total += blocks[i].kept_rows;
  return total;
}
// Calls f(t, r) for each kept token: t its place among the blocks' tokens,
// r its row among their kept rows (as kept_runs counts them).
template <class F>
void kept_places(const HexBlockView* blocks, std::size_t n, F f) {
  std::int64_t at = 0, r = 0;
  for (std::size_t i = 0; i < n; at += blocks[i].tokens, ++i) {
    const HexBlockView& b = blocks[i];
    if (b.bits == 0) continue;
    for (std::int64_t k = 0; k < b.kept_rows; ++k, ++r) f(at + b.kept_index[k], r);
  }
}
}  // namespace

void detail::kept_scores(const HexBlockView* blocks, std::size_t n, const float* q, std::int64_t nq,
                         std::int64_t q_stride, float scale, float* scores, std::int64_t s_stride) {
  const std::int64_t total = kept_total(blocks, n);
  if (total == 0) return;
  const std::int64_t d = blocks[0].head_dim;
  float* ks = Scratch::get(scratch.kept, nq * total);  // [nq][kept row]
  kept_runs(blocks, n, [&](const half_bits* k, const half_bits*, std::int64_t rows, std::int64_t first) {
    half_scores(q, nq, q_stride, k, rows, d, d, scale, ks + first, total);
  });
  // Each score to its token's place.
  kept_places(blocks, n, [&](std::int64_t t, std::int64_t r) {
    for (std::int64_t j = 0; j < nq; ++j) scores[j * s_stride + t] = ks[j * total + r];
  });
}

void detail::kept_accumulate(const HexBlockView* blocks, std::size_t n, const float* p, std::int64_t nq,
                             std::int64_t p_stride, float* out, std::int64_t out_stride) {
  const std::int64_t total = kept_total(blocks, n);
  if (total == 0) return;
  const std::int64_t d = blocks[0].head_dim;
  float* pk = Scratch::get(scratch.kept, nq * total);  // [nq][kept row]: their weights gathered
  kept_places(blocks, n, [&](std::int64_t t, std::int64_t r) {
    for (std::int64_t j = 0; j < nq; ++j) pk[j * total + r] = p[j * p_stride + t];
  });
  kept_runs(blocks, n, [&](const half_bits*, const half_bits* v, std::int64_t rows, std::int64_t first) {
    half_accumulate(pk + first, nq, total, v, rows, d, d, out, out_stride);
  });
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
  // As HexLayerCache::attend computes its fp16 method (one piece): the
  // exponentials unnormalised through the value pass, the output scaled by
  // 1 / sum once, so that the two agree bit for bit.
  half_scores(q, nq, q_stride, k, tokens, dim, token_stride, scale, p, tokens);
  std::vector<float> z(static_cast<std::size_t>(nq), 0.0f);
  for (std::int64_t j = 0; j < nq; ++j) {
    float mx = -std::numeric_limits<float>::infinity();
    online_softmax_row(p + j * tokens, tokens, mx, z[static_cast<std::size_t>(j)]);
    std::fill(out + j * out_stride, out + j * out_stride + dim, 0.0f);
  }
  half_accumulate(p, nq, tokens, v, tokens, dim, token_stride, out, out_stride);
  for (std::int64_t j = 0; j < nq; ++j) {
    const float inv = 1.0f / z[static_cast<std::size_t>(j)];
    for (std::int64_t c = 0; c < dim; ++c) out[j * out_stride + c] *= inv;
    if (probs)
      for (std::int64_t t = 0; t < tokens; ++t) p[j * tokens + t] *= inv;
  }
}

}  // namespace kvcal::runtime
