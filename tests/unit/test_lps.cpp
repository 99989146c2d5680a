#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <queue>

#include "dense_reference.h"
#include "kvcal/core/error.h"
#include "kvcal/graph/lps.h"
#include "kvcal/io/masks.h"
#include "kvcal/spectral/certify.h"

namespace kvcal {
namespace {

TEST(NumberTheory, PrimesAndLegendreAgainstBruteForce) {
  for (std::int64_t n = -3; n < 200; ++n) {
    bool prime = n >= 2;
    for (std::int64_t d = 2; d < n && prime; ++d) prime = n % d != 0;
    EXPECT_EQ(is_prime(n), prime) << n;
  }
  for (std::int64_t p : {3, 5, 7, 13, 61}) {
    for (std::int64_t a = 0; a < 2 * p; ++a) {
      bool square = false;
      for (std::int64_t x = 1; x < p; ++x) square = square || (x * x) % p == a % p;
      const int want = a % p == 0 ? 0 : (square ? 1 : -1);
      EXPECT_EQ(legendre(a, p), want) << a << " mod " << p;
    }
  }
}

TEST(LpsGenerators, CountAndConventions) {
  for (std::int64_t p : {3, 5, 7, 11, 13, 17, 19, 23, 29, 101, 103}) {
    const auto gens = lps_generator_quadruples(p);
    ASSERT_EQ(static_cast<std::int64_t>(gens.size()), p + 1) << "p = " << p;
    for (const auto& a : gens) {
      EXPECT_EQ(a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3], p);
      if (p % 4 == 1) {
        EXPECT_TRUE(a[0] > 0 && a[0] % 2 == 1);
      } else {
        EXPECT_TRUE(a[0] % 2 == 0 && (a[0] > 0 || a[1] > 0));
      }
    }
    std::vector<std::array<std::int64_t, 4>> sorted = gens;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(std::unique(sorted.begin(), sorted.end()), sorted.end()) << "repeated quadruple for p = " << p;
  }
}

TEST(LpsProblem, RejectsBadParameters) {
  EXPECT_FALSE(lps_problem(13, 13).empty());  // p == q
  EXPECT_FALSE(lps_problem(5, 7).empty());    // q = 3 mod 4
  EXPECT_FALSE(lps_problem(9, 13).empty());   // p not prime
  EXPECT_FALSE(lps_problem(5, 21).empty());   // q not prime
  EXPECT_FALSE(lps_problem(2, 13).empty());   // p even
  EXPECT_FALSE(lps_problem(5, 2).empty());
  EXPECT_TRUE(lps_problem(5, 13).empty());
  EXPECT_THROW(build_lps_graph(13, 13), Error);
  // Large p against a small q: the p + 1 generators collide in PGL(2, q).
  bool found = false;
  for (std::int64_t p = 3; p < 400 && !found; p += 2) {
    if (!is_prime(p) || p == 5) continue;
    const std::string why = lps_problem(p, 5);
    found = why.find("not distinct") != std::string::npos || why.find("identity") != std::string::npos;
  }
  EXPECT_TRUE(found) << "no p with colliding generators mod 5 below 400";
}

// Girth by BFS from every vertex (small graphs only).
std::int64_t girth(const CsrMask& a) {
  std::int64_t best = std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> dist(a.rows), parent(a.rows);
  for (std::int64_t s = 0; s < a.rows; ++s) {
    std::fill(dist.begin(), dist.end(), -1);
    std::queue<std::int64_t> queue;
    dist[s] = 0;
    parent[s] = -1;
    queue.push(s);
    while (!queue.empty()) {
      const auto u = queue.front();
      queue.pop();
      for (auto k = a.indptr[u]; k < a.indptr[u + 1]; ++k) {
        const std::int64_t v = a.indices[k];
        if (dist[v] < 0) {
          dist[v] = dist[u] + 1;
          parent[v] = u;
          queue.push(v);
        } else if (v != parent[u]) {
          best = std::min(best, dist[u] + dist[v] + 1);
        }
      }
    }
  }
  return best;
}

// Two-colours the graph by BFS; false when an odd cycle exists.
bool two_colourable(const CsrMask& a) {
  std::vector<int> colour(a.rows, -1);
  for (std::int64_t s = 0; s < a.rows; ++s) {
    if (colour[s] >= 0) continue;
    colour[s] = 0;
    std::queue<std::int64_t> queue;
    queue.push(s);
    while (!queue.empty()) {
      const auto u = queue.front();
      queue.pop();
      for (auto k = a.indptr[u]; k < a.indptr[u + 1]; ++k) {
        const auto v = a.indices[k];
        if (colour[v] < 0) {
          colour[v] = 1 - colour[u];
          queue.push(v);
        } else if (colour[v] == colour[u]) {
          return false;
        }
      }
    }
  }
  return true;
}

struct PQ {
  std::int64_t p, q;
};
void PrintTo(const PQ& c, std::ostream* os) { *os << "X^{" << c.p << "," << c.q << "}"; }

class LpsGraphs : public ::testing::TestWithParam<PQ> {};

TEST_P(LpsGraphs, MatchesTheory) {
  const auto [p, q] = GetParam();
  const LpsGraph g = build_lps_graph(p, q);
  const bool bipartite = legendre(p, q) == -1;
  EXPECT_EQ(g.bipartite, bipartite);
  EXPECT_EQ(g.vertices(), bipartite ? q * (q * q - 1) : q * (q * q - 1) / 2);
  const CsrMask& a = g.adjacency;
  const auto rep = check_structure(a);
  ASSERT_TRUE(rep.ok()) << rep.problems.front();  // sorted, no repeated edge
  EXPECT_TRUE(rep.biregular);
  EXPECT_EQ(rep.row_degree_max, p + 1);
  // Read as a biadjacency, the adjacency is the bipartite double cover: two
  // copies of a connected bipartite graph, one piece for a non-bipartite one.
  EXPECT_EQ(rep.components, bipartite ? 2 : 1);
  for (std::int64_t u = 0; u < a.rows; ++u) {
    EXPECT_FALSE(std::binary_search(a.indices.begin() + a.indptr[u], a.indices.begin() + a.indptr[u + 1],
                                    static_cast<std::int32_t>(u)))
        << "loop at " << u;
  }
  EXPECT_EQ(transpose(a), a) << "adjacency not symmetric";
  EXPECT_EQ(two_colourable(a), bipartite) << "bipartiteness by odd-cycle search";
  if (bipartite) {
    for (std::int64_t u = 0; u < a.rows; ++u)
      for (auto k = a.indptr[u]; k < a.indptr[u + 1]; ++k) EXPECT_NE(g.side[u], g.side[a.indices[k]]);
  }
  // Girth at least the LPS lower bound.
  const double logpq = std::log(static_cast<double>(q)) / std::log(static_cast<double>(p));
  const double bound = bipartite ? 4 * logpq - std::log(4.0) / std::log(static_cast<double>(p)) : 2 * logpq;
  EXPECT_GE(static_cast<double>(girth(a)), bound);
  // Ramanujan against Eigen's dense symmetric eigensolver (small graphs).
  if (a.rows > 2200) return;
  const Eigen::MatrixXd dense = test::to_dense(a);
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(dense, Eigen::EigenvaluesOnly);
  const Eigen::VectorXd ev = es.eigenvalues();
  const double d = static_cast<double>(p + 1);
  EXPECT_NEAR(ev[ev.size() - 1], d, 1e-9);
  EXPECT_LT(ev[ev.size() - 2], d - 1e-6) << "disconnected";
  EXPECT_EQ(std::abs(ev[0] + d) < 1e-9, bipartite);
  const double nontrivial = std::max(std::abs(ev[bipartite ? 1 : 0]), std::abs(ev[ev.size() - 2]));
  EXPECT_LE(nontrivial, 2 * std::sqrt(static_cast<double>(p)) + 1e-9);
  EXPECT_EQ(build_lps_graph(p, q).adjacency, a) << "not deterministic";
}

INSTANTIATE_TEST_SUITE_P(Small, LpsGraphs,
                         ::testing::ValuesIn(std::vector<PQ>{
                             {3, 5}, {5, 13}, {3, 13}, {3, 17}, {7, 17}, {13, 5}, {11, 13}}));

TEST(LpsMasks, ConstructionsAreRamanujanAndMatchDense) {
  for (auto [p, q] : std::vector<PQ>{{3, 13}, {3, 5}, {7, 5}}) {
    SCOPED_TRACE(::testing::Message() << "X^{" << p << "," << q << "}");
    const LpsGraph g = build_lps_graph(p, q);
    const double d = static_cast<double>(p + 1);
    const Eigen::MatrixXd adj = test::to_dense(g.adjacency);
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(adj, Eigen::EigenvaluesOnly);
    const Eigen::VectorXd ev = es.eigenvalues();
    if (g.bipartite) {
      EXPECT_THROW(lps_mask(g, LpsConstruction::double_cover), Error);
      const CsrMask h = lps_mask(g, LpsConstruction::half);
      EXPECT_EQ(h.rows, g.vertices() / 2);
      const auto hs = check_structure(h);
      EXPECT_TRUE(hs.ok() && hs.biregular && hs.row_degree_max == p + 1 && hs.components == 1);
      const auto s = test::dense_singular_values(h);
      EXPECT_NEAR(s[0], d, 1e-9);
      EXPECT_LE(s[1], 2 * std::sqrt(static_cast<double>(p)) + 1e-9);
      const Certificate c = certify(h);
      EXPECT_TRUE(c.ramanujan);
      EXPECT_NEAR(c.sigma2, s[1], 1e-7 * d);
    } else {
      EXPECT_THROW(lps_mask(g, LpsConstruction::half), Error);
      const CsrMask dc = lps_mask(g, LpsConstruction::double_cover);
      const auto s = test::dense_singular_values(dc);
      const double want = std::max(std::abs(ev[0]), std::abs(ev[ev.size() - 2]));
      EXPECT_NEAR(s[1], want, 1e-9);
      const Certificate c = certify(dc);
      EXPECT_TRUE(c.ramanujan);
      EXPECT_NEAR(c.sigma2, s[1], 1e-7 * d);
    }
    // Incidence: (p+1, 2)-biregular, sigma^2 = d + lambda.
    const CsrMask inc = lps_mask(g, LpsConstruction::incidence);
    const auto rep = check_structure(inc);
    ASSERT_TRUE(rep.ok());
    EXPECT_TRUE(rep.biregular);
    EXPECT_EQ(rep.row_degree_max, p + 1);
    EXPECT_EQ(rep.col_degree_max, 2);
    EXPECT_EQ(inc.cols, g.vertices() * (p + 1) / 2);
    // Singular values squared are the eigenvalues of inc inc^T (n x n, small).
    const Eigen::MatrixXd dense_inc = test::to_dense(inc);
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> gram(dense_inc * dense_inc.transpose(), Eigen::EigenvaluesOnly);
    const Eigen::VectorXd s2 = gram.eigenvalues();
    EXPECT_NEAR(s2[s2.size() - 1], 2 * d, 1e-8);
    EXPECT_NEAR(s2[s2.size() - 2], d + ev[ev.size() - 2], 1e-8);
    const Certificate c = certify(inc);
    EXPECT_EQ(c.ramanujan, ev[ev.size() - 2] <= 2 * std::sqrt(static_cast<double>(p)));
    EXPECT_TRUE(c.ramanujan);
  }
}

TEST(TwoLift, KeepsDegreesAndSplitsTheSpectrum) {
  const CsrMask base = lps_mask(build_lps_graph(3, 5), LpsConstruction::half);  // 60x60, 4-regular
  for (std::uint64_t seed : {1u, 2u}) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    const CsrMask lift = two_lift(base, seed);
    const auto rep = check_structure(lift);
    ASSERT_TRUE(rep.ok()) << rep.problems.front();
    EXPECT_TRUE(rep.biregular);
    EXPECT_EQ(rep.row_degree_max, 4);
    EXPECT_EQ(lift.rows, 2 * base.rows);
    // spectrum(lift) = spectrum(B+ + B-) united with spectrum(B+ - B-).
    const Eigen::MatrixXd l = test::to_dense(lift);
    const Eigen::Index m = base.rows, n = base.cols;
    const Eigen::MatrixXd plus = l.topLeftCorner(m, n), minus = l.topRightCorner(m, n);
    EXPECT_EQ(plus + minus, test::to_dense(base));
    EXPECT_EQ(l.bottomLeftCorner(m, n), minus);
    EXPECT_EQ(l.bottomRightCorner(m, n), plus);
    Eigen::JacobiSVD<Eigen::MatrixXd> a(plus + minus), b(plus - minus), whole(l);
    std::vector<double> joined(a.singularValues().data(), a.singularValues().data() + m);
    joined.insert(joined.end(), b.singularValues().data(), b.singularValues().data() + m);
    std::sort(joined.rbegin(), joined.rend());
    for (Eigen::Index i = 0; i < 2 * m; ++i) EXPECT_NEAR(whole.singularValues()[i], joined[i], 1e-9);
    EXPECT_EQ(two_lift(base, seed), lift);
  }
  EXPECT_NE(two_lift(base, 1), two_lift(base, 2));
}

