// kvcal mask-gen: generate certified (near-)biregular expander masks, random
// or deterministic (LPS), optionally transposed and enlarged by 2-lifts.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "cli_common.h"
#include "dist.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/graph/generate.h"
#include "kvcal/graph/lps.h"
#include "kvcal/io/masks.h"
#include "kvcal/spectral/certify.h"

namespace kvcal::cli {
namespace {

struct Options {
  std::int64_t rows = 0, cols = 0, row_degree = 0, count = 1, tries = 16;
  double sparsity = 0;
  std::string method = "random", out, construction;
  std::uint64_t seed = 1;
  std::int64_t lps_p = 0, lps_q = 0, lift_to = 0, max_rows = 65536;
  bool transpose = false, list_lps = false;
  std::int64_t exact_limit = 8192;
  double max_failure_probability = 1e-9;
  int threads = 0;
  bool allow_non_ramanujan = false;
};

constexpr const char* kFooter = R"(Examples:
  # one 96x128 mask keeping 4 channels per token (rho = 1/32), exactly certified
  kvcal mask-gen --rows 96 --cols 128 --sparsity 0.03125 --out block.h5
  # the block-structured lift (each token keeps one channel per group of 32)
  kvcal mask-gen --rows 32768 --cols 4096 --row-degree 128 --method lift --out long.h5
  # eight distinct certified masks of one shape
  kvcal mask-gen --rows 96 --cols 128 --row-degree 4 --count 8 --seed 7 --out eight.h5
  # deterministic: the LPS graph X^{5,13} (bipartite), 1092x1092, degree 6
  kvcal mask-gen --method lps --lps-p 5 --lps-q 13 --out lps.h5
  # its vertex-edge incidence, transposed (6552 tokens x 2184 channels), 2-lifted once
  kvcal mask-gen --method lps --lps-p 5 --lps-q 13 --construction incidence --transpose --lift-to 13104 --out inc.h5
  # which LPS shapes exist up to 20000 rows
  kvcal mask-gen --list-lps --max-rows 20000

A candidate that cannot be certified Ramanujan is retried with the next seed,
up to --tries times (2-lifts likewise); the file records the winning seeds.
Same arguments and seed give byte-identical mask datasets. LPS masks need no
seed: they are Ramanujan by theorem, and kvcal certifies them numerically too.)";

using Clock = std::chrono::steady_clock;

struct Attempt {
  CsrMask mask;
  Certificate certificate;
  std::uint64_t seed = 0;
};

// One candidate seed's work, the unit split over MPI ranks: the mask
// make(seed) and, unless it repeats an earlier mask (`accept` says no), its
// certificate.
struct Candidate {
  Attempt attempt;
  bool repeat = false;
  double seconds = 0;  // generation and certification
};

Candidate try_seed(std::uint64_t seed, const CertifyOptions& copt, const std::function<CsrMask(std::uint64_t)>& make,
                   const std::function<bool(const CsrMask&)>& accept) {
  const auto t0 = Clock::now();
  Candidate c;
  c.attempt.seed = seed;
  c.attempt.mask = make(seed);
  c.repeat = !accept(c.attempt.mask);
  if (!c.repeat) c.attempt.certificate = certify(c.attempt.mask, copt);
  c.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return c;
}

void put_attempt(dist::Packer& p, const Attempt& a) {
  p.put(a.mask.rows);
  p.put(a.mask.cols);
  p.put_vector(a.mask.indptr);
  p.put_vector(a.mask.indices);
  p.put(a.certificate);
  p.put(a.seed);
}

Attempt get_attempt(dist::Unpacker& u) {
  Attempt a;
  a.mask.rows = u.get<std::int64_t>();
  a.mask.cols = u.get<std::int64_t>();
  a.mask.indptr = u.get_vector<std::int64_t>();
  a.mask.indices = u.get_vector<std::int32_t>();
  a.certificate = u.get<Certificate>();
  a.seed = u.get<std::uint64_t>();
  return a;
}

// Draws candidates from `make(seed)` with successive seeds until one is
// certified Ramanujan (and passes `accept`), up to `tries`; returns it, or
// the best uncertified one when allowed. Advances `seed` past what it used.
// Collective over the ranks of `ctx`: in each round rank r tries the r-th
// next seed, rank 0 gathers the candidates in seed order and decides as one
// process does (skips a repeat, takes the first certified one, keeps the best
// otherwise), then tells every rank the outcome. The winner and the seeds
// used are therefore the same for every rank count; a round wastes at most
// ranks - 1 candidates after the winner. `accept` must give the same answer
// on every rank (it only looks at masks accepted by earlier calls).
Attempt certified_try(dist::Context& ctx, const std::string& what, std::int64_t tries, std::uint64_t& seed,
                      bool allow_best, const CertifyOptions& copt, const std::function<CsrMask(std::uint64_t)>& make,
                      const std::function<bool(const CsrMask&)>& accept, const std::string& advice) {
  std::optional<Attempt> best;  // rank 0
  for (std::int64_t t = 0;;) {
    const std::int64_t n = std::min<std::int64_t>(ctx.size(), tries - t);
    dist::Packer mine;
    ctx.step([&] {
      if (ctx.rank() >= n) return;
      // A seed kvcal cannot build a mask from is that candidate's outcome:
      // it fails the run only if the single process would have reached it.
      try {
        const Candidate c = try_seed(seed + static_cast<std::uint64_t>(ctx.rank()), copt, make, accept);
        mine.put<std::uint8_t>(0);
        put_attempt(mine, c.attempt);
        mine.put<std::uint8_t>(c.repeat ? 1 : 0);
        mine.put(c.seconds);
      } catch (const Error& e) {
        if (ctx.size() == 1) throw;
        mine = dist::Packer();
        mine.put<std::uint8_t>(1);
        mine.put_string(e.what());
      }
    });
    const std::vector<std::string> parts = ctx.gather(mine.bytes());
    dist::Packer decision;  // 0, seed, t: next round; 1, seed, attempt: done
    ctx.step([&] {
      if (!ctx.root()) return;
      for (std::int64_t i = 0; i < n; ++i, ++t, ++seed) {
        dist::Unpacker in(parts[static_cast<std::size_t>(i)]);
        if (in.get<std::uint8_t>() != 0) fail("{}", in.get_string());
        Attempt a = get_attempt(in);
        const bool repeat = in.get<std::uint8_t>() != 0;
        const double dt = in.get<double>();
        KVCAL_CHECK(in.done() && a.seed == seed, "rank {} sent an unexpected candidate", i);
        if (repeat) {
          log(LogLevel::info, "{}: seed {} repeats an earlier mask; next seed", what, seed);
          continue;
        }
        const Certificate& c = a.certificate;
        if (c.ramanujan) {
          log(LogLevel::info, "{}: seed {}: sigma2 = {:.6f} <= tau = {:.6f} ({} certificate, margin {:.4g}) in {}",
              what, seed, c.sigma2, c.ramanujan_bound, to_string(c.kind), c.margin, seconds(dt));
          ++seed;
          decision.put<std::uint8_t>(1);
          decision.put(seed);
          put_attempt(decision, a);
          return;
        }
        log(LogLevel::info, "{}: seed {}: not certified Ramanujan (sigma2 = {:.6f}, tau = {:.6f}) in {}{}", what, seed,
            c.sigma2, c.ramanujan_bound, seconds(dt), t + 1 < tries ? "; next seed" : "");
        if (!best || c.sigma2 < best->certificate.sigma2) best = std::move(a);
      }
      if (t < tries) {
        decision.put<std::uint8_t>(0);
        decision.put(seed);
        decision.put(t);
        return;
      }
      KVCAL_CHECK(allow_best && best, "{}: no certified Ramanujan candidate in {} tries (seeds {}..{}); {}", what,
                  tries, seed - static_cast<std::uint64_t>(tries), seed - 1, advice);
      log(LogLevel::warn, "{}: keeping the best uncertified candidate (seed {}, sigma2 = {:.6f})", what, best->seed,
          best->certificate.sigma2);
      decision.put<std::uint8_t>(1);
      decision.put(seed);
      put_attempt(decision, *best);
    });
    const std::string bytes = ctx.broadcast(decision.bytes());
    dist::Unpacker in(bytes);
    const auto state = in.get<std::uint8_t>();
    seed = in.get<std::uint64_t>();
    if (state == 0) {
      t = in.get<std::int64_t>();
      continue;
    }
    return get_attempt(in);
  }
}

// Every mask of a run without 2-lifts: the masks draw from one sequence of
// seeds (mask m + 1 starts after mask m's winner), so the candidates a round
// computes past a winner are the next mask's first ones and only the last
// round's tail is wasted. Same decisions as certified_try once per mask (a
// repeat of an accepted mask is skipped, the first certified one wins, after
// `tries` the best uncertified one is kept when allowed), made by rank 0 over
// each round's candidates in seed order; every rank learns the winners.
std::vector<Attempt> certified_masks(dist::Context& ctx, std::int64_t count, std::int64_t tries, std::uint64_t seed,
                                     bool allow_best, const CertifyOptions& copt,
                                     const std::function<CsrMask(std::uint64_t)>& make, const std::string& advice) {
  std::vector<Attempt> won;  // every rank
  auto is_new = [&](const CsrMask& m) {
    for (const auto& a : won) {
      if (a.mask == m) return false;
    }
    return true;
  };
  std::int64_t t = 0;           // rank 0: tries of the current mask
  std::optional<Attempt> best;  // rank 0: its best uncertified candidate
  std::uint64_t next = seed;    // first seed of the round
  while (static_cast<std::int64_t>(won.size()) < count) {
    dist::Packer mine;
    ctx.step([&] {
      try {
        const Candidate c = try_seed(next + static_cast<std::uint64_t>(ctx.rank()), copt, make, is_new);
        mine.put<std::uint8_t>(0);
        put_attempt(mine, c.attempt);
        mine.put<std::uint8_t>(c.repeat ? 1 : 0);
        mine.put(c.seconds);
      } catch (const Error& e) {
        if (ctx.size() == 1) throw;
        mine = dist::Packer();
        mine.put<std::uint8_t>(1);
        mine.put_string(e.what());
      }
    });
    const std::vector<std::string> parts = ctx.gather(mine.bytes());
    dist::Packer decision;  // the round's winners
    ctx.step([&] {
      if (!ctx.root()) return;
      const std::size_t before = won.size();
      for (std::size_t i = 0; i < parts.size() && static_cast<std::int64_t>(won.size()) < count; ++i) {
        const std::uint64_t s = next + i;
        dist::Unpacker in(parts[i]);
        if (in.get<std::uint8_t>() != 0) fail("{}", in.get_string());
        Attempt a = get_attempt(in);
        const bool repeat = in.get<std::uint8_t>() != 0;
        const double dt = in.get<double>();
        KVCAL_CHECK(in.done() && a.seed == s, "rank {} sent an unexpected candidate", i);
        const std::string what = fmt::format("mask {}/{}", won.size() + 1, count);
        const Certificate& c = a.certificate;
        if (repeat || !is_new(a.mask)) {
          log(LogLevel::info, "{}: seed {} repeats an earlier mask; next seed", what, s);
        } else if (c.ramanujan) {
          log(LogLevel::info, "{}: seed {}: sigma2 = {:.6f} <= tau = {:.6f} ({} certificate, margin {:.4g}) in {}",
              what, s, c.sigma2, c.ramanujan_bound, to_string(c.kind), c.margin, seconds(dt));
          won.push_back(std::move(a));
          t = 0;
          best.reset();
          continue;
        } else {
          log(LogLevel::info, "{}: seed {}: not certified Ramanujan (sigma2 = {:.6f}, tau = {:.6f}) in {}{}", what, s,
              c.sigma2, c.ramanujan_bound, seconds(dt), t + 1 < tries ? "; next seed" : "");
          if (!best || c.sigma2 < best->certificate.sigma2) best = std::move(a);
        }
        if (++t < tries) continue;
        KVCAL_CHECK(allow_best && best, "{}: no certified Ramanujan candidate in {} tries (seeds {}..{}); {}", what,
                    tries, s + 1 - static_cast<std::uint64_t>(tries), s, advice);
        log(LogLevel::warn, "{}: keeping the best uncertified candidate (seed {}, sigma2 = {:.6f})", what, best->seed,
            best->certificate.sigma2);
        won.push_back(std::move(*best));
        t = 0;
        best.reset();
      }
      decision.put<std::uint64_t>(won.size() - before);
      for (std::size_t w = before; w < won.size(); ++w) put_attempt(decision, won[w]);
    });
    const std::string bytes = ctx.broadcast(decision.bytes());
    if (!ctx.root()) {
      dist::Unpacker in(bytes);
      const auto n = in.get<std::uint64_t>();
      for (std::uint64_t w = 0; w < n; ++w) won.push_back(get_attempt(in));
    }
    next += static_cast<std::uint64_t>(ctx.size());
  }
  return won;
}

int list_lps(std::int64_t max_rows) {
  KVCAL_CHECK(max_rows >= 1, "--max-rows {} must be positive", max_rows);
  const std::vector<LpsShape> shapes = list_lps_shapes(max_rows);
  fmt::print("{:>9} {:>9} {:>5} {:>5} {:>5} {:>4} {:>10} {:>13} {:>10}  {}\n", "rows", "cols", "d1", "d2", "p", "q",
             "bipartite", "construction", "sparsity", "(--transpose swaps rows/cols and d1/d2)");
  for (const LpsShape& s : shapes) {
    fmt::print("{:>9} {:>9} {:>5} {:>5} {:>5} {:>4} {:>10} {:>13} {:>10.6f}\n", s.rows, s.cols, s.row_degree,
               s.col_degree, s.p, s.q, s.bipartite ? "yes" : "no", to_string(s.construction),
               static_cast<double>(s.row_degree) / static_cast<double>(s.cols));
  }
  log(LogLevel::info, "{} LPS mask shapes with at most {} rows (p < 1024)", shapes.size(), max_rows);
  return 0;
}

int run(const Options& o, std::optional<std::int64_t> row_degree, std::optional<double> sparsity, bool shape_given,
        const Globals& g) {
  // Under mpirun every rank runs this; the candidates of each mask are split
  // over the ranks (certified_try), and only rank 0 logs, writes and prints.
  dist::Context ctx;
  if (o.list_lps) {
    ctx.step([&] {
      if (ctx.root()) list_lps(o.max_rows);
    });
    return 0;
  }
  CertifyOptions copt;
  // The base mask: a seeded generator, or the one deterministic LPS mask.
  std::function<CsrMask(std::uint64_t)> make_base;
  std::optional<Attempt> lps_base;
  std::string base_advice, build_note;
  MaskRecord proto;
  std::int64_t lifts = 0;
  ctx.step([&] {
    KVCAL_CHECK(o.method == "random" || o.method == "lift" || o.method == "lps",
                "unknown method '{}': use random, lift or lps", o.method);
    KVCAL_CHECK(o.count >= 1, "--count {} must be at least 1", o.count);
    KVCAL_CHECK(o.tries >= 1, "--tries {} must be at least 1", o.tries);
    KVCAL_CHECK(o.threads >= 0, "--threads {} must be 0 (all cores) or more", o.threads);
    KVCAL_CHECK(o.exact_limit >= 0, "--exact-limit {} must be 0 or more", o.exact_limit);
    KVCAL_CHECK(o.max_failure_probability > 0 && o.max_failure_probability < 1,
                "--max-failure-probability {} must lie in (0, 1)", o.max_failure_probability);
    KVCAL_CHECK(o.lift_to >= 0, "--lift-to {} must be positive", o.lift_to);
    require_usage(!o.out.empty(), "--out is required");
    if (ctx.root()) check_mask_output_path(o.out);  // fail before a long generation, not after it

    copt.exact_limit = o.exact_limit;
    copt.max_failure_probability = o.max_failure_probability;
    copt.threads = o.threads;

    proto.method = o.method;
    proto.transposed = o.transpose;
    if (o.method == "lps") {
      require_usage(!shape_given,
                    "--method lps takes its shape from --lps-p and --lps-q; drop --rows, --cols, --sparsity and "
                    "--row-degree (see --list-lps for the shapes)");
      require_usage(o.lps_p != 0 && o.lps_q != 0, "--method lps needs --lps-p and --lps-q (see --list-lps)");
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
                               to_string(construction), a.mask.rows, a.mask.cols,
                               seconds(std::chrono::duration<double>(Clock::now() - t0).count()));
      lps_base = std::move(a);
      proto.lps_p = o.lps_p;
      proto.lps_q = o.lps_q;
      proto.construction = to_string(construction);
    } else {
      require_usage(o.lps_p == 0 && o.lps_q == 0 && o.construction.empty(),
                    "--lps-p, --lps-q and --construction need --method lps");
      const MaskMethod method = parse_mask_method(o.method);
      const MaskShape shape = resolve_shape(o.rows, o.cols, row_degree, sparsity);
      if (method == MaskMethod::lift) {
        const std::string problem = lift_shape_problem(shape);
        KVCAL_CHECK(problem.empty(), "mask {}x{} with row degree {}: {}", shape.rows, shape.cols, shape.row_degree,
                    problem);
      }
      if (sparsity &&
          std::abs(*sparsity * static_cast<double>(shape.cols) - static_cast<double>(shape.row_degree)) > 1e-9) {
        log(LogLevel::warn, "sparsity {} gives {} channels per token; using row degree {} (sparsity {:.6g})", *sparsity,
            *sparsity * static_cast<double>(shape.cols), shape.row_degree, shape.sparsity());
      }
      if (!shape.biregular()) {
        log(LogLevel::warn,
            "rows x row degree = {} is not a multiple of cols = {}: the mask is near-biregular (column degrees {} and "
            "{}); its certificate uses the maximum degree {}",
            shape.rows * shape.row_degree, shape.cols, shape.col_degree_min, shape.col_degree_max,
            shape.col_degree_max);
      }
      make_base = [method, shape, t = o.transpose](std::uint64_t s) {
        CsrMask m = generate(method, shape, s);
        return t ? transpose(m) : m;
      };
      base_advice = fmt::format("raise --tries, try --method {}, or pass --allow-non-ramanujan to keep the best",
                                method == MaskMethod::lift ? "random" : "lift");
    }

    // 2-lifts: each doubles rows and cols; --lift-to names the final rows.
    const std::int64_t base_rows = lps_base ? lps_base->mask.rows : (o.transpose ? o.cols : o.rows);
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

    if (lps_base && ctx.root()) {  // certified once all arguments are known to be usable
      log(LogLevel::info, "{}", build_note);
      Attempt& a = *lps_base;
      const std::string construction = proto.construction;
      const auto t1 = Clock::now();
      a.certificate = certify(a.mask, copt);
      const Certificate& c = a.certificate;
      log(LogLevel::info, "X^{{{},{}}} {} mask: sigma2 = {:.6f}, tau = {:.6f}, {} certificate (margin {:.4g}) in {}",
          o.lps_p, o.lps_q, construction, c.sigma2, c.ramanujan_bound, to_string(c.kind), c.margin,
          seconds(std::chrono::duration<double>(Clock::now() - t1).count()));
      if (!c.ramanujan) {
        log(LogLevel::warn,
            "X^{{{},{}}}: the numerical certificate could not confirm the theorem ({}); raise "
            "--max-failure-probability or --exact-limit",
            o.lps_p, o.lps_q, to_string(c.kind));
      }
    }
  });

