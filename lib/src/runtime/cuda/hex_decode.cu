// Host launchers of the decode kernels (hex_decode_kernels.cuh): workspace
// upload, argument checks, launches.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "kvcal/runtime/hex_cuda.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/hex_decode_kernels.cuh"

namespace kvcal::runtime::cuda {
namespace {

using namespace kernels;  // NOLINT(google-build-using-namespace)

struct DecodeSizes {
  std::size_t items, requests, slots, indptr, indices, partial, acc, res, col_ptr, col;
};

DecodeSizes sizes(const HexDecodePlan& plan, std::size_t indices, const HexPageGeometry& g, std::int32_t q_heads) {
  const std::size_t requests = plan.residual_rows.size();
  const std::size_t slots = plan.split_indptr.empty() ? 0 : static_cast<std::size_t>(plan.split_indptr.back());
  return {plan.items.size(),
          requests,
          requests + 1,
          requests + 1,
          indices,
          slots * q_heads,
          slots * q_heads * g.head_dim,
          requests * q_heads * g.block,
          mask_columns(g) ? static_cast<std::size_t>(g.head_dim) + 1 : 0,
          mask_columns(g) ? static_cast<std::size_t>(g.block) * g.mask_degree : 0};
}

template <class F>
void carve_decode(detail::Carve& c, const DecodeSizes& z, F&& at) {
  at(c.take<HexDecodeItem>(z.items), c.take<std::int32_t>(z.slots), c.take<std::int32_t>(z.requests),
     c.take<std::int32_t>(z.requests), c.take<std::int32_t>(z.indptr), c.take<std::int32_t>(z.indices),
     c.take<float>(z.partial), c.take<float>(z.partial), c.take<float>(z.acc), c.take<float>(z.res),
     c.take<std::int32_t>(z.col_ptr), c.take<std::int32_t>(z.col));
}

}  // namespace

std::size_t hex_decode_workspace_bytes(const HexDecodePlan& plan, const std::vector<std::int32_t>& page_indices,
                                       const HexPageGeometry& g, std::int32_t q_heads) {
  detail::Carve c{nullptr};
  carve_decode(c, sizes(plan, page_indices.size(), g, q_heads), [](auto...) {});
  return c.used;
}

HexDecodeArgs hex_upload_decode(const HexDecodePlan& plan, const std::vector<std::int32_t>& page_indptr,
                                const std::vector<std::int32_t>& page_indices, const HexPageGeometry& g,
                                std::int32_t q_heads, void* workspace, std::size_t bytes, Stream stream) {
  const std::size_t requests = plan.residual_rows.size();
  if (plan.split_indptr.size() != requests + 1 || plan.residual_page.size() != requests ||
      page_indptr.size() != requests + 1 || page_indptr.back() != static_cast<std::int32_t>(page_indices.size()))
    throw Error("hex CUDA: the decode plan and page table do not describe the same requests");
  const std::size_t need = hex_decode_workspace_bytes(plan, page_indices, g, q_heads);
  if (bytes < need || !workspace)
    throw Error("hex CUDA: the decode workspace holds " + std::to_string(bytes) + " bytes, the plan needs " +
                std::to_string(need));
  detail::Carve c{static_cast<std::uint8_t*>(workspace)};
  HexDecodeArgs a;
  const auto copy = [&](void* dst, const void* src, std::size_t n) {
    if (n > 0) detail::check(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, stream), "hex_upload_decode copy");
  };
  carve_decode(c, sizes(plan, page_indices.size(), g, q_heads),
               [&](HexDecodeItem* items, std::int32_t* split, std::int32_t* rows, std::int32_t* rpage,
                   std::int32_t* indptr, std::int32_t* indices, float* pmax, float* psum, float* pacc, float* res,
                   std::int32_t* col_ptr, std::int32_t* col) {
                 copy(items, plan.items.data(), plan.items.size() * sizeof(HexDecodeItem));
                 copy(split, plan.split_indptr.data(), plan.split_indptr.size() * 4);
                 copy(rows, plan.residual_rows.data(), requests * 4);
                 copy(rpage, plan.residual_page.data(), requests * 4);
                 copy(indptr, page_indptr.data(), page_indptr.size() * 4);
                 copy(indices, page_indices.data(), page_indices.size() * 4);
                 a.items = items;
                 a.split_indptr = split;
                 a.residual_rows = rows;
                 a.residual_page = rpage;
                 a.page_indptr = indptr;
                 a.page_indices = indices;
                 a.part_max = pmax;
                 a.part_sum = psum;
                 a.part_acc = pacc;
                 a.res_scores = res;
                 a.mask_col_ptr = col_ptr;
                 a.mask_col = col;
               });
  a.n_items = static_cast<std::int32_t>(plan.items.size());
  a.requests = static_cast<std::int32_t>(requests);
  a.slots = plan.split_indptr.back();
  a.q_heads = q_heads;
  return a;
}

