// The runtime's CUDA kernels (hex_step_kernels.cuh, hex_decode_kernels.cuh,
// hetero_kernels.cuh), compiled for the host and run under the emulation of
// cuda_emulation.h, through the scenarios of flow.h (HEX over a paged batch)
// and hetero_flow.h (top-k, drift monitors, satellites, gather): their
// indexing, barriers, online softmax, split merge, radix select and
// observation are checked on every machine, with or without a GPU
// (scripts/test.sh also runs a small subset under ThreadSanitizer, where a
// missing barrier is a reported race). The GPU itself is tested by
// test_hex_cuda.cpp (label cuda) through the same scenarios.
#include "cuda_emulation.h"  // first: the CUDA keywords the kernels use

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chess_flow.h"
#include "flow.h"
#include "hetero_flow.h"
#include "runtime/cuda/chess_kernels.cuh"
#include "runtime/cuda/hetero_kernels.cuh"
#include "runtime/cuda/hex_decode_kernels.cuh"
#include "runtime/cuda/hex_step_kernels.cuh"

namespace kvcal::runtime {
namespace {

using flow::i64;
using flow::run_flow;
namespace kc = kvcal::runtime::cuda;
namespace kk = kvcal::runtime::cuda::kernels;

struct HostBuffer {
  std::unique_ptr<std::uint8_t[]> data;
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit HostBuffer(std::size_t n) : data(new std::uint8_t[n + 16]()), p(data.get()), bytes(n) {}
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// The kernels launched as the library's launchers launch them, on host memory.
struct Emulated {
  static constexpr bool emulated = true;
  int decode_stages = 2;      // the decode's page stages: 2, or 1 where two do not fit (see hex_run_decode)
  bool tensor_cores = false;  // the decode's quantized rows through mma (DecodeUnits::tensor_cores)
  HostBuffer alloc(std::size_t n) { return HostBuffer(n); }
  HostBuffer host_alloc(std::size_t n) { return HostBuffer(n); }
  // CHESS kernels, launched as chess.cu launches them.
  void chess_append(const kc::ChessDeviceBatch& b, const half_bits* keys, std::int64_t stride, std::int32_t offset,
                    std::int32_t width, const std::int32_t* indptr, const std::int32_t* before) {
    emu::launch(
        static_cast<unsigned>(b.requests), kk::kChessThreads, 0,
        [&] { kk::chess_append_kernel(kk::ChessView{b}, keys, stride, offset, width, indptr, before); },
        static_cast<unsigned>((width + kk::kChessThreads - 1) / kk::kChessThreads));
  }
  void chess_select(const kc::ChessDeviceBatch& b, const std::int32_t* tokens, const kc::ChessPageTable& t) {
    const kk::ChessView v{b};
    const auto R = static_cast<unsigned>(b.requests);
    emu::launch(
        R, kk::kChessThreads, 0, [&] { kk::chess_anchor_kernel(v, tokens); },
        static_cast<unsigned>((b.dim + kk::kChessThreads - 1) / kk::kChessThreads));
    const int per = kk::kChessThreads / 32;
    const int units[3] = {b.max_grids, b.max_chunks, b.max_pages};
    for (const int level : {kk::kGridLevel, kk::kChunkLevel, kk::kPageLevel}) {
      emu::launch(
          R, kk::kChessThreads, 0, [&] { kk::chess_score_kernel(v, tokens, level); },
          static_cast<unsigned>((units[level] + per - 1) / per));
      emu::launch(R, kk::kChessSelectThreads, 0, [&] { kk::chess_level_kernel(v, tokens, level); });
    }
    emu::launch(R, kk::kChessThreads, 0, [&] { kk::chess_table_kernel(v, tokens, t); });
  }
  void chess_invalidate(const kc::ChessDeviceBatch& b) {
    std::memset(b.kept, 0, static_cast<std::size_t>(b.requests) * 3 * sizeof(std::int32_t));
  }
  // HeteroCache kernels.
  void top_k(const kc::AttentionRows& rows, const std::int32_t* k, std::int32_t max_k, std::int32_t* out,
             std::int32_t* len) {
    emu::launch(static_cast<unsigned>(rows.count), kk::kTopkThreads, 0,
                [&] { kk::top_k_rows_kernel(rows, k, max_k, out, len); });
  }
  void drift_init(const kc::DriftState& s, const kc::AttentionRows& rows) {
    emu::launch(static_cast<unsigned>(s.pivots), kk::kTopkThreads, 0, [&] { kk::drift_init_kernel(s, rows); });
  }
  void drift_step(const kc::DriftState& s, const kc::AttentionRows& rows) {
    emu::launch(static_cast<unsigned>(s.pivots), kk::kTopkThreads, 0, [&] { kk::drift_step_kernel(s, rows); });
  }
  void satellites(const kc::DriftState& s, const kc::AttentionRows& rows, const kc::Satellites& sats, bool when) {
    emu::launch(static_cast<unsigned>(sats.count), kk::kTopkThreads, 0,
                [&] { kk::satellite_topk_kernel(s, rows, sats, when); });
  }
  void gather(const kc::GatherLists& g) {
    emu::launch(
        static_cast<unsigned>(g.count), kk::kGatherThreads, 0, [&] { kk::gather_rows_kernel(g); },
        static_cast<unsigned>((g.max_k + kk::kGatherRowsPerBlock - 1) / kk::kGatherRowsPerBlock));
  }
  void put(void* dst, const void* src, std::size_t n) { std::memcpy(dst, src, n); }
  void get(void* dst, const void* src, std::size_t n) { std::memcpy(dst, src, n); }
  void step(const kc::HexDeviceLayer& L, const HexStepPlan& plan, const half_bits* k, const half_bits* v, int* error) {
    kc::HexStepArgs a;
    a.compress = plan.compress.data();
    a.append = plan.append.data();
    a.page_ids = plan.page_ids.data();
    a.n_compress = static_cast<std::int32_t>(plan.compress.size());
    a.n_append = static_cast<std::int32_t>(plan.append.size());
    a.rows = plan.token_indptr.back();
    if (a.n_compress > 0)
      emu::launch(static_cast<unsigned>(a.n_compress * L.kv_heads), kk::kStepThreads,
                  kk::compress_shared_bytes(L.geometry), [&] { kk::hex_compress_kernel(L, a, k, v, error); });
    if (a.n_append > 0)
      emu::launch(static_cast<unsigned>(a.n_append * L.kv_heads), kk::kStepThreads, 0,
                  [&] { kk::hex_append_kernel(L, a, k, v); });
  }
  void decode(const kc::HexDeviceLayer& L, const HexDecodePlan& plan, const std::vector<std::int32_t>& indptr,
              const std::vector<std::int32_t>& indices, std::int32_t q_heads, const float* q, float scale, float* out,
              bool observe) {
    const std::size_t slots = static_cast<std::size_t>(plan.split_indptr.back());
    std::vector<float> pmax(slots * q_heads), psum(pmax.size()), pacc(pmax.size() * L.geometry.head_dim);
    std::vector<float> res(plan.residual_rows.size() * q_heads * L.geometry.block);
    const bool columns = kk::mask_columns(L.geometry);
    std::vector<std::int32_t> col_ptr(columns ? L.geometry.head_dim + 1 : 0),
        col(columns ? L.geometry.block * L.geometry.mask_degree : 0);
    kc::HexDecodeArgs a;
    a.items = plan.items.data();
    a.split_indptr = plan.split_indptr.data();
    a.residual_rows = plan.residual_rows.data();
    a.residual_page = plan.residual_page.data();
    a.page_indptr = indptr.data();
    a.page_indices = indices.data();
    a.part_max = pmax.data();
    a.part_sum = psum.data();
    a.part_acc = pacc.data();
    a.res_scores = res.data();
    a.mask_col_ptr = col_ptr.data();
    a.mask_col = col.data();
    a.n_items = static_cast<std::int32_t>(plan.items.size());
    a.requests = static_cast<std::int32_t>(plan.residual_rows.size());
    a.slots = static_cast<std::int32_t>(slots);
    a.q_heads = q_heads;
    if (tensor_cores && !kk::mma_geometry(L.geometry))
      throw Error("emulated decode: tensor cores asked for a geometry they do not handle");
    if (columns)
      emu::launch(static_cast<unsigned>(kk::mask_column_blocks(L.geometry.head_dim)), kk::kColumnThreads, 0,
                  [&] { kk::hex_mask_columns_kernel(L, a); });
    kk::with_group(q_heads / L.kv_heads, [&](auto group) {
      constexpr int G = decltype(group)::value;
      const auto run = [&](auto mma_bits) {
        constexpr int B = decltype(mma_bits)::value;
        emu::launch(static_cast<unsigned>(a.n_items), kk::kDecodeThreads,
                    kk::DecodeShared<G>::bytes(L.geometry, decode_stages, B != 0),
                    [&] { kk::hex_decode_kernel<G, B>(L, a, q, scale, observe, decode_stages); });
      };
      if (!tensor_cores)
        run(std::integral_constant<int, 0>{});
      else if (L.geometry.bits == 4)
        run(std::integral_constant<int, 4>{});
      else
        run(std::integral_constant<int, 2>{});
    });
    emu::launch(static_cast<unsigned>(kk::merge_blocks(a.requests, L.kv_heads, q_heads, L.geometry.head_dim)),
                kk::kMergeThreads, 0, [&] { kk::hex_merge_kernel(L, a, out, observe); });
  }
};

// Small shapes (every thread of every block is an OS thread): every bit
// width, groups 1 to 8, head dims 64 and 128 (and odd ones), partial blocks,
// splits.
TEST(HexCudaEmulated, FlowMatchesTheHostExecutor) {
  Emulated emu;
  for (const char* method : {"hex4", "hex3", "hex2", "fp16", "kcvt3"}) {
    run_flow({method, 2, 4, 128, 16, {1, 15, 16, 17, 40}, 12, 0}, emu);
    run_flow({method, 1, 8, 64, 8, {7, 33}, 10, 2}, emu);
  }
  run_flow({"hex4", 3, 3, 64, 32, {100}, 4, 1}, emu);
  run_flow({"h2o2", 2, 1, 128, 16, {50, 3}, 20, 0}, emu);
  run_flow({"hex3", 1, 2, 40, 8, {21}, 3, 0}, emu);  // 15-byte rows: the byte-wise code path
  // Odd head dims: the value pass's last pair of channels has one.
  run_flow({"hex4", 1, 3, 45, 8, {21}, 3, 0}, emu);
  run_flow({"hex3", 2, 2, 33, 8, {9, 20}, 3, 0}, emu);
  run_flow({"fp16", 1, 2, 17, 8, {12}, 2, 0}, emu);
  // A group above 4 with an odd head dim.
  run_flow({"hex3", 1, 5, 33, 8, {9, 20}, 3, 0}, emu);
}

// Blocks of as many rows as the block has threads, or more: blocks of 128
// filled during decode (their kept rows chosen by observed scores: 117
// quantized and 11 kept), fp16 pages of 160 rows (a thread takes a second
// row), and blocks of 125 quantized rows.
TEST(HexCudaEmulated, BlocksOfAsManyRowsAsThreadsOrMore) {
  Emulated emu;
  run_flow({"hex4", 1, 2, 64, 128, {40}, 100, 0}, emu);
  run_flow({"fp16", 1, 2, 64, 160, {170}, 2, 0}, emu);
  run_flow({"hex2", 1, 3, 64, 125, {130}, 2, 0}, emu);
}

// The shapes ThreadSanitizer runs (scripts/test.sh): each kernel path once
// (codes with entries and kept rows, fp16 pages, residual rows, splits,
// items of several pages),
// with the staging copies landing as late as the kernels allow (a missing
// wait reads stale data: the outputs differ) and as early (a copy issued
// into a stage still being read: a race), with two page stages and with one.
TEST(HexCudaEmulated, SmallFlowForRaceChecks) {
  Emulated emu;
  for (const int stages : {2, 1})
    for (const bool eager : {false, true}) {
      SCOPED_TRACE(std::to_string(stages) +
                   (eager ? " stages, copies land when issued" : " stages, copies land at their wait"));
      emu.decode_stages = stages;
      emu::eager_copies = eager;
      run_flow({"hex3", 2, 4, 64, 8, {3, 29}, 5, 2}, emu);  // items of two pages, the second with the residual
      run_flow({"fp16", 1, 2, 32, 8, {9}, 2, 0}, emu);
      emu.tensor_cores = true;
      run_flow({"hex4", 1, 2, 64, 8, {3, 29}, 3, 2}, emu);
      emu.tensor_cores = false;
    }
  emu::eager_copies = false;
}

// The tensor-core decode (4- and 2-bit codes, head_dim 64 and 128): one and two
// column tiles of scores (groups up to 4, and 5 to 8), row tiles partly past
// a page's quantized rows (blocks of 8, 24), one and two channel groups of
// values, expander entries and kept rows beside the tiles, partial blocks and
// splits, with two page stages and one.
TEST(HexCudaEmulated, TensorCoreDecodeMatchesTheHostExecutor) {
  Emulated emu;
  emu.tensor_cores = true;
  for (const int stages : {2, 1}) {
    SCOPED_TRACE(std::to_string(stages) + " stages");
    emu.decode_stages = stages;
    run_flow({"hex4", 2, 4, 128, 16, {1, 15, 16, 17, 40}, 6, 0}, emu);
    run_flow({"hex4", 1, 8, 64, 8, {7, 33}, 5, 2}, emu);
    run_flow({"kcvt4", 2, 3, 64, 24, {50, 25}, 4, 1}, emu);
    run_flow({"hex4", 1, 5, 128, 32, {100}, 3, 0}, emu);
    run_flow({"h2o4", 1, 1, 64, 16, {40}, 3, 0}, emu);
    run_flow({"hex2", 2, 4, 128, 16, {1, 17, 40}, 4, 0}, emu);
    run_flow({"hex2", 1, 6, 64, 24, {7, 60}, 4, 2}, emu);  // 64 channels: half a group of 8 words
  }
  emu.decode_stages = 2;
  // Magnitudes far from 1 (the per-page powers of two that keep the hi and
  // lo parts in binary16): large keys and values near binary16's smallest
  // normals; tiny keys and large values.
  run_flow({"hex4", 1, 4, 128, 16, {40}, 2, 0, 30.0, 2e-4}, emu);
  run_flow({"hex4", 1, 2, 64, 16, {40}, 2, 0, 1e-3, 300.0}, emu);
  run_flow({"hex2", 1, 3, 128, 16, {40}, 2, 0, 30.0, 2e-4}, emu);
}

// The emulated mma against a plain product, the fragments filled by the
// PTX ISA's formulas for m16n8k16 as written there (row and column of each
// element a_i, b_i, c_i from groupID = lane >> 2 and threadID_in_group =
// lane % 4), independently of the inverse maps the emulation reads them with.
TEST(HexCudaEmulated, MmaFragmentsFollowThePtxLayout) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-64, 64);
  float A[16][16], B[16][8], C[16][8], D[16][8];
  for (auto& r : A)
    for (auto& x : r) x = static_cast<float>(small(rng)) / 8.0f;  // exact in binary16
  for (auto& r : B)
    for (auto& x : r) x = static_cast<float>(small(rng)) / 16.0f;
  for (auto& r : C)
    for (auto& x : r) x = static_cast<float>(small(rng));
  emu::launch(1, 32, 0, [&] {
    const int lane = static_cast<int>(threadIdx.x), group = lane >> 2, tig = lane % 4;
    const auto h = [](float x) { return static_cast<std::uint32_t>(float_to_half(x)); };
    std::uint32_t a[4], b[2];
    for (int r = 0; r < 4; ++r) {  // register r holds a_{2r} (low half) and a_{2r+1}
      std::uint32_t reg = 0;
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * r + e;
        const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
        const int col = i < 4 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
        reg |= h(A[row][col]) << (16 * e);
      }
      a[r] = reg;
    }
    for (int r = 0; r < 2; ++r) {
      std::uint32_t reg = 0;
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * r + e;
        const int row = i < 2 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
        reg |= h(B[row][group]) << (16 * e);
      }
      b[r] = reg;
    }
    float c[4];
    for (int i = 0; i < 4; ++i) c[i] = C[i < 2 ? group : group + 8][tig * 2 + (i & 1)];
    kk::mma16816(c, a, b);
    for (int i = 0; i < 4; ++i) D[i < 2 ? group : group + 8][tig * 2 + (i & 1)] = c[i];
  });
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      double want = C[i][j];
      for (int k = 0; k < 16; ++k) want += static_cast<double>(A[i][k]) * B[k][j];
      EXPECT_EQ(D[i][j], static_cast<float>(want)) << i << " " << j;  // every partial sum exact in float
    }
}

