// Tests of HEX block compression, attention over compressed blocks, the
// streaming HexLayerCache and the H2O eviction baseline (hex.h).
//
// The references are written here, independently of the library: a block is
// decoded from its HexBlockView in double precision (codes extracted bit by
// bit, binary16 values decoded with ldexp), attention is a double softmax over
// plain loops, and the tokens a cache should keep in fp16 are recomputed from
// the rules in hex.h's file comment.
// AVX3_DL (AVX-512 with VNNI, VBMI2, VPOPCNTDQ) is one of the compiled
// targets; Highway leaves it out unless asked before its first include.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1
#endif
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <hwy/targets.h>

#include "kvcal/runtime/common.h"
#include "kvcal/runtime/hex.h"
#include "kvcal/runtime/mask_cache.h"
#include "kvcal/runtime/quant.h"
#include "runtime/hex_test_util.h"

namespace kvcal::runtime {
namespace {

using i64 = std::int64_t;

// ------------------------------------------------------------ references

double hv(half_bits h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double s = (h & 0x8000u) ? -1.0 : 1.0;
  if (e == 0x1f) return m ? std::numeric_limits<double>::quiet_NaN() : s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(static_cast<double>(m), -24);
  return s * std::ldexp(static_cast<double>(1024 + m), e - 25);
}

// Code c of a packed row, one bit at a time (little-endian bit stream).
unsigned ref_code(const std::uint8_t* row, i64 c, int bits) {
  unsigned v = 0;
  for (int k = 0; k < bits; ++k) {
    const i64 bit = c * bits + k;
    v |= static_cast<unsigned>((row[bit / 8] >> (bit % 8)) & 1u) << k;
  }
  return v;
}

i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

// One block decoded in double precision from its view.
struct Dense {
  i64 tokens = 0, dim = 0;
  std::vector<double> k, v;            // [tokens][dim]
  std::vector<char> kept;              // [tokens]
  std::vector<char> sparse;            // [tokens][dim]: an expander entry of a quantized token
  std::vector<double> kdelta, vdelta;  // per entry: the step of its quantization group (0 when stored fp16)
  double at_k(i64 t, i64 c) const { return k[static_cast<std::size_t>(t * dim + c)]; }
  double at_v(i64 t, i64 c) const { return v[static_cast<std::size_t>(t * dim + c)]; }
};

// Byte i of quantized row q's key codes, in either layout (HexBlockView::
// k_tiled: tiles of 16 rows, the last of the n <= 16 left, each row cut into
// units of 4 bytes, 3 for 3-bit codes, unit g of row rr of the tile from row
// t0 at t0 * row_bytes + (n g + rr) * unit).
std::uint8_t key_byte(const HexBlockView& b, i64 q, i64 i) {
  const i64 rb = b.row_bytes;
  if (!b.k_tiled) return b.k_codes[q * rb + i];
  const i64 unit = b.bits == 3 ? 3 : 4, t0 = q / 16 * 16, n = std::min<i64>(16, b.quant_rows() - t0);
  EXPECT_EQ(rb % unit, 0);
  return b.k_codes[t0 * rb + (i / unit * n + q % 16) * unit + i % unit];
}
// Byte i of quantized row q's value codes, in either layout (HexBlockView::
// v_tiled: groups of four rows, byte i of row k of the group from row r at r
// * row_bytes + 4 i + k; the rows after the last whole group stay rows).
std::uint8_t value_byte(const HexBlockView& b, i64 q, i64 i) {
  const i64 rb = b.row_bytes, g = q / 4 * 4;
  if (!b.v_tiled || g + 4 > b.quant_rows()) return b.v_codes[q * rb + i];
  return b.v_codes[g * rb + 4 * i + q % 4];
}
std::vector<std::uint8_t> value_row(const HexBlockView& b, i64 q) {
  std::vector<std::uint8_t> row(static_cast<std::size_t>(b.row_bytes));
  for (i64 i = 0; i < b.row_bytes; ++i) row[static_cast<std::size_t>(i)] = value_byte(b, q, i);
  return row;
}
std::vector<std::uint8_t> key_row(const HexBlockView& b, i64 q) {
  std::vector<std::uint8_t> row(static_cast<std::size_t>(b.row_bytes));
  for (i64 i = 0; i < b.row_bytes; ++i) row[static_cast<std::size_t>(i)] = key_byte(b, q, i);
  return row;
}

Dense decode(const HexBlockView& b) {
  Dense d;
  d.tokens = b.tokens;
  d.dim = b.head_dim;
  const auto n = static_cast<std::size_t>(d.tokens * d.dim);
  d.k.assign(n, 0);
  d.v.assign(n, 0);
  d.kdelta.assign(n, 0);
  d.vdelta.assign(n, 0);
  d.sparse.assign(n, 0);
  d.kept.assign(static_cast<std::size_t>(d.tokens), 0);
  if (b.bits == 0) {
    EXPECT_EQ(b.kept_rows, b.tokens);
    for (i64 t = 0; t < d.tokens; ++t) {
      d.kept[static_cast<std::size_t>(t)] = 1;
      for (i64 c = 0; c < d.dim; ++c) {
        d.k[static_cast<std::size_t>(t * d.dim + c)] = hv(b.k_kept[t * d.dim + c]);
        d.v[static_cast<std::size_t>(t * d.dim + c)] = hv(b.v_kept[t * d.dim + c]);
      }
    }
    return d;
  }
  EXPECT_EQ(b.row_bytes, packed_bytes(b.head_dim, b.bits));
  for (i64 i = 0; i < b.kept_rows; ++i) {
    const i64 t = b.kept_index[i];
    EXPECT_LT(t, d.tokens);
    if (i > 0) {
      EXPECT_LT(b.kept_index[i - 1], b.kept_index[i]) << "kept_index ascending";
    }
    d.kept[static_cast<std::size_t>(t)] = 1;
    for (i64 c = 0; c < d.dim; ++c) {
      d.k[static_cast<std::size_t>(t * d.dim + c)] = hv(b.k_kept[i * d.dim + c]);
      d.v[static_cast<std::size_t>(t * d.dim + c)] = hv(b.v_kept[i * d.dim + c]);
    }
  }
  i64 q = 0;
  for (i64 t = 0; t < d.tokens; ++t) {
    if (d.kept[static_cast<std::size_t>(t)]) continue;
    const std::vector<std::uint8_t> krow = key_row(b, q);
    const std::uint8_t* kr = krow.data();
    const std::vector<std::uint8_t> vrow = value_row(b, q);
    const std::uint8_t* vr = vrow.data();
    for (i64 c = 0; c < d.dim; ++c) {
      const auto i = static_cast<std::size_t>(t * d.dim + c);
      d.k[i] = hv(b.k_params[c].min) + ref_code(kr, c, b.bits) * hv(b.k_params[c].delta);
      d.v[i] = hv(b.v_params[q].min) + ref_code(vr, c, b.bits) * hv(b.v_params[q].delta);
      d.kdelta[i] = hv(b.k_params[c].delta);
      d.vdelta[i] = hv(b.v_params[q].delta);
    }
    for (i64 j = 0; j < b.mask_degree; ++j) {
      const i64 c = b.mask_indices[t * b.mask_degree + j];
      const auto i = static_cast<std::size_t>(t * d.dim + c);
      d.k[i] = hv(b.k_sparse[q * b.mask_degree + j]);
      d.v[i] = hv(b.v_sparse[q * b.mask_degree + j]);
      d.kdelta[i] = d.vdelta[i] = 0;
      d.sparse[i] = 1;
    }
    ++q;
  }
  EXPECT_EQ(q, b.quant_rows());
  return d;
}

// The storage a block should count, from hex.h's description: 2 B per kept
// index, K and V fp16 rows of kept tokens, K and V codes of quantized
// tokens, (min, delta) fp16 pairs for head_dim key groups and one value group
// per quantized token (only when some token is quantized), and fp16 K and V
// expander entries per quantized token. bits 0: K and V rows only.
i64 hand_bytes(const HexBlockView& b) {
  const i64 d = b.head_dim, kept = b.kept_rows, quant = b.tokens - b.kept_rows;
  if (b.bits == 0) return b.tokens * d * 2 /*K,V*/ * 2 /*B*/;
  i64 n = kept * 2 + kept * d * 2 * 2;
  if (quant > 0) n += 2 * quant * ceil_div(d * b.bits, 8) + (d + quant) * 2 * 2 + 2 * quant * b.mask_degree * 2;
  return n;
}

void expect_same_block(const HexBlockView& a, const HexBlockView& b, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.head_dim, b.head_dim);
  ASSERT_EQ(a.bits, b.bits);
  ASSERT_EQ(a.kept_rows, b.kept_rows);
  ASSERT_EQ(a.row_bytes, b.row_bytes);
  ASSERT_EQ(a.mask_degree, b.mask_degree);
  const i64 d = a.head_dim, kept = a.kept_rows, quant = a.quant_rows();
  if (a.bits != 0) {
    for (i64 i = 0; i < kept; ++i) EXPECT_EQ(a.kept_index[i], b.kept_index[i]);
  }
  for (i64 i = 0; i < kept * d; ++i) {
    EXPECT_EQ(a.k_kept[i], b.k_kept[i]);
    EXPECT_EQ(a.v_kept[i], b.v_kept[i]);
  }
  if (a.bits == 0 || quant == 0) return;
  for (i64 i = 0; i < quant * a.row_bytes; ++i) {
    EXPECT_EQ(key_byte(a, i / a.row_bytes, i % a.row_bytes), key_byte(b, i / a.row_bytes, i % a.row_bytes));
    EXPECT_EQ(value_byte(a, i / a.row_bytes, i % a.row_bytes), value_byte(b, i / a.row_bytes, i % a.row_bytes));
  }
  for (i64 c = 0; c < d; ++c) {
    EXPECT_EQ(a.k_params[c].min, b.k_params[c].min);
    EXPECT_EQ(a.k_params[c].delta, b.k_params[c].delta);
  }
  for (i64 q = 0; q < quant; ++q) {
    EXPECT_EQ(a.v_params[q].min, b.v_params[q].min);
    EXPECT_EQ(a.v_params[q].delta, b.v_params[q].delta);
  }
  for (i64 i = 0; i < quant * a.mask_degree; ++i) {
    EXPECT_EQ(a.k_sparse[i], b.k_sparse[i]);
    EXPECT_EQ(a.v_sparse[i], b.v_sparse[i]);
  }
  for (i64 i = 0; i < a.tokens * a.mask_degree; ++i) EXPECT_EQ(a.mask_indices[i], b.mask_indices[i]);
}

std::vector<i64> kept_list(const HexBlockView& b) {
  std::vector<i64> out;
  if (b.bits == 0) {
    for (i64 t = 0; t < b.tokens; ++t) out.push_back(t);
    return out;
  }
  for (i64 i = 0; i < b.kept_rows; ++i) out.push_back(b.kept_index[i]);
  return out;
}

// Double-precision attention: out_j = softmax(scale q_j K^T) V over rows
// K, V [n][dim].
void ref_attend(const float* q, i64 nq, i64 q_stride, const std::vector<double>& K, const std::vector<double>& V, i64 n,
                i64 dim, double scale, std::vector<double>& out, std::vector<double>& probs) {
  out.assign(static_cast<std::size_t>(nq * dim), 0);
  probs.assign(static_cast<std::size_t>(nq * n), 0);
  for (i64 j = 0; j < nq; ++j) {
    std::vector<double> s(static_cast<std::size_t>(n));
    double m = -std::numeric_limits<double>::infinity();
    for (i64 t = 0; t < n; ++t) {
      double acc = 0;
      for (i64 c = 0; c < dim; ++c)
        acc += static_cast<double>(q[j * q_stride + c]) * K[static_cast<std::size_t>(t * dim + c)];
      s[static_cast<std::size_t>(t)] = scale * acc;
      m = std::max(m, scale * acc);
    }
    double z = 0;
    for (auto& x : s) z += (x = std::exp(x - m));
    for (i64 t = 0; t < n; ++t) {
      const double p = s[static_cast<std::size_t>(t)] / z;
      probs[static_cast<std::size_t>(j * n + t)] = p;
      for (i64 c = 0; c < dim; ++c)
        out[static_cast<std::size_t>(j * dim + c)] += p * V[static_cast<std::size_t>(t * dim + c)];
    }
  }
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (const double v : x) m = std::max(m, std::fabs(v));
  return m;
}

// ------------------------------------------------------------ block compression

struct BlockCase {
  i64 tokens, dim;
  int bits;
  i64 d1;         // mask degree (0: no mask)
  int keep_mode;  // 0 none, 1 some, 2 all
  i64 pad;        // token_stride - dim
};

// Compresses random rows (expander entries made outliers) and checks every
// documented property against the input.
void check_compressed_block(const BlockCase& bc, std::mt19937_64& rng) {
  SCOPED_TRACE("tokens " + std::to_string(bc.tokens) + " dim " + std::to_string(bc.dim) + " bits " +
               std::to_string(bc.bits) + " d1 " + std::to_string(bc.d1) + " keep " + std::to_string(bc.keep_mode));
  const i64 T = bc.tokens, D = bc.dim, S = D + bc.pad;
  std::vector<half_bits> k = random_halves(static_cast<std::size_t>(T * S), rng, 1.5, 0.3);
  std::vector<half_bits> v = random_halves(static_cast<std::size_t>(T * S), rng, 0.7, -0.2);
  // Padding between rows is never read: make it non-finite.
  for (i64 t = 0; t < T; ++t)
    for (i64 c = D; c < S; ++c)
      k[static_cast<std::size_t>(t * S + c)] = v[static_cast<std::size_t>(t * S + c)] = 0x7e00u;
  std::shared_ptr<const Mask> mask;
  if (bc.d1 > 0) {
    mask = make_mask(T + 2, D, bc.d1, rng());  // more rows than tokens is allowed
    for (i64 t = 0; t < T; ++t)
      for (i64 j = 0; j < bc.d1; ++j) {
        const i64 c = mask->indices[static_cast<std::size_t>(t * bc.d1 + j)];
        k[static_cast<std::size_t>(t * S + c)] = float_to_half(rng() % 2 ? 300.0f : -250.5f);
        v[static_cast<std::size_t>(t * S + c)] = float_to_half(rng() % 2 ? 123.0f : -99.0f);
      }
  }
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(T), 0);
  for (i64 t = 0; t < T; ++t)
    keep[static_cast<std::size_t>(t)] =
        static_cast<std::uint8_t>(bc.keep_mode == 2 || (bc.keep_mode == 1 && (t % 3 == 1 || t == T - 1)));
  const HexBlock blk = hex_compress_block(k.data(), v.data(), T, D, S, keep.data(), mask, bc.bits);
  const HexBlockView b = blk.view();
  ASSERT_EQ(b.tokens, T);
  ASSERT_EQ(b.head_dim, D);
  ASSERT_EQ(b.bits, bc.bits);
  std::vector<i64> want_kept;
  for (i64 t = 0; t < T; ++t)
    if (bc.bits == 0 || keep[static_cast<std::size_t>(t)]) want_kept.push_back(t);
  ASSERT_EQ(kept_list(b), want_kept);
  const i64 quant = T - static_cast<i64>(want_kept.size());
  ASSERT_EQ(b.quant_rows(), quant);
  EXPECT_EQ(b.mask_degree, (bc.bits != 0 && quant > 0) ? bc.d1 : 0);
  EXPECT_EQ(blk.bytes(), hand_bytes(b));
  EXPECT_EQ(hex_block_bytes(b), hand_bytes(b));

