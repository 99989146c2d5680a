#include "kvcal/eval/fidelity.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <variant>

#include <fmt/format.h>

#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/io/attention_dump.h"
#include "kvcal/io/entropy_calibration.h"
#include "kvcal/profile/entropy.h"
#include "kvcal/runtime/bundle.h"
#include "kvcal/runtime/hetero.h"
#include "kvcal/runtime/mask_cache.h"

namespace kvcal {
namespace {

namespace rt = kvcal::runtime;

enum class Kind { hex, evict, chess, hetero };

struct MethodSpec {
  std::string name;
  Kind kind = Kind::hex;
  rt::HexOptions hex;
  rt::ChessOptions chess;
};

using Tally = FidelityTally;

using Clock = std::chrono::steady_clock;

double norm(const float* x, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  return std::sqrt(s);
}

void add_error(Tally& t, const float* ref, const float* out, std::int64_t d) {
  double d2 = 0, ab = 0;
  for (std::int64_t c = 0; c < d; ++c) {
    const double e = static_cast<double>(ref[c]) - out[c];
    d2 += e * e;
    ab += static_cast<double>(ref[c]) * out[c];
  }
  const double na = norm(ref, d), nb = norm(out, d);
  t.rel_err.push_back(na > 0 ? std::sqrt(d2) / na : std::sqrt(d2));
  t.cos.push_back(na > 0 && nb > 0 ? ab / (na * nb) : (na == nb ? 1.0 : 0.0));
}

// fp16 attention of `group` queries over the listed tokens of one head.
void attend_tokens(const float* q, std::int64_t group, const rt::half_bits* k, const rt::half_bits* v,
                   const std::vector<std::int32_t>& tokens, std::int64_t d, float scale, float* out) {
  std::vector<rt::half_bits> ks, vs;
  ks.reserve(tokens.size() * static_cast<std::size_t>(d));
  vs.reserve(ks.capacity());
  for (const std::int32_t t : tokens) {
    ks.insert(ks.end(), k + t * d, k + (t + 1) * d);
    vs.insert(vs.end(), v + t * d, v + (t + 1) * d);
  }
  rt::attend_fp16(q, group, d, ks.data(), vs.data(), static_cast<std::int64_t>(tokens.size()), d, d, scale, out, d);
}

// The tokens CHESS lets one decode step attend, per step, and the fraction
// of pages that is, for one sample (selection is shared by all layers/heads).
struct ChessReplay {
  std::vector<std::vector<std::int32_t>> tokens;  // [T]
  std::vector<double> page_fraction;              // [T]
  std::int64_t selections = 0;
  std::int64_t summary_bytes = 0;  // page/chunk/grid vectors at the end (fp32)
};

ChessReplay replay_chess(const rt::ChessOptions& opt, const std::vector<std::vector<std::uint16_t>>& keys,
                         std::int64_t L, std::int64_t Hkv, std::int64_t S, std::int64_t N, std::int64_t T,
                         std::int64_t Dh, const rt::EntropyRule* rule, const std::vector<double>& entropy,
                         const std::vector<double>& varentropy) {
  const std::int64_t D = L * Hkv * Dh;
  rt::ChessIndex index(D, opt);
  std::vector<rt::half_bits> flat(static_cast<std::size_t>(D));
  const auto add_token = [&](std::int64_t t) {
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < Hkv; ++h)
        std::copy_n(keys[static_cast<std::size_t>(l)].data() + (h * S + t) * Dh, Dh, flat.begin() + (l * Hkv + h) * Dh);
    index.append(flat.data(), 1, D);
  };
  for (std::int64_t t = 0; t < N; ++t) add_token(t);
  ChessReplay r;
  std::vector<std::int32_t> selected = index.select();
  std::int64_t selected_at = index.pages();  // pages that existed when `selected` was chosen
  ++r.selections;
  std::unique_ptr<rt::ReselectionTrigger> trigger;
  if (rule) trigger = std::make_unique<rt::ReselectionTrigger>(*rule);
  const std::int64_t B = opt.page_size;
  for (std::int64_t t = 0; t < T; ++t) {
    add_token(N + t);
    const std::int64_t P = index.pages(), n = N + t + 1;
    std::vector<std::uint8_t> page(static_cast<std::size_t>(P), 0);
    for (const std::int32_t p : selected) page[static_cast<std::size_t>(p)] = 1;
    // Pages completed since the last selection were never scored: they stay.
    for (std::int64_t p = selected_at; p < P; ++p) page[static_cast<std::size_t>(p)] = 1;
    for (std::int64_t p = 0; p < std::min(P, opt.sink_pages); ++p) page[static_cast<std::size_t>(p)] = 1;
    for (std::int64_t p = std::max<std::int64_t>(0, P - opt.recent_pages); p < P; ++p)
      page[static_cast<std::size_t>(p)] = 1;
    std::vector<std::int32_t> tok;
    std::int64_t attended = 0;
    for (std::int64_t p = 0; p < P; ++p)
      if (page[static_cast<std::size_t>(p)]) {
        ++attended;
        for (std::int64_t i = p * B; i < (p + 1) * B; ++i) tok.push_back(static_cast<std::int32_t>(i));
      }
    for (std::int64_t i = P * B; i < n; ++i) tok.push_back(static_cast<std::int32_t>(i));  // the partial page
    const std::int64_t all_pages = P + (n > P * B ? 1 : 0);
    r.page_fraction.push_back(static_cast<double>(attended + (n > P * B ? 1 : 0)) / static_cast<double>(all_pages));
    r.tokens.push_back(std::move(tok));
    // The generated token's statistics; a page of them may call for a new selection.
    if (trigger && N + t < static_cast<std::int64_t>(entropy.size()) &&
        trigger->push(entropy[static_cast<std::size_t>(N + t)], varentropy[static_cast<std::size_t>(N + t)])) {
      selected = index.select();
      selected_at = index.pages();
      ++r.selections;
    }
  }
  r.summary_bytes = index.rows() * D * static_cast<std::int64_t>(sizeof(float));
  return r;
}

}  // namespace

