// Tests of HEX on the GPU (hex_cuda.h): the paged flow of flow.h on the
// device through the library's upload and run functions. Without a usable
// CUDA device these tests are SKIPPED with the reason; the argument checks,
// which run before any CUDA call, run everywhere. The same kernels run on the
// CPU under the host emulation of CUDA in emulated_kernels.cpp.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "chess_flow.h"
#include "flow.h"
#include "hetero_flow.h"
#include "kvcal/runtime/chess_cuda.h"
#include "kvcal/runtime/hetero_cuda.h"

namespace kvcal::runtime {
namespace {

using flow::i64;
using flow::run_flow;
using flow::Shape;
namespace kc = kvcal::runtime::cuda;

#define SKIP_WITHOUT_GPU()                                                             \
  do {                                                                                 \
    std::string why;                                                                   \
    if (!kc::device_available(&why)) GTEST_SKIP() << "no usable CUDA device: " << why; \
  } while (0)

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

// A device buffer, zeroed (freed on scope exit).
struct Dev {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit Dev(std::size_t n) : bytes(n) {
    if (n > 0) {
      ok(cudaMalloc(&p, n), "cudaMalloc");
      ok(cudaMemset(p, 0, n), "cudaMemset");
    }
  }
  ~Dev() { cudaFree(p); }
  Dev(Dev&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Pinned host memory mapped into the device's address space (freed on scope exit).
struct Pinned {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit Pinned(std::size_t n) : bytes(n) {
    if (n > 0) ok(cudaHostAlloc(&p, n, cudaHostAllocMapped), "cudaHostAlloc");
  }
  ~Pinned() { cudaFreeHost(p); }
  Pinned(Pinned&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

// The library's API on the default stream, synchronised after each call.
struct Gpu {
  static constexpr bool emulated = false;
  kc::DecodeUnits units = kc::DecodeUnits::cuda_cores;  // where decode multiplies the quantized rows out
  Dev alloc(std::size_t n) { return Dev(n); }
  Pinned host_alloc(std::size_t n) { return Pinned(n); }
  void sync(const char* what) { ok(cudaDeviceSynchronize(), what); }
  void chess_append(const kc::ChessDeviceBatch& b, const half_bits* keys, std::int64_t stride, std::int32_t offset,
                    std::int32_t width, const std::int32_t* indptr, const std::int32_t* before) {
    kc::chess_append(b, keys, stride, offset, width, indptr, before, nullptr);
    sync("chess_append");
  }
  void chess_select(const kc::ChessDeviceBatch& b, const std::int32_t* tokens, const kc::ChessPageTable& t) {
    kc::chess_select(b, tokens, t, nullptr);
    sync("chess_select");
  }
  void chess_invalidate(const kc::ChessDeviceBatch& b) {
    kc::chess_invalidate(b, nullptr);
    sync("chess_invalidate");
  }
  void top_k(const kc::AttentionRows& rows, const std::int32_t* k, std::int32_t max_k, std::int32_t* out,
             std::int32_t* len) {
    kc::top_k_rows(rows, k, max_k, out, len, nullptr);
    sync("top_k_rows");
  }
  void drift_init(const kc::DriftState& s, const kc::AttentionRows& rows) {
    kc::drift_init(s, rows, nullptr);
    sync("drift_init");
  }
  void drift_step(const kc::DriftState& s, const kc::AttentionRows& rows) {
    kc::drift_step(s, rows, nullptr);
    sync("drift_step");
  }
  void satellites(const kc::DriftState& s, const kc::AttentionRows& rows, const kc::Satellites& sats, bool when) {
    kc::satellite_topk(s, rows, sats, when, nullptr);
    sync("satellite_topk");
  }
  void gather(const kc::GatherLists& g) {
    cudaStream_t side;  // a second stream, as an engine overlaps retrieval with compute
    ok(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "stream");
    kc::gather_rows(g, side);
    ok(cudaStreamSynchronize(side), "gather_rows");
    cudaStreamDestroy(side);
  }
  void put(void* dst, const void* src, std::size_t n) { ok(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "put"); }
  void get(void* dst, const void* src, std::size_t n) { ok(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "get"); }
  void step(const kc::HexDeviceLayer& L, const HexStepPlan& plan, const half_bits* k, const half_bits* v, int* error) {
    Dev ws(kc::hex_step_workspace_bytes(plan));
    const kc::HexStepArgs a = kc::hex_upload_step(plan, ws.p, ws.bytes, nullptr);
    kc::hex_run_step(L, a, k, v, error, nullptr);
    ok(cudaDeviceSynchronize(), "step");
  }
  void decode(const kc::HexDeviceLayer& L, const HexDecodePlan& plan, const std::vector<std::int32_t>& indptr,
              const std::vector<std::int32_t>& indices, std::int32_t q_heads, const float* q, float scale, float* out,
              bool observe) {
    Dev ws(kc::hex_decode_workspace_bytes(plan, indices, L.geometry, q_heads));
    const kc::HexDecodeArgs a =
        kc::hex_upload_decode(plan, indptr, indices, L.geometry, q_heads, ws.p, ws.bytes, nullptr);
    kc::hex_run_decode(L, a, q, scale, out, observe, nullptr, units);
    ok(cudaDeviceSynchronize(), "decode");
  }
};

TEST(HexCuda, FlowMatchesTheHostExecutor) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  for (const char* method : {"hex4", "hex3", "hex2", "fp16", "kcvt4"})
    for (const i64 group : {1, 3, 4, 8}) {
      run_flow({method, 2, group, 128, 32, {1, 31, 32, 33, 200}, 40, 0}, gpu);
      run_flow({method, 3, group, 64, 16, {7, 129 * 16 - 3}, 20, 3}, gpu);
    }
}

// The shapes compute-sanitizer runs (scripts/gpu_check.sh): each kernel path once,
// items of several pages among them (the decode's staging one page side ahead).
TEST(HexCuda, SmallFlowForSanitizers) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  run_flow({"hex3", 2, 4, 64, 8, {3, 29}, 5, 2}, gpu);
  run_flow({"fp16", 1, 2, 32, 8, {9}, 2, 0}, gpu);
  gpu.units = kc::DecodeUnits::tensor_cores;
  run_flow({"hex4", 1, 2, 64, 8, {3, 29}, 3, 2}, gpu);
}

// The tensor-core decode (DecodeUnits::tensor_cores, 4 and 2 bits): the shapes of the
// emulated test (emulated_kernels.cpp), long contexts, and every group size.
TEST(HexCuda, TensorCoreDecodeMatchesTheHostExecutor) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  gpu.units = kc::DecodeUnits::tensor_cores;
  run_flow({"hex4", 2, 4, 128, 16, {1, 15, 16, 17, 40}, 6, 0}, gpu);
  run_flow({"hex4", 1, 8, 64, 8, {7, 33}, 5, 2}, gpu);
  run_flow({"kcvt4", 2, 3, 64, 24, {50, 25}, 4, 1}, gpu);
  run_flow({"h2o4", 1, 1, 64, 16, {40}, 3, 0}, gpu);
  run_flow({"hex2", 2, 4, 128, 16, {1, 17, 40}, 4, 0}, gpu);
  run_flow({"hex2", 1, 6, 64, 24, {7, 60}, 4, 2}, gpu);
  for (const i64 group : {1, 2, 3, 4, 5, 6, 7, 8}) {
    run_flow({"hex4", 2, group, 128, 96, {129 * 96 + 1}, 2, 0}, gpu);
    run_flow({"hex2", 1, group, 128, 96, {129 * 96 + 1}, 2, 0}, gpu);
  }
  run_flow({"hex4", 2, 4, 128, 96, {32768}, 2, 0}, gpu);
  run_flow({"hex2", 1, 4, 128, 96, {32768}, 2, 0}, gpu);
  run_flow({"hex4", 1, 4, 64, 96, {32768}, 2, 16}, gpu);
  run_flow({"hex4", 1, 4, 128, 16, {40}, 2, 0, 30.0, 2e-4}, gpu);  // magnitudes far from 1
  run_flow({"hex4", 1, 2, 64, 16, {40}, 2, 0, 1e-3, 300.0}, gpu);
  run_flow({"hex2", 1, 3, 128, 16, {40}, 2, 0, 30.0, 2e-4}, gpu);
}

// Tensor cores refuse other bit widths and head dims before any launch.
TEST(HexCuda, TensorCoresOnlyForTwoAndFourBitCodes) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  gpu.units = kc::DecodeUnits::tensor_cores;
  EXPECT_THROW(run_flow({"hex3", 1, 2, 64, 8, {9}, 1, 0}, gpu), Error);
  EXPECT_THROW(run_flow({"hex4", 1, 2, 32, 8, {9}, 1, 0}, gpu), Error);
}

TEST(HexCuda, BlockCountsAroundPowersOfTwoAndLongContexts) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  // 127, 128 and 129 full blocks (and one token more), then 32K tokens.
  run_flow({"hex4", 2, 4, 128, 96, {127 * 96, 128 * 96, 129 * 96 + 1}, 3, 0}, gpu);
  run_flow({"hex3", 8, 4, 128, 96, {32768}, 2, 0}, gpu);
  run_flow({"hex2", 1, 8, 64, 96, {32768, 5}, 2, 16}, gpu);
  run_flow({"fp16", 2, 8, 128, 96, {32768}, 2, 0}, gpu);
}

// Pages whose two stages do not fit in a block's shared memory (fp16 pages
// of 448 tokens at head_dim 128: 116 KB a side) are decoded with one stage,
// each side copied when the other is used up.
TEST(HexCuda, LargePagesDecodeWithOneStage) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  run_flow({"fp16", 1, 1, 128, 448, {1000, 448}, 3, 0}, gpu);
}