// The score product's channel order and the slots B is built in are inverse
// maps, at 4 and 2 bits: element b_i of lane column t in step s holds
// column k = 2t + (i & 1) + 8 (i >> 1) of that step.
TEST(HexCudaEmulated, MmaKeySlotsInvertTheChannelOrder) {
  const auto check = [](auto bits) {
    constexpr int B = decltype(bits)::value;
    std::vector<int> seen(128, 0);
    for (int c = 0; c < 128; ++c) {
      const kk::MmaKeySlot s = kk::mma_key_slot<B>(c);
      ASSERT_TRUE(s.step >= 0 && s.step < 8 && s.t >= 0 && s.t < 4 && s.i >= 0 && s.i < 4) << B << " bits, " << c;
      EXPECT_EQ(c, kk::mma_key_channel<B>(s.step, 2 * s.t + (s.i & 1) + 8 * (s.i >> 1))) << B << " bits";
      ++seen[static_cast<std::size_t>(s.step * 16 + 4 * s.t + s.i)];
    }
    for (const int n : seen) EXPECT_EQ(1, n) << B << " bits: a slot taken twice or not at all";
  };
  check(std::integral_constant<int, 4>{});
  check(std::integral_constant<int, 2>{});
}

// The mask by column against a brute-force listing: every channel's entries
// in row order, offsets that partition them; blocks whose mask spans one
// chunk of the kernel's threads and several, channels with no entry, a head
// dim that is not a multiple of 32, degree 1 to 8.
TEST(HexCudaEmulated, MaskColumnsListEachChannelsEntriesInRowOrder) {
  std::mt19937 rng(7);
  for (const auto& [block, dim, degree] :
       std::vector<std::array<int, 3>>{{8, 40, 3}, {96, 128, 4}, {33, 64, 8}, {5, 128, 1}}) {
    SCOPED_TRACE(std::to_string(block) + " rows, head_dim " + std::to_string(dim) + ", degree " +
                 std::to_string(degree));
    std::vector<std::int32_t> mask;
    for (int t = 0; t < block; ++t) {  // distinct sorted columns per row, skewed to leave channels empty
      std::vector<std::int32_t> all(static_cast<std::size_t>(dim));
      for (int c = 0; c < dim; ++c) all[static_cast<std::size_t>(c)] = c;
      std::shuffle(all.begin(), all.begin() + dim * 3 / 4, rng);
      std::sort(all.begin(), all.begin() + degree);
      mask.insert(mask.end(), all.begin(), all.begin() + degree);
    }
    kc::HexDeviceLayer L;
    L.geometry.head_dim = dim;
    L.geometry.block = block;
    L.geometry.mask_degree = degree;
    L.geometry.bits = 4;
    L.mask = mask.data();
    std::vector<std::int32_t> col_ptr(static_cast<std::size_t>(dim) + 1, -1), col(mask.size(), -1);
    kc::HexDecodeArgs a;
    a.mask_col_ptr = col_ptr.data();
    a.mask_col = col.data();
    emu::launch(static_cast<unsigned>(kk::mask_column_blocks(dim)), kk::kColumnThreads, 0,
                [&] { kk::hex_mask_columns_kernel(L, a); });
    std::vector<std::int32_t> want_ptr{0}, want;
    for (int c = 0; c < dim; ++c) {
      for (int x = 0; x < block * degree; ++x)
        if (mask[static_cast<std::size_t>(x)] == c) want.push_back((x / degree) << 8 | (x % degree));
      want_ptr.push_back(static_cast<std::int32_t>(want.size()));
    }
    EXPECT_EQ(want_ptr, col_ptr);
    EXPECT_EQ(want, col);
    // Columns from 3/4 of the head dim up are never drawn: the last channel is empty.
    EXPECT_EQ(want_ptr[static_cast<std::size_t>(dim)], want_ptr[static_cast<std::size_t>(dim) - 1]);
  }
}

