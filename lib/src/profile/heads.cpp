#include "kvcal/profile/heads.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>

#include <boost/graph/adjacency_list.hpp>

#include "core/simd_clones.h"
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

KVCAL_SIMD_CLONES void average_pool(const float* row, std::int64_t len, std::int64_t kernel, float* out) {
  if (kernel <= 1) {
    std::copy(row, row + len, out);
    return;
  }
  const std::int64_t left = kernel / 2, right = kernel - 1 - left;
  // Each output is the double sum of the in-row entries of its window, in
  // order, over their count (so a border averages fewer entries).
  auto window = [&](std::int64_t i) {
    const std::int64_t lo = std::max<std::int64_t>(0, i - left), hi = std::min(len - 1, i + right);
    double sum = 0;
    for (std::int64_t j = lo; j <= hi; ++j) sum += row[j];
    return std::max(0.0f, static_cast<float>(sum / static_cast<double>(hi - lo + 1)));
  };
  const std::int64_t begin = std::min(left, len), end = std::max(begin, len - right);
  for (std::int64_t i = 0; i < begin; ++i) out[i] = window(i);
  std::int64_t i = begin;
  if (kernel <= 64) {
    // Interior, eight outputs at a time (same sums, same order).
    typedef float vf8 __attribute__((vector_size(32)));
    typedef double vd8 __attribute__((vector_size(64)));
    const double count = static_cast<double>(kernel);
    for (; i + 8 <= end; i += 8) {
      vd8 acc{};
      for (std::int64_t j = 0; j < kernel; ++j) {
        vf8 x;
        std::memcpy(&x, row + i - left + j, sizeof x);
        acc += __builtin_convertvector(x, vd8);
      }
      const vf8 r = __builtin_convertvector(acc / count, vf8);
      std::memcpy(out + i, &r, sizeof r);
    }
  }
  for (; i < len; ++i) out[i] = window(i);
}

namespace {

// Marks the k largest of v[0, len) in the bitset `bits` (ties: lower index
// first) and returns nothing else. Values are pooled attention scores: finite
// and >= 0, so their IEEE bits order like the values. A radix select: a
// histogram of the top 11 magnitude bits finds the bucket holding the k-th largest, an
// nth_element among that bucket's keys finds it exactly, and one ordered scan
// marks everything above it plus the first ties. `scratch` is reused.
void select_top(const float* v, std::int64_t len, std::int64_t k, std::uint64_t* bits,
                std::vector<std::uint32_t>& scratch) {
  if (k <= 0) return;
  if (k >= len) {
    for (std::int64_t i = 0; i < len; ++i) bits[i / 64] |= std::uint64_t{1} << (i % 64);
    return;
  }
  constexpr int kShift = 20;  // 2048 buckets of the top 11 magnitude bits
  std::uint32_t hist[2048] = {};
  // Keys: the bits without the sign, so that -0.0 ranks as 0.
  const auto* raw = reinterpret_cast<const std::uint32_t*>(v);
  constexpr std::uint32_t kAbs = 0x7fffffffu;
  for (std::int64_t i = 0; i < len; ++i) ++hist[(raw[i] & kAbs) >> kShift];
  std::int64_t above = 0;
  int bucket = 2047;
  for (; bucket > 0 && above + hist[bucket] < static_cast<std::uint64_t>(k); --bucket) above += hist[bucket];
  // The k-th largest is the (k - above)-th largest key inside `bucket`.
  scratch.clear();
  for (std::int64_t i = 0; i < len; ++i) {
    if (static_cast<int>((raw[i] & kAbs) >> kShift) == bucket) scratch.push_back(raw[i] & kAbs);
  }
  const std::int64_t rank = k - above;  // 1-based within the bucket
  std::nth_element(scratch.begin(), scratch.begin() + (rank - 1), scratch.end(), std::greater<>());
  const std::uint32_t threshold = scratch[rank - 1];
  std::int64_t greater = above;
  for (std::uint32_t key : scratch) greater += key > threshold;
  // Everything above the threshold, 64 positions per word...
  const std::int64_t full = len / 64;
  for (std::int64_t w = 0; w < full; ++w) {
    std::uint64_t word = 0;
    for (int b = 0; b < 64; ++b) word |= static_cast<std::uint64_t>((raw[w * 64 + b] & kAbs) > threshold) << b;
    bits[w] |= word;
  }
  for (std::int64_t i = full * 64; i < len; ++i) {
    bits[i / 64] |= static_cast<std::uint64_t>((raw[i] & kAbs) > threshold) << (i % 64);
  }
  // ...then the first ties, in position order.
  std::int64_t ties = k - greater;
  for (std::int64_t i = 0; i < len && ties > 0; ++i) {
    if ((raw[i] & kAbs) == threshold) {
      bits[i / 64] |= std::uint64_t{1} << (i % 64);
      --ties;
    }
  }
}

inline std::int64_t and_count(const std::uint64_t* a, const std::uint64_t* b, std::int64_t words) {
  std::int64_t c = 0;
  for (std::int64_t w = 0; w < words; ++w) c += std::popcount(a[w] & b[w]);
  return c;
}

}  // namespace

std::vector<std::int32_t> top_k(const float* row, std::int64_t len, std::int64_t k) {
  k = std::clamp<std::int64_t>(k, 0, len);
  for (std::int64_t i = 0; i < len; ++i) {
    KVCAL_CHECK(std::isfinite(row[i]) && row[i] >= 0, "top_k: value {} at {} is not finite and >= 0", row[i], i);
  }
  std::vector<std::uint64_t> bits(static_cast<std::size_t>((len + 63) / 64), 0);
  std::vector<std::uint32_t> scratch;
  select_top(row, len, k, bits.data(), scratch);
  std::vector<std::int32_t> idx;
  for (std::int64_t i = 0; i < len; ++i) {
    if ((bits[i / 64] >> (i % 64)) & 1) idx.push_back(static_cast<std::int32_t>(i));
  }
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
    std::vector<std::uint32_t> scratch;
    for (std::int64_t h = 0; h < H; ++h) {
      average_pool(a.prefill.data() + h * n, n, o.pool_kernel, pooled.data());
      const std::int64_t k = topk_for_row(n, o);
      select_top(pooled.data(), n, k, pre.data() + h * words, scratch);
      pre_k[h] = k;
    }
  }

  // Per step: the sets of every head, their overlap with prefill and with each other.
  std::vector<double> stab(static_cast<std::size_t>(T * H)), pair(static_cast<std::size_t>(T * H * H));
#pragma omp parallel num_threads(threads) if (T * H * width > 100000)
  {
    std::vector<float> pooled(static_cast<std::size_t>(width));
    std::vector<std::uint32_t> scratch;
    std::vector<std::uint64_t> sets(static_cast<std::size_t>(H * words));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t len = n + t + 1, k = topk_for_row(len, o);
      std::fill(sets.begin(), sets.end(), 0);
      for (std::int64_t h = 0; h < H; ++h) {
        average_pool(a.decode.data() + (t * H + h) * width, len, o.pool_kernel, pooled.data());
        std::uint64_t* s = sets.data() + h * words;
        select_top(pooled.data(), len, k, s, scratch);
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
