// Inputs shared by the HEX tests: random binary16 rows and queries, and
// random masks with the CSR contract of kvcal::runtime::Mask.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "kvcal/runtime/common.h"
#include "kvcal/runtime/mask_cache.h"

namespace kvcal::runtime {

inline std::vector<half_bits> random_halves(std::size_t n, std::mt19937_64& rng, double sd, double mean = 0) {
  std::normal_distribution<double> nd(mean, sd);
  std::vector<half_bits> x(n);
  for (auto& h : x) h = float_to_half(static_cast<float>(nd(rng)));
  return x;
}

inline std::vector<float> random_floats(std::size_t n, std::mt19937_64& rng, double sd = 1) {
  std::normal_distribution<double> nd(0, sd);
  std::vector<float> x(n);
  for (auto& f : x) f = static_cast<float>(nd(rng));
  return x;
}

// A mask with d1 distinct random channels per row, ascending, indptr[i] = i*d1.
inline std::shared_ptr<const Mask> make_mask(std::int64_t rows, std::int64_t cols, std::int64_t d1,
                                             std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto m = std::make_shared<Mask>();
  m->rows = rows;
  m->cols = cols;
  m->row_degree = d1;
  for (std::int64_t r = 0; r <= rows; ++r) m->indptr.push_back(r * d1);
  std::vector<std::int32_t> all(static_cast<std::size_t>(cols));
  std::iota(all.begin(), all.end(), 0);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<std::int32_t> row(all.begin(), all.begin() + d1);
    std::sort(row.begin(), row.end());
    m->indices.insert(m->indices.end(), row.begin(), row.end());
  }
  return m;
}

}  // namespace kvcal::runtime
