#include "kvcal/profile/heads.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <numeric>

#include <boost/graph/adjacency_list.hpp>

#include "kvcal/core/error.h"

namespace kvcal {

const char* to_string(GqaReduce r) { return r == GqaReduce::max ? "max" : "mean"; }
GqaReduce parse_gqa_reduce(const std::string& name) {
  if (name == "mean") return GqaReduce::mean;
  if (name == "max") return GqaReduce::max;
  fail("unknown GQA reduction '{}': use mean or max", name);
}

const char* to_string(TaxonomyOrder o) { return o == TaxonomyOrder::appendix ? "appendix" : "similar-first"; }
TaxonomyOrder parse_taxonomy_order(const std::string& name) {
  if (name == "appendix") return TaxonomyOrder::appendix;
  if (name == "similar-first") return TaxonomyOrder::similar_first;
  fail("unknown taxonomy order '{}': use appendix or similar-first", name);
}

const char* to_string(HeadRole r) {
  switch (r) {
    case HeadRole::anchor:
      return "anchor";
    case HeadRole::volatile_head:
      return "volatile";
    case HeadRole::pivot:
      return "pivot";
    case HeadRole::satellite:
      return "satellite";
  }
  return "unknown";
}

void average_pool(const float* row, std::int64_t len, std::int64_t kernel, float* out) {
  if (kernel <= 1) {
    std::copy(row, row + len, out);
    return;
  }
  const std::int64_t left = kernel / 2, right = kernel - 1 - left;
  // Running window sum in double; each output averages the in-row entries.
  double sum = 0;
  std::int64_t lo = 0, hi = -1;  // current window [lo, hi]
  for (std::int64_t i = 0; i < len; ++i) {
    const std::int64_t want_hi = std::min(len - 1, i + right), want_lo = std::max<std::int64_t>(0, i - left);
    while (hi < want_hi) sum += row[++hi];
    while (lo < want_lo) sum -= row[lo++];
    out[i] = static_cast<float>(sum / static_cast<double>(hi - lo + 1));
  }
}

namespace {

// Selects the k largest (ties: lower index) into idx[0..k), unordered.
void select_top(const float* v, std::int64_t len, std::int64_t k, std::vector<std::int32_t>& idx) {
  idx.resize(static_cast<std::size_t>(len));
  std::iota(idx.begin(), idx.end(), 0);
  if (k >= len) return;
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(),
                   [v](std::int32_t a, std::int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
}

inline std::int64_t and_count(const std::uint64_t* a, const std::uint64_t* b, std::int64_t words) {
  std::int64_t c = 0;
  for (std::int64_t w = 0; w < words; ++w) c += std::popcount(a[w] & b[w]);
  return c;
}

}  // namespace

std::vector<std::int32_t> top_k(const float* row, std::int64_t len, std::int64_t k) {
  k = std::clamp<std::int64_t>(k, 0, len);
  std::vector<std::int32_t> idx;
  select_top(row, len, k, idx);
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

double overlap_coefficient(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b) {
  if (a.empty() || b.empty()) return 0.0;
  std::size_t i = 0, j = 0, common = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i] == b[j]) {
      ++common, ++i, ++j;
    } else if (a[i] < b[j]) {
      ++i;
    } else {
      ++j;
    }
  }
  return static_cast<double>(common) / static_cast<double>(std::min(a.size(), b.size()));
}

double median(std::vector<double> v) {
  KVCAL_CHECK(!v.empty(), "median of an empty set");
  const std::size_t m = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + m, v.end());
  if (v.size() % 2 == 1) return v[m];
  const double upper = v[m];
  const double lower = *std::max_element(v.begin(), v.begin() + m);
  return 0.5 * (lower + upper);
}

std::int64_t topk_for_row(std::int64_t len, const OverlapOptions& o) {
  if (o.topk_frac > 0) return std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(o.topk_frac * len)), 1, len);
  return std::clamp<std::int64_t>(o.topk, 1, len);
}

std::vector<float> reduce_gqa(const std::vector<float>& rows, std::int64_t outer, std::int64_t hq, std::int64_t hkv,
                              std::int64_t len, GqaReduce how) {
  KVCAL_CHECK(hkv > 0 && hq % hkv == 0, "{} query heads do not split into {} KV heads", hq, hkv);
  if (hq == hkv) return rows;
  const std::int64_t group = hq / hkv;
  std::vector<float> out(static_cast<std::size_t>(outer * hkv * len));
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t g = 0; g < hkv; ++g) {
      float* dst = out.data() + (o * hkv + g) * len;
      const float* first = rows.data() + (o * hq + g * group) * len;
      std::copy(first, first + len, dst);
      for (std::int64_t m = 1; m < group; ++m) {
        const float* src = first + m * len;
        if (how == GqaReduce::max) {
          for (std::int64_t i = 0; i < len; ++i) dst[i] = std::max(dst[i], src[i]);
        } else {
          for (std::int64_t i = 0; i < len; ++i) dst[i] += src[i];
        }
      }
      if (how == GqaReduce::mean) {
        const float inv = 1.0f / static_cast<float>(group);
        for (std::int64_t i = 0; i < len; ++i) dst[i] *= inv;
      }
    }
  }
  return out;
}

