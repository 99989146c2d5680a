// The whole of `kvcal mask-gen` as one library call: a seeded generator (or
// the deterministic LPS mask), optional transpose and certified 2-lifts,
// every candidate certified and retried with the next seed, K distinct masks
// of one shape. The CLI and the Python package both call generate_masks(), so
// the same options and seed give the same masks (byte-identical CSR) from
// either.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvcal/io/masks.h"
#include "kvcal/spectral/certify.h"

namespace kvcal {

struct MaskGenOptions {
  std::string method = "random";  // "random", "lift" or "lps"
  // random / lift: the shape, with exactly one of row_degree or sparsity.
  std::int64_t rows = 0, cols = 0;
  std::optional<std::int64_t> row_degree;
  std::optional<double> sparsity;
  // lps: the primes and the construction ("" = the graph's default).
  std::int64_t lps_p = 0, lps_q = 0;
  std::string construction;
  bool transpose = false;    // swap rows and columns of the base mask
  std::int64_t lift_to = 0;  // > 0: certified 2-lifts until the mask has this many rows
  std::uint64_t seed = 1;    // first seed; a failed candidate moves on to the next
  std::int64_t count = 1;    // distinct masks of the shape
  std::int64_t tries = 16;   // candidates per mask and per 2-lift
  bool allow_non_ramanujan = false;
  CertifyOptions certify;  // exact_limit, max_failure_probability, threads
};

// Checks every option (throws kvcal::Error naming the bad one), then
// generates. Records are named mask_0000, mask_0001, ... Progress and
// warnings go to the log. Throws kvcal::Error when no certified candidate is
// found in `tries` and allow_non_ramanujan is false.
std::vector<MaskRecord> generate_masks(const MaskGenOptions& options);

}  // namespace kvcal
