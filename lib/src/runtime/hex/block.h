// The HEX block contract's internal pieces that the layer cache (cache.cpp)
// shares with the block code (block.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcal/runtime/hex.h"
#include "runtime/hex/kernels_cpu.h"

namespace kvcal::runtime::detail {

// A mask built by the caller is checked like one read from a file: equal row
// degrees (row i starts at i * d1), columns in range and strictly ascending.
void check_mask(const Mask& m);

// Whether no binary16 value of x[0..n) is infinite or NaN.
bool finite_halves(const half_bits* x, std::int64_t n);

// Row-wise softmax of `rows` rows of n scores (row j at s + j * stride), in place.
void softmax_rows(float* s, std::int64_t rows, std::int64_t n, std::int64_t stride);

// The expander entries of the blocks of one head share one mask: entry e of
// block token t sits in channel c(t, e) = mask_indices[t * d1 + e] in every
// block. A decode over many blocks keeps what depends only on the mask and
// the queries here, instead of gathering and scattering per block.
//
// Key side: qk[j][e][t] = scale * q_j[c(t, e)] (at (j * d1 + e) * rows + t,
// entry-major as the entry kernels read it), filled for the first `rows`
// mask rows of the current mask and queries.
struct KeyEntries {
  const std::int32_t* mask = nullptr;
  const float* q = nullptr;
  std::int64_t rows = 0, d1 = 0, nq = 0, stride = 0;
  std::vector<float> qk;
  std::vector<std::int32_t> idx;     // idx[e * rows + t] = c(t, e): the mask entry-major
  std::vector<std::uint16_t> idx16;  // the same per vector of 16 tokens (entry_channels16)
  // Makes qk and idx valid for `tokens` rows of `mask` (refills on any
  // change), for queries of dim floats.
  const float* prepare(const std::int32_t* m, std::int64_t d1, std::int64_t tokens, const float* q, std::int64_t nq,
                       std::int64_t q_stride, std::int64_t dim, float scale);
  // Forgets the mask and queries, keeping the buffers: the next prepare
  // refills (an object kept across decodes, whose queries may change in
  // place, is reset before each).
  void reset() { mask = nullptr, q = nullptr, rows = 0; }
};
// Value side: sums[j][e][t] (at (j * d1 + e) * rows + t) adds
// p_jt (x_te - min_t) over blocks; flush
// adds them into out_j[c(t, e)] (out_j at out + j * out_stride) and clears
// them. The owner flushes before the mask, queries or output change and at
// the end of a decode.
//
// Code side: the blocks' code sums stay in the slot order of their kernels
// (code.acc[j][code.order.slot(c)] for channel c) beside their bias sums
// code.base[j], and the flush adds them into out_j in channel order: one
// permutation per decode instead of one per block.
struct ValueEntries {
  const std::int32_t* mask = nullptr;
  float* out = nullptr;
  std::int64_t rows = 0, d1 = 0, nq = 0, out_stride = 0;
  std::vector<float> sums;
  struct CodeSums {
    Slots order{0, 0};
    float* out = nullptr;
    std::int64_t nq = 0, out_stride = 0;
    std::vector<float> acc, base;
  } code;
  // The sums for `tokens` rows of `mask` into out (flushing first on a change).
  float* prepare(const std::int32_t* m, std::int64_t d1, std::int64_t tokens, std::int64_t nq, float* out,
                 std::int64_t out_stride);
  // code.acc ([nq][sl.dim]) and code.base ([nq]) for slot order sl and out
  // (flushing first on a change).
  void prepare_code(const Slots& sl, std::int64_t nq, float* out, std::int64_t out_stride);
  // Multiplies query j's pending sums (expander and code sums, bias sum) by
  // f: a running softmax whose maximum grew rescales what it has summed.
  void scale(std::int64_t j, float f);
  void flush();
  // Drops what is pending without adding it anywhere and forgets the mask
  // and outputs, keeping the buffers (an object kept across decodes is reset
  // before each: a decode that threw leaves nothing behind).
  void reset() { mask = nullptr, out = nullptr, rows = 0, code.out = nullptr; }
};

// The block decode with the entry state of a multi-block decode (see
// hex_block_scores and hex_block_accumulate, which use fresh ones). kept =
// false leaves out the kept tokens (of a block with codes): their scores
// untouched, their values not added; the caller takes them with the other
// blocks' through kept_scores and kept_accumulate.
void block_scores(const HexBlockView& b, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                  float* scores, std::int64_t s_stride, HexDot dot, KeyEntries& ke, bool kept = true);
void block_accumulate(const HexBlockView& b, const float* p, std::int64_t nq, std::int64_t p_stride, float* out,
                      std::int64_t out_stride, HexDot dot, ValueEntries& ve, bool kept = true);
// The kept tokens of the consecutive blocks blocks[0 .. n) (a block's tokens
// follow the previous block's in scores and p), blocks without codes left
// out: their scores written, their values added into out, with the fp16
// kernels once per run of kept rows that lie back to back in memory.
void kept_scores(const HexBlockView* blocks, std::size_t n, const float* q, std::int64_t nq, std::int64_t q_stride,
                 float scale, float* scores, std::int64_t s_stride);
void kept_accumulate(const HexBlockView* blocks, std::size_t n, const float* p, std::int64_t nq, std::int64_t p_stride,
                     float* out, std::int64_t out_stride);

// hex_compress_block without its argument checks: HexLayerCache has already
// checked the mask (constructor) and the keys and values (append).
HexBlock compress_checked_block(const half_bits* k, const half_bits* v, std::int64_t tokens, std::int64_t dim,
                                std::int64_t stride, const std::uint8_t* keep_rows, std::shared_ptr<const Mask> mask,
                                int bits);

// The block's key codes as rows: b.k_codes, or (k_tiled) their rows
// rebuilt in buf.
const std::uint8_t* key_rows(const HexBlockView& b, std::vector<std::uint8_t>& buf);
// Rearranges b's key codes into key tiles (kernels_cpu.h) where they serve
// the integer score kernels (key_tiles_layout) and b has quantized rows.
void tile_keys(HexBlock& b);
// The same for the value codes: value_rows(b, buf) is b.v_codes, or
// (v_tiled) their rows rebuilt in buf; tile_values rearranges b's value
// codes into value tiles (kernels_cpu.h) where they serve the integer value
// kernels (value_tiles_layout, with the dot's limbs) and b has quantized
// rows.
const std::uint8_t* value_rows(const HexBlockView& b, std::vector<std::uint8_t>& buf);
void tile_values(HexBlock& b, int limbs);
// The int8 limbs per weight of an integer dot product.
inline int dot_limbs(HexDot dot) { return dot == HexDot::int8 ? 1 : 2; }

}  // namespace kvcal::runtime::detail