  // Kept rows are the input halves, bit for bit.
  for (std::size_t i = 0; i < want_kept.size(); ++i)
    for (i64 c = 0; c < D; ++c) {
      ASSERT_EQ(b.k_kept[static_cast<i64>(i) * D + c], k[static_cast<std::size_t>(want_kept[i] * S + c)]);
      ASSERT_EQ(b.v_kept[static_cast<i64>(i) * D + c], v[static_cast<std::size_t>(want_kept[i] * S + c)]);
    }
  const Dense dd = decode(b);
  const double top = bc.bits ? (1 << bc.bits) - 1 : 0;
  const auto in_k = [&](i64 t, i64 c) { return hv(k[static_cast<std::size_t>(t * S + c)]); };
  const auto in_v = [&](i64 t, i64 c) { return hv(v[static_cast<std::size_t>(t * S + c)]); };
  const auto is_mask = [&](i64 t, i64 c) {
    if (!mask) return false;
    for (i64 j = 0; j < bc.d1; ++j)
      if (mask->indices[static_cast<std::size_t>(t * bc.d1 + j)] == c) return true;
    return false;
  };
  // Entries: fp16 ones exact, quantized ones within half their group's step.
  for (i64 t = 0; t < T; ++t)
    for (i64 c = 0; c < D; ++c) {
      const bool kept = dd.kept[static_cast<std::size_t>(t)];
      const bool sparse = !kept && is_mask(t, c);
      EXPECT_EQ(dd.sparse[static_cast<std::size_t>(t * D + c)] != 0, sparse);
      if (kept || sparse) {
        ASSERT_EQ(dd.at_k(t, c), in_k(t, c)) << "t " << t << " c " << c;
        ASSERT_EQ(dd.at_v(t, c), in_v(t, c)) << "t " << t << " c " << c;
      } else {
        const double kd = dd.kdelta[static_cast<std::size_t>(t * D + c)];
        const double vd = dd.vdelta[static_cast<std::size_t>(t * D + c)];
        ASSERT_LE(std::fabs(dd.at_k(t, c) - in_k(t, c)), kd / 2 + 1e-6 * (std::fabs(in_k(t, c)) + 1e-3))
            << "t " << t << " c " << c << " delta " << kd;
        ASSERT_LE(std::fabs(dd.at_v(t, c) - in_v(t, c)), vd / 2 + 1e-6 * (std::fabs(in_v(t, c)) + 1e-3))
            << "t " << t << " c " << c << " delta " << vd;
      }
    }
  // Groups: keys per channel over the quantized tokens, values per quantized
  // token over the channels, both without the expander entries.
  if (bc.bits != 0 && quant > 0) {
    for (i64 c = 0; c < D; ++c) {
      double lo = INFINITY, hi = -INFINITY;
      for (i64 t = 0; t < T; ++t)
        if (!dd.kept[static_cast<std::size_t>(t)] && !is_mask(t, c)) {
          lo = std::min(lo, in_k(t, c));
          hi = std::max(hi, in_k(t, c));
        }
      const QuantParams p = b.k_params[c];
      if (lo > hi) {  // every quantized entry of the channel is an expander entry
        EXPECT_EQ(p.delta, 0u);
        continue;
      }
      EXPECT_EQ(hv(p.min), lo) << "key channel " << c;
      EXPECT_GE(hv(p.min) + top * hv(p.delta), hi - 1e-7 * (hi - lo)) << "key channel " << c;
      if (hi > lo) {  // the step is the smallest binary16 that covers the range
        EXPECT_LT(hv(p.min) + top * hv(static_cast<half_bits>(p.delta - 1)), hi + 1e-7 * (hi - lo));
      }
    }
    i64 q = 0;
    for (i64 t = 0; t < T; ++t) {
      if (dd.kept[static_cast<std::size_t>(t)]) continue;
      double lo = INFINITY, hi = -INFINITY;
      for (i64 c = 0; c < D; ++c)
        if (!is_mask(t, c)) {
          lo = std::min(lo, in_v(t, c));
          hi = std::max(hi, in_v(t, c));
        }
      const QuantParams p = b.v_params[q++];
      if (lo > hi) {
        EXPECT_EQ(p.delta, 0u);
        continue;
      }
      EXPECT_EQ(hv(p.min), lo) << "value token " << t;
      EXPECT_GE(hv(p.min) + top * hv(p.delta), hi - 1e-7 * (hi - lo)) << "value token " << t;
      if (hi > lo) {  // the step is the smallest binary16 that covers the range
        EXPECT_LT(hv(p.min) + top * hv(static_cast<half_bits>(p.delta - 1)), hi + 1e-7 * (hi - lo));
      }
    }
  }
  // The library's dequantization agrees with the decode (fp16 entries exactly).
  std::vector<float> fk(static_cast<std::size_t>(T * D), -7.0f), fv(fk.size(), -7.0f);
  hex_dequantize_block(b, fk.data(), fv.data());
  for (i64 t = 0; t < T; ++t)
    for (i64 c = 0; c < D; ++c) {
      const auto i = static_cast<std::size_t>(t * D + c);
      const bool exact = dd.kept[static_cast<std::size_t>(t)] || dd.sparse[i];
      if (exact) {
        ASSERT_EQ(static_cast<double>(fk[i]), dd.k[i]);
        ASSERT_EQ(static_cast<double>(fv[i]), dd.v[i]);
      } else {
        ASSERT_NEAR(fk[i], dd.k[i], 1e-6 * (std::fabs(dd.k[i]) + 1));
        ASSERT_NEAR(fv[i], dd.v[i], 1e-6 * (std::fabs(dd.v[i]) + 1));
      }
    }
}

TEST(RuntimeHex, CompressBlockRestoresFp16AndBoundsError) {
  std::mt19937_64 rng(0x4e580001);
  const std::vector<std::pair<i64, i64>> shapes = {{1, 8}, {6, 8}, {17, 13}, {24, 64}, {5, 3}};
  for (const int bits : {0, 2, 3, 4})
    for (const auto& [T, D] : shapes)
      for (const i64 d1 : {i64{0}, i64{1}, std::min<i64>(3, D - 1)})
        for (const int keep_mode : {0, 1, 2})
          check_compressed_block(BlockCase{T, D, bits, d1, keep_mode, (T + D) % 2 ? 3 : 0}, rng);
}

TEST(RuntimeHex, CompressBlockBitsZeroIsExact) {
  std::mt19937_64 rng(0x4e580002);
  const i64 T = 9, D = 12;
  const auto k = random_halves(static_cast<std::size_t>(T * D), rng, 1000);
  const auto v = random_halves(static_cast<std::size_t>(T * D), rng, 1e-5);
  const std::vector<std::uint8_t> keep(static_cast<std::size_t>(T), 0);
  const HexBlock blk = hex_compress_block(k.data(), v.data(), T, D, D, keep.data(), make_mask(T, D, 2, 1), 0);
  const HexBlockView b = blk.view();
  EXPECT_EQ(b.kept_rows, T);
  EXPECT_EQ(b.quant_rows(), 0);
  EXPECT_EQ(b.kept_index, nullptr);
  EXPECT_EQ(b.mask_degree, 0);
  EXPECT_EQ(blk.bytes(), T * D * 2 * 2);
  std::vector<float> fk(static_cast<std::size_t>(T * D)), fv(fk.size());
  hex_dequantize_block(b, fk.data(), fv.data());
  for (std::size_t i = 0; i < fk.size(); ++i) {
    EXPECT_EQ(b.k_kept[i], k[i]);
    EXPECT_EQ(b.v_kept[i], v[i]);
    EXPECT_EQ(static_cast<double>(fk[i]), hv(k[i]));
    EXPECT_EQ(static_cast<double>(fv[i]), hv(v[i]));
  }
}

TEST(RuntimeHex, CompressBlockBytesByHand) {
  // tokens 6, head_dim 8, 2 kept rows (tokens 1 and 4), mask degree 1:
  //   kept indices         2 x 2 B                      =   4
  //   kept K and V rows    2 rows x 8 ch x 2 (K,V) x 2 B =  64
  //   codes (4 quantized)  2 (K,V) x 4 rows x row_bytes
  //   key groups           8 channels x (min, delta) x 2 B = 32
  //   value groups         4 tokens x (min, delta) x 2 B   = 16
  //   expander entries     4 rows x 1 x 2 (K,V) x 2 B      = 16
  // row_bytes = ceil(8 * bits / 8) = bits, so codes = 8 * bits:
  //   bits 2: 4 + 64 + 16 + 32 + 16 + 16 = 148
  //   bits 3: 4 + 64 + 24 + 32 + 16 + 16 = 156
  //   bits 4: 4 + 64 + 32 + 32 + 16 + 16 = 164
  // Without the mask: minus 16. All rows kept: 6 x 2 + 6 x 8 x 4 = 204 (no
  // groups, no entries). bits 0: 6 x 8 x 4 = 192 (no index list).
  std::mt19937_64 rng(0x4e580003);
  const auto k = random_halves(48, rng, 1), v = random_halves(48, rng, 1);
  const std::uint8_t keep[6] = {0, 1, 0, 0, 1, 0};
  const std::uint8_t all[6] = {1, 1, 1, 1, 1, 1};
  const auto mask = make_mask(6, 8, 1, 7);
  const std::pair<int, i64> want[] = {{2, 148}, {3, 156}, {4, 164}};
  for (const auto& [bits, bytes] : want) {
    EXPECT_EQ(hex_compress_block(k.data(), v.data(), 6, 8, 8, keep, mask, bits).bytes(), bytes) << bits;
    EXPECT_EQ(hex_compress_block(k.data(), v.data(), 6, 8, 8, keep, nullptr, bits).bytes(), bytes - 16) << bits;
    EXPECT_EQ(hex_compress_block(k.data(), v.data(), 6, 8, 8, all, mask, bits).bytes(), 204) << bits;
  }
  EXPECT_EQ(hex_compress_block(k.data(), v.data(), 6, 8, 8, keep, mask, 0).bytes(), 192);
  // 3 bits on an odd width: 5 channels -> 15 bits -> 2 bytes per row; no kept rows, no mask:
  //   codes 2 x 6 x 2 = 24, key groups 5 x 4 = 20, value groups 6 x 4 = 24 -> 68.
  EXPECT_EQ(hex_compress_block(k.data(), v.data(), 6, 5, 8, nullptr, nullptr, 3).bytes(), 68);
}

// A view marked tiled whose rows are not whole tile units (4-bit rows of 6
// bytes) is refused with one clear error, not read with bytes left out.
TEST(RuntimeHex, KeyTilesNeedWholeUnits) {
  std::mt19937_64 rng(0x4e580072);
  const i64 T = 6, D = 12;
  const auto k = random_halves(static_cast<std::size_t>(T * D), rng, 1), v = k;
  const HexBlock blk = hex_compress_block(k.data(), v.data(), T, D, D, nullptr, nullptr, 4);
  HexBlockView b = blk.view();
  ASSERT_EQ(b.row_bytes, 6);
  b.k_tiled = true;
  std::vector<float> kd(static_cast<std::size_t>(T * D)), vd(kd.size());
  EXPECT_THROW(hex_dequantize_block(b, kd.data(), vd.data()), Error);
}

