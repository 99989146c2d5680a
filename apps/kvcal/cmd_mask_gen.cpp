// kvcal mask-gen: generate certified (near-)biregular expander masks.
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>

#include <fmt/format.h>

#include "cli_common.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/graph/generate.h"
#include "kvcal/io/masks.h"
#include "kvcal/spectral/certify.h"

namespace kvcal::cli {
namespace {

struct Options {
  std::int64_t rows = 0, cols = 0, row_degree = 0, count = 1, tries = 16;
  double sparsity = 0;
  std::string method = "random", out;
  std::uint64_t seed = 1;
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

A candidate that cannot be certified Ramanujan is retried with the next seed,
up to --tries times; the file records each winning seed. Same arguments and seed
give byte-identical mask datasets.)";

int run(const Options& o, std::optional<std::int64_t> row_degree, std::optional<double> sparsity, const Globals& g) {
  const MaskMethod method = parse_mask_method(o.method);
  const MaskShape shape = resolve_shape(o.rows, o.cols, row_degree, sparsity);
  KVCAL_CHECK(o.count >= 1, "--count {} must be at least 1", o.count);
  KVCAL_CHECK(o.tries >= 1, "--tries {} must be at least 1", o.tries);
  KVCAL_CHECK(o.threads >= 0, "--threads {} must be 0 (all cores) or more", o.threads);
  KVCAL_CHECK(o.exact_limit >= 0, "--exact-limit {} must be 0 or more", o.exact_limit);
  KVCAL_CHECK(o.max_failure_probability > 0 && o.max_failure_probability < 1,
              "--max-failure-probability {} must lie in (0, 1)", o.max_failure_probability);
  KVCAL_CHECK(!o.out.empty(), "--out is required");
  check_mask_output_path(o.out);  // fail before a long generation, not after it
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
        "rows x row degree = {} is not a multiple of cols = {}: the mask is near-biregular (column degrees {} and {}); "
        "its certificate uses the maximum degree {}",
        shape.rows * shape.row_degree, shape.cols, shape.col_degree_min, shape.col_degree_max, shape.col_degree_max);
  }

  CertifyOptions copt;
  copt.exact_limit = o.exact_limit;
  copt.max_failure_probability = o.max_failure_probability;
  copt.threads = o.threads;

  std::vector<MaskRecord> accepted;
  std::uint64_t seed = o.seed;
  for (std::int64_t m = 0; m < o.count; ++m) {
    std::optional<MaskRecord> best;
    bool found = false;
    for (std::int64_t t = 0; t < o.tries && !found; ++t, ++seed) {
      const auto t0 = std::chrono::steady_clock::now();
      MaskRecord rec;
      rec.mask = generate(method, shape, seed);
      bool duplicate = false;
      for (const auto& prev : accepted) duplicate = duplicate || prev.mask == rec.mask;
      if (duplicate) {
        log(LogLevel::info, "mask {}/{}: seed {} repeats an earlier mask; next seed", m + 1, o.count, seed);
        continue;
      }
      rec.certificate = certify(rec.mask, copt);
      rec.method = o.method;
      rec.seed = seed;
      rec.id = fmt::format("mask_{:04d}", m);
      const Certificate& c = rec.certificate;
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (c.ramanujan) {
        log(LogLevel::info,
            "mask {}/{}: seed {}: sigma2 = {:.6f} <= tau = {:.6f} ({} certificate, margin {:.4g}) in {}", m + 1,
            o.count, seed, c.sigma2, c.ramanujan_bound, to_string(c.kind), c.margin, seconds(dt));
        found = true;
        best = std::move(rec);
      } else {
        log(LogLevel::info, "mask {}/{}: seed {}: not certified Ramanujan (sigma2 = {:.6f}, tau = {:.6f}) in {}{}",
            m + 1, o.count, seed, c.sigma2, c.ramanujan_bound, seconds(dt), t + 1 < o.tries ? "; next seed" : "");
        if (!best || c.sigma2 < best->certificate.sigma2) best = std::move(rec);
      }
    }
    if (!found) {
      KVCAL_CHECK(o.allow_non_ramanujan && best,
                  "no certified Ramanujan mask {}x{} (row degree {}) in {} tries from seed {}; raise --tries, try "
                  "--method {}, or pass --allow-non-ramanujan to keep the best candidate",
                  shape.rows, shape.cols, shape.row_degree, o.tries, seed - o.tries,
                  method == MaskMethod::lift ? "random" : "lift");
      log(LogLevel::warn, "mask {}/{}: keeping the best uncertified candidate (seed {}, sigma2 = {:.6f})", m + 1,
          o.count, best->seed, best->certificate.sigma2);
    }
    accepted.push_back(std::move(*best));
  }