TEST(LpsShapes, ListIsConsistentWithTheBuilder) {
  const auto shapes = list_lps_shapes(1100);
  ASSERT_FALSE(shapes.empty());
  bool has_513 = false;
  for (const auto& s : shapes) {
    EXPECT_LE(s.rows, 1100);
    EXPECT_TRUE(lps_problem(s.p, s.q).empty());
    EXPECT_EQ(s.rows * s.row_degree, s.cols * s.col_degree);
    has_513 = has_513 || (s.p == 5 && s.q == 13 && s.construction == LpsConstruction::half && s.rows == 1092);
  }
  EXPECT_TRUE(has_513);
  // Spot check: each listed shape of X^{3,13} is what lps_mask builds.
  const LpsGraph g = build_lps_graph(3, 13);
  for (const auto& s : shapes) {
    if (s.p != 3 || s.q != 13) continue;
    const CsrMask m = lps_mask(g, s.construction);
    EXPECT_EQ(m.rows, s.rows);
    EXPECT_EQ(m.cols, s.cols);
  }
}

TEST(VerifyRecord, LpsTheoremClaimIsCheckedByRebuilding) {
  MaskRecord rec;
  rec.method = "lps";
  rec.lps_p = 5;
  rec.lps_q = 13;
  rec.construction = "half";
  rec.certificate_theorem = "LPS";
  rec.mask = lps_mask(build_lps_graph(5, 13), LpsConstruction::half);
  rec.certificate = certify(rec.mask);
  EXPECT_TRUE(verify_record(rec).ok());
  MaskRecord wrong = rec;
  wrong.lps_q = 17;  // names another graph
  EXPECT_FALSE(verify_record(wrong).ok());
  wrong = rec;
  wrong.transposed = true;  // the half mask is not symmetric
  EXPECT_FALSE(verify_record(wrong).ok());
  wrong = rec;
  wrong.lift_seeds = {1};
  EXPECT_FALSE(verify_record(wrong).ok());
}

}  // namespace
}  // namespace kvcal
