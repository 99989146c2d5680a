// CHESS selection driven through a backend (a GPU through chess_cuda.h, or
// the host emulation of CUDA) and compared with ChessIndex / select_batch on
// the same keys: a batch of requests of mixed lengths (empty, a partial
// page, exactly one page, a single grid, many grids), keys appended layer by
// layer over several steps, the page table compared after every step. Keys
// are small multiples of 36, so that every mean and dot product is exact in
// float and page sets must be identical (HEX's ties apart, none here).
//
// A backend provides alloc/put/get (as in flow.h) and chess_append(batch,
// keys, stride, offset, width, indptr, before), chess_select(batch, tokens, table).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvcal/runtime/chess.h"
#include "kvcal/runtime/chess_cuda.h"

namespace kvcal::runtime::chess_flow {

namespace kc = kvcal::runtime::cuda;

template <class Backend>
void run(Backend& be, const ChessOptions& o, std::int32_t layers, std::int32_t width,
         const std::vector<std::int32_t>& prefill, int steps) {
  SCOPED_TRACE("page " + std::to_string(o.page_size) + " chunk " + std::to_string(o.chunk_pages) + " grid " +
               std::to_string(o.grid_chunks));
  const std::int32_t D = layers * width, R = static_cast<std::int32_t>(prefill.size());
  std::int32_t longest = 0;
  for (const std::int32_t n : prefill) longest = std::max(longest, n + steps);
  const std::int32_t max_pages = std::max<std::int32_t>(1, static_cast<std::int32_t>(longest / o.page_size));
  const std::size_t bytes = kc::chess_batch_bytes(R, D, max_pages, o);
  auto mem = be.alloc(bytes);  // zeroed
  const kc::ChessDeviceBatch b = kc::chess_batch(mem.p, bytes, R, D, max_pages, o);
  auto indptr_d = be.alloc((R + 1) * 4), indices_d = be.alloc(static_cast<std::size_t>(R) * (max_pages + 1) * 4),
       last_d = be.alloc(R * 4), tokens_d = be.alloc(R * 4), before_d = be.alloc(R * 4), tip_d = be.alloc((R + 1) * 4);
  const kc::ChessPageTable table{static_cast<std::int32_t*>(indptr_d.p), static_cast<std::int32_t*>(indices_d.p),
                                 static_cast<std::int32_t*>(last_d.p)};
  std::vector<ChessIndex> ref;
  for (int r = 0; r < R; ++r) ref.emplace_back(D, o);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(R), 0);
  std::mt19937_64 rng(17);
  std::uniform_int_distribution<int> val(-5, 5);
  for (int step = 0; step <= steps; ++step) {
    std::vector<std::int32_t> indptr{0}, counts;
    for (int r = 0; r < R; ++r) {
      counts.push_back(step == 0 ? prefill[static_cast<std::size_t>(r)] : (r % 2 == 0 || step % 3 == 0 ? 1 : 0));
      indptr.push_back(indptr.back() + counts.back());
    }
    const std::int32_t rows = indptr.back();
    std::vector<half_bits> keys(static_cast<std::size_t>(std::max(rows, 1)) * D);
    std::vector<float> fkeys(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
      fkeys[i] = static_cast<float>(36 * val(rng));
      keys[i] = float_to_half(fkeys[i]);
    }
    for (int r = 0; r < R; ++r)
      ref[static_cast<std::size_t>(r)].append(fkeys.data() + static_cast<std::size_t>(indptr[r]) * D,
                                              counts[static_cast<std::size_t>(r)], D);
    auto keys_d = be.alloc(keys.size() * 2);
    be.put(keys_d.p, keys.data(), keys.size() * 2);
    be.put(tip_d.p, indptr.data(), indptr.size() * 4);
    be.put(before_d.p, tokens.data(), tokens.size() * 4);
    for (std::int32_t l = 0; l < layers; ++l)  // one call per layer: its slice of every token's D values
      be.chess_append(b, static_cast<const half_bits*>(keys_d.p) + l * width, D, l * width, width,
                      static_cast<const std::int32_t*>(tip_d.p), static_cast<const std::int32_t*>(before_d.p));
    for (int r = 0; r < R; ++r) tokens[static_cast<std::size_t>(r)] += counts[static_cast<std::size_t>(r)];
    be.put(tokens_d.p, tokens.data(), tokens.size() * 4);
    be.chess_select(b, static_cast<const std::int32_t*>(tokens_d.p), table);
    std::vector<const ChessIndex*> reqs;
    for (const auto& c : ref) reqs.push_back(&c);
    const PageTable want = select_batch(reqs);
    std::vector<std::int32_t> indptr_got(static_cast<std::size_t>(R + 1)), last_got(static_cast<std::size_t>(R));
    be.get(indptr_got.data(), indptr_d.p, indptr_got.size() * 4);
    be.get(last_got.data(), last_d.p, last_got.size() * 4);
    ASSERT_EQ(indptr_got, want.indptr) << "step " << step;
    std::vector<std::int32_t> indices_got(static_cast<std::size_t>(indptr_got.back()));
    be.get(indices_got.data(), indices_d.p, indices_got.size() * 4);
    ASSERT_EQ(indices_got, want.indices) << "step " << step;
    ASSERT_EQ(last_got, want.last_page_len) << "step " << step;
  }
}

template <class Backend>
void batch(Backend& be) {
  ChessOptions o = chess_preset("moderate");
  o.page_size = 4;
  o.chunk_pages = 4;
  o.grid_chunks = 2;
  // Requests: empty, a partial page, one page, one grid, several grids.
  run(be, o, 2, 16, {0, 3, 4, 24, 130}, 9);
  ChessOptions a = chess_preset("aggressive");
  a.page_size = 2;
  a.chunk_pages = 2;
  a.grid_chunks = 2;
  a.sink_pages = 2;
  a.recent_pages = 1;
  run(be, a, 3, 8, {5, 64, 1}, 6);
}

}  // namespace kvcal::runtime::chess_flow
