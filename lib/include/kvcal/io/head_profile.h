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
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvcal/io/attention_dump.h"
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

// profile_heads in three steps, so that its work items can run in several
// processes (the CLI's MPI layer, apps/kvcal/dist.h) and still give the same
// bytes: plan (every process, cheap: the dumps' metadata), profile a range of
// items (anywhere, any thread count: an item's result does not depend on
// where it runs), reduce (one process, over every item in plan order: the
// serial order of floating-point additions).
struct ProfileWorkItem {
  std::size_t dump = 0;           // index into the paths
  std::size_t sample = 0;         // index into that dump's samples
  std::int64_t sample_index = 0;  // ordinal over all samples of all dumps
  std::int64_t layer = 0;
  std::int64_t weight = 0;  // score entries read: H * N + T * H * (N + T)
};
struct ProfilePlan {
  HeadProfile header;  // model, shape, options (validated, tau_drift resolved); no scores yet
  std::vector<std::string> paths;
  std::vector<std::unique_ptr<AttentionDump>> dumps;
  std::vector<ProfileWorkItem> items;  // sample-major, layers ascending: the serial order
};
// Where the time of profile_items went (seconds), for -v and the per-rank table.
struct ProfileTimes {
  double wait_read = 0, decode = 0, overlaps = 0, wall = 0;
  std::int64_t items = 0, weight = 0;
};
ProfilePlan plan_head_profile(const std::vector<std::string>& dump_paths, const HeadProfileOptions& options);
// Profiles plan.items[first, last) in order, reading item i+1 while item i is
// computed. `between_items` (optional) runs before each item and may throw to
// stop early. Returns one LayerOverlaps per item.
std::vector<LayerOverlaps> profile_items(const ProfilePlan& plan, std::size_t first, std::size_t last,
                                         ProfileTimes* times = nullptr,
                                         const std::function<void()>& between_items = {});
// Sums per_item (all plan items, in plan order) over samples exactly as
// profile_heads does, averages, classifies and budgets.
HeadProfile reduce_head_profile(const ProfilePlan& plan, const std::vector<LayerOverlaps>& per_item,
                                std::vector<std::string> dump_sha256);

// Roles and budgets from already averaged scores (used by profile_heads).
void classify_and_budget(HeadProfile& profile);

void write_head_profile(const std::string& path, const HeadProfile& profile, const std::string& command_line);
HeadProfile read_head_profile(const std::string& path);

}  // namespace kvcal
