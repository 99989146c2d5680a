// The HEX expander mask as a CSR matrix.
//
// A mask is the biadjacency matrix B (rows = tokens, cols = channels) of a
// bipartite graph, stored in compressed sparse row form: row i keeps the
// channels indices[indptr[i] .. indptr[i+1]) in strictly ascending order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvcal {

struct CsrMask {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::vector<std::int64_t> indptr;   // [rows + 1], indptr[0] = 0, ends at nnz
  std::vector<std::int32_t> indices;  // [nnz], ascending within each row

  std::int64_t nnz() const { return static_cast<std::int64_t>(indices.size()); }
  bool operator==(const CsrMask& other) const = default;
};

// What check_structure found. Never throws: a malformed mask is described,
// not rejected, so callers can list every problem at once.
struct StructureReport {
  std::vector<std::string> problems;  // empty when the CSR is well formed
  std::int64_t row_degree_min = 0, row_degree_max = 0;
  std::int64_t col_degree_min = 0, col_degree_max = 0;
  bool biregular = false;       // every row degree equal, every column degree equal
  bool near_biregular = false;  // row degrees equal, column degrees differ by at most one
  std::int64_t components = 0;  // connected components of the bipartite graph (rows + cols)

  bool ok() const { return problems.empty(); }
};

// Checks the CSR invariants (sizes, indptr monotone from 0 to nnz, indices in
// range and strictly ascending per row, i.e. no repeated edge), the degree
// statistics and, with count_components, connectivity (Boost.Graph).
StructureReport check_structure(const CsrMask& mask, bool count_components = true);

// The transpose (cols x rows), indices ascending. Requires a well-formed mask.
CsrMask transpose(const CsrMask& mask);

}  // namespace kvcal