TEST(ChessCuda, HexDecodeOverTheSelectedBlocks) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  flow::run_chess_hex(gpu);
}

TEST(ChessCuda, BatchSelectionMatchesSelectBatch) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  chess_flow::batch(gpu);
}

TEST(ChessCuda, KeptSelectionIsReusedUntilAPageCompletes) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  chess_flow::kept(gpu);
}

TEST(HeteroCuda, TopKMatchesTheCpuWithTiesAndAnyLength) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  hetero_flow::top_k(gpu);
}

TEST(HeteroCuda, DriftMonitorsAndFetchesMatchTheCpu) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  hetero_flow::drift(gpu);
}

TEST(HeteroCuda, GatherFromMappedHostMemoryOnASecondStream) {
  SKIP_WITHOUT_GPU();
  Gpu gpu;
  hetero_flow::gather(gpu);
}

// The run steps launch kernels only: a decode step captured in a CUDA graph
// and replayed gives the direct call's output (shared-memory atomics may add
// in another order: within 1e-6 relative).
TEST(HexCuda, DecodeStepReplaysFromACudaGraph) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3);
  HexOptions o = hex_method("hex4");
  o.block = 32;
  const auto mask = make_mask(32, 128, 4, 2);
  HexPagedCache cache(2, 128, o, mask, 64, 1);
  const HexPageGeometry& g = cache.geometry();
  const std::int32_t id = cache.add_request();
  const HexStepPlan plan = cache.plan_append({id}, {300});
  const auto k = random_halves(static_cast<std::size_t>(300 * 2 * 128), rng, 1.0);
  Dev pages(static_cast<std::size_t>(64 * g.page_bytes())), res(static_cast<std::size_t>(g.residual_bytes(2))),
      md(mask->indices.size() * 4), kd(k.size() * 2), ws(kc::hex_step_workspace_bytes(plan));
  ok(cudaMemcpy(md.p, mask->indices.data(), md.bytes, cudaMemcpyHostToDevice), "mask");
  ok(cudaMemcpy(kd.p, k.data(), kd.bytes, cudaMemcpyHostToDevice), "k");
  kc::HexDeviceLayer L;
  L.geometry = g;
  L.kv_heads = 2;
  L.pages = pages.as<std::uint8_t>();
  L.residual = res.as<std::uint8_t>();
  L.mask = md.as<std::int32_t>();
  kc::hex_run_step(L, kc::hex_upload_step(plan, ws.p, ws.bytes, nullptr), kd.as<half_bits>(), kd.as<half_bits>(),
                   nullptr, nullptr);
  const HexDecodePlan dp = cache.plan_decode({id}, 2);
  std::vector<std::int32_t> indptr, indices;
  cache.page_table({id}, indptr, indices);
  const auto q = random_floats(8 * 128, rng);
  Dev qd(q.size() * 4), direct(q.size() * 4), replay(q.size() * 4),
      dws(kc::hex_decode_workspace_bytes(dp, indices, g, 8));
  ok(cudaMemcpy(qd.p, q.data(), qd.bytes, cudaMemcpyHostToDevice), "q");
  const kc::HexDecodeArgs da = kc::hex_upload_decode(dp, indptr, indices, g, 8, dws.p, dws.bytes, nullptr);
  kc::hex_run_decode(L, da, qd.as<float>(), 0.088f, direct.as<float>(), false, nullptr);
  ok(cudaDeviceSynchronize(), "direct");
  cudaStream_t s;
  ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ok(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "begin capture");
  kc::hex_run_decode(L, da, qd.as<float>(), 0.088f, replay.as<float>(), false, s);
  ok(cudaStreamEndCapture(s, &graph), "end capture");
  ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int i = 0; i < 3; ++i) ok(cudaGraphLaunch(exec, s), "launch");
  ok(cudaStreamSynchronize(s), "replay");
  std::vector<float> a(q.size()), b(q.size());
  ok(cudaMemcpy(a.data(), direct.p, direct.bytes, cudaMemcpyDeviceToHost), "a");
  ok(cudaMemcpy(b.data(), replay.p, replay.bytes, cudaMemcpyDeviceToHost), "b");
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-6 * (1 + std::abs(a[i]))) << i;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

