#include "kvcal/io/entropy_calibration.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/ranges.h>

#include "io/bundle_internal.h"
#include "io/h5.h"
#include "kvcal/core/half.h"
#include "kvcal/core/log.h"
#include "kvcal/core/sha256.h"
#include "kvcal/io/attention_dump.h"

namespace kvcal {

using detail::H5Handle;

const char* to_string(EntropyUnit u) { return u == EntropyUnit::nats ? "nats" : "bits"; }
EntropyUnit parse_entropy_unit(const std::string& name) {
  if (name == "nats") return EntropyUnit::nats;
  if (name == "bits") return EntropyUnit::bits;
  fail("unknown unit '{}': use nats or bits", name);
}

bool triggers(double e, double v, double te, double tv, TriggerRule rule) {
  return rule == TriggerRule::both ? (e > te && v > tv) : (e > te || v > tv);
}

namespace {

// Token statistics of one sample: from logits when present, else the stored
// per-token statistics. `expected` is N + T (0 when unknown).
void sample_token_stats(hid_t g, const std::string& ctx, std::int64_t expected, int threads,
                        std::vector<double>& entropy, std::vector<double>& varentropy, std::string& source) {
  if (detail::has_link(g, "logits")) {
    source = "logits";
    const std::string dctx = ctx + ", dataset 'logits'";
    H5Handle ds = detail::open_dataset(g, "logits", ctx);
    const detail::DatasetInfo info = detail::dataset_info(ds.get());
    KVCAL_CHECK(info.type_class == H5T_FLOAT && info.float_kind != detail::FloatKind::other,
                "{}: must be float16 or float32", dctx);
    KVCAL_CHECK(info.dims.size() == 2, "{}: must be [N+T, V], has rank {}", dctx, info.dims.size());
    const std::int64_t rows = info.dims[0], v = info.dims[1];
    KVCAL_CHECK(v >= 1, "{}: V = 0 (no vocabulary entries)", dctx);
    KVCAL_CHECK(expected == 0 || rows == expected, "{}: {} rows, but N + T = {}", dctx, rows, expected);
    entropy.resize(static_cast<std::size_t>(rows));
    varentropy.resize(static_cast<std::size_t>(rows));
    // Row blocks of about 64 MB of floats.
    const std::int64_t block = std::max<std::int64_t>(1, (std::int64_t{16} << 20) / v);
    std::vector<std::uint16_t> half;
    std::vector<float> single, rows_f;
    for (std::int64_t r0 = 0; r0 < rows; r0 += block) {
      const std::int64_t nr = std::min(block, rows - r0);
      const bool is_half = detail::read_raw_float_block(ds.get(), {r0, 0}, {nr, v}, half, single, dctx);
      const float* data = single.data();
      if (is_half) {
        rows_f.resize(static_cast<std::size_t>(nr * v));
        fp16::to_floats(half.data(), nr * v, rows_f.data());
        data = rows_f.data();
      }
      try {
        token_stats_rows(data, nr, v, entropy.data() + r0, varentropy.data() + r0, threads, r0);
      } catch (const Error& e) {
        fail("{}: {}", dctx, e.what());
      }
    }
    return;
  }
  source = "token_stats";
  KVCAL_CHECK(detail::has_link(g, "token_entropy") && detail::has_link(g, "token_varentropy"),
              "{}: has neither 'logits' nor 'token_entropy' and 'token_varentropy' (record with --logits or "
              "--token-stats)",
              ctx);
  for (auto [name, out] : {std::pair<const char*, std::vector<double>*>{"token_entropy", &entropy},
                           std::pair<const char*, std::vector<double>*>{"token_varentropy", &varentropy}}) {
    H5Handle ds = detail::open_dataset(g, name, ctx);
    const detail::DatasetInfo info = detail::dataset_info(ds.get());
    const std::string dctx = fmt::format("{}, dataset '{}'", ctx, name);
    KVCAL_CHECK(info.type_class == H5T_FLOAT && info.dims.size() == 1, "{}: must be a float vector [N+T]", dctx);
    KVCAL_CHECK(expected == 0 || info.dims[0] == expected, "{}: {} values, but N + T = {}", dctx, info.dims[0],
                expected);
    *out = detail::read_dataset<double>(g, name, info.dims, ctx);
    for (std::size_t i = 0; i < out->size(); ++i) {
      KVCAL_CHECK(std::isfinite((*out)[i]) && (*out)[i] >= 0, "{}: position {} holds {} (must be finite and >= 0)",
                  dctx, i, (*out)[i]);
    }
  }
  KVCAL_CHECK(entropy.size() == varentropy.size(), "{}: token_entropy has {} values, token_varentropy {}", ctx,
              entropy.size(), varentropy.size());
}

std::vector<double> edges(const std::vector<double>& v, std::int64_t bins) {
  double lo = *std::min_element(v.begin(), v.end()), hi = *std::max_element(v.begin(), v.end());
  if (hi <= lo) hi = lo + 1e-12 + std::abs(lo) * 1e-12;
  std::vector<double> e(static_cast<std::size_t>(bins + 1));
  for (std::int64_t i = 0; i <= bins; ++i) e[i] = lo + (hi - lo) * static_cast<double>(i) / static_cast<double>(bins);
  e.back() = hi;
  return e;
}

std::int64_t bin_of(double x, const std::vector<double>& e) {
  const auto bins = static_cast<std::int64_t>(e.size()) - 1;
  const auto it = std::upper_bound(e.begin(), e.end(), x);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(it - e.begin()) - 1, 0, bins - 1);
}

}  // namespace

