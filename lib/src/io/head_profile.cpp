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

HeadProfile profile_heads(const std::vector<std::string>& paths, const HeadProfileOptions& options) {
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

  HeadProfile p;
  p.options = options;
  // Reading (HDF5) and hashing run on threads of their own: by default the
  // compute uses the other cores, at least one (spinning OpenMP workers would
  // otherwise steal the reader's core).
  OverlapOptions compute = ov;
  if (compute.threads <= 0) compute.threads = std::max(1, omp_get_num_procs() - 1);
  if (p.options.tau_drift < 0) p.options.tau_drift = options.taxonomy.tau_stable;
  std::vector<std::unique_ptr<AttentionDump>> dumps;
  std::int64_t total_samples = 0;
  for (const auto& path : paths) {
    dumps.push_back(std::make_unique<AttentionDump>(path));
    const AttentionDump& d = *dumps.back();
    if (dumps.size() == 1) {
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
    total_samples += static_cast<std::int64_t>(d.samples().size());
  }
  const std::int64_t L = p.layers, H = p.kv_heads;
  p.stability.assign(static_cast<std::size_t>(L * H), 0.0f);
  p.similarity.assign(static_cast<std::size_t>(L * H), 0.0f);
  p.pairwise.assign(static_cast<std::size_t>(L * H * H), 0.0f);
  std::vector<double> stab(p.stability.size(), 0.0), sim(p.similarity.size(), 0.0), pair(p.pairwise.size(), 0.0);

  // Work items in order; the raw bytes of item i+1 are read (HDF5, one
  // thread) while item i is decoded and profiled (OpenMP threads).
  struct Item {
    const AttentionDump* dump;
    const DumpSample* sample;
    std::int64_t layer;
  };
  std::vector<Item> items;
  bool whole_rows_warned = false;
  for (const auto& d : dumps) {
    for (const DumpSample& s : d->samples()) {
      if (ov.topk_frac == 0 && ov.topk >= s.prompt_len && !whole_rows_warned) {
        whole_rows_warned = true;
        log(LogLevel::warn,
            "--topk {} covers whole rows of sample '{}' (prompt of {} tokens): every overlap is then 1; use "
            "--topk-frac (e.g. 0.1) or a smaller --topk",
            ov.topk, s.name, s.prompt_len);
      }
      for (std::int64_t l = 0; l < L; ++l) items.push_back({d.get(), &s, l});
    }
  }
  auto fetch = [&items](std::size_t i) {
    return std::async(std::launch::async,
                      [&items, i] { return items[i].dump->read_raw_layer(*items[i].sample, items[i].layer); });
  };
  // The inputs' SHA-256 (provenance) is computed beside the profiling.
  std::future<std::vector<std::string>> hashes = std::async(std::launch::async, [&paths] {
    std::vector<std::string> out;
    for (const auto& path : paths) out.push_back(sha256_file(path));
    return out;
  });
  std::int64_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::future<AttentionDump::RawLayer> next = fetch(0);
  using Clock = std::chrono::steady_clock;
  double wait_s = 0, decode_s = 0, overlap_s = 0;  // where the time goes (-v)
  for (std::size_t i = 0; i < items.size(); ++i) {
    const auto ta = Clock::now();
    const AttentionDump::RawLayer raw = next.get();
    if (i + 1 < items.size()) next = fetch(i + 1);
    const Item& it = items[i];
    const auto tb = Clock::now();
    const LayerAttention layer = it.dump->decode_layer(raw, options.gqa, 2e-2, compute.threads);
    const auto tc = Clock::now();
    const LayerOverlaps o = layer_overlaps(layer, compute);
    const auto td = Clock::now();
    wait_s += std::chrono::duration<double>(tb - ta).count();
    decode_s += std::chrono::duration<double>(tc - tb).count();
    overlap_s += std::chrono::duration<double>(td - tc).count();
    const std::int64_t l = it.layer;
    for (std::int64_t h = 0; h < H; ++h) {
      stab[l * H + h] += o.stability[h];
      sim[l * H + h] += o.similarity[h];
    }
    for (std::int64_t k = 0; k < H * H; ++k) pair[l * H * H + k] += o.pairwise[k];
    if (l + 1 == L) {
      ++done;
      log(LogLevel::info, "profiled sample {}/{} ('{}', N = {}, T = {}) after {:.1f} s", done, total_samples,
          it.sample->name, it.sample->prompt_len, it.sample->steps,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  const double inv = 1.0 / static_cast<double>(total_samples);
  for (std::size_t i = 0; i < stab.size(); ++i) {
    p.stability[i] = static_cast<float>(stab[i] * inv);
    p.similarity[i] = static_cast<float>(sim[i] * inv);
  }
  for (std::size_t i = 0; i < pair.size(); ++i) p.pairwise[i] = static_cast<float>(pair[i] * inv);
  p.num_samples = total_samples;
  classify_and_budget(p);
  const auto th = Clock::now();
  p.dump_sha256 = hashes.get();
  log(LogLevel::debug,
      "time: waiting for reads {:.2f} s, decode/validate {:.2f} s, overlaps {:.2f} s, SHA-256 wait {:.2f} s", wait_s,
      decode_s, overlap_s, std::chrono::duration<double>(Clock::now() - th).count());
  return p;
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