LayerOverlaps layer_overlaps(const LayerAttention& a, const OverlapOptions& o) {
  const std::int64_t H = a.heads, n = a.n, T = a.steps, width = n + T;
  KVCAL_CHECK(H >= 1 && n >= 1, "a layer needs at least one head and one prompt token");
  KVCAL_CHECK(T >= 1, "stability needs at least one decode step (the sample has none)");
  KVCAL_CHECK(static_cast<std::int64_t>(a.prefill.size()) == H * n &&
                  static_cast<std::int64_t>(a.decode.size()) == T * H * width,
              "layer data has the wrong size");
  const std::int64_t words = (width + 63) / 64;
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();

  // Prefill sets, one bitset per head.
  std::vector<std::uint64_t> pre(static_cast<std::size_t>(H * words), 0);
  std::vector<std::int64_t> pre_k(static_cast<std::size_t>(H));
  {
    std::vector<float> pooled(static_cast<std::size_t>(n));
    std::vector<std::int32_t> idx;
    for (std::int64_t h = 0; h < H; ++h) {
      average_pool(a.prefill.data() + h * n, n, o.pool_kernel, pooled.data());
      const std::int64_t k = topk_for_row(n, o);
      select_top(pooled.data(), n, k, idx);
      for (std::int64_t i = 0; i < k; ++i) pre[h * words + idx[i] / 64] |= std::uint64_t{1} << (idx[i] % 64);
      pre_k[h] = k;
    }
  }

  // Per step: the sets of every head, their overlap with prefill and with each other.
  std::vector<double> stab(static_cast<std::size_t>(T * H)), pair(static_cast<std::size_t>(T * H * H));
#pragma omp parallel num_threads(threads) if (T * H * width > 100000)
  {
    std::vector<float> pooled(static_cast<std::size_t>(width));
    std::vector<std::int32_t> idx;
    std::vector<std::uint64_t> sets(static_cast<std::size_t>(H * words));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t len = n + t + 1, k = topk_for_row(len, o);
      std::fill(sets.begin(), sets.end(), 0);
      for (std::int64_t h = 0; h < H; ++h) {
        average_pool(a.decode.data() + (t * H + h) * width, len, o.pool_kernel, pooled.data());
        select_top(pooled.data(), len, k, idx);
        std::uint64_t* s = sets.data() + h * words;
        for (std::int64_t i = 0; i < k; ++i) s[idx[i] / 64] |= std::uint64_t{1} << (idx[i] % 64);
        stab[t * H + h] = static_cast<double>(and_count(s, pre.data() + h * words, words)) /
                          static_cast<double>(std::min(k, pre_k[h]));
      }
      for (std::int64_t h = 0; h < H; ++h) {
        pair[(t * H + h) * H + h] = 1.0;
        for (std::int64_t g = h + 1; g < H; ++g) {
          const double ov = static_cast<double>(and_count(sets.data() + h * words, sets.data() + g * words, words)) /
                            static_cast<double>(k);
          pair[(t * H + h) * H + g] = pair[(t * H + g) * H + h] = ov;
        }
      }
    }
  }

  LayerOverlaps out;
  out.stability.resize(static_cast<std::size_t>(H));
  out.similarity.resize(static_cast<std::size_t>(H));
  out.pairwise.resize(static_cast<std::size_t>(H * H));
  std::vector<double> series(static_cast<std::size_t>(T));
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t t = 0; t < T; ++t) series[t] = stab[t * H + h];
    out.stability[h] = static_cast<float>(median(series));
    for (std::int64_t t = 0; t < T; ++t) {
      double best = 0;
      for (std::int64_t g = 0; g < H; ++g) {
        if (g != h) best = std::max(best, pair[(t * H + h) * H + g]);
      }
      series[t] = best;
    }
    out.similarity[h] = H > 1 ? static_cast<float>(median(series)) : 0.0f;
    for (std::int64_t g = 0; g < H; ++g) {
      for (std::int64_t t = 0; t < T; ++t) series[t] = pair[(t * H + h) * H + g];
      out.pairwise[h * H + g] = static_cast<float>(median(series));
    }
  }
  return out;
}

