// Deterministic Ramanujan masks: the Lubotzky-Phillips-Sarnak graphs X^{p,q}
// (HEX Appendix A.2; Lubotzky, Phillips & Sarnak, Combinatorica 1988), the
// masks derived from them, and random 2-lifts (signings) of any mask.
//
// X^{p,q}, for distinct odd primes p, q with q = 1 (mod 4), is the Cayley
// graph of PGL(2, q) (Legendre symbol (p/q) = -1: bipartite, q(q^2-1)
// vertices) or PSL(2, q) ((p/q) = +1: non-bipartite, q(q^2-1)/2 vertices)
// with p + 1 generators from the solutions of a0^2 + a1^2 + a2^2 + a3^2 = p:
//   p = 1 (mod 4): a0 > 0 odd, a1, a2, a3 even;
//   p = 3 (mod 4): a0 even, a1, a2, a3 odd, and a0 > 0 (or a0 = 0, a1 > 0);
// each mapped with i^2 = -1 (mod q) to [[a0 + i a1, a2 + i a3], [-a2 + i a3, a0 - i a1]].
// It is (p + 1)-regular and Ramanujan: every eigenvalue other than +-(p+1) has
// absolute value at most 2 sqrt(p).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kvcal/graph/csr.h"

namespace kvcal {

bool is_prime(std::int64_t n);
// Legendre symbol (a/p) for an odd prime p: 1, -1 or 0.
int legendre(std::int64_t a, std::int64_t p);

struct LpsGraph {
  std::int64_t p = 0, q = 0;
  bool bipartite = false;
  CsrMask adjacency;  // n x n, p + 1 sorted neighbours per vertex
  // Vertex side for the bipartite case: 0 when det is a square mod q
  // (PSL(2, q), holding the identity), 1 otherwise. Empty if non-bipartite.
  std::vector<std::uint8_t> side;
  std::int64_t vertices() const { return adjacency.rows; }
  std::int64_t degree() const { return p + 1; }
};

// Why X^{p,q} cannot be built (empty when it can): p or q not an odd prime,
// p == q, q != 1 (mod 4), generators that are not distinct in PGL(2, q) (q
// small relative to p), or a graph beyond max_vertices.
std::string lps_problem(std::int64_t p, std::int64_t q, std::int64_t max_vertices = std::int64_t{1} << 27);

// The p + 1 generator quadruples (a0, a1, a2, a3) for p (see above).
std::vector<std::array<std::int64_t, 4>> lps_generator_quadruples(std::int64_t p);

// Builds X^{p,q} by breadth-first search from the identity over canonical
// representatives of PGL(2, q) (scaled so the first nonzero entry is 1).
// Throws kvcal::Error when lps_problem(p, q) is not empty.
LpsGraph build_lps_graph(std::int64_t p, std::int64_t q);

enum class LpsConstruction { half, double_cover, incidence };
const char* to_string(LpsConstruction c);
LpsConstruction parse_lps_construction(const std::string& name);  // throws kvcal::Error

// Masks from a (p+1)-regular graph:
//  half         (bipartite only): the biadjacency between the two sides,
//               n/2 x n/2, (p+1, p+1)-biregular;
//  double_cover (non-bipartite only): biadjacency = adjacency, n x n; for a
//               bipartite graph its sigma2 equals sigma1, so it is refused;
//  incidence    the vertex-edge incidence, n x n(p+1)/2, (p+1, 2)-biregular;
//               sigma^2 = (p+1) + lambda, so it is Ramanujan exactly when
//               lambda_2 <= 2 sqrt(p).
// Throws kvcal::Error for a construction the graph does not admit.
CsrMask lps_mask(const LpsGraph& graph, LpsConstruction construction);

// The construction kvcal picks when none is given: half when bipartite,
// double_cover otherwise.
LpsConstruction default_lps_construction(const LpsGraph& graph);

// A random 2-lift (signing) of a mask B (m x n): each edge gets a sign; the
// lift is [[B+, B-], [B-, B+]] (2m x 2n), with the same degrees. Its singular
// values are those of B and of the signed matrix B+ - B-.
CsrMask two_lift(const CsrMask& mask, std::uint64_t seed);

// One reachable LPS mask shape, for `kvcal mask-gen --list-lps`.
struct LpsShape {
  std::int64_t p, q;
  bool bipartite;
  LpsConstruction construction;
  std::int64_t rows, cols, row_degree, col_degree;
};

// Every (p, q, construction) whose mask has at most max_rows rows (either
// orientation), ordered by rows.
std::vector<LpsShape> list_lps_shapes(std::int64_t max_rows);

}  // namespace kvcal
