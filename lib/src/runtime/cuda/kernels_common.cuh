// The kernels of HEX over a paged batch, in one header so that two builds
// share them: nvcc (hex_step.cu, hex_decode.cu: the library) and a host
// emulation of the CUDA execution model (tests/cuda/emulated_kernels.cpp:
// every thread of a block a std::thread, __syncthreads a barrier, warp
// shuffles through a per-warp exchange), which runs them on the CPU against
// the host executor and under ThreadSanitizer, where no GPU is available.
//
// Step kernels (hex_step_kernels.cuh): compression of every block that filled (one thread block per
// job and KV head, the codec of page_codec.h over its threads), then the
// append of the remaining tokens to the residual pages. Their translation
// unit is compiled with -fmad=false: the codec's float operations must round
// as quant.cpp's do on the host (bit-identical codes and parameters).
//
// Decode (flash-decoding, hex_decode_kernels.cuh): one thread block per work item (request, KV head,
// run of block pages, maybe the residual rows) computes the scores of its
// query group on the codes in place (never a dequantized copy), an online
// softmax over its pages and the unnormalised output; a merge kernel combines
// the splits of each request and head, and with observe adds the residual
// tokens' weights to their heavy-hitter scores.
#pragma once

#include <cmath>
#include <cstdint>
#include <new>

#include "kvcal/runtime/hex_cuda.h"
#include "runtime/hex/page_codec.h"

namespace kvcal::runtime::cuda::kernels {

#if defined(__CUDACC__)
__device__ inline unsigned char* dynamic_shared() {
  extern __shared__ __align__(16) unsigned char kvcal_dynamic_shared[];
  return kvcal_dynamic_shared;
}
#endif

}  // namespace kvcal::runtime::cuda::kernels
