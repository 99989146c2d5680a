// Argument checks of the runtime: every failure is a kvcal::runtime::Error.
// The const char* overload builds no string unless the check fails, so it is
// cheap enough for per-element checks.
#pragma once

#include <string>

#include "kvcal/runtime/common.h"

namespace kvcal::runtime::detail {

[[noreturn]] inline void fail(const std::string& what) { throw Error(what); }

inline void require(bool cond, const char* what) {
  if (!cond) throw Error(what);
}

inline void require(bool cond, const std::string& what) {
  if (!cond) throw Error(what);
}

}  // namespace kvcal::runtime::detail
