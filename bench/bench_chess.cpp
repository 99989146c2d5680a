// CHESS selection cost per decode step against one fp16 attention decode over
// the same context (issue goal: <= 2% of it; the paper reports 0.72-1.49%).
//
// Model shape: an 8B Llama (32 layers, 8 KV heads, 32 query heads, head dim
// 128), so a page vector has D = 32 * 8 * 128 = 32,768 floats; pages of 32
// tokens, 4 pages per chunk, 4 chunks per grid, the "moderate" ratios.
//  select/<tokens>: anchor + one product over every grid, chunk and page
//    vector + Algorithm 1 + sinks and recent pages, all threads.
//  attention_layer/<tokens>: fp16 attention of the 32 query heads over one
//    layer's keys and values (8 KV heads), all threads; a decode step does 32
//    of these, so the goal compares select with 32 x this figure.
#include <benchmark/benchmark.h>

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include <omp.h>

#include "kvcal/runtime/chess.h"
#include "kvcal/runtime/hex.h"

namespace {

namespace rt = kvcal::runtime;

constexpr std::int64_t kLayers = 32, kKvHeads = 8, kQHeads = 32, kDim = 128, kD = kLayers * kKvHeads * kDim;

// An index over `tokens` tokens whose keys are drawn from a few topics plus
// noise (page vectors with structure, like real keys), built page by page.
const rt::ChessIndex& index(std::int64_t tokens) {
  static std::map<std::int64_t, std::unique_ptr<rt::ChessIndex>> cache;
  auto& slot = cache[tokens];
  if (!slot) {
    slot = std::make_unique<rt::ChessIndex>(kD, rt::chess_preset("moderate"));
    std::mt19937_64 rng(5);
    std::normal_distribution<float> g;
    constexpr int kTopics = 16;
    std::vector<float> topics(static_cast<std::size_t>(kTopics * kD));
    for (float& x : topics) x = g(rng);
    std::vector<float> page(static_cast<std::size_t>(32 * kD));
    for (std::int64_t t = 0; t < tokens; t += 32) {
      const float* topic = topics.data() + (rng() % kTopics) * kD;
      for (std::int64_t i = 0; i < 32; ++i)
        for (std::int64_t d = 0; d < kD; ++d) page[static_cast<std::size_t>(i * kD + d)] = topic[d] + 0.5f * g(rng);
      slot->append(page.data(), 32, kD);
    }
  }
  return *slot;
}

void select(benchmark::State& state) {
  const rt::ChessIndex& ix = index(state.range(0));
  std::int64_t pages = 0;
  for (auto _ : state) {
    const std::vector<std::int32_t> sel = ix.select();
    pages = static_cast<std::int64_t>(sel.size());
    benchmark::DoNotOptimize(sel.data());
  }
  state.counters["pages"] = static_cast<double>(ix.pages());
  state.counters["selected"] = static_cast<double>(pages);
  state.counters["summary_MB"] = static_cast<double>(ix.rows() * kD * 4) / 1e6;
  state.SetBytesProcessed(state.iterations() * ix.rows() * kD * 4);
}

void attention_layer(benchmark::State& state) {
  const std::int64_t tokens = state.range(0);
  std::vector<rt::half_bits> k(static_cast<std::size_t>(kKvHeads * tokens * kDim)), v(k.size());
  std::mt19937_64 rng(9);
  std::normal_distribution<float> g;
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = rt::float_to_half(g(rng));
    v[i] = rt::float_to_half(g(rng));
  }
  std::vector<float> q(static_cast<std::size_t>(kQHeads * kDim)), out(q.size());
  for (float& x : q) x = g(rng);
  const std::int64_t group = kQHeads / kKvHeads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  for (auto _ : state) {
#pragma omp parallel for schedule(static)
    for (std::int64_t h = 0; h < kKvHeads; ++h)
      rt::attend_fp16(q.data() + h * group * kDim, group, kDim, k.data() + h * tokens * kDim,
                      v.data() + h * tokens * kDim, tokens, kDim, kDim, scale, out.data() + h * group * kDim, kDim);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * kKvHeads * tokens * kDim * 4);
  state.counters["layers_per_step"] = static_cast<double>(kLayers);
}

BENCHMARK(select)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(attention_layer)->Arg(32768)->Arg(131072)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
