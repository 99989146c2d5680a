// The layout of CHESS's device store (chess_cuda.h): plain host code, in
// libkvcal_runtime, so that it serves the CUDA library and the host
// emulation of its kernels alike.
#include <algorithm>
#include <string>

#include "kvcal/runtime/chess_cuda.h"
#include "runtime/cuda/carve.h"

namespace kvcal::runtime::cuda {
namespace {

struct Sizes {
  std::size_t pages, chunks, grids;
};

Sizes sizes(std::int32_t max_pages, const ChessOptions& o) {
  const std::size_t P = static_cast<std::size_t>(max_pages);
  const std::size_t C = (P + static_cast<std::size_t>(o.chunk_pages) - 1) / static_cast<std::size_t>(o.chunk_pages);
  const std::size_t G = (C + static_cast<std::size_t>(o.grid_chunks) - 1) / static_cast<std::size_t>(o.grid_chunks);
  return {P, C, G};
}

template <class F>
void carve(detail::Carve& c, std::int32_t requests, std::int32_t dim, const Sizes& z, F&& at) {
  const auto R = static_cast<std::size_t>(requests), D = static_cast<std::size_t>(dim);
  at(c.take<float>(R * z.pages * D), c.take<float>(R * z.chunks * D), c.take<float>(R * z.grids * D),
     c.take<double>(R * D), c.take<double>(R * D), c.take<double>(R * D), c.take<float>(R * D),
     c.take<float>(R * (z.pages + z.chunks + z.grids)), c.take<std::int32_t>(R * (z.pages + 1)),
     c.take<std::int32_t>(R), c.take<std::uint8_t>(R * (z.pages + z.chunks + z.grids)), c.take<std::int32_t>(R * 3));
}

void check(std::int32_t requests, std::int32_t dim, std::int32_t max_pages, const ChessOptions& o) {
  check_options(o);
  if (requests < 1 || dim < 1 || max_pages < 1 || max_pages > kChessMaxPages)
    throw Error("CHESS device store: requests and dim must be >= 1 and max_pages in [1, " +
                std::to_string(kChessMaxPages) + "], got " + std::to_string(requests) + ", " + std::to_string(dim) +
                ", " + std::to_string(max_pages));
}

}  // namespace

std::size_t chess_batch_bytes(std::int32_t requests, std::int32_t dim, std::int32_t max_pages, const ChessOptions& o) {
  check(requests, dim, max_pages, o);
  detail::Carve c{nullptr};
  carve(c, requests, dim, sizes(max_pages, o), [](auto...) {});
  return c.used;
}

ChessDeviceBatch chess_batch(void* memory, std::size_t bytes, std::int32_t requests, std::int32_t dim,
                             std::int32_t max_pages, const ChessOptions& o) {
  const std::size_t need = chess_batch_bytes(requests, dim, max_pages, o);
  if (!memory || bytes < need)
    throw Error("CHESS device store: " + std::to_string(bytes) + " bytes given, " + std::to_string(need) + " needed");
  const Sizes z = sizes(max_pages, o);
  ChessDeviceBatch b;
  b.requests = requests;
  b.dim = dim;
  b.max_pages = static_cast<std::int32_t>(z.pages);
  b.max_chunks = static_cast<std::int32_t>(z.chunks);
  b.max_grids = static_cast<std::int32_t>(z.grids);
  b.page_size = static_cast<std::int32_t>(o.page_size);
  b.chunk_pages = static_cast<std::int32_t>(o.chunk_pages);
  b.grid_chunks = static_cast<std::int32_t>(o.grid_chunks);
  b.sink_pages = static_cast<std::int32_t>(std::min<std::int64_t>(o.sink_pages, max_pages));
  b.recent_pages = static_cast<std::int32_t>(std::min<std::int64_t>(o.recent_pages, max_pages));
  b.rho_grid = o.rho_grid;
  b.rho_chunk = o.rho_chunk;
  b.rho_page = o.rho_page;
  detail::Carve c{static_cast<std::uint8_t*>(memory)};
  carve(c, requests, dim, z,
        [&](float* pages, float* chunks, float* grids, double* ps, double* ca, double* ga, float* anchor, float* scores,
            std::int32_t* sel, std::int32_t* len, std::uint8_t* masks, std::int32_t* kept) {
          b.pages = pages;
          b.chunks = chunks;
          b.grids = grids;
          b.page_sum = ps;
          b.chunk_acc = ca;
          b.grid_acc = ga;
          b.anchor = anchor;
          b.scores = scores;
          b.selected = sel;
          b.selected_len = len;
          b.masks = masks;
          b.kept = kept;
        });
  return b;
}

}  // namespace kvcal::runtime::cuda
