// HEX decode and compression on the GPU (hex_cuda.h) at serving shapes:
// head_dim 128, 8 KV heads, 32 query heads, blocks of 96, 2% heavy hitters,
// a window of 8, expander entries d / 32; contexts 32K and 128K, batch 1 and
// 16, bits 4, 3, 2 and 0 (plain fp16 pages: the baseline in the same run;
// scripts/bench_sdpa.py times torch's scaled_dot_product_attention on the
// same shapes). Times are CUDA events around the kernels (manual time).
//
// Counters: bytes_per_second = the bytes a step must read (every used byte
// of the pages it visits, the residual rows, the queries) / time;
// frac_hbm = that over the H100 SXM's HBM3 peak (3.35 TB/s); frac_copy = over
// a device-to-device copy's read+write rate measured in the same run.
// BM_compress: a step in which every request's block fills; amortised = its
// time / 96 steps, beside the decode step of the same shape.
//
// Without a usable GPU every benchmark is skipped with the reason.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvcal/runtime/hex.h"
#include "kvcal/runtime/hex_cuda.h"
#include "kvcal/runtime/hex_paged.h"
#include "kvcal/runtime/mask_cache.h"

namespace rt = kvcal::runtime;
namespace kc = kvcal::runtime::cuda;

namespace {

constexpr int kHeads = 8, kQHeads = 32, kDim = 128, kBlock = 96;
constexpr double kHbmPeak = 3.35e12;

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(std::size_t n) {
    if (n > 0 && cudaMalloc(&p, n) != cudaSuccess) {
      cudaGetLastError();
      throw rt::Error("cudaMalloc of " + std::to_string(n) + " bytes failed");
    }
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw rt::Error(std::string(what) + ": " + cudaGetErrorString(e));
}

std::shared_ptr<const rt::Mask> mask(std::int64_t d1) {
  auto m = std::make_shared<rt::Mask>();
  m->rows = kBlock;
  m->cols = kDim;
  m->row_degree = d1;
  std::mt19937_64 rng(3);
  for (std::int64_t r = 0; r <= kBlock; ++r) m->indptr.push_back(r * d1);
  for (std::int64_t r = 0; r < kBlock; ++r) {
    std::vector<std::int32_t> all(kDim);
    for (int c = 0; c < kDim; ++c) all[c] = c;
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + d1);
    m->indices.insert(m->indices.end(), all.begin(), all.begin() + d1);
  }
  return m;
}

// One layer's cache for `batch` requests of `context` tokens, filled on the device.
struct Layer {
  std::unique_ptr<rt::HexPagedCache> cache;
  std::unique_ptr<DeviceBuffer> pages, residual, mask_dev, q, out, ws;
  kc::HexDeviceLayer L;
  std::vector<std::int32_t> ids, indptr, indices;
  rt::HexDecodePlan plan;
  kc::HexDecodeArgs args;
  double bytes = 0;  // read per decode step

