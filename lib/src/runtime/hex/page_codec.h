// The compression of one HEX block into a page (hex_paged.h), written once
// for the host and the device: every step is a function of one independent
// item (a channel, a token, a code byte), which the host calls in a loop
// (hex_compress_page, HexPagedHost) and the CUDA kernel over its threads,
// with a barrier between steps. The arithmetic is quant.cpp's, operation for
// operation (no contraction: products feeding a sum are exact in double, and
// the float operations are single divisions and subtractions), so the codes
// and parameters are bit-identical to hex_compress_block.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcal/runtime/hex_paged.h"

namespace kvcal::runtime::codec {

// The smallest binary16 value >= x (x finite, >= 0, below 65504).
KVCAL_HD inline half_bits half_round_up(float x) {
  half_bits h = float_to_half(x);
  if (half_to_float(h) < x) ++h;
  return h;
}

KVCAL_HD inline bool finite_half(half_bits h) { return (h & 0x7c00u) != 0x7c00u; }

// Where the block's rows come from: rows t < split at a + t * a_stride, the
// others at b + (t - split) * b_stride (both in halves; V likewise).
struct Rows {
  const half_bits *ka = nullptr, *va = nullptr, *kb = nullptr, *vb = nullptr;
  std::int64_t a_stride = 0, b_stride = 0;
  std::int32_t split = 0;
  KVCAL_HD const half_bits* k(std::int32_t t) const {
    return t < split ? ka + t * a_stride : kb + (t - split) * b_stride;
  }
  KVCAL_HD const half_bits* v(std::int32_t t) const {
    return t < split ? va + t * a_stride : vb + (t - split) * b_stride;
  }
};

// One block's compression state: the geometry, the source rows, the page and
// the quantized tokens' list (qtok[q] = block token of quantized row q).
struct Block {
  HexPageGeometry g;
  Rows rows;
  const std::int32_t* mask = nullptr;  // [n_b][mask_degree]
  std::uint8_t* page = nullptr;
  std::int32_t* qtok = nullptr;  // [n_b] scratch
  std::int32_t kept = 0, quant = 0;

  KVCAL_HD std::uint16_t* kept_index() const { return reinterpret_cast<std::uint16_t*>(page + g.off_kept_index()); }
  KVCAL_HD half_bits* k_kept() const { return reinterpret_cast<half_bits*>(page + g.off_k_kept()); }
  KVCAL_HD half_bits* v_kept() const { return reinterpret_cast<half_bits*>(page + g.off_v_kept()); }
  KVCAL_HD QuantParams* k_params() const { return reinterpret_cast<QuantParams*>(page + g.off_k_params()); }
  KVCAL_HD QuantParams* v_params() const { return reinterpret_cast<QuantParams*>(page + g.off_v_params()); }
  KVCAL_HD half_bits* k_sparse() const { return reinterpret_cast<half_bits*>(page + g.off_k_sparse()); }
  KVCAL_HD half_bits* v_sparse() const { return reinterpret_cast<half_bits*>(page + g.off_v_sparse()); }