// Everything the items of one dump share: the methods, the dump's shapes, the
// bundle, the expander mask and CHESS's re-selection rule.
struct FidelityEvaluator::Impl {
  std::string dump_path;
  FidelityOptions o;
  std::vector<MethodSpec> specs;
  std::unique_ptr<AttentionDump> dump;
  FidelityReport rep;  // the shapes and the mask's source; rows come from reduce()
  std::int64_t L = 0, Hq = 0, Hkv = 0, Dh = 0, group = 1;
  float scale = 1;
  std::unique_ptr<rt::Bundle> bundle;
  std::shared_ptr<const rt::Mask> mask;
  std::unique_ptr<rt::EntropyRule> rule;
  std::vector<FidelityItem> items;

  bool uses(Kind k) const {
    return std::any_of(specs.begin(), specs.end(), [&](const MethodSpec& m) { return m.kind == k; });
  }
  void setup();
  std::vector<Tally> eval_layer(const DumpSample& s, std::int64_t l, const std::vector<ChessReplay>& chess,
                                std::mutex& io_mutex, double& diff_out) const;
};

void FidelityEvaluator::Impl::setup() {
  KVCAL_CHECK(!o.methods.empty(), "no methods given");
  KVCAL_CHECK(std::isfinite(o.h2o_budget) && o.h2o_budget > 0 && o.h2o_budget <= 1,
              "--h2o-budget must be in (0, 1], got {}", o.h2o_budget);
  KVCAL_CHECK(o.drift_window >= 0 && o.drift_window <= 1 << 20, "--drift-window must be in [0, 2^20], got {}",
              o.drift_window);
  try {
    rt::check_options(o.hex);
    rt::check_options(o.chess);
    for (const std::string& name : o.methods) {
      KVCAL_CHECK(std::none_of(specs.begin(), specs.end(), [&](const MethodSpec& s) { return s.name == name; }),
                  "method '{}' is listed twice", name);
      MethodSpec m;
      m.name = name;
      if (name == "h2o-evict") {
        m.kind = Kind::evict;
      } else if (name == "hetero") {
        m.kind = Kind::hetero;
        KVCAL_CHECK(!o.bundle.empty(), "method 'hetero' needs --bundle (its head profile)");
      } else if (name.rfind("chess-", 0) == 0) {
        m.kind = Kind::chess;
        m.chess = rt::chess_preset(name.substr(6).c_str(), o.chess);
      } else {
        m.hex = rt::hex_method(name, o.hex);
      }
      specs.push_back(m);
    }
  } catch (const rt::Error& e) {
    fail("{}", e.what());
  }

  dump = std::make_unique<AttentionDump>(dump_path);
  rep.model = dump->model();
  rep.layers = dump->layers();
  rep.q_heads = dump->q_heads();
  rep.kv_heads = dump->kv_heads();
  rep.samples = static_cast<std::int64_t>(dump->samples().size());
  for (const DumpSample& s : dump->samples()) {
    const std::int64_t dh = dump->qkv_head_dim(s);
    KVCAL_CHECK(dh > 0,
                "{}: sample '{}' holds no queries/keys/values; record it with scripts/record_attention.py --qkv",
                dump_path, s.name);
    KVCAL_CHECK(rep.head_dim == 0 || rep.head_dim == dh, "{}: samples disagree on the head dim ({} and {})", dump_path,
                rep.head_dim, dh);
    rep.head_dim = dh;
  }
  L = rep.layers;
  Hq = rep.q_heads;
  Hkv = rep.kv_heads;
  Dh = rep.head_dim;
  group = Hq / Hkv;
  scale = 1.0f / std::sqrt(static_cast<float>(Dh));

  // The bundle (optional): masks first, the head profile for hetero, the thresholds for CHESS.
  try {
    // Sealed bundles are verified as always; old unsealed ones are read too:
    // kvcal runs each command in a child process, which contains a libhdf5
    // crash on a damaged file (an engine's process would not).
    rt::BundleOpenOptions bo;
    bo.allow_unverified = true;
    if (!o.bundle.empty()) bundle = rt::Bundle::open(o.bundle, bo);
  } catch (const rt::Error& e) {
    fail("{}", e.what());
  }
  if (std::any_of(specs.begin(), specs.end(),
                  [](const MethodSpec& m) { return m.kind == Kind::hex && m.hex.expander; })) {
    rt::MaskCacheOptions mo;
    mo.seed = o.mask_seed;
    rt::MaskCache cache(mo);
    try {
      if (bundle) cache.attach(bundle.get());
      mask = cache.get(o.hex.block, Dh, o.hex.sparsity);
    } catch (const rt::Error& e) {
      fail("expander mask {}x{} at sparsity {}: {} (choose another --sparsity or --block)", o.hex.block, Dh,
           o.hex.sparsity, e.what());
    }
    rep.mask_source = fmt::format("{}x{} d1={} ({})", mask->rows, mask->cols, mask->row_degree, mask->source);
    log(LogLevel::info, "expander mask {}x{}, {} per row, sigma2 {:.4f} <= bound {:.4f}: {}", mask->rows, mask->cols,
        mask->row_degree, mask->sigma2, mask->ramanujan_bound, mask->source);
  }
  if (uses(Kind::chess) && bundle) {
    const rt::EntropyThresholds& e = bundle->entropy();
    rule = std::make_unique<rt::EntropyRule>();
    rule->entropy_threshold = e.entropy;
    rule->varentropy_threshold = e.varentropy;
    rule->rule_both = e.rule_both;
    rule->varentropy_temporal = e.varentropy_temporal;
    rule->page_size = e.page_size;
    rule->unit_bits = e.unit_bits;
  } else if (uses(Kind::chess)) {
    log(LogLevel::info, "no --bundle: CHESS selects once after the prompt (no entropy thresholds to re-select with)");
  }
  if (uses(Kind::hetero)) {
    const rt::HeadTable& t = bundle->heads();
    KVCAL_CHECK(t.layers == L && t.kv_heads == Hkv,
                "the bundle's head profile is for {} layers x {} KV heads, the dump has {} x {}", t.layers, t.kv_heads,
                L, Hkv);
  }

  // The work items: one layer of one sample each, or whole samples when a
  // CHESS method is listed (its page selection reads every layer's keys of
  // the sample). Weight: the attention rows the item's decode steps read.
  const bool whole_samples = uses(Kind::chess);
  for (std::size_t i = 0; i < dump->samples().size(); ++i) {
    const DumpSample& s = dump->samples()[i];
    const std::int64_t S = s.prompt_len + s.steps, w = S * (s.steps + 1);
    if (whole_samples) {
      items.push_back({static_cast<std::int64_t>(i), 0, L, w * L});
    } else {
      for (std::int64_t l = 0; l < L; ++l) items.push_back({static_cast<std::int64_t>(i), l, l + 1, w});
    }
  }
}

