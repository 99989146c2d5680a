#include "kvcal/graph/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvcal/core/error.h"
#include "kvcal/core/random.h"

namespace kvcal {

const char* to_string(MaskMethod method) {
  switch (method) {
    case MaskMethod::random:
      return "random";
    case MaskMethod::lift:
      return "lift";
  }
  return "unknown";
}

MaskMethod parse_mask_method(const std::string& name) {
  if (name == "random") return MaskMethod::random;
  if (name == "lift") return MaskMethod::lift;
  fail("unknown mask method '{}': use 'random' or 'lift'", name);
}

MaskShape resolve_shape(std::int64_t rows, std::int64_t cols, std::optional<std::int64_t> row_degree,
                        std::optional<double> sparsity) {
  constexpr std::int64_t kMaxSide = std::numeric_limits<std::int32_t>::max();
  KVCAL_CHECK(rows > 0 && cols > 0, "mask shape {}x{}: rows and cols must be positive", rows, cols);
  KVCAL_CHECK(rows <= kMaxSide && cols <= kMaxSide, "mask shape {}x{}: each side must be below 2^31", rows, cols);
  KVCAL_CHECK(row_degree.has_value() != sparsity.has_value(), "give exactly one of --sparsity or --row-degree");
  MaskShape s;
  s.rows = rows;
  s.cols = cols;
  if (sparsity) {
    const double rho = *sparsity;
    KVCAL_CHECK(std::isfinite(rho) && rho > 0.0 && rho <= 1.0,
                "sparsity {} is outside (0, 1]: it is the fraction of channels kept per token, e.g. 0.03125", rho);
    s.row_degree = std::max<std::int64_t>(1, std::llround(rho * static_cast<double>(cols)));
  } else {
    s.row_degree = *row_degree;
    KVCAL_CHECK(s.row_degree >= 1 && s.row_degree <= cols,
                "row degree {} is impossible for {} columns: it must lie in [1, {}]", s.row_degree, cols, cols);
  }
  const std::int64_t edges = rows * s.row_degree;
  KVCAL_CHECK(edges <= std::numeric_limits<std::int64_t>::max() / 4 && edges <= (std::int64_t{1} << 40),
              "mask {}x{} with row degree {} has too many edges ({})", rows, cols, s.row_degree, edges);
  s.col_degree_min = edges / cols;
  s.col_degree_max = (edges + cols - 1) / cols;
  return s;
}

std::string lift_shape_problem(const MaskShape& s) {
  if (s.cols % s.row_degree != 0) {
    return fmt::format(
        "lift needs cols ({}) divisible by the row degree ({}); use --method random or a degree that divides {}",
        s.cols, s.row_degree, s.cols);
  }
  const std::int64_t r = s.cols / s.row_degree;
  if (s.rows % r != 0) {
    return fmt::format(
        "lift needs rows ({}) divisible by the fibre size r = cols / row degree = {}; use --method random or rows a "
        "multiple of {}",
        s.rows, r, r);
  }
  return {};
}

namespace {

// Rows of a degree-d1 graph stored flat: row i is adj[i*d1 .. i*d1+d1), sorted.
struct FlatRows {
  std::int64_t d1;
  std::vector<std::int32_t> adj;
  std::int32_t* row(std::int64_t i) { return adj.data() + i * d1; }
  bool contains(std::int64_t i, std::int32_t c) { return std::binary_search(row(i), row(i) + d1, c); }
  // Replaces the entry at position pos of row i by value and restores order.
  void replace(std::int64_t i, std::int64_t pos, std::int32_t value) {
    std::int32_t* r = row(i);
    while (pos > 0 && r[pos - 1] > value) r[pos] = r[pos - 1], --pos;
    while (pos + 1 < d1 && r[pos + 1] < value) r[pos] = r[pos + 1], ++pos;
    r[pos] = value;
  }
};

// Column degree of column j when `edges` edges are spread over `cols` columns
// as evenly as possible (the extra ones spaced out, not packed at the start).
std::int64_t spread_degree(std::int64_t edges, std::int64_t cols, std::int64_t j) {
  const auto hi = static_cast<uint128_t>(edges) * (j + 1) / cols;
  const auto lo = static_cast<uint128_t>(edges) * j / cols;
  return static_cast<std::int64_t>(hi - lo);
}

CsrMask from_flat(const MaskShape& s, std::vector<std::int32_t> adj) {
  CsrMask m;
  m.rows = s.rows;
  m.cols = s.cols;
  m.indptr.resize(static_cast<std::size_t>(s.rows + 1));
  for (std::int64_t i = 0; i <= s.rows; ++i) m.indptr[i] = i * s.row_degree;
  m.indices = std::move(adj);
  return m;
}

// Configuration model + degree-preserving switches, for d1 <= cols / 2.
std::vector<std::int32_t> sparse_random(const MaskShape& s, const std::vector<std::int64_t>& col_deg, Rng& rng) {
  const std::int64_t edges = s.rows * s.row_degree;
  FlatRows g{s.row_degree, {}};
  g.adj.reserve(static_cast<std::size_t>(edges));
  for (std::int64_t j = 0; j < s.cols; ++j) g.adj.insert(g.adj.end(), col_deg[j], static_cast<std::int32_t>(j));
  rng.shuffle(g.adj.data(), static_cast<std::uint64_t>(edges));
  for (std::int64_t i = 0; i < s.rows; ++i) std::sort(g.row(i), g.row(i) + s.row_degree);

  // Each accepted switch removes one repeated edge and creates none, so the
  // loop ends; the attempt cap only guards shapes where switches are rare.
  const std::int64_t max_attempts = std::max<std::int64_t>(1'000'000, 2000 * edges);
  std::int64_t attempts = 0;
  for (std::int64_t i = 0; i < s.rows; ++i) {
    for (std::int64_t pos = 1; pos < s.row_degree;) {
      std::int32_t* r = g.row(i);
      if (r[pos] != r[pos - 1]) {
        ++pos;
        continue;
      }
      const std::int32_t c = r[pos];
      for (;;) {
        KVCAL_CHECK(++attempts <= max_attempts,
                    "could not remove repeated edges from a random {}x{} mask with row degree {}; use --method lift",
                    s.rows, s.cols, s.row_degree);
        const auto e = static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(edges)));
        const std::int64_t i2 = e / s.row_degree;
        const std::int32_t c2 = g.adj[e];
        if (i2 == i || c2 == c || g.contains(i, c2) || g.contains(i2, c)) continue;
        // Switch (i, c), (i2, c2) -> (i, c2), (i2, c): all degrees are kept.
        g.replace(i2, e - i2 * s.row_degree, c);
        g.replace(i, pos, c2);
        break;
      }
      pos = 1;  // the row was reordered: scan it again
    }
  }
  return std::move(g.adj);
}

}  // namespace

