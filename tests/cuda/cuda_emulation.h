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
// Not emulated: warp-synchronous execution without a barrier (the kernels
// never rely on it), memory spaces (device pointers are host pointers here),
// and floating-point differences of the device (expf is the host's).
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

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
  std::vector<float> exchange;  // [warps][32]
  std::vector<unsigned> votes;  // [warps][32]
  std::vector<unsigned char> shared;
};

inline thread_local Dim3 thread_idx, block_idx, block_dim;
inline Launch* current = nullptr;  // one launch at a time

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

// Runs body() as grid x grid_y blocks of `threads` threads (a multiple of
// 32) with `shared_bytes` of dynamic shared memory.
template <class Body>
void launch(unsigned grid, unsigned threads, std::size_t shared_bytes, Body body, unsigned grid_y = 1) {
  Launch l;
  l.block = std::make_unique<std::barrier<>>(threads);
  for (unsigned w = 0; w < threads / 32; ++w) l.warps.push_back(std::make_unique<std::barrier<>>(32));
  l.exchange.assign(static_cast<std::size_t>(threads), 0.0f);
  l.votes.assign(static_cast<std::size_t>(threads), 0u);
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