// One layer of one sample: every method's tallies (CHESS's page selections
// of the sample in `chess`).
std::vector<Tally> FidelityEvaluator::Impl::eval_layer(const DumpSample& s, std::int64_t l,
                                                       const std::vector<ChessReplay>& chess, std::mutex& io_mutex,
                                                       double& diff_out) const {
  const std::int64_t N = s.prompt_len, T = s.steps, S = N + T;
  AttentionDump::QkvLayer qkv;
  LayerAttention att;
  {
    std::lock_guard<std::mutex> lock(io_mutex);  // libhdf5 is not thread-safe
    qkv = dump->read_qkv_layer(s, l);
    att = dump->decode_layer(dump->read_raw_layer(s, l), GqaReduce::mean, 2e-2, 1);
  }
  std::vector<float> q(qkv.queries.size());
  rt::halves_to_floats(qkv.queries.data(), static_cast<std::int64_t>(q.size()), q.data());
  KVCAL_CHECK(std::all_of(q.begin(), q.end(), [](float x) { return std::isfinite(x); }),
              "{}: sample '{}', layer {}: non-finite query", dump_path, s.name, l);
  const auto finite = [](const std::vector<std::uint16_t>& x) {
    return std::none_of(x.begin(), x.end(), [](std::uint16_t h) { return (h & 0x7c00u) == 0x7c00u; });
  };
  KVCAL_CHECK(finite(qkv.keys) && finite(qkv.values), "{}: sample '{}', layer {}: non-finite key or value", dump_path,
              s.name, l);
  const auto kh = [&](std::int64_t h) { return qkv.keys.data() + h * S * Dh; };
  const auto vh = [&](std::int64_t h) { return qkv.values.data() + h * S * Dh; };
  // Reference outputs and weights [T][Hq][...] over the fp16 keys/values,
  // and a check of the recording (the recorded rows are KV-head means).
  std::vector<float> ref(static_cast<std::size_t>(T * Hq * Dh));
  // The weights are kept per step only for CHESS's attention mass.
  const bool keep_probs = uses(Kind::chess);
  std::vector<std::vector<float>> probs(static_cast<std::size_t>(T));
  std::vector<float> step_probs;
  double diff = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const std::int64_t n = N + t + 1;
    auto& p = keep_probs ? probs[static_cast<std::size_t>(t)] : step_probs;
    p.resize(static_cast<std::size_t>(Hq * n));
    for (std::int64_t h = 0; h < Hkv; ++h) {
      float* ph = p.data() + h * group * n;
      rt::attend_fp16(q.data() + (t * Hq + h * group) * Dh, group, Dh, kh(h), vh(h), n, Dh, Dh, scale,
                      ref.data() + (t * Hq + h * group) * Dh, Dh, ph);
      const float* rec = att.decode.data() + (t * Hkv + h) * S;
      for (std::int64_t i = 0; i < n; ++i) {
        double m = 0;
        for (std::int64_t j = 0; j < group; ++j) m += ph[j * n + i];
        diff = std::max(diff, std::abs(m / static_cast<double>(group) - rec[i]));
      }
    }
  }
  // H2O's per-head scores from the KV-head rows: each query head gets its KV head's row.
  const auto per_query_head = [&](const float* kv_rows, std::int64_t stride, std::int64_t n) {
    std::vector<float> rows(static_cast<std::size_t>(Hq * n));
    for (std::int64_t j = 0; j < Hq; ++j)
      std::copy(kv_rows + (j / group) * stride, kv_rows + (j / group) * stride + n, rows.begin() + j * n);
    return rows;
  };
  std::vector<Tally> local(specs.size());
  std::vector<float> out(static_cast<std::size_t>(Hq * Dh));
  for (std::size_t mi = 0; mi < specs.size(); ++mi) {
    const MethodSpec& m = specs[mi];
    Tally& tally = local[mi];
    const auto m0 = Clock::now();
    if (m.kind == Kind::chess) {
      const ChessReplay& cr = chess[mi];
      for (std::int64_t t = 0; t < T; ++t) {
        const auto& tok = cr.tokens[static_cast<std::size_t>(t)];
        const std::int64_t n = N + t + 1;
        for (std::int64_t h = 0; h < Hkv; ++h) {
          attend_tokens(q.data() + (t * Hq + h * group) * Dh, group, kh(h), vh(h), tok, Dh, scale,
                        out.data() + h * group * Dh);
          const float* ph = probs[static_cast<std::size_t>(t)].data() + h * group * n;
          for (std::int64_t j = 0; j < group; ++j) {
            double mass = 0;
            for (const std::int32_t i : tok) mass += ph[j * n + i];
            tally.mass_sum += mass;
            ++tally.mass_n;
          }
        }
        for (std::int64_t j = 0; j < Hq; ++j) add_error(tally, ref.data() + (t * Hq + j) * Dh, out.data() + j * Dh, Dh);
        tally.selected_sum += cr.page_fraction[static_cast<std::size_t>(t)];
        ++tally.selected_n;
      }
    } else if (m.kind == Kind::hetero) {
      const rt::HeteroPlan plan =
          rt::make_hetero_plan(bundle->heads(), N, o.drift_window > 0 ? o.drift_window : bundle->heads().drift_window);
      // Token sets of every head: full heads everything; compressed heads
      // their top-l_i prompt tokens by their own prefill attention.
      std::vector<std::vector<std::int32_t>> kept(static_cast<std::size_t>(Hkv));
      std::vector<std::unique_ptr<rt::DriftMonitor>> monitor(static_cast<std::size_t>(Hkv));
      for (std::int64_t h = 0; h < Hkv; ++h) {
        const auto idx = static_cast<std::size_t>(l * Hkv + h);
        auto& set = kept[static_cast<std::size_t>(h)];
        if (plan.full[idx]) {
          for (std::int64_t i = 0; i < N; ++i) set.push_back(static_cast<std::int32_t>(i));
        } else {
          set = rt::top_indices(att.prefill.data() + h * N, N, plan.budget[idx]);
        }
        if (!plan.satellites[idx].empty()) {
          monitor[static_cast<std::size_t>(h)] =
              std::make_unique<rt::DriftMonitor>(plan.l_base, plan.window, plan.tau_drift);
          monitor[static_cast<std::size_t>(h)]->init(att.prefill.data() + h * N, N);
        }
      }
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t n = N + t + 1;
        for (auto& set : kept) set.push_back(static_cast<std::int32_t>(N + t));  // decode tokens stay
        for (std::int64_t h = 0; h < Hkv; ++h)
          attend_tokens(q.data() + (t * Hq + h * group) * Dh, group, kh(h), vh(h), kept[static_cast<std::size_t>(h)],
                        Dh, scale, out.data() + h * group * Dh);
        for (std::int64_t j = 0; j < Hq; ++j) add_error(tally, ref.data() + (t * Hq + j) * Dh, out.data() + j * Dh, Dh);
        // Pivots watch their (full) attention of this step; on drift their
        // satellites take the pivot's top-l_s tokens (prompt and decode so far).
        for (std::int64_t h = 0; h < Hkv; ++h) {
          auto& mon = monitor[static_cast<std::size_t>(h)];
          if (!mon) continue;
          const float* row = att.decode.data() + (t * Hkv + h) * S;
          const rt::DriftMonitor::Step st = mon->step(row, n);
          ++tally.drift_steps;
          if (!st.drift) continue;
          ++tally.drifts;
          for (rt::SatelliteFetch& f : rt::satellite_fetches(plan, l, h, row, n))
            kept[static_cast<std::size_t>(f.head)] = std::move(f.tokens);
        }
      }
      for (const auto& set : kept) tally.bytes += static_cast<std::int64_t>(set.size()) * Dh * 4;
      tally.fp16_bytes += Hkv * S * Dh * 4;
    } else {
      std::variant<std::monostate, rt::HexLayerCache, rt::H2OEvictCache> cache;
      if (m.kind == Kind::evict) {
        auto& c = cache.emplace<rt::H2OEvictCache>(Hkv, Hq, Dh, o.h2o_budget);
        const auto rows = per_query_head(att.prefill.data(), N, N);
        c.observe(rows.data(), N, N);
      } else {
        auto& c = cache.emplace<rt::HexLayerCache>(Hkv, Dh, m.hex, mask);
        c.observe(att.prefill.data(), Hkv, N, N);
      }
      const auto append = [&](std::int64_t from, std::int64_t n) {
        if (m.kind == Kind::evict)
          std::get<rt::H2OEvictCache>(cache).append(kh(0) + from * Dh, vh(0) + from * Dh, n, S * Dh, Dh);
        else
          std::get<rt::HexLayerCache>(cache).append(kh(0) + from * Dh, vh(0) + from * Dh, n, S * Dh, Dh);
      };
      append(0, N);
      for (std::int64_t t = 0; t < T; ++t) {
        append(N + t, 1);
        const float* qt = q.data() + t * Hq * Dh;
        const float* row = att.decode.data() + t * Hkv * S;
        if (m.kind == Kind::evict) {
          auto& c = std::get<rt::H2OEvictCache>(cache);
          c.attend(qt, scale, out.data());
          const auto rows = per_query_head(row, S, N + t + 1);
          c.observe(rows.data(), N + t + 1, N + t + 1);
        } else {
          auto& c = std::get<rt::HexLayerCache>(cache);
          c.attend(qt, Hq, scale, out.data());
          c.observe(row, Hkv, N + t + 1, S);
        }
        for (std::int64_t j = 0; j < Hq; ++j) add_error(tally, ref.data() + (t * Hq + j) * Dh, out.data() + j * Dh, Dh);
      }
      if (m.kind == Kind::evict) {
        tally.bytes = std::get<rt::H2OEvictCache>(cache).bytes();
        tally.fp16_bytes = std::get<rt::H2OEvictCache>(cache).fp16_bytes();
      } else {
        tally.bytes = std::get<rt::HexLayerCache>(cache).bytes();
        tally.fp16_bytes = std::get<rt::HexLayerCache>(cache).fp16_bytes();
      }
    }
    tally.seconds = std::chrono::duration<double>(Clock::now() - m0).count();
  }
  diff_out = diff;
  return local;
}

