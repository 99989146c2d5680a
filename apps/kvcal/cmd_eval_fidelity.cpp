// kvcal eval-fidelity: attention error against KV size of each compression
// method, replayed on the queries, keys and values recorded in a dump.
#include <algorithm>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "cli_common.h"
#include "dist.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/eval/fidelity.h"
#include "kvcal/io/masks.h"
#include "kvcal/io/temp_files.h"

namespace kvcal::cli {
namespace {

struct Options {
  std::string dump, bundle, out, mode = "append";
  std::string methods = "fp16,kcvt3,kcvt4,h2o4,expander4,hex3,hex4,h2o-evict";
  std::int64_t block = 96, recent = 8;
  std::int64_t page_size = 32, chunk_pages = 4, grid_chunks = 4, sink_pages = 1, recent_pages = 2, drift_window = 0;
  double hh_ratio = 0.02, sparsity = 1.0 / 32, h2o_budget = 0.2;
  std::uint64_t seed = 0x6b7663616cULL;
  int threads = 0;
};

constexpr const char* kFooter = R"(Examples:
  kvcal eval-fidelity --dump data/smollm2_long.h5 --out fidelity.csv
  kvcal eval-fidelity --dump data/smollm2_long.h5 --bundle model.kvcal.h5 --methods kcvt4,h2o4,hex4 --mode full
  kvcal eval-fidelity --dump data/smollm2_attention.h5 --block 32 --methods fp16,kcvt2,hex2
  kvcal eval-fidelity --dump data/smollm2_long.h5 --methods hex4,hex4@int14,hex4@int8,kcvt2,kcvt2@int8

Methods (the HEX ablation rows, bits B in 2, 3, 4):
  fp16        no compression (the reference: 100%, zero error)
  kcvtB       KCVT quantization only (keys per channel, values per token)
  h2oB        quantization + heavy hitters and the recent window in fp16
  expanderB   quantization + the expander mask's entries in fp16
  hexB        all of HEX: quantization + expander + heavy hitters + recent window
  NAME@int14  any of the four above decoded in the integer domain: per block,
              the query's and the attention weights rounded to 14 bits and
              multiplied with the codes on integer units (e.g. hex4@int14;
              the same compressed bytes, a bounded extra error)
  NAME@int8   the same with 8-bit weights: one byte product per code, about
              64 times the error bound of @int14 (e.g. kcvt4@int8)
  h2o-evict   original H2O: keep --h2o-budget of the tokens (half recent, half
              heavy hitters, per KV head) in fp16, evict the rest
  chess-conservative|chess-moderate|chess-aggressive
              CHESS page selection with retention ratios (grid, chunk, page) of
              (0.9,0.9,0.9), (0.8,0.7,0.7), (0.5,0.2,0.1); pages of --page-size
              tokens, --chunk-pages per chunk, --grid-chunks per grid, plus
              --sink-pages and --recent-pages; selected after the prompt and
              re-selected when the --bundle's entropy thresholds trigger
  hetero      HeteroCache (needs --bundle with a head profile of the dump's
              shape): full heads keep everything, anchors and satellites their
              budget of prompt tokens; pivots check drift every --drift-window
              steps and refresh their satellites

The dump must hold queries, keys and values (scripts/record_attention.py --qkv).
Per sample and layer, the prompt is appended at once (its full --block-token
blocks compressed, the rest waiting in the fp16 residual buffer), then every
decode step appends its token and attends with its recorded queries. Errors are
against plain attention over the same fp16 keys/values: relative error
||o - o^|| / ||o|| (mean, p99) and cosine similarity, over every query head,
layer, step and sample. KV size: stored bytes at the end of each sample over
the fp16 bytes of the same tokens. The expander mask (--block x head dim, at
--sparsity) comes from --bundle when it holds that shape, otherwise it is
generated and certified on the fly. CHESS adds the fraction of pages attended
(selected %) and the full attention's mass on them; hetero adds the retrieval
trigger rate per pivot step. --out writes the CSV columns
method,kv_size_pct,rel_err_mean,rel_err_p99,cos_mean,selected_pct,attn_mass,trigger_rate
(the last three empty where they do not apply); plot it with scripts/plot_fidelity.py.
Under mpirun the layers of the samples (whole samples with CHESS) are split over
the ranks; the CSV is the same as one process writes.)";

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
  }
  return out;
}

