// Token entropy/varentropy throughput (issue goals: >= 70% of the machine's
// memory-read bandwidth, and >= 5x a NumPy implementation on the same data,
// which scripts/bench_entropy.py measures in the same run).
//
// Data: float32 logits [rows, V]. With KVCAL_BENCH_LOGITS=FILE (raw float32,
// rows x KVCAL_BENCH_VOCAB) the file is used, so NumPy and kvcal see the same
// numbers; otherwise 512 rows x 128,256 are drawn here. The buffer (~260 MB)
// is far larger than the caches, so each pass streams from memory.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <omp.h>

#include "kvcal/core/random.h"
#include "kvcal/profile/entropy.h"
#include "streaming_read.h"

namespace {

struct Logits {
  std::int64_t rows = 512, vocab = 128256;
  std::vector<float> data;
};

const Logits& logits() {
  static const Logits l = [] {
    Logits x;
    if (const char* v = std::getenv("KVCAL_BENCH_VOCAB")) x.vocab = std::atoll(v);
    if (const char* path = std::getenv("KVCAL_BENCH_LOGITS")) {
      std::FILE* f = std::fopen(path, "rb");
      if (!f) {
        std::fprintf(stderr, "cannot open %s\n", path);
        std::exit(1);
      }
      std::fseek(f, 0, SEEK_END);
      const long bytes = std::ftell(f);
      std::fseek(f, 0, SEEK_SET);
      x.rows = bytes / static_cast<long>(sizeof(float)) / x.vocab;
      x.data.resize(static_cast<std::size_t>(x.rows * x.vocab));
      if (std::fread(x.data.data(), sizeof(float), x.data.size(), f) != x.data.size()) std::exit(1);
      std::fclose(f);
    } else {
      x.data.resize(static_cast<std::size_t>(x.rows * x.vocab));
      kvcal::Rng rng(1);
      for (auto& z : x.data) z = static_cast<float>(3.0 * rng.normal());
    }
    return x;
  }();
  return l;
}

// Memory-read bandwidth: a vectorized sum of the same buffer, all threads.
void streaming_read(benchmark::State& state) {
  const Logits& l = logits();
  const auto n = static_cast<std::int64_t>(l.data.size());
  const int threads = static_cast<int>(state.range(0));
  for (auto _ : state) {
    const float total = kvcal::bench::streaming_sum(l.data.data(), n, threads);
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(state.iterations() * n * static_cast<std::int64_t>(sizeof(float)));
}

void token_stats(benchmark::State& state) {
  const Logits& l = logits();
  const int threads = static_cast<int>(state.range(0));
  std::vector<double> h(static_cast<std::size_t>(l.rows)), v(h.size());
  for (auto _ : state) {
    kvcal::token_stats_rows(l.data.data(), l.rows, l.vocab, h.data(), v.data(), threads);
    benchmark::DoNotOptimize(h.data());
  }
  state.SetBytesProcessed(state.iterations() * l.rows * l.vocab * static_cast<std::int64_t>(sizeof(float)));
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * l.rows), benchmark::Counter::kIsRate);
  state.counters["vocab"] = static_cast<double>(l.vocab);
}

BENCHMARK(streaming_read)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(token_stats)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
