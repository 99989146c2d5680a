// Per-target pieces the HEX CPU kernel files share (kernels_cpu.cpp,
// scores_int_cpu.cpp, values_int_cpu.cpp): vector tags, unrolling and register helpers, the
// 3-bit row reads and widenings, and the integer dot products' building
// blocks. Included by each of those files once per SIMD target (Highway's
// per-target include guard below) and, in the integer kernels' files, once
// more in each VPDPBUSD pass (see avxvnni_pass.h), inside whose namespace KVCAL_KERNEL_NS it defines them.
// Templates and inline functions only: each kernel file instantiates what it
// uses.
#if defined(KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_) == defined(HWY_TARGET_TOGGLE)  // NOLINT(llvm-header-guard)
#ifdef KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_
#undef KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_
#else
#define KVCAL_RUNTIME_HEX_KERNELS_CPU_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Not again in the VPDPBUSD passes, whose operations exist already (and
// a second inclusion for the flipped toggle would define them again).
#ifndef KVCAL_AVXVNNI_PASS
#include <hwy/highway.h>
#endif

#include "runtime/hex/kernels_cpu.h"

HWY_BEFORE_NAMESPACE();
namespace kvcal::runtime::detail {
namespace KVCAL_KERNEL_NS {
#ifdef KVCAL_VNNI512_PASS
namespace hn = hwy::N_AVX3;  // see avxvnni_pass.h
#elif defined(KVCAL_AVXVNNI_PASS)
namespace hn = hwy::N_AVX2;  // see avxvnni_pass.h
#else
namespace hn = hwy::HWY_NAMESPACE;
#endif

// Whether this target converts binary16 in hardware (F16C on x86-64 AVX2 and
// up, Arm NEON/SVE); the others convert row by row with the scalar routine.
#if (HWY_ARCH_X86 && HWY_TARGET > HWY_AVX2) || HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
constexpr bool kHardwareHalf = false;
#else
constexpr bool kHardwareHalf = true;
#endif

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using D8 = hn::Rebind<std::uint8_t, DI>;  // as many bytes as float lanes
using DH = hn::Rebind<hwy::float16_t, DF>;

// Rows ahead whose codes are requested early: a block's codes are a few
// kilobytes, too short for the hardware prefetcher to ramp up on by itself.
// (The blocks follow one another in memory, so near a block's end this
// reaches into the next one.) 48 rows, 3 KiB of 4-bit codes: on a 2-vCPU
// Zen 3 guest, decode over 32K tokens against 16 rows took 10% less at
// kcvt4@int8 with a GQA group of 4, and 2% / 10% less at fp16 with groups
// of 1 / 4; 32 and 96 rows were no better for the codes. Rows wider than a
// line take one request per line: the fp16 kernels (ScoresRows on fp16
// rows, HalfAccumulateRows) requested only a row's first line, and with the
// rows of the fp16 method 16 bytes past a line the loads that straddled two
// lines stood in for the missing requests, with the rows on lines nothing
// did (decode over 32K tokens 26-38% slower). Every line: the fp16 method's
// decode over 32K tokens on a Zen 4 guest, one thread, one round, 5% faster
// with one query and 17% with four (README, "The fp16 kernels request every
// line of the rows ahead").
constexpr std::int64_t kPrefetchRows = 48;
// The integer code kernels (code_scores_int, code_accumulate_int) also
// request lines some KiB ahead of the rows they read, with the hint for
// the outer caches (PREFETCHT2): at their speed, their near requests (48 to
// 96 rows, 3-6 KiB of 4-bit codes) come too late for lines still in memory,
// and requesting 128 to 256 rows ahead into L1 instead made them slower. On
// the 2-vCPU Zen 4 guest, decode over 32K tokens with one thread: hex4@int8
// 7-12% less time with a group of 1 and 10-16% less with a group of 4,
// kcvt4@int8 9-17% less. 2-bit rows there: 5-11% more time with one query,
// nothing gained with four (8 KiB ahead); on a Zen 5 guest, 4 KiB ahead took
// 15-20% off hex2@int8 with four. How far: 8 KiB for 3- and 4-bit rows,
// 16 KiB for 4-bit codes on AMD Zen 4 and 5, none for 2-bit rows but 4 KiB on
// Zen 5, chosen when the library loads (far_bytes_by_bits, prefetch.cpp,
// where the timings are).
// Requests the lines of [p + far, p + far + n) for kBits-bit rows, far =
// far_bytes_by_bits[kBits] (0: none), one request per line (past the end of
// the codes is harmless). For stored 2-, 3- and 4-bit rows in memory only:
// 3-bit rows widened into a chunk (kWide3, not an index of
// far_bytes_by_bits) get theirs from the widening (see WidenedChunks3).
template <int kBits>
HWY_INLINE void PrefetchFar(const std::uint8_t* p, std::int64_t n) {
  if constexpr (kBits >= 2 && kBits <= 4) {
    const std::int64_t far = far_bytes_by_bits[kBits];
    if (far > 0)
      for (std::int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + far + o, 0, 1);
  }
}

HWY_INLINE float Sum(DF d, hn::Vec<DF> v) { return hn::GetLane(hn::SumOfLanes(d, v)); }

#if HWY_TARGET != HWY_SCALAR
// The lane sums of four vectors, out4[m] = sum of the lanes of a_m: two
// rounds of interleaving leave each 128-bit block holding the four partial
// sums, then the blocks are added (far fewer steps than four reductions).
template <class D>
HWY_INLINE void StoreBlockSum(D d, hn::Vec<D> y, hn::TFromD<D>* out4) {
  if constexpr (HWY_HAVE_SCALABLE) {
    using T = hn::TFromD<D>;
    HWY_ALIGN T lanes[hn::MaxLanes(D())];
    hn::Store(y, d, lanes);
    T s[4] = {0, 0, 0, 0};
    for (std::size_t l = 0; l < hn::Lanes(d); ++l) s[l & 3] += lanes[l];
    for (int m = 0; m < 4; ++m) out4[m] = s[m];
  } else if constexpr (hn::MaxLanes(D()) <= 4) {
    hn::StoreU(y, d, out4);
  } else {
    const hn::Half<D> dh;
    StoreBlockSum(dh, hn::Add(hn::LowerHalf(dh, y), hn::UpperHalf(dh, y)), out4);
  }
}
template <class D>
HWY_INLINE void Sum4(D d, hn::Vec<D> a0, hn::Vec<D> a1, hn::Vec<D> a2, hn::Vec<D> a3, hn::TFromD<D>* out4) {
  const hn::Repartition<double, D> d64;
  const auto x01 = hn::Add(hn::InterleaveLower(d, a0, a1), hn::InterleaveUpper(d, a0, a1));
  const auto x23 = hn::Add(hn::InterleaveLower(d, a2, a3), hn::InterleaveUpper(d, a2, a3));
  const auto u = hn::BitCast(d64, x01), v = hn::BitCast(d64, x23);
  StoreBlockSum(
      d, hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, u, v)), hn::BitCast(d, hn::InterleaveUpper(d64, u, v))), out4);
}
#endif