  std::vector<MaskRecord> accepted;
  auto is_new = [&](const CsrMask& m) {
    for (const auto& prev : accepted) {
      if (prev.mask == m) return false;
    }
    return true;
  };
  auto always = [](const CsrMask&) { return true; };
  std::uint64_t seed = o.seed;
  if (!lps_base && lifts == 0) {
    std::vector<Attempt> won =
        certified_masks(ctx, o.count, o.tries, seed, o.allow_non_ramanujan, copt, make_base, base_advice);
    for (std::size_t m = 0; m < won.size(); ++m) {
      MaskRecord rec = proto;
      rec.id = fmt::format("mask_{:04d}", m);
      rec.seed = won[m].seed;
      rec.mask = std::move(won[m].mask);
      rec.certificate = won[m].certificate;
      accepted.push_back(std::move(rec));
    }
  }
  for (std::int64_t m = static_cast<std::int64_t>(accepted.size()); m < o.count; ++m) {
    const std::string what = fmt::format("mask {}/{}", m + 1, o.count);
    MaskRecord rec = proto;
    rec.id = fmt::format("mask_{:04d}", m);
    Attempt cur;
    if (lps_base) {
      cur = *lps_base;
      rec.certificate_theorem = lifts == 0 ? "LPS" : "";
    } else {
      cur = certified_try(ctx, what, o.tries, seed, o.allow_non_ramanujan, copt, make_base,
                          lifts == 0 ? std::function<bool(const CsrMask&)>(is_new) : always, base_advice);
      rec.seed = cur.seed;
    }
    for (std::int64_t level = 1; level <= lifts; ++level) {
      const CsrMask base = std::move(cur.mask);
      cur = certified_try(
          ctx, fmt::format("{}, 2-lift {}/{} to {}x{}", what, level, lifts, 2 * base.rows, 2 * base.cols), o.tries,
          seed, o.allow_non_ramanujan, copt, [&base](std::uint64_t s) { return two_lift(base, s); },
          level == lifts ? std::function<bool(const CsrMask&)>(is_new) : always,
          "raise --tries or pass --allow-non-ramanujan to keep the best");
      rec.lift_seeds.push_back(cur.seed);
    }
    rec.mask = std::move(cur.mask);
    rec.certificate = cur.certificate;
    accepted.push_back(std::move(rec));
  }