  Layer(int bits, std::int64_t context, int batch) {
    rt::HexOptions o = rt::hex_method(bits == 0 ? "fp16" : "hex" + std::to_string(bits));
    o.block = kBlock;
    const std::int64_t d1 = bits == 0 ? 0 : kDim / 32;
    const std::int64_t blocks = (context + 1) / kBlock + 1;
    const std::int64_t n_pages = batch * kHeads * blocks;
    cache = std::make_unique<rt::HexPagedCache>(kHeads, kDim, o, bits == 0 ? nullptr : mask(d1), n_pages, batch);
    const rt::HexPageGeometry& g = cache->geometry();
    pages = std::make_unique<DeviceBuffer>(static_cast<std::size_t>(n_pages * g.page_bytes()));
    residual = std::make_unique<DeviceBuffer>(static_cast<std::size_t>(batch * g.residual_bytes(kHeads)));
    ok(cudaMemset(residual->p, 0, static_cast<std::size_t>(batch * g.residual_bytes(kHeads))), "memset");
    mask_dev = std::make_unique<DeviceBuffer>(cache->mask_indices().size() * 4);
    if (!cache->mask_indices().empty())
      ok(cudaMemcpy(mask_dev->p, cache->mask_indices().data(), cache->mask_indices().size() * 4,
                    cudaMemcpyHostToDevice),
         "mask");
    L.geometry = g;
    L.kv_heads = kHeads;
    L.pages = static_cast<std::uint8_t*>(pages->p);
    L.residual = static_cast<std::uint8_t*>(residual->p);
    L.mask = static_cast<const std::int32_t*>(mask_dev->p);
    for (int r = 0; r < batch; ++r) ids.push_back(cache->add_request());
    // Prefill in chunks of 4096 tokens per request (random K/V, one chunk reused).
    const std::int64_t chunk = 4096;
    std::mt19937_64 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<rt::half_bits> kv(static_cast<std::size_t>(batch * chunk * kHeads * kDim));
    for (auto& h : kv) h = rt::float_to_half(nd(rng));
    DeviceBuffer kd(kv.size() * 2);
    ok(cudaMemcpy(kd.p, kv.data(), kv.size() * 2, cudaMemcpyHostToDevice), "kv");
    DeviceBuffer err(4);
    for (std::int64_t done = 0; done < context; done += chunk) {
      const auto n = static_cast<std::int32_t>(std::min(chunk, context - done));
      const rt::HexStepPlan sp = cache->plan_append(ids, std::vector<std::int32_t>(ids.size(), n));
      DeviceBuffer sws(kc::hex_step_workspace_bytes(sp));
      const kc::HexStepArgs sa = kc::hex_upload_step(sp, sws.p, kc::hex_step_workspace_bytes(sp), nullptr);
      const auto* k = static_cast<const rt::half_bits*>(kd.p);
      kc::hex_run_step(L, sa, k, k, static_cast<int*>(err.p), nullptr);
      ok(cudaDeviceSynchronize(), "prefill");
    }
    plan = cache->plan_decode(ids);
    cache->page_table(ids, indptr, indices);
    const std::size_t wsb = kc::hex_decode_workspace_bytes(plan, indices, g, kQHeads);
    ws = std::make_unique<DeviceBuffer>(wsb);
    args = kc::hex_upload_decode(plan, indptr, indices, g, kQHeads, ws->p, wsb, nullptr);
    std::vector<float> qh(static_cast<std::size_t>(batch * kQHeads * kDim));
    for (auto& x : qh) x = nd(rng);
    q = std::make_unique<DeviceBuffer>(qh.size() * 4);
    out = std::make_unique<DeviceBuffer>(qh.size() * 4);
    ok(cudaMemcpy(q->p, qh.data(), qh.size() * 4, cudaMemcpyHostToDevice), "q");
    // Bytes a step reads: each page's used bytes (kept rows, codes of the
    // quantized rows, parameters, entries; header and index), the residual rows.
    std::vector<std::uint8_t> header(16);
    for (const std::int32_t id : indices) {
      ok(cudaMemcpy(header.data(), L.pages + static_cast<std::int64_t>(id) * g.page_bytes(), 16,
                    cudaMemcpyDeviceToHost),
         "header");
      rt::HexBlockView v;
      v.tokens = g.block;
      v.head_dim = g.head_dim;
      v.bits = g.bits;
      v.kept_rows = *reinterpret_cast<const std::int32_t*>(header.data());
      v.row_bytes = g.row_bytes();
      v.mask_degree = g.bits == 0 ? 0 : g.mask_degree;
      bytes += static_cast<double>(rt::hex_block_bytes(v) + 16);
    }
    for (const std::int32_t r : plan.residual_rows) bytes += 2.0 * r * kHeads * kDim * 2;
    bytes += 2.0 * batch * kQHeads * kDim * 4;  // queries in, outputs out
  }
};

std::string why_no_gpu() {
  std::string why;
  return kc::device_available(&why) ? std::string() : why;
}

