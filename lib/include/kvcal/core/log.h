// Logging: the library never prints. It reports progress and diagnostics
// through a callback that the caller sets (the CLI sends them to stderr).
#pragma once

#include <functional>
#include <string_view>
#include <utility>

#include <fmt/format.h>

namespace kvcal {

enum class LogLevel { debug = 0, info = 1, warn = 2 };

using LogCallback = std::function<void(LogLevel, std::string_view)>;

// Sets the process-wide log callback (nullptr silences the library).
void set_log_callback(LogCallback callback);

// Sends one message to the callback, if one is set. Thread-safe.
void log_message(LogLevel level, std::string_view message);

template <typename... Args>
void log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  log_message(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kvcal
