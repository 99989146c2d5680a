// Re-derives every claim stored with a mask from its CSR alone.
#pragma once

#include <string>
#include <vector>

#include "kvcal/graph/csr.h"
#include "kvcal/spectral/certify.h"

namespace kvcal {

struct Verification {
  StructureReport structure;
  Certificate recomputed;                 // valid only when structure.ok() and degrees >= 1
  bool recertified = false;               // recomputed was filled
  std::vector<std::string> false_claims;  // empty when every stored claim holds
  bool ok() const { return false_claims.empty(); }
};

// Checks the CSR invariants, then re-runs certify() and compares the stored
// degrees, biregularity, sigma1, sigma2, bound, Ramanujan claim, certificate
// kind and margin against the recomputation.
Verification verify_claims(const CsrMask& mask, const Certificate& stored, const CertifyOptions& options = {});

}  // namespace kvcal
