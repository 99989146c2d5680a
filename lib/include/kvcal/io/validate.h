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
  bool ok() const { return problems.empty(); }
};

// Checks any kvcal artifact (masks, attention dump, head profile, entropy
// calibration, bundle): required groups, datasets and attributes, dtypes,
// ranks, shape relations and value ranges from its schema, then the
// semantic invariants (CSR structure and degrees, role/pivot/budget
// consistency, histogram totals) and, for bundles, the manifest checksums.
// Never throws for a bad file: every problem is listed.
ValidationReport validate_artifact(const std::string& path);

// The schema text of a format ("kvcal.masks", ...); throws kvcal::Error if unknown.
const std::string& schema_text(const std::string& format);

// A readable summary of any kvcal artifact, or the same as JSON.
std::string inspect_artifact(const std::string& path, bool json);

}  // namespace kvcal
