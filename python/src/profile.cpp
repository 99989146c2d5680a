// profile_heads and calibrate_entropy: the library drivers kvcal
// profile-heads and kvcal calibrate-entropy run, with the CLI's defaults;
// results as arrays, the artifact written when `out` is given.
#include <filesystem>
#include <optional>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.h"
#include "kvcal/core/error.h"
#include "kvcal/io/entropy_calibration.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/io/masks.h"

namespace kvcal::py {

namespace {

void require_files(const std::vector<std::string>& paths) {
  if (paths.empty()) value_error("no dump files given");
  for (const std::string& p : paths) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec)) throw OsErr{fmt::format("{}: no such file", p)};
  }
}

void check_out(const std::optional<std::string>& out) {
  if (!out) return;
  try {
    check_mask_output_path(*out);
  } catch (const kvcal::Error& e) {
    throw OsErr{e.what()};
  }
}

template <typename T>
auto lh_view(nb::handle self, const std::vector<T>& v, const HeadProfile& p) {
  return view(v.data(), {static_cast<std::size_t>(p.layers), static_cast<std::size_t>(p.kv_heads)}, self);
}

}  // namespace

void bind_profile(nb::module_& m) {
  nb::class_<HeadProfile>(m, "HeadProfile",
                          "HeteroCache head roles and budgets (arrays [layers, kv_heads], read-only views).")
      .def_ro("model", &HeadProfile::model)
      .def_ro("layers", &HeadProfile::layers)
      .def_ro("kv_heads", &HeadProfile::kv_heads)
      .def_ro("q_heads", &HeadProfile::q_heads)
      .def_ro("num_samples", &HeadProfile::num_samples)
      .def_prop_ro("stability",
                   [](nb::handle s) {
                     const auto& p = nb::cast<const HeadProfile&>(s);
                     return lh_view(s, p.stability, p);
                   })
      .def_prop_ro("similarity",
                   [](nb::handle s) {
                     const auto& p = nb::cast<const HeadProfile&>(s);
                     return lh_view(s, p.similarity, p);
                   })
      .def_prop_ro("budget_ratio",
                   [](nb::handle s) {
                     const auto& p = nb::cast<const HeadProfile&>(s);
                     return lh_view(s, p.budget_ratio, p);
                   })
      .def_prop_ro(
          "role",
          [](nb::handle s) {
            const auto& p = nb::cast<const HeadProfile&>(s);
            return lh_view(s, p.role, p);
          },
          "int8: 1 anchor, 2 volatile, 3 pivot, 4 satellite")
      .def_prop_ro("pivot",
                   [](nb::handle s) {
                     const auto& p = nb::cast<const HeadProfile&>(s);
                     return lh_view(s, p.pivot, p);
                   })
      .def_prop_ro("pairwise",
                   [](nb::handle s) {
                     const auto& p = nb::cast<const HeadProfile&>(s);
                     const auto L = static_cast<std::size_t>(p.layers), H = static_cast<std::size_t>(p.kv_heads);
                     return view(p.pairwise.data(), {L, H, H}, s);
                   })
      .def_prop_ro("tau_drift", [](const HeadProfile& p) { return p.options.tau_drift; })
      .def_ro("dump_sha256", &HeadProfile::dump_sha256);

  m.def(
      "profile_heads",
      [](const std::vector<std::string>& dumps, double tau_stable, double tau_sim, std::optional<double> tau_drift,
         std::int64_t drift_window, std::int64_t topk, double topk_frac, std::int64_t pool, double budget,
         const std::string& gqa, const std::string& order, int threads, std::optional<std::string> out,
         const std::string& command_line) {
        HeadProfileOptions opt;
        opt.overlap.pool_kernel = pool;
        opt.overlap.topk = topk;
        opt.overlap.topk_frac = topk_frac;
        opt.overlap.threads = threads;
        opt.taxonomy.tau_stable = tau_stable;
        opt.taxonomy.tau_sim = tau_sim;
        opt.taxonomy.order = parse_taxonomy_order(order);
        opt.budget.budget = budget;
        opt.gqa = parse_gqa_reduce(gqa);
        opt.tau_drift = tau_drift.value_or(-1);
        opt.drift_window = drift_window;
        if (drift_window < 1 || drift_window > (1 << 20)) {
          value_error("drift_window {} must lie in [1, 2^20]", drift_window);
        }
        if (tau_drift && !(*tau_drift >= 0 && *tau_drift <= 1))
          value_error("tau_drift {} must lie in [0, 1]", *tau_drift);
        if (threads < 0) value_error("threads {} must be 0 (all cores) or more", threads);
        require_files(dumps);
        check_out(out);
        nb::gil_scoped_release release;
        HeadProfile p = profile_heads(dumps, opt);
        if (out) write_head_profile(*out, p, command_line);
        return p;
      },
      nb::arg("dumps"), nb::kw_only(), nb::arg("tau_stable") = 0.5, nb::arg("tau_sim") = 0.5,
      nb::arg("tau_drift") = nb::none(), nb::arg("drift_window") = 8, nb::arg("topk") = 1024,
      nb::arg("topk_frac") = 0.0, nb::arg("pool") = 5, nb::arg("budget") = 0.5, nb::arg("gqa") = "mean",
      nb::arg("order") = "appendix", nb::arg("threads") = 0, nb::arg("out") = nb::none(),
      nb::arg("command_line") = "kvcal (Python) profile_heads",
      "HeteroCache head roles and budgets from attention dumps, as `kvcal profile-heads` (same defaults).\n"
      "Writes the kvcal.head_profile artifact to `out` when given.");

  m.def(
      "read_head_profile",
      [](const std::string& path) {
        require_files({path});
        nb::gil_scoped_release release;
        return read_head_profile(path);
      },
      nb::arg("path"), "Reads a kvcal.head_profile file.");

  nb::class_<EntropyCalibration>(m, "EntropyCalibration", "CHESS re-selection thresholds and the page statistics.")
      .def_ro("entropy_threshold", &EntropyCalibration::entropy_threshold)
      .def_ro("varentropy_threshold", &EntropyCalibration::varentropy_threshold)
      .def_ro("trigger_rate", &EntropyCalibration::trigger_rate)
      .def_ro("num_pages", &EntropyCalibration::num_pages)
      .def_ro("num_tokens", &EntropyCalibration::num_tokens)
      .def_prop_ro("page_entropy",
                   [](nb::handle s) {
                     const auto& c = nb::cast<const EntropyCalibration&>(s);
                     return view(c.page_entropy.data(), {c.page_entropy.size()}, s);
                   })
      .def_prop_ro("page_varentropy",
                   [](nb::handle s) {
                     const auto& c = nb::cast<const EntropyCalibration&>(s);
                     return view(c.page_varentropy.data(), {c.page_varentropy.size()}, s);
                   })
      .def_prop_ro("entropy_edges",
                   [](nb::handle s) {
                     const auto& c = nb::cast<const EntropyCalibration&>(s);
                     return view(c.entropy_edges.data(), {c.entropy_edges.size()}, s);
                   })
      .def_prop_ro("varentropy_edges",
                   [](nb::handle s) {
                     const auto& c = nb::cast<const EntropyCalibration&>(s);
                     return view(c.varentropy_edges.data(), {c.varentropy_edges.size()}, s);
                   })
      .def_prop_ro("histogram",
                   [](nb::handle s) {
                     const auto& c = nb::cast<const EntropyCalibration&>(s);
                     const auto b = static_cast<std::size_t>(c.options.bins);
                     return view(c.histogram.data(), {b, b}, s);
                   })
      .def_ro("input_sha256", &EntropyCalibration::input_sha256)
      .def_ro("sources", &EntropyCalibration::sources);

  m.def(
      "calibrate_entropy",
      [](const std::vector<std::string>& dumps, std::int64_t page_size, double percentile, const std::string& rule,
         const std::string& page_varentropy, const std::string& unit, const std::string& partial_pages,
         std::int64_t bins, int threads, std::optional<std::string> out, const std::string& command_line) {
        if (threads < 0) value_error("threads {} must be 0 (all cores) or more", threads);
        if (partial_pages != "drop" && partial_pages != "keep") {
          value_error("partial_pages '{}': use drop or keep", partial_pages);
        }
        EntropyOptions opt;
        opt.page.page_size = page_size;
        opt.page.varentropy = parse_page_varentropy(page_varentropy);
        opt.page.keep_partial = partial_pages == "keep";
        opt.percentile = percentile;
        opt.rule = parse_trigger_rule(rule);
        opt.unit = parse_entropy_unit(unit);
        opt.bins = bins;
        opt.threads = threads;
        require_files(dumps);
        check_out(out);
        nb::gil_scoped_release release;
        EntropyCalibration c = calibrate_entropy(dumps, opt);
        if (out) write_entropy_calibration(*out, c, command_line);
        return c;
      },
      nb::arg("dumps"), nb::kw_only(), nb::arg("page_size") = 32, nb::arg("percentile") = 99.0, nb::arg("rule") = "and",
      nb::arg("page_varentropy") = "mean", nb::arg("unit") = "nats", nb::arg("partial_pages") = "drop",
      nb::arg("bins") = 64, nb::arg("threads") = 0, nb::arg("out") = nb::none(),
      nb::arg("command_line") = "kvcal (Python) calibrate_entropy",
      "CHESS entropy/varentropy thresholds from dumps, as `kvcal calibrate-entropy` (same defaults).\n"
      "Writes the kvcal.entropy_calibration artifact to `out` when given.");
}

}  // namespace kvcal::py
