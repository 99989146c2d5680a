// HeteroCache on the GPU (libkvcal_runtime_cuda; HeteroCache §4.3 and
// Algorithm 1): the pivot heads' drift monitors and the satellites'
// retrieval, with kvcal/runtime/hetero.h's CPU code as the reference.
//
// Per decode step an engine (pointers are device pointers unless stated):
//   1. cuda::drift_step(state, rows, stream): each pivot's top-L_base
//      positions of its attention row (a radix select in one thread block per
//      row, rows of any length), the overlap with its base set, and every W
//      steps the window's median against tau_drift; on drift the base set
//      becomes the current one. Results in state.result (DriftResult per
//      pivot), identical to DriftMonitor::step on the same rows.
//   2. cuda::satellite_topk(state, rows, sats, stream): for each satellite
//      of a pivot that drifted this step, the top-l_s positions of the
//      pivot's row (satellite_fetches), ascending; others get length 0.
//   3. cuda::gather_rows(...) on a second stream: each listed token's K and V
//      rows copied from host memory (pinned and mapped: cudaHostAlloc with
//      cudaHostAllocMapped, or registered) into the satellite's device rows,
//      the copy overlapping the compute stream's work.
// All calls launch kernels only (graph-capturable); bad arguments are an
// Error before any launch.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvcal/runtime/common.h"

struct CUstream_st;

namespace kvcal::runtime::cuda {

using Stream = CUstream_st*;

// One attention row per pivot (or per request and head): rows[i] points to
// n[i] floats. Both arrays in device memory.
struct AttentionRows {
  const float* const* rows = nullptr;
  const std::int32_t* n = nullptr;
  std::int32_t count = 0;
};

// What a drift step found for one pivot (DriftMonitor::Step, plus counters).
struct DriftResult {
  double overlap = 0, median = 0;
  std::int32_t checked = 0, drift = 0, steps = 0, drifts = 0;
};

// The device state of `pivots` drift monitors (carve it with drift_state()).
struct DriftState {
  std::int32_t pivots = 0, l_base = 0, window = 0;
  double tau = 0;
  std::int32_t* base = nullptr;      // [pivots][l_base] ascending token indices
  std::int32_t* base_len = nullptr;  // [pivots]
  std::int32_t* current = nullptr;   // [pivots][l_base] this step's set
  std::int32_t* cur_len = nullptr;   // [pivots]
  std::int32_t* overlaps = nullptr;  // [pivots][window] |K_t ∩ K_base| of the window's steps
  DriftResult* result = nullptr;     // [pivots]
};

// Bytes of device memory the state of `pivots` monitors needs.
KVCAL_RUNTIME_API std::size_t drift_state_bytes(std::int32_t pivots, std::int32_t l_base, std::int32_t window);
// Lays the state out in `memory` (device, `bytes` long; zero it before
// drift_init). Throws Error for bad parameters (as DriftMonitor's) or too
// little memory.
KVCAL_RUNTIME_API DriftState drift_state(void* memory, std::size_t bytes, std::int32_t pivots, std::int32_t l_base,
                                         std::int32_t window, double tau_drift);
// Base sets from the prefill rows (rows.count == pivots); counters reset.
KVCAL_RUNTIME_API void drift_init(const DriftState& state, const AttentionRows& prefill, Stream stream);
KVCAL_RUNTIME_API void drift_step(const DriftState& state, const AttentionRows& attention, Stream stream);

// Satellites to refresh: satellite i belongs to pivot pivot_of[i] (an index
// into the state's pivots and rows) and keeps k[i] tokens (l_s).
struct Satellites {
  const std::int32_t* pivot_of = nullptr;  // [count]
  const std::int32_t* k = nullptr;         // [count]
  std::int32_t count = 0;
  std::int32_t max_k = 0;          // the largest k (host value: the lists' row length)
  std::int32_t* tokens = nullptr;  // [count][max_k] output, ascending
  std::int32_t* len = nullptr;     // [count] output: min(k, n) when the pivot drifted this step, else 0
};
// when_drifted: only satellites of pivots whose result says drift (else all).
KVCAL_RUNTIME_API void satellite_topk(const DriftState& state, const AttentionRows& pivot_rows, const Satellites& sats,
                                      bool when_drifted, Stream stream);

// Top-k positions of each row (ties: lower index first), ascending: out
// [rows.count][max_k], len[i] = min(k[i], n[i]). The selection primitive of
// the calls above, exposed for engines' own policies.
KVCAL_RUNTIME_API void top_k_rows(const AttentionRows& rows, const std::int32_t* k, std::int32_t max_k,
                                  std::int32_t* out, std::int32_t* len, Stream stream);

// Copies the K and V rows of listed tokens from host memory into device rows:
// entry t < len[i] of list i, token = tokens[i * max_k + t], is copied from
// host_k[i] + token * token_stride to dst_k[i] + t * head_dim (head_dim
// halves; V likewise). host_k/host_v point to mapped pinned host memory (the
// CPU's full cache of the satellite's head); the arrays of pointers are in
// device memory.
struct GatherLists {
  const half_bits* const* host_k = nullptr;  // [count]
  const half_bits* const* host_v = nullptr;
  half_bits* const* dst_k = nullptr;  // [count]
  half_bits* const* dst_v = nullptr;
  const std::int32_t* tokens = nullptr;  // [count][max_k]
  const std::int32_t* len = nullptr;     // [count]
  std::int32_t count = 0, max_k = 0, head_dim = 0;
  std::int64_t token_stride = 0;  // halves between tokens in host memory
};
KVCAL_RUNTIME_API void gather_rows(const GatherLists& lists, Stream stream);

}  // namespace kvcal::runtime::cuda
