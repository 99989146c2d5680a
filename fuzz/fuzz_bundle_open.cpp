// Fuzz target for the serving path alone: the runtime's Bundle::open, in
// process, with its default options, linking kvcal::runtime only (what an
// engine links). Every input must be a clean kvcal::runtime::Error or a
// loaded bundle; any crash or sanitizer report is a bug, wherever it
// happens (libhdf5 included: the integrity seal is there to keep damaged
// files away from it).
//
// Built by `scripts/fuzz.sh SECONDS bundle_open` with clang's libFuzzer; the
// replay binary kvcal_fuzz_bundle_replay runs saved inputs with any compiler.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvcal/runtime/bundle.h"

namespace {

std::string scratch_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir ? dir : "/tmp") + "/kvcal_fuzz_bundle_" + std::to_string(::getpid()) + ".h5";
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = scratch_path();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    const auto b = kvcal::runtime::Bundle::open(path);
    // A bundle that opened is indexed as an engine would.
    for (const auto& m : b->masks()) (void)b->find_mask({m->rows, m->cols, m->row_degree});
    (void)b->heads().full(0, 0);
  } catch (const kvcal::runtime::Error&) {
  }
  std::remove(path.c_str());
  return 0;
}
