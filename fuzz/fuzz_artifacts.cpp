// Fuzz target for the artifact readers: the input bytes are written to a file
// and given to every reader kvcal has (validate, inspect, the mask, head
// profile, entropy and dump readers, the runtime's Bundle::open). Any
// kvcal::Error or kvcal::runtime::Error is a clean rejection;
// anything else (a crash, a sanitizer report, an uncaught exception) is a bug.
//
// Built by scripts/fuzz.sh with clang's libFuzzer; the same function replays
// saved inputs in ctest (fuzz/replay.cpp) with any compiler.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvcal/core/error.h"
#include "kvcal/io/attention_dump.h"
#include "kvcal/io/entropy_calibration.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/io/masks.h"
#include "kvcal/io/validate.h"
#include "kvcal/runtime/bundle.h"

namespace {

std::string scratch_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir ? dir : "/tmp") + "/kvcal_fuzz_" + std::to_string(::getpid()) + ".h5";
  }();
  return path;
}

template <typename F>
void guarded(F&& f) {
  try {
    f();
  } catch (const kvcal::Error&) {
  } catch (const kvcal::runtime::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = scratch_path();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  (void)kvcal::validate_artifact(path);  // never throws
  guarded([&] { (void)kvcal::inspect_artifact(path, true); });
  guarded([&] {
    const kvcal::MaskFile m = kvcal::read_mask_file(path);
    for (const auto& r : m.masks) (void)kvcal::check_structure(r.mask, true);
  });
  guarded([&] { (void)kvcal::read_head_profile(path); });
  guarded([&] { (void)kvcal::read_entropy_calibration(path); });
  guarded([&] {
    kvcal::AttentionDump d(path);
    for (const auto& s : d.samples()) {
      (void)d.read_layer(s, 0, kvcal::GqaReduce::mean, 2e-2, 1);
      guarded([&] {
        if (d.qkv_head_dim(s) > 0) (void)d.read_qkv_layer(s, 0);
      });
    }
  });
  guarded([&] { (void)kvcal::runtime::Bundle::open(path); });
  std::remove(path.c_str());
  return 0;
}
