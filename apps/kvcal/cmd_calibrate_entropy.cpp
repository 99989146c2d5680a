// kvcal calibrate-entropy: CHESS re-selection thresholds from calibration dumps.
#include <algorithm>
#include <chrono>
#include <memory>

#include <fmt/format.h>

#include "cli_common.h"
#include "dist.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/core/sha256.h"
#include "kvcal/io/entropy_calibration.h"
#include "kvcal/io/masks.h"

namespace kvcal::cli {
namespace {

struct Options {
  std::vector<std::string> dumps;
  std::string out, rule = "and", page_varentropy = "mean", unit = "nats", partial = "drop";
  std::int64_t page_size = 32, bins = 64;
  double percentile = 99;
  int threads = 0;
};

constexpr const char* kFooter = R"(Examples:
  kvcal calibrate-entropy data/smollm2_attention.h5 --page-size 16 --out entropy.h5
  kvcal calibrate-entropy a.h5 b.h5 --percentile 95 --rule or --unit bits --out entropy.h5

Per token: entropy H = -sum p ln p and varentropy sum p (ln p + H)^2 of the
next-token distribution, from `logits` [N+T, V] (one pass after the row maximum,
-inf entries allowed) or the dump's token_entropy / token_varentropy. Per page of
--page-size tokens: the mean entropy, and the page varentropy (--page-varentropy
mean: mean token varentropy; temporal: variance of token entropy in the page).
Thresholds: the --percentile of each over all calibration pages; a page triggers
re-selection when it is above both (--rule and, the upper-right region of CHESS
Figure 4) or either (--rule or).)";

EntropyOptions entropy_options(const Options& o) {
  KVCAL_CHECK(o.threads >= 0, "--threads {} must be 0 (all cores) or more", o.threads);
  EntropyOptions opt;
  opt.page.page_size = o.page_size;
  opt.page.varentropy = parse_page_varentropy(o.page_varentropy);
  opt.page.keep_partial = o.partial == "keep";
  opt.percentile = o.percentile;
  opt.rule = parse_trigger_rule(o.rule);
  opt.unit = parse_entropy_unit(o.unit);
  opt.bins = o.bins;
  opt.threads = o.threads;
  return opt;
}

// Samples split over the ranks by token count (file order kept); dump f is
// hashed by the rank that reads most of its tokens. Rank 0 concatenates the
// pages in sample order and takes the percentiles over all of them, as one
// process does. Returns the calibration on rank 0 (empty elsewhere).
EntropyCalibration calibrate_distributed(dist::Context& ctx, const std::vector<std::string>& dumps,
                                         const EntropyOptions& opt) {
  std::vector<EntropySampleRef> refs;
  std::vector<std::int64_t> weights;
  ctx.step([&] {
    refs = list_entropy_samples(dumps, opt);
    for (const auto& r : refs) weights.push_back(r.weight);
  });
  const std::vector<std::size_t> bounds = dist::split_by_weight(weights, ctx.size());
  std::vector<std::vector<std::int64_t>> share(dumps.size(), std::vector<std::int64_t>(ctx.size(), 0));
  for (int r = 0; r < ctx.size(); ++r) {
    for (std::size_t i = bounds[r]; i < bounds[r + 1]; ++i) share[refs[i].file][r] += weights[i];
  }
  std::vector<std::uint64_t> my_files;
  for (std::size_t f = 0; f < dumps.size(); ++f) {
    if (std::max_element(share[f].begin(), share[f].end()) - share[f].begin() == ctx.rank()) my_files.push_back(f);
  }
  dist::Packer out;
  ctx.step([&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = bounds[ctx.rank()]; i < bounds[ctx.rank() + 1]; ++i) {
      ctx.poll();
      const EntropySamplePages s = entropy_sample_pages(dumps[refs[i].file], refs[i].name, opt);
      log(LogLevel::info, "{}: sample '{}': {} tokens from {}, {} pages ({:.1f} s)", dumps[refs[i].file], refs[i].name,
          s.tokens, s.source, s.page_entropy.size(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      out.put_vector(s.page_entropy);
      out.put_vector(s.page_varentropy);
      out.put(s.tokens);
      out.put_string(s.source);
    }
    out.put_vector(my_files);
    for (std::uint64_t f : my_files) {
      ctx.poll();
      out.put_string(sha256_file(dumps[f]));
    }
  });
  const std::vector<std::string> parts = ctx.gather(out.bytes());
  EntropyCalibration c;
  ctx.step([&] {
    if (!ctx.root()) return;
    std::vector<EntropySamplePages> all;
    std::vector<std::string> sha(dumps.size());
    for (int r = 0; r < ctx.size(); ++r) {
      dist::Unpacker in(parts[r]);
      for (std::size_t i = bounds[r]; i < bounds[r + 1]; ++i) {
        EntropySamplePages s;
        s.page_entropy = in.get_vector<double>();
        s.page_varentropy = in.get_vector<double>();
        s.tokens = in.get<std::int64_t>();
        s.source = in.get_string();
        all.push_back(std::move(s));
      }
      for (std::uint64_t f : in.get_vector<std::uint64_t>()) {
        KVCAL_CHECK(f < sha.size(), "rank {} sent a hash of dump {}", r, f);
        sha[f] = in.get_string();
      }
      KVCAL_CHECK(in.done(), "rank {} sent more than expected", r);
    }
    c = finish_entropy_calibration(opt, all, std::move(sha));
    if (ctx.size() > 1) log(LogLevel::info, "gathered {} samples from {} ranks", all.size(), ctx.size());
  });
  return c;
}

int run(const Options& o, const Globals& g) {
  dist::Context ctx;
  EntropyOptions opt;
  ctx.step([&] {
    require_usage(!o.out.empty(), "--out is required");
    if (ctx.root()) check_mask_output_path(o.out);
    opt = entropy_options(o);
  });
  const EntropyCalibration c = calibrate_distributed(ctx, o.dumps, opt);
  ctx.step([&] {
    if (!ctx.root()) return;
    write_entropy_calibration(o.out, c, g.command_line);
    fmt::print("pages            {} of {} tokens ({} per page, partial pages: {})\n", c.num_pages, c.num_tokens,
               o.page_size, o.partial);
    fmt::print("entropy          p{:g} = {:.6f} {}\n", o.percentile, c.entropy_threshold, o.unit);
    fmt::print("varentropy       p{:g} = {:.6f} {}^2 (page varentropy: {})\n", o.percentile, c.varentropy_threshold,
               o.unit, o.page_varentropy);
    fmt::print("trigger rule     {} -> {:.2f}% of calibration pages re-select\n", o.rule, 100 * c.trigger_rate);
    log(LogLevel::info, "wrote the entropy calibration to {}", o.out);
  });
  return 0;
}

}  // namespace

Runner add_calibrate_entropy(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("calibrate-entropy", "Calibrate CHESS entropy/varentropy re-selection thresholds");
  sub->footer(kFooter);
  sub->add_option("dumps", o->dumps, "kvcal.attention_dump files with logits or token statistics")->required();
  sub->add_option("--out", o->out, "Output calibration (HDF5, written atomically)");
  sub->add_option("--page-size", o->page_size, "Tokens per KV-cache page (CHESS uses 32)")->capture_default_str();
  sub->add_option("--percentile", o->percentile, "Percentile of page statistics used as thresholds")
      ->capture_default_str();
  sub->add_option("--rule", o->rule, "Trigger when above both thresholds (and) or either (or)")
      ->check(CLI::IsMember({"and", "or"}))
      ->capture_default_str();
  sub->add_option("--page-varentropy", o->page_varentropy,
                  "mean (of token varentropies) or temporal (variance of token entropy in the page)")
      ->check(CLI::IsMember({"mean", "temporal"}))
      ->capture_default_str();
  sub->add_option("--unit", o->unit, "nats or bits")->check(CLI::IsMember({"nats", "bits"}))->capture_default_str();
  sub->add_option("--partial-pages", o->partial, "drop or keep a last page with fewer tokens")
      ->check(CLI::IsMember({"drop", "keep"}))
      ->capture_default_str();
  sub->add_option("--bins", o->bins, "Bins per axis of the 2-D histogram")->capture_default_str();
  sub->add_option("--threads", o->threads, "Worker threads (0: all cores)")->capture_default_str();
  return [o](const Globals& g) { return run(*o, g); };
}

}  // namespace kvcal::cli
