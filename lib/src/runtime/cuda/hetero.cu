// Host launchers of the HeteroCache kernels (hetero_kernels.cuh): state
// layout, argument checks, launches.
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "kvcal/runtime/hetero_cuda.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/hetero_kernels.cuh"

namespace kvcal::runtime::cuda {
namespace {

using namespace kernels;  // NOLINT(google-build-using-namespace)

void check_rows(const AttentionRows& rows, const char* what) {
  if (rows.count < 0 || (rows.count > 0 && (!rows.rows || !rows.n)))
    throw Error(std::string(what) + ": null attention rows");
}

}  // namespace

void drift_init(const DriftState& s, const AttentionRows& rows, Stream stream) {
  check_rows(rows, "drift_init");
  if (!s.base || rows.count != s.pivots)
    throw Error("drift_init: " + std::to_string(rows.count) + " rows for " + std::to_string(s.pivots) + " pivots");
  drift_init_kernel<<<s.pivots, kTopkThreads, 0, stream>>>(s, rows);
  detail::check_launch("drift_init_kernel");
}

void drift_step(const DriftState& s, const AttentionRows& rows, Stream stream) {
  check_rows(rows, "drift_step");
  if (!s.base || rows.count != s.pivots)
    throw Error("drift_step: " + std::to_string(rows.count) + " rows for " + std::to_string(s.pivots) + " pivots");
  drift_step_kernel<<<s.pivots, kTopkThreads, 0, stream>>>(s, rows);
  detail::check_launch("drift_step_kernel");
}

void satellite_topk(const DriftState& s, const AttentionRows& rows, const Satellites& sats, bool when_drifted,
                    Stream stream) {
  check_rows(rows, "satellite_topk");
  if (!s.result || rows.count != s.pivots) throw Error("satellite_topk: one row per pivot is needed");
  if (sats.count < 0 || sats.max_k < 0 || (sats.count > 0 && (!sats.pivot_of || !sats.k || !sats.tokens || !sats.len)))
    throw Error("satellite_topk: bad satellite arrays");
  if (sats.count == 0) return;
  satellite_topk_kernel<<<sats.count, kTopkThreads, 0, stream>>>(s, rows, sats, when_drifted);
  detail::check_launch("satellite_topk_kernel");
}

void top_k_rows(const AttentionRows& rows, const std::int32_t* k, std::int32_t max_k, std::int32_t* out,
                std::int32_t* len, Stream stream) {
  check_rows(rows, "top_k_rows");
  if (max_k < 0 || (rows.count > 0 && (!k || !len || (max_k > 0 && !out))))
    throw Error("top_k_rows: bad k, output or length arrays");
  if (rows.count == 0) return;
  top_k_rows_kernel<<<rows.count, kTopkThreads, 0, stream>>>(rows, k, max_k, out, len);
  detail::check_launch("top_k_rows_kernel");
}

void gather_rows(const GatherLists& g, Stream stream) {
  if (g.count < 0 || g.max_k < 0 || g.head_dim < 1 || g.token_stride < g.head_dim)
    throw Error("gather_rows: bad counts, head_dim or token stride");
  if (g.count == 0 || g.max_k == 0) return;
  if (!g.host_k || !g.host_v || !g.dst_k || !g.dst_v || !g.tokens || !g.len)
    throw Error("gather_rows: null pointer arrays");
  const dim3 grid(static_cast<unsigned>(g.count),
                  static_cast<unsigned>((g.max_k + kGatherRowsPerBlock - 1) / kGatherRowsPerBlock));
  gather_rows_kernel<<<grid, kGatherThreads, 0, stream>>>(g);
  detail::check_launch("gather_rows_kernel");
}

}  // namespace kvcal::runtime::cuda