TEST(RuntimeHex, CompressBlockRejectsBadInput) {
  std::mt19937_64 rng(0x4e580004);
  const i64 T = 6, D = 8;
  for (const half_bits bad : {half_bits{0x7c00u}, half_bits{0xfc00u}, half_bits{0x7e00u}}) {
    for (const int bits : {0, 2, 3, 4}) {
      auto k = random_halves(static_cast<std::size_t>(T * D), rng, 1), v = k;
      k[13] = bad;
      EXPECT_THROW(hex_compress_block(k.data(), v.data(), T, D, D, nullptr, nullptr, bits), Error);
      k[13] = 0;
      v[47] = bad;
      EXPECT_THROW(hex_compress_block(k.data(), v.data(), T, D, D, nullptr, nullptr, bits), Error);
      // ... also in a row that would be kept in fp16.
      const std::uint8_t keep[6] = {0, 0, 0, 0, 0, 1};
      EXPECT_THROW(hex_compress_block(k.data(), v.data(), T, D, D, keep, nullptr, bits), Error);
    }
  }
  const auto k = random_halves(static_cast<std::size_t>(T * D), rng, 1);
  EXPECT_THROW(hex_compress_block(k.data(), k.data(), T, D, D, nullptr, make_mask(T - 1, D, 1, 1), 3), Error);
  EXPECT_THROW(hex_compress_block(k.data(), k.data(), T, D, D, nullptr, make_mask(T, D + 1, 1, 1), 3), Error);
  EXPECT_THROW(hex_compress_block(k.data(), k.data(), T, D, D, nullptr, nullptr, 1), Error);
  EXPECT_THROW(hex_compress_block(k.data(), k.data(), T, D, D, nullptr, nullptr, 5), Error);
  EXPECT_THROW(hex_compress_block(k.data(), k.data(), 0, D, D, nullptr, nullptr, 3), Error);
  EXPECT_THROW(hex_compress_block(k.data(), k.data(), T, D, D - 1, nullptr, nullptr, 3), Error);
}

// ------------------------------------------------------------ scores / accumulate

// Decode of one block against the dense double reference, on the SIMD target
// the runtime dispatches to now.
// With an integer dot the tolerances add the documented fixed-point bounds
// (hex.h): per score (s/2) (2^b - 1) D with s = max_c |scale q_c delta_c| /
// L, per output channel (s'/2) (2^b - 1) (quantized tokens) with s' =
// max_t p_t delta_t / L, L = 8191 (int14) or 127 (int8) -- computed here
// from the block's parameters.
void check_block_decode(HexDot dot = HexDot::float32) {
  std::mt19937_64 rng(0x4e580005);
  const i64 T = 20;
  int cases = 0;
  // 64, 130: the permuted 2- and 4-bit paths (vector loops, and for 130 a
  // scalar tail); 12: permuted for 2 and 4 bits; 10: permuted for 4 bits, not
  // for 2; 7: never permuted; 128: the integer kernels' main shape (64 has
  // them too). Query groups of 1, 3, 4 (one pass) and 5 (4 + 1).
  for (const i64 D : {64, 130, 12, 10, 7, 128})
    for (const int bits : {0, 2, 3, 4})
      for (const i64 nq : {1, 3, 4, 5})
        for (const bool with_mask : {false, true})
          for (const bool with_kept : {false, true}) {
            SCOPED_TRACE("D " + std::to_string(D) + " bits " + std::to_string(bits) + " nq " + std::to_string(nq) +
                         " mask " + std::to_string(with_mask) + " kept " + std::to_string(with_kept));
            const double offset = cases % 3 == 2 ? 40.0 : 0.0;  // keys away from 0: bias and codes cancel
            auto k = random_halves(static_cast<std::size_t>(T * D), rng, 1.0, offset);
            auto v = random_halves(static_cast<std::size_t>(T * D), rng, 2.0, -offset / 2);
            std::shared_ptr<const Mask> mask;
            if (with_mask) {
              mask = make_mask(T, D, std::max<i64>(1, D / 8), rng());
              for (i64 t = 0; t < T; ++t)
                for (i64 j = 0; j < mask->row_degree; ++j) {
                  const auto i = static_cast<std::size_t>(
                      t * D + mask->indices[static_cast<std::size_t>(t * mask->row_degree + j)]);
                  k[i] = float_to_half(half_to_float(k[i]) * 25.0f);
                  v[i] = float_to_half(half_to_float(v[i]) * 25.0f - 10.0f);
                }
            }
            std::vector<std::uint8_t> keep(static_cast<std::size_t>(T), 0);
            if (with_kept)
              for (const i64 t : {0, 7, 8, 19}) keep[static_cast<std::size_t>(t)] = 1;
            const HexBlock blk = hex_compress_block(k.data(), v.data(), T, D, D, keep.data(), mask, bits);
            const HexBlockView b = blk.view();
            const Dense dd = decode(b);
            const double kmax = max_abs(dd.k), vmax = max_abs(dd.v);

            const i64 qs = D + 2, ss = T + 3;
            const auto q = random_floats(static_cast<std::size_t>(nq * qs), rng);
            const float scale = 1.0f / std::sqrt(static_cast<float>(D));
            std::vector<float> scores(static_cast<std::size_t>(nq * ss), 1234.5f);
            hex_block_scores(b, q.data(), nq, qs, scale, scores.data(), ss, dot);
            if (bits > 0 && b.quant_rows() > 0 && b.row_bytes % (bits == 3 ? 3 : 4) == 0) {
              // The same block with its keys in tiles (HexBlockView::k_tiled),
              // tiled here from the layout's definition (key_byte): the same
              // scores bit for bit, the same keys dequantized.
              const i64 rb = b.row_bytes, nqr = b.quant_rows();
              std::vector<std::uint8_t> tiled(static_cast<std::size_t>(nqr * rb));
              HexBlockView bt = b;
              bt.k_tiled = true;
              bt.k_codes = tiled.data();
              const i64 unit = bits == 3 ? 3 : 4;
              for (i64 r = 0; r < nqr; ++r) {
                const i64 t0 = r / 16 * 16, n = std::min<i64>(16, nqr - t0);
                for (i64 i = 0; i < rb; ++i)
                  tiled[static_cast<std::size_t>(t0 * rb + (i / unit * n + r % 16) * unit + i % unit)] =
                      b.k_codes[r * rb + i];
              }
              for (i64 r = 0; r < nqr; ++r) ASSERT_EQ(key_row(bt, r), key_row(b, r)) << "row " << r;
              std::vector<float> st(scores.size(), 1234.5f);
              hex_block_scores(bt, q.data(), nq, qs, scale, st.data(), ss, dot);
              ASSERT_EQ(st, scores);
              std::vector<float> k1(static_cast<std::size_t>(T * D)), v1(k1.size()), k2(k1.size()), v2(k1.size());
              hex_dequantize_block(b, k1.data(), v1.data());
              hex_dequantize_block(bt, k2.data(), v2.data());
              ASSERT_EQ(k1, k2);
              ASSERT_EQ(v1, v2);
            }
            const bool fixed = dot != HexDot::float32 && bits > 0 && b.quant_rows() > 0;
            const double levels = dot == HexDot::int8 ? 127 : 8191;
            const double top = bits > 0 ? (1 << bits) - 1 : 0;
            for (i64 j = 0; j < nq; ++j) {
              double qnorm1 = 0, wmax = 0;
              for (i64 c = 0; c < D; ++c) qnorm1 += std::fabs(q[static_cast<std::size_t>(j * qs + c)]);
              if (fixed)
                for (i64 c = 0; c < D; ++c)
                  wmax = std::max(wmax, std::fabs(static_cast<double>(scale) * q[static_cast<std::size_t>(j * qs + c)] *
                                                  hv(b.k_params[c].delta)));
              const double fixed_tol = fixed ? 1.0001 * wmax / levels / 2 * top * static_cast<double>(D) : 0.0;
              for (i64 t = 0; t < T; ++t) {
                double s = 0;
                for (i64 c = 0; c < D; ++c)
                  s += static_cast<double>(q[static_cast<std::size_t>(j * qs + c)]) * dd.at_k(t, c);
                s *= scale;
                ASSERT_NEAR(scores[static_cast<std::size_t>(j * ss + t)], s,
                            2e-5 * scale * qnorm1 * kmax + 1e-7 + fixed_tol)
                    << "query " << j << " token " << t;
              }
              for (i64 t = T; t < ss; ++t) EXPECT_EQ(scores[static_cast<std::size_t>(j * ss + t)], 1234.5f);
            }

            // out_j += sum_t p_jt v_t, with strides and a non-zero start.
            const i64 ps = T + 1, os = D + 1;
            std::vector<float> p(static_cast<std::size_t>(nq * ps));
            std::uniform_real_distribution<float> u(0.0f, 1.0f);
            for (auto& x : p) x = u(rng);
            auto out = random_floats(static_cast<std::size_t>(nq * os), rng);
            const auto out0 = out;
            hex_block_accumulate(b, p.data(), nq, ps, out.data(), os, dot);
            if (bits > 0 && b.quant_rows() > 0) {
              // The same block with its values as value tiles
              // (HexBlockView::v_tiled), tiled here from the layout's
              // definition (value_byte): the same sums bit for bit, the same
              // values dequantized (3-bit tiles: read by the integer kernels
              // where value_tiles_layout says so, untiled for the reference
              // elsewhere).
              const i64 rb = b.row_bytes, nqr = b.quant_rows();
              std::vector<std::uint8_t> tiled(static_cast<std::size_t>(nqr * rb));
              HexBlockView bt = b;
              bt.v_tiled = true;
              bt.v_codes = tiled.data();
              for (i64 r = 0; r < nqr; ++r) {
                const i64 g = r / 4 * 4;
                for (i64 i = 0; i < rb; ++i)
                  tiled[static_cast<std::size_t>(g + 4 <= nqr ? g * rb + 4 * i + r % 4 : r * rb + i)] =
                      b.v_codes[r * rb + i];
              }
              for (i64 r = 0; r < nqr; ++r) ASSERT_EQ(value_row(bt, r), value_row(b, r)) << "row " << r;
              auto out_t = out0;
              hex_block_accumulate(bt, p.data(), nq, ps, out_t.data(), os, dot);
              ASSERT_EQ(out_t, out);
              std::vector<float> k1(static_cast<std::size_t>(T * D)), v1(k1.size()), k2(k1.size()), v2(k1.size());
              hex_dequantize_block(b, k1.data(), v1.data());
              hex_dequantize_block(bt, k2.data(), v2.data());
              ASSERT_EQ(k1, k2);
              ASSERT_EQ(v1, v2);
            }
            for (i64 j = 0; j < nq; ++j) {
              double psum = 0;
              for (i64 t = 0; t < T; ++t) psum += p[static_cast<std::size_t>(j * ps + t)];
              double amax = 0;
              if (fixed) {
                const auto kept = kept_list(b);
                i64 qr = 0;
                for (i64 t = 0; t < T; ++t) {
                  if (std::find(kept.begin(), kept.end(), t) != kept.end()) continue;
                  amax = std::max(
                      amax, static_cast<double>(p[static_cast<std::size_t>(j * ps + t)]) * hv(b.v_params[qr].delta));
                  ++qr;
                }
              }
              const double fixed_vtol =
                  fixed ? 1.0001 * amax / levels / 2 * top * static_cast<double>(b.quant_rows()) : 0.0;
              for (i64 c = 0; c < D; ++c) {
                double r = out0[static_cast<std::size_t>(j * os + c)];
                for (i64 t = 0; t < T; ++t)
                  r += static_cast<double>(p[static_cast<std::size_t>(j * ps + t)]) * dd.at_v(t, c);
                ASSERT_NEAR(out[static_cast<std::size_t>(j * os + c)], r, 2e-5 * (psum * vmax + 1) + 1e-7 + fixed_vtol)
                    << "query " << j << " channel " << c;
              }
              EXPECT_EQ(out[static_cast<std::size_t>(j * os + D)], out0[static_cast<std::size_t>(j * os + D)]);
            }
            ++cases;
          }
  EXPECT_EQ(cases, 6 * 4 * 4 * 2 * 2);
}

TEST(RuntimeHex, BlockScoresAndAccumulateMatchDense) { check_block_decode(); }
TEST(RuntimeHex, BlockDecodeInt14WithinItsBound) { check_block_decode(HexDot::int14); }
TEST(RuntimeHex, BlockDecodeInt8WithinItsBound) { check_block_decode(HexDot::int8); }

// Every SIMD target compiled in and supported by this CPU, forced in turn.
// simd_target() for a Highway target: its name, and on AVX2 hosts with
// AVX-VNNI "AVX2+AVX-VNNI", on AVX3 ones with AVX-512 VNNI "AVX3+AVX512-VNNI"
// (the integer kernels on VPDPBUSD).
bool is_target_name(const std::string& name, std::int64_t target) {
  const std::string hwy_name = hwy::TargetName(target);
  return name == hwy_name || (target == HWY_AVX2 && name == hwy_name + "+AVX-VNNI") ||
         (target == HWY_AVX3 && name == hwy_name + "+AVX512-VNNI");
}

