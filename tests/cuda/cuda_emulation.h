// A host emulation of the parts of the CUDA execution model the runtime's
// kernels use, so that their source runs on a CPU: every thread of a block is
// a std::thread (blocks of a launch run one after another), __syncthreads is
// a barrier of the block, a warp shuffle goes through a per-warp exchange
// with a barrier of the warp, __shared__ variables are function statics
// (shared by the block's threads; blocks never overlap), atomics are
// std::atomic_ref. Under ThreadSanitizer, a missing barrier between threads
// that share memory is a reported race, as compute-sanitizer's racecheck
// reports it on a GPU.
//
// Asynchronous copies (cp.async) are queued per thread in commit groups and
// performed at the latest moment the model allows, the thread's wait for
// them: a read of staged data before its wait sees what was there before.
// With eager_copies, each is performed as it is issued instead: a copy issued
// into memory other threads still read is then a race ThreadSanitizer reports
// (the device may land it that early).
//
// mma.sync (m16n8k16, binary16 operands, float accumulators) goes through a
// per-warp exchange of the fragments, laid out as the PTX ISA documents them;
// each lane then computes its four outputs in float, k in order.
//
// Not emulated: warp-synchronous execution without a barrier (the kernels
// never rely on it), memory spaces (device pointers are host pointers here),
// and floating-point differences of the device (expf is the host's).
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "kvcal/core/half.h"

#define KVCAL_CUDA_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

namespace kvcal::emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

struct Launch {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> exchange;       // [warps][32]
  std::vector<unsigned> votes;       // [warps][32]
  std::vector<std::uint32_t> frags;  // [warps][32][10]: an mma's a, b and c
  std::vector<unsigned char> shared;
};

inline thread_local Dim3 thread_idx, block_idx, block_dim;
inline Launch* current = nullptr;  // one launch at a time

// cp.async of one 32-bit word, its commit groups and waits (per thread, as
// on the device). The copies of a group are done when a wait no longer
// allows the group to be pending.
struct AsyncCopies {
  struct Copy {
    std::uint32_t* dst;
    const std::uint32_t* src;
  };
  std::vector<std::vector<Copy>> committed;  // oldest first
  std::vector<Copy> open;                    // issued since the last commit
};
inline thread_local AsyncCopies async_copies;
inline bool eager_copies = false;  // set between launches only

inline void async_copy(std::uint32_t* dst, const std::uint32_t* src) {
  if (eager_copies)
    *dst = *src;
  else
    async_copies.open.push_back({dst, src});
}
inline void async_commit() {
  async_copies.committed.push_back(std::move(async_copies.open));
  async_copies.open.clear();
}
// cp.async.wait_group n: every group but the n most recently committed is done.
inline void async_wait(std::size_t n) {
  auto& c = async_copies.committed;
  while (c.size() > n) {
    for (const auto& x : c.front()) *x.dst = *x.src;
    c.erase(c.begin());
  }
}
// Whether no copy is in flight (empty groups may be pending, as on the device).
inline bool async_idle() {
  for (const auto& g : async_copies.committed)
    if (!g.empty()) return false;
  return async_copies.open.empty();
}

inline void syncthreads() { current->block->arrive_and_wait(); }

// A warp shuffle: every lane posts x and reads lane source(lane)'s.
template <class T, class Source>
T exchange(T x, Source source) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  const unsigned t = thread_idx.x, w = t / 32, lane = t % 32;
  float* ex = current->exchange.data() + static_cast<std::size_t>(w) * 32;
  std::memcpy(ex + lane, &x, 4);
  current->warps[w]->arrive_and_wait();
  T y;
  std::memcpy(&y, ex + source(lane), 4);
  current->warps[w]->arrive_and_wait();
  return y;
}

template <class T>
T shfl_xor(T x, int offset) {
  return exchange(x, [offset](unsigned lane) { return lane ^ static_cast<unsigned>(offset); });
}

// Lanes below delta keep their own value, as on the device.
template <class T>
T shfl_up(T x, unsigned delta) {
  return exchange(x, [delta](unsigned lane) { return lane >= delta ? lane - delta : lane; });
}

inline unsigned ballot(bool pred) {
  const unsigned t = thread_idx.x, w = t / 32, lane = t % 32;
  unsigned* v = current->votes.data() + static_cast<std::size_t>(w) * 32;
  v[lane] = pred ? 1u : 0u;
  current->warps[w]->arrive_and_wait();
  unsigned m = 0;
  for (unsigned l = 0; l < 32; ++l) m |= v[l] << l;
  current->warps[w]->arrive_and_wait();
  return m;
}

