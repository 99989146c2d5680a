// kvcal: offline calibration and mask synthesis for KV-cache compression.
#include <cstdio>
#include <exception>
#include <map>
#include <new>

#include <fmt/format.h>

#include "cli_common.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/core/version.h"

namespace {

constexpr const char* kFooter = R"(Examples:
  kvcal mask-gen --rows 4096 --cols 128 --sparsity 0.03125 --out masks.h5
  kvcal mask-certify masks.h5
  kvcal profile-heads dump.h5 --topk-frac 0.1 --out heads.h5
  kvcal calibrate-entropy dump.h5 --out entropy.h5
  kvcal bundle --model NAME --masks masks.h5 --heads heads.h5 --entropy entropy.h5 --out NAME.kvcal.h5
  kvcal validate NAME.kvcal.h5
  kvcal inspect NAME.kvcal.h5 --json
  kvcal mask-gen --config recipe.toml      (options from a TOML file, section [mask-gen])

Exit status: 0 success, 1 failure (bad input, I/O, a false claim), 2 usage error.
Run 'kvcal <command> --help' for a command's options.)";

}  // namespace

int main(int argc, char** argv) {
  using namespace kvcal;
  cli::Globals globals;
  globals.command_line = cli::join_command_line(argc, argv);

  CLI::App app{"kvcal: certified expander masks and calibration artifacts for KV-cache compression", "kvcal"};
  app.footer(kFooter);
  app.set_version_flag("--version",
                       fmt::format("kvcal {} (CUDA: {})", kVersion, KVCAL_ENABLE_CUDA ? "enabled" : "disabled"));
  app.require_subcommand(1);
  // Global options (--config, -q, -v) are accepted after the subcommand too.
  app.fallthrough();
  bool quiet = false, verbose = false;
  app.add_flag("-q,--quiet", quiet, "Print only results and errors");
  app.add_flag("-v,--verbose", verbose, "Print debug diagnostics");
  app.set_config("--config", "", "Read options from a TOML file (one [section] per subcommand)");

  std::map<CLI::App*, cli::Runner> runners;
  auto add = [&](cli::Runner (*adder)(CLI::App&)) {
    cli::Runner r = adder(app);
    runners[app.get_subcommands({}).back()] = std::move(r);
  };
  add(&cli::add_mask_gen);
  add(&cli::add_mask_certify);
  add(&cli::add_profile_heads);
  add(&cli::add_calibrate_entropy);
  add(&cli::add_bundle);
  add(&cli::add_validate);
  add(&cli::add_inspect);

  std::string which = "kvcal";
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
      return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
      return app.exit(e);
    } catch (const CLI::CallForVersion& e) {
      return app.exit(e);
    } catch (const CLI::ParseError& e) {
      const auto subs = app.get_subcommands();
      const std::string name = subs.empty() ? "kvcal" : "kvcal " + subs.front()->get_name();
      std::fprintf(stderr, "%s: %s (run '%s --help')\n", name.c_str(), e.what(), name.c_str());
      return 2;
    }
    globals.verbosity = quiet ? 0 : verbose ? 2 : 1;
    set_log_callback([v = globals.verbosity](LogLevel level, std::string_view msg) {
      const int rank = static_cast<int>(level);
      if ((v == 0 && level != LogLevel::warn) || (v == 1 && rank < static_cast<int>(LogLevel::info))) return;
      std::fprintf(stderr, "%s%.*s\n", level == LogLevel::warn ? "warning: " : "", static_cast<int>(msg.size()),
                   msg.data());
    });
    CLI::App* sub = app.get_subcommands().front();
    which = "kvcal " + sub->get_name();
    return runners.at(sub)(globals);
  } catch (const cli::UsageError& e) {
    std::fprintf(stderr, "%s: %s (run '%s --help')\n", which.c_str(), e.what(), which.c_str());
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", which.c_str(), e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: error: out of memory (try a smaller shape or fewer threads)\n", which.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", which.c_str(), e.what());
  }
  return 1;
}