// Calls f(std::integral_constant<int, kQ>(), j) for queries j .. j + kQ - 1,
// four at a time (a GQA group of 4 in one pass; the accumulators of larger
// groups would not stay in registers).
template <class F>
HWY_INLINE void InGroupsOf4(std::int64_t nq, F f) {
  for (std::int64_t j = 0; j < nq; j += 4) {
    switch (std::min<std::int64_t>(4, nq - j)) {
      case 1:
        f(std::integral_constant<int, 1>(), j);
        break;
      case 2:
        f(std::integral_constant<int, 2>(), j);
        break;
      case 3:
        f(std::integral_constant<int, 3>(), j);
        break;
      default:
        f(std::integral_constant<int, 4>(), j);
        break;
    }
  }
}

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// Vector registers the row-wise accumulation may fill with accumulators
// (AVX2 and SSE4 have 16 registers; AVX-512 and NEON 32).
constexpr int kAccVectors = (HWY_ARCH_X86 && HWY_TARGET > HWY_AVX3) ? 8 : 16;

// Lambdas of the unrolled kernels are inlined, or their accumulators spill.
// Not in sanitizer builds: forced inlining of the unrolled bodies with their
// instrumented arrays of vectors makes the compiler take tens of minutes, and
// speed is not what those builds are for.
#ifndef KVCAL_UNROLL_ATTRS
#define KVCAL_UNROLL_ATTRS
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVCAL_INLINE_LAMBDA
#define KVCAL_FLATTEN
#define KVCAL_ROW_KERNELS 0  // the row-unrolled kernels: not compiled (see above)
#else
#define KVCAL_ROW_KERNELS 1
#define KVCAL_INLINE_LAMBDA __attribute__((always_inline))
#define KVCAL_FLATTEN HWY_FLATTEN
#endif
#endif

template <int... kI, class F>
HWY_INLINE void UnrollSeq(std::integer_sequence<int, kI...>, [[maybe_unused]] F f) {  // unused when kN == 0
  (f(std::integral_constant<int, kI>()), ...);
}
// f(std::integral_constant<int, i>()) for i = 0 .. kN - 1.
template <int kN, class F>
HWY_INLINE void Unroll(F f) {
  UnrollSeq(std::make_integer_sequence<int, kN>(), f);
}

// Register pressure in the unrolled integer kernels on x86 targets with 16
// vector registers (SSE4, AVX2). Left to itself, GCC loads every query's
// weights ahead of their products and keeps loaded weights for the next
// row; the accumulators no longer fit, and one spilled accumulator puts a
// store and a reload (several cycles) on the loop-carried path of every
// iteration. KVCAL_PIN(v) fixes v in a register at that point of the program
// order (an empty volatile asm: no instruction), so that a vector is made
// where it is used; Launder(p) makes loads through p new ones, so that GCC
// reads operands from memory again instead of holding them. Elsewhere (32
// registers, or no x86) both do nothing.
// (Pin is a macro: through a function's reference parameter an element of
// an array of vectors is no longer taken for a register.)
// Both macros are defined afresh in each target's inclusion of this header.
#undef KVCAL_SIXTEEN_REGISTERS
#undef KVCAL_PIN
#if HWY_ARCH_X86 && HWY_TARGET > HWY_AVX3 && HWY_TARGET != HWY_SCALAR
#define KVCAL_SIXTEEN_REGISTERS 1
#define KVCAL_PIN(v) asm volatile("" : "+x"((v).raw))
#else
#define KVCAL_SIXTEEN_REGISTERS 0
#define KVCAL_PIN(v) ((void)0)
#endif
template <class T>
HWY_INLINE T* Launder(T* p) {
#if KVCAL_SIXTEEN_REGISTERS
  asm volatile("" : "+r"(p));
#endif
  return p;
}

#endif

// ---------------------------------------------------------------- 3-bit rows
// 3-bit rows of a width divisible by 8 (see kernels_cpu.h): group g (channels
// 8g .. 8g + 7, slots k * run + g) is the 24 bits at byte 3g. One float lane
// per group: a permute of 32-bit lanes brings each 128-bit block the 16 bytes
// holding its four groups, a byte shuffle within blocks gives each lane its
// three bytes, and phase k is (lane >> 3k) & 7. A vector of N groups reads 4N
// bytes for its 3N: the last row of a block is read from a padded copy.
#if HWY_TARGET != HWY_SCALAR
template <class D>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> GroupPermutation3(D) {
  const hn::RebindToUnsigned<D> du;
  const auto l = hn::Iota(du, 0);
  return hn::Sub(l, hn::ShiftRight<2>(l));  // lane l <- 32-bit word 3 (l / 4) + l % 4
}
template <class D>
HWY_INLINE hn::Vec<hn::Repartition<std::uint8_t, hn::RebindToUnsigned<D>>> GroupShuffle3(D) {
  const hn::Repartition<std::uint8_t, hn::RebindToUnsigned<D>> du8;
  const auto b = hn::And(hn::Iota(du8, 0), hn::Set(du8, 15));
  return hn::Sub(b, hn::ShiftRight<2>(b));  // byte 4j + m of a block <- its byte 3j + m
}
template <class D, class Idx, class VS>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<D>> LoadGroups3(D, const std::uint8_t* p, const Idx& perm, VS shuffle) {
  const hn::RebindToUnsigned<D> du;
  const hn::Repartition<std::uint8_t, decltype(du)> du8;
  auto words = hn::BitCast(du, hn::LoadU(du8, p));
  if constexpr (hn::MaxLanes(D()) > 4) words = hn::TableLookupLanes(words, perm);  // one block: in place
  return hn::BitCast(du, hn::TableLookupBytes(hn::BitCast(du8, words), shuffle));
}
template <int k, class D, class VU>
HWY_INLINE hn::Vec<D> Code3(D d, VU groups) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  return hn::ConvertTo(d, hn::BitCast(di, hn::And(hn::ShiftRight<3 * k>(groups), hn::Set(du, 7u))));
}
#endif

// The 24 bits of group g of a 3-bit row.
HWY_INLINE std::uint32_t Group3(const std::uint8_t* row, std::int64_t g) {
  const std::uint8_t* b = row + 3 * g;
  return b[0] | (static_cast<std::uint32_t>(b[1]) << 8) | (static_cast<std::uint32_t>(b[2]) << 16);
}

