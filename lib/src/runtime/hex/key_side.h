// The key side of a HEX block on the int8 decode path in one pass, the
// dispatched kernel of kernels_cpu.cpp that block_scores calls before the
// integer score kernels (code_scores_int*).
#pragma once

#include <cstdint>

#include "kvcal/runtime/common.h"
#include "runtime/hex/kernels_cpu.h"

namespace kvcal::runtime::detail {

// From the block's key groups as stored (params[2c] = delta_c, params[2c +
// 1] = min_c in binary16, c < sl.dim) and nq queries (q_j at q + j *
// q_stride), what halves_to_floats, key_weights and quantize_rows(1, ...)
// make in turn, with the same floats and bytes:
//   w8[j * dim + s], ws[j]  the int8 code weights in slot order and their
//                           scale (quantize_rows of scale * q_j[c] * delta_c),
//   kmin[c] = min_c,  bias[j] = sum_c scale * q_j[c] * min_c.
// On AVX-512 with dim 64, 128 or 256 the weights stay in registers from the
// products to the bytes; elsewhere the three steps run in one call. Returns
// false, having written nothing, where the shape is not one it takes (sl.per
// 2 or 4, that is 2- to 4-bit rows in int_slots order; dim up to 256 and
// sl.run a multiple of the target's float lanes) or the target has no such
// pass (scalable vectors, the scalar target); the caller then makes the
// three steps itself.
bool key_weights_int8(const half_bits* params, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                      const Slots& sl, std::int8_t* w8, float* ws, float* kmin, float* bias);

}  // namespace kvcal::runtime::detail
