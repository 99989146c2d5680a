// HeteroCache head profiling (HeteroCache §3, §4.1-4.2, Appendix B-C).
//
// From attention rows recorded on calibration prompts kvcal scores every KV
// head's temporal stability and intra-layer similarity, clusters similar
// heads around pivots (greedy star clustering, Appendix C.2), labels the rest
// anchor or volatile, and gives each compressed head a cache budget inversely
// proportional to its stability (Eq. 7-8).
//
// Choices where the paper is silent (each documented in the README):
//  * pooling: centred 1-D average over `pool_kernel` positions, averaging only
//    the positions inside the row (no zero padding at the borders);
//  * top-k ties: the lower position wins, so sets are deterministic;
//  * median of an even count: the mean of the two middle values;
//  * several samples: per-sample medians are averaged;
//  * S_stable = 0: weight 1 / max(S_stable, stability_floor);
//  * a budget above the full length is capped at 1 and the excess given to
//    the uncapped heads in proportion to their weights (water filling).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvcal {

// How query heads of a GQA group are combined into their KV head.
enum class GqaReduce { mean, max };
const char* to_string(GqaReduce r);
GqaReduce parse_gqa_reduce(const std::string& name);  // throws kvcal::Error

// Clustering order: Appendix C.2 (cluster every head, classify the rest) or
// §4.1 (only heads with S_sim >= tau_sim take part in clustering).
enum class TaxonomyOrder { appendix, similar_first };
const char* to_string(TaxonomyOrder o);
TaxonomyOrder parse_taxonomy_order(const std::string& name);  // throws kvcal::Error

// Role codes (those of the public HeteroCache scripts).
enum class HeadRole : std::int8_t { anchor = 1, volatile_head = 2, pivot = 3, satellite = 4 };
const char* to_string(HeadRole r);

struct OverlapOptions {
  std::int64_t pool_kernel = 5;  // 1 disables pooling
  std::int64_t topk = 1024;      // clipped to the row length
  double topk_frac = 0;          // > 0: k = ceil(topk_frac * row length) instead of topk
  int threads = 0;               // 0: all cores
};

// One layer of one sample, already reduced to KV heads.
// prefill [heads, n]; decode [steps, heads, n + steps] (step t uses n + t + 1).
struct LayerAttention {
  std::int64_t heads = 0, n = 0, steps = 0;
  std::vector<float> prefill;
  std::vector<float> decode;
};

// Per-layer overlap statistics of one sample.
struct LayerOverlaps {
  std::vector<float> stability;   // [heads] median_t O(K_t, K_prefill)
  std::vector<float> similarity;  // [heads] median_t max_{h' != h} O(K_t^h, K_t^h')
  std::vector<float> pairwise;    // [heads, heads] median_t O(K_t^h, K_t^h'); diagonal 1
};

// Centred average pooling of one row (see above) into out (same length).
void average_pool(const float* row, std::int64_t len, std::int64_t kernel, float* out);
// Indices of the k largest values (ties: lower index first), ascending.
std::vector<std::int32_t> top_k(const float* row, std::int64_t len, std::int64_t k);
// |A ∩ B| / min(|A|, |B|) for ascending index sets; 0 when either is empty.
double overlap_coefficient(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b);
// Median (mean of the middle two for an even count). Requires a non-empty input.
double median(std::vector<double> values);
// k for a row of `len` entries under `options`.
std::int64_t topk_for_row(std::int64_t len, const OverlapOptions& options);

// Reduces [.., hq, len] rows to [.., hkv, len] by groups of hq / hkv
// consecutive query heads. `rows` holds `outer` blocks of hq rows.
std::vector<float> reduce_gqa(const std::vector<float>& rows, std::int64_t outer, std::int64_t hq, std::int64_t hkv,
                              std::int64_t len, GqaReduce how);

LayerOverlaps layer_overlaps(const LayerAttention& layer, const OverlapOptions& options);

struct TaxonomyOptions {
  double tau_stable = 0.5;
  double tau_sim = 0.5;
  TaxonomyOrder order = TaxonomyOrder::appendix;
};

struct LayerTaxonomy {
  std::vector<HeadRole> role;       // [heads]
  std::vector<std::int32_t> pivot;  // [heads] pivot index for pivots/satellites, -1 otherwise
};

// Greedy star clustering on the graph with an edge h - h' where
// pairwise[h, h'] >= tau_sim (Boost.Graph): repeatedly the unassigned head
// with the most unassigned neighbours (ties: lowest index) becomes a pivot and
// its unassigned neighbours its satellites, until no unassigned head has an
// unassigned neighbour. Remaining heads: anchor when stability >= tau_stable,
// else volatile.
LayerTaxonomy classify_layer(const std::vector<float>& stability, const std::vector<float>& similarity,
                             const std::vector<float>& pairwise, std::int64_t heads, const TaxonomyOptions& options);

struct BudgetOptions {
  double budget = 0.5;            // rho: mean cache ratio over all heads, in (0, 1]
  double stability_floor = 1e-3;  // S_stable below this counts as this
};

// Budget ratios (of the context length) for all heads: 1 for full heads
// (pivot, volatile), Eq. 7-8 for compressed ones (anchor, satellite), capped
// at 1 with the excess redistributed. The mean over all heads equals budget
// (up to rounding). Throws kvcal::Error when rho * N < N_full, naming the
// smallest feasible rho.
std::vector<float> allocate_budgets(const std::vector<HeadRole>& roles, const std::vector<float>& stability,
                                    const BudgetOptions& options);

}  // namespace kvcal
