// HEX runtime benchmarks (issue goals: decode over the 4-bit cache faster than
// fp16 decode, at >= 50% of this machine's memory bandwidth).
//
//  compress_block/<method>: one 96-token block of 8 KV heads, head dim 128
//    (bytes = the fp16 keys and values compressed).
//  decode/<method>/<group>: attention of one query per query head (group query
//    heads per KV head: 1, 4, and 8 as in a 70B model's 64 query heads over 8
//    KV heads) over a 32K-token cache of 8 KV heads, head dim 128, all
//    threads (bytes = what the cache stores, i.e. what decode must read). As in
//    a model's decode step, where each layer's cache is read once and the layers
//    together far exceed the last-level cache, the iterations cycle through
//    enough identical copies of the layer (counter `layers`) to fill twice the
//    LLC: on a host whose LLC holds a whole layer (a 260 MB L3 holds the fp16
//    one) a single copy would time the LLC, not memory. KVCAL_BENCH_LAYERS=N
//    sets the number of copies (1: the LLC's figure, for what memory costs).
//  decode_l2/<method>/<group>: the same over 960 tokens (ten blocks per head;
//    the compressed caches stay in L2), in microseconds: the decode's compute
//    with memory left out, what the kernels and the per-block work cost.
//  streaming_read/<threads>: a vectorised sum over 256 MB or four times the
//    LLC, whichever is larger: the memory-read bandwidth the decode figures are
//    compared with.
// The context line simd_target names the kernels' SIMD target on this host
// (KVCAL_BENCH_TARGET forces another: see force_target.h), prefetch_far how
// far ahead the code kernels request codes in memory (KVCAL_PREFETCH_FAR),
// prefetch_near how many rows ahead they request lines into L1
// (KVCAL_PREFETCH_NEAR).
// Keys and values are Gaussian with a few outlier channels, the shape real
// keys have; the expander mask is generated and certified like the runtime does.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <omp.h>

#include "force_target.h"
#include "kvcal/runtime/hex.h"
#include "kvcal/runtime/mask_cache.h"
#include "streaming_read.h"

namespace {

namespace rt = kvcal::runtime;

constexpr std::int64_t kHeads = 8, kDim = 128, kBlock = 96, kTokens = 32768;
constexpr std::int64_t kHotTokens = 960;
// "@int14", "@int8": the integer dot products (HexDot::int14, HexDot::int8).
// h2o4@int8 and expander4@int8 are hex4@int8's two parts apart (its kept
// fp16 rows, its expander entries), for what each costs over kcvt4@int8.
const char* const kMethods[] = {"fp16",       "kcvt4",      "kcvt3",         "kcvt2",       "h2o4",        "hex4",
                                "hex3",       "hex2",       "kcvt4@int14",   "kcvt3@int14", "kcvt2@int14", "hex4@int14",
                                "hex2@int14", "kcvt4@int8", "kcvt3@int8",    "kcvt2@int8",  "hex4@int8",   "hex3@int8",
                                "hex2@int8",  "h2o4@int8",  "expander4@int8"};

// [heads][tokens][dim] fp16 keys and values.
struct Data {
  std::vector<rt::half_bits> k, v;
};

const Data& data() {
  static const Data d = [] {
    Data x;
    const std::size_t n = static_cast<std::size_t>(kHeads * kTokens * kDim);
    x.k.resize(n);
    x.v.resize(n);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t c = i % kDim;
      const float outlier = (c % 32 == 5) ? 8.0f : 1.0f;  // a few large key channels
      x.k[i] = rt::float_to_half(outlier * g(rng));
      x.v[i] = rt::float_to_half(g(rng));
    }
    return x;
  }();
  return d;
}

std::shared_ptr<const rt::Mask> mask() {
  static rt::MaskCache cache;
  return cache.get(kBlock, kDim, 1.0 / 32);
}

