// kvcal profile-heads: HeteroCache head roles and budgets from attention dumps.
#include <algorithm>
#include <array>
#include <chrono>
#include <future>
#include <memory>

#include <fmt/format.h>

#include "cli_common.h"
#include "dist.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/core/sha256.h"
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

// The work items (one layer of one sample each) split over the ranks by
// weight; each rank also hashes the dumps it reads most of. Rank 0 gathers
// every item's overlaps in plan order and reduces them as one process does.
// Returns the profile on rank 0 (empty elsewhere).
HeadProfile profile_distributed(dist::Context& ctx, const std::vector<std::string>& dumps,
                                const HeadProfileOptions& opt) {
  ProfilePlan plan;
  ctx.step([&] { plan = plan_head_profile(dumps, opt); });
  std::vector<std::int64_t> weights;
  for (const auto& it : plan.items) weights.push_back(it.weight);
  const std::vector<std::size_t> bounds = dist::split_by_weight(weights, ctx.size());
  const std::size_t first = bounds[ctx.rank()], last = bounds[ctx.rank() + 1];
  // Dump f is hashed by the rank that reads most of it (ties: the lowest).
  std::vector<std::vector<std::int64_t>> share(dumps.size(), std::vector<std::int64_t>(ctx.size(), 0));
  for (int r = 0; r < ctx.size(); ++r) {
    for (std::size_t i = bounds[r]; i < bounds[r + 1]; ++i) share[plan.items[i].dump][r] += plan.items[i].weight;
  }
  std::vector<std::size_t> my_files;
  for (std::size_t f = 0; f < dumps.size(); ++f) {
    const auto best = std::max_element(share[f].begin(), share[f].end()) - share[f].begin();
    if (best == ctx.rank()) my_files.push_back(f);
  }

  dist::Packer out;
  ctx.step([&] {
    using Clock = std::chrono::steady_clock;
    const auto t0 = Clock::now();
    std::future<std::vector<std::string>> hashes = std::async(std::launch::async, [&] {
      std::vector<std::string> h;
      for (std::size_t f : my_files) h.push_back(sha256_file(dumps[f]));
      return h;
    });
    ProfileTimes tm;
    const std::vector<LayerOverlaps> mine = profile_items(plan, first, last, &tm, [&] { ctx.poll(); });
    const auto th = Clock::now();
    const std::vector<std::string> h = hashes.get();
    const double hash_wait = std::chrono::duration<double>(Clock::now() - th).count();
    for (const LayerOverlaps& o : mine) {
      out.put_vector(o.stability);
      out.put_vector(o.similarity);
      out.put_vector(o.pairwise);
    }
    out.put_vector(std::vector<std::uint64_t>(my_files.begin(), my_files.end()));
    for (const auto& s : h) out.put_string(s);
    out.put(tm);
    out.put(hash_wait);
    out.put(std::chrono::duration<double>(Clock::now() - t0).count());
  });
  const std::vector<std::string> parts = ctx.gather(out.bytes());

  HeadProfile p;
  ctx.step([&] {
    if (!ctx.root()) return;
    std::vector<LayerOverlaps> all;
    all.reserve(plan.items.size());
    std::vector<std::string> sha(dumps.size());
    if (ctx.size() > 1)
      log(LogLevel::debug, "{:>5} {:>6} {:>9} {:>8} {:>8} {:>9} {:>10} {:>7}", "rank", "items", "M scores", "wait rd",
          "decode", "overlaps", "hash wait", "wall");
    for (int r = 0; r < ctx.size(); ++r) {
      dist::Unpacker in(parts[r]);
      for (std::size_t i = bounds[r]; i < bounds[r + 1]; ++i) {
        LayerOverlaps o;
        o.stability = in.get_vector<float>();
        o.similarity = in.get_vector<float>();
        o.pairwise = in.get_vector<float>();
        all.push_back(std::move(o));
      }
      for (std::uint64_t f : in.get_vector<std::uint64_t>()) {
        KVCAL_CHECK(f < sha.size(), "rank {} sent a hash of dump {}", r, f);
        sha[f] = in.get_string();
      }
      const auto tm = in.get<ProfileTimes>();
      const auto hash_wait = in.get<double>();
      const auto wall = in.get<double>();
      KVCAL_CHECK(in.done(), "rank {} sent more than expected", r);
      if (ctx.size() > 1) {
        log(LogLevel::debug, "{:>5} {:>6} {:>9.1f} {:>8.2f} {:>8.2f} {:>9.2f} {:>10.2f} {:>7.2f}", r, tm.items,
            static_cast<double>(tm.weight) * 1e-6, tm.wait_read, tm.decode, tm.overlaps, hash_wait, wall);
      } else {
        log(LogLevel::debug,
            "time: waiting for reads {:.2f} s, decode/validate {:.2f} s, overlaps {:.2f} s, SHA-256 wait {:.2f} s",
            tm.wait_read, tm.decode, tm.overlaps, hash_wait);
      }
    }
    p = reduce_head_profile(plan, all, std::move(sha));
    if (ctx.size() > 1) {
      log(LogLevel::info, "gathered {} layer profiles of {} samples from {} ranks", all.size(), p.num_samples,
          ctx.size());
    }
  });
  return p;
}

HeadProfileOptions profile_options(const Options& o) {
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
  return opt;
}

void print_summary(const HeadProfile& p) {
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
}

int run(const Options& o, const Globals& g) {
  dist::Context ctx;
  HeadProfileOptions opt;
  ctx.step([&] {
    require_usage(!o.out.empty(), "--out is required");
    if (ctx.root()) check_mask_output_path(o.out);
    opt = profile_options(o);
  });
  const HeadProfile p = profile_distributed(ctx, o.dumps, opt);
  ctx.step([&] {
    if (!ctx.root()) return;
    write_head_profile(o.out, p, g.command_line);
    print_summary(p);
    log(LogLevel::info, "wrote the head profile to {}", o.out);
  });
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
