#include "kvcal/graph/csr.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>
#include <boost/graph/compressed_sparse_row_graph.hpp>
#include <boost/graph/connected_components.hpp>

namespace kvcal {
namespace {

std::int64_t count_components(const CsrMask& mask) {
  // Vertices 0..rows-1 are tokens, rows..rows+cols-1 channels. Each edge is
  // added in both directions so the directed CSR graph is symmetric.
  using Graph = boost::compressed_sparse_row_graph<boost::directedS, boost::no_property, boost::no_property,
                                                   boost::no_property, std::uint32_t, std::uint64_t>;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> edges;
  edges.reserve(2 * mask.indices.size());
  for (std::int64_t r = 0; r < mask.rows; ++r) {
    for (auto k = mask.indptr[r]; k < mask.indptr[r + 1]; ++k) {
      const auto u = static_cast<std::uint32_t>(r);
      const auto v = static_cast<std::uint32_t>(mask.rows + mask.indices[k]);
      edges.emplace_back(u, v);
      edges.emplace_back(v, u);
    }
  }
  const auto nv = static_cast<std::uint32_t>(mask.rows + mask.cols);
  Graph g(boost::edges_are_unsorted_multi_pass, edges.begin(), edges.end(), nv);
  std::vector<std::uint32_t> component(nv);
  return static_cast<std::int64_t>(boost::connected_components(g, component.data()));
}

}  // namespace

StructureReport check_structure(const CsrMask& mask, bool count_components_too) {
  StructureReport rep;
  auto& p = rep.problems;
  if (mask.rows <= 0 || mask.cols <= 0) {
    p.push_back(fmt::format("shape {}x{} is not positive", mask.rows, mask.cols));
    return rep;
  }
  if (static_cast<std::int64_t>(mask.indptr.size()) != mask.rows + 1) {
    p.push_back(fmt::format("indptr has {} entries, expected rows + 1 = {}", mask.indptr.size(), mask.rows + 1));
    return rep;
  }
  if (mask.indptr.front() != 0) p.push_back(fmt::format("indptr[0] = {}, expected 0", mask.indptr.front()));
  if (mask.indptr.back() != mask.nnz()) {
    p.push_back(fmt::format("indptr ends at {}, expected nnz = {}", mask.indptr.back(), mask.nnz()));
  }
  for (std::int64_t r = 0; r < mask.rows; ++r) {
    if (mask.indptr[r + 1] < mask.indptr[r]) {
      p.push_back(fmt::format("indptr decreases at row {} ({} -> {})", r, mask.indptr[r], mask.indptr[r + 1]));
      break;
    }
  }
  if (!p.empty()) return rep;

  std::vector<std::int64_t> col_degree(static_cast<std::size_t>(mask.cols), 0);
  rep.row_degree_min = mask.cols + 1;
  std::int64_t out_of_range = 0, unsorted = 0, repeated = 0;
  std::int64_t first_bad_row = -1;
  for (std::int64_t r = 0; r < mask.rows; ++r) {
    const auto begin = mask.indptr[r], end = mask.indptr[r + 1];
    rep.row_degree_min = std::min(rep.row_degree_min, end - begin);
    rep.row_degree_max = std::max(rep.row_degree_max, end - begin);
    for (auto k = begin; k < end; ++k) {
      const auto c = mask.indices[k];
      bool bad = false;
      if (c < 0 || c >= mask.cols) {
        ++out_of_range;
        bad = true;
      } else {
        ++col_degree[c];
      }
      if (k > begin && c < mask.indices[k - 1]) ++unsorted, bad = true;
      if (k > begin && c == mask.indices[k - 1]) ++repeated, bad = true;
      if (bad && first_bad_row < 0) first_bad_row = r;
    }
  }
  if (out_of_range)
    p.push_back(fmt::format("{} column indices out of range [0, {}) (first in row {})", out_of_range, mask.cols,
                            first_bad_row));
  if (unsorted)
    p.push_back(
        fmt::format("{} column indices not ascending within their row (first in row {})", unsorted, first_bad_row));
  if (repeated)
    p.push_back(
        fmt::format("{} repeated edges (same column twice in a row; first in row {})", repeated, first_bad_row));
  const auto [cmin, cmax] = std::minmax_element(col_degree.begin(), col_degree.end());
  rep.col_degree_min = *cmin;
  rep.col_degree_max = *cmax;
  const bool rows_equal = rep.row_degree_min == rep.row_degree_max;
  rep.biregular = rows_equal && rep.col_degree_min == rep.col_degree_max;
  rep.near_biregular = rows_equal && rep.col_degree_max - rep.col_degree_min <= 1;
  if (p.empty() && count_components_too) rep.components = count_components(mask);
  return rep;
}

CsrMask transpose(const CsrMask& mask) {
  CsrMask t;
  t.rows = mask.cols;
  t.cols = mask.rows;
  t.indptr.assign(static_cast<std::size_t>(t.rows + 1), 0);
  for (auto c : mask.indices) ++t.indptr[c + 1];
  for (std::int64_t i = 0; i < t.rows; ++i) t.indptr[i + 1] += t.indptr[i];
  t.indices.resize(mask.indices.size());
  std::vector<std::int64_t> next(t.indptr.begin(), t.indptr.end() - 1);
  // Rows are visited in ascending order, so each transposed row comes out sorted.
  for (std::int64_t r = 0; r < mask.rows; ++r) {
    for (auto k = mask.indptr[r]; k < mask.indptr[r + 1]; ++k) {
      t.indices[next[mask.indices[k]]++] = static_cast<std::int32_t>(r);
    }
  }
  return t;
}

}  // namespace kvcal