TEST(RuntimeHex, BlockDecodeOnEverySimdTarget) {
  const auto targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (const std::int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    EXPECT_TRUE(is_target_name(simd_target(), target)) << simd_target();  // the runtime really dispatches there
    check_block_decode();
    check_block_decode(HexDot::int14);
    check_block_decode(HexDot::int8);
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the host's best
  EXPECT_TRUE(is_target_name(simd_target(), targets.front())) << simd_target();
}

// ------------------------------------------------------------ attend_fp16

TEST(RuntimeHex, AttendFp16MatchesDoubleSoftmax) {
  std::mt19937_64 rng(0x4e580006);
  for (const i64 T : {1, 5, 37})
    for (const i64 D : {8, 10, 64})
      for (const i64 nq : {1, 3}) {
        SCOPED_TRACE("T " + std::to_string(T) + " D " + std::to_string(D) + " nq " + std::to_string(nq));
        const i64 ts = D + 5, qs = D + 1, os = D + 2;
        const auto k = random_halves(static_cast<std::size_t>(T * ts), rng, 2.0);
        const auto v = random_halves(static_cast<std::size_t>(T * ts), rng, 1.0, 0.5);
        const auto q = random_floats(static_cast<std::size_t>(nq * qs), rng);
        const float scale = 1.0f / std::sqrt(static_cast<float>(D));
        std::vector<double> K, V;
        for (i64 t = 0; t < T; ++t)
          for (i64 c = 0; c < D; ++c) {
            K.push_back(hv(k[static_cast<std::size_t>(t * ts + c)]));
            V.push_back(hv(v[static_cast<std::size_t>(t * ts + c)]));
          }
        std::vector<double> ro, rp;
        ref_attend(q.data(), nq, qs, K, V, T, D, scale, ro, rp);
        std::vector<float> out(static_cast<std::size_t>(nq * os), 99.0f), probs(static_cast<std::size_t>(nq * T));
        attend_fp16(q.data(), nq, qs, k.data(), v.data(), T, D, ts, scale, out.data(), os, probs.data());
        const double vmax = max_abs(V);
        for (i64 j = 0; j < nq; ++j) {
          double psum = 0;
          for (i64 t = 0; t < T; ++t) {
            const float pr = probs[static_cast<std::size_t>(j * T + t)];
            EXPECT_NEAR(pr, rp[static_cast<std::size_t>(j * T + t)], 1e-6);
            EXPECT_GE(pr, 0.0f);
            psum += pr;
          }
          EXPECT_NEAR(psum, 1.0, 1e-5);
          for (i64 c = 0; c < D; ++c)
            EXPECT_NEAR(out[static_cast<std::size_t>(j * os + c)], ro[static_cast<std::size_t>(j * D + c)],
                        1e-5 * vmax);
          EXPECT_EQ(out[static_cast<std::size_t>(j * os + D)], 99.0f);  // stride gap untouched
        }
        // Without probs: the same output.
        std::vector<float> out2(out.size(), 99.0f);
        attend_fp16(q.data(), nq, qs, k.data(), v.data(), T, D, ts, scale, out2.data(), os);
        EXPECT_EQ(out, out2);
      }
  std::vector<half_bits> k(8, 0);
  std::vector<float> q(8, 0), out(8);
  EXPECT_THROW(attend_fp16(q.data(), 1, 8, k.data(), k.data(), 0, 8, 8, 1.0f, out.data(), 8), Error);
}

// ------------------------------------------------------------ HexLayerCache

// A sequence of K/V for every KV head, laid out [head][token][stride].
struct Seq {
  i64 heads = 0, tokens = 0, dim = 0, stride = 0;
  std::vector<half_bits> k, v;
  i64 head_stride() const { return tokens * stride; }
  const half_bits* kp(i64 t0) const { return k.data() + t0 * stride; }
  const half_bits* vp(i64 t0) const { return v.data() + t0 * stride; }
  half_bits K(i64 h, i64 t, i64 c) const { return k[static_cast<std::size_t>(h * head_stride() + t * stride + c)]; }
  half_bits V(i64 h, i64 t, i64 c) const { return v[static_cast<std::size_t>(h * head_stride() + t * stride + c)]; }
};

Seq make_seq(i64 heads, i64 tokens, i64 dim, std::mt19937_64& rng, i64 pad = 0) {
  Seq s{heads, tokens, dim, dim + pad, {}, {}};
  s.k = random_halves(static_cast<std::size_t>(heads * tokens * s.stride), rng, 1.5);
  s.v = random_halves(static_cast<std::size_t>(heads * tokens * s.stride), rng, 1.0, 0.25);
  for (i64 h = 0; h < heads; ++h)
    for (i64 t = 0; t < tokens; ++t)
      for (i64 c = dim; c < s.stride; ++c)  // padding is never read
        s.k[static_cast<std::size_t>(h * s.head_stride() + t * s.stride + c)] =
            s.v[static_cast<std::size_t>(h * s.head_stride() + t * s.stride + c)] = 0x7e00u;
  return s;
}

void append(HexLayerCache& c, const Seq& s, i64 t0, i64 n) {
  c.append(s.kp(t0), s.vp(t0), n, s.head_stride(), s.stride);
}

// Head h's K and V as the cache should hold them: its blocks decoded, then the
// residual tokens exactly as appended.
void cache_rows(const HexLayerCache& c, const Seq& s, i64 h, std::vector<double>& K, std::vector<double>& V) {
  K.clear();
  V.clear();
  i64 pos = 0;
  for (const HexBlockView& b : c.blocks(h)) {
    const Dense d = decode(b);
    K.insert(K.end(), d.k.begin(), d.k.end());
    V.insert(V.end(), d.v.begin(), d.v.end());
    pos += b.tokens;
  }
  EXPECT_EQ(pos, c.compressed_tokens());
  for (i64 t = pos; t < c.tokens(); ++t)
    for (i64 ch = 0; ch < s.dim; ++ch) {
      K.push_back(hv(s.K(h, t, ch)));
      V.push_back(hv(s.V(h, t, ch)));
    }
}

// Checks attend() over the cache against the double reference on cache_rows,
// query head j reading KV head j / group.
void check_cache_attention(const HexLayerCache& c, const Seq& s, i64 q_heads, std::mt19937_64& rng, double rel) {
  const i64 D = s.dim, S = c.tokens(), group = q_heads / s.heads;
  const auto q = random_floats(static_cast<std::size_t>(q_heads * D), rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> out(static_cast<std::size_t>(q_heads * D)), probs(static_cast<std::size_t>(q_heads * S));
  c.attend(q.data(), q_heads, scale, out.data(), probs.data());
  std::vector<float> out2(out.size());
  c.attend(q.data(), q_heads, scale, out2.data());
  EXPECT_EQ(out, out2);
  for (i64 h = 0; h < s.heads; ++h) {
    std::vector<double> K, V, ro, rp;
    cache_rows(c, s, h, K, V);
    ASSERT_EQ(static_cast<i64>(K.size()), S * D);
    ref_attend(q.data() + h * group * D, group, D, K, V, S, D, scale, ro, rp);
    const double vmax = max_abs(V);
    for (i64 j = 0; j < group; ++j) {
      double psum = 0;
      for (i64 t = 0; t < S; ++t) {
        psum += probs[static_cast<std::size_t>((h * group + j) * S + t)];
        ASSERT_NEAR(probs[static_cast<std::size_t>((h * group + j) * S + t)], rp[static_cast<std::size_t>(j * S + t)],
                    rel)
            << "head " << h << " q " << j << " token " << t;
      }
      EXPECT_NEAR(psum, 1.0, 1e-5);
      for (i64 ch = 0; ch < D; ++ch)
        ASSERT_NEAR(out[static_cast<std::size_t>((h * group + j) * D + ch)], ro[static_cast<std::size_t>(j * D + ch)],
                    rel * vmax)
            << "head " << h << " q " << j << " channel " << ch;
    }
  }
}

// bytes() from hex.h: every block's storage plus the fp16 residual.
i64 expected_cache_bytes(const HexLayerCache& c, i64 heads, i64 dim) {
  i64 n = 0;
  for (i64 h = 0; h < heads; ++h)
    for (const HexBlockView& b : c.blocks(h)) {
      EXPECT_EQ(hex_block_bytes(b), hand_bytes(b));
      n += hand_bytes(b);
    }
  return n + (c.tokens() - c.compressed_tokens()) * dim * 2 * 2 * heads;
}

// The tokens of the block at `start` that hex.h's rules keep in fp16, when
// the block is compressed with `total` tokens appended and heavy-hitter
// scores `score` (by position): the recent window (positions >= total -
// recent_window) and the top ceil(hh_ratio * block) positive scores.
std::vector<i64> expected_kept(const HexOptions& o, i64 start, i64 total, const std::vector<double>& score) {
  std::set<i64> keep;
  if (o.bits == 0) {
    for (i64 t = 0; t < o.block; ++t) keep.insert(t);
    return {keep.begin(), keep.end()};
  }
  if (o.recent)
    for (i64 t = 0; t < o.block; ++t)
      if (start + t >= total - o.recent_window) keep.insert(t);
  if (o.heavy_hitters) {
    i64 h = 0;
    while (static_cast<double>(h) < o.hh_ratio * static_cast<double>(o.block) - 1e-9) ++h;  // ceil
    std::vector<std::pair<double, i64>> cand;
    for (i64 t = 0; t < o.block; ++t) {
      const auto p = static_cast<std::size_t>(start + t);
      const double sc = p < score.size() ? score[p] : 0.0;
      if (sc > 0) cand.emplace_back(-sc, t);
    }
    std::sort(cand.begin(), cand.end());
    for (i64 i = 0; i < h && i < static_cast<i64>(cand.size()); ++i)
      keep.insert(cand[static_cast<std::size_t>(i)].second);
  }
  return {keep.begin(), keep.end()};
}

// Long contexts: 3K tokens at group 8 and 16K at group 1 (hundreds to
// thousands of blocks and a residual), whose last third holds the largest
// scores (its keys scaled up), for fp16, kcvt4 and hex4, against the double
// reference, with and without the weights out (check_cache_attention).
// attend() takes a head's blocks in pieces of 8192 / group weights with a
// running softmax: here three pieces and the residual at group 8, two and
// the residual at group 1, the maximum growing in a later piece.
TEST(RuntimeHex, LongContextsEqualReference) {
  std::mt19937_64 rng(0x4e58000c);
  const i64 H = 2, D = 16, B = 8;
  for (const char* method : {"fp16", "kcvt4", "hex4"})
    for (const i64 group : {1, 8}) {
      const i64 N = (group == 1 ? 2 * 8192 : 3 * 1024) + 5;  // a residual of 5
      HexOptions base;
      base.block = B;
      const HexOptions o = hex_method(method, base);
      HexLayerCache c(H, D, o, o.expander ? make_mask(B, D, 2, 3) : nullptr);
      Seq s = make_seq(H, N, D, rng);
      for (i64 h = 0; h < H; ++h)
        for (i64 t = N - N / 3; t < N; ++t)
          for (i64 ch = 0; ch < D; ++ch) {
            half_bits& x = s.k[static_cast<std::size_t>(h * s.head_stride() + t * s.stride + ch)];
            x = float_to_half(half_to_float(x) * 3.0f);
          }
      append(c, s, 0, N);
      SCOPED_TRACE(std::string(method) + " group " + std::to_string(group));
      check_cache_attention(c, s, group * H, rng, 1e-4);
    }
}

// attend() takes the kept tokens of a piece's blocks after the blocks, in
// runs of kept rows that lie back to back in the cache's kept streams: here
// 8 to 11 kept rows of 32 per block (4 KiB of keys or more), blocks added one at a time so
// that the streams grow in chunks and the runs break at chunk starts, one
// piece at group 1 and five at group 16 (a run across two pieces is split),
// against the double reference (check_cache_attention).
TEST(RuntimeHex, KeptRowsInRunsEqualReference) {
  std::mt19937_64 rng(0x4e580031);
  const i64 H = 2, D = 128, B = 32, N = 80 * B + 9;
  const Seq s = make_seq(H, N, D, rng);
  HexOptions base;
  base.block = B;
  base.recent_window = 3;
  base.hh_ratio = 0.25;
  std::vector<float> attn(static_cast<std::size_t>(N));
  std::exponential_distribution<float> ex(1.0f);
  for (auto& a : attn) a = ex(rng);
  for (const char* method : {"hex4", "h2o3", "hex2@int14"}) {
    SCOPED_TRACE(method);
    const HexOptions o = hex_method(method, base);
    HexLayerCache c(H, D, o, o.expander ? make_mask(B, D, 4, 9) : nullptr);
    c.observe(attn.data(), 1, N, N);
    for (i64 t = 0; t < N; t += B) append(c, s, t, std::min(B, N - t));
    i64 breaks = 0;
    for (i64 h = 0; h < H; ++h) {
      const auto blocks = c.blocks(h);
      for (std::size_t i = 0; i + 1 < blocks.size(); ++i) {
        ASSERT_GE(blocks[i].kept_rows, 8) << "block " << i;
        breaks += blocks[i + 1].k_kept != blocks[i].k_kept + blocks[i].kept_rows * D ? 1 : 0;
      }
    }
    EXPECT_GE(breaks, H) << "the kept streams crossed no chunk";
    check_cache_attention(c, s, H, rng, 1e-4);
    check_cache_attention(c, s, 16 * H, rng, 1e-4);
  }
}

TEST(RuntimeHex, Fp16CacheEqualsPlainAttention) {
  std::mt19937_64 rng(0x4e580007);
  for (const i64 q_heads : {2, 4}) {
    const i64 H = 2, D = 16, N = 27;
    HexOptions base;
    base.block = 8;
    const HexOptions o = hex_method("fp16", base);
    HexLayerCache c(H, D, o, nullptr);
    const Seq s = make_seq(H, N, D, rng, 1);
    i64 n = 0;
    for (const i64 chunk : {5, 1, 13, 7, 1}) {
      append(c, s, n, chunk);
      n += chunk;
      EXPECT_EQ(c.tokens(), n);
      EXPECT_EQ(c.compressed_tokens(), n / 8 * 8);
      EXPECT_EQ(c.bytes(), n * D * 2 * 2 * H);
      EXPECT_EQ(c.fp16_bytes(), n * D * 2 * 2 * H);
      EXPECT_EQ(c.bytes(), expected_cache_bytes(c, H, D));
      // The cache's attention against the library's plain attention over the
      // same K/V (GQA: query head j reads KV head j / group) ...
      const i64 group = q_heads / H;
      const auto q = random_floats(static_cast<std::size_t>(q_heads * D), rng);
      const float scale = 0.3f;
      std::vector<float> out(static_cast<std::size_t>(q_heads * D)), probs(static_cast<std::size_t>(q_heads * n));
      c.attend(q.data(), q_heads, scale, out.data(), probs.data());
      for (i64 h = 0; h < H; ++h) {
        std::vector<float> po(static_cast<std::size_t>(group * D)), pp(static_cast<std::size_t>(group * n));
        attend_fp16(q.data() + h * group * D, group, D, s.kp(0) + h * s.head_stride(), s.vp(0) + h * s.head_stride(), n,
                    D, s.stride, scale, po.data(), D, pp.data());
        for (i64 i = 0; i < group * D; ++i)
          EXPECT_NEAR(out[static_cast<std::size_t>(h * group * D + i)], po[static_cast<std::size_t>(i)], 1e-5);
        for (i64 i = 0; i < group * n; ++i)
          EXPECT_NEAR(probs[static_cast<std::size_t>(h * group * n + i)], pp[static_cast<std::size_t>(i)], 1e-6);
      }
      // ... and against the double reference.
      check_cache_attention(c, s, q_heads, rng, 1e-5);
    }
  }
}

HexOptions hex3_options(i64 block) {
  HexOptions base;
  base.block = block;
  base.recent_window = 3;
  base.hh_ratio = 0.125;  // 2 of 16
  return hex_method("hex3", base);
}

TEST(RuntimeHex, AppendEqualsFullModeForOneBlock) {
  std::mt19937_64 rng(0x4e580008);
  const i64 H = 2, D = 16, B = 16;
  HexOptions oa = hex3_options(B), of = oa;
  of.mode = HexMode::full;
  const auto mask = make_mask(B, D, 1, 11);
  HexLayerCache ca(H, D, oa, mask), cf(H, D, of, mask);
  const Seq s = make_seq(H, 40, D, rng);
  append(ca, s, 0, 10);
  append(cf, s, 0, 10);
  std::vector<float> attn(2 * 12, 0.0f);  // two query heads' rows over 10 tokens, stride 12
  attn[2] = 0.5f;
  attn[12 + 2] = 0.25f;  // token 2: 0.75
  attn[7] = 0.6f;        // token 7: 0.6
  attn[12 + 4] = 0.1f;   // token 4: 0.1
  ca.observe(attn.data(), 2, 10, 12);
  cf.observe(attn.data(), 2, 10, 12);
  std::vector<double> score(10, 0.0);
  score[2] = 0.75;
  score[7] = 0.6;
  score[4] = 0.1;
  append(ca, s, 10, 6);
  append(cf, s, 10, 6);
  const auto same = [&](const std::string& what) {
    ASSERT_EQ(ca.tokens(), cf.tokens());
    ASSERT_EQ(ca.compressed_tokens(), cf.compressed_tokens());
    EXPECT_EQ(ca.bytes(), cf.bytes());
    for (i64 h = 0; h < H; ++h) {
      const auto ba = ca.blocks(h), bf = cf.blocks(h);
      ASSERT_EQ(ba.size(), bf.size());
      for (std::size_t i = 0; i < ba.size(); ++i) expect_same_block(ba[i], bf[i], what);
    }
    const auto q = random_floats(static_cast<std::size_t>(H * D), rng);
    std::vector<float> oa_(static_cast<std::size_t>(H * D)), of_(oa_.size());
    ca.attend(q.data(), H, 0.25f, oa_.data());
    cf.attend(q.data(), H, 0.25f, of_.data());
    EXPECT_EQ(oa_, of_) << what;
  };
  same("one block");
  ASSERT_EQ(ca.compressed_tokens(), 16);
  // Kept: the top 2 scores (tokens 2, 7) and the last 3 tokens.
  const std::vector<i64> want = {2, 7, 13, 14, 15};
  EXPECT_EQ(expected_kept(oa, 0, 16, score), want);
  for (i64 h = 0; h < H; ++h) EXPECT_EQ(kept_list(ca.blocks(h)[0]), want);
  check_cache_attention(ca, s, H, rng, 1e-4);
  check_cache_attention(cf, s, 2 * H, rng, 1e-4);
  // Before the second block completes nothing is recompressed.
  append(ca, s, 16, 5);
  append(cf, s, 16, 5);
  same("second block pending");
  EXPECT_EQ(ca.compressed_tokens(), 16);
  check_cache_attention(cf, s, H, rng, 1e-4);  // full mode's residual starts after its blocks' source

  // Completing the second block after new scores: full mode recompresses
  // block 0 with the current scores and the window relative to 32 tokens;
  // append mode leaves it alone.
  std::vector<float> attn2(21, 0.0f);
  attn2[4] = 2.0f;   // token 4: 2.1
  attn2[18] = 1.0f;  // token 18 (second block)
  ca.observe(attn2.data(), 1, 21, 21);
  cf.observe(attn2.data(), 1, 21, 21);
  score.resize(21, 0.0);
  score[4] += 2.0;
  score[18] += 1.0;
  append(ca, s, 21, 11);
  append(cf, s, 21, 11);
  ASSERT_EQ(cf.compressed_tokens(), 32);
  for (i64 h = 0; h < H; ++h) {
    EXPECT_EQ(kept_list(ca.blocks(h)[0]), want);
    EXPECT_EQ(kept_list(cf.blocks(h)[0]), expected_kept(of, 0, 32, score));
    EXPECT_EQ(kept_list(cf.blocks(h)[0]), (std::vector<i64>{2, 4}));
    EXPECT_EQ(kept_list(ca.blocks(h)[1]), expected_kept(oa, 16, 32, score));
    EXPECT_EQ(kept_list(cf.blocks(h)[1]), (std::vector<i64>{2, 13, 14, 15}));  // token 18, the window 29..31
    expect_same_block(ca.blocks(h)[1], cf.blocks(h)[1], "second block");
  }
  EXPECT_EQ(ca.bytes(), expected_cache_bytes(ca, H, D));
  EXPECT_EQ(cf.bytes(), expected_cache_bytes(cf, H, D));
  EXPECT_LT(cf.bytes(), ca.bytes());  // block 0 lost its recent rows
  append(ca, s, 32, 3);
  append(cf, s, 32, 3);
  check_cache_attention(ca, s, H, rng, 1e-4);
  check_cache_attention(cf, s, H, rng, 1e-4);
}

TEST(RuntimeHex, StreamingCompressesFullBlocksOnly) {
  std::mt19937_64 rng(0x4e580009);
  const i64 H = 2, D = 32, B = 8, N = 61;
  for (const HexMode mode : {HexMode::append, HexMode::full}) {
    HexOptions base;
    base.block = B;
    base.recent_window = 3;
    base.hh_ratio = 0.25;  // 2 of 8
    base.mode = mode;
    const HexOptions o = hex_method("hex4", base);
    HexLayerCache c(H, D, o, make_mask(B, D, 2, 5));
    const Seq s = make_seq(H, N, D, rng, 2);
    std::vector<double> score;
    std::uniform_real_distribution<double> u(0.01, 1.0);
    // Expected kept lists, per block, as computed when each block was compressed.
    std::vector<std::vector<i64>> want;
    i64 n = 0;
    for (const i64 chunk : {3, 0, 9, 1, 1, 17, 6, 24}) {
      const i64 before = n;
      append(c, s, n, chunk);
      n += chunk;
      ASSERT_EQ(c.tokens(), n);
      ASSERT_EQ(c.compressed_tokens(), n / B * B);
      if (mode == HexMode::append) {
        // The new blocks, with the scores and total of this moment.
        for (i64 start = before / B * B; start + B <= n; start += B) want.push_back(expected_kept(o, start, n, score));
      } else if (n / B != before / B) {
        // Full mode: every block again at a block boundary; between boundaries
        // nothing changes although the scores do.
        want.clear();
        for (i64 start = 0; start + B <= n; start += B) want.push_back(expected_kept(o, start, n, score));
      }
      for (i64 h = 0; h < H; ++h) {
        const auto blocks = c.blocks(h);
        ASSERT_EQ(static_cast<i64>(blocks.size()), n / B);
        ASSERT_EQ(blocks.size(), want.size());
        for (std::size_t i = 0; i < blocks.size(); ++i)
          EXPECT_EQ(kept_list(blocks[i]), want[i]) << "block " << i << " after " << n << " tokens";
      }
      EXPECT_EQ(c.bytes(), expected_cache_bytes(c, H, D));
      EXPECT_EQ(c.fp16_bytes(), n * D * 2 * 2 * H);
      if (n > 0) check_cache_attention(c, s, 2 * H, rng, 1e-4);
      // Random positive attention over the tokens so far (3 query rows).
      if (n > 0) {
        std::vector<float> attn(static_cast<std::size_t>(3 * n));
        for (auto& a : attn) a = static_cast<float>(u(rng));
        c.observe(attn.data(), 3, n, n);
        score.resize(static_cast<std::size_t>(n), 0.0);
        for (i64 r = 0; r < 3; ++r)
          for (i64 t = 0; t < n; ++t) score[static_cast<std::size_t>(t)] += attn[static_cast<std::size_t>(r * n + t)];
      }
    }
    EXPECT_LT(c.bytes(), c.fp16_bytes());
  }
}

TEST(RuntimeHex, OneAtATimeVersusPrefix) {
  std::mt19937_64 rng(0x4e58000a);
  const i64 H = 1, D = 16, B = 16, N = 2 * B + 3;
  const Seq s = make_seq(H, N, D, rng);
  for (const std::string method : {"kcvt3", "expander2", "hex3"}) {
    SCOPED_TRACE(method);
    HexOptions base;
    base.block = B;
    base.recent_window = 8;
    const HexOptions o = hex_method(method, base);
    const auto mask = make_mask(B, D, 1, 3);
    HexLayerCache one(H, D, o, mask), all(H, D, o, mask);
    for (i64 t = 0; t < N; ++t) append(one, s, t, 1);
    append(all, s, 0, N);
    ASSERT_EQ(one.compressed_tokens(), 2 * B);
    ASSERT_EQ(all.compressed_tokens(), 2 * B);
    const auto b1 = one.blocks(0), ba = all.blocks(0);
    ASSERT_EQ(b1.size(), 2u);
    ASSERT_EQ(ba.size(), 2u);
    if (!o.recent) {
      for (std::size_t i = 0; i < 2; ++i) expect_same_block(b1[i], ba[i], "block " + std::to_string(i));
      EXPECT_EQ(b1[0].kept_rows, 0);
      continue;
    }
    // The recent window is taken relative to the total at compression time:
    // one token at a time, block b is compressed when its last token arrives,
    // so its last 8 tokens are recent; a 35-token prefix is compressed after
    // all 35 arrived, so only positions >= 27 are: none of block 0, 11..15 of block 1.
    const std::vector<double> none;
    EXPECT_EQ(kept_list(b1[0]), expected_kept(o, 0, B, none));
    EXPECT_EQ(kept_list(b1[1]), expected_kept(o, B, 2 * B, none));
    EXPECT_EQ(kept_list(b1[0]), (std::vector<i64>{8, 9, 10, 11, 12, 13, 14, 15}));
    EXPECT_EQ(kept_list(ba[0]), std::vector<i64>{});
    EXPECT_EQ(kept_list(ba[1]), (std::vector<i64>{11, 12, 13, 14, 15}));
    EXPECT_EQ(kept_list(ba[1]), expected_kept(o, B, N, none));
    // Equal keep sets give identical blocks: compress block 0 of the prefix
    // with the one-at-a-time keep set and compare.
    std::vector<std::uint8_t> keep(static_cast<std::size_t>(B), 0);
    for (const i64 t : kept_list(b1[0])) keep[static_cast<std::size_t>(t)] = 1;
    const HexBlock again = hex_compress_block(s.kp(0), s.vp(0), B, D, s.stride, keep.data(), mask, o.bits);
    expect_same_block(again.view(), b1[0], "block 0 recompressed");
    check_cache_attention(one, s, H, rng, 1e-4);
    check_cache_attention(all, s, H, rng, 1e-4);
  }
}

// The layer cache stores a head's blocks as two append-only streams (key side,
// value side): views handed out stay valid and unchanged while the cache
// grows past its first chunks, consecutive blocks follow one another in each
// stream (what lets the prefetcher run ahead), and every array starts on a
// 16-byte boundary.
TEST(RuntimeHex, BlockStreamsGrowInPlace) {
  std::mt19937_64 rng(0x4e580012);
  const i64 H = 2, D = 64, B = 32, N = 80 * B + 5;  // ~1 KiB per block side: past the first 64 KiB chunk
  const Seq s = make_seq(H, N, D, rng);
  HexOptions base;
  base.block = B;
  base.recent_window = 4;
  const HexOptions o = hex_method("hex3", base);
  const auto mask = make_mask(B, D, 2, 5);
  HexLayerCache c(H, D, o, mask);
  append(c, s, 0, B + 1);
  const auto first = c.blocks(1);
  ASSERT_EQ(first.size(), 1u);
  for (i64 t = B + 1; t < N; ++t) append(c, s, t, 1);
  const auto all = c.blocks(1);
  ASSERT_EQ(all.size(), static_cast<std::size_t>(N / B));
  EXPECT_EQ(all[0].k_codes, first[0].k_codes);
  EXPECT_EQ(all[0].v_params, first[0].v_params);
  expect_same_block(all[0], first[0], "block 0 after growth");
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  const auto end_of = [](const void* p, i64 bytes) { return static_cast<const char*>(p) + (bytes + 15) / 16 * 16; };
  i64 followed_keys = 0, followed_values = 0, followed_kept = 0, kept_pairs = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const HexBlockView& b = all[i];
    const i64 nq = b.quant_rows(), d1 = b.mask_degree, kept = b.kept_rows;
    for (const void* p : {static_cast<const void*>(b.k_params), static_cast<const void*>(b.k_codes),
                          static_cast<const void*>(b.k_sparse), static_cast<const void*>(b.v_params),
                          static_cast<const void*>(b.v_codes), static_cast<const void*>(b.v_sparse)})
      EXPECT_TRUE(aligned(p)) << "block " << i;
    if (kept > 0) {
      EXPECT_TRUE(aligned(b.k_kept)) << "block " << i;
      EXPECT_TRUE(aligned(b.v_kept)) << "block " << i;
    }
    // Key side in the order the score pass reads it (parameters, kept
    // indices, codes, entries), then the value side; the kept rows apart.
    const char* params_end = end_of(b.k_params, D * 4);
    if (kept > 0) {
      EXPECT_EQ(static_cast<const void*>(b.kept_index), params_end) << "block " << i;
    }
    EXPECT_EQ(static_cast<const void*>(b.k_codes), kept > 0 ? end_of(b.kept_index, kept * 2) : params_end);
    EXPECT_EQ(static_cast<const void*>(b.k_sparse), end_of(b.k_codes, nq * b.row_bytes)) << "block " << i;
    const char* entries_end = end_of(b.k_sparse, nq * d1 * 2);
    EXPECT_EQ(static_cast<const void*>(b.v_sparse), end_of(b.v_params, nq * 4));
    if (i + 1 < all.size()) {
      const char* value_end = end_of(b.v_codes, nq * b.row_bytes);
      followed_keys += static_cast<const void*>(all[i + 1].k_params) == entries_end ? 1 : 0;
      followed_values += static_cast<const void*>(all[i + 1].v_params) == value_end ? 1 : 0;
      // The kept rows of consecutive blocks back to back, keys and values
      // (D * 2 bytes a row: no padding between blocks).
      if (kept > 0 && all[i + 1].kept_rows > 0) {
        ++kept_pairs;
        followed_kept += static_cast<const void*>(all[i + 1].k_kept) == end_of(b.k_kept, kept * D * 2) &&
                                 static_cast<const void*>(all[i + 1].v_kept) == end_of(b.v_kept, kept * D * 2)
                             ? 1
                             : 0;
      }
    }
    std::vector<std::uint8_t> keep(static_cast<std::size_t>(B), 0);
    for (const i64 t : kept_list(b)) keep[static_cast<std::size_t>(t)] = 1;
    if (i + 1 == all.size() || i % 17 == 0) {
      const i64 t0 = static_cast<i64>(i) * B;
      const HexBlock want = hex_compress_block(s.kp(t0) + s.head_stride(), s.vp(t0) + s.head_stride(), B, D, s.stride,
                                               keep.data(), mask, 3);
      expect_same_block(b, want.view(), "block " + std::to_string(i));
    }
  }
  // Blocks follow their predecessor except at chunk starts (a few: chunks
  // double from 64 KiB), and the key stream, the larger, did cross one.
  const auto pairs = static_cast<i64>(all.size()) - 1;
  EXPECT_GE(followed_keys, pairs - 3);
  EXPECT_GE(followed_values, pairs - 3);
  // The kept rows' streams are small (a few rows a block): one chunk here.
  EXPECT_GT(kept_pairs, pairs / 2);
  EXPECT_EQ(followed_kept, kept_pairs);
  EXPECT_LT(followed_keys, pairs);
  check_cache_attention(c, s, H, rng, 1e-4);
}

TEST(RuntimeHex, HeavyHittersAreKept) {
  std::mt19937_64 rng(0x4e58000b);
  const i64 H = 2, D = 8, B = 16;
  HexOptions base;
  base.block = B;
  base.recent_window = 2;
  base.hh_ratio = 0.2;  // ceil(3.2) = 4 per block
  const HexOptions o = hex_method("h2o3", base);
  const Seq s = make_seq(H, 4 * B, D, rng);
  {
    // Only two tokens ever attended: only they (and the window) are kept.
    HexLayerCache c(H, D, o, nullptr);
    append(c, s, 0, 12);
    std::vector<float> attn(12, 0.0f);
    attn[3] = 0.9f;
    attn[9] = 0.1f;
    c.observe(attn.data(), 1, 12, 12);
    append(c, s, 12, 4);
    for (i64 h = 0; h < H; ++h) EXPECT_EQ(kept_list(c.blocks(h)[0]), (std::vector<i64>{3, 9, 14, 15}));
  }
  {
    // Scores summed over query heads and observe calls: the top 4 of the sum,
    // which is not the top 4 of any single row.
    HexLayerCache c(H, D, o, nullptr);
    append(c, s, 0, B + 10);
    std::uniform_real_distribution<float> u(0.0f, 0.02f);             // noise: at most 0.06 summed
    std::vector<float> attn(static_cast<std::size_t>(3 * 30), 0.0f);  // 3 heads, stride 30, 26 tokens
    for (i64 r = 0; r < 3; ++r)
      for (i64 t = 0; t < B + 10; ++t) attn[static_cast<std::size_t>(r * 30 + t)] = u(rng);
    attn[0 * 30 + 17] += 1.0f;  // head 0 likes 17 and 18
    attn[0 * 30 + 18] += 0.9f;
    attn[1 * 30 + 19] += 0.8f;  // head 1 likes 19 and 18
    attn[1 * 30 + 18] += 0.5f;
    attn[2 * 30 + 25] += 0.7f;  // head 2 likes 25, 20 and 3 (3 is in the compressed block 0)
    attn[2 * 30 + 20] += 0.65f;
    attn[2 * 30 + 3] += 5.0f;
    c.observe(attn.data(), 3, B + 10, 30);
    std::vector<float> more(static_cast<std::size_t>(B + 10), 0.0f);
    more[21] = 0.3f;
    more[20] = 0.3f;  // 20 overtakes 25
    c.observe(more.data(), 1, B + 10, 0);
    std::vector<double> score(static_cast<std::size_t>(B + 10), 0.0);
    for (i64 r = 0; r < 3; ++r)
      for (i64 t = 0; t < B + 10; ++t) score[static_cast<std::size_t>(t)] += attn[static_cast<std::size_t>(r * 30 + t)];
    for (i64 t = 0; t < B + 10; ++t) score[static_cast<std::size_t>(t)] += more[static_cast<std::size_t>(t)];
    append(c, s, B + 10, B - 10);
    ASSERT_EQ(c.compressed_tokens(), 2 * B);
    const std::vector<i64> want = expected_kept(o, B, 2 * B, score);
    EXPECT_EQ(want, (std::vector<i64>{1, 2, 3, 4, 14, 15}));  // 17, 18, 19, 20 and the window 30, 31
    for (i64 h = 0; h < H; ++h) {
      // Block 0 was compressed before any score: the window of 26 tokens does not reach it.
      EXPECT_EQ(c.blocks(h)[0].kept_rows, 0);
      EXPECT_EQ(kept_list(c.blocks(h)[1]), want);
    }
  }
  {
    // Many tokens with mass: at most ceil(hh_ratio * block) heavy hitters;
    // a window of 0 leaves exactly those.
    HexOptions o2 = o;
    o2.recent_window = 0;
    HexLayerCache c(H, D, o2, nullptr);
    append(c, s, 0, 15);
    std::vector<float> attn(15);
    std::uniform_real_distribution<float> u(0.5f, 1.0f);
    for (auto& a : attn) a = u(rng);
    c.observe(attn.data(), 1, 15, 15);
    append(c, s, 15, 1);  // token 15 has score 0
    std::vector<double> score(attn.begin(), attn.end());
    const auto want = expected_kept(o2, 0, 16, score);
    EXPECT_EQ(want.size(), 4u);
    EXPECT_TRUE(std::find(want.begin(), want.end(), 15) == want.end());
    for (i64 h = 0; h < H; ++h) EXPECT_EQ(kept_list(c.blocks(h)[0]), want);
    check_cache_attention(c, s, 2 * H, rng, 1e-4);
  }
}

TEST(RuntimeHex, KcvtAndExpanderKeepNoRows) {
  std::mt19937_64 rng(0x4e58000c);
  const i64 H = 2, D = 16, B = 8;
  const Seq s = make_seq(H, 30, D, rng);
  for (const std::string method : {"kcvt2", "kcvt3", "kcvt4", "expander3"}) {
    HexOptions base;
    base.block = B;
    base.hh_ratio = 0.5;
    base.recent_window = 4;
    HexLayerCache c(H, D, hex_method(method, base), make_mask(B, D, 1, 2));
    append(c, s, 0, 5);
    std::vector<float> attn(5, 1.0f);
    c.observe(attn.data(), 1, 5, 5);
    append(c, s, 5, 25);
    for (i64 h = 0; h < H; ++h)
      for (const HexBlockView& b : c.blocks(h)) {
        EXPECT_EQ(b.kept_rows, 0) << method;
        EXPECT_EQ(b.mask_degree, method == "expander3" ? 1 : 0) << method;
      }
    check_cache_attention(c, s, H, rng, 1e-4);
  }
}

TEST(RuntimeHex, GqaQueryHeadReadsItsKvHead) {
  std::mt19937_64 rng(0x4e58000d);
  const i64 H = 2, D = 12, B = 8, QH = 6;
  Seq s = make_seq(H, 21, D, rng);
  // Head 1's values far from head 0's, so that a wrong mapping is visible.
  for (i64 t = 0; t < 21; ++t)
    for (i64 c = 0; c < D; ++c)
      s.v[static_cast<std::size_t>(s.head_stride() + t * s.stride + c)] =
          float_to_half(5.0f + half_to_float(s.V(1, t, c)));
  for (const std::string method : {"fp16", "hex3"}) {
    HexOptions base;
    base.block = B;
    HexLayerCache c(H, D, hex_method(method, base), make_mask(B, D, 2, 9));
    append(c, s, 0, 21);
    check_cache_attention(c, s, QH, rng, 1e-4);
    // Query heads 0..2 read head 0 (values near 0.25), 3..5 head 1 (near 5.25).
    const auto q = random_floats(static_cast<std::size_t>(QH * D), rng, 0.1);
    std::vector<float> out(static_cast<std::size_t>(QH * D));
    c.attend(q.data(), QH, 0.3f, out.data());
    for (i64 j = 0; j < QH; ++j) {
      double mean = 0;
      for (i64 ch = 0; ch < D; ++ch) mean += out[static_cast<std::size_t>(j * D + ch)] / static_cast<double>(D);
      if (j < 3)
        EXPECT_LT(mean, 2.0) << method << " q head " << j;
      else
        EXPECT_GT(mean, 3.5) << method << " q head " << j;
    }
    std::vector<float> bad(out.size());
    EXPECT_THROW(c.attend(q.data(), 3, 0.3f, bad.data()), Error);  // not a multiple of 2
    EXPECT_THROW(c.attend(q.data(), 1, 0.3f, bad.data()), Error);  // fewer than the KV heads
  }
}

// The decode keeps its expander-entry state per thread across calls (its
// buffers reused): a query buffer overwritten in place between two decodes
// must be read again, on every integer and float path and for groups of 1
// and 4, bit for bit as a fresh buffer with the same queries.
// One KV head is the hazard: every decode then starts where the last ended.
TEST(RuntimeHex, QueriesChangedInPlaceAreReadAgain) {
  std::mt19937_64 rng(0x4e580021);
  const i64 D = 32, B = 16, N = 5 * B + 3;
  for (const i64 H : {1, 2})
    for (const std::string method : {"hex4", "hex3@int8", "hex2@int14", "hex4@int8"}) {
      const Seq s = make_seq(H, N, D, rng);
      HexOptions base;
      base.block = B;
      HexLayerCache c(H, D, hex_method(method, base), make_mask(B, D, 2, 9));
      append(c, s, 0, N);
      for (const i64 group : {1, 4}) {
        SCOPED_TRACE(method + " heads " + std::to_string(H) + " group " + std::to_string(group));
        const auto n = static_cast<std::size_t>(H * group * D);
        const auto q1 = random_floats(n, rng), q2 = random_floats(n, rng);
        std::vector<float> q = q1, out1(n), out2(n), fresh(n);
        c.attend(q.data(), H * group, 0.2f, out1.data());
        q = q2;  // the same buffer, new queries
        c.attend(q.data(), H * group, 0.2f, out2.data());
        const std::vector<float> other = q2;  // another buffer
        c.attend(other.data(), H * group, 0.2f, fresh.data());
        ASSERT_EQ(out2, fresh);
        ASSERT_NE(out1, out2);
      }
    }
}

// A cache big enough for attend() to split the KV heads across threads
// (tokens * head_dim * group above 2^16), moved once.
TEST(RuntimeHex, LargeCacheAttentionAndMove) {
  std::mt19937_64 rng(0x4e580013);
  const i64 H = 2, D = 32, B = 96, N = 2 * 1100 + 17;
  HexOptions base;
  base.block = B;
  base.hh_ratio = 0.05;
  const Seq s = make_seq(H, N, D, rng);
  HexLayerCache c(H, D, hex_method("hex4", base), make_mask(B, D, 1, 21));
  append(c, s, 0, 1000);
  std::vector<float> attn(1000);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& a : attn) a = u(rng);
  c.observe(attn.data(), 1, 1000, 1000);
  append(c, s, 1000, N - 1000);
  EXPECT_EQ(c.compressed_tokens(), N / B * B);
  EXPECT_EQ(c.bytes(), expected_cache_bytes(c, H, D));
  check_cache_attention(c, s, H, rng, 1e-4);
  check_cache_attention(c, s, 2 * H, rng, 1e-4);
  HexLayerCache moved = std::move(c);
  EXPECT_EQ(moved.tokens(), N);
  check_cache_attention(moved, s, H, rng, 1e-4);
}

