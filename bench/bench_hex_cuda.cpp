// HEX decode and compression on the GPU (hex_cuda.h) at serving shapes:
// head_dim 128, 8 KV heads, 32 query heads, blocks of 96, 2% heavy hitters,
// a window of 8, expander entries d / 32; contexts 32K and 128K, batch 1 and
// 16, bits 4, 3, 2 and 0 (plain fp16 pages: the baseline in the same run;
// scripts/bench_sdpa.py times torch's scaled_dot_product_attention on the
// same shapes). Times are CUDA events around the kernels (manual time).
//
// Counters: bytes_per_second = the bytes a step must read (every used byte
// of the pages it visits, the residual rows, the queries) / time;
// frac_hbm = that over the device's HBM peak (2 x memory clock x bus width,
// from the device's attributes: 3.35 TB/s on an H100 SXM, 4.9 on an H200);
// frac_copy = over a device-to-device copy's read+write rate measured in the
// same run.
// BM_compress: a step in which every request's block fills; amortised = its
// time / 96 steps, beside the decode step of the same shape.
//
// BM_chess_select: a whole CHESS selection of a batch at the 8B shape (32
// layers x 8 KV heads x 128 = D 32768, pages of 32, "moderate"), its
// summaries filled first (a step at which every request completes a page);
// BM_chess_steps: chess_select per step of a decode loop (one whole
// selection per page of steps, kept ones between) and append_us, the
// step's 32 chess_append calls; compare either with 32 x BM_decode/bits:0
// of the same context and batch (one fp16 decode step of the model). BM_drift_step: 64 pivot rows (32
// layers x 2 pivots) at the context. BM_gather: satellites' rows from mapped
// pinned host memory, bytes/s beside BM_h2d_copy (cudaMemcpy from pinned
// memory: the link's measured peak).
//
// Without a usable GPU every benchmark is skipped with the reason.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvcal/runtime/chess_cuda.h"
#include "kvcal/runtime/hetero_cuda.h"
#include "kvcal/runtime/hex.h"
#include "kvcal/runtime/hex_cuda.h"
#include "kvcal/runtime/hex_paged.h"
#include "kvcal/runtime/mask_cache.h"

namespace rt = kvcal::runtime;
namespace kc = kvcal::runtime::cuda;

namespace {

constexpr int kHeads = 8, kQHeads = 32, kDim = 128, kBlock = 96;

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

// Decode work items to aim for: by default 16 per multiprocessor, a few
// waves of the thread blocks that fit at once (so that the last wave's tail
// is short); BM_decode_items tries others.
std::int32_t decode_items(int per_sm = 16) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return std::max(1, sms) * per_sm;
}

// One layer's cache for `batch` requests of `context` tokens, filled on the device.
struct Layer {
  std::unique_ptr<rt::HexPagedCache> cache;
  std::unique_ptr<DeviceBuffer> pages, residual, mask_dev, q, out, ws;
  kc::HexDeviceLayer L;
  std::vector<std::int32_t> ids, indptr, indices;
  rt::HexDecodePlan plan;
  kc::HexDecodeArgs args;
  double bytes = 0;       // read per decode step
  int q_heads = kQHeads;  // query heads: kHeads x the GQA group

  // With chess: a CHESS store (pages = HEX blocks, "moderate") fed the same
  // keys, and the decode planned over the blocks it selects.
  std::unique_ptr<DeviceBuffer> chess_mem;
  double selected_fraction = 1.0;

