// CHESS page selection (CPU reference): page summaries maintained as pages
// fill, the coarse-to-fine Grid -> Chunk -> Page selection of Algorithm 1,
// attention sinks and the recent window, and the entropy/varentropy trigger
// that decides when to select again.
//
// Page vector: the mean of a page's B keys, flattened over every layer and KV
// head (D = layers * kv_heads * head_dim); chunk and grid vectors are the
// means of their pages' and chunks' vectors (CHESS Eq. 1-2). All of them live
// in one row-major store, appended as pages complete and updated in place, so
// one matrix-vector product scores every grid, chunk and page. Only complete
// pages are candidates; the partial last page always belongs to the recent
// window. No key or value is copied: only the running sum of the page being
// filled and the D-float summaries.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcal/runtime/common.h"

namespace kvcal::runtime {

struct ChessOptions {
  std::int64_t page_size = 32;                             // B
  std::int64_t chunk_pages = 4;                            // N_c pages per chunk
  std::int64_t grid_chunks = 4;                            // N_g chunks per grid
  double rho_grid = 0.8, rho_chunk = 0.7, rho_page = 0.7;  // retention ratios ("moderate")
  std::int64_t sink_pages = 1;                             // first pages always kept (attention sinks)
  std::int64_t recent_pages = 2;                           // last complete pages always kept, and the anchor's window W
};

// The paper's settings: "conservative" (0.9, 0.9, 0.9), "moderate" (0.8, 0.7,
// 0.7), "aggressive" (0.5, 0.2, 0.1). Throws Error for other names.
KVCAL_RUNTIME_API ChessOptions chess_preset(const char* name, const ChessOptions& base = {});
KVCAL_RUNTIME_API void check_options(const ChessOptions& options);

// The q-quantile (q in [0, 1]) of n values with linear interpolation between
// order statistics (numpy's and torch's default), as Algorithm 1 uses.
KVCAL_RUNTIME_API float quantile(const float* values, std::int64_t n, double q);

// Algorithm 1, given the scores: masks of the selected grids, chunks and
// pages (1 = selected). chunk_grid[c] and page_chunk[p] are the parents.
// Literal to the paper: scores of inactive parents are zeroed (not removed)
// before each level's quantile, and a unit is kept when its score is >= the
// quantile and its parent is active.
KVCAL_RUNTIME_API void hierarchical_select(const float* grid_scores, std::int64_t grids, const float* chunk_scores,
                                           const std::int32_t* chunk_grid, std::int64_t chunks,
                                           const float* page_scores, const std::int32_t* page_chunk, std::int64_t pages,
                                           double rho_grid, double rho_chunk, double rho_page, std::uint8_t* grid_mask,
                                           std::uint8_t* chunk_mask, std::uint8_t* page_mask);

// Page summaries of one request, and its selection.
class KVCAL_RUNTIME_API ChessIndex {
 public:
  ChessIndex(std::int64_t dim, const ChessOptions& options);
  ~ChessIndex();
  ChessIndex(ChessIndex&&) noexcept;
  ChessIndex& operator=(ChessIndex&&) noexcept;

  // Adds n tokens' flattened keys (token i at keys + i * stride, dim floats,
  // layer-major then KV head then channel). Throws Error on non-finite keys.
  void append(const float* keys, std::int64_t n, std::int64_t stride);
  // The same from binary16 keys.
  void append(const half_bits* keys, std::int64_t n, std::int64_t stride);

  std::int64_t dim() const;
  std::int64_t tokens() const;
  std::int64_t pages() const;  // complete pages
  std::int64_t chunks() const;
  std::int64_t grids() const;
  const ChessOptions& options() const;

  // The summaries: rows of the store, and where each unit's row is.
  const float* store() const;  // [rows][dim]
  std::int64_t rows() const;
  std::int64_t page_row(std::int64_t page) const;
  std::int64_t chunk_row(std::int64_t chunk) const;
  std::int64_t grid_row(std::int64_t grid) const;

  // The anchor: the mean of the last recent_pages complete pages' vectors
  // (the partial page's mean when no page is complete yet).
  std::vector<float> anchor() const;

  // Runs Algorithm 1 against anchor(), adds the sink and recent pages, and
  // returns the selected complete pages, ascending. The partial last page (if
  // any) is not listed: it is always attended (tokens pages()*B .. tokens()).
  std::vector<std::int32_t> select() const;
  // The same with a given anchor (dim floats).
  std::vector<std::int32_t> select(const float* anchor) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Selections of a batch in the paged-attention layout: request r attends the
// pages indices[indptr[r] .. indptr[r+1]) (its partial last page included as
// the last entry when it has one), with last_page_len[r] valid tokens in its
// last listed page.
struct PageTable {
  std::vector<std::int32_t> indptr{0};
  std::vector<std::int32_t> indices;
  std::vector<std::int32_t> last_page_len;
};
KVCAL_RUNTIME_API PageTable select_batch(const std::vector<const ChessIndex*>& requests);

// When to select again: per page of generated tokens, the page's mean token
// entropy and its varentropy (mean token varentropy, or the variance of token
// entropy within the page) against the calibrated thresholds, strictly above
// both (rule_both) or either.
struct EntropyRule {
  double entropy_threshold = 0, varentropy_threshold = 0;
  bool rule_both = true;
  bool varentropy_temporal = false;
  std::int64_t page_size = 32;
  bool unit_bits = false;  // thresholds in bits: token statistics given in nats are converted
};

class KVCAL_RUNTIME_API ReselectionTrigger {
 public:
  explicit ReselectionTrigger(const EntropyRule& rule);
  // One generated token's entropy and varentropy (nats). Returns true when
  // this token completes a page whose statistics cross the thresholds.
  bool push(double entropy, double varentropy);
  std::int64_t pages() const;      // complete pages seen
  std::int64_t triggered() const;  // of which triggered
  const EntropyRule& rule() const;

 private:
  EntropyRule rule_;
  std::vector<double> entropy_, varentropy_;
  std::int64_t pages_ = 0, triggered_ = 0;
};

}  // namespace kvcal::runtime