TEST(RuntimeHex, LayerCacheRejectsBadInput) {
  std::mt19937_64 rng(0x4e58000e);
  const i64 D = 16, B = 8;
  HexOptions base;
  base.block = B;
  const HexOptions hex = hex_method("hex3", base);
  EXPECT_THROW(HexLayerCache(1, D, hex, nullptr), Error);                    // expander without a mask
  EXPECT_THROW(HexLayerCache(1, D, hex, make_mask(B + 1, D, 1, 1)), Error);  // wrong rows
  EXPECT_THROW(HexLayerCache(1, D, hex, make_mask(B - 1, D, 1, 1)), Error);
  EXPECT_THROW(HexLayerCache(1, D, hex, make_mask(B, D + 2, 1, 1)), Error);  // wrong cols
  EXPECT_THROW(HexLayerCache(0, D, hex, make_mask(B, D, 1, 1)), Error);
  EXPECT_THROW(HexLayerCache(1, 0, hex_method("kcvt3", base), nullptr), Error);
  EXPECT_NO_THROW(HexLayerCache(1, D, hex_method("kcvt3", base), nullptr));  // no mask needed
  EXPECT_NO_THROW(HexLayerCache(1, D, hex_method("h2o2", base), nullptr));
  EXPECT_NO_THROW(HexLayerCache(1, D, hex_method("fp16", base), nullptr));
  {
    auto broken = std::make_shared<Mask>(*make_mask(B, D, 2, 1));
    broken->indices.pop_back();  // nnz != rows * row_degree
    EXPECT_THROW(HexLayerCache(1, D, hex, broken), Error);
  }

  const auto bad_opt = [&](auto edit) {
    HexOptions o = hex;
    edit(o);
    EXPECT_THROW(check_options(o), Error);
    EXPECT_THROW(HexLayerCache(1, D, o, make_mask(o.block > 0 && o.block < 100 ? o.block : B, D, 1, 1)), Error);
  };
  EXPECT_NO_THROW(check_options(hex));
  bad_opt([](HexOptions& o) { o.block = 0; });
  bad_opt([](HexOptions& o) { o.block = 65536; });
  bad_opt([](HexOptions& o) { o.bits = 1; });
  bad_opt([](HexOptions& o) { o.bits = 5; });
  bad_opt([](HexOptions& o) { o.hh_ratio = -0.1; });
  bad_opt([](HexOptions& o) { o.hh_ratio = 1.5; });
  bad_opt([](HexOptions& o) { o.hh_ratio = std::nan(""); });
  bad_opt([](HexOptions& o) { o.recent_window = -1; });
  bad_opt([](HexOptions& o) { o.sparsity = 0; });
  bad_opt([](HexOptions& o) { o.sparsity = 1.5; });
  bad_opt([](HexOptions& o) { o.sparsity = std::numeric_limits<double>::infinity(); });
  {
    HexOptions o = hex;
    o.hh_ratio = 1.0;
    o.bits = 0;
    o.recent_window = 0;
    o.block = 65535;
    EXPECT_NO_THROW(check_options(o));
  }

  // Non-finite keys or values: rejected, and the cache is left as it was
  // (no head takes the rows of a rejected call).
  const auto mask = make_mask(B, D, 1, 1);
  HexLayerCache c(2, D, hex, mask);
  Seq s = make_seq(2, 12, D, rng);
  append(c, s, 0, 6);
  const i64 bytes = c.bytes();
  for (const half_bits bad : {half_bits{0x7e00u}, half_bits{0x7c00u}, half_bits{0xfc00u}}) {
    Seq t = s;
    for (i64 i = 6 * t.stride; i < 12 * t.stride; ++i)  // head 0's rows differ from s's (finite)
      t.k[static_cast<std::size_t>(i)] = t.v[static_cast<std::size_t>(i)] = float_to_half(7.0f);
    t.k[static_cast<std::size_t>(t.head_stride() + 9 * t.stride + 3)] = bad;  // head 1, token 9
    EXPECT_THROW(append(c, t, 6, 6), Error);
    EXPECT_EQ(c.tokens(), 6);
    EXPECT_EQ(c.compressed_tokens(), 0);
    EXPECT_EQ(c.bytes(), bytes);
    Seq u = s;
    u.v[static_cast<std::size_t>(7 * u.stride)] = bad;  // head 0, token 7
    EXPECT_THROW(append(c, u, 6, 6), Error);
    EXPECT_EQ(c.tokens(), 6);
  }
  append(c, s, 6, 6);
  EXPECT_EQ(c.compressed_tokens(), 8);
  // Block 0 is s's tokens 0..7 (window of 8 over 12 tokens: 4..7 kept).
  const auto keep_idx = expected_kept(hex, 0, 12, {});
  EXPECT_EQ(keep_idx, (std::vector<i64>{4, 5, 6, 7}));
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(B), 0);
  for (const i64 t : keep_idx) keep[static_cast<std::size_t>(t)] = 1;
  for (i64 h = 0; h < 2; ++h) {
    const HexBlock want = hex_compress_block(s.kp(0) + h * s.head_stride(), s.vp(0) + h * s.head_stride(), B, D,
                                             s.stride, keep.data(), mask, 3);
    expect_same_block(c.blocks(h)[0], want.view(), "head " + std::to_string(h));
  }
  check_cache_attention(c, s, 2, rng, 1e-4);  // the residual 8..11 is s's
  std::vector<float> nan_attn = {0.1f, std::nanf(""), 0.2f};
  EXPECT_THROW(c.observe(nan_attn.data(), 1, 3, 3), Error);
  EXPECT_THROW(c.observe(nan_attn.data(), -1, 3, 3), Error);
  EXPECT_THROW(c.blocks(2), Error);
  EXPECT_THROW(c.blocks(-1), Error);
  HexLayerCache empty(1, D, hex_method("kcvt3", base), nullptr);
  std::vector<float> q(D), out(D);
  EXPECT_THROW(empty.attend(q.data(), 1, 1.0f, out.data()), Error);
}

