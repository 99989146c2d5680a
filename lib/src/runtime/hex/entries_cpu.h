// The per-token kernels around a block's code kernels (entries_cpu.cpp):
// the expander entries and the value weights, dispatched at run time to the
// host's best SIMD target like the code kernels (kernels_cpu.h). They take
// runs of any length (the quantized tokens between a block's kept tokens).
// Raw pointers and sizes only; nothing allocates, nothing throws.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcal/runtime/common.h"

namespace kvcal::runtime::detail {

// The expander entries of n tokens, g per token: the kernels below take
// them token-major from a block (entry e of token i at x[i * g + e], the
// block's stored halves) and keep them entry-major (at out[e * out_stride +
// i]), so that the per-query kernels read whole vectors of tokens.
// Key side: out[e * out_stride + i] = x[i * g + e] - b[idx[i * g + e]], b a
// table of b_size floats (the key channels' mins; 0 <= idx < b_size).
void key_entry_diffs(const float* b, std::int64_t b_size, const std::int32_t* idx, const half_bits* x, std::int64_t n,
                     std::int64_t g, float* out, std::int64_t out_stride);
// Value side: out[e * out_stride + i] = x[i * g + e] - params[2 i + 1] (the
// token's min in its (delta, min) pair).
void value_entry_diffs(const float* params, const half_bits* x, std::int64_t n, std::int64_t g, float* out,
                       std::int64_t out_stride);
// The entries' part of n tokens' scores, entry-major inputs, added to them:
//   out[i] += sum_{e < g} a[e * a_stride + i] * x[e * x_stride + i]
// (out apart from the inputs; the products added to out[i] in entry order).
void entry_scores(const float* a, std::int64_t a_stride, const float* x, std::int64_t x_stride, std::int64_t n,
                  std::int64_t g, float* out);
// y[e * y_stride + i] += p[i] * x[e * x_stride + i] for i < n and e < g.
void group_axpy(const float* p, std::int64_t n, std::int64_t g, const float* x, std::int64_t x_stride, float* y,
                std::int64_t y_stride);

// The key side's entry weights of nq queries (q_j = q + j * q_stride, dim
// floats; 0 <= idx < dim): out[j * n + k] = scale * q_j[idx[k]] for k < n.
void entry_query_weights(const float* q, std::int64_t nq, std::int64_t q_stride, std::int64_t dim, float scale,
                         const std::int32_t* idx, std::int64_t n, float* out);

// The value side of n quantized rows, params[2i] = delta_i and params[2i + 1]
// = min_i: a[i] = p[i] * delta_i; returns sum_i p[i] * min_i.
float value_weights(const float* params, const float* p, std::int64_t n, float* a);

// The most entries per token the fused kernels below take in vectors (more
// take their scalar loops: callers keep the separate kernels for them).
constexpr std::int64_t kFusedEntries = 4;
// The same per-token work fused for the quantized tokens of a block of
// `tokens` tokens, nq queries, the differences made once per vector of
// tokens and never stored. Token t of the block is quantized row r, its
// place among the quantized ones: kept (kept_rows positions, ascending, as
// HexBlockView::kept_index; null where there are none) are skipped, and
// their outputs left untouched. Inputs and outputs per token are at t,
// those per quantized row at r.
// Key side: out[j * out_stride + t] = bias[j] + code_j(r)
//   + sum_{e < g} a[(j * g + e) * a_stride + t] * (x[r * g + e] - b[idx[e * idx_stride + t]]),
// code_j(r) = w[j] * qi[j * code_stride + r] where qi is not null, else
// qf[j * code_stride + r]; the products added in entry order. The mask
// indices entry-major (as KeyEntries keeps them, once for all blocks).
// idx16, if not null, holds the same indices as entry_channels16 lays them
// out, and b then binary16 values (a block's key mins):
// on AVX-512 the mins are then looked up as halves, 32 at a time.
void key_run_scores(const float* b, std::int64_t b_size, const std::int32_t* idx, std::int64_t idx_stride,
                    const std::uint16_t* idx16, const half_bits* x, const std::uint16_t* kept, std::int64_t kept_rows,
                    std::int64_t tokens, std::int64_t g, std::int64_t nq, const float* bias, const float* w,
                    const std::int32_t* qi, const float* qf, std::int64_t code_stride, const float* a,
                    std::int64_t a_stride, float* out, std::int64_t out_stride);
// The same arguments as one job, in the order above (the form the
// per-target kernels take them in).
struct KeyRunJob {
  const float* b;
  std::int64_t b_size;
  const std::int32_t* idx;
  std::int64_t is;
  const std::uint16_t* idx16;
  const half_bits* x;
  const std::uint16_t* kept;
  std::int64_t nk, tokens, g, nq;
  const float* bias;
  const float* w;
  const std::int32_t* qi;
  const float* qf;
  std::int64_t cs;
  const float* a;
  std::int64_t as;
  float* out;
  std::int64_t os;
};
// The mask indices idx (entry-major, idx_stride apart; below 65536) per
// vector of 16 tokens: out[(v * g + e) * 16 + k] = idx[e * idx_stride + 16 v
// + k] for tokens 16 v + k < tokens, 0 past them.
void entry_channels16(const std::int32_t* idx, std::int64_t idx_stride, std::int64_t tokens, std::int64_t g,
                      std::vector<std::uint16_t>& out);
// The most queries value_run_weights takes in vectors (more take its scalar
// loop: callers keep the separate kernels for them).
constexpr std::int64_t kRunQueries = 16;
// Value side, p_j = p + j * p_stride, params[2r] = delta_r, params[2r + 1] = min_r:
//   a[j * a_stride + r] = p_j[t] * delta_r,  base[j] += sum_r p_j[t] * min_r,
//   y[(j * g + e) * y_stride + t] += p_j[t] * (x[r * g + e] - min_r),
//   amax[j] = max_r |a[j * a_stride + r]|   (for quantize_rows; 0 if none).
void value_run_weights(const float* params, const half_bits* x, const std::uint16_t* kept, std::int64_t kept_rows,
                       std::int64_t tokens, std::int64_t g, std::int64_t nq, const float* p, std::int64_t p_stride,
                       float* a, std::int64_t a_stride, float* y, std::int64_t y_stride, float* base, float* amax);

}  // namespace kvcal::runtime::detail
