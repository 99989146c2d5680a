// KVCAL_BENCH_TARGET=NAME (a Highway target name: AVX3_DL, AVX3, AVX2, SSE4,
// ...) makes a benchmark dispatch its kernels to that target instead of the
// host's best, so that one host can time several targets; with
// KVCAL_AVX_VNNI=0 or 1 (read by the runtime) AVX2 and AVX3 run with or
// without their VPDPBUSD integer kernels (AVX-VNNI, AVX-512 VNNI) where the
// CPU has the instruction. An unknown or unsupported name is an error.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <hwy/targets.h>

namespace kvcal::bench {

// Forces the target named by KVCAL_BENCH_TARGET, if set; exits with a message
// if the host cannot run it.
inline void force_target_from_env() {
  const char* want = std::getenv("KVCAL_BENCH_TARGET");
  if (want == nullptr || *want == '\0') return;
  for (const std::int64_t t : hwy::SupportedAndGeneratedTargets()) {
    if (std::strcmp(hwy::TargetName(t), want) == 0) {
      hwy::SetSupportedTargetsForTest(t);
      return;
    }
  }
  std::fprintf(stderr, "error: KVCAL_BENCH_TARGET=%s is not a SIMD target this build and CPU can run\n", want);
  std::exit(2);
}

}  // namespace kvcal::bench
