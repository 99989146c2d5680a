// The memory-read bandwidth baseline the benchmarks compare with: a
// vectorised sum over a buffer far larger than the caches, on `threads`
// threads, each summing a contiguous slice with four 16-lane accumulators.
#pragma once

#include <cstdint>
#include <cstring>

#include <omp.h>

namespace kvcal::bench {

// The sum over [begin, end) of data, with the widest vectors the host has:
// built for x86-64-v4 (AVX-512), v3 (AVX2) and the baseline and picked at
// load time, since the portable build's baseline (16-byte loads) drew 40%
// less than 64-byte loads from memory on an Intel host (16 against 27 GB/s,
// two threads), which would understate the bandwidth the decode is compared
// with.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVCAL_BENCH_WIDEST_VECTORS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVCAL_BENCH_WIDEST_VECTORS
#endif
KVCAL_BENCH_WIDEST_VECTORS static float slice_sum(const float* data, std::int64_t begin, std::int64_t end) {
  typedef float vf16 __attribute__((vector_size(64)));
  vf16 a0{}, a1{}, a2{}, a3{};
  for (std::int64_t i = begin; i < end; i += 64) {
    vf16 x0, x1, x2, x3;
    std::memcpy(&x0, data + i, 64);
    std::memcpy(&x1, data + i + 16, 64);
    std::memcpy(&x2, data + i + 32, 64);
    std::memcpy(&x3, data + i + 48, 64);
    a0 += x0, a1 += x1, a2 += x2, a3 += x3;
  }
  const vf16 a = a0 + a1 + a2 + a3;
  float total = 0;
  for (int k = 0; k < 16; ++k) total += a[k];
  return total;
}

inline float streaming_sum(const float* data, std::int64_t n, int threads) {
  float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const std::int64_t per = n / nt / 64 * 64;
    const std::int64_t begin = t * per, end = t + 1 == nt ? n / 64 * 64 : begin + per;
    total += slice_sum(data, begin, end);
  }
  return total;
}

}  // namespace kvcal::bench