  Layer(int bits, std::int64_t context, int batch, bool chess = false, int items_per_sm = 16,
        int group = kQHeads / kHeads)
      : q_heads(kHeads * group) {
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
    rt::ChessOptions co = rt::chess_preset("moderate");
    co.page_size = kBlock;
    kc::ChessDeviceBatch cb;
    std::unique_ptr<DeviceBuffer> tip, before;
    if (chess) {
      const auto max_pages = static_cast<std::int32_t>(context / kBlock + 1);
      const std::size_t cbytes = kc::chess_batch_bytes(batch, kHeads * kDim, max_pages, co);
      chess_mem = std::make_unique<DeviceBuffer>(cbytes);
      ok(cudaMemset(chess_mem->p, 0, cbytes), "memset");
      cb = kc::chess_batch(chess_mem->p, cbytes, batch, kHeads * kDim, max_pages, co);
      tip = std::make_unique<DeviceBuffer>((batch + 1) * 4);
      before = std::make_unique<DeviceBuffer>(batch * 4);
    }
    for (std::int64_t done = 0; done < context; done += chunk) {
      const auto n = static_cast<std::int32_t>(std::min(chunk, context - done));
      const rt::HexStepPlan sp = cache->plan_append(ids, std::vector<std::int32_t>(ids.size(), n));
      DeviceBuffer sws(kc::hex_step_workspace_bytes(sp));
      const kc::HexStepArgs sa = kc::hex_upload_step(sp, sws.p, kc::hex_step_workspace_bytes(sp), nullptr);
      const auto* k = static_cast<const rt::half_bits*>(kd.p);
      kc::hex_run_step(L, sa, k, k, static_cast<int*>(err.p), nullptr);
      if (chess) {
        const std::vector<std::int32_t> bef(static_cast<std::size_t>(batch), static_cast<std::int32_t>(done));
        ok(cudaMemcpy(tip->p, sp.token_indptr.data(), (batch + 1) * 4, cudaMemcpyHostToDevice), "indptr");
        ok(cudaMemcpy(before->p, bef.data(), batch * 4, cudaMemcpyHostToDevice), "before");
        kc::chess_append(cb, k, kHeads * kDim, 0, kHeads * kDim, static_cast<const std::int32_t*>(tip->p),
                         static_cast<const std::int32_t*>(before->p), nullptr);
      }
      ok(cudaDeviceSynchronize(), "prefill");
    }
    if (chess) {
      const auto max_pages = static_cast<std::int32_t>(context / kBlock + 1);
      const std::vector<std::int32_t> toks(static_cast<std::size_t>(batch), static_cast<std::int32_t>(context));
      DeviceBuffer tk(batch * 4), t_ip((batch + 1) * 4), t_idx(static_cast<std::size_t>(batch) * (max_pages + 1) * 4),
          t_last(batch * 4);
      ok(cudaMemcpy(tk.p, toks.data(), batch * 4, cudaMemcpyHostToDevice), "tokens");
      kc::chess_select(cb, static_cast<const std::int32_t*>(tk.p),
                       kc::ChessPageTable{static_cast<std::int32_t*>(t_ip.p), static_cast<std::int32_t*>(t_idx.p),
                                          static_cast<std::int32_t*>(t_last.p)},
                       nullptr);
      std::vector<std::int32_t> sel_ip(static_cast<std::size_t>(batch + 1));
      ok(cudaMemcpy(sel_ip.data(), t_ip.p, sel_ip.size() * 4, cudaMemcpyDeviceToHost), "table");
      std::vector<std::int32_t> sel(static_cast<std::size_t>(sel_ip.back()));
      ok(cudaMemcpy(sel.data(), t_idx.p, sel.size() * 4, cudaMemcpyDeviceToHost), "table");
      std::vector<std::int32_t> counts;
      cache->select_blocks(ids, sel_ip, sel, indptr, indices, counts);
      std::int64_t kept = 0;
      for (const std::int32_t c : counts) kept += c;
      selected_fraction = static_cast<double>(kept) / static_cast<double>(batch * (context / kBlock));
      plan = cache->plan_decode(ids, counts, 0, decode_items(items_per_sm));
    } else {
      plan = cache->plan_decode(ids, 0, decode_items(items_per_sm));
      cache->page_table(ids, indptr, indices);
    }
    const std::size_t wsb = kc::hex_decode_workspace_bytes(plan, indices, g, q_heads);
    ws = std::make_unique<DeviceBuffer>(wsb);
    args = kc::hex_upload_decode(plan, indptr, indices, g, q_heads, ws->p, wsb, nullptr);
    std::vector<float> qh(static_cast<std::size_t>(batch * q_heads * kDim));
    for (auto& x : qh) x = nd(rng);
    q = std::make_unique<DeviceBuffer>(qh.size() * 4);
    out = std::make_unique<DeviceBuffer>(qh.size() * 4);
    ok(cudaMemcpy(q->p, qh.data(), qh.size() * 4, cudaMemcpyHostToDevice), "q");
    // Bytes a step reads: each page's used bytes (kept rows, codes of the
    // quantized rows, parameters, entries; header and index), the residual rows.
    std::vector<std::uint8_t> headers(static_cast<std::size_t>(n_pages) * 16);  // every page's 16 bytes, one copy
    ok(cudaMemcpy2D(headers.data(), 16, L.pages, static_cast<std::size_t>(g.page_bytes()), 16,
                    static_cast<std::size_t>(n_pages), cudaMemcpyDeviceToHost),
       "headers");
    for (const std::int32_t id : indices) {
      rt::HexBlockView v;
      v.tokens = g.block;
      v.head_dim = g.head_dim;
      v.bits = g.bits;
      std::memcpy(&v.kept_rows, headers.data() + static_cast<std::size_t>(id) * 16, 4);
      v.row_bytes = g.row_bytes();
      v.mask_degree = g.bits == 0 ? 0 : g.mask_degree;
      bytes += static_cast<double>(rt::hex_block_bytes(v) + 16);
    }
    for (const std::int32_t r : plan.residual_rows) bytes += 2.0 * r * kHeads * kDim * 2;
    bytes += 2.0 * batch * q_heads * kDim * 4;  // queries in, outputs out
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

// The device's HBM peak in bytes/s: double data rate x bus width.
double hbm_peak() {
  int device = 0, khz = 0, bits = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, device);
  cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, device);
  return 2.0 * khz * 1e3 * bits / 8.0;
}

