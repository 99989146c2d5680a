#include "kvcal/io/head_profile.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>

#include <fmt/ranges.h>

#include "io/bundle_internal.h"
#include "io/h5.h"
#include "kvcal/core/log.h"
#include "kvcal/core/sha256.h"
#include "kvcal/io/attention_dump.h"

namespace kvcal {

using detail::H5Handle;

void classify_and_budget(HeadProfile& p) {
  const std::int64_t L = p.layers, H = p.kv_heads;
  p.role.assign(static_cast<std::size_t>(L * H), 0);
  p.pivot.assign(static_cast<std::size_t>(L * H), -1);
  std::vector<HeadRole> roles(static_cast<std::size_t>(L * H));
  for (std::int64_t l = 0; l < L; ++l) {
    const auto layer = [&](const std::vector<float>& v, std::int64_t width) {
      return std::vector<float>(v.begin() + l * width, v.begin() + (l + 1) * width);
    };
    const LayerTaxonomy tax =
        classify_layer(layer(p.stability, H), layer(p.similarity, H), layer(p.pairwise, H * H), H, p.options.taxonomy);
    for (std::int64_t h = 0; h < H; ++h) {
      roles[l * H + h] = tax.role[h];
      p.role[l * H + h] = static_cast<std::int8_t>(tax.role[h]);
      p.pivot[l * H + h] = tax.pivot[h];
    }
  }
  p.budget_ratio = allocate_budgets(roles, p.stability, p.options.budget);
}

ProfilePlan plan_head_profile(const std::vector<std::string>& paths, const HeadProfileOptions& options) {
  KVCAL_CHECK(!paths.empty(), "no attention dump given");
  const auto& ov = options.overlap;
  KVCAL_CHECK(ov.pool_kernel >= 1 && ov.pool_kernel <= 4096, "--pool {} must lie in [1, 4096]", ov.pool_kernel);
  KVCAL_CHECK(ov.topk >= 1, "--topk {} must be at least 1", ov.topk);
  KVCAL_CHECK(ov.topk_frac >= 0 && ov.topk_frac <= 1, "--topk-frac {} must lie in (0, 1] (0: use --topk)",
              ov.topk_frac);
  for (double tau : {options.taxonomy.tau_stable, options.taxonomy.tau_sim}) {
    KVCAL_CHECK(std::isfinite(tau) && tau >= 0 && tau <= 1, "threshold {} must lie in [0, 1]", tau);
  }
  KVCAL_CHECK(options.budget.budget > 0 && options.budget.budget <= 1, "--budget {} must lie in (0, 1]",
              options.budget.budget);

  ProfilePlan plan;
  plan.paths = paths;
  HeadProfile& p = plan.header;
  p.options = options;
  if (p.options.tau_drift < 0) p.options.tau_drift = options.taxonomy.tau_stable;
  for (const auto& path : paths) {
    plan.dumps.push_back(std::make_unique<AttentionDump>(path));
    const AttentionDump& d = *plan.dumps.back();
    if (plan.dumps.size() == 1) {
      p.model = d.model();
      p.layers = d.layers();
      p.q_heads = d.q_heads();
      p.kv_heads = d.kv_heads();
    } else {
      KVCAL_CHECK(d.layers() == p.layers && d.q_heads() == p.q_heads && d.kv_heads() == p.kv_heads,
                  "{}: L x Hq x Hkv = {} x {} x {} differs from {} ({} x {} x {}); profile one model at a time", path,
                  d.layers(), d.q_heads(), d.kv_heads(), paths.front(), p.layers, p.q_heads, p.kv_heads);
      if (d.model() != p.model) log(LogLevel::warn, "{}: model '{}' differs from '{}'", path, d.model(), p.model);
    }
  }
  bool whole_rows_warned = false;
  for (std::size_t f = 0; f < plan.dumps.size(); ++f) {
    const auto& samples = plan.dumps[f]->samples();
    for (std::size_t si = 0; si < samples.size(); ++si) {
      const DumpSample& s = samples[si];
      if (ov.topk_frac == 0 && ov.topk >= s.prompt_len && !whole_rows_warned) {
        whole_rows_warned = true;
        log(LogLevel::warn,
            "--topk {} covers whole rows of sample '{}' (prompt of {} tokens): every overlap is then 1; use "
            "--topk-frac (e.g. 0.1) or a smaller --topk",
            ov.topk, s.name, s.prompt_len);
      }
      const std::int64_t weight = s.heads * s.prompt_len + s.steps * s.heads * (s.prompt_len + s.steps);
      for (std::int64_t l = 0; l < p.layers; ++l) plan.items.push_back({f, si, p.num_samples, l, weight});
      ++p.num_samples;
    }
  }
  return plan;
}

std::vector<LayerOverlaps> profile_items(const ProfilePlan& plan, std::size_t first, std::size_t last,
                                         ProfileTimes* times, const std::function<void()>& between_items) {
  KVCAL_CHECK(first <= last && last <= plan.items.size(), "profile_items: range [{}, {}) outside {} items", first, last,
              plan.items.size());
  const HeadProfileOptions& options = plan.header.options;
  // Reading (HDF5) and hashing run on threads of their own: by default the
  // compute uses the other cores, at least one (spinning OpenMP workers would
  // otherwise steal the reader's core).
  OverlapOptions compute = options.overlap;
  if (compute.threads <= 0) compute.threads = std::max(1, omp_get_num_procs() - 1);
  const std::int64_t L = plan.header.layers;

  // The raw bytes of item i+1 are read (HDF5, one thread) while item i is
  // decoded and profiled (OpenMP threads).
  auto fetch = [&plan](std::size_t i) {
    return std::async(std::launch::async, [&plan, i] {
      const ProfileWorkItem& it = plan.items[i];
      const AttentionDump& d = *plan.dumps[it.dump];
      return d.read_raw_layer(d.samples()[it.sample], it.layer);
    });
  };
  std::vector<LayerOverlaps> out;
  out.reserve(last - first);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  ProfileTimes local;
  ProfileTimes& tm = times ? *times : local;
  std::future<AttentionDump::RawLayer> next;
  if (first < last) next = fetch(first);
  for (std::size_t i = first; i < last; ++i) {
    if (between_items) between_items();
    const auto ta = Clock::now();
    const AttentionDump::RawLayer raw = next.get();
    if (i + 1 < last) next = fetch(i + 1);
    const ProfileWorkItem& it = plan.items[i];
    const AttentionDump& d = *plan.dumps[it.dump];
    const auto tb = Clock::now();
    const LayerAttention layer = d.decode_layer(raw, options.gqa, 2e-2, compute.threads);
    const auto tc = Clock::now();
    out.push_back(layer_overlaps(layer, compute));
    const auto td = Clock::now();
    tm.wait_read += std::chrono::duration<double>(tb - ta).count();
    tm.decode += std::chrono::duration<double>(tc - tb).count();
    tm.overlaps += std::chrono::duration<double>(td - tc).count();
    ++tm.items;
    tm.weight += it.weight;
    if (it.layer + 1 == L) {
      const DumpSample& s = d.samples()[it.sample];
      log(LogLevel::info, "profiled sample {}/{} ('{}', N = {}, T = {}) after {:.1f} s", it.sample_index + 1,
          plan.header.num_samples, s.name, s.prompt_len, s.steps,
          std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  tm.wall = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

HeadProfile reduce_head_profile(const ProfilePlan& plan, const std::vector<LayerOverlaps>& per_item,
                                std::vector<std::string> dump_sha256) {
  KVCAL_CHECK(per_item.size() == plan.items.size(), "reduce_head_profile: {} results for {} items", per_item.size(),
              plan.items.size());
  HeadProfile p = plan.header;
  const std::int64_t L = p.layers, H = p.kv_heads;
  p.stability.assign(static_cast<std::size_t>(L * H), 0.0f);
  p.similarity.assign(static_cast<std::size_t>(L * H), 0.0f);
  p.pairwise.assign(static_cast<std::size_t>(L * H * H), 0.0f);
  std::vector<double> stab(p.stability.size(), 0.0), sim(p.similarity.size(), 0.0), pair(p.pairwise.size(), 0.0);
  // Sample-major order: each score is a sum over samples in file and sample order.
  for (std::size_t i = 0; i < per_item.size(); ++i) {
    const LayerOverlaps& o = per_item[i];
    KVCAL_CHECK(static_cast<std::int64_t>(o.stability.size()) == H &&
                    static_cast<std::int64_t>(o.similarity.size()) == H &&
                    static_cast<std::int64_t>(o.pairwise.size()) == H * H,
                "reduce_head_profile: item {} has the wrong size", i);
    const std::int64_t l = plan.items[i].layer;
    for (std::int64_t h = 0; h < H; ++h) {
      stab[l * H + h] += o.stability[h];
      sim[l * H + h] += o.similarity[h];
    }
    for (std::int64_t k = 0; k < H * H; ++k) pair[l * H * H + k] += o.pairwise[k];
  }
  const double inv = 1.0 / static_cast<double>(p.num_samples);
  for (std::size_t i = 0; i < stab.size(); ++i) {
    p.stability[i] = static_cast<float>(stab[i] * inv);
    p.similarity[i] = static_cast<float>(sim[i] * inv);
  }
  for (std::size_t i = 0; i < pair.size(); ++i) p.pairwise[i] = static_cast<float>(pair[i] * inv);
  classify_and_budget(p);
  p.dump_sha256 = std::move(dump_sha256);
  return p;
}

HeadProfile profile_heads(const std::vector<std::string>& paths, const HeadProfileOptions& options) {
  const ProfilePlan plan = plan_head_profile(paths, options);
  // The inputs' SHA-256 (provenance) is computed beside the profiling.
  std::future<std::vector<std::string>> hashes = std::async(std::launch::async, [&paths] {
    std::vector<std::string> out;
    for (const auto& path : paths) out.push_back(sha256_file(path));
    return out;
  });
  ProfileTimes tm;
  const std::vector<LayerOverlaps> per_item = profile_items(plan, 0, plan.items.size(), &tm);
  const auto th = std::chrono::steady_clock::now();
  std::vector<std::string> sha = hashes.get();
  log(LogLevel::debug,
      "time: waiting for reads {:.2f} s, decode/validate {:.2f} s, overlaps {:.2f} s, SHA-256 wait {:.2f} s",
      tm.wait_read, tm.decode, tm.overlaps,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - th).count());
  return reduce_head_profile(plan, per_item, std::move(sha));
}

void write_head_profile(const std::string& path, const HeadProfile& p, const std::string& command_line) {
  const std::int64_t L = p.layers, H = p.kv_heads;
  detail::write_atomically(path, [&](hid_t file) {
    detail::write_provenance(file, kHeadProfileFormat, kHeadProfileFormatVersion, command_line);
    detail::write_attr(file, "model", p.model);
    detail::write_attr(file, "num_layers", L);
    detail::write_attr(file, "num_kv_heads", H);
    detail::write_attr(file, "num_q_heads", p.q_heads);
    detail::write_attr(file, "num_samples", p.num_samples);
    detail::write_attr(file, "tau_stable", p.options.taxonomy.tau_stable);
    detail::write_attr(file, "tau_sim", p.options.taxonomy.tau_sim);
    detail::write_attr(file, "tau_drift", p.options.tau_drift);
    detail::write_attr(file, "drift_window", p.options.drift_window);
    detail::write_attr(file, "topk", p.options.overlap.topk);
    detail::write_attr(file, "topk_frac", p.options.overlap.topk_frac);
    detail::write_attr(file, "pool_kernel", p.options.overlap.pool_kernel);
    detail::write_attr(file, "gqa", std::string(to_string(p.options.gqa)));
    detail::write_attr(file, "budget", p.options.budget.budget);
    detail::write_attr(file, "stability_floor", p.options.budget.stability_floor);
    detail::write_attr(file, "taxonomy_order", std::string(to_string(p.options.taxonomy.order)));
    detail::write_attr(file, "dump_sha256", fmt::format("{}", fmt::join(p.dump_sha256, ",")));
    H5Handle g = detail::create_group(file, "heads");
    detail::write_dataset(g.get(), "stability", {L, H}, p.stability.data());
    detail::write_dataset(g.get(), "similarity", {L, H}, p.similarity.data());
    detail::write_dataset(g.get(), "role", {L, H}, p.role.data());
    detail::write_dataset(g.get(), "pivot", {L, H}, p.pivot.data());
    detail::write_dataset(g.get(), "budget_ratio", {L, H}, p.budget_ratio.data());
    detail::write_dataset(g.get(), "pairwise_overlap", {L, H, H}, p.pairwise.data());
  });
}

HeadProfile read_head_profile(const std::string& path) {
  std::int64_t version = 0;
  H5Handle file = detail::open_artifact(path, kHeadProfileFormat, kHeadProfileFormatVersion, &version);
  H5Handle g = detail::open_group(file.get(), "heads", path);
  return detail::read_head_profile(file.get(), g.get(), path, path + ": /heads");
}

HeadProfile detail::read_head_profile(hid_t f, hid_t g, const std::string& path, const std::string& ctx) {
  HeadProfile p;
  p.model = detail::read_attr_string(f, "model", path);
  p.layers = detail::read_attr_int(f, "num_layers", path);
  p.kv_heads = detail::read_attr_int(f, "num_kv_heads", path);
  p.q_heads = detail::read_attr_int(f, "num_q_heads", path);
  p.num_samples = detail::read_attr_int(f, "num_samples", path);
  KVCAL_CHECK(p.layers >= 1 && p.layers <= 4096 && p.kv_heads >= 1 && p.kv_heads <= 4096,
              "{}: num_layers = {} / num_kv_heads = {} out of range", path, p.layers, p.kv_heads);
  auto& o = p.options;
  o.taxonomy.tau_stable = detail::read_attr_double(f, "tau_stable", path);
  o.taxonomy.tau_sim = detail::read_attr_double(f, "tau_sim", path);
  o.tau_drift = detail::read_attr_double(f, "tau_drift", path);
  // Optional: profiles written before it existed get the default.
  if (detail::has_attr(f, "drift_window")) o.drift_window = detail::read_attr_int(f, "drift_window", path);
  KVCAL_CHECK(o.drift_window >= 1 && o.drift_window <= (1 << 20), "{}: drift_window = {} is out of range", path,
              o.drift_window);
  o.overlap.topk = detail::read_attr_int(f, "topk", path);
  o.overlap.topk_frac = detail::read_attr_double(f, "topk_frac", path);
  o.overlap.pool_kernel = detail::read_attr_int(f, "pool_kernel", path);
  o.gqa = parse_gqa_reduce(detail::read_attr_string(f, "gqa", path));
  o.budget.budget = detail::read_attr_double(f, "budget", path);
  o.budget.stability_floor = detail::read_attr_double(f, "stability_floor", path);
  o.taxonomy.order = parse_taxonomy_order(detail::read_attr_string(f, "taxonomy_order", path));
  const std::string sha = detail::read_attr_string(f, "dump_sha256", path);
  for (std::size_t pos = 0; pos < sha.size();) {
    const std::size_t comma = std::min(sha.find(',', pos), sha.size());
    p.dump_sha256.push_back(sha.substr(pos, comma - pos));
    pos = comma + 1;
  }
  const std::int64_t L = p.layers, H = p.kv_heads;
  p.stability = detail::read_dataset<float>(g, "stability", {L, H}, ctx);
  p.similarity = detail::read_dataset<float>(g, "similarity", {L, H}, ctx);
  p.role = detail::read_dataset<std::int8_t>(g, "role", {L, H}, ctx);
  p.pivot = detail::read_dataset<std::int32_t>(g, "pivot", {L, H}, ctx);
  p.budget_ratio = detail::read_dataset<float>(g, "budget_ratio", {L, H}, ctx);
  p.pairwise = detail::read_dataset<float>(g, "pairwise_overlap", {L, H, H}, ctx);
  return p;
}

}  // namespace kvcal