void hex_run_decode(const HexDeviceLayer& L, const HexDecodeArgs& a, const float* q, float scale, float* out,
                    bool observe, Stream stream, DecodeUnits units) {
  const HexPageGeometry& g = L.geometry;
  if (L.kv_heads < 1 || a.q_heads < L.kv_heads || a.q_heads % L.kv_heads != 0 || a.q_heads / L.kv_heads > kMaxGroup)
    throw Error("hex CUDA decode: query heads must be 1 to 8 times the KV heads, got " + std::to_string(a.q_heads) +
                " for " + std::to_string(L.kv_heads));
  if (g.head_dim < 1 || g.head_dim > kMaxHeadDim)
    throw Error("hex CUDA decode: head_dim must be in [1, 128], got " + std::to_string(g.head_dim));
  if (g.mask_degree > 0 && g.bits != 0 && !L.mask) throw Error("hex CUDA decode: the mask is null");
  if (!L.pages || !L.residual || !q || !out) throw Error("hex CUDA decode: null pool, query or output pointer");
  if (!std::isfinite(scale)) throw Error("hex CUDA decode: the scale is not finite");
  if (units != DecodeUnits::cuda_cores && units != DecodeUnits::tensor_cores)
    throw Error("hex CUDA decode: unknown decode units " + std::to_string(static_cast<int>(units)));
  const bool mma = units == DecodeUnits::tensor_cores;
  if (mma && !mma_geometry(g))
    throw Error("hex CUDA decode: tensor cores need 4- or 2-bit codes and head_dim 64 or 128, got " +
                std::to_string(g.bits) + " bits and head_dim " + std::to_string(g.head_dim));
  int device = -1;
  const auto attribute = [&](cudaDeviceAttr what) {
    if (device < 0) detail::check(cudaGetDevice(&device), "hex CUDA decode: cudaGetDevice");
    int v = 0;
    detail::check(cudaDeviceGetAttribute(&v, what, device), "hex CUDA decode: cudaDeviceGetAttribute");
    return v;
  };
  if (mma && attribute(cudaDevAttrComputeCapabilityMajor) < 8)
    throw Error("hex CUDA decode: tensor cores need a device of compute capability 8.0 or later");
  if (a.n_items == 0) return;
  if (mask_columns(g)) {
    if (!a.mask_col_ptr || !a.mask_col) throw Error("hex CUDA decode: the arguments have no room for the mask columns");
    hex_mask_columns_kernel<<<mask_column_blocks(g.head_dim), kColumnThreads, 0, stream>>>(L, a);
    detail::check_launch("hex_mask_columns_kernel");
  }
  with_group(a.q_heads / L.kv_heads, [&](auto group) {
    constexpr int G = decltype(group)::value;
    const auto launch = [&](auto kernel) {
      // Two stages (a page side in flight while the other is used) where
      // they fit, else one.
      int stages = 2;
      std::size_t shared = DecodeShared<G>::bytes(g, stages, mma);
      if (shared > 48 * 1024) {  // above the default: opt in, up to what the device allows
        const int most = attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
        if (shared > static_cast<std::size_t>(most)) {
          stages = 1;
          shared = DecodeShared<G>::bytes(g, stages, mma);
        }
        if (shared > static_cast<std::size_t>(most))
          throw Error("hex CUDA decode: a block of " + std::to_string(g.block) + " tokens needs " +
                      std::to_string(shared) + " bytes of shared memory, above the device's " + std::to_string(most));
        detail::check(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)),
            "hex CUDA decode: cudaFuncSetAttribute");
      }
      kernel<<<a.n_items, kDecodeThreads, shared, stream>>>(L, a, q, scale, observe, stages);
      detail::check_launch("hex_decode_kernel");
    };
    if (!mma)
      launch(hex_decode_kernel<G, 0>);
    else if (g.bits == 4)
      launch(hex_decode_kernel<G, 4>);
    else
      launch(hex_decode_kernel<G, 2>);
  });
  hex_merge_kernel<<<merge_blocks(a.requests, L.kv_heads, a.q_heads, g.head_dim), kMergeThreads, 0, stream>>>(L, a, out,
                                                                                                              observe);
  detail::check_launch("hex_merge_kernel");
}

}  // namespace kvcal::runtime::cuda