// The groups a target reads in vectors (a multiple of N, the rest scalar) and
// the copy of the last row they read from: 3 vec + N bytes, zero past the row.
struct LastRow3 {
  static constexpr std::int64_t kBytes = 1024;
  HWY_ALIGN std::uint8_t pad[kBytes];
  std::int64_t vec = 0;
  LastRow3(std::int64_t run, std::int64_t N, const std::uint8_t* last_row) {
    vec = HWY_TARGET == HWY_SCALAR ? 0 : run / N * N;
    if (3 * vec + N > kBytes) vec = 0;  // very wide rows: scalar
    std::memcpy(pad, last_row, static_cast<std::size_t>(3 * vec));
    std::memset(pad + 3 * vec, 0, static_cast<std::size_t>(N));
  }
};

// Calls f with the widest float tag whose lanes fit in a run of groups (the
// narrowest where none does: its groups then go scalar).
template <class F>
HWY_INLINE void WithGroupTag3(std::int64_t run, F f) {
  const DF df;
#if HWY_TARGET == HWY_SVE || HWY_TARGET == HWY_SVE2 || HWY_TARGET == HWY_SVE_256 || HWY_TARGET == HWY_SVE2_128
  (void)run;
  f(df);
#else
  if (static_cast<std::int64_t>(hn::Lanes(df)) <= run) return f(df);
  const hn::CappedTag<float, 8> d8;
  if (static_cast<std::int64_t>(hn::Lanes(d8)) <= run) return f(d8);
  f(hn::CappedTag<float, 4>());
#endif
}

// 3-bit codes widened to 4 bits: n groups of three bytes (eight codes, code
// k at bits 3k) at src to n little-endian 32-bit words at dst (code k in
// nibble k), i.e. a 3-bit row stream becomes the 4-bit row stream of the same
// codes. The integer kernels then read 3-bit rows as 4-bit rows. Per vector
// of groups: blends give byte m of a group bits [6m, 6m + 8) -- each 16-bit
// half its 12 bits at 0 (the low half as it is, the high one from the group
// shifted by 4), then each byte its 6 bits at 0 (the low byte as it is, the
// high one from the half shifted by 2); bits 6-7 of a byte are left over,
// and one shift-mask-merge puts its codes in nibbles.
#if HWY_TARGET != HWY_SCALAR
// The first two steps: byte m of each group holds codes 2m and 2m + 1 in
// bits 0-2 and 3-5 (bits 6-7: the group's next bits), which the integer
// kernels split as they split 4-bit bytes (shift and mask). This is how they
// read 3-bit rows in place (see IntBytes).
template <class VU>
HWY_INLINE VU Widen3ToPairs(VU x) {
  const hn::DFromV<VU> du;
  const hn::Repartition<std::uint16_t, decltype(du)> du16;
  const hn::Repartition<std::uint8_t, decltype(du)> du8;
  const auto h = hn::OddEven(hn::BitCast(du16, hn::ShiftLeft<4>(x)), hn::BitCast(du16, x));
  return hn::BitCast(du, hn::OddEven(hn::BitCast(du8, hn::ShiftLeft<2>(h)), hn::BitCast(du8, h)));
}
template <class VU>
HWY_INLINE VU Widen3To4(VU x) {
  const hn::DFromV<VU> du;
  const hn::Repartition<std::uint16_t, decltype(du)> du16;
  const hn::Repartition<std::uint8_t, decltype(du)> du8;
  const auto b = hn::BitCast(du8, Widen3ToPairs(x));
  const auto b1 = hn::BitCast(du8, hn::ShiftLeft<1>(hn::BitCast(du16, b)));  // bit 7 into the next byte's bit 0
  return hn::BitCast(du, hn::OrAnd(hn::And(b, hn::Set(du8, 0x07)), b1, hn::Set(du8, 0x70)));
}
#endif

HWY_INLINE std::uint32_t Widen3ToPairsScalar(std::uint32_t x) {
  x = (x & 0xfffu) | ((x << 4) & 0x0fff0000u);
  return (x & 0x003f003fu) | ((x << 2) & 0x3f003f00u);
}
HWY_INLINE std::uint32_t Widen3To4Scalar(std::uint32_t x) {
  x = Widen3ToPairsScalar(x);
  return (x & 0x07070707u) | ((x << 1) & 0x70707070u);
}

// With kPairs, the rows widened only to two codes per byte (Widen3ToPairs:
// codes 2m and 2m + 1 in bits 0-2 and 3-5 of byte m, bits 6-7 unspecified),
// which the integer kernels split as PhaseBytes<3, k> (see kWide3).
// How far ahead of its reads WidenCodes3 requests the 3-bit codes: it
// consumes them faster than memory delivers and computes nothing while it
// waits, so the request must be out a memory latency early, past the
// block's end into the next block's (BlockStore keeps them in one stream).
// hex3@int8 decode at a group of 4 on a Zen 5 host, each against 4096
// bytes ahead in interleaved runs: 1024 bytes 10% slower, 2048 6%, 8192 1%.
#if HWY_TARGET == HWY_AVX3_DL
HWY_INLINE __m512i MultishiftRaw(__m512i at, __m512i x) { return _mm512_multishift_epi64_epi8(at, x); }
HWY_INLINE __m256i MultishiftRaw(__m256i at, __m256i x) { return _mm256_multishift_epi64_epi8(at, x); }
HWY_INLINE __m128i MultishiftRaw(__m128i at, __m128i x) { return _mm_multishift_epi64_epi8(at, x); }

// The constants of the VBMI 3-bit read (VPERMD then VPMULTISHIFTQB, see
// WidenCodes3), for vectors of up to 64 bytes: words, the 32-bit word each
// 32-bit lane takes (each 64-bit lane two groups: six bytes from bit a = 0 in
// even lanes, 16 in odd ones); pairs, the bit each output byte starts at for
// codes 2m and 2m + 1 (bits [a + 6m, a + 6m + 8)); nibble_hi, one bit lower,
// for code 2m + 1 in the high nibble.
struct Multishift3 {
  alignas(64) std::uint32_t words[16];
  alignas(64) std::uint8_t pairs[64];
  alignas(64) std::uint8_t nibble_hi[64];
  constexpr Multishift3() : words{}, pairs{}, nibble_hi{} {
    for (int w = 0; w < 16; ++w) words[w] = static_cast<std::uint32_t>(w / 4 * 3 + (w % 4 + 1) / 2);
    for (int i = 0; i < 64; ++i) {
      const int lane = i / 8, m = i % 8, at = lane % 2 ? 16 : 0;  // odd lanes: bytes 2-7
      pairs[i] = static_cast<std::uint8_t>((at + 6 * m) % 64);
      nibble_hi[i] = static_cast<std::uint8_t>((at + 6 * m + 63) % 64);
    }
  }
};
inline constexpr Multishift3 kMultishift3{};