// D += A B on the fragments of one warp (see mma16816 in
// hex_decode_kernels.cuh for the layout).
inline void mma_m16n8k16(float d[4], const std::uint32_t a[4], const std::uint32_t b[2]) {
  const unsigned t = thread_idx.x, w = t / 32, lane = t % 32;
  std::uint32_t* f = current->frags.data() + static_cast<std::size_t>(w) * 320;
  for (int i = 0; i < 4; ++i) f[lane * 10 + i] = a[i];
  f[lane * 10 + 4] = b[0];
  f[lane * 10 + 5] = b[1];
  current->warps[w]->arrive_and_wait();
  const auto half = [](std::uint32_t reg, int k) {
    return fp16::to_float(static_cast<fp16::half_bits>(k % 2 == 0 ? reg & 0xFFFFu : reg >> 16));
  };
  // A[row][k]: lane 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8).
  const auto A = [&](int row, int k) {
    return half(f[((row % 8) * 4 + (k % 8) / 2) * 10 + (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
  };
  // B[k][col]: lane 4 col + (k % 8) / 2, register k >= 8.
  const auto B = [&](int k, int col) { return half(f[(col * 4 + (k % 8) / 2) * 10 + 4 + (k >= 8 ? 1 : 0)], k); };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = static_cast<int>(lane / 4) + 8 * (i / 2), col = 2 * static_cast<int>(lane % 4) + i % 2;
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
    out[i] = s;
  }
  current->warps[w]->arrive_and_wait();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// Runs body() as grid x grid_y blocks of `threads` threads (a multiple of
// 32) with `shared_bytes` of dynamic shared memory.
template <class Body>
void launch(unsigned grid, unsigned threads, std::size_t shared_bytes, Body body, unsigned grid_y = 1) {
  Launch l;
  l.block = std::make_unique<std::barrier<>>(threads);
  for (unsigned w = 0; w < threads / 32; ++w) l.warps.push_back(std::make_unique<std::barrier<>>(32));
  l.exchange.assign(static_cast<std::size_t>(threads), 0.0f);
  l.votes.assign(static_cast<std::size_t>(threads), 0u);
  l.frags.assign(static_cast<std::size_t>(threads) * 10, 0u);
  l.shared.assign(shared_bytes + 16, 0);
  current = &l;
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      thread_idx.x = t;
      block_dim.x = threads;
      for (unsigned by = 0; by < grid_y; ++by)
        for (unsigned b = 0; b < grid; ++b) {
          block_idx.x = b;
          block_idx.y = by;
          body();
          // A kernel that leaves copies in flight reads what it staged
          // before it landed, or not at all.
          const bool idle = async_idle();
          async_copies = AsyncCopies{};
          if (!idle) {
            std::fputs("cuda emulation: a thread ended its block with asynchronous copies in flight\n", stderr);
            std::abort();
          }
          syncthreads();  // the block ends before the next one starts
        }
    });
  for (auto& th : pool) th.join();
  current = nullptr;
}

}  // namespace kvcal::emu

#define threadIdx ::kvcal::emu::thread_idx
#define blockIdx ::kvcal::emu::block_idx
#define blockDim ::kvcal::emu::block_dim
#define __syncthreads() ::kvcal::emu::syncthreads()
#define __shfl_xor_sync(mask, x, offset) ::kvcal::emu::shfl_xor(x, offset)
#define __shfl_up_sync(mask, x, delta) ::kvcal::emu::shfl_up(x, static_cast<unsigned>(delta))
#define __ballot_sync(mask, pred) ::kvcal::emu::ballot(pred)

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }

inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int atomicExch(int* p, int v) { return std::atomic_ref<int>(*p).exchange(v); }

struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct alignas(16) float4 {
  float x, y, z, w;
};

namespace kvcal::runtime::cuda::kernels {
inline unsigned char* dynamic_shared() {
  // 16-byte aligned like CUDA's dynamic shared memory.
  auto p = reinterpret_cast<std::uintptr_t>(::kvcal::emu::current->shared.data());
  return reinterpret_cast<unsigned char*>((p + 15) & ~std::uintptr_t{15});
}
}  // namespace kvcal::runtime::cuda::kernels
