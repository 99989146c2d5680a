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

namespace kvcal {

inline constexpr const char* kMaskFormat = "kvcal.masks";
inline constexpr std::int64_t kMaskFormatVersion = 1;

struct MaskRecord {
  std::string id;  // group name under /masks
  CsrMask mask;
  std::string method;  // "random", "lift", ...
  std::uint64_t seed = 0;
  Certificate certificate;  // the claims stored with the mask
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

}  // namespace kvcal