rt::HexLayerCache make_cache(const std::string& method, std::int64_t tokens) {
  rt::HexOptions o = rt::hex_method(method);
  o.block = kBlock;
  rt::HexLayerCache c(kHeads, kDim, o, mask());
  // Heavy-hitter scores: a decaying attention profile with some spikes.
  std::vector<float> attn(static_cast<std::size_t>(tokens));
  std::mt19937_64 rng(3);
  std::exponential_distribution<float> e(1.0f);
  for (auto& a : attn) a = e(rng);
  c.observe(attn.data(), 1, tokens, tokens);
  const Data& d = data();
  c.append(d.k.data(), d.v.data(), tokens, kTokens * kDim, kDim);
  return c;
}

// The largest data cache's size in bytes, as Google Benchmark reads it (0 if
// unknown).
std::int64_t llc_bytes() {
  std::int64_t b = 0;
  for (const auto& c : benchmark::CPUInfo::Get().caches)
    if (c.type != "Instruction") b = std::max<std::int64_t>(b, c.size);
  return b;
}

// KVCAL_BENCH_LAYERS=N: decode/ cycles through N copies of the layer
// instead (N = 1 times the layer where the LLC holds it: the decode's compute
// and cache traffic without memory's); 0 when unset. Read once, before any
// benchmark runs (register_all); a bad value is one error line and exit 2.
std::int64_t layers_from_env() {
  const char* env = std::getenv("KVCAL_BENCH_LAYERS");
  if (!env || !*env) return 0;
  char* end = nullptr;
  const long long n = std::isdigit(static_cast<unsigned char>(*env)) ? std::strtoll(env, &end, 10) : 0;
  if (!end || *end != '\0' || n < 1 || n > 4096) {
    std::fprintf(stderr, "error: KVCAL_BENCH_LAYERS=%s is not a layer count in [1, 4096]\n", env);
    std::exit(2);
  }
  return n;
}
std::int64_t wanted_layers = 0;  // layers_from_env(), set by register_all

// The layer caches a decode benchmark cycles through: one for caches that fit
// L2 by design (decode_l2), else enough copies to fill twice the LLC, or
// KVCAL_BENCH_LAYERS copies. Only the latest method's full-size copies are
// kept (a few GB on a large-LLC host).
const std::vector<std::unique_ptr<rt::HexLayerCache>>& cached(const std::string& method, std::int64_t tokens) {
  using Layers = std::vector<std::unique_ptr<rt::HexLayerCache>>;
  static std::map<std::string, Layers> hot;
  static std::pair<std::string, Layers> cold;
  const bool fits_l2 = tokens < kTokens;
  Layers& slot = fits_l2 ? hot[method] : cold.second;
  if (!fits_l2 && cold.first != method) {
    cold.second.clear();
    cold.first = method;
  }
  if (slot.empty()) {
    slot.push_back(std::make_unique<rt::HexLayerCache>(make_cache(method, tokens)));
    const auto bytes = static_cast<std::int64_t>(slot[0]->bytes());
    const std::int64_t n = fits_l2             ? 1
                           : wanted_layers > 0 ? wanted_layers
                                               : std::max<std::int64_t>(1, (2 * llc_bytes() + bytes - 1) / bytes);
    slot.resize(static_cast<std::size_t>(n));
#pragma omp parallel for schedule(dynamic)  // ~0.8 s apiece; hex2@int8 takes 22 on a 260 MB L3
    for (std::int64_t i = 1; i < n; ++i) slot[i] = std::make_unique<rt::HexLayerCache>(make_cache(method, tokens));
  }
  return slot;
}