// The same kernels refuse what they do not handle.
TEST(HexCudaEmulated, TensorCoresOnlyForTwoAndFourBitCodes) {
  Emulated emu;
  emu.tensor_cores = true;
  EXPECT_THROW(run_flow({"hex3", 1, 2, 64, 8, {9}, 1, 0}, emu), Error);
  EXPECT_THROW(run_flow({"hex4", 1, 2, 32, 8, {9}, 1, 0}, emu), Error);
}

TEST(ChessCudaEmulated, HexDecodeOverTheSelectedBlocks) {
  Emulated emu;
  flow::run_chess_hex(emu);
}

TEST(ChessCudaEmulated, BatchSelectionMatchesSelectBatch) {
  Emulated emu;
  chess_flow::batch(emu);
}

TEST(ChessCudaEmulated, KeptSelectionIsReusedUntilAPageCompletes) {
  Emulated emu;
  chess_flow::kept(emu);
}

TEST(HeteroCudaEmulated, TopKMatchesTheCpuWithTiesAndAnyLength) {
  Emulated emu;
  hetero_flow::top_k(emu);
}

TEST(HeteroCudaEmulated, DriftMonitorsAndFetchesMatchTheCpu) {
  Emulated emu;
  hetero_flow::drift(emu);
}

TEST(HeteroCudaEmulated, GatherCopiesListedRowsExactly) {
  Emulated emu;
  hetero_flow::gather(emu);
}

}  // namespace
}  // namespace kvcal::runtime
