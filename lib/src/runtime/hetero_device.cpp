// The layout of the HeteroCache drift monitors' device state
// (hetero_cuda.h): plain host code, in libkvcal_runtime, so that it serves the
// CUDA library and the host emulation of its kernels alike.
#include <cmath>
#include <string>

#include "kvcal/runtime/hetero_cuda.h"
#include "runtime/cuda/carve.h"

namespace kvcal::runtime::cuda {
namespace {

template <class F>
void carve_state(detail::Carve& c, std::int32_t P, std::int32_t L, std::int32_t W, F&& at) {
  const auto p = static_cast<std::size_t>(P);
  at(c.take<std::int32_t>(p * L), c.take<std::int32_t>(p), c.take<std::int32_t>(p * L), c.take<std::int32_t>(p),
     c.take<std::int32_t>(p * W), c.take<DriftResult>(p));
}

}  // namespace

std::size_t drift_state_bytes(std::int32_t pivots, std::int32_t l_base, std::int32_t window) {
  if (pivots < 1 || l_base < 1 || window < 1) throw Error("drift state: pivots, L_base and the window must be >= 1");
  detail::Carve c{nullptr};
  carve_state(c, pivots, l_base, window, [](auto...) {});
  return c.used;
}

DriftState drift_state(void* memory, std::size_t bytes, std::int32_t pivots, std::int32_t l_base, std::int32_t window,
                       double tau) {
  if (!std::isfinite(tau)) throw Error("drift state: tau_drift is not finite");
  const std::size_t need = drift_state_bytes(pivots, l_base, window);
  if (!memory || bytes < need)
    throw Error("drift state: " + std::to_string(bytes) + " bytes given, " + std::to_string(need) + " needed");
  DriftState s;
  s.pivots = pivots;
  s.l_base = l_base;
  s.window = window;
  s.tau = tau;
  detail::Carve c{static_cast<std::uint8_t*>(memory)};
  carve_state(c, pivots, l_base, window,
              [&](std::int32_t* base, std::int32_t* base_len, std::int32_t* cur, std::int32_t* cur_len,
                  std::int32_t* overlaps, DriftResult* result) {
                s.base = base;
                s.base_len = base_len;
                s.current = cur;
                s.cur_len = cur_len;
                s.overlaps = overlaps;
                s.result = result;
              });
  return s;
}

}  // namespace kvcal::runtime::cuda