void compress_block(benchmark::State& state, const std::string& method) {
  const rt::HexOptions o = rt::hex_method(method);
  const Data& d = data();
  const auto m = o.expander ? mask() : nullptr;
  std::vector<std::uint8_t> keep(kBlock, 0);
  if (o.heavy_hitters) keep[3] = keep[50] = keep[kBlock - 1] = 1;
  for (auto _ : state) {
    for (std::int64_t h = 0; h < kHeads; ++h) {
      const rt::HexBlock b = rt::hex_compress_block(d.k.data() + h * kTokens * kDim, d.v.data() + h * kTokens * kDim,
                                                    kBlock, kDim, kDim, keep.data(), m, o.bits);
      benchmark::DoNotOptimize(b.k_codes.data());
    }
  }
  state.SetBytesProcessed(state.iterations() * kHeads * kBlock * kDim * 2 * 2);
  state.counters["blocks_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void decode(benchmark::State& state, const std::string& method, std::int64_t tokens) {
  const std::int64_t group = state.range(0);
  const auto& layers = cached(method, tokens);
  std::vector<float> q(static_cast<std::size_t>(kHeads * group * kDim)), out(q.size());
  std::mt19937_64 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (auto& x : q) x = g(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  std::size_t next = 0;
  for (auto _ : state) {
    layers[next]->attend(q.data(), kHeads * group, scale, out.data());
    benchmark::DoNotOptimize(out.data());
    next = next + 1 == layers.size() ? 0 : next + 1;
  }
  const rt::HexLayerCache& c = *layers[0];
  state.SetBytesProcessed(state.iterations() * c.bytes());
  state.counters["kv_size_pct"] = 100.0 * static_cast<double>(c.bytes()) / static_cast<double>(c.fp16_bytes());
  state.counters["threads"] = omp_get_max_threads();
  state.counters["layers"] = static_cast<double>(layers.size());
}

void streaming_read(benchmark::State& state) {
  static const std::vector<float> buf(
      static_cast<std::size_t>(std::max<std::int64_t>(std::int64_t{256} << 20, 4 * llc_bytes())) / sizeof(float), 1.0f);
  const auto n = static_cast<std::int64_t>(buf.size());
  const int threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    const float total = kvcal::bench::streaming_sum(buf.data(), n, threads);
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(state.iterations() * n * static_cast<std::int64_t>(sizeof(float)));
}

int register_all() {
  wanted_layers = layers_from_env();
  // The SIMD target the kernels run on (dispatched at run time).
  kvcal::bench::force_target_from_env();
  benchmark::AddCustomContext("simd_target", rt::simd_target());
  // How far ahead the integer code kernels request 2-, 3- and 4-bit codes.
  benchmark::AddCustomContext("prefetch_far", std::to_string(rt::prefetch_far_bytes(2)) + " B (2-bit), " +
                                                  std::to_string(rt::prefetch_far_bytes(3)) + " B (3-bit), " +
                                                  std::to_string(rt::prefetch_far_bytes(4)) + " B (4-bit)");
  // How many rows ahead they request lines into L1 (key tiles, value kernel).
  benchmark::AddCustomContext("prefetch_near", std::to_string(rt::prefetch_near_rows(false)) + " rows (keys), " +
                                                   std::to_string(rt::prefetch_near_rows(true)) + " rows (values)");
  for (const char* m : kMethods) {
    if (std::string(m) != "fp16" && std::string(m).find('@') == std::string::npos)
      benchmark::RegisterBenchmark((std::string("compress_block/") + m).c_str(), compress_block, std::string(m))
          ->Unit(benchmark::kMicrosecond);
  }
  struct Decode {
    const char* prefix;
    std::int64_t tokens;
    benchmark::TimeUnit unit;
  };
  for (const Decode& d :
       {Decode{"decode/", kTokens, benchmark::kMillisecond}, Decode{"decode_l2/", kHotTokens, benchmark::kMicrosecond}})
    for (const char* m : kMethods)
      benchmark::RegisterBenchmark((d.prefix + std::string(m)).c_str(), decode, std::string(m), d.tokens)
          ->Arg(1)
          ->Arg(4)
          ->Arg(8)
          ->UseRealTime()
          ->Unit(d.unit);
  benchmark::RegisterBenchmark("streaming_read", streaming_read)
      ->Arg(1)
      ->Arg(2)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
