// HeteroCache at run time (CPU reference, HeteroCache §4.3 and Algorithm 1):
// which heads keep their full KV cache, the budgets of the compressed ones,
// and the pivots' drift monitors that decide when satellites fetch new tokens
// from host memory.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcal/runtime/common.h"

namespace kvcal::runtime {

struct HeadTable;

// The plan of one context length: per layer and KV head (index l * kv_heads + h).
struct HeteroPlan {
  std::int64_t layers = 0, kv_heads = 0, context = 0;
  std::vector<std::uint8_t> full;                     // pivots and volatile heads keep everything
  std::vector<std::int64_t> budget;                   // l_i tokens kept by a compressed head (context for full heads)
  std::vector<std::int32_t> pivot;                    // a satellite's pivot head in the same layer, -1 otherwise
  std::vector<std::vector<std::int32_t>> satellites;  // a pivot's satellites (empty for other heads)
  std::int64_t l_base = 0;  // L_base: mean budget of the compressed heads, the drift sets' size
  double tau_drift = 0;
  std::int64_t window = 8;  // W: decode steps per drift check
  std::int64_t compressed_heads = 0;
  std::int64_t budget_sum = 0;  // sum of l_i over compressed heads

  bool is_full(std::int64_t layer, std::int64_t head) const {
    return full[static_cast<std::size_t>(layer * kv_heads + head)] != 0;
  }
};

// Budgets from the profile for a context of `context` tokens: l_i =
// round(budget_ratio_i * context), at least 1 and at most context; L_base =
// round(sum l_i / N_comp) (Eq. 8: the budgets sum to N_comp * L_base up to
// rounding). Throws Error when the table is inconsistent.
KVCAL_RUNTIME_API HeteroPlan make_hetero_plan(const HeadTable& heads, std::int64_t context, std::int64_t window = 8);

// Indices of the k largest values (ties: lower index first), ascending.
KVCAL_RUNTIME_API std::vector<std::int32_t> top_indices(const float* values, std::int64_t n, std::int64_t k);

// What the engine fetches from host memory when a pivot drifts: for each of
// its satellites, the top-l_s tokens of the pivot's current attention
// (attention over n tokens), ascending (Algorithm 1, lines 36-38).
struct SatelliteFetch {
  std::int32_t head = 0;             // the satellite's KV head in the layer
  std::vector<std::int32_t> tokens;  // its new token set, l_s of them (fewer when n < l_s)
};
KVCAL_RUNTIME_API std::vector<SatelliteFetch> satellite_fetches(const HeteroPlan& plan, std::int64_t layer,
                                                                std::int64_t pivot, const float* attention,
                                                                std::int64_t n);

// One pivot head's drift monitor (Algorithm 1, lines 19-41): the base set is
// the top-L_base of the prefill attention; each decode step's top-L_base set
// gives o_t = |K_t ∩ K_base| / L_base; every W steps the median of the last W
// overlaps is compared with tau_drift, and on drift the base set becomes the
// current step's set.
class KVCAL_RUNTIME_API DriftMonitor {
 public:
  DriftMonitor(std::int64_t l_base, std::int64_t window, double tau_drift);
  void init(const float* prefill_attention, std::int64_t n);
  struct Step {
    double overlap = 0;    // o_t
    bool checked = false;  // a window completed at this step
    double median = 0;     // its median overlap (when checked)
    bool drift = false;    // median < tau_drift: satellites must be refreshed
  };
  Step step(const float* attention, std::int64_t n);
  const std::vector<std::int32_t>& base() const { return base_; }
  std::int64_t steps() const { return steps_; }
  std::int64_t drifts() const { return drifts_; }

 private:
  std::int64_t l_base_, window_;
  double tau_;
  std::vector<std::int32_t> base_;
  std::vector<double> recent_;
  std::int64_t steps_ = 0, drifts_ = 0;
};

}  // namespace kvcal::runtime
