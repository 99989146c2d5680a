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
//
// The near requests (into L1, near_rows_keys and near_rows_values rows ahead
// of the key tiles' and the value kernel's reads) are the same on every CPU:
// 96 and 64 rows. On the Zen 4 guest shorter ones helped only hex4: 48 rows
// for both took 4-22% off hex4@int8 decode over 32K tokens (one thread, 3
// interleaved rounds, groups of 1 and 4) but added 8-17% to hex3@int8, 3-9%
// to hex2@int8 and up to 15% to kcvt4@int8; 48 for the keys alone, 3-13% off
// hex4 and up to 10% more for the other three. KVCAL_PREFETCH_NEAR=<rows>
// sets both, to time other distances without a rebuild.
#include <cstdlib>
#include <cstring>

#include <hwy/targets.h>

#include "runtime/hex/kernels_cpu.h"
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kvcal::runtime::detail {

namespace {
// env as a whole number in [0, max] (at most 7 digits), or -1.
std::int64_t env_count(const char* env, std::int64_t max) {
  if (env == nullptr || *env == '\0' || std::strlen(env) > 7) return -1;
  std::int64_t v = 0;
  for (const char* c = env; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') return -1;
    v = 10 * v + (*c - '0');
  }
  return v <= max ? v : -1;
}
}  // namespace

FarBytes choose_prefetch_far(unsigned amd_family, bool avx512, const char* env) {
  FarBytes f;
  if ((amd_family == 0x19u || amd_family == 0x1au) && avx512) f.bits4 = 16384;
  if (amd_family == 0x1au && avx512) f.bits2 = 4096;
  if (const std::int64_t v = env_count(env, std::int64_t{1} << 20); v >= 0) f.bits2 = f.bits3 = f.bits4 = v;
  return f;
}

NearRows choose_prefetch_near(const char* env) {
  NearRows n;
  if (const std::int64_t v = env_count(env, 4096); v >= 0) n.keys = n.values = v;
  return n;
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

std::int64_t near_rows_keys = NearRows{}.keys, near_rows_values = NearRows{}.values;
namespace {
[[maybe_unused]] const bool near_rows_set = [] {
  const NearRows n = choose_prefetch_near(std::getenv("KVCAL_PREFETCH_NEAR"));
  near_rows_keys = n.keys;
  near_rows_values = n.values;
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

NearRows prefetch_near_rows() { return NearRows{near_rows_keys, near_rows_values}; }

NearRows set_prefetch_near(NearRows n) {
  const NearRows old = prefetch_near_rows();
  near_rows_keys = n.keys;
  near_rows_values = n.values;
  return old;
}

}  // namespace kvcal::runtime::detail
