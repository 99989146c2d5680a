// kvcal bundle / validate / inspect: one checked artifact per model.
#include <memory>

#include <fmt/format.h>

#include "cli_common.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/io/bundle.h"
#include "kvcal/io/validate.h"

namespace kvcal::cli {

Runner add_bundle(CLI::App& app) {
  auto in = std::make_shared<BundleInputs>();
  auto out = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand("bundle", "Bundle masks, head profile and entropy thresholds for one model");
  sub->footer(R"(Examples:
  kvcal bundle --model SmolLM2-135M --masks masks.h5 --heads heads.h5 --entropy entropy.h5 --out smollm2.kvcal.h5
  kvcal bundle --model llama-3-8b --masks block.h5 --masks long.h5 --heads heads.h5 --entropy entropy.h5 \
               --model-config config.json --out llama.kvcal.h5

Every input is validated first (kvcal validate). With --model-config (a HuggingFace
config.json) the head profile must be num_hidden_layers x num_key_value_heads and
every mask must have head_dim channels. The manifest records each part's source,
SHA-256, format version and parameters, and the SHA-256 of every dataset.
The finished file is sealed: the SHA-256 of the whole file in its first 512
bytes (the HDF5 user block), checked by kvcal validate, inspect and the runtime.)");
  sub->add_option("--model", in->model, "The model the bundle is for (recorded)");
  sub->add_option("--masks", in->masks, "kvcal.masks file (repeatable)");
  sub->add_option("--heads", in->heads, "kvcal.head_profile file");
  sub->add_option("--entropy", in->entropy, "kvcal.entropy_calibration file");
  sub->add_option("--model-config", in->model_config, "HuggingFace config.json to check the shapes against");
  sub->add_option("--out", *out, "Output bundle (written atomically)");
  return [in, out](const Globals& g) {
    require_usage(!out->empty(), "--out is required");
    require_usage(!in->model.empty(), "--model is required");
    require_usage(!in->masks.empty() && !in->heads.empty() && !in->entropy.empty(),
                  "--masks, --heads and --entropy are required");
    write_bundle(*out, *in, g.command_line);
    fmt::print("{}", inspect_artifact(*out, false));
    log(LogLevel::info, "wrote the bundle to {}", *out);
    return 0;
  };
}

Runner add_validate(CLI::App& app) {
  auto files = std::make_shared<std::vector<std::string>>();
  CLI::App* sub = app.add_subcommand("validate", "Check kvcal artifacts against their schemas and checksums");
  sub->footer(R"(Examples:
  kvcal validate smollm2.kvcal.h5
  kvcal validate masks.h5 heads.h5 entropy.h5 data/smollm2_attention.h5

Checks required groups, datasets and attributes, dtypes, ranks, shape relations
and value ranges (schemas/), the CSR invariants and claimed degrees, role/pivot/
budget consistency, histogram totals, and for bundles every manifest checksum.
A bundle's integrity seal (the SHA-256 of the whole file, format_version 2 on)
is checked first, with plain reads, before libhdf5 opens the file.
Lists every violation; exits 0 only when every file is valid.)");
  sub->add_option("files", *files, "kvcal artifacts (masks, dump, head profile, entropy calibration, bundle)")
      ->required();
  return [files](const Globals&) {
    int bad = 0;
    for (const auto& path : *files) {
      const ValidationReport r = validate_artifact(path);
      if (r.ok()) {
        // Bundles say what their integrity seal gave (checked before libhdf5 read them).
        const bool bundle = r.format == kBundleFormat;
        fmt::print("{}: valid {} v{}{}\n", path, r.format, r.format_version,
                   !bundle                    ? std::string()
                   : r.integrity == "no seal" ? std::string(", no seal (written before format_version 2)")
                                              : ", " + r.integrity);
      } else {
        ++bad;
        fmt::print("{}: INVALID{} ({} problem{})\n", path, r.format.empty() ? "" : " " + r.format, r.problems.size(),
                   r.problems.size() == 1 ? "" : "s");
        for (const auto& p : r.problems) fmt::print("  - {}\n", p);
      }
    }
    return bad == 0 ? 0 : 1;
  };
}

Runner add_inspect(CLI::App& app) {
  auto file = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  CLI::App* sub = app.add_subcommand("inspect", "Summarize any kvcal artifact");
  sub->footer(R"(Examples:
  kvcal inspect smollm2.kvcal.h5
  kvcal inspect heads.h5 --json | python3 -m json.tool)");
  sub->add_option("file", *file, "kvcal artifact")->required();
  sub->add_flag("--json", *json, "Machine-readable JSON instead of text");
  return [file, json](const Globals&) {
    fmt::print("{}", inspect_artifact(*file, *json));
    return 0;
  };
}

}  // namespace kvcal::cli
