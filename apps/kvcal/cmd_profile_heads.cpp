// kvcal profile-heads: HeteroCache head roles and budgets from attention dumps.
#include <array>
#include <memory>

#include <fmt/format.h>

#include "cli_common.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/io/masks.h"

namespace kvcal::cli {
namespace {

struct Options {
  std::vector<std::string> dumps;
  std::string out, gqa = "mean", order = "appendix";
  std::int64_t drift_window = 8;
  double tau_stable = 0.5, tau_sim = 0.5, tau_drift = -1, budget = 0.5, topk_frac = 0;
  std::int64_t topk = 1024, pool = 5;
  int threads = 0;
};

constexpr const char* kFooter = R"(Examples:
  kvcal profile-heads data/smollm2_attention.h5 --topk-frac 0.1 --out heads.h5
  kvcal profile-heads a.h5 b.h5 --tau-stable 0.6 --tau-sim 0.5 --budget 0.3 --gqa max --out heads.h5

Per KV head: stability = median over decode steps of the top-k overlap with the
prefill row; similarity = median over steps of the best overlap with another
head of its layer (HeteroCache Eq. 1-3, scores averaged over samples). Heads are
clustered per layer (greedy star clustering, Appendix C.2) into pivot and
satellite heads; the rest are anchor (stable) or volatile. Compressed heads
(anchor, satellite) share the budget in inverse proportion to their stability
(Eq. 7-8); budget_ratio is a fraction of the context length, and its mean over
all heads equals --budget.)";

int run(const Options& o, const Globals& g) {
  require_usage(!o.out.empty(), "--out is required");
  check_mask_output_path(o.out);
  HeadProfileOptions opt;
  opt.overlap.pool_kernel = o.pool;
  opt.overlap.topk = o.topk;
  opt.overlap.topk_frac = o.topk_frac;
  opt.overlap.threads = o.threads;
  opt.taxonomy.tau_stable = o.tau_stable;
  opt.taxonomy.tau_sim = o.tau_sim;
  opt.taxonomy.order = parse_taxonomy_order(o.order);
  opt.budget.budget = o.budget;
  opt.gqa = parse_gqa_reduce(o.gqa);
  opt.tau_drift = o.tau_drift;
  opt.drift_window = o.drift_window;
  KVCAL_CHECK(o.drift_window >= 1 && o.drift_window <= (1 << 20), "--drift-window {} must lie in [1, 2^20]",
              o.drift_window);
  KVCAL_CHECK(o.tau_drift < 0 || o.tau_drift <= 1, "--tau-drift {} must lie in [0, 1]", o.tau_drift);
  KVCAL_CHECK(o.threads >= 0, "--threads {} must be 0 (all cores) or more", o.threads);

  const HeadProfile p = profile_heads(o.dumps, opt);
  write_head_profile(o.out, p, g.command_line);

  const std::int64_t L = p.layers, H = p.kv_heads;
  std::array<std::int64_t, 5> total{};
  fmt::print("{} ({} layers x {} KV heads, {} samples)\n", p.model.empty() ? "model" : p.model, L, H, p.num_samples);
  fmt::print("{:>6} {:>7} {:>9} {:>7} {:>10} {:>11} {:>11} {:>12}\n", "layer", "anchor", "volatile", "pivot",
             "satellite", "stability", "similarity", "mean budget");
  for (std::int64_t l = 0; l < L; ++l) {
    std::array<std::int64_t, 5> c{};
    double st = 0, si = 0, b = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      ++c[p.role[l * H + h]];
      ++total[p.role[l * H + h]];
      st += p.stability[l * H + h];
      si += p.similarity[l * H + h];
      b += p.budget_ratio[l * H + h];
    }
    const auto hd = static_cast<double>(H);
    fmt::print("{:>6} {:>7} {:>9} {:>7} {:>10} {:>11.3f} {:>11.3f} {:>12.3f}\n", l, c[1], c[2], c[3], c[4], st / hd,
               si / hd, b / hd);
  }
  double mean_budget = 0;
  for (float r : p.budget_ratio) mean_budget += r;
  mean_budget /= static_cast<double>(L * H);
  fmt::print("{:>6} {:>7} {:>9} {:>7} {:>10} {:>11} {:>11} {:>12.3f}\n", "all", total[1], total[2], total[3], total[4],
             "", "", mean_budget);
  log(LogLevel::info, "wrote the head profile to {}", o.out);
  return 0;
}

}  // namespace

Runner add_profile_heads(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("profile-heads", "Profile KV heads into HeteroCache roles and budgets");
  sub->footer(kFooter);
  sub->add_option("dumps", o->dumps, "kvcal.attention_dump HDF5 files (scripts/record_attention.py)")->required();
  sub->add_option("--out", o->out, "Output head profile (HDF5, written atomically)");
  sub->add_option("--tau-stable", o->tau_stable, "Stability threshold: anchor vs volatile")->capture_default_str();
  sub->add_option("--tau-sim", o->tau_sim, "Pairwise-overlap threshold for the similarity graph")
      ->capture_default_str();
  sub->add_option("--tau-drift", o->tau_drift, "Drift threshold stored for the runtime (default: --tau-stable)");
  sub->add_option("--drift-window", o->drift_window, "Decode steps per drift check stored for the runtime (W)")
      ->capture_default_str();
  sub->add_option("--topk", o->topk, "Top-k positions per row (clipped to the row)")->capture_default_str();
  sub->add_option("--topk-frac", o->topk_frac, "Top-k as a fraction of the row length, instead of --topk");
  sub->add_option("--pool", o->pool, "Average-pooling kernel over positions (1: none)")->capture_default_str();
  sub->add_option("--budget", o->budget, "Mean cache ratio over all heads, rho in (0, 1]")->capture_default_str();
  sub->add_option("--gqa", o->gqa, "Query heads -> KV head: mean or max")
      ->check(CLI::IsMember({"mean", "max"}))
      ->capture_default_str();
  sub->add_option("--order", o->order,
                  "appendix (cluster all heads, App. C.2) or similar-first (only S_sim >= tau-sim heads, §4.1)")
      ->check(CLI::IsMember({"appendix", "similar-first"}))
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "Compute threads (0: all cores but one, which reads and hashes)")
      ->capture_default_str();
  return [o](const Globals& g) { return run(*o, g); };
}

}  // namespace kvcal::cli