// The constants of the VBMI read of 3-bit value tiles (Tile3Bytes): the
// N = 64 bytes of a group's vector -- N / 4 pair columns (codes 2p and 2p +
// 1 of a row, as IntBytes<3> reads rows) of four rows, row k of column p in
// byte 4p + k -- come from a 3N / 4-byte window of the tile (N / 16 groups of
// eight codes of each row, row k's byte c at 4c + k). VPERMB (bytes) gives
// 64-bit lane q = 2g + d, for each row k, the row's bytes 3g + d and 3g + d +
// 1 of the window in bytes 2k and 2k + 1: bits [8d, 8d + 16) of group g,
// which hold codes 4d .. 4d + 3. VPMULTISHIFTQB (pairs) then gives output
// byte b of lane q -- row b % 4 of pair column 2q + b / 4, i.e. codes 2m and
// 2m + 1 of group g with m = 2d + b / 4 -- the bits from 16 (b % 4) + 4d + 6
// (b / 4): those codes in bits 0-5 (bits 6-7 are the next ones, which the
// phases' masks clear). The first 32 bytes of each table serve N = 32.
struct Tile3 {
  alignas(64) std::uint8_t bytes[64];
  alignas(64) std::uint8_t pairs[64];
  constexpr Tile3() : bytes{}, pairs{} {
    for (int j = 0; j < 64; ++j) {
      const int q = j / 8, b = j % 8, g = q / 2, d = q % 2;
      bytes[j] = static_cast<std::uint8_t>(4 * (3 * g + d + b % 2) + b / 2);
      pairs[j] = static_cast<std::uint8_t>(16 * (b % 4) + 4 * d + 6 * (b / 4));
    }
  }
};
inline constexpr Tile3 kTile3{};

// A vector of a group of four 3-bit rows stored as value tiles, from its
// window at p (3N / 4 bytes; a masked load, which reads nothing past them):
// the bytes IntBytes<3> gives for the rows, transposed as value tiles are
// (see Tile3). Vectors of 64 and 32 bytes (VbmiRead3).
template <class D8>
HWY_INLINE hn::Vec<D8> Tile3Bytes(D8, const std::uint8_t* p) {
  static_assert(hn::MaxLanes(D8()) == 64 || hn::MaxLanes(D8()) == 32, "the VBMI read's vectors");
  if constexpr (hn::MaxLanes(D8()) == 64) {
    const __m512i x =
        _mm512_permutexvar_epi8(_mm512_load_si512(kTile3.bytes), _mm512_maskz_loadu_epi8(0xffffffffffffull, p));
    return hn::Vec<D8>{_mm512_multishift_epi64_epi8(_mm512_load_si512(kTile3.pairs), x)};
  } else {
    const __m256i x = _mm256_permutexvar_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kTile3.bytes)),
                                              _mm256_maskz_loadu_epi8(0xffffffu, p));
    return hn::Vec<D8>{
        _mm256_multishift_epi64_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(kTile3.pairs)), x)};
  }
}
#endif

constexpr std::int64_t kWidenAhead = 4096;
// kFar: also the far requests (PrefetchFar) for the 3-bit rows, one per turn
// (see WidenedChunks3).
template <bool kPairs, bool kFar = false>
void WidenCodes3(const std::uint8_t* src, std::int64_t n, std::uint8_t* dst) {
  std::int64_t g = 0;
#if HWY_TARGET == HWY_AVX3_DL
  // VBMI (in Highway's AVX3_DL attributes, not in its 1.0.3 API): one 32-bit
  // permute gives each 64-bit lane two groups (six bytes from bit a = 0 in
  // even lanes, 16 in odd ones; code k at bit a + 3k), and VPMULTISHIFTQB
  // moves each output byte's two codes into place: byte m takes bits
  // [a + 6m, a + 6m + 8) for its low nibble (code 2m) and, rotating, bits
  // [a + 6m - 1, a + 6m + 7) for its high one (code 2m + 1). Masked loads and
  // stores: no tail, no read past the end.
  {
    const __m512i vperm = _mm512_load_si512(kMultishift3.words), vlo = _mm512_load_si512(kMultishift3.pairs),
                  vhi = _mm512_load_si512(kMultishift3.nibble_hi);
    const __m512i low3 = _mm512_set1_epi8(0x07), high3 = _mm512_set1_epi8(0x70);
    for (; g < n; g += 16) {
      const std::int64_t k = std::min<std::int64_t>(16, n - g);
      __builtin_prefetch(src + 3 * g + kWidenAhead, 0, 3);  // past the end is harmless
      if constexpr (kFar) PrefetchFar<3>(src + 3 * g, 1);
      const __mmask64 in = k == 16 ? 0xffffffffffffull : (1ull << (3 * k)) - 1;
      const __mmask64 out = k == 16 ? ~0ull : (1ull << (4 * k)) - 1;
      const __m512i x = _mm512_permutexvar_epi32(vperm, _mm512_maskz_loadu_epi8(in, src + 3 * g));
      const __m512i lo = _mm512_multishift_epi64_epi8(vlo, x);  // byte m: bits [a + 6m, a + 6m + 8)
      const __m512i y =
          kPairs ? lo
                 : _mm512_ternarylogic_epi32(lo, low3, _mm512_and_si512(_mm512_multishift_epi64_epi8(vhi, x), high3),
                                             0xea);  // (a & b) | c
      _mm512_mask_storeu_epi8(dst + 4 * g, out, y);
    }
  }
#elif HWY_TARGET != HWY_SCALAR
  WithGroupTag3(n, [&](auto d) {
    const hn::RebindToUnsigned<decltype(d)> du;
    const auto N = static_cast<std::int64_t>(hn::Lanes(d));
    const auto perm = hn::IndicesFromVec(du, GroupPermutation3(d));
    const auto shuffle = GroupShuffle3(d);
    // A vector of N groups loads 4N bytes for its 3N: stop where that would
    // pass the end; the rest go one by one.
    for (; 3 * g + 4 * N <= 3 * n; g += N) {
      __builtin_prefetch(src + 3 * g + kWidenAhead, 0, 3);  // past the end is harmless
      if constexpr (kFar) PrefetchFar<3>(src + 3 * g, 1);
      const auto x = LoadGroups3(d, src + 3 * g, perm, shuffle);
      hn::StoreU(hn::BitCast(hn::Repartition<std::uint8_t, decltype(du)>(), kPairs ? Widen3ToPairs(x) : Widen3To4(x)),
                 hn::Repartition<std::uint8_t, decltype(du)>(), dst + 4 * g);
    }
  });
#endif
  for (; g < n; ++g) {
    const std::uint32_t y = kPairs ? Widen3ToPairsScalar(Group3(src, g)) : Widen3To4Scalar(Group3(src, g));
    for (int m = 0; m < 4; ++m) dst[4 * g + m] = static_cast<std::uint8_t>(y >> (8 * m));
  }
}

