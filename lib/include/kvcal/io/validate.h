// Validation and inspection of kvcal artifacts against their schemas
// (schemas/*.json, compiled into the library).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvcal {

struct ValidationReport {
  std::string path;
  std::string format;  // empty when the file is not a kvcal artifact
  std::int64_t format_version = 0;
  std::vector<std::string> problems;  // every violation found; empty when valid
  // The integrity seal (kvcal/io/seal.h), checked before libhdf5 opens the
  // file: "seal verified (SHA-256 ... over N bytes)", "no seal", or empty when
  // not checked.
  std::string integrity;
  bool ok() const { return problems.empty(); }
};

// Checks any kvcal artifact (masks, attention dump, head profile, entropy
// calibration, bundle): required groups, datasets and attributes, dtypes,
// ranks, shape relations and value ranges from its schema, then the
// semantic invariants (CSR structure and degrees, role/pivot/budget
// consistency, histogram totals) and, for bundles, the manifest checksums.
// First of all, with check_seal, a file that starts with an integrity seal
// has its seal checked with plain reads; a mismatch, a truncation or a
// damaged seal is the only problem reported (libhdf5 never opens the file).
// A bundle of format_version 2 or later without a seal is invalid.
// Never throws for a bad file: every problem is listed.
ValidationReport validate_artifact(const std::string& path, bool check_seal = true);

// The schema text of a format ("kvcal.masks", ...); throws kvcal::Error if unknown.
const std::string& schema_text(const std::string& format);

// A readable summary of any kvcal artifact, or the same as JSON.
std::string inspect_artifact(const std::string& path, bool json);

}  // namespace kvcal
