// Pieces of the MPI layer shared by its two implementations (dist_mpi.cpp,
// dist_serial.cpp). Internal to the CLI.
#pragma once

#include <algorithm>
#include <new>
#include <string>

#include "cli_common.h"
#include "dist.h"
#include "kvcal/runtime/common.h"

namespace kvcal::cli::dist::detail {

// The message of the exception in flight, as the CLI's error line says it
// after "error: ".
inline std::string describe_current_exception() {
  try {
    throw;
  } catch (const UsageError& e) {
    return e.what();
  } catch (const kvcal::Error& e) {
    return e.what();
  } catch (const kvcal::runtime::Error& e) {
    return e.what();
  } catch (const std::bad_alloc&) {
    return "out of memory (try a smaller shape or fewer threads)";
  } catch (const std::exception& e) {
    return std::string("internal error: ") + e.what();
  } catch (...) {
    return "internal error: unknown exception";
  }
}

inline std::vector<std::size_t> split(const std::vector<std::int64_t>& weights, int parts) {
  std::vector<std::size_t> bounds(static_cast<std::size_t>(parts) + 1, weights.size());
  bounds[0] = 0;
  long double total = 0;
  for (std::int64_t w : weights) total += static_cast<long double>(std::max<std::int64_t>(w, 1));
  // Item i goes to part floor(midpoint_i * parts / total): non-decreasing in
  // i, so parts are contiguous ranges.
  long double before = 0;
  int part = 0;
  for (std::size_t i = 0; i < weights.size(); ++i) {
    const auto w = static_cast<long double>(std::max<std::int64_t>(weights[i], 1));
    const int owner = std::min(parts - 1, static_cast<int>((before + w / 2) * parts / total));
    while (part < owner) bounds[static_cast<std::size_t>(++part)] = i;
    before += w;
  }
  return bounds;
}

}  // namespace kvcal::cli::dist::detail