TEST(RuntimeHex, MethodNames) {
  HexOptions base;
  base.block = 33;
  base.hh_ratio = 0.3;
  base.recent_window = 5;
  base.sparsity = 0.25;
  base.mode = HexMode::full;
  const auto keeps_base = [&](const HexOptions& o) {
    EXPECT_EQ(o.block, 33);
    EXPECT_EQ(o.hh_ratio, 0.3);
    EXPECT_EQ(o.recent_window, 5);
    EXPECT_EQ(o.sparsity, 0.25);
    EXPECT_EQ(o.mode, HexMode::full);
  };
  const HexOptions f = hex_method("fp16", base);
  EXPECT_EQ(f.bits, 0);
  EXPECT_FALSE(f.expander);
  EXPECT_FALSE(f.heavy_hitters);
  EXPECT_FALSE(f.recent);
  keeps_base(f);
  struct Row {
    std::string prefix;
    bool expander, hh;
  };
  for (const Row& r :
       {Row{"kcvt", false, false}, Row{"h2o", false, true}, Row{"expander", true, false}, Row{"hex", true, true}})
    for (int bits = 2; bits <= 4; ++bits) {
      const HexOptions o = hex_method(r.prefix + std::to_string(bits), base);
      EXPECT_EQ(o.bits, bits) << r.prefix;
      EXPECT_EQ(o.expander, r.expander) << r.prefix;
      EXPECT_EQ(o.heavy_hitters, r.hh) << r.prefix;
      EXPECT_EQ(o.recent, r.hh) << r.prefix;
      keeps_base(o);
      EXPECT_NO_THROW(check_options(o));
    }
  for (const std::string bad : {"", "hex", "hex1", "hex5", "hex0", "hex33", "HEX3", "Hex3", " hex3", "hex3 ", "kcvt",
                                "kcvt8", "h2o", "h2o-evict", "expander", "fp32", "fp", "bf16", "hex-3"})
    EXPECT_THROW(hex_method(bad, base), Error) << "'" << bad << "'";
}

