// kvcal eval-fidelity: replays the queries, keys and values recorded in an
// attention dump through each compression method of the runtime library and
// measures attention-output error against KV size.
//
// Per sample and layer: the prompt's N tokens are appended at once (their
// full blocks compressed, the prefill attention of the last prompt token
// observed first for the heavy-hitter scores), then each decode step t
// appends token N+t, attends with the recorded query of every query head over
// the compressed cache, and observes the recorded attention row of step t.
// The reference is plain attention over the same fp16 keys and values.
//
// CHESS (chess-conservative|moderate|aggressive): page summaries from every
// layer's keys; pages are selected after the prompt and again whenever the
// re-selection trigger fires (thresholds from --bundle; without a bundle the
// prompt's selection stays); every query head attends the selected pages,
// the sinks, the recent window, the pages completed since the last selection
// (never scored yet) and the partial page, in fp16.
// HeteroCache (hetero, needs --bundle): full heads keep everything; anchors
// and satellites keep their top-l_i prompt tokens by their own prefill
// attention plus every decode token; pivots monitor drift (window W) and on
// drift their satellites take the pivot's current top-l_s tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvcal/runtime/chess.h"
#include "kvcal/runtime/hex.h"

namespace kvcal {

struct FidelityOptions {
  std::vector<std::string> methods;  // hex_method names and "h2o-evict"
  runtime::HexOptions hex;           // block, hh_ratio, recent window, sparsity, mode (bits and parts per method)
  double h2o_budget = 0.2;           // h2o-evict: fraction of tokens kept
  std::string bundle;                // optional: masks come from here first
  std::uint64_t mask_seed = 0x6b7663616cULL;
  int threads = 0;                // 0: all cores (layers run in parallel)
  runtime::ChessOptions chess;    // page size, chunk/grid sizes, sinks, recent pages (ratios per method)
  std::int64_t drift_window = 0;  // hetero: W (0: the bundle's head profile says)
};

struct FidelityRow {
  std::string method;
  double kv_size_pct = 0;                    // compressed bytes / fp16 bytes, at the end of every sample, in percent
  double rel_err_mean = 0, rel_err_p99 = 0;  // ||o - o^|| / ||o|| over queries, heads, layers, samples
  double cos_mean = 0;
  std::int64_t queries = 0;  // (sample, step, layer, query head) evaluated
  // CHESS: fraction of pages attended and the full attention's mass on them
  // (means over steps, query heads, layers); hetero: retrievals per pivot step.
  double selected_pct = -1, attn_mass = -1, trigger_rate = -1;  // < 0: not applicable
  double seconds = 0;                                           // time spent in this method's compression and attention
};

struct FidelityReport {
  std::vector<FidelityRow> rows;
  std::string model, mask_source;  // where the expander mask came from
  std::int64_t samples = 0, layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  double reference_max_abs_diff = 0;  // recomputed fp16 attention vs the recorded weights
};

// Throws kvcal::Error for a dump without queries/keys/values, unknown
// methods, bad options, or a bundle that cannot be used.
FidelityReport eval_fidelity(const std::string& dump_path, const FidelityOptions& options);

// Splitting the evaluation (kvcal eval-fidelity over MPI ranks): the work is
// a list of items in a fixed order, one layer of one sample each, or whole
// samples when a CHESS method is listed (its page selection reads every
// layer's keys of the sample). An item's result is its tallies per method, in
// parts merged in order (a layer; for a whole sample its CHESS selections
// first, then each layer). reduce() merges every item's parts in item order
// and computes the rows from the merged tallies, the same arithmetic however
// the items were split, so the report is the same to the bit;
// eval_fidelity() is evaluate() of every item, then reduce().
struct FidelityTally {
  std::vector<double> rel_err, cos;  // per (step, query head) of the part, in order
  std::int64_t bytes = 0, fp16_bytes = 0;
  double seconds = 0;
  double mass_sum = 0, selected_sum = 0;
  std::int64_t mass_n = 0, selected_n = 0;
  std::int64_t drift_steps = 0, drifts = 0;
  void merge(const FidelityTally& o);
};

struct FidelityItem {
  std::int64_t sample = 0, layer_begin = 0, layer_end = 0;
  std::int64_t weight = 0;  // work estimate: attention rows read by its decode steps
};

struct FidelityPartial {
  std::vector<std::vector<FidelityTally>> parts;  // [part][method]
  double reference_max_abs_diff = 0;
};

class FidelityEvaluator {
 public:
  // Checks the options and the dump's shapes, opens the bundle and gets the
  // expander mask (throws kvcal::Error as eval_fidelity does). Reads the
  // dump's metadata only.
  FidelityEvaluator(const std::string& dump_path, const FidelityOptions& options);
  ~FidelityEvaluator();
  FidelityEvaluator(const FidelityEvaluator&) = delete;
  FidelityEvaluator& operator=(const FidelityEvaluator&) = delete;

  const std::vector<FidelityItem>& items() const;
  const FidelityReport& shape() const;  // the report's shapes and mask source, no rows
  std::size_t methods() const;
  // Items [begin, end), reading only their layers of the dump (a sample's
  // layers in parallel threads); `between` runs before each sample's items
  // (it may throw to stop).
  std::vector<FidelityPartial> evaluate(std::size_t begin, std::size_t end,
                                        const std::function<void()>& between = {}) const;
  // Every item's result, in item order.
  FidelityReport reduce(const std::vector<FidelityPartial>& all) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The CSV: method,kv_size_pct,rel_err_mean,rel_err_p99,cos_mean,selected_pct,attn_mass,trigger_rate
// (one row per method; the last three empty where they do not apply).
std::string fidelity_csv(const FidelityReport& report);

}  // namespace kvcal
