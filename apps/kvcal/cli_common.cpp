#include "cli_common.h"

#include <fmt/format.h>

namespace kvcal::cli {

std::string join_command_line(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i > 0) out += ' ';
    const bool plain =
        !arg.empty() &&
        arg.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") ==
            std::string::npos;
    if (plain) {
      out += arg;
    } else {
      out += '\'';
      for (char c : arg) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
  }
  return out;
}

std::string seconds(double s) { return s < 1 ? fmt::format("{:.0f} ms", s * 1e3) : fmt::format("{:.2f} s", s); }

}  // namespace kvcal::cli
