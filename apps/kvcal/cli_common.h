// Shared pieces of the kvcal command line: each subcommand registers itself
// with a parser and returns the function that runs it.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>

#include <CLI/CLI.hpp>

namespace kvcal::cli {

// Global state the subcommands may read.
struct Globals {
  std::string command_line;  // argv joined, recorded as provenance
  int verbosity = 1;         // 0 quiet, 1 normal, 2 verbose
};

using Runner = std::function<int(const Globals&)>;

// A usage problem found after parsing (a missing or conflicting option):
// reported like a parse error, with exit status 2.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& what) : std::runtime_error(what) {}
};

// Throws UsageError with `message` unless `cond` holds.
inline void require_usage(bool cond, const std::string& message) {
  if (!cond) throw UsageError(message);
}

// Each subcommand: adds itself to `app` and returns its runner.
Runner add_mask_gen(CLI::App& app);
Runner add_mask_certify(CLI::App& app);
Runner add_profile_heads(CLI::App& app);
Runner add_calibrate_entropy(CLI::App& app);
Runner add_bundle(CLI::App& app);
Runner add_validate(CLI::App& app);
Runner add_inspect(CLI::App& app);
Runner add_eval_fidelity(CLI::App& app);

// Joins argv into one shell-quoted string.
std::string join_command_line(int argc, char** argv);

// Formats a duration in seconds for progress lines.
std::string seconds(double s);

}  // namespace kvcal::cli
