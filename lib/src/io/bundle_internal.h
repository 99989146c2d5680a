// Internal: bundle manifest checksums, shared by the writer and validate, and
// the readers of one artifact part at an HDF5 location, shared by the
// standalone file readers and read_bundle (a bundle keeps each part in a group).
#pragma once

#include <hdf5.h>

#include <map>
#include <string>
#include <vector>

#include "kvcal/io/entropy_calibration.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/io/masks.h"

namespace kvcal::detail {

// SHA-256 of a dataset's bytes as stored (read in its own file type).
std::string dataset_sha256(hid_t dataset);

// Every dataset below `loc`, as "/path" -> SHA-256.
void hash_datasets(hid_t loc, const std::string& prefix, std::map<std::string, std::string>& out);

// Parses the root `manifest` and compares its dataset checksums with the
// file's datasets; appends one problem per mismatch, missing or extra entry.
void check_manifest(hid_t file, const std::string& path, std::vector<std::string>& problems);

// The mask group `id` under `masks` (errors name `where` for the group itself,
// `ctx` for its contents).
MaskRecord read_mask_group(hid_t masks, const std::string& id, const std::string& where, const std::string& ctx);

// The head profile's attributes on `attrs` and its datasets in `data` (a
// profile file's root and /heads; the same group in a bundle).
HeadProfile read_head_profile(hid_t attrs, hid_t data, const std::string& where, const std::string& ctx);

// The entropy calibration's attributes and datasets on `loc`.
EntropyCalibration read_entropy_calibration(hid_t loc, const std::string& where);

}  // namespace kvcal::detail
