// CUDA error handling of the runtime's GPU code: every failure becomes a
// kvcal::runtime::Error naming what failed and CUDA's message.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvcal/runtime/common.h"
#include "runtime/cuda/carve.h"

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

}  // namespace kvcal::runtime::cuda::detail