void FidelityTally::merge(const FidelityTally& o) {
  rel_err.insert(rel_err.end(), o.rel_err.begin(), o.rel_err.end());
  cos.insert(cos.end(), o.cos.begin(), o.cos.end());
  bytes += o.bytes;
  fp16_bytes += o.fp16_bytes;
  seconds += o.seconds;
  mass_sum += o.mass_sum;
  selected_sum += o.selected_sum;
  mass_n += o.mass_n;
  selected_n += o.selected_n;
  drift_steps += o.drift_steps;
  drifts += o.drifts;
}

FidelityReport eval_fidelity(const std::string& dump_path, const FidelityOptions& options) {
  const FidelityEvaluator ev(dump_path, options);
  return ev.reduce(ev.evaluate(0, ev.items().size()));
}

FidelityEvaluator::FidelityEvaluator(const std::string& dump_path, const FidelityOptions& options)
    : impl_(std::make_unique<Impl>()) {
  impl_->dump_path = dump_path;
  impl_->o = options;
  impl_->setup();
}

FidelityEvaluator::~FidelityEvaluator() = default;

const std::vector<FidelityItem>& FidelityEvaluator::items() const { return impl_->items; }
const FidelityReport& FidelityEvaluator::shape() const { return impl_->rep; }
std::size_t FidelityEvaluator::methods() const { return impl_->specs.size(); }

