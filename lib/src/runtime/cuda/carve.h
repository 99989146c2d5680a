// Device workspace layout shared by the CUDA launchers and the host code
// that lays out device state (no CUDA header needed).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcal::runtime::cuda::detail {

// Workspace carving: arrays one after another, each 256-byte aligned.
struct Carve {
  std::uint8_t* base;
  std::size_t used = 0;
  template <class T>
  T* take(std::size_t n) {
    T* p = reinterpret_cast<T*>(base ? base + used : nullptr);
    used += (n * sizeof(T) + 255) & ~std::size_t{255};
    return p;
  }
};

}  // namespace kvcal::runtime::cuda::detail