// A rejected observe() (non-finite weight) must not change the scores: append
// validates everything before it changes the cache, observe should too.
TEST(RuntimeHex, RejectedObserveLeavesScoresUnchanged) {
  std::mt19937_64 rng(0x4e580011);
  const i64 D = 8, B = 8;
  HexOptions base;
  base.block = B;
  base.recent_window = 0;
  base.hh_ratio = 1.0 / 8;  // one heavy hitter
  const Seq s = make_seq(1, B, D, rng);
  HexLayerCache c(1, D, hex_method("h2o3", base), nullptr);
  append(c, s, 0, 4);
  const std::vector<float> bad = {0.0f, 0.0f, 5.0f, std::nanf("")};
  EXPECT_THROW(c.observe(bad.data(), 1, 4, 4), Error);
  const std::vector<float> good = {0.0f, 0.1f, 0.0f, 0.0f};
  c.observe(good.data(), 1, 4, 4);
  append(c, s, 4, 4);
  // Token 1 is the only token with a (valid) score.
  EXPECT_EQ(kept_list(c.blocks(0)[0]), std::vector<i64>{1}) << "the rejected weight 5.0 of token 2 was counted";
}

// ------------------------------------------------------------ H2OEvictCache

// The tokens kept per KV head, read back from attend()'s probabilities:
// evicted tokens have weight 0, kept ones a positive weight.
std::vector<std::set<i64>> h2o_kept_sets(const H2OEvictCache& c, i64 kv_heads, i64 q_heads, i64 dim) {
  const i64 S = c.tokens(), group = q_heads / kv_heads;
  std::vector<float> q(static_cast<std::size_t>(q_heads * dim), 0.01f), out(q.size()),
      probs(static_cast<std::size_t>(q_heads * S), -1.0f);
  c.attend(q.data(), 1.0f, out.data(), probs.data());
  std::vector<std::set<i64>> sets(static_cast<std::size_t>(kv_heads));
  for (i64 h = 0; h < kv_heads; ++h)
    for (i64 t = 0; t < S; ++t) {
      const float p = probs[static_cast<std::size_t>(h * group * S + t)];
      EXPECT_GE(p, 0.0f);
      for (i64 j = 1; j < group; ++j)  // every query head of the group sees the same tokens
        EXPECT_EQ(p > 0, probs[static_cast<std::size_t>((h * group + j) * S + t)] > 0);
      if (p > 0) sets[static_cast<std::size_t>(h)].insert(t);
    }
  return sets;
}

i64 h2o_limit(double budget, i64 tokens) {
  i64 l = 0;
  while (static_cast<double>(l) < budget * static_cast<double>(tokens) - 1e-9) ++l;  // ceil
  return std::max<i64>(1, l);
}

