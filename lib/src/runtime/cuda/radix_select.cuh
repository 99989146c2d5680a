// Block-wide radix selection over float keys, shared by the HeteroCache
// top-k (hetero_kernels.cuh) and CHESS's per-level quantiles
// (chess_kernels.cuh). Included after <cuda_runtime.h> (nvcc) or
// tests/cuda/cuda_emulation.h, like the kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvcal::runtime::cuda::kernels {

// A float's position in an unsigned order (-0 and +0 tie, as they compare equal).
__device__ inline std::uint32_t order_key(float x) {
  std::uint32_t u = 0;
  if (x != 0.0f) std::memcpy(&u, &x, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float of an order key (+0 for the key both zeros share).
__device__ inline float key_float(std::uint32_t key) {
  const std::uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Inclusive prefix sum of x over the block's threads in thread order; total:
// the sum over the block. Every thread calls it (two barriers).
__device__ inline unsigned block_scan(unsigned x, unsigned* warp_total, unsigned& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_total[warp] = x;
  __syncthreads();
  unsigned before = 0;
  total = 0;
  for (int w = 0; w < warps; ++w) {
    const unsigned t = warp_total[w];
    if (w < warp) before += t;
    total += t;
  }
  __syncthreads();  // warp_total is rewritten by the next scan
  return before + x;
}

// Shared memory of a selection whose first digit has kFirstBits bits (the
// other two split the remaining bits, the second taking the odd one).
template <int kFirstBits>
struct RadixShared {
  static constexpr int kSecondBits = (32 - kFirstBits + 1) / 2, kThirdBits = (32 - kFirstBits) / 2;
  static constexpr int kBins = 1 << (kFirstBits > kSecondBits ? kFirstBits : kSecondBits);
  unsigned hist[kBins];
  unsigned warp_total[32];
  int chosen;
  unsigned remaining;
};

// The k-th largest (1 <= k <= n) of the keys key(i), i < n, by one thread
// block, in every thread; `take` = how many of the keys equal to it are among
// the k largest. Three radix passes, most significant digit first: per pass
// a histogram of the keys that match the digits found so far (kLoads keys
// read per thread before their updates), then the bin where the count from
// the top reaches what is left, found by a block scan of each thread's bins.
template <int kFirstBits, int kLoads, class Key>
__device__ inline std::uint32_t radix_kth_largest(Key key, int n, unsigned k, RadixShared<kFirstBits>& sh,
                                                  unsigned& take) {
  using S = RadixShared<kFirstBits>;
  const int tid = threadIdx.x, nt = blockDim.x;
  std::uint32_t prefix = 0, mask = 0;
  unsigned remaining = k;
  for (int pass = 0; pass < 3; ++pass) {
    const int width = pass == 0 ? kFirstBits : (pass == 1 ? S::kSecondBits : S::kThirdBits);
    const int shift = pass == 0 ? 32 - kFirstBits : (pass == 1 ? S::kThirdBits : 0), bins = 1 << width;
    const std::uint32_t digit = static_cast<std::uint32_t>(bins - 1);
    for (int b = tid; b < bins; b += nt) sh.hist[b] = 0;
    __syncthreads();
    for (int base = tid; base < n; base += kLoads * nt) {
      std::uint32_t v[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) v[u] = base + u * nt < n ? key(base + u * nt) : 0u;
#pragma unroll
      for (int u = 0; u < kLoads; ++u)
        if (base + u * nt < n && (v[u] & mask) == prefix) atomicAdd(&sh.hist[(v[u] >> shift) & digit], 1u);
    }
    __syncthreads();
    // Thread t holds bins [top - per (t + 1), top - per t), counted from the top.
    const int per = (bins + nt - 1) / nt, hi = bins - 1 - per * tid, lo = hi - per + 1 > 0 ? hi - per + 1 : 0;
    unsigned mine = 0;
    for (int b = hi; b >= lo; --b) mine += sh.hist[b];
    unsigned total = 0;
    const unsigned upto = block_scan(mine, sh.warp_total, total);
    unsigned above = upto - mine;
    if (hi >= 0 && above < remaining && remaining <= upto) {  // one thread: the bin is among its own
      int b = hi;
      for (; b > lo && above + sh.hist[b] < remaining; --b) above += sh.hist[b];
      sh.chosen = b;
      sh.remaining = remaining - above;
    }
    __syncthreads();
    prefix |= static_cast<std::uint32_t>(sh.chosen) << shift;
    mask |= digit << shift;
    remaining = sh.remaining;
    __syncthreads();  // read before the next pass's owner writes them again
  }
  take = remaining;
  return prefix;
}

}  // namespace kvcal::runtime::cuda::kernels
