// kvcal::Error and the KVCAL_CHECK macro.
//
// Bad arguments, bad files and I/O failures throw kvcal::Error with a message
// that says what was wrong and what to do about it. Numerical outcomes (a mask
// that is not Ramanujan, a solver that did not converge) are returned results,
// never exceptions.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace kvcal {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Throws kvcal::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kvcal

// KVCAL_CHECK(cond, "fmt {}", args...): throws kvcal::Error when cond is false.
#define KVCAL_CHECK(cond, ...)    \
  do {                            \
    if (!(cond)) {                \
      ::kvcal::fail(__VA_ARGS__); \
    }                             \
  } while (false)