LayerTaxonomy classify_layer(const std::vector<float>& stability, const std::vector<float>& similarity,
                             const std::vector<float>& pairwise, std::int64_t H, const TaxonomyOptions& opt) {
  KVCAL_CHECK(static_cast<std::int64_t>(stability.size()) == H && static_cast<std::int64_t>(similarity.size()) == H &&
                  static_cast<std::int64_t>(pairwise.size()) == H * H,
              "classify_layer: sizes do not match {} heads", H);
  using Graph = boost::adjacency_list<boost::vecS, boost::vecS, boost::undirectedS>;
  Graph g(static_cast<std::size_t>(H));
  auto eligible = [&](std::int64_t h) { return opt.order == TaxonomyOrder::appendix || similarity[h] >= opt.tau_sim; };
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t k = h + 1; k < H; ++k) {
      // An edge needs both directions of the (symmetric) pairwise overlap.
      if (eligible(h) && eligible(k) && pairwise[h * H + k] >= opt.tau_sim && pairwise[k * H + h] >= opt.tau_sim) {
        boost::add_edge(static_cast<std::size_t>(h), static_cast<std::size_t>(k), g);
      }
    }
  }
  LayerTaxonomy out;
  out.role.assign(static_cast<std::size_t>(H), HeadRole::anchor);
  out.pivot.assign(static_cast<std::size_t>(H), -1);
  std::vector<bool> assigned(static_cast<std::size_t>(H), false);
  for (;;) {
    std::int64_t best = -1, best_degree = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      if (assigned[h]) continue;
      std::int64_t degree = 0;
      for (auto [e, end] = boost::out_edges(static_cast<std::size_t>(h), g); e != end; ++e) {
        degree += !assigned[boost::target(*e, g)];
      }
      if (degree > best_degree) best = h, best_degree = degree;  // strict: ties keep the lowest index
    }
    if (best < 0) break;
    assigned[best] = true;
    out.role[best] = HeadRole::pivot;
    out.pivot[best] = static_cast<std::int32_t>(best);
    for (auto [e, end] = boost::out_edges(static_cast<std::size_t>(best), g); e != end; ++e) {
      const auto s = boost::target(*e, g);
      if (assigned[s]) continue;
      assigned[s] = true;
      out.role[s] = HeadRole::satellite;
      out.pivot[s] = static_cast<std::int32_t>(best);
    }
  }
  for (std::int64_t h = 0; h < H; ++h) {
    if (!assigned[h]) out.role[h] = stability[h] >= opt.tau_stable ? HeadRole::anchor : HeadRole::volatile_head;
  }
  return out;
}

std::vector<float> allocate_budgets(const std::vector<HeadRole>& roles, const std::vector<float>& stability,
                                    const BudgetOptions& opt) {
  KVCAL_CHECK(std::isfinite(opt.budget) && opt.budget > 0 && opt.budget <= 1,
              "budget {} must lie in (0, 1]: it is the mean cache ratio over all heads", opt.budget);
  KVCAL_CHECK(roles.size() == stability.size(), "allocate_budgets: sizes differ");
  const auto total = static_cast<double>(roles.size());
  std::vector<std::size_t> comp;
  for (std::size_t i = 0; i < roles.size(); ++i) {
    if (roles[i] == HeadRole::anchor || roles[i] == HeadRole::satellite) comp.push_back(i);
  }
  const double full = total - static_cast<double>(comp.size());
  // Eq. 7: N_comp * L_base = (rho N - N_full) L; in ratios of L: rho N - N_full.
  const double pool = opt.budget * total - full;
  std::vector<float> ratio(roles.size(), 1.0f);
  if (comp.empty()) return ratio;
  KVCAL_CHECK(pool > 1e-9 * total,
              "budget {} is too small: {} of {} heads keep their full cache (pivots and volatile heads), so the "
              "budget must exceed {:.4f} to leave the {} compressed heads any cache; raise --budget, or lower "
              "--tau-stable (fewer volatile heads)",
              opt.budget, full, total, full / total, comp.size());
  // Eq. 8 with w = 1 / S_stable, then water filling at the cap of 1.
  std::vector<double> w(comp.size()), r(comp.size(), 0.0);
  for (std::size_t j = 0; j < comp.size(); ++j) {
    w[j] = 1.0 / std::max(static_cast<double>(stability[comp[j]]), opt.stability_floor);
  }
  std::vector<bool> capped(comp.size(), false);
  double remaining = std::max(pool, 0.0);
  for (;;) {
    double wsum = 0;
    for (std::size_t j = 0; j < comp.size(); ++j) wsum += capped[j] ? 0.0 : w[j];
    if (wsum == 0) break;
    bool newly_capped = false;
    for (std::size_t j = 0; j < comp.size(); ++j) {
      if (capped[j]) continue;
      r[j] = remaining * w[j] / wsum;
      if (r[j] > 1.0) newly_capped = true;
    }
    if (!newly_capped) break;
    for (std::size_t j = 0; j < comp.size(); ++j) {
      if (!capped[j] && r[j] > 1.0) {
        capped[j] = true;
        r[j] = 1.0;
        remaining -= 1.0;
      }
    }
  }
  for (std::size_t j = 0; j < comp.size(); ++j) ratio[comp[j]] = static_cast<float>(std::min(r[j], 1.0));
  return ratio;
}

}  // namespace kvcal