  // Whether channel c of block token t is an expander entry (the row's
  // columns are ascending).
  KVCAL_HD bool masked(std::int32_t t, std::int32_t c) const {
    const std::int32_t d1 = g.mask_degree;
    if (d1 == 0) return false;
    std::int32_t lo = 0, hi = d1;
    const std::int32_t* row = mask + t * d1;
    while (lo < hi) {
      const std::int32_t mid = (lo + hi) / 2;
      if (row[mid] < c)
        lo = mid + 1;
      else
        hi = mid;
    }
    return lo < d1 && row[lo] == c;
  }
};

// ---- step 0 (one thread): the kept list from the keep flags, the header.
KVCAL_HD inline void list_rows(Block& b, const std::uint8_t* keep) {
  std::int32_t kept = 0, quant = 0;
  for (std::int32_t t = 0; t < b.g.block; ++t) {
    if (b.g.bits == 0 || keep[t]) {
      if (b.g.bits != 0) b.kept_index()[kept] = static_cast<std::uint16_t>(t);
      b.qtok[b.g.block - 1 - kept] = t;  // kept tokens from the back of the scratch
      ++kept;
    } else {
      b.qtok[quant++] = t;
    }
  }
  b.kept = kept;
  b.quant = quant;
  auto* header = reinterpret_cast<std::int32_t*>(b.page);
  header[0] = kept;
  header[1] = b.g.block;
  header[2] = header[3] = 0;
}

// The heavy-hitter and recent-window rule of HexLayerCache: token t is kept
// when t >= recent_from, or when its score is positive and fewer than hh
// tokens rank above it (a higher score, or an equal score and an earlier
// position: a stable sort by descending score). score(t) for t < n.
template <class Score>
KVCAL_HD bool keep_row(std::int32_t t, std::int32_t n, std::int32_t hh, std::int32_t recent_from, Score score) {
  if (t >= recent_from) return true;
  const float s = score(t);
  if (hh <= 0 || !(s > 0.0f)) return false;
  std::int32_t above = 0;
  for (std::int32_t u = 0; u < n && above < hh; ++u) {
    const float su = score(u);
    if (su > s || (su == s && u < t)) ++above;
  }
  return above < hh;
}

// ---- step 1, item i < kept * head_dim: a kept row's channel, K and V.
KVCAL_HD inline void copy_kept(const Block& b, std::int32_t i) {
  const std::int32_t d = b.g.head_dim, r = i / d, c = i % d;
  const std::int32_t t = b.g.bits == 0 ? r : b.qtok[b.g.block - 1 - r];
  b.k_kept()[r * d + c] = b.rows.k(t)[c];
  b.v_kept()[r * d + c] = b.rows.v(t)[c];
}

// ---- step 1, item i < quant * mask_degree: an expander entry, K and V.
KVCAL_HD inline void copy_entry(const Block& b, std::int32_t i) {
  const std::int32_t d1 = b.g.mask_degree, q = i / d1, e = i % d1, t = b.qtok[q];
  const std::int32_t c = b.mask[t * d1 + e];
  b.k_sparse()[i] = b.rows.k(t)[c];
  b.v_sparse()[i] = b.rows.v(t)[c];
}

// quant_params over the values x(i), i < n, whose skip(i) is false; *bad set
// on a non-finite value.
template <class X, class Skip>
KVCAL_HD QuantParams group_params(std::int32_t n, int bits, X x, Skip skip, bool* bad) {
  float lo = 0.0f, hi = 0.0f;
  half_bits lo_bits = 0;
  bool any = false;
  for (std::int32_t i = 0; i < n; ++i) {
    if (skip(i)) continue;
    const half_bits h = x(i);
    if (!finite_half(h)) {
      *bad = true;
      continue;
    }
    const float v = half_to_float(h);
    if (!any || v < lo) {
      lo = v;
      lo_bits = h;
    }
    if (!any || v > hi) hi = v;
    any = true;
  }
  QuantParams p;
  if (!any) return p;
  p.min = lo_bits == 0x8000u ? half_bits{0} : lo_bits;
  const float range = hi - lo;
  p.delta = range > 0 ? half_round_up(range / static_cast<float>((1 << bits) - 1)) : half_bits{0};
  const double top = static_cast<double>((1 << bits) - 1);
  while (p.delta != 0 && static_cast<double>(half_to_float(p.min)) + top * half_to_float(p.delta) < hi) ++p.delta;
  return p;
}

// ---- step 2, item c < head_dim: the key group of channel c.
KVCAL_HD inline void key_params(const Block& b, std::int32_t c, bool* bad) {
  const std::int32_t d = b.g.head_dim;
  (void)d;
  b.k_params()[c] = group_params(
      b.quant, b.g.bits, [&](std::int32_t q) { return b.rows.k(b.qtok[q])[c]; },
      [&](std::int32_t q) { return b.masked(b.qtok[q], c); }, bad);
}

// ---- step 2, item q < quant: the value group of quantized row q.
KVCAL_HD inline void value_params(const Block& b, std::int32_t q, bool* bad) {
  const std::int32_t t = b.qtok[q];
  const half_bits* row = b.rows.v(t);
  b.v_params()[q] = group_params(
      b.g.head_dim, b.g.bits, [&](std::int32_t c) { return row[c]; }, [&](std::int32_t c) { return b.masked(t, c); },
      bad);
}

// ---- step 3, item i < quant * row_bytes: one byte of a key code row and of
// the value code row (code c occupies bits [c b, (c + 1) b) of the row).
KVCAL_HD inline void code_byte(const Block& b, std::int32_t i) {
  const std::int32_t rb = b.g.row_bytes(), q = i / rb, j = i % rb, bits = b.g.bits, d = b.g.head_dim;
  const std::int32_t t = b.qtok[q];
  const half_bits* kr = b.rows.k(t);
  const half_bits* vr = b.rows.v(t);
  const QuantParams vp = b.v_params()[q];
  const QuantParams* kp = b.k_params();
  unsigned kbyte = 0, vbyte = 0;
  const std::int32_t first = (8 * j) / bits, last = (8 * j + 7) / bits;
  for (std::int32_t c = first; c <= last && c < d; ++c) {
    unsigned kc = 0, vc = 0;
    if (!b.masked(t, c)) {  // expander entries keep code 0
      kc = quantize_value(half_to_float(kr[c]), kp[c], bits);
      vc = quantize_value(half_to_float(vr[c]), vp, bits);
    }
    const std::int32_t shift = c * bits - 8 * j;  // may be negative for the code straddling in from the left
    if (shift >= 0) {
      kbyte |= kc << shift;
      vbyte |= vc << shift;
    } else {
      kbyte |= kc >> -shift;
      vbyte |= vc >> -shift;
    }
  }
  b.page[b.g.off_k_codes() + i] = static_cast<std::uint8_t>(kbyte & 0xffu);
  b.page[b.g.off_v_codes() + i] = static_cast<std::uint8_t>(vbyte & 0xffu);
}

#if !defined(__CUDACC__)
// Host only: the steps in order, each over all its items (the device runs
// the items of a step in parallel, with a barrier between steps). Zeroes the
// page first. Returns false on a non-finite value.
inline bool compress_serial(Block& b, const std::uint8_t* keep) {
  std::memset(b.page, 0, static_cast<std::size_t>(b.g.page_bytes()));
  list_rows(b, keep);
  const std::int32_t d = b.g.head_dim;
  for (std::int32_t i = 0; i < b.kept * d; ++i) copy_kept(b, i);
  if (b.g.bits == 0 || b.quant == 0) return true;
  for (std::int32_t i = 0; i < b.quant * b.g.mask_degree; ++i) copy_entry(b, i);
  bool bad = false;
  for (std::int32_t c = 0; c < d; ++c) key_params(b, c, &bad);
  for (std::int32_t q = 0; q < b.quant; ++q) value_params(b, q, &bad);
  for (std::int32_t i = 0; i < b.quant * b.g.row_bytes(); ++i) code_byte(b, i);
  return !bad;
}

#endif

}  // namespace kvcal::runtime::codec
