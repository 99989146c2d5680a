// CUDA error handling of the runtime's GPU code: every failure becomes a
// kvcal::runtime::Error naming what failed and CUDA's message.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvcal/runtime/common.h"

namespace kvcal::runtime::cuda::detail {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

// After a launch: a bad configuration is reported now, with the kernel's name.
inline void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw Error(std::string("CUDA kernel ") + kernel + " failed to launch: " + cudaGetErrorName(e) + " (" +
                cudaGetErrorString(e) + ")");
}

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