CsrMask generate_random(const MaskShape& s, std::uint64_t seed) {
  Rng rng(seed);
  const std::int64_t edges = s.rows * s.row_degree;
  std::vector<std::int64_t> col_deg(static_cast<std::size_t>(s.cols));
  for (std::int64_t j = 0; j < s.cols; ++j) col_deg[j] = spread_degree(edges, s.cols, j);

  if (2 * s.row_degree <= s.cols) return from_flat(s, sparse_random(s, col_deg, rng));

  // Dense: draw the complement (degree cols - d1, column degrees rows - deg)
  // and take its complement, which is simple and (near-)biregular too.
  MaskShape cs = s;
  cs.row_degree = s.cols - s.row_degree;
  std::vector<std::int32_t> comp;
  if (cs.row_degree > 0) {
    std::vector<std::int64_t> comp_deg(col_deg.size());
    for (std::size_t j = 0; j < col_deg.size(); ++j) comp_deg[j] = s.rows - col_deg[j];
    comp = sparse_random(cs, comp_deg, rng);
  }
  std::vector<std::int32_t> adj;
  adj.reserve(static_cast<std::size_t>(edges));
  for (std::int64_t i = 0; i < s.rows; ++i) {
    const std::int32_t* missing = comp.data() + i * cs.row_degree;
    std::int64_t k = 0;
    for (std::int32_t c = 0; c < s.cols; ++c) {
      if (k < cs.row_degree && missing[k] == c) {
        ++k;
      } else {
        adj.push_back(c);
      }
    }
  }
  return from_flat(s, std::move(adj));
}

CsrMask generate_lift(const MaskShape& s, std::uint64_t seed) {
  const std::string problem = lift_shape_problem(s);
  KVCAL_CHECK(problem.empty(), "mask {}x{} with row degree {}: {}", s.rows, s.cols, s.row_degree, problem);
  Rng rng(seed);
  const std::int64_t r = s.cols / s.row_degree;
  const std::int64_t row_fibres = s.rows / r;  // = d2
  std::vector<std::int32_t> adj(static_cast<std::size_t>(s.rows * s.row_degree));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(r));
  for (std::int64_t a = 0; a < row_fibres; ++a) {
    for (std::int64_t b = 0; b < s.row_degree; ++b) {
      std::iota(perm.begin(), perm.end(), 0);
      rng.shuffle(perm.data(), static_cast<std::uint64_t>(r));
      for (std::int64_t t = 0; t < r; ++t) {
        // Row a*r+t meets column fibre b at position b of its row (ascending).
        adj[(a * r + t) * s.row_degree + b] = static_cast<std::int32_t>(b * r + perm[t]);
      }
    }
  }
  return from_flat(s, std::move(adj));
}

CsrMask generate(MaskMethod method, const MaskShape& shape, std::uint64_t seed) {
  return method == MaskMethod::lift ? generate_lift(shape, seed) : generate_random(shape, seed);
}

}  // namespace kvcal
