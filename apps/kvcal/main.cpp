// kvcal: offline calibration and mask synthesis for KV-cache compression.
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <new>

#include <fmt/format.h>

#include "cli_common.h"
#include "dist.h"
#include "kvcal/core/error.h"
#include "kvcal/core/log.h"
#include "kvcal/core/version.h"
#include "kvcal/io/temp_files.h"
#include "kvcal/runtime/common.h"

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

// Prints the exception in flight as one line on stderr; returns the exit
// status: 2 for usage errors, 1 for everything else.
int report_exception(const std::string& which) {
  try {
    throw;
  } catch (const kvcal::cli::dist::Failed& e) {
    return e.status;  // rank 0 has reported the error
  } catch (const kvcal::cli::UsageError& e) {
    std::fprintf(stderr, "%s: %s (run '%s --help')\n", which.c_str(), e.what(), which.c_str());
    return 2;
  } catch (const kvcal::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", which.c_str(), e.what());
  } catch (const kvcal::runtime::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", which.c_str(), e.what());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: error: out of memory (try a smaller shape or fewer threads)\n", which.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", which.c_str(), e.what());
  }
  return 1;
}

// Runs a command in a child process. Every input is untrusted and the HDF5
// library (not kvcal) can crash on some damaged files; then the parent removes
// any temporary file the child left and reports one error line instead of a
// signal. KVCAL_NO_ISOLATION=1 runs in-process (for debuggers).
int run_isolated(const std::string& which, const std::function<int()>& command) {
  const char* off = std::getenv("KVCAL_NO_ISOLATION");
  int fds[2];
  if ((off && std::string(off) == "1") || pipe(fds) != 0) return command();
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return command();
  }
  if (pid == 0) {
    close(fds[0]);
    kvcal::set_temp_file_observer([fd = fds[1]](const std::string& path) {
      const std::string line = path + "\n";
      [[maybe_unused]] const auto n = write(fd, line.data(), line.size());
    });
    int rc = 1;
    try {
      rc = command();
    } catch (...) {
      rc = report_exception(which);
    }
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(rc);
  }
  close(fds[1]);
  std::string temps;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    temps.append(buf, static_cast<std::size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  std::size_t start = 0;
  for (std::size_t end; (end = temps.find('\n', start)) != std::string::npos; start = end + 1) {
    std::remove(temps.substr(start, end - start).c_str());
  }
  const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
  std::fprintf(stderr,
               "%s: error: the input could not be read safely (the reader died with signal %d, %s; a damaged "
               "or hostile file?); nothing was written\n",
               which.c_str(), sig, strsignal(sig));
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvcal;
  cli::Globals globals;
  globals.command_line = cli::join_command_line(argc, argv);

  CLI::App app{"kvcal: certified expander masks and calibration artifacts for KV-cache compression", "kvcal"};
  app.footer(kFooter);
  // The CPU kernels named are the ones the runtime dispatches to on this host
  // (the same binary reports another target on another CPU).
  app.set_version_flag("--version", fmt::format("kvcal {} (CUDA: {}; {}; CPU kernels: {})", kVersion,
                                                KVCAL_ENABLE_CUDA ? "enabled" : "disabled", cli::dist::describe(),
                                                runtime::simd_target()));
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
  add(&cli::add_eval_fidelity);

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
    // Under an MPI launcher the commands that split their work over ranks run
    // in the process the launcher started: MPI must be initialised there, and
    // mpirun must see (and signal) the process that does the work. They still
    // leave no partial file: only rank 0 writes, after every read (see dist.h).
    // eval-fidelity is not split yet: under more than one rank it refuses.
    const bool distributed = sub->get_name() == "profile-heads" || sub->get_name() == "calibrate-entropy" ||
                             sub->get_name() == "mask-gen" || sub->get_name() == "eval-fidelity";
    if (distributed && cli::dist::launched()) {
      cli::dist::set_error_reporter([which](std::exception_ptr e) {
        try {
          std::rethrow_exception(e);
        } catch (...) {
          return report_exception(which);
        }
      });
      return runners.at(sub)(globals);
    }
    return run_isolated(which, [&] { return runners.at(sub)(globals); });
  } catch (...) {
    return report_exception(which);
  }
}
