// The step kernels: compress the blocks that filled, append the rest. Included by hex_step.cu (-fmad=false) and by the
// host emulation (tests/cuda/emulated_kernels.cpp); see kernels_common.cuh. Include after <cuda_runtime.h> (nvcc) or
// tests/cuda/cuda_emulation.h.
#pragma once

#include "runtime/cuda/kernels_common.cuh"

namespace kvcal::runtime::cuda::kernels {

constexpr int kStepThreads = 256;

// Dynamic shared memory of the compress kernel: scores, quantized-token list, keep flags.
__host__ __device__ inline std::size_t compress_shared_bytes(const HexPageGeometry& g) {
  return static_cast<std::size_t>(g.block) * (4 + 4 + 1);
}

struct ResidualRef {
  std::uint8_t* base;
  HexPageGeometry g;
  std::int32_t heads;
  __device__ half_bits* k(std::int32_t page, std::int32_t h) const {
    return reinterpret_cast<half_bits*>(base + static_cast<std::int64_t>(page) * g.residual_bytes(heads)) +
           static_cast<std::int64_t>(h) * g.block * g.head_dim;
  }
  __device__ half_bits* v(std::int32_t page, std::int32_t h) const {
    return reinterpret_cast<half_bits*>(base + static_cast<std::int64_t>(page) * g.residual_bytes(heads) +
                                        g.residual_rows_bytes(heads)) +
           static_cast<std::int64_t>(h) * g.block * g.head_dim;
  }
  __device__ float* scores(std::int32_t page, std::int32_t h) const {
    return reinterpret_cast<float*>(base + static_cast<std::int64_t>(page) * g.residual_bytes(heads) +
                                    2 * g.residual_rows_bytes(heads)) +
           static_cast<std::int64_t>(h) * g.block;
  }
};

__global__ void __launch_bounds__(kStepThreads)
    hex_compress_kernel(HexDeviceLayer L, HexStepArgs A, const half_bits* k, const half_bits* v, int* error) {
  const HexPageGeometry g = L.geometry;
  const std::int32_t H = L.kv_heads, nb = g.block, d = g.head_dim;
  const std::int32_t job_index = blockIdx.x / H, h = blockIdx.x % H, tid = threadIdx.x, nt = blockDim.x;
  const HexCompressJob job = A.compress[job_index];
  const ResidualRef res{L.residual, g, H};
  float* score = reinterpret_cast<float*>(dynamic_shared());
  std::int32_t* qtok = reinterpret_cast<std::int32_t*>(score + nb);
  std::uint8_t* keep = reinterpret_cast<std::uint8_t*>(qtok + nb);
  // The block's state, built by one thread (no constructor runs for __shared__ storage).
  struct alignas(codec::Block) Storage {
    unsigned char bytes[sizeof(codec::Block)];
  };
  __shared__ Storage blk_storage;
  codec::Block& blk = *reinterpret_cast<codec::Block*>(blk_storage.bytes);

  std::uint8_t* page = L.pages + static_cast<std::int64_t>(A.page_ids[job.page_index + h]) * g.page_bytes();
  for (std::int64_t i = tid; i < g.page_bytes() / 16; i += nt)
    reinterpret_cast<uint4*>(page)[i] = make_uint4(0, 0, 0, 0);
  const std::int64_t row = static_cast<std::int64_t>(H) * d;
  const codec::Rows rows{res.k(job.residual_page, h),
                         res.v(job.residual_page, h),
                         k + job.src_row * row + h * d,
                         v + job.src_row * row + h * d,
                         d,
                         row,
                         job.from_residual};
  // The layer's score of each row: its residual scores summed over the KV heads in head order.
  for (std::int32_t t = tid; t < nb; t += nt) {
    float s = 0.0f;
    if (t < job.from_residual)
      for (std::int32_t hh = 0; hh < H; ++hh) s += res.scores(job.residual_page, hh)[t];
    score[t] = s;
  }
  for (std::int64_t i = tid; i < static_cast<std::int64_t>(nb) * d; i += nt) {
    const std::int32_t t = static_cast<std::int32_t>(i / d), c = static_cast<std::int32_t>(i % d);
    if (!codec::finite_half(rows.k(t)[c]) || !codec::finite_half(rows.v(t)[c])) {
      if (error) atomicExch(error, 1);
    }
  }
  __syncthreads();
  for (std::int32_t t = tid; t < nb; t += nt)
    keep[t] =
        codec::keep_row(t, nb, job.heavy_hitters, job.recent_from, [&](std::int32_t u) { return score[u]; }) ? 1 : 0;
  __syncthreads();
  if (tid == 0) {
    new (blk_storage.bytes) codec::Block();
    blk.g = g;
    blk.rows = rows;
    blk.mask = L.mask;
    blk.page = page;
    blk.qtok = qtok;
    codec::list_rows(blk, keep);
  }
  __syncthreads();
  const codec::Block b = blk;
  for (std::int32_t i = tid; i < b.kept * d; i += nt) codec::copy_kept(b, i);
  if (g.bits == 0 || b.quant == 0) return;
  for (std::int32_t i = tid; i < b.quant * g.mask_degree; i += nt) codec::copy_entry(b, i);
  bool bad = false;
  for (std::int32_t i = tid; i < d + b.quant; i += nt) {
    if (i < d)
      codec::key_params(b, i, &bad);
    else
      codec::value_params(b, i - d, &bad);
  }
  if (bad && error) atomicExch(error, 1);
  __syncthreads();  // the code bytes read every parameter
  for (std::int32_t i = tid; i < b.quant * g.row_bytes(); i += nt) codec::code_byte(b, i);
}

__global__ void __launch_bounds__(kStepThreads)
    hex_append_kernel(HexDeviceLayer L, HexStepArgs A, const half_bits* k, const half_bits* v) {
  const HexPageGeometry g = L.geometry;
  const std::int32_t H = L.kv_heads, nb = g.block, d = g.head_dim;
  const std::int32_t h = blockIdx.x % H, tid = threadIdx.x, nt = blockDim.x;
  const HexAppendJob a = A.append[blockIdx.x / H];
  const ResidualRef res{L.residual, g, H};
  half_bits* rk = res.k(a.residual_page, h);
  half_bits* rv = res.v(a.residual_page, h);
  float* sc = res.scores(a.residual_page, h);
  const std::int64_t row = static_cast<std::int64_t>(H) * d;
  for (std::int64_t i = tid; i < static_cast<std::int64_t>(a.count) * d; i += nt) {
    const std::int64_t r = i / d, c = i % d;
    rk[(a.dst_row + r) * d + c] = k[(a.src_row + r) * row + h * d + c];
    rv[(a.dst_row + r) * d + c] = v[(a.src_row + r) * row + h * d + c];
  }
  for (std::int32_t t = tid; t < nb; t += nt)
    if (!a.keep_scores || (t >= a.dst_row && t < a.dst_row + a.count)) sc[t] = 0.0f;
}

}  // namespace kvcal::runtime::cuda::kernels
