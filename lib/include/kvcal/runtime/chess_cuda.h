// CHESS page selection on the GPU (libkvcal_runtime_cuda; CHESS §3,
// Algorithm 1), with kvcal/runtime/chess.h's ChessIndex as the reference.
//
// One store per batch: for each request its page, chunk and grid vectors (the
// means of its keys flattened over layers and KV heads, D floats each) and the
// running double sums behind them, updated in place as tokens arrive; no key
// or value is copied. Per step:
//   chess_append(batch, keys of one layer, ...)  once per layer (its slice of D)
//   chess_select(batch, tokens, table)           once per step, after the last layer
// chess_select computes each request's anchor (the mean of its last
// recent_pages page vectors), scores every grid, chunk and page (one product
// per row), applies the hierarchical rule exactly as ChessIndex::select does
// (per level the (1 - rho) quantile with linear interpolation over the scores
// with inactive parents zeroed; kept when >= it with an active parent), adds
// the sink and recent pages, and writes the paged-attention layout (indptr,
// indices, last_page_len, the partial page last) on the device, as
// select_batch does on the host. The arithmetic of the summaries is the CPU's
// (double sums, float vectors); scores are float dot products summed in
// another order than the CPU's, so page sets are identical whenever scores
// are exact (integer-valued keys) and may differ only where two scores tie
// within float rounding.
//
// A request's selection depends only on its complete pages (the anchor is
// the mean of complete pages; every summary row changes only when a page
// completes), so chess_select keeps each request's last selection on the
// device and recomputes it only when its page count changed or chess_append
// completed one of its pages since; otherwise it reuses it (adding or
// dropping the partial page). In a decode loop that is one step in
// page_size per request; the steps between cost a few launches that return
// at once. chess_invalidate forgets every kept selection (after writing the
// store by other means than chess_append).
//
// The re-selection trigger (ReselectionTrigger) stays on the host: a few
// scalars per generated page decide when to call chess_select again.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcal/runtime/chess.h"
#include "kvcal/runtime/common.h"

struct CUstream_st;

namespace kvcal::runtime::cuda {

using Stream = CUstream_st*;

// The device store of a batch (carve it with chess_batch()).
struct ChessDeviceBatch {
  std::int32_t requests = 0, dim = 0, max_pages = 0, max_chunks = 0, max_grids = 0;
  std::int32_t page_size = 0, chunk_pages = 0, grid_chunks = 0, sink_pages = 0, recent_pages = 0;
  double rho_grid = 0, rho_chunk = 0, rho_page = 0;
  float *pages = nullptr, *chunks = nullptr, *grids = nullptr;            // [requests][max_*][dim]
  double *page_sum = nullptr, *chunk_acc = nullptr, *grid_acc = nullptr;  // [requests][dim]
  float* anchor = nullptr;                                                // [requests][dim]
  float* scores = nullptr;               // [requests][max_grids + max_chunks + max_pages]
  std::int32_t* selected = nullptr;      // [requests][max_pages + 1]
  std::int32_t* selected_len = nullptr;  // [requests]
  std::uint8_t* masks = nullptr;         // [requests][max_grids + max_chunks + max_pages] scratch
  // [requests][3]: whether the kept selection is valid (0 after chess_batch's
  // zeroed memory, chess_append completing a page, chess_invalidate), the
  // page count it was made for, and how many complete pages it holds.
  std::int32_t* kept = nullptr;
};

// The largest page count a request may reach for one selection (with pages
// of 32 tokens, 256K tokens).
constexpr std::int32_t kChessMaxPages = 8192;

// Bytes of device memory for `requests` requests of up to max_pages complete
// pages each, D = dim. Throws Error for bad options (check_options), dim < 1
// or max_pages outside [1, kChessMaxPages].
KVCAL_RUNTIME_API std::size_t chess_batch_bytes(std::int32_t requests, std::int32_t dim, std::int32_t max_pages,
                                                const ChessOptions& options);
// Lays the store out in `memory` (device, zeroed by the caller: every request
// starts empty).
KVCAL_RUNTIME_API ChessDeviceBatch chess_batch(void* memory, std::size_t bytes, std::int32_t requests, std::int32_t dim,
                                               std::int32_t max_pages, const ChessOptions& options);

// Adds new tokens' keys of one layer: request r's tokens are rows
// [token_indptr[r], token_indptr[r + 1]) of keys (binary16, key_stride halves
// apart), each `width` values going to dimensions [dim_offset, dim_offset +
// width) of the request's vectors; tokens_before[r] is the request's token
// count before this step (device arrays). Call once per layer with the same
// token_indptr and tokens_before; pages complete as in ChessIndex::append.
KVCAL_RUNTIME_API void chess_append(const ChessDeviceBatch& batch, const half_bits* keys, std::int64_t key_stride,
                                    std::int32_t dim_offset, std::int32_t width, const std::int32_t* token_indptr,
                                    const std::int32_t* tokens_before, Stream stream);

// The selection of every request with tokens[r] tokens (device array): the
// page table of select_batch in device memory: indptr [requests + 1],
// indices [requests * (max_pages + 1)] (room for the longest), last_page_len
// [requests].
struct ChessPageTable {
  std::int32_t* indptr = nullptr;
  std::int32_t* indices = nullptr;
  std::int32_t* last_page_len = nullptr;
};
KVCAL_RUNTIME_API void chess_select(const ChessDeviceBatch& batch, const std::int32_t* tokens,
                                    const ChessPageTable& table, Stream stream);
// Forgets every request's kept selection: the next chess_select recomputes
// them all. Needed only after the store was written other than through
// chess_append (a request's slot cleared for a new sequence, say).
KVCAL_RUNTIME_API void chess_invalidate(const ChessDeviceBatch& batch, Stream stream);

}  // namespace kvcal::runtime::cuda
