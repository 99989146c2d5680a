// Host launchers of the step kernels (hex_step_kernels.cuh): workspace
// upload, argument checks, launches. Compiled with -fmad=false.
#include <cuda_runtime.h>

#include <algorithm>
#include <new>
#include <string>

#include "kvcal/runtime/hex_cuda.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/hex_step_kernels.cuh"

namespace kvcal::runtime::cuda {
namespace {

using namespace kernels;  // NOLINT(google-build-using-namespace)

void check_layer(const HexDeviceLayer& L) {
  const HexPageGeometry& g = L.geometry;
  if (L.kv_heads < 1 || g.block < 1 || g.head_dim < 1 || !(g.bits == 0 || (g.bits >= 2 && g.bits <= 4)))
    throw Error("hex CUDA: bad layer geometry or KV head count");
  if (g.mask_degree > 0 && !L.mask) throw Error("hex CUDA: the geometry has expander entries but the mask is null");
  if (!L.pages || !L.residual) throw Error("hex CUDA: the layer's page pools are null");
}

}  // namespace

std::size_t hex_step_workspace_bytes(const HexStepPlan& plan) {
  detail::Carve c{nullptr};
  c.take<HexCompressJob>(plan.compress.size());
  c.take<HexAppendJob>(plan.append.size());
  c.take<std::int32_t>(plan.page_ids.size());
  return c.used;
}

HexStepArgs hex_upload_step(const HexStepPlan& plan, void* workspace, std::size_t bytes, Stream stream) {
  if (bytes < hex_step_workspace_bytes(plan))
    throw Error("hex CUDA: the step workspace holds " + std::to_string(bytes) + " bytes, the plan needs " +
                std::to_string(hex_step_workspace_bytes(plan)));
  if (!workspace && bytes > 0) throw Error("hex CUDA: null step workspace");
  detail::Carve c{static_cast<std::uint8_t*>(workspace)};
  HexStepArgs a;
  auto* cj = c.take<HexCompressJob>(plan.compress.size());
  auto* aj = c.take<HexAppendJob>(plan.append.size());
  auto* ids = c.take<std::int32_t>(plan.page_ids.size());
  const auto copy = [&](void* dst, const void* src, std::size_t n) {
    if (n > 0) detail::check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream), "hex_upload_step copy");
  };
  copy(cj, plan.compress.data(), plan.compress.size() * sizeof(HexCompressJob));
  copy(aj, plan.append.data(), plan.append.size() * sizeof(HexAppendJob));
  copy(ids, plan.page_ids.data(), plan.page_ids.size() * sizeof(std::int32_t));
  a.compress = cj;
  a.append = aj;
  a.page_ids = ids;
  a.n_compress = static_cast<std::int32_t>(plan.compress.size());
  a.n_append = static_cast<std::int32_t>(plan.append.size());
  a.rows = plan.token_indptr.empty() ? 0 : plan.token_indptr.back();
  return a;
}

void hex_run_step(const HexDeviceLayer& L, const HexStepArgs& a, const half_bits* k, const half_bits* v, int* error,
                  Stream stream) {
  check_layer(L);
  if (a.rows > 0 && (!k || !v)) throw Error("hex CUDA: the step has new tokens but k or v is null");
  const std::size_t shared = compress_shared_bytes(L.geometry);
  if (shared > 48 * 1024) throw Error("hex CUDA: blocks above 5461 tokens are not supported by the compress kernel");
  if (a.n_compress > 0) {
    hex_compress_kernel<<<a.n_compress * L.kv_heads, kStepThreads, shared, stream>>>(L, a, k, v, error);
    detail::check_launch("hex_compress_kernel");
  }
  if (a.n_append > 0) {
    hex_append_kernel<<<a.n_append * L.kv_heads, kStepThreads, 0, stream>>>(L, a, k, v);
    detail::check_launch("hex_append_kernel");
  }
}

bool device_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why)
      *why = e != cudaSuccess ? std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e) : "no CUDA device";
    cudaGetLastError();  // clear the sticky-free error state
    return false;
  }
  return true;
}

}  // namespace kvcal::runtime::cuda