std::vector<FidelityPartial> FidelityEvaluator::evaluate(std::size_t begin, std::size_t end,
                                                         const std::function<void()>& between) const {
  const Impl& m = *impl_;
  KVCAL_CHECK(begin <= end && end <= m.items.size(), "items [{}, {}) of {}", begin, end, m.items.size());
  const auto& specs = m.specs;
  const std::string& dump_path = m.dump_path;
  const std::int64_t L = m.L, Dh = m.Dh, Hkv = m.Hkv;
  std::vector<FidelityPartial> out;
  std::mutex io_mutex, merge_mutex;
  const int threads = m.o.threads > 0 ? m.o.threads : omp_get_max_threads();
  // A sample's items in [begin, end) at a time: its layers run in parallel.
  for (std::size_t i = begin; i < end;) {
    if (between) between();
    const FidelityItem& first = m.items[i];
    std::size_t j = i;
    while (j < end && m.items[j].sample == first.sample) ++j;
    const std::int64_t lb = first.layer_begin, le = m.items[j - 1].layer_end;
    const DumpSample& s = m.dump->samples()[static_cast<std::size_t>(first.sample)];
    const auto t0 = Clock::now();
    const std::int64_t N = s.prompt_len, T = s.steps, S = N + T;
    // CHESS needs every layer's keys before any layer is evaluated (its items
    // are whole samples). Its selections' time and bytes are the sample's
    // first tallies, merged before its layers' as the single process does.
    std::vector<ChessReplay> chess(specs.size());
    std::vector<Tally> pre(specs.size());
    if (m.uses(Kind::chess)) {
      std::vector<std::vector<std::uint16_t>> keys(static_cast<std::size_t>(L));
      for (std::int64_t l = 0; l < L; ++l) keys[static_cast<std::size_t>(l)] = m.dump->read_qkv_layer(s, l).keys;
      std::vector<double> ent, var;
      if (m.rule) read_token_stats(dump_path, s.name, S, ent, var);
      for (std::size_t mi = 0; mi < specs.size(); ++mi)
        if (specs[mi].kind == Kind::chess) {
          const auto c0 = Clock::now();
          try {
            chess[mi] = replay_chess(specs[mi].chess, keys, L, Hkv, S, N, T, Dh, m.rule.get(), ent, var);
          } catch (const rt::Error& e) {
            fail("{}: sample '{}': {}", dump_path, s.name, e.what());
          }
          pre[mi].seconds += std::chrono::duration<double>(Clock::now() - c0).count();
          pre[mi].bytes += L * Hkv * S * Dh * 4 + chess[mi].summary_bytes;
          pre[mi].fp16_bytes += L * Hkv * S * Dh * 4;
        }
    }
    std::string error;
    // Each layer's tallies, kept apart and merged in layer order by reduce()
    // (not in the order layers finish), so the sums behind the means do not
    // depend on thread timing or on how the items were split.
    std::vector<std::vector<Tally>> layer_tallies(static_cast<std::size_t>(le - lb));
    std::vector<double> layer_diff(static_cast<std::size_t>(le - lb), 0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (std::int64_t l = lb; l < le; ++l) {
      try {
        const auto k = static_cast<std::size_t>(l - lb);
        layer_tallies[k] = m.eval_layer(s, l, chess, io_mutex, layer_diff[k]);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(merge_mutex);
        if (error.empty()) error = e.what();
      }
    }
    KVCAL_CHECK(error.empty(), "{}", error);
    if (m.uses(Kind::chess)) {
      // One item: the selections, then every layer.
      FidelityPartial p;
      p.parts.push_back(std::move(pre));
      for (auto& t : layer_tallies) p.parts.push_back(std::move(t));
      p.reference_max_abs_diff = *std::max_element(layer_diff.begin(), layer_diff.end());
      out.push_back(std::move(p));
    } else {
      for (std::size_t k = 0; k < layer_tallies.size(); ++k) {
        FidelityPartial p;
        p.parts.push_back(std::move(layer_tallies[k]));
        p.reference_max_abs_diff = layer_diff[k];
        out.push_back(std::move(p));
      }
    }
    for (std::size_t mi = 0; mi < specs.size(); ++mi)
      if (specs[mi].kind == Kind::chess)
        log(LogLevel::info, "sample '{}': {} selected {} time(s)", s.name, specs[mi].name, chess[mi].selections);
    if (lb == 0 && le == L) {
      log(LogLevel::info, "sample '{}': N = {}, T = {}, {} layers, {} methods ({:.2f} s)", s.name, N, T, L,
          specs.size(), std::chrono::duration<double>(Clock::now() - t0).count());
    } else {
      log(LogLevel::info, "sample '{}': N = {}, T = {}, layers {} to {}, {} methods ({:.2f} s)", s.name, N, T, lb,
          le - 1, specs.size(), std::chrono::duration<double>(Clock::now() - t0).count());
    }
    i = j;
  }
  return out;
}

FidelityReport FidelityEvaluator::reduce(const std::vector<FidelityPartial>& all) const {
  const Impl& m = *impl_;
  const auto& specs = m.specs;
  KVCAL_CHECK(all.size() == m.items.size(), "{} item results for {} items", all.size(), m.items.size());
  FidelityReport rep = m.rep;
  std::vector<Tally> total(specs.size());
  double ref_diff = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::int64_t layers = m.items[i].layer_end - m.items[i].layer_begin;
    const std::size_t parts = static_cast<std::size_t>(layers) + (m.uses(Kind::chess) ? 1 : 0);
    KVCAL_CHECK(all[i].parts.size() == parts, "item {}: {} tallies, expected {}", i, all[i].parts.size(), parts);
    for (const std::vector<Tally>& part : all[i].parts) {
      KVCAL_CHECK(part.size() == specs.size(), "item {}: tallies of {} methods, expected {}", i, part.size(),
                  specs.size());
      for (std::size_t mi = 0; mi < specs.size(); ++mi) total[mi].merge(part[mi]);
    }
    ref_diff = std::max(ref_diff, all[i].reference_max_abs_diff);
  }
  rep.reference_max_abs_diff = ref_diff;
  if (ref_diff > 2e-2)
    log(LogLevel::warn,
        "attention recomputed from the recorded queries and keys differs from the recorded weights by up to {:.3g}"
        " (a different softmax scale or positional encoding?); errors are measured against the recomputed one",
        ref_diff);
  for (std::size_t mi = 0; mi < specs.size(); ++mi) {
    const Tally& g = total[mi];
    FidelityRow r;
    r.method = specs[mi].name;
    r.queries = static_cast<std::int64_t>(g.rel_err.size());
    r.kv_size_pct = g.fp16_bytes > 0 ? 100.0 * static_cast<double>(g.bytes) / static_cast<double>(g.fp16_bytes) : 0;
    double se = 0, sc = 0;
    for (double v : g.rel_err) se += v;
    for (double v : g.cos) sc += v;
    r.rel_err_mean = r.queries > 0 ? se / static_cast<double>(r.queries) : 0;
    r.cos_mean = r.queries > 0 ? sc / static_cast<double>(r.queries) : 0;
    r.rel_err_p99 = r.queries > 0 ? percentile(g.rel_err, 99) : 0;
    r.seconds = g.seconds;
    if (specs[mi].kind == Kind::chess) {
      r.selected_pct = g.selected_n > 0 ? 100.0 * g.selected_sum / static_cast<double>(g.selected_n) : 0;
      r.attn_mass = g.mass_n > 0 ? g.mass_sum / static_cast<double>(g.mass_n) : 0;
    }
    if (specs[mi].kind == Kind::hetero)
      r.trigger_rate = g.drift_steps > 0 ? static_cast<double>(g.drifts) / static_cast<double>(g.drift_steps) : 0;
    rep.rows.push_back(r);
  }
  return rep;
}

std::string fidelity_csv(const FidelityReport& rep) {
  std::string out = "method,kv_size_pct,rel_err_mean,rel_err_p99,cos_mean,selected_pct,attn_mass,trigger_rate\n";
  const auto opt = [](double v, const char* f) { return v < 0 ? std::string() : fmt::format(fmt::runtime(f), v); };
  for (const FidelityRow& r : rep.rows)
    out += fmt::format("{},{:.4f},{:.6g},{:.6g},{:.8f},{},{},{}\n", r.method, r.kv_size_pct, r.rel_err_mean,
                       r.rel_err_p99, r.cos_mean, opt(r.selected_pct, "{:.4f}"), opt(r.attn_mass, "{:.6f}"),
                       opt(r.trigger_rate, "{:.6f}"));
  return out;
}

}  // namespace kvcal
