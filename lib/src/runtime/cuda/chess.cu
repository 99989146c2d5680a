// Host launchers of the CHESS kernels (chess_kernels.cuh): argument checks,
// launches.
#include <cuda_runtime.h>

#include <string>

#include "kvcal/runtime/chess_cuda.h"
#include "runtime/cuda/check.h"
#include "runtime/cuda/chess_kernels.cuh"

namespace kvcal::runtime::cuda {

using namespace kernels;  // NOLINT(google-build-using-namespace)

void chess_append(const ChessDeviceBatch& b, const half_bits* keys, std::int64_t stride, std::int32_t offset,
                  std::int32_t width, const std::int32_t* indptr, const std::int32_t* before, Stream stream) {
  if (!b.pages || b.requests < 1) throw Error("chess_append: the store is not laid out (chess_batch)");
  if (width < 1 || offset < 0 || offset + width > b.dim || stride < width)
    throw Error("chess_append: dimensions [" + std::to_string(offset) + ", " + std::to_string(offset + width) +
                ") do not fit D = " + std::to_string(b.dim) + " or the key stride is below the width");
  if (!keys || !indptr || !before) throw Error("chess_append: null keys, token_indptr or tokens_before");
  const dim3 grid(static_cast<unsigned>(b.requests),
                  static_cast<unsigned>((width + kChessThreads - 1) / kChessThreads));
  chess_append_kernel<<<grid, kChessThreads, 0, stream>>>(ChessView{b}, keys, stride, offset, width, indptr, before);
  detail::check_launch("chess_append_kernel");
}

void chess_select(const ChessDeviceBatch& b, const std::int32_t* tokens, const ChessPageTable& t, Stream stream) {
  if (!b.pages || b.requests < 1) throw Error("chess_select: the store is not laid out (chess_batch)");
  if (!tokens || !t.indptr || !t.indices || !t.last_page_len) throw Error("chess_select: null tokens or table arrays");
  const ChessView v{b};
  const unsigned R = static_cast<unsigned>(b.requests);
  chess_anchor_kernel<<<dim3(R, static_cast<unsigned>((b.dim + kChessThreads - 1) / kChessThreads)), kChessThreads, 0,
                        stream>>>(v, tokens);
  detail::check_launch("chess_anchor_kernel");
  const int per_block = kChessThreads / 32;
  const int units[3] = {b.max_grids, b.max_chunks, b.max_pages};
  for (const int level : {kGridLevel, kChunkLevel, kPageLevel}) {  // scores, then the selection, per level
    chess_score_kernel<<<dim3(R, static_cast<unsigned>((units[level] + per_block - 1) / per_block)), kChessThreads, 0,
                         stream>>>(v, tokens, level);
    detail::check_launch("chess_score_kernel");
    chess_level_kernel<<<R, kChessSelectThreads, 0, stream>>>(v, tokens, level);
    detail::check_launch("chess_level_kernel");
  }
  chess_table_kernel<<<R, kChessThreads, 0, stream>>>(v, tokens, t);
  detail::check_launch("chess_table_kernel");
}

void chess_invalidate(const ChessDeviceBatch& b, Stream stream) {
  if (!b.kept || b.requests < 1) throw Error("chess_invalidate: the store is not laid out (chess_batch)");
  detail::check(cudaMemsetAsync(b.kept, 0, static_cast<std::size_t>(b.requests) * 3 * sizeof(std::int32_t), stream),
                "chess_invalidate");
}

}  // namespace kvcal::runtime::cuda