namespace {

void check_entropy_options(const EntropyOptions& o) {
  KVCAL_CHECK(o.page.page_size >= 1 && o.page.page_size <= (1 << 20), "--page-size {} must lie in [1, 2^20]",
              o.page.page_size);
  KVCAL_CHECK(o.percentile > 0 && o.percentile < 100, "--percentile {} must lie in (0, 100)", o.percentile);
  KVCAL_CHECK(o.bins >= 1 && o.bins <= 4096, "--bins {} must lie in [1, 4096]", o.bins);
}

}  // namespace

std::vector<EntropySampleRef> list_entropy_samples(const std::vector<std::string>& paths, const EntropyOptions& o) {
  KVCAL_CHECK(!paths.empty(), "no attention dump given");
  check_entropy_options(o);
  std::vector<EntropySampleRef> out;
  for (std::size_t f = 0; f < paths.size(); ++f) {
    std::int64_t version = 0;
    H5Handle file = detail::open_artifact(paths[f], kAttentionDumpFormat, kAttentionDumpFormatVersion, &version);
    H5Handle root = detail::open_group(file.get(), "samples", paths[f]);
    const auto names = detail::list_links(root.get());
    KVCAL_CHECK(!names.empty(), "{}: no samples under /samples", paths[f]);
    for (const auto& name : names) {
      // The weight is only a hint for splitting work; a malformed sample is
      // reported, with its full context, when its pages are computed.
      std::int64_t weight = 1;
      try {
        H5Handle g = detail::open_group(root.get(), name, paths[f]);
        const char* ds = detail::has_link(g.get(), "logits")          ? "logits"
                         : detail::has_link(g.get(), "token_entropy") ? "token_entropy"
                                                                      : nullptr;
        if (ds != nullptr) {
          H5Handle d = detail::open_dataset(g.get(), ds, paths[f]);
          for (std::int64_t n : detail::dataset_info(d.get()).dims) {
            weight = std::min<std::int64_t>(weight * std::clamp<std::int64_t>(n, 1, std::int64_t{1} << 31),
                                            std::int64_t{1} << 50);
          }
        }
      } catch (const Error&) {
      }
      out.push_back({f, name, weight});
    }
  }
  return out;
}

EntropySamplePages entropy_sample_pages(const std::string& path, const std::string& name, const EntropyOptions& o) {
  const double scale_h = o.unit == EntropyUnit::bits ? 1.0 / std::log(2.0) : 1.0;
  std::int64_t version = 0;
  H5Handle file = detail::open_artifact(path, kAttentionDumpFormat, kAttentionDumpFormatVersion, &version);
  H5Handle root = detail::open_group(file.get(), "samples", path);
  const std::string ctx = fmt::format("{}: sample '{}'", path, name);
  H5Handle g = detail::open_group(root.get(), name, path);
  std::int64_t expected = 0;
  if (detail::has_attr(g.get(), "prompt_len") && detail::has_link(g.get(), "decode")) {
    H5Handle ds = detail::open_dataset(g.get(), "decode", ctx);
    const auto info = detail::dataset_info(ds.get());
    if (!info.dims.empty()) expected = detail::read_attr_int(g.get(), "prompt_len", ctx) + info.dims[0];
  }
  std::vector<double> h, v;
  EntropySamplePages out;
  sample_token_stats(g.get(), ctx, expected, o.threads, h, v, out.source);
  for (auto& x : h) x *= scale_h;
  for (auto& x : v) x *= scale_h * scale_h;
  page_stats(h, v, o.page, out.page_entropy, out.page_varentropy);
  out.tokens = static_cast<std::int64_t>(h.size());
  return out;
}

