// How far ahead the integer code kernels request rows still in memory
// (far_bytes_by_bits, kernels_cpu.h), chosen once when the library loads.
//
// 8 KiB by default: on the Intel guests of the measurement log (docs/cpu-decode-log.md)
// 16 KiB took 3-16% more time (Ice Lake) or gained nothing (model 207), and
// 4 KiB or none gained nothing beyond noise with two threads. On AMD Zen 4
// (a 2-vCPU EPYC guest, family 0x19 model 0x11) 16 KiB for 4-bit codes took
// 15-31% off hex4@int8 decode over 32K tokens with one query and 4-11% with
// four (one thread, interleaved rounds), and 23-39% / 9-23% off kcvt4@int8;
// 3-bit codes were 13-16% slower at 16 KiB and no faster at 12 KiB, so they
// keep 8 KiB. On AMD Zen 5 (a 2-vCPU EPYC guest, family 0x1a model 0x02)
// 16 KiB for 4-bit codes took 4-12% off hex4@int8 with one query and 0-5%
// with four (one thread, 3 interleaved rounds; kcvt4@int8 within the rounds'
// noise either way), while 3-bit codes took 20-39% more time at 16 KiB: the
// same rule. Zen 3 (family 0x19 without AVX-512) and other AMD families were
// not timed at 16 KiB and keep 8 KiB.
//
// 2-bit codes make no far requests by default: on Zen 4, 8 KiB ahead took
// 5-11% more time with one query and gained nothing with four. On the Zen 5
// guest 4 KiB ahead took 15-20% off hex2@int8 with four queries and 4-13%
// with one (8 KiB: 5-13% and 0-9%; 16 KiB: 0-7% and -6 to +5%; one thread,
// 3 interleaved rounds, hex4@int8 in the same runs within 0.94-1.06), so
// Zen 5 with AVX-512 requests 2-bit rows 4 KiB ahead; other CPUs, untimed at
// that distance, make none.
#include <cstdlib>
#include <cstring>

#include <hwy/targets.h>

#include "runtime/hex/kernels_cpu.h"
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kvcal::runtime::detail {

FarBytes choose_prefetch_far(unsigned amd_family, bool avx512, const char* env) {
  FarBytes f;
  if ((amd_family == 0x19u || amd_family == 0x1au) && avx512) f.bits4 = 16384;
  if (amd_family == 0x1au && avx512) f.bits2 = 4096;
  if (env != nullptr && *env != '\0' && std::strlen(env) <= 7) {
    std::int64_t v = 0;
    bool digits = true;
    for (const char* c = env; *c != '\0'; ++c) {
      if (*c < '0' || *c > '9') {
        digits = false;
        break;
      }
      v = 10 * v + (*c - '0');
    }
    if (digits && v <= (std::int64_t{1} << 20)) f.bits2 = f.bits3 = f.bits4 = v;
  }
  return f;
}

namespace {

// The CPU's family where it is AMD's, 0 otherwise (cpuid leaf 1: the base
// family, plus the extended family where the base is 0xf: 0x19 for Zen 3
// and 4, 0x1a for Zen 5).
unsigned amd_family() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return 0;
  const bool amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "AuthenticAMD"
  if (!amd || __get_cpuid(1, &a, &b, &c, &d) == 0) return 0;
  const unsigned base = (a >> 8) & 0xfu;
  return base + (base == 0xfu ? (a >> 20) & 0xffu : 0u);
#else
  return 0;
#endif
}

FarBytes chosen() {
  // AVX-512 as Highway finds it (the CPU's F, VL, DQ, BW and the OS's ZMM
  // state): its AVX3 target or a later one among those the CPU supports.
  const bool avx512 = (hwy::SupportedTargets() & (HWY_AVX3 | HWY_AVX3_DL)) != 0;
  return choose_prefetch_far(amd_family(), avx512, std::getenv("KVCAL_PREFETCH_FAR"));
}

}  // namespace

// Constant-initialised to the defaults (a kernel called from another
// library's static initialiser before this one's runs gets those), then set
// for this CPU.
std::int64_t far_bytes_by_bits[5] = {0, 0, 0, 8192, 8192};
namespace {
[[maybe_unused]] const bool far_bytes_set = [] {
  const FarBytes f = chosen();
  far_bytes_by_bits[2] = f.bits2;
  far_bytes_by_bits[3] = f.bits3;
  far_bytes_by_bits[4] = f.bits4;
  return true;
}();
}  // namespace

std::int64_t prefetch_far_bytes(int bits) { return bits >= 2 && bits <= 4 ? far_bytes_by_bits[bits] : 0; }

FarBytes set_prefetch_far(FarBytes f) {
  const FarBytes old{far_bytes_by_bits[3], far_bytes_by_bits[4], far_bytes_by_bits[2]};
  far_bytes_by_bits[2] = f.bits2;
  far_bytes_by_bits[3] = f.bits3;
  far_bytes_by_bits[4] = f.bits4;
  return old;
}

}  // namespace kvcal::runtime::detail