TEST(HexCuda, ArgumentsAreCheckedBeforeAnyLaunch) {
  // No device needed: these throw before any CUDA call.
  HexOptions o = hex_method("kcvt4");
  o.block = 16;
  HexPagedCache cache(2, 64, o, nullptr, 8, 1);
  const std::int32_t id = cache.add_request();
  const HexStepPlan plan = cache.plan_append({id}, {20});
  EXPECT_THROW(kc::hex_upload_step(plan, nullptr, 0, nullptr), Error);  // workspace too small
  kc::HexDeviceLayer L;
  L.geometry = cache.geometry();
  L.kv_heads = 2;
  kc::HexStepArgs sa;
  EXPECT_THROW(kc::hex_run_step(L, sa, nullptr, nullptr, nullptr, nullptr), Error);  // null pools
  std::vector<std::uint8_t> fake(16);
  L.pages = L.residual = fake.data();
  sa.rows = 3;
  EXPECT_THROW(kc::hex_run_step(L, sa, nullptr, nullptr, nullptr, nullptr), Error);  // tokens but no k/v
  kc::HexDecodeArgs da;
  float x = 0;
  da.q_heads = 18;  // group 9
  EXPECT_THROW(kc::hex_run_decode(L, da, &x, 1.0f, &x, false, nullptr), Error);
  da.q_heads = 3;  // not a multiple
  EXPECT_THROW(kc::hex_run_decode(L, da, &x, 1.0f, &x, false, nullptr), Error);
  da.q_heads = 4;
  EXPECT_THROW(kc::hex_run_decode(L, da, &x, NAN, &x, false, nullptr), Error);
  kc::HexDeviceLayer wide = L;
  wide.geometry.head_dim = 256;
  EXPECT_THROW(kc::hex_run_decode(wide, da, &x, 1.0f, &x, false, nullptr), Error);
  kc::HexDeviceLayer masked = L;  // expander entries: the decode needs room for the mask by column
  masked.geometry.mask_degree = 2;
  masked.mask = reinterpret_cast<const std::int32_t*>(fake.data());
  da.n_items = 1;
  EXPECT_THROW(kc::hex_run_decode(masked, da, &x, 1.0f, &x, false, nullptr), Error);
  da.n_items = 0;
  const HexDecodePlan dp = cache.plan_decode({id});
  std::vector<std::int32_t> indptr, indices;
  cache.page_table({id}, indptr, indices);
  EXPECT_THROW(kc::hex_upload_decode(dp, indptr, indices, L.geometry, 4, nullptr, 0, nullptr), Error);
  indptr.back() += 1;  // a table that lies about its length
  EXPECT_THROW(kc::hex_upload_decode(dp, indptr, indices, L.geometry, 4, fake.data(), 1 << 20, nullptr), Error);
}

}  // namespace
}  // namespace kvcal::runtime