double copy_rate() {  // device-to-device copy, bytes moved (read + write) per second
  static double rate = [] {
    const std::size_t n = std::size_t{1} << 30;
    DeviceBuffer a(n), b(n);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    ok(cudaMemcpy(b.p, a.p, n, cudaMemcpyDeviceToDevice), "warm");
    cudaEventRecord(e0);
    for (int i = 0; i < 10; ++i) cudaMemcpy(b.p, a.p, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 2.0 * 10 * static_cast<double>(n) / (ms * 1e-3);
  }();
  return rate;
}

void BM_decode(benchmark::State& state) {
  if (const std::string why = why_no_gpu(); !why.empty()) {
    state.SkipWithError(("no usable CUDA device: " + why).c_str());
    return;
  }
  const int bits = static_cast<int>(state.range(0)), batch = static_cast<int>(state.range(2));
  const std::int64_t context = state.range(1) * 1024;
  try {
    Layer layer(bits, context, batch);
    const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 3; ++i)
      kc::hex_run_decode(layer.L, layer.args, static_cast<float*>(layer.q->p), scale, static_cast<float*>(layer.out->p),
                         false, nullptr);
    for (auto _ : state) {
      cudaEventRecord(e0);
      kc::hex_run_decode(layer.L, layer.args, static_cast<float*>(layer.q->p), scale, static_cast<float*>(layer.out->p),
                         false, nullptr);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      state.SetIterationTime(ms * 1e-3);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    state.counters["bytes_per_second"] = benchmark::Counter(layer.bytes, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["MB_per_step"] = layer.bytes / 1e6;
    state.counters["work_items"] = static_cast<double>(layer.plan.items.size());
    state.counters["copy_GBps"] = copy_rate() / 1e9;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_compress(benchmark::State& state) {
  if (const std::string why = why_no_gpu(); !why.empty()) {
    state.SkipWithError(("no usable CUDA device: " + why).c_str());
    return;
  }
  const int bits = static_cast<int>(state.range(0)), batch = static_cast<int>(state.range(1));
  try {
    // Every request one token short of a block, then one step fills them all.
    Layer layer(bits, kBlock - 1, batch);
    DeviceBuffer kd(static_cast<std::size_t>(batch) * kHeads * kDim * 2), err(4);
    ok(cudaMemset(kd.p, 0x3c, static_cast<std::size_t>(batch) * kHeads * kDim * 2), "k");
    const auto* k = static_cast<const rt::half_bits*>(kd.p);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (auto _ : state) {
      state.PauseTiming();
      rt::HexPagedCache& c = *layer.cache;
      for (const std::int32_t id : layer.ids) c.release(id);
      layer.ids.clear();
      for (int r = 0; r < batch; ++r) layer.ids.push_back(c.add_request());
      c.plan_append(layer.ids, std::vector<std::int32_t>(layer.ids.size(), kBlock - 1));  // book-keeping only
      const rt::HexStepPlan sp = c.plan_append(layer.ids, std::vector<std::int32_t>(layer.ids.size(), 1));
      DeviceBuffer sws(kc::hex_step_workspace_bytes(sp));
      const kc::HexStepArgs sa = kc::hex_upload_step(sp, sws.p, kc::hex_step_workspace_bytes(sp), nullptr);
      ok(cudaDeviceSynchronize(), "upload");
      state.ResumeTiming();
      cudaEventRecord(e0);
      kc::hex_run_step(layer.L, sa, k, k, static_cast<int*>(err.p), nullptr);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0;
      cudaEventElapsedTime(&ms, e0, e1);
      state.SetIterationTime(ms * 1e-3);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    state.counters["blocks"] = batch * kHeads;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

BENCHMARK(BM_decode)
    ->ArgNames({"bits", "ctxK", "batch"})
    ->ArgsProduct({{4, 3, 2, 0}, {32, 128}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.5);
BENCHMARK(BM_compress)
    ->ArgNames({"bits", "batch"})
    ->ArgsProduct({{4, 3, 2}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
