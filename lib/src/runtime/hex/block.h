// The HEX block contract's internal pieces that the layer cache (cache.cpp)
// shares with the block code (block.cpp).
#pragma once

#include <cstdint>
#include <memory>

#include "kvcal/runtime/hex.h"

namespace kvcal::runtime::detail {

// A mask built by the caller is checked like one read from a file: equal row
// degrees (row i starts at i * d1), columns in range and strictly ascending.
void check_mask(const Mask& m);

// Whether no binary16 value of x[0..n) is infinite or NaN.
bool finite_halves(const half_bits* x, std::int64_t n);

// Row-wise softmax of `rows` rows of n scores (row j at s + j * stride), in place.
void softmax_rows(float* s, std::int64_t rows, std::int64_t n, std::int64_t stride);

// Requests a block's key (keys) or value data into the cache ahead of use:
// kept rows, parameters, expander entries and the first rows of the codes
// (each is its own allocation, which the hardware prefetcher does not
// anticipate). No effect on results.
void prefetch_block(const HexBlockView& b, bool keys);

// hex_compress_block without its argument checks: HexLayerCache has already
// checked the mask (constructor) and the keys and values (append).
HexBlock compress_checked_block(const half_bits* k, const half_bits* v, std::int64_t tokens, std::int64_t dim,
                                std::int64_t stride, const std::uint8_t* keep_rows, std::shared_ptr<const Mask> mask,
                                int bits);

}  // namespace kvcal::runtime::detail