  ctx.step([&] {
    if (!ctx.root()) return;
    write_mask_file(o.out, accepted, g.command_line);
    for (const auto& r : accepted) {
      const Certificate& c = r.certificate;
      const std::string origin = r.method == "lps" ? fmt::format("lps X^{{{},{}}} {}", r.lps_p, r.lps_q, r.construction)
                                                   : fmt::format("{} seed={}", r.method, r.seed);
      fmt::print("{}  {}x{}  d1={} d2={}  {}{}{}  sigma2={:.6f}  tau={:.6f}  margin={:.4g}  {}{}\n", r.id, r.mask.rows,
                 r.mask.cols, c.row_degree, c.col_degree, origin, r.transposed ? " transposed" : "",
                 r.lift_seeds.empty() ? std::string() : fmt::format(" lifts={}", r.lift_seeds.size()), c.sigma2,
                 c.ramanujan_bound, c.margin,
                 c.ramanujan ? fmt::format("ramanujan ({})", to_string(c.kind)) : std::string("NOT certified"),
                 r.certificate_theorem.empty() ? "" : " + LPS theorem");
    }
    log(LogLevel::info, "wrote {} mask{} to {}", accepted.size(), accepted.size() == 1 ? "" : "s", o.out);
  });
  return 0;
}

}  // namespace