// Times the body with CUDA events over the benchmark's iterations and returns
// the mean seconds per iteration. setup() runs before each, outside the events.
template <class Body, class Setup = void (*)()>
double timed(
    benchmark::State& state, Body body, Setup setup = [] {}) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  double total = 0;
  setup();
  body();  // warm-up
  ok(cudaDeviceSynchronize(), "warm-up");
  for (auto _ : state) {
    setup();
    cudaEventRecord(e0);
    body();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    state.SetIterationTime(ms * 1e-3);
    total += ms * 1e-3;
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return state.iterations() > 0 ? total / static_cast<double>(state.iterations()) : 0.0;
}

#define KVCAL_NEED_GPU(state)                                         \
  if (const std::string why = why_no_gpu(); !why.empty()) {           \
    (state).SkipWithError(("no usable CUDA device: " + why).c_str()); \
    return;                                                           \
  }

// One decode step of the layer's whole batch.
void decode_step(const Layer& layer, kc::DecodeUnits units = kc::DecodeUnits::cuda_cores) {
  kc::hex_run_decode(layer.L, layer.args, static_cast<const float*>(layer.q->p), 1.0f / std::sqrt(float{kDim}),
                     static_cast<float*>(layer.out->p), false, nullptr, units);
}

void decode_bench(benchmark::State& state, int bits, std::int64_t context, int batch, kc::DecodeUnits units,
                  int items_per_sm = 16, int group = kQHeads / kHeads) {
  KVCAL_NEED_GPU(state);
  try {
    Layer layer(bits, context, batch, false, items_per_sm, group);
    const double seconds = timed(state, [&] { decode_step(layer, units); });
    state.counters["bytes_per_second"] = benchmark::Counter(layer.bytes, benchmark::Counter::kIsIterationInvariantRate);
    if (seconds > 0) {
      state.counters["frac_hbm"] = layer.bytes / seconds / hbm_peak();
      state.counters["frac_copy"] = layer.bytes / seconds / copy_rate();
    }
    state.counters["MB_per_step"] = layer.bytes / 1e6;
    state.counters["work_items"] = static_cast<double>(layer.plan.items.size());
    state.counters["copy_GBps"] = copy_rate() / 1e9;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_decode(benchmark::State& state) {
  decode_bench(state, static_cast<int>(state.range(0)), state.range(1) * 1024, static_cast<int>(state.range(2)),
               kc::DecodeUnits::cuda_cores);
}

// HEX-4 and HEX-2 with the quantized rows on tensor cores
// (DecodeUnits::tensor_cores), beside BM_decode/bits:4 and bits:2 (CUDA
// cores) of the same shape.
void BM_decode_tensor_cores(benchmark::State& state) {
  decode_bench(state, static_cast<int>(state.range(0)), state.range(1) * 1024, static_cast<int>(state.range(2)),
               kc::DecodeUnits::tensor_cores);
}

// HEX-4 on CUDA cores with the work split into items_per_sm work items per
// multiprocessor (BM_decode: 16): fewer, longer items have fewer splits to
// merge and less per-item setup, more fill the waves better.
void BM_decode_items(benchmark::State& state) {
  decode_bench(state, 4, state.range(0) * 1024, static_cast<int>(state.range(1)), kc::DecodeUnits::cuda_cores,
               static_cast<int>(state.range(2)));
}

// HEX-4 at 32K tokens with other GQA groups (query heads = 8 x group;
// BM_decode: 4), each its own kernel instantiation.
void BM_decode_groups(benchmark::State& state) {
  decode_bench(state, 4, 32 * 1024, static_cast<int>(state.range(1)), kc::DecodeUnits::cuda_cores, 16,
               static_cast<int>(state.range(0)));
}

// HEX-4 decode over the blocks CHESS selects ("moderate", pages = HEX
// blocks), beside BM_decode/bits:4 (every block) and bits:0 (fp16).
void BM_chess_hex_decode(benchmark::State& state) {
  KVCAL_NEED_GPU(state);
  const std::int64_t context = state.range(0) * 1024;
  const int batch = static_cast<int>(state.range(1));
  try {
    Layer layer(4, context, batch, true);
    timed(state, [&] { decode_step(layer); });
    state.counters["selected_fraction"] = layer.selected_fraction;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_compress(benchmark::State& state) {
  KVCAL_NEED_GPU(state);
  const int bits = static_cast<int>(state.range(0)), batch = static_cast<int>(state.range(1));
  try {
    // Every request one token short of a block, then one step fills them all.
    Layer layer(bits, kBlock - 1, batch);
    DeviceBuffer kd(static_cast<std::size_t>(batch) * kHeads * kDim * 2), err(4);
    ok(cudaMemset(kd.p, 0x3c, static_cast<std::size_t>(batch) * kHeads * kDim * 2), "k");
    const auto* k = static_cast<const rt::half_bits*>(kd.p);
    std::unique_ptr<DeviceBuffer> sws;
    kc::HexStepArgs sa;
    const auto setup = [&] {  // fresh requests one token short of a block (book-keeping only)
      rt::HexPagedCache& c = *layer.cache;
      for (const std::int32_t id : layer.ids) c.release(id);
      layer.ids.clear();
      for (int r = 0; r < batch; ++r) layer.ids.push_back(c.add_request());
      c.plan_append(layer.ids, std::vector<std::int32_t>(layer.ids.size(), kBlock - 1));
      const rt::HexStepPlan sp = c.plan_append(layer.ids, std::vector<std::int32_t>(layer.ids.size(), 1));
      sws = std::make_unique<DeviceBuffer>(kc::hex_step_workspace_bytes(sp));
      sa = kc::hex_upload_step(sp, sws->p, kc::hex_step_workspace_bytes(sp), nullptr);
      ok(cudaDeviceSynchronize(), "upload");
    };
    timed(
        state, [&] { kc::hex_run_step(layer.L, sa, k, k, static_cast<int*>(err.p), nullptr); }, setup);
    state.counters["blocks"] = batch * kHeads;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// The CHESS store of BM_chess_select and BM_chess_steps: `batch` requests at
// the 8B shape (D = 32 layers x 8 x 128), pages of 32, "moderate", each
// filled with `context` tokens (one chess_append per layer for every 1024
// tokens), the same keys standing for every layer; room for `room` more
// tokens (BM_chess_steps appends kSteps).
struct ChessBench {
  static constexpr std::int32_t kLayers = 32, kWidth = kHeads * kDim, D = kLayers * kWidth, B = 32, kChunk = 1024;
  static constexpr std::int32_t kPagesOfSteps = 64, kSteps = kPagesOfSteps * B;
  std::int32_t context, batch, max_pages;
  rt::ChessOptions o;
  std::size_t bytes;
  DeviceBuffer mem, keys, ip, before, tokens, t_ip, t_idx, t_last;
  kc::ChessDeviceBatch b;
  kc::ChessPageTable t;
  std::vector<std::int32_t> count;  // tokens per request, as on the device

  static rt::ChessOptions options() {
    rt::ChessOptions opt = rt::chess_preset("moderate");
    opt.page_size = B;
    return opt;
  }
  ChessBench(std::int32_t ctx, std::int32_t n, std::int32_t room)
      : context(ctx),
        batch(n),
        max_pages((ctx + room + B - 1) / B),
        o(options()),
        bytes(kc::chess_batch_bytes(n, D, max_pages, o)),
        mem(bytes),
        keys(static_cast<std::size_t>(n) * kChunk * kWidth * 2),
        ip((n + 1) * 4),
        before(n * 4),
        tokens(n * 4),
        t_ip((n + 1) * 4),
        t_idx(static_cast<std::size_t>(n) * (max_pages + 1) * 4),
        t_last(n * 4),
        count(static_cast<std::size_t>(n), 0) {
    ok(cudaMemset(mem.p, 0, bytes), "memset");
    b = kc::chess_batch(mem.p, bytes, batch, D, max_pages, o);
    t = kc::ChessPageTable{static_cast<std::int32_t*>(t_ip.p), static_cast<std::int32_t*>(t_idx.p),
                           static_cast<std::int32_t*>(t_last.p)};
    std::vector<rt::half_bits> kh(static_cast<std::size_t>(batch) * kChunk * kWidth);
    std::mt19937_64 rng(4);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& h : kh) h = rt::float_to_half(nd(rng));
    ok(cudaMemcpy(keys.p, kh.data(), kh.size() * 2, cudaMemcpyHostToDevice), "keys");
    for (std::int32_t done = 0; done < context; done += kChunk) {
      upload(kChunk);
      append(kChunk);
    }
    upload(0);
  }
  // token_indptr for n new tokens per request (rows of `keys`), tokens_before
  // and the token counts after them.
  void upload(std::int32_t n) {
    std::vector<std::int32_t> indptr(static_cast<std::size_t>(batch) + 1), after(count);
    for (int r = 0; r <= batch; ++r) indptr[static_cast<std::size_t>(r)] = r * n;
    for (auto& a : after) a += n;
    ok(cudaMemcpy(ip.p, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice), "indptr");
    ok(cudaMemcpy(before.p, count.data(), count.size() * 4, cudaMemcpyHostToDevice), "before");
    ok(cudaMemcpy(tokens.p, after.data(), after.size() * 4, cudaMemcpyHostToDevice), "tokens");
  }
  // The n uploaded tokens appended, one call per layer.
  void append(std::int32_t n) {
    for (int l = 0; l < kLayers; ++l)
      kc::chess_append(b, static_cast<const rt::half_bits*>(keys.p), kWidth, l * kWidth, kWidth,
                       static_cast<const std::int32_t*>(ip.p), static_cast<const std::int32_t*>(before.p), nullptr);
    for (auto& c : count) c += n;
  }
  void select() { kc::chess_select(b, static_cast<const std::int32_t*>(tokens.p), t, nullptr); }
};

// A whole selection: the kept selections forgotten before every iteration,
// as at a step where every request has just completed a page.
void BM_chess_select(benchmark::State& state) {
  KVCAL_NEED_GPU(state);
  try {
    ChessBench c(static_cast<std::int32_t>(state.range(0) * 1024), static_cast<std::int32_t>(state.range(1)), 0);
    timed(
        state, [&] { c.select(); }, [&] { kc::chess_invalidate(c.b, nullptr); });
    state.counters["summary_MB"] = static_cast<double>(c.bytes) / 1e6;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// The selection per decode step of a decode loop: an iteration is a page of
// steps (32), every request one token further per step, all in step (the
// page completes for all of them at the same step: one whole selection and
// 31 kept ones per iteration). Time: chess_select per step, the mean over
// the page; append_us: the step's chess_append calls (one token, one call
// per layer), timed apart.
void BM_chess_steps(benchmark::State& state) {
  KVCAL_NEED_GPU(state);
  try {
    ChessBench c(static_cast<std::int32_t>(state.range(0) * 1024), static_cast<std::int32_t>(state.range(1)),
                 ChessBench::kSteps);
    cudaEvent_t e[3];
    for (auto& x : e) ok(cudaEventCreate(&x), "event");
    double append_s = 0;
    std::int64_t steps = 0;
    c.select();
    for (auto _ : state) {
      double page = 0;
      for (std::int32_t s = 0; s < ChessBench::B; ++s) {
        c.upload(1);
        ok(cudaEventRecord(e[0]), "event");
        c.append(1);
        ok(cudaEventRecord(e[1]), "event");
        c.select();
        ok(cudaEventRecord(e[2]), "event");
        ok(cudaEventSynchronize(e[2]), "step");
        float a_ms = 0, s_ms = 0;
        cudaEventElapsedTime(&a_ms, e[0], e[1]);
        cudaEventElapsedTime(&s_ms, e[1], e[2]);
        append_s += a_ms * 1e-3;
        page += s_ms * 1e-3;
        ++steps;
      }
      state.SetIterationTime(page / ChessBench::B);
    }
    for (auto& x : e) cudaEventDestroy(x);
    state.counters["append_us"] = steps > 0 ? append_s / static_cast<double>(steps) * 1e6 : 0.0;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_drift_step(benchmark::State& state) {
  KVCAL_NEED_GPU(state);
  const std::int32_t n = static_cast<std::int32_t>(state.range(0) * 1024), P = 64, L = n / 50, W = 8;
  try {
    DeviceBuffer rows(static_cast<std::size_t>(P) * n * 4), ptrs(P * sizeof(float*)), lens(P * 4);
    std::vector<float> h(static_cast<std::size_t>(n));
    std::mt19937_64 rng(6);
    std::exponential_distribution<float> ex(1.0f);
    std::vector<const float*> p;
    for (int i = 0; i < P; ++i) {
      for (auto& x : h) x = ex(rng);
      float* dst = static_cast<float*>(rows.p) + static_cast<std::size_t>(i) * n;
      ok(cudaMemcpy(dst, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "rows");
      p.push_back(dst);
    }
    const std::vector<std::int32_t> ns(P, n);
    ok(cudaMemcpy(ptrs.p, p.data(), P * sizeof(float*), cudaMemcpyHostToDevice), "ptrs");
    ok(cudaMemcpy(lens.p, ns.data(), P * 4, cudaMemcpyHostToDevice), "lens");
    const kc::AttentionRows view{static_cast<const float* const*>(ptrs.p), static_cast<const std::int32_t*>(lens.p), P};
    const std::size_t bytes = kc::drift_state_bytes(P, L, W);
    DeviceBuffer mem(bytes);
    ok(cudaMemset(mem.p, 0, bytes), "memset");
    const kc::DriftState s = kc::drift_state(mem.p, bytes, P, L, W, 0.5);
    kc::drift_init(s, view, nullptr);
    timed(state, [&] { kc::drift_step(s, view, nullptr); });
    state.counters["rows"] = P;
    state.counters["L_base"] = L;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_gather(benchmark::State& state) {
  KVCAL_NEED_GPU(state);
  // rows per list; the host cache per list (K tokens: the span the rows are
  // drawn from, of the 128K pinned); the rows in token order or at random.
  const std::int32_t lists = 64, k = static_cast<std::int32_t>(state.range(0));
  const std::int32_t tokens = static_cast<std::int32_t>(state.range(1)) * 1024;
  const bool sorted = state.range(2) != 0;
  constexpr std::int32_t kHostTokens = 131072;
  // The host cache (64 lists of K and V, 4 GiB pinned) is pinned once per
  // process: pinning takes seconds, and the benchmark library calls this
  // function several times per argument.
  struct Pinned {
    std::vector<void*> k, v;
    ~Pinned() {
      for (void* p : k) cudaFreeHost(p);
      for (void* p : v) cudaFreeHost(p);
    }
  };
  static Pinned pinned;
  try {
    const std::size_t host_bytes = static_cast<std::size_t>(kHostTokens) * kDim * 2;
    if (tokens < k || tokens > kHostTokens) throw std::runtime_error("bad host span");
    while (pinned.k.size() < static_cast<std::size_t>(lists)) {
      void *pk = nullptr, *pv = nullptr;
      ok(cudaHostAlloc(&pk, host_bytes, cudaHostAllocMapped), "pinned k");
      pinned.k.push_back(pk);
      ok(cudaHostAlloc(&pv, host_bytes, cudaHostAllocMapped), "pinned v");
      pinned.v.push_back(pv);
    }
    const std::vector<void*>&hk = pinned.k, &hv = pinned.v;
    DeviceBuffer dk(static_cast<std::size_t>(lists) * k * kDim * 2), dv(static_cast<std::size_t>(lists) * k * kDim * 2);
    std::vector<const rt::half_bits*> hkp, hvp;
    std::vector<rt::half_bits*> dkp, dvp;
    for (int i = 0; i < lists; ++i) {
      hkp.push_back(static_cast<const rt::half_bits*>(hk[i]));
      hvp.push_back(static_cast<const rt::half_bits*>(hv[i]));
      dkp.push_back(static_cast<rt::half_bits*>(dk.p) + static_cast<std::size_t>(i) * k * kDim);
      dvp.push_back(static_cast<rt::half_bits*>(dv.p) + static_cast<std::size_t>(i) * k * kDim);
    }
    std::vector<std::int32_t> tok(static_cast<std::size_t>(lists) * k), len(lists, k);
    std::mt19937_64 rng(8);
    for (auto& t : tok) t = static_cast<std::int32_t>(rng() % tokens);
    if (sorted)
      for (int i = 0; i < lists; ++i) std::sort(tok.begin() + i * k, tok.begin() + (i + 1) * k);
    DeviceBuffer a(4 * lists * sizeof(void*)), t_d(tok.size() * 4), l_d(lists * 4);
    auto** arr = static_cast<void**>(a.p);
    ok(cudaMemcpy(arr, hkp.data(), lists * sizeof(void*), cudaMemcpyHostToDevice), "a");
    ok(cudaMemcpy(arr + lists, hvp.data(), lists * sizeof(void*), cudaMemcpyHostToDevice), "a");
    ok(cudaMemcpy(arr + 2 * lists, dkp.data(), lists * sizeof(void*), cudaMemcpyHostToDevice), "a");
    ok(cudaMemcpy(arr + 3 * lists, dvp.data(), lists * sizeof(void*), cudaMemcpyHostToDevice), "a");
    ok(cudaMemcpy(t_d.p, tok.data(), tok.size() * 4, cudaMemcpyHostToDevice), "tok");
    ok(cudaMemcpy(l_d.p, len.data(), len.size() * 4, cudaMemcpyHostToDevice), "len");
    const kc::GatherLists g{reinterpret_cast<const rt::half_bits* const*>(arr),
                            reinterpret_cast<const rt::half_bits* const*>(arr + lists),
                            reinterpret_cast<rt::half_bits* const*>(arr + 2 * lists),
                            reinterpret_cast<rt::half_bits* const*>(arr + 3 * lists),
                            static_cast<const std::int32_t*>(t_d.p),
                            static_cast<const std::int32_t*>(l_d.p),
                            lists,
                            k,
                            kDim,
                            kDim};
    timed(state, [&] { kc::gather_rows(g, nullptr); });
    state.counters["bytes_per_second"] =
        benchmark::Counter(2.0 * lists * k * kDim * 2, benchmark::Counter::kIsIterationInvariantRate);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void BM_h2d_copy(benchmark::State& state) {  // the link's peak from pinned memory
  KVCAL_NEED_GPU(state);
  const std::size_t n = std::size_t{256} << 20;
  void* h = nullptr;
  try {
    ok(cudaHostAlloc(&h, n, 0), "pinned");
    DeviceBuffer d(n);
    timed(state, [&] { cudaMemcpyAsync(d.p, h, n, cudaMemcpyHostToDevice, nullptr); });
    state.counters["bytes_per_second"] =
        benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
  cudaFreeHost(h);
}

}  // namespace

BENCHMARK(BM_decode)
    ->ArgNames({"bits", "ctxK", "batch"})
    ->ArgsProduct({{4, 3, 2, 0}, {32, 128}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.5);
BENCHMARK(BM_decode_tensor_cores)
    ->ArgNames({"bits", "ctxK", "batch"})
    ->ArgsProduct({{4, 2}, {32, 128}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.5);
BENCHMARK(BM_decode_items)
    ->ArgNames({"ctxK", "batch", "items_per_sm"})
    ->ArgsProduct({{32}, {1, 16}, {5, 10, 32}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.5);

BENCHMARK(BM_decode_groups)
    ->ArgNames({"group", "batch"})
    ->ArgsProduct({{1, 2, 8}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.5);

BENCHMARK(BM_compress)
    ->ArgNames({"bits", "batch"})
    ->ArgsProduct({{4, 3, 2}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_chess_hex_decode)
    ->ArgNames({"ctxK", "batch"})
    ->ArgsProduct({{32, 128}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_chess_select)
    ->ArgNames({"ctxK", "batch"})
    ->ArgsProduct({{32, 128}, {1, 16}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_chess_steps)
    ->ArgNames({"ctxK", "batch"})
    ->ArgsProduct({{32, 128}, {1, 16}})
    ->Iterations(ChessBench::kPagesOfSteps)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_drift_step)->ArgNames({"ctxK"})->Arg(32)->Arg(128)->UseManualTime()->Unit(benchmark::kMicrosecond);
// Random rows from the whole 128K-token host cache at 256 to 2,048 rows per
// list; then a small span (8K tokens) and rows in token order, which tell
// the link's rate from the cost of translating scattered host pages.
BENCHMARK(BM_gather)
    ->ArgNames({"rows", "spanK", "sorted"})
    ->Args({256, 128, 0})
    ->Args({512, 128, 0})
    ->Args({1024, 128, 0})
    ->Args({2048, 128, 0})
    ->Args({2048, 8, 0})
    ->Args({2048, 128, 1})
    ->Args({256, 8, 0})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_h2d_copy)->UseManualTime()->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