  write_mask_file(o.out, accepted, g.command_line);
  for (const auto& r : accepted) {
    const Certificate& c = r.certificate;
    fmt::print("{}  {}x{}  d1={} d2={}  seed={}  sigma2={:.6f}  tau={:.6f}  margin={:.4g}  {}\n", r.id, r.mask.rows,
               r.mask.cols, c.row_degree, c.col_degree, r.seed, c.sigma2, c.ramanujan_bound, c.margin,
               c.ramanujan ? fmt::format("ramanujan ({})", to_string(c.kind)) : std::string("NOT certified"));
  }
  log(LogLevel::info, "wrote {} mask{} to {}", accepted.size(), accepted.size() == 1 ? "" : "s", o.out);
  return 0;
}

}  // namespace

Runner add_mask_gen(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("mask-gen", "Generate certified Ramanujan expander masks (HEX §3.2, App. A.2)");
  sub->footer(kFooter);
  sub->add_option("--rows", o->rows, "Tokens (mask rows), e.g. the block size 96")->required();
  sub->add_option("--cols", o->cols, "Channels (mask columns), e.g. the head dimension 128")->required();
  auto* sp =
      sub->add_option("--sparsity", o->sparsity, "Fraction of channels kept per token, rho = d1 / cols, in (0, 1]");
  auto* deg = sub->add_option("--row-degree", o->row_degree, "Channels kept per token (d1), instead of --sparsity");
  sp->excludes(deg);
  sub->add_option("--method", o->method, "random (configuration model + switches) or lift (block-structured r-lift)")
      ->check(CLI::IsMember({"random", "lift"}))
      ->capture_default_str();
  sub->add_option("--seed", o->seed, "First seed; a failed candidate moves on to the next")
      ->check(CLI::Validator(
          [](std::string& v) {
            return v.find_first_not_of("0123456789") == std::string::npos ? std::string()
                                                                          : "must be a non-negative integer";
          },
          "UINT64"))
      ->capture_default_str();
  sub->add_option("--count", o->count, "Distinct certified masks of this shape to write")->capture_default_str();
  sub->add_option("--tries", o->tries, "Candidates to try per mask")->capture_default_str();
  sub->add_option("--out", o->out, "Output HDF5 file (written atomically)")->required();
  sub->add_option("--exact-limit", o->exact_limit, "Largest Gram side for the exact (Cholesky) certificate")
      ->capture_default_str();
  sub->add_option("--max-failure-probability", o->max_failure_probability,
                  "Largest accepted failure chance of a probabilistic certificate")
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "Worker threads (0: all cores)")->capture_default_str();
  sub->add_flag("--allow-non-ramanujan", o->allow_non_ramanujan,
                "Keep the best uncertified candidate instead of failing when no try is certified");
  return [o, sp, deg](const Globals& g) {
    KVCAL_CHECK(sp->count() + deg->count() == 1, "give one of --sparsity or --row-degree");
    std::optional<std::int64_t> row_degree;
    std::optional<double> sparsity;
    if (deg->count()) row_degree = o->row_degree;
    if (sp->count()) sparsity = o->sparsity;
    return run(*o, row_degree, sparsity, g);
  };
}

}  // namespace kvcal::cli