TEST(RuntimeHex, H2OPrefixKeepsRecentHalfAndTopScores) {
  std::mt19937_64 rng(0x4e58000f);
  const i64 H = 2, QH = 4, D = 8;
  struct Case {
    i64 n;
    double budget;
  };
  for (const Case cs : {Case{40, 0.25}, Case{30, 0.3}, Case{17, 0.5}, Case{5, 1.0}, Case{9, 0.05}}) {
    SCOPED_TRACE("n " + std::to_string(cs.n) + " budget " + std::to_string(cs.budget));
    const i64 N = cs.n;
    H2OEvictCache c(H, QH, D, cs.budget);
    const Seq s = make_seq(H, N, D, rng);
    // Distinct scores observed before the prefix arrives: query heads 2h, 2h+1 count for KV head h.
    std::vector<float> attn(static_cast<std::size_t>(QH * N));
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (auto& a : attn) a = u(rng);
    c.observe(attn.data(), N, N);
    c.append(s.kp(0), s.vp(0), N, s.head_stride(), s.stride);
    ASSERT_EQ(c.tokens(), N);
    const i64 lim = h2o_limit(cs.budget, N);
    const i64 recent = (lim + 1) / 2;  // half the budget (rounded up) for the most recent tokens
    const auto sets = h2o_kept_sets(c, H, QH, D);
    i64 total_kept = 0;
    for (i64 h = 0; h < H; ++h) {
      std::vector<std::pair<double, i64>> older;
      for (i64 t = 0; t < N - recent; ++t)
        older.emplace_back(-(static_cast<double>(attn[static_cast<std::size_t>(2 * h * N + t)]) +
                             attn[static_cast<std::size_t>((2 * h + 1) * N + t)]),
                           t);
      std::sort(older.begin(), older.end());
      std::set<i64> want;
      for (i64 t = std::max<i64>(0, N - recent); t < N; ++t) want.insert(t);
      for (i64 i = 0; i < lim - recent && i < static_cast<i64>(older.size()); ++i)
        want.insert(older[static_cast<std::size_t>(i)].second);
      EXPECT_EQ(c.kept(h), static_cast<i64>(want.size()));
      EXPECT_LE(c.kept(h), lim);
      EXPECT_EQ(sets[static_cast<std::size_t>(h)], want) << "head " << h;
      total_kept += c.kept(h);

      // Attention equals plain attention over exactly the kept tokens.
      std::vector<double> K, V, ro, rp;
      std::vector<half_bits> kh, vh;
      for (const i64 t : want)
        for (i64 ch = 0; ch < D; ++ch) {
          K.push_back(hv(s.K(h, t, ch)));
          V.push_back(hv(s.V(h, t, ch)));
          kh.push_back(s.K(h, t, ch));
          vh.push_back(s.V(h, t, ch));
        }
      const auto n = static_cast<i64>(want.size());
      const auto q = random_floats(static_cast<std::size_t>(QH * D), rng);
      std::vector<float> out(static_cast<std::size_t>(QH * D)), probs(static_cast<std::size_t>(QH * N));
      c.attend(q.data(), 0.4f, out.data(), probs.data());
      ref_attend(q.data() + 2 * h * D, 2, D, K, V, n, D, 0.4, ro, rp);
      std::vector<float> po(static_cast<std::size_t>(2 * D));
      attend_fp16(q.data() + 2 * h * D, 2, D, kh.data(), vh.data(), n, D, D, 0.4f, po.data(), D);
      for (i64 i = 0; i < 2 * D; ++i) {
        EXPECT_NEAR(out[static_cast<std::size_t>(2 * h * D + i)], ro[static_cast<std::size_t>(i)], 1e-5 * max_abs(V));
        EXPECT_NEAR(out[static_cast<std::size_t>(2 * h * D + i)], po[static_cast<std::size_t>(i)], 1e-6);
      }
      for (i64 j = 0; j < 2; ++j) {
        double psum = 0;
        for (i64 t = 0; t < N; ++t) psum += probs[static_cast<std::size_t>((2 * h + j) * N + t)];
        EXPECT_NEAR(psum, 1.0, 1e-5);
      }
    }
    EXPECT_EQ(c.bytes(), total_kept * D * 2 * 2);
    EXPECT_EQ(c.fp16_bytes(), N * D * 2 * 2 * H);
  }
}

TEST(RuntimeHex, H2OEvictionIsPermanent) {
  std::mt19937_64 rng(0x4e580010);
  const i64 H = 2, QH = 2, D = 4, N = 60;
  const double budget = 0.4;
  H2OEvictCache c(H, QH, D, budget);
  const Seq s = make_seq(H, N, D, rng);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<std::set<i64>> prev(static_cast<std::size_t>(H));
  std::vector<std::set<i64>> ever_evicted(static_cast<std::size_t>(H));
  i64 n = 0;
  std::mt19937_64 chunks(3);
  while (n < N) {
    const i64 add = std::min<i64>(N - n, 1 + static_cast<i64>(chunks() % 5));
    c.append(s.kp(n), s.vp(n), add, s.head_stride(), s.stride);
    n += add;
    const i64 lim = h2o_limit(budget, n), recent = (lim + 1) / 2;
    const auto sets = h2o_kept_sets(c, H, QH, D);
    for (i64 h = 0; h < H; ++h) {
      const auto& now = sets[static_cast<std::size_t>(h)];
      EXPECT_EQ(c.kept(h), static_cast<i64>(now.size()));
      EXPECT_LE(c.kept(h), lim);
      for (i64 t = n - recent; t < n; ++t) EXPECT_TRUE(now.count(t)) << "recent token " << t << " evicted";
      for (const i64 t : now) {
        EXPECT_FALSE(ever_evicted[static_cast<std::size_t>(h)].count(t)) << "token " << t << " came back";
        EXPECT_TRUE(t >= n - add || prev[static_cast<std::size_t>(h)].count(t));
      }
      for (const i64 t : prev[static_cast<std::size_t>(h)])
        if (!now.count(t)) ever_evicted[static_cast<std::size_t>(h)].insert(t);
      prev[static_cast<std::size_t>(h)] = now;
    }
    // New attention: the evicted tokens get the largest weights of all.
    std::vector<float> attn(static_cast<std::size_t>(QH * n));
    for (i64 j = 0; j < QH; ++j)
      for (i64 t = 0; t < n; ++t)
        attn[static_cast<std::size_t>(j * n + t)] =
            ever_evicted[static_cast<std::size_t>(j)].count(t) ? 100.0f : u(rng);
    c.observe(attn.data(), n, n);
  }
  EXPECT_FALSE(ever_evicted[0].empty());
  EXPECT_FALSE(ever_evicted[1].empty());
}

TEST(RuntimeHex, H2ORejectedObserveLeavesScoresUnchanged) {
  std::mt19937_64 rng(0x4e580012);
  const i64 D = 4;
  const Seq s = make_seq(1, 4, D, rng);
  H2OEvictCache c(1, 2, D, 0.5);
  // Query head 0's row is fine, query head 1's has a NaN after a large weight.
  const std::vector<float> bad = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 5.0f, std::nanf("")};
  EXPECT_THROW(c.observe(bad.data(), 4, 4), Error);
  const std::vector<float> good = {0.2f, 0.1f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  c.observe(good.data(), 4, 4);
  c.append(s.kp(0), s.vp(0), 4, s.head_stride(), s.stride);
  // Budget 2 of 4: token 3 (recent) and the top score among 0..2, token 0.
  EXPECT_EQ(h2o_kept_sets(c, 1, 2, D)[0], (std::set<i64>{0, 3})) << "the rejected weight 5.0 of token 2 was counted";
}

// A negative token count is an error (HexLayerCache::append rejects it);
// H2OEvictCache::append accepts it and subtracts it from tokens() and kept().
TEST(RuntimeHex, H2ORejectsNegativeTokenCount) {
  std::vector<half_bits> k(16, 0x3c00u), v(16, 0x3c00u);
  H2OEvictCache c(1, 1, 4, 1.0);
  c.append(k.data(), v.data(), 3, 16, 4);
  EXPECT_THROW(c.append(k.data(), v.data(), -1, 16, 4), Error);
  EXPECT_EQ(c.tokens(), 3);
  EXPECT_EQ(c.kept(0), 3);
  HexLayerCache hc(1, 4, hex_method("fp16"), nullptr);
  EXPECT_THROW(hc.append(k.data(), v.data(), -1, 16, 4), Error);
  EXPECT_EQ(hc.tokens(), 0);
}

TEST(RuntimeHex, H2ORejectsBadInput) {
  EXPECT_THROW(H2OEvictCache(2, 3, 8, 0.5), Error);  // 3 query heads over 2 KV heads
  EXPECT_THROW(H2OEvictCache(2, 1, 8, 0.5), Error);
  EXPECT_THROW(H2OEvictCache(0, 2, 8, 0.5), Error);
  EXPECT_THROW(H2OEvictCache(1, 1, 0, 0.5), Error);
  EXPECT_THROW(H2OEvictCache(1, 1, 8, 0.0), Error);
  EXPECT_THROW(H2OEvictCache(1, 1, 8, 1.5), Error);
  EXPECT_THROW(H2OEvictCache(1, 1, 8, std::nan("")), Error);
  H2OEvictCache c(1, 2, 4, 0.5);
  std::vector<float> q(8), out(8);
  EXPECT_THROW(c.attend(q.data(), 1.0f, out.data()), Error);  // empty
  std::vector<half_bits> k(8, 0x3c00u), v(8, 0x3c00u);
  k[5] = 0x7c00u;
  EXPECT_THROW(c.append(k.data(), v.data(), 2, 8, 4), Error);
  EXPECT_EQ(c.tokens(), 0);
  k[5] = 0;
  c.append(k.data(), v.data(), 2, 8, 4);
  EXPECT_EQ(c.tokens(), 2);
  std::vector<float> attn = {0.5f, std::nanf(""), 0.5f, 0.5f};
  EXPECT_THROW(c.observe(attn.data(), 2, 2), Error);
  EXPECT_THROW(c.kept(1), Error);
}

TEST(RuntimeHex, MethodNamesTakeADotSuffix) {
  HexOptions base;
  base.block = 40;
  const HexOptions h = hex_method("hex4", base);
  EXPECT_EQ(h.dot, HexDot::float32);
  EXPECT_EQ(h.bits, 4);
  EXPECT_EQ(h.block, 40);
  const HexOptions hi = hex_method("hex4@int14", base);
  EXPECT_EQ(hi.dot, HexDot::int14);
  EXPECT_EQ(hi.bits, 4);
  EXPECT_TRUE(hi.expander && hi.heavy_hitters && hi.recent);
  const HexOptions ki = hex_method("kcvt2@int14", base);
  EXPECT_EQ(ki.dot, HexDot::int14);
  EXPECT_EQ(ki.bits, 2);
  EXPECT_FALSE(ki.expander || ki.heavy_hitters);
  base.dot = HexDot::int14;
  EXPECT_EQ(hex_method("h2o3@float32", base).dot, HexDot::float32);
  EXPECT_EQ(hex_method("h2o3", base).dot, HexDot::int14);  // no suffix: base's
  const HexOptions k8 = hex_method("kcvt4@int8", base);
  EXPECT_EQ(k8.dot, HexDot::int8);
  EXPECT_EQ(k8.bits, 4);
  EXPECT_FALSE(k8.expander || k8.heavy_hitters);
  for (const char* bad :
       {"hex4@int4", "hex4@", "fp16@int14", "fp16@int8", "hex5@int14", "@int14", "hex4@int14@int14"}) {
    try {
      (void)hex_method(bad, base);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace kvcal::runtime

// Masks an engine builds itself are checked like masks read from a file.
TEST(RuntimeHex, HandBuiltMasksAreChecked) {
  namespace rt = kvcal::runtime;
  const auto make = [](std::vector<std::int32_t> indices) {
    auto m = std::make_shared<rt::Mask>();
    m->rows = 4;
    m->cols = 8;
    m->row_degree = 2;
    m->indptr = {0, 2, 4, 6, 8};
    m->indices = std::move(indices);
    return m;
  };
  rt::HexOptions o = rt::hex_method("hex4");
  o.block = 4;
  EXPECT_NO_THROW(rt::HexLayerCache(1, 8, o, make({0, 4, 1, 5, 2, 6, 3, 7})));
  EXPECT_THROW(rt::HexLayerCache(1, 8, o, make({0, 4, 1, 5, 2, 6, 3, 8})), rt::Error);   // column out of range
  EXPECT_THROW(rt::HexLayerCache(1, 8, o, make({0, 4, 1, 1, 2, 6, 3, 7})), rt::Error);   // repeated column
  EXPECT_THROW(rt::HexLayerCache(1, 8, o, make({0, 4, 5, 1, 2, 6, 3, 7})), rt::Error);   // unsorted
  EXPECT_THROW(rt::HexLayerCache(1, 8, o, make({0, 4, 1, 5, 2, 6, 3, -1})), rt::Error);  // negative
  auto bad_indptr = make({0, 4, 1, 5, 2, 6, 3, 7});
  bad_indptr->indptr = {0, 1, 4, 6, 8};
  EXPECT_THROW(rt::HexLayerCache(1, 8, o, bad_indptr), rt::Error);
  // The kernel-level entry point checks too.
  std::vector<rt::half_bits> k(4 * 8, rt::float_to_half(1.0f)), v = k;
  EXPECT_THROW(rt::hex_compress_block(k.data(), v.data(), 4, 8, 8, nullptr, make({0, 4, 1, 5, 2, 6, 3, 9}), 4),
               rt::Error);
}
