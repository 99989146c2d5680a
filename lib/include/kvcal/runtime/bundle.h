// A validated, read-only view of a model's artifact bundle
// (kvcal.bundle, format_version 2, or 1 by request) for the serving engine:
// the masks, the head roles and budgets, and the entropy thresholds.
//
// Bundle::open checks the file's bytes before libhdf5 reads any of them: the
// integrity seal that kvcal bundle writes into the file's first 512 bytes
// (the SHA-256 of the rest of the file), read and hashed with plain reads.
// A damaged or truncated file is an Error there, so a bit flip or an
// incomplete copy never reaches libhdf5's parser (which crashes on some
// damaged files: libhdf5 is not written for hostile input). Then it runs the
// checks kvcal validate runs (schema, manifest checksums, CSR structure,
// ranges and cross-field consistency), so a corrupt file is an Error, never
// an out-of-bounds read later.
//
// What the seal does not stop: a file crafted with a matching seal. Where
// files may come from an adversary, pin the digest of the exact file the
// fleet shipped (BundleOpenOptions::expected_sha256) and check new files
// with `kvcal validate` (it runs in a child process) before an engine loads
// them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcal/runtime/common.h"
#include "kvcal/runtime/mask_cache.h"

namespace kvcal::runtime {

// Head roles as stored in the profile (kvcal::HeadRole values).
enum class Role : std::int8_t { anchor = 1, volatile_head = 2, pivot = 3, satellite = 4 };

// The head profile, per layer and KV head, index l * kv_heads + h.
struct HeadTable {
  std::int64_t layers = 0, kv_heads = 0, q_heads = 0;
  std::vector<Role> role;
  std::vector<std::int32_t> pivot;  // the pivot's head index (pivots and satellites), -1 otherwise
  std::vector<float> stability, similarity;
  std::vector<float> budget_ratio;  // fraction of the context a head keeps; 1 for full heads
  double budget = 0;                // rho, the mean of budget_ratio
  double tau_stable = 0, tau_sim = 0;
  double tau_drift = 0;           // drift threshold on the median overlap
  std::int64_t drift_window = 8;  // W: decode steps per drift check
  std::int64_t topk = 0;          // top-k used for overlaps (L_base for drift monitoring)
  double topk_frac = 0;           // > 0: k = ceil(topk_frac * context) instead of topk
  std::int64_t pool_kernel = 1;

  bool full(std::int64_t layer, std::int64_t head) const {
    const Role r = role[static_cast<std::size_t>(layer * kv_heads + head)];
    return r == Role::pivot || r == Role::volatile_head;
  }
};

// The CHESS re-selection thresholds and the rule they are applied with.
struct EntropyThresholds {
  double entropy = 0, varentropy = 0;
  bool rule_both = true;             // true: trigger when both exceed ("and"); false: either ("or")
  bool unit_bits = false;            // thresholds in bits (else nats)
  std::int64_t page_size = 32;       // tokens per page the statistics were pooled over
  bool varentropy_temporal = false;  // page varentropy = variance of token entropy (else mean varentropy)
  double percentile = 99, calibration_trigger_rate = 0;
};

// How Bundle::open verifies the file before parsing it.
struct BundleOpenOptions {
  // The SHA-256 of the whole file (what `sha256sum` prints, 64 hex digits,
  // either case), when the engine knows which file it must get; empty: any
  // file with a valid seal. A mismatch is an Error before libhdf5 reads the
  // file. A pinned digest also admits a bundle without a seal (format_version
  // 1): the pin verifies its bytes. With a pin a sealed file is hashed twice in
  // one read (its seal and the whole file).
  std::string expected_sha256;
  // Open a bundle that has no seal (format_version 1, written before the seal
  // existed) without verifying its bytes: libhdf5 then parses a file nobody
  // checked, and a damaged one can crash the process. For old bundles already
  // checked with `kvcal validate`; re-bundling them (kvcal bundle) is better.
  // A sealed file is always verified, and a file that is neither sealed nor
  // an HDF5 file is refused either way.
  bool allow_unverified = false;
};

class KVCAL_RUNTIME_API Bundle {
 public:
  // Verifies, opens and validates `path`; throws Error naming the path and
  // the first problem. Without a pin (options.expected_sha256), a file without
  // a seal is refused unless options.allow_unverified.
  static std::unique_ptr<Bundle> open(const std::string& path, const BundleOpenOptions& options);
  static std::unique_ptr<Bundle> open(const std::string& path);  // default options
  ~Bundle();
  Bundle(const Bundle&) = delete;
  Bundle& operator=(const Bundle&) = delete;

  const std::string& path() const;
  // How the bytes were verified before parsing: "seal", "pinned", "seal+pinned"
  // or "unverified" (allow_unverified on a file without a seal).
  const std::string& verified() const;
  const std::string& model() const;
  const std::vector<std::shared_ptr<const Mask>>& masks() const;
  // The bundle's mask for a shape (the first one listed), or null.
  std::shared_ptr<const Mask> find_mask(const MaskKey& key) const;
  const HeadTable& heads() const;
  const EntropyThresholds& entropy() const;

 private:
  Bundle();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcal::runtime
