// The mask artifact (format "kvcal.masks", format_version 1); see
// schemas/masks.v1.json and the README for the layout.
//
// Root attributes: format, format_version, kvcal_version, command_line,
// created_utc. One group per mask under /masks/<id> with datasets indptr
// (int64 [rows+1]) and indices (int32 [nnz]) and the certificate attributes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvcal/graph/csr.h"
#include "kvcal/spectral/certify.h"
#include "kvcal/spectral/verify.h"

namespace kvcal {

inline constexpr const char* kMaskFormat = "kvcal.masks";
inline constexpr std::int64_t kMaskFormatVersion = 1;

struct MaskRecord {
  std::string id;  // group name under /masks
  CsrMask mask;
  std::string method;       // "random", "lift" or "lps"
  std::uint64_t seed = 0;   // seed of the base mask (0 for lps, which needs none)
  Certificate certificate;  // the claims stored with the mask

  // Deterministic LPS masks (method "lps"); attributes lps_p, lps_q, construction.
  std::int64_t lps_p = 0, lps_q = 0;
  std::string construction;  // "half", "double-cover" or "incidence"
  // "LPS" when the LPS theorem alone proves the mask Ramanujan (no lifts);
  // empty otherwise. The numerical certificate is recorded either way.
  std::string certificate_theorem;
  bool transposed = false;                // the base mask was transposed (attribute transposed)
  std::vector<std::uint64_t> lift_seeds;  // winning seed of each random 2-lift (attribute lifts = count)
};

struct MaskFile {
  std::int64_t format_version = 0;
  std::string kvcal_version;
  std::string command_line;
  std::string created_utc;
  std::vector<MaskRecord> masks;
};

// Writes the masks atomically (temporary file, then rename).
void write_mask_file(const std::string& path, const std::vector<MaskRecord>& masks, const std::string& command_line);

// Checks up front that write_mask_file can create `path` (not a directory; its
// directory exists and is writable), so a long generation does not end in an
// I/O error. Throws kvcal::Error otherwise.
void check_mask_output_path(const std::string& path);

// Reads a mask file. Throws kvcal::Error for anything that is not a readable
// kvcal.masks file: missing or mistyped attributes and datasets, sizes that
// do not match the stated shape. The CSR content itself is returned as
// stored; check it with check_structure() before use.
MaskFile read_mask_file(const std::string& path);

// Everything kvcal mask-certify checks for one record: verify_claims() on the
// CSR, plus, for a mask claiming the LPS theorem, that it is exactly the
// X^{p,q} mask its attributes name (rebuilt from p and q).
Verification verify_record(const MaskRecord& record, const CertifyOptions& options = {});

}  // namespace kvcal
