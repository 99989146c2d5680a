// Internal: bundle manifest checksums, shared by the writer and validate.
#pragma once

#include <hdf5.h>

#include <map>
#include <string>
#include <vector>

namespace kvcal::detail {

// SHA-256 of a dataset's bytes as stored (read in its own file type).
std::string dataset_sha256(hid_t dataset);

// Every dataset below `loc`, as "/path" -> SHA-256.
void hash_datasets(hid_t loc, const std::string& prefix, std::map<std::string, std::string>& out);

// Parses the root `manifest` and compares its dataset checksums with the
// file's datasets; appends one problem per mismatch, missing or extra entry.
void check_manifest(hid_t file, const std::string& path, std::vector<std::string>& problems);

}  // namespace kvcal::detail
