// generate_masks(): the body of `kvcal mask-gen` (the CLI only parses).
#include "kvcal/io/mask_gen.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <optional>

#include <fmt/format.h>

#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/graph/generate.h"
#include "kvcal/graph/lps.h"

namespace kvcal {
namespace {

using Clock = std::chrono::steady_clock;

std::string seconds(double s) { return s < 1 ? fmt::format("{:.0f} ms", s * 1e3) : fmt::format("{:.2f} s", s); }
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Attempt {
  CsrMask mask;
  Certificate certificate;
  std::uint64_t seed = 0;
};

// Draws candidates from `make(seed)` with successive seeds until one is
// certified Ramanujan (and passes `accept`), up to `tries`; returns it, or
// the best uncertified one when allowed. Advances `seed` past what it used.
Attempt certified_try(const std::string& what, std::int64_t tries, std::uint64_t& seed, bool allow_best,
                      const CertifyOptions& copt, const std::function<CsrMask(std::uint64_t)>& make,
                      const std::function<bool(const CsrMask&)>& accept, const std::string& advice) {
  std::optional<Attempt> best;
  for (std::int64_t t = 0; t < tries; ++t, ++seed) {
    const auto t0 = Clock::now();
    Attempt a;
    a.seed = seed;
    a.mask = make(seed);
    if (!accept(a.mask)) {
      log(LogLevel::info, "{}: seed {} repeats an earlier mask; next seed", what, seed);
      continue;
    }
    a.certificate = certify(a.mask, copt);
    const Certificate& c = a.certificate;
    if (c.ramanujan) {
      log(LogLevel::info, "{}: seed {}: sigma2 = {:.6f} <= tau = {:.6f} ({} certificate, margin {:.4g}) in {}", what,
          seed, c.sigma2, c.ramanujan_bound, to_string(c.kind), c.margin, seconds(since(t0)));
      ++seed;
      return a;
    }
    log(LogLevel::info, "{}: seed {}: not certified Ramanujan (sigma2 = {:.6f}, tau = {:.6f}) in {}{}", what, seed,
        c.sigma2, c.ramanujan_bound, seconds(since(t0)), t + 1 < tries ? "; next seed" : "");
    if (!best || c.sigma2 < best->certificate.sigma2) best = std::move(a);
  }
  KVCAL_CHECK(allow_best && best, "{}: no certified Ramanujan candidate in {} tries (seeds {}..{}); {}", what, tries,
              seed - static_cast<std::uint64_t>(tries), seed - 1, advice);
  log(LogLevel::warn, "{}: keeping the best uncertified candidate (seed {}, sigma2 = {:.6f})", what, best->seed,
      best->certificate.sigma2);
  return std::move(*best);
}

}  // namespace

std::vector<MaskRecord> generate_masks(const MaskGenOptions& o) {
  KVCAL_CHECK(o.method == "random" || o.method == "lift" || o.method == "lps",
              "unknown method '{}': use random, lift or lps", o.method);
  KVCAL_CHECK(o.count >= 1, "count {} must be at least 1", o.count);
  KVCAL_CHECK(o.tries >= 1, "tries {} must be at least 1", o.tries);
  KVCAL_CHECK(o.certify.threads >= 0, "threads {} must be 0 (all cores) or more", o.certify.threads);
  KVCAL_CHECK(o.certify.exact_limit >= 0, "exact_limit {} must be 0 or more", o.certify.exact_limit);
  KVCAL_CHECK(o.certify.max_failure_probability > 0 && o.certify.max_failure_probability < 1,
              "max_failure_probability {} must lie in (0, 1)", o.certify.max_failure_probability);
  KVCAL_CHECK(o.lift_to >= 0, "lift_to {} must be positive", o.lift_to);
  const CertifyOptions& copt = o.certify;

  // The base mask: a seeded generator, or the one deterministic LPS mask.
  std::function<CsrMask(std::uint64_t)> make_base;
  std::optional<Attempt> lps_base;
  std::string base_advice, build_note;
  MaskRecord proto;
  proto.method = o.method;
  proto.transposed = o.transpose;
  if (o.method == "lps") {
    KVCAL_CHECK(o.rows == 0 && o.cols == 0 && !o.row_degree && !o.sparsity,
                "method lps takes its shape from lps_p and lps_q; drop rows, cols, sparsity and row_degree");
    KVCAL_CHECK(o.lps_p != 0 && o.lps_q != 0, "method lps needs lps_p and lps_q");
    const auto t0 = Clock::now();
    const LpsGraph graph = build_lps_graph(o.lps_p, o.lps_q);
    const LpsConstruction construction =
        o.construction.empty() ? default_lps_construction(graph) : parse_lps_construction(o.construction);
    Attempt a;
    a.mask = lps_mask(graph, construction);
    if (o.transpose) a.mask = transpose(a.mask);
    // Logged once the remaining arguments are checked, so an error stays one line.
    build_note = fmt::format("X^{{{},{}}}: {} vertices, {}-regular, {}; {} mask {}x{} built in {}", o.lps_p, o.lps_q,
                             graph.vertices(), graph.degree(), graph.bipartite ? "bipartite" : "non-bipartite",
                             to_string(construction), a.mask.rows, a.mask.cols, seconds(since(t0)));
    lps_base = std::move(a);
    proto.lps_p = o.lps_p;
    proto.lps_q = o.lps_q;
    proto.construction = to_string(construction);
  } else {
    KVCAL_CHECK(o.lps_p == 0 && o.lps_q == 0 && o.construction.empty(),
                "lps_p, lps_q and construction need method lps");
    KVCAL_CHECK(o.row_degree.has_value() != o.sparsity.has_value(), "give one of sparsity or row_degree");
    const MaskMethod method = parse_mask_method(o.method);
    const MaskShape shape = resolve_shape(o.rows, o.cols, o.row_degree, o.sparsity);
    if (method == MaskMethod::lift) {
      const std::string problem = lift_shape_problem(shape);
      KVCAL_CHECK(problem.empty(), "mask {}x{} with row degree {}: {}", shape.rows, shape.cols, shape.row_degree,
                  problem);
    }
    if (o.sparsity &&
        std::abs(*o.sparsity * static_cast<double>(shape.cols) - static_cast<double>(shape.row_degree)) > 1e-9) {
      log(LogLevel::warn, "sparsity {} gives {} channels per token; using row degree {} (sparsity {:.6g})", *o.sparsity,
          *o.sparsity * static_cast<double>(shape.cols), shape.row_degree, shape.sparsity());
    }
    if (!shape.biregular()) {
      log(LogLevel::warn,
          "rows x row degree = {} is not a multiple of cols = {}: the mask is near-biregular (column degrees {} and "
          "{}); its certificate uses the maximum degree {}",
          shape.rows * shape.row_degree, shape.cols, shape.col_degree_min, shape.col_degree_max, shape.col_degree_max);
    }
    make_base = [method, shape, t = o.transpose](std::uint64_t s) {
      CsrMask m = generate(method, shape, s);
      return t ? transpose(m) : m;
    };
    base_advice = fmt::format("raise --tries, try --method {}, or pass --allow-non-ramanujan to keep the best",
                              method == MaskMethod::lift ? "random" : "lift");
  }

  // 2-lifts: each doubles rows and cols; lift_to names the final rows.
  const std::int64_t base_rows = lps_base ? lps_base->mask.rows : (o.transpose ? o.cols : o.rows);
  std::int64_t lifts = 0;
  if (o.lift_to > 0) {
    std::int64_t r = base_rows;
    while (r < o.lift_to && lifts < 31) r *= 2, ++lifts;
    KVCAL_CHECK(r == o.lift_to && lifts >= 1,
                "--lift-to {} is not {} times a power of two (2-lifts double the rows; reachable: {}, {}, {}, ...)",
                o.lift_to, base_rows, base_rows * 2, base_rows * 4, base_rows * 8);
  }
  KVCAL_CHECK(!lps_base || lifts > 0 || o.count == 1,
              "LPS masks are deterministic: there is one per (p, q, construction); --count {} needs --lift-to",
              o.count);

  if (lps_base) {  // certified once all arguments are known to be usable
    log(LogLevel::info, "{}", build_note);
    Attempt& a = *lps_base;
    const auto t1 = Clock::now();
    a.certificate = certify(a.mask, copt);
    const Certificate& c = a.certificate;
    log(LogLevel::info, "X^{{{},{}}} {} mask: sigma2 = {:.6f}, tau = {:.6f}, {} certificate (margin {:.4g}) in {}",
        o.lps_p, o.lps_q, proto.construction, c.sigma2, c.ramanujan_bound, to_string(c.kind), c.margin,
        seconds(since(t1)));
    if (!c.ramanujan) {
      log(LogLevel::warn,
          "X^{{{},{}}}: the numerical certificate could not confirm the theorem ({}); raise "
          "--max-failure-probability or --exact-limit",
          o.lps_p, o.lps_q, to_string(c.kind));
    }
  }

  std::vector<MaskRecord> accepted;
  auto is_new = [&](const CsrMask& m) {
    for (const auto& prev : accepted) {
      if (prev.mask == m) return false;
    }
    return true;
  };
  auto always = [](const CsrMask&) { return true; };
  std::uint64_t seed = o.seed;
  for (std::int64_t m = 0; m < o.count; ++m) {
    const std::string what = fmt::format("mask {}/{}", m + 1, o.count);
    MaskRecord rec = proto;
    rec.id = fmt::format("mask_{:04d}", m);
    Attempt cur;
    if (lps_base) {
      cur = *lps_base;
      rec.certificate_theorem = lifts == 0 ? "LPS" : "";
    } else {
      cur = certified_try(what, o.tries, seed, o.allow_non_ramanujan, copt, make_base,
                          lifts == 0 ? std::function<bool(const CsrMask&)>(is_new) : always, base_advice);
      rec.seed = cur.seed;
    }
    for (std::int64_t level = 1; level <= lifts; ++level) {
      const CsrMask base = std::move(cur.mask);
      cur = certified_try(
          fmt::format("{}, 2-lift {}/{} to {}x{}", what, level, lifts, 2 * base.rows, 2 * base.cols), o.tries, seed,
          o.allow_non_ramanujan, copt, [&base](std::uint64_t s) { return two_lift(base, s); },
          level == lifts ? std::function<bool(const CsrMask&)>(is_new) : always,
          "raise --tries or pass --allow-non-ramanujan to keep the best");
      rec.lift_seeds.push_back(cur.seed);
    }
    rec.mask = std::move(cur.mask);
    rec.certificate = cur.certificate;
    accepted.push_back(std::move(rec));
  }
  return accepted;
}

}  // namespace kvcal