// The n 3-bit rows at codes (row_bytes apart, dim % 8 == 0) widened to rows
// of dim / 2 bytes at out (see WidenCodes3): contiguous rows in one stream.
template <bool kPairs, bool kFar = false>
void WidenRows3(const std::uint8_t* codes, std::int64_t n, std::int64_t row_bytes, std::int64_t dim,
                std::uint8_t* out) {
  if (row_bytes == dim / 8 * 3) {
    WidenCodes3<kPairs, kFar>(codes, n * (dim / 8), out);
  } else {
    for (std::int64_t k = 0; k < n; ++k) WidenCodes3<kPairs, kFar>(codes + k * row_bytes, dim / 8, out + k * (dim / 2));
  }
}

// f(wide, n, r0) for the 3-bit rows r0 .. r0 + n - 1 (dim % 8 == 0) widened
// to rows of dim / 2 bytes (4-bit rows, or with kPairs two codes per byte),
// a chunk of them at a time in a per-thread buffer (dim / 2 <=
// kIntWide3Bytes): how the integer kernels read 3-bit rows where they do not
// read them in place.
//
// The kernels that read the chunks make no far requests (their argument far
// = false: the chunk is in L1, and the far distance past it is not the rows'
// memory); with kFar the widening makes them, for the stored rows. kFar
// where the chunks are a whole block's rows, not where they are a block's
// last rows after a kernel that read the others in place (that kernel made
// the requests): on the 2-vCPU Zen 4 guest, decode over 32K tokens with one
// thread and AVX2 forced, hex3@int8 at a group of 4 took 9-12% less time
// and kcvt3@int8 12-14% less (AVX3 forced: 3% and 7-9%; a group of 1 moved
// by no more than the rounds' spread). Far requests for the last rows as
// well moved a group of 1 both ways: hex3@int8 2-6% slower (AVX2, AVX3 and
// AVX3_DL), kcvt3@int8 3-8% faster (AVX2).
template <bool kPairs, bool kFar = false, class F>
void WidenedChunks3(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t dim, F f) {
  alignas(64) static thread_local std::uint8_t wide[kIntWide3Bytes];
  const std::int64_t chunk = kIntWide3Bytes / (dim / 2);
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t n = std::min(chunk, rows - r0);
    WidenRows3<kPairs, kFar>(codes + r0 * row_bytes, n, row_bytes, dim, wide);
    f(static_cast<const std::uint8_t*>(wide), n, r0);
  }
}

// ---------------------------------------------------------------- integer dot

// acc[l] += sum_{i < 4} a[4l + i] * b[4l + i], a unsigned and b signed
// bytes (VPDPBUSD's contract). Every target computes the same exact int32
// sums, provided each pair a[2m] b[2m] + a[2m+1] b[2m+1] fits in int16
// (true for 4-bit codes times int8 weights) and, on Arm, a < 128.
//
// Arm's integer dot products: SVE's SDOT is VPDPBUSD's signed twin (every
// SVE target has it); AArch64 NEON without the dot-product extension (which
// Highway's NEON target does not assume) multiplies and adds pairs (see
// NeonPairs). Both read the unsigned bytes a as signed: a < 128 there.
// (Defined once per target: this header is included once for each.)
#undef KVCAL_SVE
#undef KVCAL_NEON_A64
#if HWY_TARGET == HWY_SVE || HWY_TARGET == HWY_SVE2 || HWY_TARGET == HWY_SVE_256 || HWY_TARGET == HWY_SVE2_128
#define KVCAL_SVE 1
#else
#define KVCAL_SVE 0
#endif
#if HWY_ARCH_ARM_A64 && HWY_TARGET == HWY_NEON
#define KVCAL_NEON_A64 1
#else
#define KVCAL_NEON_A64 0
#endif

