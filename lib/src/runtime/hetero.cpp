#include "kvcal/runtime/hetero.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kvcal/runtime/bundle.h"
#include "runtime/checks.h"

namespace kvcal::runtime {

using detail::require;

std::vector<std::int32_t> top_indices(const float* values, std::int64_t n, std::int64_t k) {
  require(n >= 0 && k >= 0, "negative size");
  k = std::min(k, n);
  std::vector<std::int32_t> idx(static_cast<std::size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  const auto better = [&](std::int32_t a, std::int32_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), better);
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

HeteroPlan make_hetero_plan(const HeadTable& t, std::int64_t context, std::int64_t window) {
  require(context >= 1, "context must be at least one token");
  require(window >= 1, "drift window must be at least one step");
  const std::int64_t n = t.layers * t.kv_heads;
  require(t.layers >= 1 && t.kv_heads >= 1 && static_cast<std::int64_t>(t.role.size()) == n &&
              static_cast<std::int64_t>(t.pivot.size()) == n && static_cast<std::int64_t>(t.budget_ratio.size()) == n,
          "head table sizes do not match layers x kv_heads");
  require(std::isfinite(t.tau_drift), "tau_drift is not finite");
  HeteroPlan p;
  p.layers = t.layers;
  p.kv_heads = t.kv_heads;
  p.context = context;
  p.tau_drift = t.tau_drift;
  p.window = window;
  p.full.resize(static_cast<std::size_t>(n));
  p.budget.resize(static_cast<std::size_t>(n));
  p.pivot.assign(static_cast<std::size_t>(n), -1);
  p.satellites.resize(static_cast<std::size_t>(n));
  for (std::int64_t l = 0; l < t.layers; ++l)
    for (std::int64_t h = 0; h < t.kv_heads; ++h) {
      const auto i = static_cast<std::size_t>(l * t.kv_heads + h);
      const Role r = t.role[i];
      require(r == Role::anchor || r == Role::volatile_head || r == Role::pivot || r == Role::satellite,
              "head role out of range");
      const bool full = r == Role::pivot || r == Role::volatile_head;
      p.full[i] = full;
      const double ratio = t.budget_ratio[i];
      require(std::isfinite(ratio) && ratio > 0 && ratio <= 1, "budget ratio out of (0, 1]");
      if (full) {
        p.budget[i] = context;
      } else {
        p.budget[i] = std::clamp<std::int64_t>(std::llround(ratio * static_cast<double>(context)), 1, context);
        ++p.compressed_heads;
        p.budget_sum += p.budget[i];
      }
      if (r == Role::satellite) {
        const std::int32_t pv = t.pivot[i];
        require(pv >= 0 && pv < t.kv_heads && pv != h, "satellite's pivot out of range");
        require(t.role[static_cast<std::size_t>(l * t.kv_heads + pv)] == Role::pivot,
                "a satellite's pivot is not a pivot head");
        p.pivot[i] = pv;
        p.satellites[static_cast<std::size_t>(l * t.kv_heads + pv)].push_back(static_cast<std::int32_t>(h));
      }
    }
  p.l_base = p.compressed_heads > 0
                 ? std::max<std::int64_t>(
                       1, std::llround(static_cast<double>(p.budget_sum) / static_cast<double>(p.compressed_heads)))
                 : context;
  return p;
}

std::vector<SatelliteFetch> satellite_fetches(const HeteroPlan& plan, std::int64_t layer, std::int64_t pivot,
                                              const float* attention, std::int64_t n) {
  require(layer >= 0 && layer < plan.layers && pivot >= 0 && pivot < plan.kv_heads, "layer or head out of range");
  require(n >= 1, "empty attention row");
  std::vector<SatelliteFetch> out;
  for (const std::int32_t s : plan.satellites[static_cast<std::size_t>(layer * plan.kv_heads + pivot)]) {
    SatelliteFetch f;
    f.head = s;
    f.tokens = top_indices(attention, n, plan.budget[static_cast<std::size_t>(layer * plan.kv_heads + s)]);
    out.push_back(std::move(f));
  }
  return out;
}

DriftMonitor::DriftMonitor(std::int64_t l_base, std::int64_t window, double tau_drift)
    : l_base_(l_base), window_(window), tau_(tau_drift) {
  require(l_base >= 1 && window >= 1 && std::isfinite(tau_drift), "bad drift monitor parameters");
}

void DriftMonitor::init(const float* prefill, std::int64_t n) {
  require(n >= 1, "empty prefill attention");
  base_ = top_indices(prefill, n, l_base_);
  recent_.clear();
  steps_ = drifts_ = 0;
}

DriftMonitor::Step DriftMonitor::step(const float* attention, std::int64_t n) {
  require(!base_.empty(), "drift monitor used before init");
  const std::vector<std::int32_t> cur = top_indices(attention, n, l_base_);
  std::vector<std::int32_t> both;
  std::set_intersection(cur.begin(), cur.end(), base_.begin(), base_.end(), std::back_inserter(both));
  Step s;
  s.overlap = static_cast<double>(both.size()) / static_cast<double>(l_base_);
  recent_.push_back(s.overlap);
  ++steps_;
  if (steps_ % window_ == 0) {
    std::vector<double> w(recent_.end() - window_, recent_.end());
    std::sort(w.begin(), w.end());
    const auto m = w.size();
    s.median = m % 2 ? w[m / 2] : 0.5 * (w[m / 2 - 1] + w[m / 2]);
    s.checked = true;
    s.drift = s.median < tau_;
    if (s.drift) {
      base_ = cur;
      ++drifts_;
    }
    recent_.clear();
  }
  return s;
}

}  // namespace kvcal::runtime
