// The HeteroCache kernels (hetero_cuda.h): a top-k radix select over one row
// per thread block, the drift monitors' step, the satellites' lists and the
// host-to-device gather. Included by hetero.cu and by the host emulation
// (tests/cuda/emulated_kernels.cpp); see kernels_common.cuh.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvcal/runtime/hetero_cuda.h"
#include "runtime/cuda/kernels_common.cuh"
#include "runtime/cuda/radix_select.cuh"

namespace kvcal::runtime::cuda::kernels {

constexpr int kTopkThreads = 512;
// Radix digits of 12, 10 and 10 bits. The first is wide because attention
// rows put most keys in a few exponents: with 8-bit digits nearly every key
// of the first pass hit the same two or three bins.
constexpr int kTopkFirstBits = 12, kTopkLoads = 4, kTopkRun = 4;
using TopkShared = RadixShared<kTopkFirstBits>;

// The k largest of x[0..n) (ties: lower index first) into out, ascending, by
// one thread block; returns min(k, n) in every thread. radix_kth_largest
// finds the k-th largest key T and how many of the keys equal to T to take;
// one more pass writes the indices in order, kTopkRun consecutive keys per
// thread and one block scan per tile, and stops once k indices are out.
__device__ inline int top_k_block(const float* x, int n, int k, std::int32_t* out, TopkShared& sh) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if (k > n) k = n;
  if (k <= 0) return 0;
  if (k == n) {
    for (int i = tid; i < n; i += nt) out[i] = i;
    return n;
  }
  unsigned remaining = 0;
  const std::uint32_t prefix = radix_kth_largest<kTopkFirstBits, kTopkLoads>([x](int i) { return order_key(x[i]); }, n,
                                                                             static_cast<unsigned>(k), sh, remaining);
  // T = prefix; take every key above it and the first `remaining` equal to it.
  int written = 0;
  unsigned eq_seen = 0;
  for (int base = 0; base < n && written < k; base += kTopkRun * nt) {
    const int i0 = base + kTopkRun * tid;
    std::uint32_t key[kTopkRun];
#pragma unroll
    for (int e = 0; e < kTopkRun; ++e) key[e] = i0 + e < n ? order_key(x[i0 + e]) : 0u;
    unsigned gt = 0, eq = 0;
#pragma unroll
    for (int e = 0; e < kTopkRun; ++e)
      if (i0 + e < n) {
        gt += key[e] > prefix ? 1u : 0u;
        eq += key[e] == prefix ? 1u : 0u;
      }
    unsigned total = 0;  // gt in the high half, eq in the low (each <= kTopkRun * nt per tile)
    const unsigned upto = block_scan(gt << 16 | eq, sh.warp_total, total);
    const unsigned gt_before = (upto >> 16) - gt, eq_before = (upto & 0xffffu) - eq;
    const unsigned quota = remaining > eq_seen ? remaining - eq_seen : 0u;
    int pos = written + static_cast<int>(gt_before + (eq_before < quota ? eq_before : quota));
    unsigned eq_run = eq_before;
#pragma unroll
    for (int e = 0; e < kTopkRun; ++e)
      if (i0 + e < n) {
        if (key[e] > prefix) {
          out[pos++] = i0 + e;
        } else if (key[e] == prefix) {
          if (eq_run < quota) out[pos++] = i0 + e;
          ++eq_run;
        }
      }
    const unsigned eq_total = total & 0xffffu;
    written += static_cast<int>((total >> 16) + (eq_total < quota ? eq_total : quota));
    eq_seen += eq_total;
  }
  return written;
}

__global__ void __launch_bounds__(kTopkThreads)
    top_k_rows_kernel(AttentionRows rows, const std::int32_t* k, std::int32_t max_k, std::int32_t* out,
                      std::int32_t* len) {
  __shared__ TopkShared sh;
  const int r = blockIdx.x;
  const int kr = k[r] < max_k ? k[r] : max_k;
  const int got = top_k_block(rows.rows[r], rows.n[r], kr, out + static_cast<std::int64_t>(r) * max_k, sh);
  if (threadIdx.x == 0) len[r] = got;
}

__global__ void __launch_bounds__(kTopkThreads) drift_init_kernel(DriftState s, AttentionRows rows) {
  __shared__ TopkShared sh;
  const int p = blockIdx.x;
  const int got = top_k_block(rows.rows[p], rows.n[p], s.l_base, s.base + static_cast<std::int64_t>(p) * s.l_base, sh);
  if (threadIdx.x == 0) {
    s.base_len[p] = got;
    s.cur_len[p] = 0;
    s.result[p] = DriftResult{};
  }
  for (int w = threadIdx.x; w < s.window; w += blockDim.x) s.overlaps[static_cast<std::int64_t>(p) * s.window + w] = 0;
}

