// The CHESS kernels (chess_cuda.h): summaries updated per dimension with the
// CPU's arithmetic, the anchor, one dot product per summary row, the
// hierarchical selection of one request per thread block (each level's
// quantile from two radix selections over its scores), and the
// paged-attention table. chess_select runs the levels in turn (scores of a
// level, then its selection), so that only units with an active parent are
// scored. A request whose kept selection still holds (see chess_kept) skips
// the anchor, the scores and the selection. Included by chess.cu and by the host emulation
// (tests/cuda/emulated_kernels.cpp); see kernels_common.cuh.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvcal/runtime/chess_cuda.h"
#include "runtime/cuda/kernels_common.cuh"
#include "runtime/cuda/radix_select.cuh"

namespace kvcal::runtime::cuda::kernels {

constexpr int kChessThreads = 128, kChessSelectThreads = 512;

struct ChessView {
  ChessDeviceBatch b;
  __device__ std::int64_t rows() const { return std::int64_t{b.max_grids} + b.max_chunks + b.max_pages; }
  __device__ float* page(int r, int p) const {
    return b.pages + (static_cast<std::int64_t>(r) * b.max_pages + p) * b.dim;
  }
  __device__ float* chunk(int r, int c) const {
    return b.chunks + (static_cast<std::int64_t>(r) * b.max_chunks + c) * b.dim;
  }
  __device__ float* grid(int r, int g) const {
    return b.grids + (static_cast<std::int64_t>(r) * b.max_grids + g) * b.dim;
  }
};

// Whether request r's kept selection holds for P complete pages: made for P
// pages and no page completed since (chess_append clears kept[0]).
__device__ inline bool chess_kept(const ChessDeviceBatch& b, int r, int P) {
  const std::int32_t* k = b.kept + 3 * static_cast<std::int64_t>(r);
  return P > 0 && k[0] != 0 && k[1] == P;
}

// Grid (requests, ceil(width / threads)): each thread owns one dimension of
// one request and runs ChessIndex's per-dimension updates over its new tokens.
__global__ void __launch_bounds__(kChessThreads)
    chess_append_kernel(ChessView v, const half_bits* keys, std::int64_t stride, int offset, int width,
                        const std::int32_t* indptr, const std::int32_t* before) {
  const ChessDeviceBatch& b = v.b;
  const int r = blockIdx.x, x = blockIdx.y * blockDim.x + threadIdx.x;
  if (x >= width) return;
  const int j = offset + x, B = b.page_size, Nc = b.chunk_pages, Ng = b.grid_chunks;
  const std::int64_t at = static_cast<std::int64_t>(r) * b.dim + j;
  double sum = b.page_sum[at], cacc = b.chunk_acc[at], gacc = b.grid_acc[at];
  const int first = indptr[r], n = indptr[r + 1] - first;
  std::int64_t tokens = before[r];
  for (int i = 0; i < n; ++i) {
    sum += static_cast<double>(half_to_float(keys[(first + i) * stride + x]));
    if (++tokens % B != 0) continue;
    if (x == 0) b.kept[3 * static_cast<std::int64_t>(r)] = 0;  // a page completes: select again
    const int p = static_cast<int>(tokens / B) - 1;
    if (p >= b.max_pages) continue;  // beyond the store (the host sizes it)
    const float pv = static_cast<float>(sum * (1.0 / static_cast<double>(B)));
    sum = 0.0;
    v.page(r, p)[j] = pv;
    const int c = p / Nc, g = c / Ng, in_chunk = p % Nc + 1, in_grid = c % Ng + 1;
    if (p % Nc == 0) {
      cacc = 0.0;
      if (c % Ng == 0) gacc = 0.0;
    }
    float* cv = v.chunk(r, c);
    const double old_c = in_chunk > 1 ? static_cast<double>(cv[j]) : 0.0;
    cacc += pv;
    const double new_c = cacc / static_cast<double>(in_chunk);
    cv[j] = static_cast<float>(new_c);
    gacc += new_c - old_c;
    v.grid(r, g)[j] = static_cast<float>(gacc / static_cast<double>(in_grid));
  }
  b.page_sum[at] = sum;
  b.chunk_acc[at] = cacc;
  b.grid_acc[at] = gacc;
}

// Grid (requests, ceil(dim / threads)): ChessIndex::anchor().
__global__ void __launch_bounds__(kChessThreads) chess_anchor_kernel(ChessView v, const std::int32_t* tokens) {
  const ChessDeviceBatch& b = v.b;
  const int r = blockIdx.x, j = blockIdx.y * blockDim.x + threadIdx.x;
  if (j >= b.dim) return;
  const int P = tokens[r] / b.page_size, partial = tokens[r] % b.page_size;
  if (P > b.max_pages || chess_kept(b, r, P)) return;  // beyond the store: nothing is selected
  double acc = 0.0;
  int count = 0;
  if (P > 0) {
    for (int p = P - b.recent_pages > 0 ? P - b.recent_pages : 0; p < P; ++p, ++count)
      acc += static_cast<double>(v.page(r, p)[j]);
  } else {
    acc = b.page_sum[static_cast<std::int64_t>(r) * b.dim + j];
    count = partial;
  }
  b.anchor[static_cast<std::int64_t>(r) * b.dim + j] = count > 0 ? static_cast<float>(acc / count) : 0.0f;
}

constexpr int kChessScoreLoads = 8;

// a . row over n floats by one warp (the sum in lane 0's and every lane's
// result). With n % 4 == 0 (both 16-byte aligned) each lane reads float4s,
// kChessScoreLoads of the row in flight: a row is D = layers x heads x
// head_dim floats (128 KB at the 8B shape), read once per selection, so the
// kernel is bound by the reads in flight, not by arithmetic. The order of the
// sum is fixed (lane, component, then the warp's butterfly): the same scores
// on every run.
__device__ inline float warp_dot(const float* a, const float* row, int n, int lane) {
  float s = 0.0f;
  if (n % 4 == 0) {
    const auto* a4 = reinterpret_cast<const float4*>(a);
    const auto* r4 = reinterpret_cast<const float4*>(row);
    const int n4 = n / 4;
    float sx = 0.0f, sy = 0.0f, sz = 0.0f, sw = 0.0f;
    int j = lane;
    for (; j + 32 * (kChessScoreLoads - 1) < n4; j += 32 * kChessScoreLoads) {
      float4 x[kChessScoreLoads];
#pragma unroll
      for (int u = 0; u < kChessScoreLoads; ++u) x[u] = r4[j + 32 * u];
#pragma unroll
      for (int u = 0; u < kChessScoreLoads; ++u) {
        const float4 y = a4[j + 32 * u];
        sx += x[u].x * y.x;
        sy += x[u].y * y.y;
        sz += x[u].z * y.z;
        sw += x[u].w * y.w;
      }
    }
    for (; j < n4; j += 32) {
      const float4 x = r4[j], y = a4[j];
      sx += x.x * y.x;
      sy += x.y * y.y;
      sz += x.z * y.z;
      sw += x.w * y.w;
    }
    s = (sx + sy) + (sz + sw);
  } else {
    for (int j = lane; j < n; j += 32) s += a[j] * row[j];
  }
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// A request's unit counts: P complete pages, C chunks, G grids.
struct ChessUnits {
  int P, partial, C, G;
  __device__ ChessUnits(const ChessDeviceBatch& b, std::int32_t tokens)
      : P(tokens / b.page_size),
        partial(tokens % b.page_size),
        C((P + b.chunk_pages - 1) / b.chunk_pages),
        G((C + b.grid_chunks - 1) / b.grid_chunks) {}
};

// The levels of Algorithm 1, in the order they are selected; a level's scores
// and mask sit at its offset in the request's rows (grids, chunks, pages).
enum ChessLevel : int { kGridLevel = 0, kChunkLevel = 1, kPageLevel = 2 };

// Grid (requests, ceil(max units of the level / warps)): one warp per unit of
// one level, after its parent level was selected. Only units whose parent is
// active are scored: the rule zeroes the others' scores (S' = S * active),
// so theirs are set to 0 without reading their rows -- with "moderate"
// ratios about 20% of the chunks and 30-44% of the pages (the zeroed scores
// below all others or among them).
__global__ void __launch_bounds__(kChessThreads)
    chess_score_kernel(ChessView v, const std::int32_t* tokens, int level) {
  const ChessDeviceBatch& b = v.b;
  const int r = blockIdx.x, lane = threadIdx.x % 32;
  const int q = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
  const ChessUnits u(b, tokens[r]);
  const int n = level == kGridLevel ? u.G : (level == kChunkLevel ? u.C : u.P);
  if (q >= n || u.P > b.max_pages || chess_kept(b, r, u.P)) return;  // whole warps leave together
  const std::int64_t at = static_cast<std::int64_t>(r) * v.rows();
  const int offset = level == kGridLevel ? 0 : (level == kChunkLevel ? b.max_grids : b.max_grids + b.max_chunks);
  bool active = true;  // the parent's mask (grids have none)
  if (level == kChunkLevel) active = b.masks[at + q / b.grid_chunks] != 0;
  if (level == kPageLevel) active = b.masks[at + b.max_grids + q / b.chunk_pages] != 0;
  float s = 0.0f;
  if (active) {
    const float* row = level == kGridLevel ? v.grid(r, q) : (level == kChunkLevel ? v.chunk(r, q) : v.page(r, q));
    s = warp_dot(b.anchor + static_cast<std::int64_t>(r) * b.dim, row, b.dim, lane);
  }
  if (lane == 0) b.scores[at + offset + q] = s;
}

using ChessRadix = RadixShared<11>;  // digits of 11, 11 and 10 bits over at most kChessMaxPages scores

// One level of Algorithm 1 by a thread block: S' = S * active; tau =
// quantile(S', 1 - rho) (linear interpolation between the order statistics
// at floor(pos) and the next, pos = (1 - rho)(n - 1), each found by a radix
// selection); mask = S' >= tau & active. active null: every unit active.
__device__ inline void chess_level(const float* s, int n, const std::uint8_t* active, double rho, std::uint8_t* mask,
                                   ChessRadix& sh) {
  const int tid = threadIdx.x, nt = blockDim.x;
  const auto key = [s, active](int i) { return order_key((!active || active[i]) ? s[i] : 0.0f); };
  const double pos = (1.0 - rho) * static_cast<double>(n - 1);
  const int lo = static_cast<int>(floor(pos));
  const int hi = lo + 1 < n - 1 ? lo + 1 : n - 1;
  unsigned take = 0;  // ascending position lo is the (n - lo)-th largest
  const float a = key_float(radix_kth_largest<11, 4>(key, n, static_cast<unsigned>(n - lo), sh, take));
  const float c =
      hi != lo ? key_float(radix_kth_largest<11, 4>(key, n, static_cast<unsigned>(n - lo - 1), sh, take)) : a;
  const double frac = pos - static_cast<double>(lo);
  const float tau = static_cast<float>(static_cast<double>(a) + frac * (static_cast<double>(c) - a));
  for (int i = tid; i < n; i += nt) {
    const bool on = !active || active[i];
    mask[i] = (on ? s[i] : 0.0f) >= tau && on ? 1 : 0;
  }
  __syncthreads();
}

// One request per thread block, one level: its active flags (its parent
// level's mask, written where its own mask goes: chess_level reads flag i
// before the same thread writes mask i), its mask; after the page level the
// sink and recent pages, then the selected pages in order (and the partial
// page) into `selected`, and the kept selection.
__global__ void __launch_bounds__(kChessSelectThreads)
    chess_level_kernel(ChessView v, const std::int32_t* tokens, int level) {
  const ChessDeviceBatch& b = v.b;
  const int r = blockIdx.x, tid = threadIdx.x, nt = blockDim.x, lane = tid % 32, warp = tid / 32;
  __shared__ ChessRadix sh;
  __shared__ int warp_sel[32];
  const ChessUnits u(b, tokens[r]);
  const int P = u.P, partial = u.partial, C = u.C, G = u.G;
  std::int32_t* out = b.selected + static_cast<std::int64_t>(r) * (b.max_pages + 1);
  std::int32_t* kept = b.kept + 3 * static_cast<std::int64_t>(r);
  const float* s = b.scores + static_cast<std::int64_t>(r) * v.rows();
  std::uint8_t* gm = b.masks + static_cast<std::int64_t>(r) * v.rows();
  std::uint8_t* cm = gm + b.max_grids;
  std::uint8_t* pm = cm + b.max_chunks;
  if (level == kGridLevel) {
    if (P > 0 && P <= b.max_pages && !chess_kept(b, r, P)) chess_level(s, G, nullptr, b.rho_grid, gm, sh);
    return;
  }
  if (level == kChunkLevel) {
    if (P > 0 && P <= b.max_pages && !chess_kept(b, r, P)) {
      for (int c = tid; c < C; c += nt) cm[c] = gm[c / b.grid_chunks];
      __syncthreads();
      chess_level(s + b.max_grids, C, cm, b.rho_chunk, cm, sh);
    }
    return;
  }
  if (P > b.max_pages) {  // beyond the store: select nothing rather than read out of it
    if (tid == 0) {
      b.selected_len[r] = 0;
      kept[0] = 0;
    }
    return;
  }
  if (chess_kept(b, r, P)) {  // the complete pages' selection holds; the partial page may have changed
    if (tid == 0) {
      int n = kept[2];
      if (partial > 0) out[n++] = P;
      b.selected_len[r] = n;
    }
    return;
  }
  if (P > 0) {
    for (int p = tid; p < P; p += nt) pm[p] = cm[p / b.chunk_pages];
    __syncthreads();
    chess_level(s + b.max_grids + b.max_chunks, P, pm, b.rho_page, pm, sh);
    for (int p = tid; p < P; p += nt)
      if (p < b.sink_pages || p >= P - b.recent_pages) pm[p] = 1;
    __syncthreads();
    int written = 0;
    const unsigned below = (1u << lane) - 1u;
    for (int base = 0; base < P; base += nt) {  // the selected pages in order
      const int p = base + tid;
      const bool sel = p < P && pm[p];
      const unsigned m = __ballot_sync(0xffffffffu, sel);
      if (lane == 0) warp_sel[warp] = __popc(m);
      __syncthreads();
      int pos = written + __popc(m & below), tile = 0;
      for (int w = 0; w < nt / 32; ++w) {
        if (w < warp) pos += warp_sel[w];
        tile += warp_sel[w];
      }
      if (sel) out[pos] = p;
      written += tile;
      __syncthreads();
    }
    if (tid == 0) {
      kept[0] = 1;
      kept[1] = P;
      kept[2] = written;
      if (partial > 0) out[written++] = P;
      b.selected_len[r] = written;
    }
  } else if (tid == 0) {
    if (partial > 0) out[0] = 0;
    b.selected_len[r] = partial > 0 ? 1 : 0;
  }
}

// One thread block per request: its offset in the table, its indices; block
// 0 also writes indptr.
__global__ void __launch_bounds__(kChessThreads)
    chess_table_kernel(ChessView v, const std::int32_t* tokens, ChessPageTable t) {
  const ChessDeviceBatch& b = v.b;
  const int r = blockIdx.x;
  int offset = 0;
  for (int q = 0; q < r; ++q) offset += b.selected_len[q];
  const int n = b.selected_len[r];
  const std::int32_t* sel = b.selected + static_cast<std::int64_t>(r) * (b.max_pages + 1);
  for (int i = threadIdx.x; i < n; i += blockDim.x) t.indices[offset + i] = sel[i];
  if (threadIdx.x == 0) {
    const int partial = tokens[r] % b.page_size;
    t.last_page_len[r] = n == 0 ? 0 : (partial > 0 ? partial : b.page_size);
  }
  if (r == 0 && threadIdx.x == 0) {
    int acc = 0;
    t.indptr[0] = 0;
    for (int q = 0; q < b.requests; ++q) t.indptr[q + 1] = (acc += b.selected_len[q]);
  }
}

}  // namespace kvcal::runtime::cuda::kernels