void report(const Options& o, const FidelityReport& rep) {
  fmt::print("{}: {} samples, {} layers, {} query / {} KV heads, head dim {}; block {}, {} mode\n", o.dump, rep.samples,
             rep.layers, rep.q_heads, rep.kv_heads, rep.head_dim, o.block, o.mode);
  if (!rep.mask_source.empty()) fmt::print("expander mask {}\n", rep.mask_source);
  const bool extra = std::any_of(rep.rows.begin(), rep.rows.end(),
                                 [](const FidelityRow& r) { return r.selected_pct >= 0 || r.trigger_rate >= 0; });
  const auto col = [](double v, double scale) { return v < 0 ? std::string("-") : fmt::format("{:.2f}", v * scale); };
  fmt::print("{:<18} {:>10} {:>13} {:>12} {:>12} {:>9}", "method", "KV size %", "rel err mean", "rel err p99",
             "cos mean", "seconds");
  if (extra) fmt::print(" {:>10} {:>10} {:>9}", "selected %", "attn mass", "trigger %");
  fmt::print("\n");
  for (const FidelityRow& r : rep.rows) {
    fmt::print("{:<18} {:>10.2f} {:>13.5f} {:>12.5f} {:>12.6f} {:>9.2f}", r.method, r.kv_size_pct, r.rel_err_mean,
               r.rel_err_p99, r.cos_mean, r.seconds);
    if (extra)
      fmt::print(" {:>10} {:>10} {:>9}", col(r.selected_pct, 1), col(r.attn_mass, 100), col(r.trigger_rate, 100));
    fmt::print("\n");
  }
  // Every row's values unrounded (the CSV rounds them): -v shows that any rank
  // count gives the same bits, not only the same printed digits.
  for (const FidelityRow& r : rep.rows)
    log(LogLevel::debug, "{} exact: {:a} {:a} {:a} {:a} {:a} {:a} {:a} {} queries", r.method, r.kv_size_pct,
        r.rel_err_mean, r.rel_err_p99, r.cos_mean, r.selected_pct, r.attn_mass, r.trigger_rate, r.queries);
  if (!o.out.empty()) {
    write_text_file(o.out, fidelity_csv(rep));
    log(LogLevel::info, "wrote {}", o.out);
  }
}

void pack(dist::Packer& out, const std::vector<FidelityPartial>& items) {
  for (const FidelityPartial& p : items) {
    out.put(p.reference_max_abs_diff);
    out.put<std::uint64_t>(p.parts.size());
    for (const auto& part : p.parts) {
      out.put<std::uint64_t>(part.size());
      for (const FidelityTally& t : part) {
        out.put_vector(t.rel_err);
        out.put_vector(t.cos);
        out.put(t.bytes);
        out.put(t.fp16_bytes);
        out.put(t.seconds);
        out.put(t.mass_sum);
        out.put(t.selected_sum);
        out.put(t.mass_n);
        out.put(t.selected_n);
        out.put(t.drift_steps);
        out.put(t.drifts);
      }
    }
  }
}

FidelityPartial unpack_item(dist::Unpacker& in) {
  FidelityPartial p;
  p.reference_max_abs_diff = in.get<double>();
  const auto parts = in.get<std::uint64_t>();
  KVCAL_CHECK(parts <= (1u << 24), "MPI message holds {} tally parts", parts);
  for (std::uint64_t i = 0; i < parts; ++i) {
    const auto methods = in.get<std::uint64_t>();
    KVCAL_CHECK(methods <= (1u << 16), "MPI message holds {} methods", methods);
    std::vector<FidelityTally> part(methods);
    for (FidelityTally& t : part) {
      t.rel_err = in.get_vector<double>();
      t.cos = in.get_vector<double>();
      t.bytes = in.get<std::int64_t>();
      t.fp16_bytes = in.get<std::int64_t>();
      t.seconds = in.get<double>();
      t.mass_sum = in.get<double>();
      t.selected_sum = in.get<double>();
      t.mass_n = in.get<std::int64_t>();
      t.selected_n = in.get<std::int64_t>();
      t.drift_steps = in.get<std::int64_t>();
      t.drifts = in.get<std::int64_t>();
    }
    p.parts.push_back(std::move(part));
  }
  return p;
}

// The items (layers of samples, or whole samples with CHESS) split over the
// ranks by weight; each rank reads only its items' layers. Rank 0 gathers
// every item's tallies in item order and reduces them as one process does.
// Returns the report on rank 0 (empty elsewhere).
FidelityReport eval_distributed(dist::Context& ctx, const std::string& dump, const FidelityOptions& opt) {
  std::unique_ptr<FidelityEvaluator> ev;
  ctx.step([&] { ev = std::make_unique<FidelityEvaluator>(dump, opt); });
  std::vector<std::int64_t> weights;
  for (const FidelityItem& it : ev->items()) weights.push_back(it.weight);
  const std::vector<std::size_t> bounds = dist::split_by_weight(weights, ctx.size());
  dist::Packer out;
  ctx.step([&] { pack(out, ev->evaluate(bounds[ctx.rank()], bounds[ctx.rank() + 1], [&] { ctx.poll(); })); });
  const std::vector<std::string> parts = ctx.gather(out.bytes());
  FidelityReport rep;
  ctx.step([&] {
    if (!ctx.root()) return;
    std::vector<FidelityPartial> all;
    all.reserve(ev->items().size());
    for (int r = 0; r < ctx.size(); ++r) {
      dist::Unpacker in(parts[static_cast<std::size_t>(r)]);
      for (std::size_t i = bounds[r]; i < bounds[r + 1]; ++i) all.push_back(unpack_item(in));
      KVCAL_CHECK(in.done(), "rank {} sent more than expected", r);
    }
    rep = ev->reduce(all);
    if (ctx.size() > 1)
      log(LogLevel::info, "gathered {} items of {} samples from {} ranks", all.size(), rep.samples, ctx.size());
  });
  return rep;
}

