// Expander masks at run time: an immutable CSR mask shared by every block
// and head that uses its shape, and a thread-safe LRU cache of them filled
// from a bundle and, for shapes the bundle lacks, by generating and
// certifying a mask on the fly (HEX §3.2, "Implementation Details").
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcal/runtime/common.h"

namespace kvcal::runtime {

class Bundle;

// A (d1, d2)-biregular (or near-biregular) mask over rows = block tokens and
// cols = head channels. Row i keeps the columns indices[indptr[i] ..
// indptr[i+1]) ascending; every row has exactly row_degree of them, so row i
// also starts at i * row_degree.
struct Mask {
  std::int64_t rows = 0, cols = 0, row_degree = 0;
  std::vector<std::int64_t> indptr;   // [rows + 1]
  std::vector<std::int32_t> indices;  // [rows * row_degree]
  bool ramanujan = false;             // certified (numerically or by the LPS theorem)
  double sigma2 = 0, ramanujan_bound = 0;
  std::string source;  // "bundle:<id>" or "generated:<method> seed <s>"

  std::int64_t nnz() const { return static_cast<std::int64_t>(indices.size()); }
  double sparsity() const { return cols > 0 ? static_cast<double>(row_degree) / static_cast<double>(cols) : 0.0; }
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(indptr.size() * sizeof(std::int64_t) + indices.size() * sizeof(std::int32_t));
  }
};

// The cache key: the shape and the ones per row, d1 = round(sparsity * cols),
// at least 1 (the rule kvcal mask-gen uses).
struct MaskKey {
  std::int64_t rows = 0, cols = 0, row_degree = 0;
  bool operator==(const MaskKey& o) const { return rows == o.rows && cols == o.cols && row_degree == o.row_degree; }
};
KVCAL_RUNTIME_API MaskKey mask_key(std::int64_t rows, std::int64_t cols, double sparsity);

struct MaskCacheOptions {
  std::size_t capacity = 16;             // masks kept in memory (LRU beyond that)
  std::string method = "lift";           // generator on a miss: "lift" or "random" ("lift" falls back to "random"
                                         // for shapes a lift cannot hold)
  std::uint64_t seed = 0x6b7663616cULL;  // first seed tried; the next ones follow
  int tries = 16;                        // candidates per miss before giving up on a certificate
  bool require_ramanujan = true;         // false: keep the best candidate when none certifies
  int threads = 1;                       // threads per certification (0: all cores); misses on different keys
                                         // already run in parallel
};

// Every get with a valid key is one hit or one miss; a get that waits for
// another thread's build of its key counts as a miss. generated + from_bundle
// counts the masks built, once per key while it stays cached.
struct MaskCacheStats {
  std::int64_t hits = 0, misses = 0, generated = 0, from_bundle = 0, evictions = 0;
};

class KVCAL_RUNTIME_API MaskCache {
 public:
  explicit MaskCache(MaskCacheOptions options = {});
  ~MaskCache();
  MaskCache(const MaskCache&) = delete;
  MaskCache& operator=(const MaskCache&) = delete;

  // Makes the bundle's masks available: a miss looks there before generating.
  // The bundle must outlive the cache.
  void attach(const Bundle* bundle);

  // The mask for a shape: from memory, else the bundle, else generated and
  // certified. Safe to call from many threads; concurrent misses on one key
  // build the mask once. Throws Error when no mask can be had.
  std::shared_ptr<const Mask> get(std::int64_t rows, std::int64_t cols, double sparsity);
  std::shared_ptr<const Mask> get(const MaskKey& key);

  MaskCacheStats stats() const;
  std::size_t size() const;
  std::size_t capacity() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcal::runtime
