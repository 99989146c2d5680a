// The head profile (format "kvcal.head_profile", format_version 1; see
// schemas/head_profile.v1.json) and the driver that computes it from dumps.
//
// /heads: stability f32 [L, Hkv], similarity f32 [L, Hkv], role int8 [L, Hkv]
// (1 anchor, 2 volatile, 3 pivot, 4 satellite), pivot int32 [L, Hkv] (the
// pivot's head index for pivots and satellites, -1 otherwise), budget_ratio
// f32 [L, Hkv] (1 for full heads), pairwise_overlap f32 [L, Hkv, Hkv].
// Root attributes: every parameter, the dumps' SHA-256, provenance.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvcal/profile/heads.h"

namespace kvcal {

inline constexpr const char* kHeadProfileFormat = "kvcal.head_profile";
inline constexpr std::int64_t kHeadProfileFormatVersion = 1;

struct HeadProfileOptions {
  OverlapOptions overlap;
  TaxonomyOptions taxonomy;
  BudgetOptions budget;
  GqaReduce gqa = GqaReduce::mean;
  double tau_drift = -1;          // < 0: tau_stable
  std::int64_t drift_window = 8;  // W: decode steps per drift check at run time (attribute drift_window)
};

struct HeadProfile {
  std::string model;
  std::int64_t layers = 0, kv_heads = 0, q_heads = 0, num_samples = 0;
  std::vector<float> stability, similarity, budget_ratio;  // [L * Hkv]
  std::vector<std::int8_t> role;                           // [L * Hkv]
  std::vector<std::int32_t> pivot;                         // [L * Hkv]
  std::vector<float> pairwise;                             // [L * Hkv * Hkv]
  HeadProfileOptions options;                              // tau_drift resolved
  std::vector<std::string> dump_sha256;                    // one per dump, in order
};

// Profiles every sample of every dump (all must agree on L, Hq, Hkv), one
// layer of one sample in memory at a time; progress goes to the log.
HeadProfile profile_heads(const std::vector<std::string>& dump_paths, const HeadProfileOptions& options);

// Roles and budgets from already averaged scores (used by profile_heads).
void classify_and_budget(HeadProfile& profile);

void write_head_profile(const std::string& path, const HeadProfile& profile, const std::string& command_line);
HeadProfile read_head_profile(const std::string& path);

}  // namespace kvcal