int run(const Options& o, const Globals&) {
  dist::Context ctx;
  FidelityOptions opt;
  ctx.step([&] {
    require_usage(!o.dump.empty(), "--dump is required");
    if (!o.out.empty() && ctx.root()) check_mask_output_path(o.out);
    KVCAL_CHECK(o.threads >= 0, "--threads {} must be 0 (all cores) or more", o.threads);
    opt.methods = split(o.methods);
    require_usage(!opt.methods.empty(), "--methods lists no method");
  });
  opt.hex.block = o.block;
  opt.hex.recent_window = o.recent;
  opt.hex.hh_ratio = o.hh_ratio;
  opt.hex.sparsity = o.sparsity;
  opt.hex.mode = o.mode == "full" ? runtime::HexMode::full : runtime::HexMode::append;
  opt.h2o_budget = o.h2o_budget;
  opt.bundle = o.bundle;
  opt.mask_seed = o.seed;
  opt.threads = o.threads;
  opt.chess.page_size = o.page_size;
  opt.chess.chunk_pages = o.chunk_pages;
  opt.chess.grid_chunks = o.grid_chunks;
  opt.chess.sink_pages = o.sink_pages;
  opt.chess.recent_pages = o.recent_pages;
  opt.drift_window = o.drift_window;
  const FidelityReport rep = eval_distributed(ctx, o.dump, opt);
  ctx.step([&] {
    if (ctx.root()) report(o, rep);
  });
  return 0;
}

}  // namespace

Runner add_eval_fidelity(CLI::App& app) {
  auto o = std::make_shared<Options>();
  CLI::App* sub =
      app.add_subcommand("eval-fidelity", "Attention error vs KV size of each compression method on recorded Q/K/V");
  sub->footer(kFooter);
  sub->add_option("--dump", o->dump, "kvcal.attention_dump with queries, keys and values");
  sub->add_option("--bundle", o->bundle, "Model bundle whose masks are used first");
  sub->add_option("--methods", o->methods, "Comma-separated methods (see below)")->capture_default_str();
  sub->add_option("--block", o->block, "Streaming block size n_b (tokens)")->capture_default_str();
  sub->add_option("--mode", o->mode, "append (compress each block once) or full (recompress at every block)")
      ->check(CLI::IsMember({"append", "full"}))
      ->capture_default_str();
  sub->add_option("--hh-ratio", o->hh_ratio, "Heavy hitters per block, fraction of its tokens")->capture_default_str();
  sub->add_option("--recent", o->recent, "Recent window kept in fp16 (tokens)")->capture_default_str();
  sub->add_option("--sparsity", o->sparsity, "Expander mask density (ones per row / head dim)")->capture_default_str();
  sub->add_option("--h2o-budget", o->h2o_budget, "h2o-evict: fraction of tokens kept")->capture_default_str();
  sub->add_option("--page-size", o->page_size, "CHESS: tokens per page")->capture_default_str();
  sub->add_option("--chunk-pages", o->chunk_pages, "CHESS: pages per chunk")->capture_default_str();
  sub->add_option("--grid-chunks", o->grid_chunks, "CHESS: chunks per grid")->capture_default_str();
  sub->add_option("--sink-pages", o->sink_pages, "CHESS: first pages always attended")->capture_default_str();
  sub->add_option("--recent-pages", o->recent_pages, "CHESS: last pages always attended (the anchor's window)")
      ->capture_default_str();
  sub->add_option("--drift-window", o->drift_window,
                  "hetero: decode steps per drift check (W; 0: the bundle's profile)")
      ->capture_default_str();
  sub->add_option("--seed", o->seed, "First seed tried when a mask is generated")->capture_default_str();
  sub->add_option("--out", o->out, "CSV report (written atomically)");
  sub->add_option("--threads", o->threads, "Worker threads (0: all cores)")->capture_default_str();
  return [o](const Globals& g) { return run(*o, g); };
}

}  // namespace kvcal::cli
