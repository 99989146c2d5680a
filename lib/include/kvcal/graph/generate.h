// Random (d1, d2)-biregular bipartite masks (HEX §3.2, Appendix A.2).
//
// A mask of `rows` tokens x `cols` channels with row degree d1 has
// rows * d1 = cols * d2 edges. When rows * d1 is not a multiple of cols, the
// column degrees are spread as evenly as possible (they differ by at most one):
// the mask is near-biregular and its certificate uses the maximum degrees.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvcal/graph/csr.h"

namespace kvcal {

enum class MaskMethod { random, lift };

const char* to_string(MaskMethod method);
MaskMethod parse_mask_method(const std::string& name);  // throws kvcal::Error

struct MaskShape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t row_degree = 0;      // d1: ones per row
  std::int64_t col_degree_max = 0;  // d2 = ceil(rows * d1 / cols)
  std::int64_t col_degree_min = 0;  // floor(rows * d1 / cols)
  bool biregular() const { return col_degree_min == col_degree_max; }
  double sparsity() const { return static_cast<double>(row_degree) / static_cast<double>(cols); }
};

// Resolves a shape from exactly one of row_degree or sparsity (rho = d1 / cols;
// rounded to the nearest degree >= 1). Throws kvcal::Error for sizes <= 0,
// rho outside (0, 1], a degree outside [1, cols], or sizes beyond int32 indices.
MaskShape resolve_shape(std::int64_t rows, std::int64_t cols, std::optional<std::int64_t> row_degree,
                        std::optional<double> sparsity);

// Why `lift` cannot build this shape (empty when it can). A lift of K(d2, d1)
// needs cols = d1 * r and rows = d2 * r for one fibre size r.
std::string lift_shape_problem(const MaskShape& shape);

// A random simple (near-)biregular mask: configuration model, then repeated
// edges removed by degree-preserving switches (no rejection loop). Dense shapes
// (d1 > cols / 2) are built as the complement of a sparse one. Deterministic in
// the seed on every platform.
CsrMask generate_random(const MaskShape& shape, std::uint64_t seed);

// A random r-lift of the complete bipartite graph K(d2, d1): row fibre a
// (rows a*r .. a*r+r-1) and column fibre b (channels b*r .. b*r+r-1) are joined
// by a random r x r permutation. Simple by construction; each row keeps exactly
// one channel in each group of r consecutive channels. Throws kvcal::Error when
// lift_shape_problem(shape) is not empty.
CsrMask generate_lift(const MaskShape& shape, std::uint64_t seed);

CsrMask generate(MaskMethod method, const MaskShape& shape, std::uint64_t seed);

}  // namespace kvcal