#if HWY_TARGET != HWY_SCALAR
#if HWY_TARGET == HWY_AVX3_DL || defined(KVCAL_VNNI512_PASS)
// VPDPBUSD (AVX512-VNNI, part of what Highway requires for AVX3_DL, and what
// the AVX3 target's extra pass is for: see avxvnni_pass.h). Its compiler
// option is not in Highway 1.0.3's attribute lists, and adding it per
// function breaks the per-target passes, so the instruction is written
// directly (EVEX form, also for 256 and 128 bits).
HWY_INLINE __m512i DotBytesRaw(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
HWY_INLINE __m256i DotBytesRaw(__m256i acc, __m256i a, __m256i b) {
  asm("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
HWY_INLINE __m128i DotBytesRaw(__m128i acc, __m128i a, __m128i b) {
  asm("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
#elif defined(KVCAL_AVXVNNI_PASS)
// VPDPBUSD in its VEX form (AVX-VNNI), on the AVX2 target's vectors (__m256i
// and __m128i); "x" operands: VEX encodes only the first 16 vector registers.
template <class V>
HWY_INLINE V DotBytesRaw(V acc, V a, V b) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
}
#elif HWY_ARCH_X86
// PMADDUBSW (pairs of products to int16) and PMADDWD by 1 (pairs of int16 to
// int32).
#if HWY_TARGET <= HWY_AVX3
HWY_INLINE __m512i PairsRaw(__m512i a, __m512i b) { return _mm512_maddubs_epi16(a, b); }
HWY_INLINE __m512i WidenRaw(__m512i x) { return _mm512_madd_epi16(x, _mm512_set1_epi16(1)); }
#endif
#if HWY_TARGET <= HWY_AVX2
HWY_INLINE __m256i PairsRaw(__m256i a, __m256i b) { return _mm256_maddubs_epi16(a, b); }
HWY_INLINE __m256i WidenRaw(__m256i x) { return _mm256_madd_epi16(x, _mm256_set1_epi16(1)); }
#endif
HWY_INLINE __m128i PairsRaw(__m128i a, __m128i b) { return _mm_maddubs_epi16(a, b); }
HWY_INLINE __m128i WidenRaw(__m128i x) { return _mm_madd_epi16(x, _mm_set1_epi16(1)); }
#elif KVCAL_NEON_A64
// Pair sums of a 128-bit vector (AArch64 NEON): SMULL and SMULL2 give the
// sixteen int16 products, ADDP adds neighbours, [a0 b0 + a1 b1, ..., a14 b14
// + a15 b15] in order -- PMADDUBSW's result (3 instructions where the generic
// form takes 8). The unsigned codes are read as signed bytes: exact for a <
// 128 (every code the kernels multiply has at most 4 bits).
HWY_INLINE int16x8_t NeonPairs(uint8x16_t a, int8x16_t b) {
  const int8x16_t as = vreinterpretq_s8_u8(a);
  return vpaddq_s16(vmull_s8(vget_low_s8(as), vget_low_s8(b)), vmull_high_s8(as, b));
}
#endif

// Products as int16 pair sums, acc16[m] += a[2m] b[2m] + a[2m+1] b[2m+1],
// widened to int32 later. Where the dot product is not one instruction, the
// row kernels keep these in their inner loop (PMADDUBSW and an int16 add
// instead of PMADDUBSW, PMADDWD and an int32 add). Each pair sum is below
// 2 * 15 * 128 = 3840 in magnitude (codes of at most 4 bits, int8 limbs), so
// kPairSums of them stay exact in int16.
constexpr int kPairSums = 8;
#ifdef KVCAL_AVXVNNI_PASS
constexpr bool kPairTarget = false;
#else
constexpr bool kPairTarget = HWY_TARGET != HWY_AVX3_DL;
#endif

template <class D8>
HWY_INLINE hn::Vec<hn::Repartition<std::int16_t, D8>> DotPairs(D8 d8, hn::Vec<D8> a,
                                                               hn::Vec<hn::Repartition<std::int8_t, D8>> b,
                                                               hn::Vec<hn::Repartition<std::int16_t, D8>> acc) {
#if HWY_ARCH_X86
  (void)d8;
  return hn::Add(acc, decltype(acc){PairsRaw(a.raw, b.raw)});
#else
#if KVCAL_NEON_A64
  if constexpr (hn::MaxLanes(D8()) == 16) return hn::Add(acc, decltype(acc){NeonPairs(a.raw, b.raw)});
#endif
  const hn::Repartition<std::uint16_t, D8> du16;
  const hn::Repartition<std::int16_t, D8> d16;
  const auto a16 = hn::BitCast(du16, a);
  const auto a_even = hn::BitCast(d16, hn::And(a16, hn::Set(du16, 0xff)));
  const auto a_odd = hn::BitCast(d16, hn::ShiftRight<8>(a16));
  const auto b16 = hn::BitCast(d16, b);
  const auto b_even = hn::ShiftRight<8>(hn::ShiftLeft<8>(b16));  // arithmetic: sign-extends
  const auto b_odd = hn::ShiftRight<8>(b16);
  return hn::Add(acc, hn::Add(hn::Mul(a_even, b_even), hn::Mul(a_odd, b_odd)));
#endif
}

// acc32[l] += acc16[2l] + acc16[2l + 1].
template <class D16>
HWY_INLINE hn::Vec<hn::Repartition<std::int32_t, D16>> WidenPairs(D16, hn::Vec<D16> acc16,
                                                                  hn::Vec<hn::Repartition<std::int32_t, D16>> acc32) {
#if HWY_ARCH_X86
  return hn::Add(acc32, decltype(acc32){WidenRaw(acc16.raw)});
#else
#if KVCAL_NEON_A64
  if constexpr (hn::MaxLanes(D16()) == 8) return decltype(acc32){vpadalq_s16(acc32.raw, acc16.raw)};
#endif
  const hn::Repartition<std::int32_t, D16> d32;
  const auto p = hn::BitCast(d32, acc16);
  return hn::Add(acc32, hn::Add(hn::ShiftRight<16>(hn::ShiftLeft<16>(p)), hn::ShiftRight<16>(p)));
#endif
}

template <class D8>
HWY_INLINE hn::Vec<hn::Repartition<std::int32_t, D8>> DotBytes(D8 d8, hn::Vec<D8> a,
                                                               hn::Vec<hn::Repartition<std::int8_t, D8>> b,
                                                               hn::Vec<hn::Repartition<std::int32_t, D8>> acc) {
#if HWY_TARGET == HWY_AVX3_DL || defined(KVCAL_AVXVNNI_PASS)
  (void)d8;
  return decltype(acc){DotBytesRaw(acc.raw, a.raw, b.raw)};
#elif KVCAL_SVE
  (void)d8;
  return svdot_s32(acc, svreinterpret_s8_u8(a), b);  // a < 128: see above
#else
  const hn::Repartition<std::int16_t, D8> d16;
  return WidenPairs(d16, DotPairs(d8, a, b, hn::Zero(d16)), acc);
#endif
}

// The accumulator of the row kernels: int16 pair sums (kPairs) or int32.
template <bool kPairs, class D8>
using AccTag = std::conditional_t<kPairs, hn::Repartition<std::int16_t, D8>, hn::Repartition<std::int32_t, D8>>;

template <bool kPairs, class D8>
HWY_INLINE hn::Vec<AccTag<kPairs, D8>> DotAcc(D8 d8, hn::Vec<D8> a, hn::Vec<hn::Repartition<std::int8_t, D8>> b,
                                              hn::Vec<AccTag<kPairs, D8>> acc) {
  if constexpr (kPairs)
    return DotPairs(d8, a, b, acc);
  else
    return DotBytes(d8, a, b, acc);
}

// acc32 plus the sums of acc (as it is where acc is int32).
template <bool kPairs, class D8>
HWY_INLINE hn::Vec<hn::Repartition<std::int32_t, D8>> AddAcc(D8, hn::Vec<AccTag<kPairs, D8>> acc,
                                                             hn::Vec<hn::Repartition<std::int32_t, D8>> acc32) {
  if constexpr (kPairs)
    return WidenPairs(AccTag<kPairs, D8>(), acc, acc32);
  else
    return hn::Add(acc32, acc);
}

// The rows the integer kernels read, by their kBits: 2 and 4, stored rows;
// 3, stored 3-bit rows, read in place (IntBytes widens them in registers);
// kWide3, 3-bit rows widened to two codes per byte (WidenCodes3<true>) in a
// buffer, read as they are.
constexpr int kWide3 = 5;
constexpr int CodeBits(int kind) { return kind == kWide3 ? 3 : kind; }

// Codes of phase k (bits [k * b, (k + 1) * b) of each byte, b =
// CodeBits(kBits); the 16-bit shift brings in bits of the next byte, which
// the mask clears, as it clears bits 6-7 of widened 3-bit bytes).
template <int kBits, int k, class D8>
HWY_INLINE hn::Vec<D8> PhaseBytes(D8 d8, hn::Vec<D8> b) {
  constexpr int kB = CodeBits(kBits);
  const hn::Repartition<std::uint16_t, D8> du16;
  const auto mask = hn::Set(d8, static_cast<std::uint8_t>((1u << kB) - 1u));
  if constexpr (k == 0) return hn::And(b, mask);
#if HWY_TARGET == HWY_AVX3_DL
  // 3-bit codes: VPMULTISHIFTQB, not a shift on the port VPDPBUSD needs
  // (bench_kernels, int8, group 4, one block in cache, Intel AVX3_DL guest,
  // 3 interleaved rounds: 506-555 -> 465-481 ns; 2- and 4-bit codes no
  // faster: 488-495 -> 485-526 and 401-409 -> 393-433).
  if constexpr (kB == 3 && hn::MaxLanes(d8) >= 16) {
    const hn::Repartition<std::uint64_t, D8> du64;
    const auto at = hn::BitCast(d8, hn::Set(du64, 0x3830282018100800ull + 0x0101010101010101ull * (k * kB)));
    return hn::And(hn::Vec<D8>{MultishiftRaw(at.raw, b.raw)}, mask);
  }
#endif
  return hn::And(hn::BitCast(d8, hn::ShiftRight<k * kB>(hn::BitCast(du16, b))), mask);
}

// Where DotBytes is one VPDPBUSD (unsigned bytes times signed bytes, int32
// sums: AVX-512 VNNI and AVX-VNNI), the codes of phase k need not be shifted
// down: the bytes masked in place, b & (mask << k s), are the codes times
// 2^(k s) (at most 255), and the int32 sums of that phase are shifted down by
// k s once, exactly (every product is a multiple of 2^(k s)). That saves a
// shift per vector and phase past the first, which on Intel cores shares the
// one 512-bit port that runs VPDPBUSD. Not with int16 pair sums
// (VPMADDUBSW, which would saturate) or the signed dot products of Arm
// (codes below 128).
#if HWY_TARGET == HWY_AVX3_DL || defined(KVCAL_AVXVNNI_PASS)
constexpr bool kMaskedPhases = true;
#else
constexpr bool kMaskedPhases = false;
#endif

// Codes of phase k of kBits-bit rows (CodeBits(kBits) bits a code), times
// 2^(k kSpacing): their bits in place where kSpacing is the rows' code width
// (an AND), else moved there first (3-bit codes widened to 4-bit rows,
// summed with 3-bit ones). 16-bit shifts bring in bits of the next byte,
// which the mask clears.
template <int kBits, int k, int kSpacing, class D8>
HWY_INLINE hn::Vec<D8> MaskedPhaseBytes(D8 d8, hn::Vec<D8> b) {
  constexpr int kB = CodeBits(kBits), kFrom = k * kB, kTo = k * kSpacing;
  static_assert(kTo + kB <= 8, "the scaled codes fit a byte");
  const hn::Repartition<std::uint16_t, D8> du16;
  const auto mask = hn::Set(d8, static_cast<std::uint8_t>(((1u << kB) - 1u) << kTo));
  if constexpr (kFrom == kTo) {
    return hn::And(b, mask);
  } else if constexpr (kFrom > kTo) {
    return hn::And(hn::BitCast(d8, hn::ShiftRight<kFrom - kTo>(hn::BitCast(du16, b))), mask);
  } else {
    return hn::And(hn::BitCast(d8, hn::ShiftLeft<kTo - kFrom>(hn::BitCast(du16, b))), mask);
  }
}

// The codes of phase k as the integer kernels multiply them: masked in place
// (kMasked, with int32 sums) or shifted down (PhaseBytes).
template <bool kMasked, int kBits, int k, int kSpacing, class D8>
HWY_INLINE hn::Vec<D8> KernelPhaseBytes(D8 d8, hn::Vec<D8> b) {
  if constexpr (kMasked)
    return MaskedPhaseBytes<kBits, k, kSpacing>(d8, b);
  else
    return PhaseBytes<kBits, k>(d8, b);
}

// int32 sums of phase k's products back to the codes' scale (see
// kMaskedPhases).
template <bool kMasked, int k, int kSpacing, class V>
HWY_INLINE V PhaseScaled(V sums) {
  if constexpr (kMasked && k > 0)
    return hn::ShiftRight<k * kSpacing>(sums);
  else
    return sums;
}

// Codes per byte of the rows the integer kernels read: four of 2 bits, two
// of 4 bits, and two of 3 bits (3-bit rows are read widened, see IntBytes
// and kWide3).
constexpr int IntPhases(int bits) { return bits == 2 ? 4 : 2; }

// Where the bytes [i, i + N) of a row the integer kernels read come from:
// 2 and 4 bits, the stored bytes [i, i + N); 3 bits, the stored groups of
// eight codes from byte 3i / 4 (i is a multiple of 16).
template <int kBits>
constexpr std::int64_t IntOffset(std::int64_t i) {
  return kBits == 3 ? i / 4 * 3 : i;
}

// Whether IntBytes reads 3-bit rows into vectors of D8 with VBMI.
template <class D8>
constexpr bool VbmiRead3(D8 d8) {
  return HWY_TARGET == HWY_AVX3_DL && (hn::MaxLanes(d8) == 64 || hn::MaxLanes(d8) == 32);
}

#if HWY_TARGET != HWY_SCALAR
// The constants of a 3-bit read (see LoadGroups3) for vectors of bytes D8.
template <class D8>
struct Groups3 {
  using DG = hn::Repartition<float, D8>;  // one lane per group of eight codes
  using DU = hn::RebindToUnsigned<DG>;
  decltype(hn::IndicesFromVec(DU(), GroupPermutation3(DG()))) perm;
  decltype(GroupShuffle3(DG())) shuffle;
  Groups3() : perm(hn::IndicesFromVec(DU(), GroupPermutation3(DG()))), shuffle(GroupShuffle3(DG())) {}
};

// A vector of the bytes the integer kernels read, from p = row +
// IntOffset<kBits>(i): for 2 and 4 bits a load; for 3 bits the N / 4 groups
// at p widened in registers to two codes per byte (Widen3ToPairs), so that
// PhaseBytes<3, k> splits them. The 3-bit read loads N bytes for its 3N / 4:
// it must not be used on the last row of a block. On AVX3_DL, vectors of 32
// and 64 bytes take the VBMI read of WidenCodes3: a VPERMD and a
// VPMULTISHIFTQB, against a permute, a byte shuffle, two shifts and two
// blends (LoadGroups3, Widen3ToPairs), the shifts on the port VPDPBUSD
// needs. One block in cache (bench_kernels, int8, Intel AVX3_DL guest):
// scores at a group of 1, 369-387 -> 328-345 ns, of 4, 553-561 -> 505-528;
// values at a group of 1, 263-290 -> 202-203. hex3@int8 decode over 32K
// tokens, 5 interleaved rounds: 1.79-1.84 -> 1.67-1.69 ms at a group of 1
// (hex4@int8: 1.63-1.73), 3.14-3.38 -> 3.07-3.13 at a group of 4.
template <int kBits, class D8>
HWY_INLINE hn::Vec<D8> IntBytes(D8 d8, const std::uint8_t* p, const Groups3<D8>& g3) {
  if constexpr (kBits == 3) {
#if HWY_TARGET == HWY_AVX3_DL
    if constexpr (hn::MaxLanes(d8) == 64) {
      (void)g3;
      const __m512i x = _mm512_permutexvar_epi32(_mm512_load_si512(kMultishift3.words), _mm512_loadu_si512(p));
      return hn::Vec<D8>{_mm512_multishift_epi64_epi8(_mm512_load_si512(kMultishift3.pairs), x)};
    } else if constexpr (hn::MaxLanes(d8) == 32) {
      (void)g3;
      const auto* words = reinterpret_cast<const __m256i*>(kMultishift3.words);
      const auto* pairs = reinterpret_cast<const __m256i*>(kMultishift3.pairs);
      const __m256i x =
          _mm256_permutexvar_epi32(_mm256_load_si256(words), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      return hn::Vec<D8>{_mm256_multishift_epi64_epi8(_mm256_load_si256(pairs), x)};
    }
#endif
    return hn::BitCast(d8, Widen3ToPairs(LoadGroups3(typename Groups3<D8>::DG(), p, g3.perm, g3.shuffle)));
  } else {
    (void)g3;
    return hn::LoadU(d8, p);
  }
}
#endif

// Sums of the lanes of four int32 vectors at once (rows r0..r3 of one
// query): two rounds of interleaving leave row (lane mod 4) in every lane
// -- with either meaning of InterleaveLower (per 128-bit block on x86 and
// NEON, whole vector on SVE) -- and the lanes of each row are then added.
template <class D32>
HWY_INLINE void SumOfLanes4(D32 d32, hn::Vec<D32> t0, hn::Vec<D32> t1, hn::Vec<D32> t2, hn::Vec<D32> t3,
                            std::int32_t* out4) {
  const hn::Repartition<std::uint64_t, D32> d64;
  const auto x01 = hn::Add(hn::InterleaveLower(d32, t0, t1), hn::InterleaveUpper(d32, t0, t1));
  const auto x23 = hn::Add(hn::InterleaveLower(d32, t2, t3), hn::InterleaveUpper(d32, t2, t3));
  const auto a = hn::BitCast(d64, x01), b = hn::BitCast(d64, x23);
  // (Added as int32 lanes: a 64-bit add would carry between rows.)
  const auto y =
      hn::Add(hn::BitCast(d32, hn::InterleaveLower(d64, a, b)), hn::BitCast(d32, hn::InterleaveUpper(d64, a, b)));
  HWY_ALIGN std::int32_t lanes[hn::MaxLanes(d32)];
  hn::Store(y, d32, lanes);
  const auto n = static_cast<std::int64_t>(hn::Lanes(d32));
  std::int32_t s[4] = {0, 0, 0, 0};
  for (std::int64_t l = 0; l < n; ++l) s[l & 3] += lanes[l];
  for (int r = 0; r < 4; ++r) out4[r] = s[r];
}

// The int32 sums of a query's weights: one limb as it is, two limbs as
// 128 hi + lo.
template <int kL, class V>
HWY_INLINE V MergeLimbs(V h, V l) {
  if constexpr (kL == 1) return h;
  return hn::Add(hn::ShiftLeft<7>(h), l);
}

#endif  // HWY_TARGET != HWY_SCALAR

// Whether the integer kernels read 3-bit rows in place (IntBytes) for one
// query with kL limbs of weights: the unrolled kernels of fixed-size
// targets, one limb. There, the value kernel reads the rows of GQA groups
// widened to two codes per byte (kWide3) a chunk at a time; otherwise the
// rows are widened to 4-bit rows and read by the 4-bit kernels. (In place,
// each kernel reads a block's codes once, widening them on the way: 6-7%
// less time than widening first at one query on AVX2. For groups it costs
// more: the value kernel passes over the codes once per quarter of its
// transposed vectors, widening them each time, and the widening's constants
// push the score sums out of 16 registers: with AVX-512's 32, the score
// kernel reads groups' rows in place too, see ScoresIntPer, and with VBMI
// the value kernel as well, see AccumulateIntPer. Widening to
// pairs takes two shifts and two blends per vector of groups, to 4-bit rows
// three more operations: with a group of 4 on a Zen 3 core, 7% less time
// for the value kernel, but 12% more for the score kernel, which stays on
// 4-bit rows there.)
template <int kL>
constexpr bool Fused3() {
#if !HWY_HAVE_SCALABLE && KVCAL_ROW_KERNELS && HWY_TARGET != HWY_SCALAR
  return kL == 1;
#else
  return false;
#endif
}

// The widest vector of bytes that divides a run (runs are multiples of 16),
// and the kernel for kL limbs there; false where none does.
template <class F>
bool WithIntVector(std::int64_t run, int limbs, const F& f) {
#if HWY_TARGET != HWY_SCALAR
  const auto with = [&](auto d8) {
    if (run % static_cast<std::int64_t>(hn::Lanes(d8)) != 0) return false;
    if (limbs == 1)
      f(d8, std::integral_constant<int, 1>());
    else
      f(d8, std::integral_constant<int, 2>());
    return true;
  };
  if (with(hn::ScalableTag<std::uint8_t>())) return true;
#if HWY_TARGET != HWY_SVE && HWY_TARGET != HWY_SVE2 && HWY_TARGET != HWY_SVE_256 && HWY_TARGET != HWY_SVE2_128
  if (with(hn::CappedTag<std::uint8_t, 32>())) return true;
  if (with(hn::CappedTag<std::uint8_t, 16>())) return true;
#endif
#else
  (void)run, (void)limbs, (void)f;
#endif
  return false;
}

// f(d8, kl, run) for the integer kernels of rows of `bits`-bit codes and dim
// channels (run: their slot run), where their layout and a vector width
// serve them (int_dot_layout, WithIntVector); false where not (the caller
// takes the reference).
template <class F>
bool WithIntKernel(int bits, std::int64_t dim, int limbs, const F& f) {
  if (!int_dot_layout(bits, dim)) return false;
  const std::int64_t run = int_slots(bits, dim).run;
  return WithIntVector(run, limbs, [&](auto d8, auto kl) { f(d8, kl, run); });
}

}  // namespace KVCAL_KERNEL_NS
}  // namespace kvcal::runtime::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
