#include "kvcal/graph/lps.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "kvcal/core/error.h"
#include "kvcal/core/random.h"

namespace kvcal {

bool is_prime(std::int64_t n) {
  if (n < 2) return false;
  if (n % 2 == 0) return n == 2;
  for (std::int64_t d = 3; d * d <= n; d += 2) {
    if (n % d == 0) return false;
  }
  return true;
}

namespace {

std::int64_t pow_mod(std::int64_t base, std::int64_t exp, std::int64_t mod) {
  std::int64_t result = 1 % mod;
  base %= mod;
  if (base < 0) base += mod;
  while (exp > 0) {
    if (exp & 1) result = result * base % mod;
    base = base * base % mod;
    exp >>= 1;
  }
  return result;
}

// Arithmetic in PGL(2, q) on canonical representatives: the first nonzero of
// (a, b) scaled to 1. Entries are < q <= 2^15, so products fit in 32 bits.
struct Mat {
  std::uint32_t a, b, c, d;
};

class Pgl {
 public:
  explicit Pgl(std::int64_t q) : q_(static_cast<std::uint32_t>(q)), inv_(q), square_(q, 0) {
    for (std::int64_t x = 1; x < q; ++x) {
      inv_[x] = static_cast<std::uint32_t>(pow_mod(x, q - 2, q));
      square_[x * x % q] = 1;
    }
  }
  std::uint32_t q() const { return q_; }
  Mat mul(const Mat& x, const Mat& y) const {
    return {(x.a * y.a + x.b * y.c) % q_, (x.a * y.b + x.b * y.d) % q_, (x.c * y.a + x.d * y.c) % q_,
            (x.c * y.b + x.d * y.d) % q_};
  }
  Mat canon(const Mat& m) const {
    const std::uint32_t s = inv_[m.a != 0 ? m.a : m.b];
    return {m.a * s % q_, m.b * s % q_, m.c * s % q_, m.d * s % q_};
  }
  // Index of a canonical matrix in [0, q^3 + q^2).
  std::uint64_t key(const Mat& m) const {
    const std::uint64_t q = q_;
    return m.a != 0 ? (m.b * q + m.c) * q + m.d : q * q * q + m.c * q + m.d;
  }
  std::uint64_t key_space() const { return std::uint64_t{q_} * q_ * q_ + std::uint64_t{q_} * q_; }
  std::uint32_t det(const Mat& m) const { return (m.a * m.d + (q_ - m.b) * m.c % q_) % q_; }
  bool det_is_square(const Mat& m) const { return square_[det(m)] != 0; }