EntropyCalibration finish_entropy_calibration(const EntropyOptions& o, const std::vector<EntropySamplePages>& samples,
                                              std::vector<std::string> input_sha256) {
  check_entropy_options(o);
  EntropyCalibration c;
  c.options = o;
  for (const EntropySamplePages& s : samples) {
    KVCAL_CHECK(s.page_entropy.size() == s.page_varentropy.size(), "finish_entropy_calibration: page counts differ");
    c.page_entropy.insert(c.page_entropy.end(), s.page_entropy.begin(), s.page_entropy.end());
    c.page_varentropy.insert(c.page_varentropy.end(), s.page_varentropy.begin(), s.page_varentropy.end());
    c.num_tokens += s.tokens;
    c.sources.push_back(s.source);
  }
  c.input_sha256 = std::move(input_sha256);
  c.num_pages = static_cast<std::int64_t>(c.page_entropy.size());
  KVCAL_CHECK(c.num_pages > 0,
              "no complete page of {} tokens in {} tokens; lower --page-size or pass --partial-pages keep",
              o.page.page_size, c.num_tokens);
  c.entropy_threshold = percentile(c.page_entropy, o.percentile);
  c.varentropy_threshold = percentile(c.page_varentropy, o.percentile);
  std::int64_t fired = 0;
  for (std::int64_t i = 0; i < c.num_pages; ++i) {
    fired += triggers(c.page_entropy[i], c.page_varentropy[i], c.entropy_threshold, c.varentropy_threshold, o.rule);
  }
  c.trigger_rate = static_cast<double>(fired) / static_cast<double>(c.num_pages);
  c.entropy_edges = edges(c.page_entropy, o.bins);
  c.varentropy_edges = edges(c.page_varentropy, o.bins);
  c.histogram.assign(static_cast<std::size_t>(o.bins * o.bins), 0.0);
  for (std::int64_t i = 0; i < c.num_pages; ++i) {
    c.histogram[bin_of(c.page_entropy[i], c.entropy_edges) * o.bins +
                bin_of(c.page_varentropy[i], c.varentropy_edges)] += 1;
  }
  return c;
}

