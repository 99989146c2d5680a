// One artifact bundle per model (format "kvcal.bundle", format_version 2;
// schemas/bundle.v2.json): the masks, the head profile and the entropy
// thresholds, with provenance and a manifest of checksums, checked before use.
//
// format_version 2 adds the integrity seal (kvcal/io/seal.h): a SHA-256 of
// the whole file in its 512-byte HDF5 user block, checked before libhdf5
// reads the file. The HDF5 layout is that of version 1, which is still read
// (such files have no seal).
//
// Layout: /masks/<id> (the mask layout), /heads (the head profile's root
// attributes and its /heads datasets), /entropy (the entropy calibration's
// root attributes and datasets), root attribute `manifest`: JSON with the
// model, kvcal version, creation time, each part's source, SHA-256, format
// version and parameters, and the SHA-256 of every dataset's stored bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvcal/io/entropy_calibration.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/io/masks.h"

namespace kvcal {

inline constexpr const char* kBundleFormat = "kvcal.bundle";
inline constexpr std::int64_t kBundleFormatVersion = 2;

// What a HuggingFace config.json says about the attention shapes.
struct ModelConfig {
  std::int64_t layers = 0;    // num_hidden_layers
  std::int64_t q_heads = 0;   // num_attention_heads
  std::int64_t kv_heads = 0;  // num_key_value_heads (default: num_attention_heads)
  std::int64_t head_dim = 0;  // head_dim (default: hidden_size / num_attention_heads)
};
ModelConfig read_model_config(const std::string& path);  // throws kvcal::Error

struct BundleInputs {
  std::string model;
  std::vector<std::string> masks;  // kvcal.masks files
  std::string heads;               // kvcal.head_profile
  std::string entropy;             // kvcal.entropy_calibration
  std::string model_config;        // optional config.json
};

// Validates every input (kvcal validate), checks the shapes against the model
// config when given, and writes the bundle atomically, sealed. Throws kvcal::Error
// naming the first problem.
void write_bundle(const std::string& out, const BundleInputs& inputs, const std::string& command_line);

// A bundle's parts, read with the same code as the standalone artifacts.
struct BundleContents {
  std::string model;
  std::vector<MaskRecord> masks;  // in /masks link order
  HeadProfile heads;
  EntropyCalibration entropy;
};

// Reads a bundle. Checks what the typed readers check (types, shapes, sizes)
// and no more: run validate_artifact first. Throws kvcal::Error.
BundleContents read_bundle(const std::string& path);

}  // namespace kvcal