 private:
  std::uint32_t q_;
  std::vector<std::uint32_t> inv_;
  std::vector<std::uint8_t> square_;
};

std::int64_t sqrt_minus_one(std::int64_t q) {
  for (std::int64_t x = 2; x < q; ++x) {
    if (legendre(x, q) == -1) return pow_mod(x, (q - 1) / 4, q);
  }
  fail("no square root of -1 modulo {}", q);
}

std::vector<Mat> generator_matrices(const Pgl& g, std::int64_t p) {
  const std::int64_t q = g.q();
  const std::int64_t i = sqrt_minus_one(q);
  auto m = [q](std::int64_t x) { return static_cast<std::uint32_t>(((x % q) + q) % q); };
  std::vector<Mat> out;
  for (const auto& a : lps_generator_quadruples(p)) {
    out.push_back(g.canon({m(a[0] + i * a[1]), m(a[2] + i * a[3]), m(-a[2] + i * a[3]), m(a[0] - i * a[1])}));
  }
  return out;
}

}  // namespace

int legendre(std::int64_t a, std::int64_t p) {
  const std::int64_t r = pow_mod(a, (p - 1) / 2, p);
  return r == 0 ? 0 : r == 1 ? 1 : -1;
}

std::vector<std::array<std::int64_t, 4>> lps_generator_quadruples(std::int64_t p) {
  std::vector<std::array<std::int64_t, 4>> out;
  const auto r = static_cast<std::int64_t>(std::sqrt(static_cast<double>(p))) + 1;
  const bool one_mod_four = p % 4 == 1;
  for (std::int64_t a0 = 0; a0 <= r; ++a0) {
    for (std::int64_t a1 = -r; a1 <= r; ++a1) {
      for (std::int64_t a2 = -r; a2 <= r; ++a2) {
        const std::int64_t rest = p - a0 * a0 - a1 * a1 - a2 * a2;
        if (rest < 0) continue;
        const auto s = static_cast<std::int64_t>(std::llround(std::sqrt(static_cast<double>(rest))));
        if (s * s != rest) continue;
        for (int sign = 0; sign < (s == 0 ? 1 : 2); ++sign) {
          const std::int64_t a3 = sign == 0 ? s : -s;
          const std::array<std::int64_t, 4> a{a0, a1, a2, a3};
          bool ok;
          if (one_mod_four) {
            ok = a0 > 0 && a0 % 2 == 1 && a1 % 2 == 0 && a2 % 2 == 0 && a3 % 2 == 0;
          } else {
            ok = a0 % 2 == 0 && a1 % 2 != 0 && a2 % 2 != 0 && a3 % 2 != 0 && (a0 > 0 || a1 > 0);
          }
          if (ok) out.push_back(a);
        }
      }
    }
  }
  return out;
}

std::string lps_problem(std::int64_t p, std::int64_t q, std::int64_t max_vertices) {
  if (!is_prime(p) || p == 2) return fmt::format("p = {} is not an odd prime", p);
  if (!is_prime(q) || q == 2) return fmt::format("q = {} is not an odd prime", q);
  if (p == q) return fmt::format("p and q must be distinct (both are {})", p);
  if (q % 4 != 1) return fmt::format("q = {} is not 1 mod 4 (try 5, 13, 17, 29, 37, 41, 53, 61, ...)", q);
  const std::int64_t n = legendre(p, q) == 1 ? q * (q * q - 1) / 2 : q * (q * q - 1);
  if (q > 32749 || n > max_vertices) {
    return fmt::format("X^{{{},{}}} has {} vertices, more than the {} supported", p, q, n, max_vertices);
  }
  const Pgl g(q);
  const std::vector<Mat> gens = generator_matrices(g, p);
  if (static_cast<std::int64_t>(gens.size()) != p + 1) {
    return fmt::format("found {} generators for p = {}, expected {}", gens.size(), p, p + 1);
  }
  std::set<std::uint64_t> keys;
  for (const Mat& m : gens) {
    if (m.a == 1 && m.b == 0 && m.c == 0 && m.d == 1) {
      return fmt::format("a generator of X^{{{},{}}} is the identity mod {}: q is too small for p", p, q, q);
    }
    keys.insert(g.key(m));
  }
  if (static_cast<std::int64_t>(keys.size()) != p + 1) {
    return fmt::format(
        "the {} generators of X^{{{},{}}} are not distinct mod {} (q is too small for p; try q > 2 sqrt(p)): "
        "they would give a multigraph, not a 0/1 mask",
        p + 1, p, q, q);
  }
  return {};
}

LpsGraph build_lps_graph(std::int64_t p, std::int64_t q) {
  const std::string problem = lps_problem(p, q);
  KVCAL_CHECK(problem.empty(), "LPS graph X^{{{},{}}}: {}", p, q, problem);
  const Pgl g(q);
  const std::vector<Mat> gens = generator_matrices(g, p);
  LpsGraph out;
  out.p = p;
  out.q = q;
  out.bipartite = legendre(p, q) == -1;
  const std::int64_t expected = out.bipartite ? q * (q * q - 1) : q * (q * q - 1) / 2;
  const std::int64_t d = p + 1;

  std::vector<std::int32_t> id(g.key_space(), -1);
  std::vector<Mat> verts;
  verts.reserve(static_cast<std::size_t>(expected));
  std::vector<std::int32_t> adj(static_cast<std::size_t>(expected * d));
  verts.push_back({1, 0, 0, 1});
  id[g.key(verts[0])] = 0;
  for (std::size_t u = 0; u < verts.size(); ++u) {
    for (std::int64_t j = 0; j < d; ++j) {
      const Mat w = g.canon(g.mul(verts[u], gens[j]));
      std::int32_t& slot = id[g.key(w)];
      if (slot < 0) {
        KVCAL_CHECK(static_cast<std::int64_t>(verts.size()) < expected, "X^{{{},{}}} has more vertices than {}", p, q,
                    expected);
        slot = static_cast<std::int32_t>(verts.size());
        verts.push_back(w);
      }
      adj[u * d + j] = slot;
    }
  }
  KVCAL_CHECK(static_cast<std::int64_t>(verts.size()) == expected,
              "X^{{{},{}}} reached {} vertices from the identity, expected {}", p, q, verts.size(), expected);
  CsrMask& a = out.adjacency;
  a.rows = a.cols = expected;
  a.indptr.resize(static_cast<std::size_t>(expected + 1));
  for (std::int64_t u = 0; u <= expected; ++u) a.indptr[u] = u * d;
  for (std::int64_t u = 0; u < expected; ++u) std::sort(adj.begin() + u * d, adj.begin() + (u + 1) * d);
  a.indices = std::move(adj);
  if (out.bipartite) {
    out.side.resize(static_cast<std::size_t>(expected));
    for (std::int64_t u = 0; u < expected; ++u) out.side[u] = g.det_is_square(verts[u]) ? 0 : 1;
  }
  return out;
}

const char* to_string(LpsConstruction c) {
  switch (c) {
    case LpsConstruction::half:
      return "half";
    case LpsConstruction::double_cover:
      return "double-cover";
    case LpsConstruction::incidence:
      return "incidence";
  }
  return "unknown";
}

LpsConstruction parse_lps_construction(const std::string& name) {
  if (name == "half") return LpsConstruction::half;
  if (name == "double-cover") return LpsConstruction::double_cover;
  if (name == "incidence") return LpsConstruction::incidence;
  fail("unknown construction '{}': use half, double-cover or incidence", name);
}

LpsConstruction default_lps_construction(const LpsGraph& graph) {
  return graph.bipartite ? LpsConstruction::half : LpsConstruction::double_cover;
}

CsrMask lps_mask(const LpsGraph& graph, LpsConstruction construction) {
  const CsrMask& a = graph.adjacency;
  const std::int64_t n = a.rows, d = graph.degree();
  CsrMask m;
  switch (construction) {
    case LpsConstruction::double_cover:
      KVCAL_CHECK(!graph.bipartite,
                  "X^{{{},{}}} is bipartite, so its double cover is two disjoint copies (sigma2 = sigma1): use "
                  "--construction half or incidence",
                  graph.p, graph.q);
      return a;
    case LpsConstruction::half: {
      KVCAL_CHECK(graph.bipartite,
                  "X^{{{},{}}} is not bipartite ((p/q) = +1): use --construction double-cover or incidence", graph.p,
                  graph.q);
      std::vector<std::int32_t> index(static_cast<std::size_t>(n));
      std::int32_t count[2] = {0, 0};
      for (std::int64_t u = 0; u < n; ++u) index[u] = count[graph.side[u]]++;
      KVCAL_CHECK(count[0] == count[1], "X^{{{},{}}}: unequal sides {} and {}", graph.p, graph.q, count[0], count[1]);
      m.rows = m.cols = count[0];
      m.indptr.reserve(static_cast<std::size_t>(m.rows + 1));
      m.indptr.push_back(0);
      m.indices.reserve(static_cast<std::size_t>(m.rows * d));
      for (std::int64_t u = 0; u < n; ++u) {
        if (graph.side[u] != 0) continue;
        const auto begin = m.indices.size();
        for (auto k = a.indptr[u]; k < a.indptr[u + 1]; ++k) {
          const auto v = a.indices[k];
          KVCAL_CHECK(graph.side[v] == 1, "X^{{{},{}}}: an edge inside one side", graph.p, graph.q);
          m.indices.push_back(index[v]);
        }
        std::sort(m.indices.begin() + static_cast<std::ptrdiff_t>(begin), m.indices.end());
        m.indptr.push_back(static_cast<std::int64_t>(m.indices.size()));
      }
      return m;
    }
    case LpsConstruction::incidence: {
      // Edge ids in order of (smaller end, larger end): row u lists first the
      // edges to smaller neighbours (numbered earlier), then its own: ascending.
      m.rows = n;
      m.cols = n * d / 2;
      m.indptr.resize(static_cast<std::size_t>(n + 1));
      for (std::int64_t u = 0; u <= n; ++u) m.indptr[u] = u * d;
      m.indices.assign(static_cast<std::size_t>(n * d), 0);
      std::vector<std::int64_t> fill(static_cast<std::size_t>(n), 0);
      std::int64_t edge = 0;
      for (std::int64_t u = 0; u < n; ++u) {
        for (auto k = a.indptr[u]; k < a.indptr[u + 1]; ++k) {
          const auto v = a.indices[k];
          if (v <= u) continue;
          m.indices[u * d + fill[u]++] = static_cast<std::int32_t>(edge);
          m.indices[v * d + fill[v]++] = static_cast<std::int32_t>(edge);
          ++edge;
        }
      }
      KVCAL_CHECK(edge == m.cols, "incidence: {} edges, expected {}", edge, m.cols);
      for (std::int64_t u = 0; u < n; ++u) std::sort(m.indices.begin() + u * d, m.indices.begin() + (u + 1) * d);
      return m;
    }
  }
  fail("unknown construction");
}

CsrMask two_lift(const CsrMask& b, std::uint64_t seed) {
  KVCAL_CHECK(
      2 * b.rows <= std::numeric_limits<std::int32_t>::max() && 2 * b.cols <= std::numeric_limits<std::int32_t>::max(),
      "a 2-lift of a {}x{} mask exceeds 2^31 rows or columns", b.rows, b.cols);
  Rng rng(seed);
  const std::int64_t m = b.rows, n = b.cols;
  CsrMask out;
  out.rows = 2 * m;
  out.cols = 2 * n;
  out.indptr.resize(static_cast<std::size_t>(2 * m + 1));
  out.indices.resize(2 * b.indices.size());
  std::vector<std::uint8_t> sign(b.indices.size());
  std::uint64_t bits = 0;
  for (std::size_t k = 0; k < sign.size(); ++k) {
    if (k % 64 == 0) bits = rng.next();
    sign[k] = static_cast<std::uint8_t>((bits >> (k % 64)) & 1);  // 1: negative edge
  }
  // Row r keeps (plus edges at c) then (minus edges at n + c); row m + r the
  // other way round. Each part is ascending because the source row is.
  out.indptr[0] = 0;
  for (std::int64_t r = 0; r < m; ++r) out.indptr[r + 1] = b.indptr[r + 1];
  for (std::int64_t r = 0; r < m; ++r) out.indptr[m + r + 1] = b.nnz() + b.indptr[r + 1];
  for (std::int64_t r = 0; r < m; ++r) {
    std::int64_t top = out.indptr[r], bottom = out.indptr[m + r];
    for (int part = 0; part < 2; ++part) {
      for (auto k = b.indptr[r]; k < b.indptr[r + 1]; ++k) {
        const auto c = b.indices[k];
        const bool minus = sign[k] != 0;
        if (minus == (part == 1)) out.indices[top++] = static_cast<std::int32_t>(c + part * n);
        if (minus == (part == 0)) out.indices[bottom++] = static_cast<std::int32_t>(c + part * n);
      }
    }
  }
  return out;
}

std::vector<LpsShape> list_lps_shapes(std::int64_t max_rows) {
  std::vector<LpsShape> out;
  for (std::int64_t q = 5; q * (q * q - 1) / 2 <= max_rows; q += 4) {
    if (!is_prime(q)) continue;
    for (std::int64_t p = 3; p < 1024; p += 2) {
      if (!is_prime(p) || p == q) continue;
      if (!lps_problem(p, q, max_rows * 2 + 1).empty()) continue;
      const bool bip = legendre(p, q) == -1;
      const std::int64_t n = bip ? q * (q * q - 1) : q * (q * q - 1) / 2;
      const std::int64_t d = p + 1;
      if (bip) {
        if (n / 2 <= max_rows) out.push_back({p, q, bip, LpsConstruction::half, n / 2, n / 2, d, d});
      } else {
        if (n <= max_rows) out.push_back({p, q, bip, LpsConstruction::double_cover, n, n, d, d});
      }
      if (n <= max_rows) out.push_back({p, q, bip, LpsConstruction::incidence, n, n * d / 2, d, 2});
    }
  }
  std::sort(out.begin(), out.end(), [](const LpsShape& x, const LpsShape& y) {
    return std::tie(x.rows, x.row_degree, x.cols) < std::tie(y.rows, y.row_degree, y.cols);
  });
  return out;
}

}  // namespace kvcal