EntropyCalibration calibrate_entropy(const std::vector<std::string>& paths, const EntropyOptions& o) {
  const std::vector<EntropySampleRef> refs = list_entropy_samples(paths, o);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<EntropySamplePages> pages;
  for (const EntropySampleRef& r : refs) {
    pages.push_back(entropy_sample_pages(paths[r.file], r.name, o));
    log(LogLevel::info, "{}: sample '{}': {} tokens from {}, {} pages ({:.1f} s)", paths[r.file], r.name,
        pages.back().tokens, pages.back().source, pages.back().page_entropy.size(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<std::string> sha;
  for (const auto& path : paths) sha.push_back(sha256_file(path));
  return finish_entropy_calibration(o, pages, std::move(sha));
}

void write_entropy_calibration(const std::string& path, const EntropyCalibration& c, const std::string& command_line) {
  detail::write_atomically(path, [&](hid_t f) {
    detail::write_provenance(f, kEntropyFormat, kEntropyFormatVersion, command_line);
    detail::write_attr(f, "page_size", c.options.page.page_size);
    detail::write_attr(f, "percentile", c.options.percentile);
    detail::write_attr(f, "unit", std::string(to_string(c.options.unit)));
    detail::write_attr(f, "page_varentropy", std::string(to_string(c.options.page.varentropy)));
    detail::write_attr(f, "partial_pages", std::string(c.options.page.keep_partial ? "keep" : "drop"));
    detail::write_attr(f, "rule", std::string(to_string(c.options.rule)));
    detail::write_attr(f, "entropy_threshold", c.entropy_threshold);
    detail::write_attr(f, "varentropy_threshold", c.varentropy_threshold);
    detail::write_attr(f, "trigger_rate", c.trigger_rate);
    detail::write_attr(f, "num_pages", c.num_pages);
    detail::write_attr(f, "num_tokens", c.num_tokens);
    detail::write_attr(f, "input_sha256", fmt::format("{}", fmt::join(c.input_sha256, ",")));
    detail::write_attr(f, "token_sources", fmt::format("{}", fmt::join(c.sources, ",")));
    const auto bins = static_cast<std::int64_t>(c.entropy_edges.size()) - 1;
    detail::write_dataset(f, "histogram", {bins, bins}, c.histogram.data());
    detail::write_dataset(f, "entropy_edges", {bins + 1}, c.entropy_edges.data());
    detail::write_dataset(f, "varentropy_edges", {bins + 1}, c.varentropy_edges.data());
    detail::write_dataset(f, "page_entropy", {c.num_pages}, c.page_entropy.data());
    detail::write_dataset(f, "page_varentropy", {c.num_pages}, c.page_varentropy.data());
  });
}

EntropyCalibration read_entropy_calibration(const std::string& path) {
  std::int64_t version = 0;
  H5Handle file = detail::open_artifact(path, kEntropyFormat, kEntropyFormatVersion, &version);
  return detail::read_entropy_calibration(file.get(), path);
}

EntropyCalibration detail::read_entropy_calibration(hid_t f, const std::string& path) {
  EntropyCalibration c;
  auto& o = c.options;
  o.page.page_size = detail::read_attr_int(f, "page_size", path);
  o.percentile = detail::read_attr_double(f, "percentile", path);
  o.unit = parse_entropy_unit(detail::read_attr_string(f, "unit", path));
  o.page.varentropy = parse_page_varentropy(detail::read_attr_string(f, "page_varentropy", path));
  o.page.keep_partial = detail::read_attr_string(f, "partial_pages", path) == "keep";
  o.rule = parse_trigger_rule(detail::read_attr_string(f, "rule", path));
  c.entropy_threshold = detail::read_attr_double(f, "entropy_threshold", path);
  c.varentropy_threshold = detail::read_attr_double(f, "varentropy_threshold", path);
  c.trigger_rate = detail::read_attr_double(f, "trigger_rate", path);
  c.num_pages = detail::read_attr_int(f, "num_pages", path);
  c.num_tokens = detail::read_attr_int(f, "num_tokens", path);
  KVCAL_CHECK(c.num_pages >= 1 && c.num_pages <= (std::int64_t{1} << 40), "{}: num_pages = {} out of range", path,
              c.num_pages);
  H5Handle e = detail::open_dataset(f, "entropy_edges", path);
  const auto info = detail::dataset_info(e.get());
  KVCAL_CHECK(info.dims.size() == 1 && info.dims[0] >= 2 && info.dims[0] <= 4097, "{}: entropy_edges has a bad shape",
              path);
  const std::int64_t bins = info.dims[0] - 1;
  o.bins = bins;
  c.entropy_edges = detail::read_dataset<double>(f, "entropy_edges", {bins + 1}, path);
  c.varentropy_edges = detail::read_dataset<double>(f, "varentropy_edges", {bins + 1}, path);
  c.histogram = detail::read_dataset<double>(f, "histogram", {bins, bins}, path);
  c.page_entropy = detail::read_dataset<double>(f, "page_entropy", {c.num_pages}, path);
  c.page_varentropy = detail::read_dataset<double>(f, "page_varentropy", {c.num_pages}, path);
  return c;
}

}  // namespace kvcal

namespace kvcal {

std::string read_token_stats(const std::string& path, const std::string& sample, std::int64_t expected,
                             std::vector<double>& entropy, std::vector<double>& varentropy) {
  std::int64_t version = 0;
  H5Handle file = detail::open_artifact(path, kAttentionDumpFormat, kAttentionDumpFormatVersion, &version);
  H5Handle root = detail::open_group(file.get(), "samples", path);
  H5Handle g = detail::open_group(root.get(), sample, path);
  std::string source;
  sample_token_stats(g.get(), fmt::format("{}: sample '{}'", path, sample), expected, 1, entropy, varentropy, source);
  return source;
}

}  // namespace kvcal
