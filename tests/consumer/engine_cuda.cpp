// A CUDA engine using an installed kvcal through find_package: it links
// kvcal::runtime_cuda, plans a step of a paged HEX batch on the host and,
// where a GPU is usable, runs it there and decodes one token; without a GPU
// it checks that bad arguments are refused before any launch.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kvcal/runtime/hex_cuda.h"

namespace rt = kvcal::runtime;
namespace kc = kvcal::runtime::cuda;

int main() {
  rt::HexOptions o = rt::hex_method("kcvt4");
  o.block = 16;
  rt::HexPagedCache cache(2, 64, o, nullptr, 16, 1);
  const std::int32_t id = cache.add_request();
  const rt::HexStepPlan plan = cache.plan_append({id}, {40});
  std::string why;
  if (!kc::device_available(&why)) {
    try {
      kc::hex_upload_step(plan, nullptr, 0, nullptr);
      std::puts("FAIL: a missing workspace was accepted");
      return 1;
    } catch (const rt::Error& e) {
      std::printf("engine_cuda: no GPU (%s); linked, and refused a bad call: %s\n", why.c_str(), e.what());
      return 0;
    }
  }
  const rt::HexPageGeometry& g = cache.geometry();
  std::vector<rt::half_bits> kv(static_cast<std::size_t>(40 * 2 * 64), 0x3c00);  // every value 1.0
  void *pages, *res, *k, *ws, *q, *out, *dws;
  cudaMalloc(&pages, 16 * g.page_bytes());
  cudaMalloc(&res, g.residual_bytes(2));
  cudaMemset(res, 0, g.residual_bytes(2));
  cudaMalloc(&k, kv.size() * 2);
  cudaMemcpy(k, kv.data(), kv.size() * 2, cudaMemcpyHostToDevice);
  kc::HexDeviceLayer L;
  L.geometry = g;
  L.kv_heads = 2;
  L.pages = static_cast<std::uint8_t*>(pages);
  L.residual = static_cast<std::uint8_t*>(res);
  cudaMalloc(&ws, kc::hex_step_workspace_bytes(plan));
  const kc::HexStepArgs sa = kc::hex_upload_step(plan, ws, kc::hex_step_workspace_bytes(plan), nullptr);
  kc::hex_run_step(L, sa, static_cast<rt::half_bits*>(k), static_cast<rt::half_bits*>(k), nullptr, nullptr);
  const rt::HexDecodePlan dp = cache.plan_decode({id});
  std::vector<std::int32_t> indptr, indices;
  cache.page_table({id}, indptr, indices);
  std::vector<float> qh(4 * 64, 0.1f), oh(qh.size());
  cudaMalloc(&q, qh.size() * 4);
  cudaMalloc(&out, qh.size() * 4);
  cudaMemcpy(q, qh.data(), qh.size() * 4, cudaMemcpyHostToDevice);
  const std::size_t wb = kc::hex_decode_workspace_bytes(dp, indices, g, 4);
  cudaMalloc(&dws, wb);
  const kc::HexDecodeArgs da = kc::hex_upload_decode(dp, indptr, indices, g, 4, dws, wb, nullptr);
  kc::hex_run_decode(L, da, static_cast<float*>(q), 0.125f, static_cast<float*>(out), false, nullptr);
  cudaMemcpy(oh.data(), out, oh.size() * 4, cudaMemcpyDeviceToHost);
  // Every value is 1.0 (a constant group: exact), so every output is 1.0.
  for (const float x : oh)
    if (x != 1.0f) {
      std::printf("FAIL: output %g, expected 1\n", x);
      return 1;
    }
  std::puts("engine_cuda: decoded on the GPU, outputs exact");
  return 0;
}