Runner add_mask_gen(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("mask-gen", "Generate certified Ramanujan expander masks (HEX §3.2, App. A.2)");
  sub->footer(kFooter);
  auto* rows = sub->add_option("--rows", o->rows, "Tokens (mask rows), e.g. the block size 96");
  auto* cols = sub->add_option("--cols", o->cols, "Channels (mask columns), e.g. the head dimension 128");
  auto* sp =
      sub->add_option("--sparsity", o->sparsity, "Fraction of channels kept per token, rho = d1 / cols, in (0, 1]");
  auto* deg = sub->add_option("--row-degree", o->row_degree, "Channels kept per token (d1), instead of --sparsity");
  sp->excludes(deg);
  sub->add_option("--method", o->method,
                  "random (configuration model + switches), lift (block-structured r-lift) or lps (deterministic)")
      ->check(CLI::IsMember({"random", "lift", "lps"}))
      ->capture_default_str();
  sub->add_option("--lps-p", o->lps_p, "LPS: odd prime p; the degree is p + 1");
  sub->add_option("--lps-q", o->lps_q, "LPS: odd prime q = 1 (mod 4), q != p; q(q^2-1) or half as many vertices");
  sub->add_option("--construction", o->construction,
                  "LPS: half (bipartite graphs), double-cover (non-bipartite) or incidence; default by graph")
      ->check(CLI::IsMember({"half", "double-cover", "incidence"}));
  sub->add_flag("--transpose", o->transpose, "Swap rows and columns of the base mask (the other orientation)");
  sub->add_option("--lift-to", o->lift_to, "Random certified 2-lifts until the mask has this many rows");
  sub->add_flag("--list-lps", o->list_lps, "Print every LPS mask shape up to --max-rows rows, then exit");
  sub->add_option("--max-rows", o->max_rows, "Largest rows listed by --list-lps")->capture_default_str();
  sub->add_option("--seed", o->seed, "First seed; a failed candidate moves on to the next")
      ->check(CLI::Validator(
          [](std::string& v) {
            return v.find_first_not_of("0123456789") == std::string::npos ? std::string()
                                                                          : "must be a non-negative integer";
          },
          "UINT64"))
      ->capture_default_str();
  sub->add_option("--count", o->count, "Distinct certified masks of this shape to write")->capture_default_str();
  sub->add_option("--tries", o->tries, "Candidates to try per mask (and per 2-lift)")->capture_default_str();
  sub->add_option("--out", o->out, "Output HDF5 file (written atomically)");
  sub->add_option("--exact-limit", o->exact_limit, "Largest Gram side for the exact (Cholesky) certificate")
      ->capture_default_str();
  sub->add_option("--max-failure-probability", o->max_failure_probability,
                  "Largest accepted failure chance of a probabilistic certificate")
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "Worker threads (0: all cores)")->capture_default_str();
  sub->add_flag("--allow-non-ramanujan", o->allow_non_ramanujan,
                "Keep the best uncertified candidate instead of failing when no try is certified");
  return [o, sp, deg, rows, cols](const Globals& g) {
    const bool shape_given = rows->count() + cols->count() + sp->count() + deg->count() > 0;
    std::optional<std::int64_t> row_degree;
    std::optional<double> sparsity;
    if (!o->list_lps && o->method != "lps") {
      require_usage(rows->count() && cols->count(), fmt::format("--method {} needs --rows and --cols", o->method));
      require_usage(sp->count() + deg->count() == 1, "give one of --sparsity or --row-degree");
      if (deg->count()) row_degree = o->row_degree;
      if (sp->count()) sparsity = o->sparsity;
    }
    return run(*o, row_degree, sparsity, shape_given, g);
  };
}

}  // namespace kvcal::cli
