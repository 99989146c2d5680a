#include "kvcal/core/log.h"

#include <mutex>

namespace kvcal {
namespace {
std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}
LogCallback& log_callback() {
  static LogCallback cb;
  return cb;
}
}  // namespace

void set_log_callback(LogCallback callback) {
  std::lock_guard<std::mutex> lock(log_mutex());
  log_callback() = std::move(callback);
}

void log_message(LogLevel level, std::string_view message) {
  std::lock_guard<std::mutex> lock(log_mutex());
  if (log_callback()) log_callback()(level, message);
}

}  // namespace kvcal
