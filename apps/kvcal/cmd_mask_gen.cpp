// kvcal mask-gen: generate certified (near-)biregular expander masks, random
// or deterministic (LPS), optionally transposed and enlarged by 2-lifts.
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "cli_common.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/graph/generate.h"
#include "kvcal/graph/lps.h"
#include "kvcal/io/mask_gen.h"
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
  if (o.list_lps) return list_lps(o.max_rows);
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
  check_mask_output_path(o.out);  // fail before a long generation, not after it

  if (o.method == "lps") {
    require_usage(!shape_given,
                  "--method lps takes its shape from --lps-p and --lps-q; drop --rows, --cols, --sparsity and "
                  "--row-degree (see --list-lps for the shapes)");
    require_usage(o.lps_p != 0 && o.lps_q != 0, "--method lps needs --lps-p and --lps-q (see --list-lps)");
  } else {
    require_usage(o.lps_p == 0 && o.lps_q == 0 && o.construction.empty(),
                  "--lps-p, --lps-q and --construction need --method lps");
  }

  MaskGenOptions gen;
  gen.method = o.method;
  gen.rows = o.method == "lps" ? 0 : o.rows;
  gen.cols = o.method == "lps" ? 0 : o.cols;
  gen.row_degree = row_degree;
  gen.sparsity = sparsity;
  gen.lps_p = o.lps_p;
  gen.lps_q = o.lps_q;
  gen.construction = o.construction;
  gen.transpose = o.transpose;
  gen.lift_to = o.lift_to;
  gen.seed = o.seed;
  gen.count = o.count;
  gen.tries = o.tries;
  gen.allow_non_ramanujan = o.allow_non_ramanujan;
  gen.certify.exact_limit = o.exact_limit;
  gen.certify.max_failure_probability = o.max_failure_probability;
  gen.certify.threads = o.threads;
  const std::vector<MaskRecord> accepted = generate_masks(gen);

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
