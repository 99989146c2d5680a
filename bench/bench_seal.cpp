// The integrity seal's cost at open: what Bundle::open adds before libhdf5
// reads a bundle, on a sealed file of 1 GiB (KVCAL_SEAL_BENCH_MB overrides),
// against reading the same file with the same reads in the same run.
//
//  raw_read: pread of the whole file in 1 MiB pieces, nothing else (the
//    floor: the seal check reads the file once, the same way).
//  check_seal: kvcal::check_seal_fd, i.e. read + SHA-256 of the bytes after
//    the seal + comparison (what every Bundle::open does).
//  check_seal_pinned: the same with the whole-file digest computed alongside
//    (Bundle::open with expected_sha256: two hashes in one read).
//  sha256_memory: SHA-256 of a 64 MiB buffer already in memory (the hash
//    alone, no reads).
// The file is written once and stays in the page cache (warm: the reads are
// memory copies; a cold read from disk adds the disk's time to both). The
// seal covers bytes, not structure, so the file is pseudo-random bytes after
// a 512-byte user block, sealed by kvcal::write_seal as kvcal bundle seals.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvcal/core/sha256.h"
#include "kvcal/io/seal.h"

namespace {

std::string g_path;
std::uint64_t g_bytes = 0;

void make_file() {
  const char* mb = std::getenv("KVCAL_SEAL_BENCH_MB");
  g_bytes = (mb ? std::strtoull(mb, nullptr, 10) : 1024) << 20;
  const char* dir = std::getenv("TMPDIR");
  g_path = std::string(dir ? dir : "/tmp") + "/kvcal_bench_seal_" + std::to_string(::getpid()) + ".h5";
  std::FILE* f = std::fopen(g_path.c_str(), "wb");
  if (!f) std::abort();
  std::vector<char> block(1 << 20, '\0');
  std::fwrite(block.data(), 1, kvcal::kSealSize, f);  // the empty user block
  std::mt19937_64 rng(1);
  for (std::uint64_t done = 0; done < g_bytes; done += block.size()) {
    for (std::size_t i = 0; i < block.size(); i += 8) {
      const std::uint64_t x = rng();
      std::memcpy(block.data() + i, &x, 8);
    }
    std::fwrite(block.data(), 1, block.size(), f);
  }
  std::fclose(f);
  kvcal::write_seal(g_path);
}

void set_bytes(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(g_bytes + kvcal::kSealSize));
}

void raw_read(benchmark::State& state) {
  std::vector<char> buf(1 << 20);
  for (auto _ : state) {
    const int fd = ::open(g_path.c_str(), O_RDONLY);
    std::uint64_t total = 0;
    for (ssize_t n; (n = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(total))) > 0;) {
      total += static_cast<std::uint64_t>(n);
    }
    ::close(fd);
    benchmark::DoNotOptimize(total);
    benchmark::DoNotOptimize(buf.data());
  }
  set_bytes(state);
}

void check_seal(benchmark::State& state) {
  const bool pinned = state.range(0) != 0;
  for (auto _ : state) {
    const int fd = ::open(g_path.c_str(), O_RDONLY);
    const kvcal::SealCheck c = kvcal::check_seal_fd(fd, g_path, pinned);
    ::close(fd);
    if (c.state != kvcal::SealState::sealed) state.SkipWithError("not sealed");
    benchmark::DoNotOptimize(c.sha256.data());
  }
  set_bytes(state);
}

void sha256_memory(benchmark::State& state) {
  std::vector<char> buf(64 << 20, 'x');
  for (auto _ : state) {
    kvcal::Sha256 h;
    h.update(buf.data(), buf.size());
    benchmark::DoNotOptimize(h.digest());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(buf.size()));
}

BENCHMARK(raw_read)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(check_seal)->Name("check_seal")->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(check_seal)->Name("check_seal_pinned")->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(sha256_memory)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  make_file();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::remove(g_path.c_str());
  return 0;
}
