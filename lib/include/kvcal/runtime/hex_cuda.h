// HEX on the GPU over a paged batch (libkvcal_runtime_cuda, built when the
// CUDA toolkit is found; target kvcal::runtime_cuda). The layout and the
// book-keeping are hex_paged.h's: HexPagedCache plans each step on the host,
// these functions run the plans on the device; HexPagedHost runs the same
// plans on the host with the same codec and is the reference the CUDA tests
// compare against (pages byte for byte, outputs within tolerance). The
// device decode computes the code products in float32 whatever the cache
// options' HexOptions::dot says (the integer rules are CPU-only so far).
//
// Per layer and decode step an engine:
//   1. plan = cache.plan_append(requests, new_tokens);          // host
//      args = hex_upload_step(plan, ws, ws_bytes, stream);      // host -> device copy
//      hex_run_step(layer, args, k_new, v_new, error, stream);   // compress filled blocks, append the rest
//   2. dplan = cache.plan_decode(requests); cache.page_table(requests, indptr, indices);
//      dargs = hex_upload_decode(dplan, indptr, indices, q_heads, ws2, ws2_bytes, stream);
//      hex_run_decode(layer, dargs, q, scale, out, observe, stream);
// The run steps launch kernels only (no allocation, copy or synchronisation):
// they can be captured in a CUDA graph and replayed with the same workspaces
// as long as the uploaded arrays are rewritten in place (hex_upload_* into the
// same workspace before the replay).
//
// Errors: invalid arguments throw kvcal::runtime::Error before any launch; a
// failed launch throws Error naming the kernel and CUDA's message. A
// non-finite key or value in a block being compressed cannot be reported
// synchronously: the compress kernel sets *error to 1 (error may be null).
// All pointers below are device pointers unless stated otherwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvcal/runtime/hex_paged.h"

// cudaStream_t without the CUDA headers (the same typedef as CUDA's).
struct CUstream_st;

namespace kvcal::runtime::cuda {

using Stream = CUstream_st*;

// One layer's device memory (the engine allocates it; sizes from the geometry).
struct HexDeviceLayer {
  HexPageGeometry geometry;
  std::int32_t kv_heads = 0;
  std::uint8_t* pages = nullptr;       // block page p at pages + p * geometry.page_bytes()
  std::uint8_t* residual = nullptr;    // residual page p at residual + p * geometry.residual_bytes(kv_heads)
  const std::int32_t* mask = nullptr;  // [block][mask_degree]; null when mask_degree == 0
  std::int64_t pages_count = 0, residual_count = 0;  // pool sizes (ids are checked on the host)
};

// A step plan in device memory (hex_upload_step).
struct HexStepArgs {
  const HexCompressJob* compress = nullptr;
  const HexAppendJob* append = nullptr;
  const std::int32_t* page_ids = nullptr;
  std::int32_t n_compress = 0, n_append = 0, rows = 0;
};

// Bytes of device workspace hex_upload_step needs for `plan`.
KVCAL_RUNTIME_API std::size_t hex_step_workspace_bytes(const HexStepPlan& plan);
// Copies the plan's arrays into `workspace` (device, `bytes` long) on `stream`.
KVCAL_RUNTIME_API HexStepArgs hex_upload_step(const HexStepPlan& plan, void* workspace, std::size_t bytes,
                                              Stream stream);
// Compresses the blocks that filled (one launch, every job and KV head), then
// appends the remaining tokens to the residual pages. k, v: the step's new
// tokens [rows][kv_heads][head_dim] binary16 (rows = plan.token_indptr.back()).
KVCAL_RUNTIME_API void hex_run_step(const HexDeviceLayer& layer, const HexStepArgs& args, const half_bits* k,
                                    const half_bits* v, int* error, Stream stream);

// A decode plan in device memory, with room for the split partials.
struct HexDecodeArgs {
  const HexDecodeItem* items = nullptr;
  const std::int32_t *split_indptr = nullptr, *residual_rows = nullptr, *residual_page = nullptr;
  const std::int32_t *page_indptr = nullptr, *page_indices = nullptr;
  float *part_max = nullptr, *part_sum = nullptr, *part_acc = nullptr, *res_scores = nullptr;
  // The mask by column, filled at each hex_run_decode before the pages are
  // read: channel c's entries (token << 8 | entry) at [mask_col_ptr[c],
  // mask_col_ptr[c + 1]) of mask_col.
  std::int32_t *mask_col_ptr = nullptr, *mask_col = nullptr;
  std::int32_t n_items = 0, requests = 0, slots = 0, q_heads = 0;
};

KVCAL_RUNTIME_API std::size_t hex_decode_workspace_bytes(const HexDecodePlan& plan,
                                                         const std::vector<std::int32_t>& page_indices,
                                                         const HexPageGeometry& geometry, std::int32_t q_heads);
// Copies the plan and page table (HexPagedCache::page_table of the same
// requests) into `workspace` on `stream`.
KVCAL_RUNTIME_API HexDecodeArgs hex_upload_decode(const HexDecodePlan& plan,
                                                  const std::vector<std::int32_t>& page_indptr,
                                                  const std::vector<std::int32_t>& page_indices,
                                                  const HexPageGeometry& geometry, std::int32_t q_heads,
                                                  void* workspace, std::size_t bytes, Stream stream);
// One query token per request: q [requests][q_heads][head_dim] floats (query
// head j reads KV head j / (q_heads / kv_heads), groups of 1 to 8), out
// likewise. Three launches: the mask by column (pages with expander
// entries), work items in parallel over compressed pages, the residual rows
// and the expander entries (codes read in place), then a merge of the splits
// (flash-decoding). observe: each residual token's attention weight, summed
// over its KV head's query group, is added to its heavy-hitter score.
//
// units: where the quantized rows of the pages are multiplied out. CUDA cores
// (every geometry; the default, and the faster on an H100 at every shape
// measured), or tensor cores: mma.sync with the codes as binary16
// operands (exact) and the query or weight factors split into a binary16
// high part and remainder (about 22 bits), accumulated in float; for 4- and
// 2-bit codes and head_dim 64 or 128, on devices of compute capability 8.0 and
// later (anything else is a runtime::Error before any launch). Kept rows,
// expander entries and the residual rows stay on the CUDA cores either way.
enum class DecodeUnits : std::int32_t { cuda_cores = 0, tensor_cores = 1 };
KVCAL_RUNTIME_API void hex_run_decode(const HexDeviceLayer& layer, const HexDecodeArgs& args, const float* q,
                                      float scale, float* out, bool observe, Stream stream,
                                      DecodeUnits units = DecodeUnits::cuda_cores);

// Whether a CUDA device is usable from this process, and if not why.
KVCAL_RUNTIME_API bool device_available(std::string* why = nullptr);

}  // namespace kvcal::runtime::cuda