__global__ void __launch_bounds__(kTopkThreads) drift_step_kernel(DriftState s, AttentionRows rows) {
  __shared__ TopkShared sh;
  __shared__ int counts[32];
  __shared__ int drifted;
  const int p = blockIdx.x, tid = threadIdx.x, nt = blockDim.x, lane = tid % 32, warp = tid / 32;
  std::int32_t* cur = s.current + static_cast<std::int64_t>(p) * s.l_base;
  const std::int32_t* base = s.base + static_cast<std::int64_t>(p) * s.l_base;
  const int len = top_k_block(rows.rows[p], rows.n[p], s.l_base, cur, sh);
  __syncthreads();  // cur complete
  const int blen = s.base_len[p];
  int hits = 0;
  for (int t = tid; t < len; t += nt) {  // |cur ∩ base|: binary search of each current index
    const std::int32_t v = cur[t];
    int lo = 0, hi = blen;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (base[mid] < v)
        lo = mid + 1;
      else
        hi = mid;
    }
    hits += lo < blen && base[lo] == v ? 1 : 0;
  }
  for (int o = 16; o > 0; o >>= 1) hits += __shfl_xor_sync(0xffffffffu, hits, o);
  if (lane == 0) counts[warp] = hits;
  __syncthreads();
  if (tid == 0) {
    int both = 0;
    for (int w = 0; w < nt / 32; ++w) both += counts[w];
    DriftResult r = s.result[p];
    r.steps += 1;
    std::int32_t* ov = s.overlaps + static_cast<std::int64_t>(p) * s.window;
    ov[(r.steps - 1) % s.window] = both;
    r.overlap = static_cast<double>(both) / static_cast<double>(s.l_base);
    r.checked = r.drift = 0;
    r.median = 0;
    if (r.steps % s.window == 0) {        // the window's median (DriftMonitor::step's arithmetic)
      for (int a = 1; a < s.window; ++a)  // insertion sort of W counts (W is small)
        for (int b = a; b > 0 && ov[b - 1] > ov[b]; --b) {
          const std::int32_t t = ov[b];
          ov[b] = ov[b - 1];
          ov[b - 1] = t;
        }
      const int m = s.window;
      const double lb = static_cast<double>(s.l_base);
      r.median = m % 2 ? ov[m / 2] / lb : 0.5 * (ov[m / 2 - 1] / lb + ov[m / 2] / lb);
      r.checked = 1;
      r.drift = r.median < s.tau ? 1 : 0;
      r.drifts += r.drift;
    }
    s.result[p] = r;
    s.cur_len[p] = len;
    drifted = r.drift;
  }
  __syncthreads();
  if (drifted) {  // the base set becomes this step's set
    std::int32_t* b = s.base + static_cast<std::int64_t>(p) * s.l_base;
    for (int t = tid; t < len; t += nt) b[t] = cur[t];
    if (tid == 0) s.base_len[p] = len;
  }
}

__global__ void __launch_bounds__(kTopkThreads)
    satellite_topk_kernel(DriftState s, AttentionRows rows, Satellites sats, bool when_drifted) {
  __shared__ TopkShared sh;
  const int i = blockIdx.x, p = sats.pivot_of[i];
  if (when_drifted && !s.result[p].drift) {
    if (threadIdx.x == 0) sats.len[i] = 0;
    return;
  }
  const int k = sats.k[i] < sats.max_k ? sats.k[i] : sats.max_k;
  const int got = top_k_block(rows.rows[p], rows.n[p], k, sats.tokens + static_cast<std::int64_t>(i) * sats.max_k, sh);
  if (threadIdx.x == 0) sats.len[i] = got;
}

constexpr int kGatherThreads = 128, kGatherRowsPerBlock = 32, kGatherLoads = 4;

__device__ inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Grid (lists, ceil(max_k / 32)): each block copies up to 32 rows of one
// list. Reads of mapped host memory cross the link one request at a time and
// are bound by how many are in flight, not by the link's rate; so rows that
// come in whole 16-byte pieces (head_dim and the token stride multiples of
// 8 halves, every pointer 16-byte aligned) move as uint4, a warp's load
// asking for 512 contiguous bytes, and each thread issues kGatherLoads K and
// as many V loads before it stores any. Other rows move a half at a time.
__global__ void __launch_bounds__(kGatherThreads) gather_rows_kernel(GatherLists g) {
  const int i = blockIdx.x, d = g.head_dim;
  const int first = blockIdx.y * kGatherRowsPerBlock, len = g.len[i];
  const int rows = len - first < kGatherRowsPerBlock ? len - first : kGatherRowsPerBlock;
  if (rows <= 0) return;
  const std::int32_t* tok = g.tokens + static_cast<std::int64_t>(i) * g.max_k + first;
  const half_bits* hk = g.host_k[i];
  const half_bits* hv = g.host_v[i];
  half_bits* dk = g.dst_k[i] + static_cast<std::int64_t>(first) * d;
  half_bits* dv = g.dst_v[i] + static_cast<std::int64_t>(first) * d;
  if (d % 8 == 0 && g.token_stride % 8 == 0 && aligned16(hk) && aligned16(hv) && aligned16(dk) && aligned16(dv)) {
    const int per_row = d / 8, n = rows * per_row;
    const std::int64_t stride = g.token_stride / 8;
    const auto* sk = reinterpret_cast<const uint4*>(hk);
    const auto* sv = reinterpret_cast<const uint4*>(hv);
    auto* ok = reinterpret_cast<uint4*>(dk);
    auto* ov = reinterpret_cast<uint4*>(dv);
    for (int base = threadIdx.x; base < n; base += kGatherLoads * kGatherThreads) {
      uint4 k[kGatherLoads], v[kGatherLoads];
#pragma unroll
      for (int u = 0; u < kGatherLoads; ++u) {
        const int x = base + u * kGatherThreads;
        if (x < n) {
          const std::int64_t src = static_cast<std::int64_t>(tok[x / per_row]) * stride + x % per_row;
          k[u] = sk[src];
          v[u] = sv[src];
        }
      }
#pragma unroll
      for (int u = 0; u < kGatherLoads; ++u) {
        const int x = base + u * kGatherThreads;
        if (x < n) {
          ok[x] = k[u];
          ov[x] = v[u];
        }
      }
    }
    return;
  }
  for (int x = threadIdx.x; x < rows * d; x += blockDim.x) {
    const int t = x / d, c = x % d;
    const std::int64_t src = static_cast<std::int64_t>(tok[t]) * g.token_stride + c;
    dk[x] = hk[src];
    dv[x] = hv[src];
  }
}

}  // namespace kvcal::runtime::cuda::kernels
