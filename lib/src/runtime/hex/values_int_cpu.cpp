// The HEX integer value kernels (code_accumulate_int and its scaled and
// tiled forms: kernels_cpu.h), compiled once per SIMD target as
// kernels_cpu.cpp is, and once more in each VPDPBUSD pass (AVX-VNNI, AVX-512
// VNNI: avxvnni_pass.h). A file of their own for build time, as the score
// kernels (scores_int_cpu.cpp) have: their unrolled bodies took most of
// kernels_cpu.cpp's compile time, the longest step of a cold build, and the
// three files build in parallel. Also here: which VPDPBUSD passes the CPU
// runs (vnni_kernels), as this file and scores_int_cpu.cpp compile them.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1  // as kernels_cpu.cpp: the same targets in every file
#endif
#include <algorithm>
#include <atomic>
#include <cassert>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>  // __get_cpuid_count (AVX-VNNI, AVX-512 VNNI)
#endif

#include "runtime/hex/kernels_cpu.h"

// The kernels' namespace: Highway's per-target one, except in the extra
// passes for VPDPBUSD (avxvnni_pass.h, at the end), which compile them once
// more for AVX2 into N_AVX2_VNNI (AVX-VNNI) and for AVX3 into N_AVX3_VNNI
// (AVX-512 VNNI), with Highway's AVX2 and AVX3 operations.
#undef KVCAL_KERNEL_NS
#ifdef KVCAL_VNNI512_PASS
#define KVCAL_KERNEL_NS N_AVX3_VNNI
#elif defined(KVCAL_AVXVNNI_PASS)
#define KVCAL_KERNEL_NS N_AVX2_VNNI
#else
#define KVCAL_KERNEL_NS HWY_NAMESPACE
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/hex/values_int_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#endif
#include "runtime/hex/kernels_cpu-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvcal::runtime::detail {
namespace KVCAL_KERNEL_NS {
#ifdef KVCAL_VNNI512_PASS
static_assert(HWY_TARGET == HWY_AVX3, "the AVX-512 VNNI kernels are the AVX3 target's");
namespace hn = hwy::N_AVX3;  // and so are its operations (set_macros-inl.h made HWY_NAMESPACE that)
#elif defined(KVCAL_AVXVNNI_PASS)
static_assert(HWY_TARGET == HWY_AVX2, "the AVX-VNNI kernels are the AVX2 target's");
namespace hn = hwy::N_AVX2;  // and so are its operations (set_macros-inl.h made HWY_NAMESPACE that)
#else
namespace hn = hwy::HWY_NAMESPACE;
#endif

// Whether this target's value kernels read 3-bit value tiles of rows of dim
// channels with `limbs` limbs of weights (see value_tiles_layout): in
// vectors of D8 (the one WithIntKernel picks), with VBMI (Tile3Bytes) and
// one limb, the rows' widened last group within kIntWide3Bytes.
template <int kL, class D8>
constexpr bool ValueTiles3Kernel(D8 d8, std::int64_t run) {
  return Fused3<kL>() && VbmiRead3(d8) && 4 * run <= kIntWide3Bytes;
}
bool ValueTiles3(int limbs, std::int64_t dim) {
  bool ok = false;
  WithIntKernel(3, dim, limbs,
                [&](auto d8, auto kl, std::int64_t run) { ok = ValueTiles3Kernel<decltype(kl)::value>(d8, run); });
  return ok;
}

#if HWY_TARGET != HWY_SCALAR
// Integer value accumulation over phase-split rows:
//   acc_j[slot] += sum_r w_j[r] * code_r(slot)
// (w8 + j * w8_stride holds w for every row, or with two limbs hi for every
// row, then lo: w = 128 hi + lo). Four rows at a time,
// their bytes are transposed in registers (two rounds of interleaving) so
// that each int32 lane holds one byte position of the four rows, which one
// VPDPBUSD (or its equivalent) multiplies by the four rows' weights.
template <class D8>
struct Transpose4 {
  using D32 = hn::Repartition<std::int32_t, D8>;
  // perm[m * N32 + l]: the byte position lane l of transposed vector m holds
  // (found once by transposing rows of position numbers).
  std::int64_t perm[4 * hn::MaxLanes(D32())];
  static HWY_INLINE hn::Vec<D8> Apply(D8 d8, hn::Vec<D8> a, hn::Vec<D8> b, hn::Vec<D8> c, hn::Vec<D8> d, int m) {
    const hn::Repartition<std::uint16_t, D8> d16;
    const auto ab = BitCast(d16, (m < 2) ? hn::InterleaveLower(d8, a, b) : hn::InterleaveUpper(d8, a, b));
    const auto cd = BitCast(d16, (m < 2) ? hn::InterleaveLower(d8, c, d) : hn::InterleaveUpper(d8, c, d));
    return hn::BitCast(d8, (m % 2 == 0) ? hn::InterleaveLower(d16, ab, cd) : hn::InterleaveUpper(d16, ab, cd));
  }
  explicit Transpose4(D8 d8) {
    const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
    const auto N32 = static_cast<std::int64_t>(hn::Lanes(D32()));
    HWY_ALIGN std::uint8_t pos[hn::MaxLanes(d8)];
    HWY_ALIGN std::uint8_t tp[hn::MaxLanes(d8)];
    for (std::int64_t l = 0; l < N; ++l) pos[l] = static_cast<std::uint8_t>(l);
    const auto p = hn::Load(d8, pos);
    for (int m = 0; m < 4; ++m) {
      hn::Store(Apply(d8, p, p, p, p, m), d8, tp);
      for (std::int64_t l = 0; l < N32; ++l) perm[m * N32 + l] = tp[4 * l];
    }
  }
};

// The int8 weights of rows r .. r + 3 (zero past the last row) in every
// 32-bit lane.
template <class D8>
HWY_INLINE hn::Vec<hn::Repartition<std::int8_t, D8>> Weights4(D8, const std::int8_t* w, std::int64_t r,
                                                              std::int64_t rows) {
  const hn::Repartition<std::int32_t, D8> d32;
  std::uint32_t x = 0;
  if (r + 4 <= rows) {
    std::memcpy(&x, w + r, 4);  // little-endian: row r + k in byte k
  } else {
    for (std::int64_t k = 0; r + k < rows; ++k)
      x |= static_cast<std::uint32_t>(static_cast<std::uint8_t>(w[r + k])) << (8 * k);
  }
  return hn::BitCast(hn::Repartition<std::int8_t, D8>(), hn::Set(d32, static_cast<std::int32_t>(x)));
}

// The four rows of bytes at `base` (stride `stride`) from r on, the last
// group (rows % 4) copied next to zero rows in pad.
template <class D8>
HWY_INLINE const std::uint8_t* RowGroup(D8 d8, const std::uint8_t* base, std::int64_t r, std::int64_t rows,
                                        std::int64_t& stride, std::uint8_t* pad) {
  if (r + 4 <= rows) return base;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
  std::memset(pad, 0, static_cast<std::size_t>(4 * N));
  for (std::int64_t k = 0; r + k < rows; ++k) std::memcpy(pad + k * N, base + k * stride, static_cast<std::size_t>(N));
  stride = N;
  return pad;
}

// Value tiles (kernels_cpu.h): the vector of the group of four rows from
// row r (a multiple of 4) at byte column col -- byte col + x of row r + k in
// byte k of 32-bit lane x, for N / 4 columns -- loaded as it is stored for a
// whole group; for the last group, the rows % 4 rows that stay rows, put
// together from their bytes (zero bytes for the rows missing).
template <class D8>
HWY_INLINE hn::Vec<D8> TileGroup(D8 d8, const std::uint8_t* codes, std::int64_t r, std::int64_t rows,
                                 std::int64_t row_bytes, std::int64_t col) {
  const std::uint8_t* g = codes + r * row_bytes;
  if (r + 4 <= rows) return hn::LoadU(d8, g + 4 * col);
  const hn::Repartition<std::uint32_t, D8> du32;
  const hn::Rebind<std::uint8_t, decltype(du32)> dq;
  auto v = hn::Zero(du32);
  for (std::int64_t k = 0; r + k < rows; ++k)
    v = hn::Or(v,
               hn::ShiftLeftSame(hn::PromoteTo(du32, hn::LoadU(dq, g + k * row_bytes + col)), static_cast<int>(8 * k)));
  return hn::BitCast(d8, v);
}

// acc[pm[x]] += (the merged limbs)[x] for every lane x.
template <int kL, class D32>
HWY_INLINE void FlushLimbs(D32 d32, hn::Vec<D32> h, hn::Vec<D32> l, const std::int64_t* pm, std::int32_t* acc) {
  HWY_ALIGN std::int32_t lanes[hn::MaxLanes(d32)];
  hn::Store(MergeLimbs<kL>(h, l), d32, lanes);
  for (std::size_t x = 0; x < hn::Lanes(d32); ++x) acc[pm[x]] += lanes[x];
}

// Where the value kernels put their sums: int32 rows (acc, for
// code_accumulate_int: exact) or, where fs is set, ws[j] * sum added to float
// rows (fs, for code_accumulate_int_scaled: the decode then has no int32 rows
// to clear before the kernel and no pass to scale them after it). One type
// for both, the choice made per flush, outside the row loops: a sink type per
// choice would instantiate every kernel twice (AccumulateIntQ, the heaviest,
// tripled this file's compile time so). Query(j) is query j's rows;
// FlushLanes adds lane x at pm[x], FlushBlocks (AccumulateIntQ's transposed
// layout, see FlushTransposed) lane e of 128-bit block k of transposed vector
// m at 16 k + 4 m + e.
struct Sums {
  std::int32_t* acc;    // int32 rows, or null
  float* fs;            // float rows, or null
  const float* ws;      // the scales of fs's rows, one per query
  std::int64_t stride;  // between queries' rows
  Sums Query(std::int64_t j) const {
    return fs ? Sums{nullptr, fs + j * stride, ws + j, stride} : Sums{acc + j * stride, nullptr, nullptr, stride};
  }
  // The merged limbs times ws[j], as floats.
  template <int kL, class D32>
  HWY_INLINE void Scaled(D32 /*d32*/, hn::Vec<D32> h, hn::Vec<D32> l, std::int64_t j, float* lanes) const {
    const hn::Rebind<float, D32> df;
    hn::Store(hn::Mul(hn::Set(df, ws[j]), hn::ConvertTo(df, MergeLimbs<kL>(h, l))), df, lanes);
  }
  template <int kL, class D32>
  HWY_INLINE void FlushLanes(D32 d32, hn::Vec<D32> h, hn::Vec<D32> l, const std::int64_t* pm, std::int64_t j,
                             std::int64_t at) const {
    if (!fs) return FlushLimbs<kL>(d32, h, l, pm, acc + j * stride + at);
    HWY_ALIGN float lanes[hn::MaxLanes(d32)];
    Scaled<kL>(d32, h, l, j, lanes);
    float* a = fs + j * stride + at;
    for (std::size_t x = 0; x < hn::Lanes(d32); ++x) a[pm[x]] += lanes[x];
  }
  template <int kL, class D32>
  HWY_INLINE void FlushBlocks(D32 d32, hn::Vec<D32> h, hn::Vec<D32> l, int m, std::int64_t j, std::int64_t at) const;
  // Lane x at at + x (the value tiles' kernels, whose lanes are in slot
  // order).
  template <int kL, class D32>
  HWY_INLINE void FlushRun(D32 d32, hn::Vec<D32> h, hn::Vec<D32> l, std::int64_t j, std::int64_t at) const {
    if (!fs) {
      std::int32_t* a = acc + j * stride + at;
      hn::StoreU(hn::Add(hn::LoadU(d32, a), MergeLimbs<kL>(h, l)), d32, a);
      return;
    }
    const hn::Rebind<float, D32> df;
    float* a = fs + j * stride + at;
    hn::StoreU(hn::MulAdd(hn::Set(df, ws[j]), hn::ConvertTo(df, MergeLimbs<kL>(h, l)), hn::LoadU(df, a)), df, a);
  }
};

#if HWY_HAVE_SCALABLE || !KVCAL_ROW_KERNELS
// One query at a time (named accumulators: scalable vectors form no arrays);
// kM of the four transposed vectors per pass over the rows. Also what the
// sanitizer builds run on fixed-size targets: AccumulateIntQ's unrolled
// arrays of vectors, instrumented, take the compiler tens of minutes (see
// KVCAL_ROW_KERNELS; valgrind checks that kernel in the Release build).
// kTiled: the rows stored as value tiles (TileGroup), no transposition.
template <int kPer, int kM, int kL, bool kTiled, class D8>
void AccumulateInt(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                   const std::int8_t* w8, std::int64_t limb_stride, const Sums& out) {
  constexpr int kBits = 8 / kPer;
  const hn::Repartition<std::int32_t, D8> d32;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
  const auto N32 = static_cast<std::int64_t>(hn::Lanes(d32));
  const Transpose4<D8> tr(d8);
  HWY_ALIGN std::uint8_t pad[4 * hn::MaxLanes(d8)];
  std::int64_t ident[hn::MaxLanes(d32)];  // tiles: lane x to slot x
  for (std::int64_t x = 0; x < N32; ++x) ident[x] = x;
  for (std::int64_t i = 0; i < run; i += N) {
    for (int m0 = 0; m0 < 4; m0 += kM) {
      // Accumulators: phase k, transposed vector m0 + mm, limb.
      auto a00 = hn::Zero(d32), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
      auto b00 = a00, b01 = a00, b02 = a00, b03 = a00, b10 = a00, b11 = a00, b12 = a00, b13 = a00;
      for (std::int64_t r = 0; r < rows; r += 4) {
        const auto wh = Weights4(d8, w8, r, rows), wl = Weights4(d8, w8 + (kL - 1) * limb_stride, r, rows);
        const auto one = [&](hn::Vec<D8> t, auto& h0, auto& h1, auto& h2, auto& h3, auto& l0, auto& l1, auto& l2,
                             auto& l3) {
          const auto ph = [&](auto c, auto& h, auto& l) {
            h = DotBytes(d8, c, wh, h);
            if constexpr (kL == 2) l = DotBytes(d8, c, wl, l);
          };
          ph(PhaseBytes<kBits, 0>(d8, t), h0, l0);
          if constexpr (kPer >= 2) ph(PhaseBytes<kBits, 1>(d8, t), h1, l1);
          if constexpr (kPer == 4) {
            ph(PhaseBytes<kBits, 2>(d8, t), h2, l2);
            ph(PhaseBytes<kBits, 3>(d8, t), h3, l3);
          }
        };
        if constexpr (kTiled) {
          one(TileGroup(d8, codes, r, rows, row_bytes, i + m0 * N32), a00, a01, a02, a03, b00, b01, b02, b03);
          if constexpr (kM > 1)
            one(TileGroup(d8, codes, r, rows, row_bytes, i + (m0 + 1) * N32), a10, a11, a12, a13, b10, b11, b12, b13);
        } else {
          std::int64_t stride = row_bytes;
          const std::uint8_t* base = RowGroup(d8, codes + r * row_bytes + i, r, rows, stride, pad);
          const auto r0 = hn::LoadU(d8, base), r1 = hn::LoadU(d8, base + stride);
          const auto r2 = hn::LoadU(d8, base + 2 * stride), r3 = hn::LoadU(d8, base + 3 * stride);
          one(Transpose4<D8>::Apply(d8, r0, r1, r2, r3, m0), a00, a01, a02, a03, b00, b01, b02, b03);
          if constexpr (kM > 1)
            one(Transpose4<D8>::Apply(d8, r0, r1, r2, r3, m0 + 1), a10, a11, a12, a13, b10, b11, b12, b13);
        }
      }
      const auto flush = [&](int mm, int k, auto h, auto l) {
        // (Tiles: lane x at x, added as the rows' lanes are, so that the
        // sums round alike.)
        out.template FlushLanes<kL>(d32, h, l, kTiled ? ident : tr.perm + (m0 + mm) * N32, 0,
                                    k * run + i + (kTiled ? (m0 + mm) * N32 : 0));
      };
      flush(0, 0, a00, b00);
      if constexpr (kPer >= 2) flush(0, 1, a01, b01);
      if constexpr (kPer == 4) flush(0, 2, a02, b02), flush(0, 3, a03, b03);
      if constexpr (kM > 1) {
        flush(1, 0, a10, b10);
        if constexpr (kPer >= 2) flush(1, 1, a11, b11);
        if constexpr (kPer == 4) flush(1, 2, a12, b12), flush(1, 3, a13, b13);
      }
    }
  }
}
#else
// acc[16 k + 4 m + e] += (the merged limbs)[4 k + e] for every 128-bit block
// k of transposed vector m and e < 4: where the interleaving is per 128-bit
// block (x86, NEON), lane e of block k of transposed vector m holds byte
// position 16 k + 4 m + e, so each block goes back with one 128-bit add.
template <int kL, class D32>
HWY_INLINE void FlushTransposed(D32 d32, hn::Vec<D32> h, hn::Vec<D32> l, int m, std::int32_t* acc) {
  HWY_ALIGN std::int32_t lanes[hn::MaxLanes(d32)];
  hn::Store(MergeLimbs<kL>(h, l), d32, lanes);
  const hn::FixedTag<std::int32_t, 4> d4;
  for (std::size_t k = 0; k < hn::Lanes(d32) / 4; ++k) {
    std::int32_t* a = acc + 16 * k + 4 * static_cast<std::size_t>(m);
    hn::StoreU(hn::Add(hn::LoadU(d4, a), hn::Load(d4, lanes + 4 * k)), d4, a);
  }
}
template <int kL, class D32>
HWY_INLINE void Sums::FlushBlocks(D32 d32, hn::Vec<D32> h, hn::Vec<D32> l, int m, std::int64_t j,
                                  std::int64_t at) const {
  if (!fs) return FlushTransposed<kL>(d32, h, l, m, acc + j * stride + at);
  // fs += ws[j] * sum as FlushRun computes it (one multiply-add: one
  // rounding where the target fuses them), so that rows and value tiles give
  // the same floats.
  const hn::Rebind<float, D32> df;
  HWY_ALIGN float lanes[hn::MaxLanes(d32)];
  hn::Store(hn::ConvertTo(df, MergeLimbs<kL>(h, l)), df, lanes);
  const hn::FixedTag<float, 4> d4;
  const auto w = hn::Set(d4, ws[j]);
  for (std::size_t k = 0; k < hn::Lanes(d32) / 4; ++k) {
    float* a = fs + j * stride + 16 * k + 4 * static_cast<std::size_t>(m) + at;
    hn::StoreU(hn::MulAdd(w, hn::Load(d4, lanes + 4 * k), hn::LoadU(d4, a)), d4, a);
  }
}

// kQ queries of a GQA group share each load and transposition of the codes,
// kM of the four transposed vectors per pass over the rows (kM kL kQ kPer
// accumulators in registers). The lo limbs of the rows' weights are
// limb_stride after their hi limbs. 3-bit rows (kBits = 3) are read in place
// (IntBytes) but for the last group of four rows, which holds the block's
// last row: those rows are widened to 4-bit rows first (4 run <= kIntWide3Bytes).
// far: the requests far_bytes_by_bits ahead (PrefetchFar); false for rows widened
// into a chunk (see WidenedChunks3). kTiled: the rows stored as value tiles,
// whose vectors (TileGroup; 3 bits, Tile3Bytes) are in slot order, so
// neither transposed nor put back in order when flushed; 3-bit tiles only
// where VbmiRead3, their rows after the last whole group (rows % 4, which
// stay rows) widened to 4-bit rows as the rows' last group is.
template <int kBits, int kQ, int kL, bool kTiled, class D8>
KVCAL_FLATTEN void AccumulateIntQ(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes,
                                  std::int64_t run, const std::int8_t* w8, std::int64_t limb_stride,
                                  std::int64_t w8_stride, const Sums& out, bool far = true) {
  static_assert(!kTiled || kBits == 2 || kBits == 4 || (kBits == 3 && VbmiRead3(D8())),
                "value tiles of 2- and 4-bit codes, of 3-bit codes where VBMI reads them");
  constexpr int kPer = IntPhases(kBits), kX = kQ * kPer;
  constexpr int kFit = kAccVectors / (kL * kX);
  constexpr int kM = kFit >= 4 ? 4 : kFit >= 2 ? 2 : 1;
  const std::int64_t ahead = near_rows_values;  // rows requested ahead of the first pass (prefetch.cpp)
  const hn::Repartition<std::int32_t, D8> d32;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
  const auto N32 = static_cast<std::int64_t>(hn::Lanes(d32));
#ifndef NDEBUG
  {  // the layout FlushTransposed relies on
    const Transpose4<D8> tr(d8);
    for (std::int64_t x = 0; x < 4 * static_cast<std::int64_t>(hn::Lanes(d32)); ++x)
      assert(tr.perm[x] == 16 * ((x % static_cast<std::int64_t>(hn::Lanes(d32))) / 4) +
                               4 * (x / static_cast<std::int64_t>(hn::Lanes(d32))) + x % 4);
  }
#endif
  // The phases' codes masked in place (kMaskedPhases), summed at the scale
  // 2^(k kSp) for phase k: kSp the code width of the rows, 3 for 3-bit rows
  // however they are read (their last group widened to 4 bits included).
  constexpr bool kMasked = kMaskedPhases && !kPairTarget;
  constexpr int kSp = CodeBits(kBits);
  // Rows per accumulation in registers: int16, one pair sum per group of
  // four rows; masked phases, where a group adds at most 4 * 240 * 128 to a
  // lane, 2^16 rows (2^14 groups) stay below 2^31.
  const std::int64_t span = kPairTarget ? 4 * kPairSums : kMasked ? std::min<std::int64_t>(rows, 65536) : rows;
  const AccTag<kPairTarget, D8> da;
  [[maybe_unused]] HWY_ALIGN std::uint8_t pad[4 * hn::MaxLanes(d8)];  // 2 and 4 bits
  const Groups3<D8> g3;
  // Rows [0, direct) are read in place; 3 bits: the rows from direct on,
  // widened (and zero rows up to four). (3-bit tiles: every whole group, read
  // with masked loads.)
  const std::int64_t direct = kBits != 3 ? rows : kTiled ? rows / 4 * 4 : (rows - 1) / 4 * 4;
  HWY_ALIGN std::uint8_t tail3[kBits == 3 ? kIntWide3Bytes : 1];
  if constexpr (kBits == 3) {
    assert(4 * run <= kIntWide3Bytes);
    std::memset(tail3, 0, static_cast<std::size_t>(4 * run));
    WidenRows3<false>(codes + direct * row_bytes, rows - direct, row_bytes, 2 * run, tail3);
  }
  for (std::int64_t i = 0; i < run; i += N) {
    const std::int64_t at = IntOffset<kBits>(i);  // where vector i of a row is read from
    // Line k < 4 of this i's bytes of the group of four rows from r: a row's
    // vector, or a vector of the group's tile (3 bits: its 3N / 4 bytes).
    const auto line = [&](std::int64_t r, std::int64_t k) {
      return kTiled ? codes + r * row_bytes + 4 * at + k * (kBits == 3 ? 3 * N / 4 : N)
                    : codes + (r + k) * row_bytes + at;
    };
    for (std::int64_t r = 0; r < std::min(rows, ahead); r += 4)
      for (int k = 0; k < 4; ++k) __builtin_prefetch(line(r, k), 0, 3);
    // The transposed vectors a pass covers, fixed at compile time (the
    // interleavings of Transpose4::Apply chosen without a branch).
    Unroll<4 / kM>([&](auto mi) KVCAL_INLINE_LAMBDA {
      constexpr int m0 = decltype(mi)::value * kM;
      // The int32 sums, [transposed vector][query][phase] for each limb, in
      // memory: held in registers across the row loop they would push the
      // int16 sums of its inner loop onto the stack.
      HWY_ALIGN std::int32_t hs[kM * kX * hn::MaxLanes(d32)], ls[kM * kX * hn::MaxLanes(d32)];
      Unroll<kM * kX>([&](auto x) {
        hn::Store(hn::Zero(d32), d32, hs + x * N32);
        if constexpr (kL == 2) hn::Store(hn::Zero(d32), d32, ls + x * N32);
      });
      for (std::int64_t r0 = 0; r0 < rows; r0 += span) {
        hn::Vec<decltype(da)> ha[kM * kX], la[kM * kX];  // the same, for rows r0 .. r0 + span - 1
        Unroll<kM * kX>([&](auto x) { ha[x] = la[x] = hn::Zero(da); });
        // One group of four rows of kB-bit codes, its vector m0 + mm from
        // vec(mm), their weights from weights(w) for a query's limb of
        // weights w.
        const auto dots = [&](auto vec, auto weights, auto bits_c) KVCAL_INLINE_LAMBDA {
          constexpr int kB = decltype(bits_c)::value;
          Unroll<kM>([&](auto mm) KVCAL_INLINE_LAMBDA {
            const hn::Vec<D8> t = vec(mm);
            hn::Vec<D8> ph[kPer];
            Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA { ph[k] = KernelPhaseBytes<kMasked, kB, k, kSp>(d8, t); });
            Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
              constexpr int x0 = (decltype(mm)::value * kQ + decltype(j)::value) * kPer;
              const std::int8_t* wj = w8 + j * w8_stride;
              auto wh = weights(wj);
              KVCAL_PIN(wh);  // each query's weights where they are used (see KVCAL_PIN)
              Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA {
                ha[x0 + k] = DotAcc<kPairTarget>(d8, ph[k], wh, ha[x0 + k]);
                KVCAL_PIN(ha[x0 + k]);
              });
              if constexpr (kL == 2) {
                const auto wl = weights(wj + limb_stride);
                Unroll<kPer>([&](auto k)
                                 KVCAL_INLINE_LAMBDA { la[x0 + k] = DotAcc<kPairTarget>(d8, ph[k], wl, la[x0 + k]); });
              }
            });
          });
        };
        // The same for rows at base, stride apart, transposed.
        const auto group = [&](const std::uint8_t* base, std::int64_t stride, auto weights,
                               auto bits_c) KVCAL_INLINE_LAMBDA {
          constexpr int kB = decltype(bits_c)::value;
          const auto c0 = IntBytes<kB>(d8, base, g3), c1 = IntBytes<kB>(d8, base + stride, g3);
          const auto c2 = IntBytes<kB>(d8, base + 2 * stride, g3), c3 = IntBytes<kB>(d8, base + 3 * stride, g3);
          dots([&](auto mm)
                   KVCAL_INLINE_LAMBDA { return Transpose4<D8>::Apply(d8, c0, c1, c2, c3, m0 + decltype(mm)::value); },
               weights, bits_c);
        };
        const std::int64_t r1 = std::min(rows, r0 + span);
        std::int64_t r = r0;
        for (; r + 4 <= std::min(r1, direct); r += 4) {  // whole groups: no padding, four weights in one load
          if (m0 == 0) {                                 // the first pass streams the rows in; past the end is harmless
            for (int k = 0; k < 4; ++k) __builtin_prefetch(line(r + ahead, k), 0, 3);
            if (far && i == 0) PrefetchFar<kBits>(codes + r * row_bytes, 4 * row_bytes);
          }
          const auto weights = [&](const std::int8_t* w) KVCAL_INLINE_LAMBDA { return Weights4(d8, w, r, r + 4); };
          if constexpr (kTiled)
            dots(
                [&](auto mm) KVCAL_INLINE_LAMBDA {
                  const std::uint8_t* p = line(r, m0 + decltype(mm)::value);
#if HWY_TARGET == HWY_AVX3_DL
                  if constexpr (kBits == 3) return Tile3Bytes(d8, p);
#endif
                  return hn::LoadU(d8, p);
                },
                weights, std::integral_constant<int, kBits>());
          else
            group(codes + r * row_bytes + at, row_bytes, weights, std::integral_constant<int, kBits>());
        }
        if (r < r1) {  // the last rows, next to zero rows
          const auto weights = [&](const std::int8_t* w) { return Weights4(d8, w, r, rows); };
          if constexpr (kTiled && kBits == 3) {  // the rows left, widened to 4-bit rows
            dots(
                [&](auto mm) {
                  return TileGroup(d8, tail3, 0, rows - direct, run, i + (m0 + decltype(mm)::value) * N32);
                },
                weights, std::integral_constant<int, 4>());
          } else if constexpr (kTiled) {
            dots(
                [&](auto mm) {
                  return TileGroup(d8, codes, r, rows, row_bytes, at + (m0 + decltype(mm)::value) * N32);
                },
                weights, std::integral_constant<int, kBits>());
          } else if constexpr (kBits == 3) {
            group(tail3 + i, run, weights, std::integral_constant<int, 4>());
          } else {
            std::int64_t stride = row_bytes;
            const std::uint8_t* base = RowGroup(d8, codes + r * row_bytes + i, r, rows, stride, pad);
            group(base, stride, weights, std::integral_constant<int, kBits>());
          }
        }
        Unroll<kM * kX>([&](auto x) {
          constexpr int k = decltype(x)::value % kPer;  // the phase
          hn::Store(AddAcc<kPairTarget>(d8, PhaseScaled<kMasked, k, kSp>(ha[x]), hn::Load(d32, hs + x * N32)), d32,
                    hs + x * N32);
          if constexpr (kL == 2)
            hn::Store(AddAcc<kPairTarget>(d8, PhaseScaled<kMasked, k, kSp>(la[x]), hn::Load(d32, ls + x * N32)), d32,
                      ls + x * N32);
        });
      }
      Unroll<kM * kX>([&](auto x) {
        constexpr int mm = decltype(x)::value / kX, q = decltype(x)::value % kX;
        const auto h = hn::Load(d32, hs + x * N32), l = kL == 2 ? hn::Load(d32, ls + x * N32) : h;
        if constexpr (kTiled)
          out.template FlushRun<kL>(d32, h, l, q / kPer, q % kPer * run + i + (m0 + mm) * N32);
        else
          out.template FlushBlocks<kL>(d32, h, l, m0 + mm, q / kPer, q % kPer * run + i);
      });
    });
  }
}
#endif

// tiled: the rows stored as value tiles (3 bits: where ValueTiles3Kernel).
template <int kL, class D8>
void AccumulateIntPer(D8 d8, int bits, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes,
                      std::int64_t run, const std::int8_t* w8, std::int64_t limb_stride, std::int64_t nq,
                      std::int64_t w8_stride, const Sums& out, bool tiled, [[maybe_unused]] bool far = true) {
  if (bits == 3) {
#if !HWY_HAVE_SCALABLE && KVCAL_ROW_KERNELS
    if constexpr (ValueTiles3Kernel<kL>(D8(), 0)) {
      if (tiled) {
        assert(ValueTiles3Kernel<kL>(d8, run));
        InGroupsOf4(nq, [&](auto kq, std::int64_t j) {
          AccumulateIntQ<3, decltype(kq)::value, kL, true>(d8, codes, rows, row_bytes, run, w8 + j * w8_stride,
                                                           limb_stride, w8_stride, out.Query(j));
        });
        return;
      }
    }
#endif
    assert(!tiled);
#if !HWY_HAVE_SCALABLE && KVCAL_ROW_KERNELS
    if constexpr (Fused3<kL>()) {
      if (4 * run <= kIntWide3Bytes) {  // its last four rows' widened copy fits
        if (nq == 1)
          return AccumulateIntQ<3, 1, kL, false>(d8, codes, rows, row_bytes, run, w8, limb_stride, w8_stride, out);
        // Groups too where the read is VBMI's two shuffles (IntBytes): the
        // value kernel then widens the codes once per pass, on the shuffle
        // port, instead of storing and reloading them widened. hex3@int8
        // decode at a group of 4 on an Intel AVX3_DL guest, 5 interleaved
        // rounds: 3-4% less time (as well as the VBMI read's 2-3%).
        if constexpr (VbmiRead3(D8())) {
          InGroupsOf4(nq, [&](auto kq, std::int64_t j) {
            AccumulateIntQ<3, decltype(kq)::value, kL, false>(d8, codes, rows, row_bytes, run, w8 + j * w8_stride,
                                                              limb_stride, w8_stride, out.Query(j));
          });
          return;
        }
      }
      WidenedChunks3<true, true>(
          codes, rows, row_bytes, 2 * run, [&](const std::uint8_t* wide, std::int64_t n, std::int64_t r0) {
            InGroupsOf4(nq, [&](auto kq, std::int64_t j) {
              AccumulateIntQ<kWide3, decltype(kq)::value, kL, false>(d8, wide, n, run, run, w8 + j * w8_stride + r0,
                                                                     limb_stride, w8_stride, out.Query(j), false);
            });
          });
      return;
    }
#endif
    WidenedChunks3<false, true>(
        codes, rows, row_bytes, 2 * run, [&](const std::uint8_t* wide, std::int64_t n, std::int64_t r0) {
          AccumulateIntPer<kL>(d8, 4, wide, n, run, run, w8 + r0, limb_stride, nq, w8_stride, out, false, false);
        });
    return;
  }
#if HWY_HAVE_SCALABLE || !KVCAL_ROW_KERNELS
  const auto one = [&](auto per_c, auto tiled_c) {
    for (std::int64_t j = 0; j < nq; ++j)
      AccumulateInt<decltype(per_c)::value, 2, kL, decltype(tiled_c)::value>(
          d8, codes, rows, row_bytes, run, w8 + j * w8_stride, limb_stride, out.Query(j));
  };
  const auto per = [&](auto tiled_c) {
    if (bits == 2)
      one(std::integral_constant<int, 4>(), tiled_c);
    else
      one(std::integral_constant<int, 2>(), tiled_c);
  };
#else
  // Queries in groups whose accumulators (kL limbs per phase) fit the
  // registers; over value tiles, groups of at most four (there is no
  // transposition for larger groups to share).
  const auto groups = [&](auto bits_c, auto tiled_c) {
    constexpr int kBits = decltype(bits_c)::value;
    constexpr bool kTiled = decltype(tiled_c)::value;
    constexpr int kFitG = std::max(1, kAccVectors / (kL * IntPhases(kBits)));
    constexpr int kG = kTiled ? std::min(4, kFitG) : kFitG;
    for (std::int64_t j = 0; j < nq; j += kG) {
      const std::int8_t* wj = w8 + j * w8_stride;
      const Sums aj = out.Query(j);
      const std::int64_t g = std::min<std::int64_t>(kG, nq - j);
      Unroll<kG>([&](auto q) {
        if (q + 1 == g)
          AccumulateIntQ<kBits, q + 1, kL, kTiled>(d8, codes, rows, row_bytes, run, wj, limb_stride, w8_stride, aj,
                                                   far);
      });
    }
  };
  const auto per = [&](auto tiled_c) {
    if (bits == 2)
      groups(std::integral_constant<int, 2>(), tiled_c);
    else
      groups(std::integral_constant<int, 4>(), tiled_c);
  };
#endif
  if (tiled)
    per(std::true_type());
  else
    per(std::false_type());
}

// The value kernels into out where they take the layout (WithIntKernel);
// false where the caller runs the reference instead.
bool AccumulateIntKernel(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                         std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                         const Sums& out, bool tiled = false) {
  bool taken = false;
  WithIntKernel(bits, dim, limbs, [&](auto d8, auto kl, std::int64_t run) {
    // 3-bit tiles these kernels do not read: the reference, untiled.
    if (tiled && bits == 3 && !ValueTiles3Kernel<decltype(kl)::value>(d8, run)) return;
    AccumulateIntPer<decltype(kl)::value>(d8, bits, codes, rows, row_bytes, run, w8, rows, nq, w8_stride, out, tiled);
    taken = true;
  });
  return taken;
}
#endif  // HWY_TARGET != HWY_SCALAR

// The rows of codes stored as value tiles, back in rows (in a buffer per
// thread), for the references; codes as they are otherwise.
const std::uint8_t* RowsOf(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, bool tiled) {
  if (!tiled) return codes;
  thread_local std::vector<std::uint8_t> buf;
  buf.resize(static_cast<std::size_t>(rows * row_bytes));
  value_tiles_to_rows(codes, rows, row_bytes, buf.data());
  return buf.data();
}

void CodeAccumulateInt(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                       int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride, std::int32_t* acc,
                       std::int64_t acc_stride, bool tiled) {
#if HWY_TARGET != HWY_SCALAR
  if (AccumulateIntKernel(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride,
                          Sums{acc, nullptr, nullptr, acc_stride}, tiled))
    return;
#endif
  code_accumulate_int_reference(RowsOf(codes, rows, row_bytes, tiled), rows, row_bytes, bits, dim, limbs, w8, nq,
                                w8_stride, acc, acc_stride);
}

// See kernels_cpu.h: code_accumulate_int_scaled.
void CodeAccumulateIntScaled(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                             std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                             std::int64_t w8_stride, const float* ws, float* acc, std::int64_t acc_stride,
                             std::int32_t* scratch, bool tiled) {
#if HWY_TARGET != HWY_SCALAR
  if (AccumulateIntKernel(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride,
                          Sums{nullptr, acc, ws, acc_stride}, tiled))
    return;
#endif
  std::fill(scratch, scratch + nq * dim, 0);
  code_accumulate_int_reference(RowsOf(codes, rows, row_bytes, tiled), rows, row_bytes, bits, dim, limbs, w8, nq,
                                w8_stride, scratch, dim);
  for (std::int64_t j = 0; j < nq; ++j) axpy_int(ws[j], scratch + j * dim, acc + j * acc_stride, dim);
}

}  // namespace KVCAL_KERNEL_NS
}  // namespace kvcal::runtime::detail
HWY_AFTER_NAMESPACE();

#define KVCAL_AVXVNNI_FILE "runtime/hex/values_int_cpu.cpp"
#include "runtime/hex/avxvnni_pass.h"  // IWYU pragma: keep

#if HWY_ONCE && !defined(KVCAL_AVXVNNI_PASS)
namespace kvcal::runtime::detail {

HWY_EXPORT(CodeAccumulateInt);
HWY_EXPORT(CodeAccumulateIntScaled);
HWY_EXPORT(ValueTiles3);

namespace {
#if KVCAL_HAVE_AVXVNNI_KERNELS || KVCAL_HAVE_VNNI512_KERNELS
// Bit `bit` of register `reg` (0 = EAX, 1 = EBX, 2 = ECX, 3 = EDX) of cpuid
// leaf 7, subleaf `subleaf`.
bool cpuid7_bit(unsigned subleaf, int reg, int bit) {
  unsigned r[4] = {};
  return __get_cpuid_count(7, subleaf, &r[0], &r[1], &r[2], &r[3]) != 0 && ((r[reg] >> bit) & 1u) != 0;
}
#endif
// AVX-VNNI (VEX VPDPBUSD), for the AVX2 target's kernels.
bool cpu_has_avx_vnni() {
#if KVCAL_HAVE_AVXVNNI_KERNELS
  return cpuid7_bit(1, 0, 4);
#else
  return false;
#endif
}
// AVX512_VNNI (EVEX VPDPBUSD), for the AVX3 target's kernels: Highway runs
// AVX3 only where the CPU has AVX-512 F, VL, DQ and BW.
bool cpu_has_avx512_vnni() {
#if KVCAL_HAVE_VNNI512_KERNELS
  return cpuid7_bit(0, 2, 11);
#else
  return false;
#endif
}
// On unless the environment says KVCAL_AVX_VNNI=0 (a way to run the AVX2
// kernels on such a host, e.g. under a tool that does not know VPDPBUSD).
std::atomic<bool>& avx_vnni_allowed() {
  static std::atomic<bool> allowed{[] {
    const char* e = std::getenv("KVCAL_AVX_VNNI");
    return e == nullptr || std::strcmp(e, "0") != 0;
  }()};
  return allowed;
}
}  // namespace

bool avx_vnni_available() {
  static const bool has = cpu_has_avx_vnni();
  return has;
}
bool avx512_vnni_available() {
  static const bool has = cpu_has_avx512_vnni();
  return has;
}
bool vnni_kernels_for(std::int64_t target) {
  return (target == HWY_AVX2 && avx_vnni_available()) || (target == HWY_AVX3 && avx512_vnni_available());
}
bool set_avx_vnni(bool allow) { return avx_vnni_allowed().exchange(allow); }
VnniKernels vnni_kernels() {
  if (!avx_vnni_allowed().load(std::memory_order_relaxed)) return VnniKernels::kNone;
  const std::int64_t target = kernel_target_id();
  if (!vnni_kernels_for(target)) return VnniKernels::kNone;
  return target == HWY_AVX2 ? VnniKernels::kAvx2 : VnniKernels::kAvx3;
}
bool avx_vnni_active() { return vnni_kernels() != VnniKernels::kNone; }

bool value_tiles_layout(int bits, std::int64_t dim, int limbs) {
  if (bits == 3) return HWY_DYNAMIC_DISPATCH(ValueTiles3)(limbs, dim);
  return int_dot_layout(bits, dim);
}

namespace {
// The entry points below, over rows or (tiled) value tiles.
void code_accumulate_int(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                         std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                         std::int32_t* acc, std::int64_t acc_stride, bool tiled) {
  KVCAL_VNNI_DISPATCH(
      CodeAccumulateInt(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, acc, acc_stride, tiled));
  HWY_DYNAMIC_DISPATCH(CodeAccumulateInt)
  (codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, acc, acc_stride, tiled);
}

void code_accumulate_int_scaled(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                                std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                                std::int64_t w8_stride, const float* ws, float* acc, std::int64_t acc_stride,
                                std::int32_t* scratch, bool tiled) {
  KVCAL_VNNI_DISPATCH(CodeAccumulateIntScaled(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, ws, acc,
                                              acc_stride, scratch, tiled));
  HWY_DYNAMIC_DISPATCH(CodeAccumulateIntScaled)
  (codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, ws, acc, acc_stride, scratch, tiled);
}
}  // namespace

void code_accumulate_int(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                         std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                         std::int32_t* acc, std::int64_t acc_stride) {
  code_accumulate_int(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, acc, acc_stride, false);
}

void code_accumulate_int_tiles(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                               std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                               std::int64_t w8_stride, std::int32_t* acc, std::int64_t acc_stride) {
  code_accumulate_int(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, acc, acc_stride, true);
}

void code_accumulate_int_scaled(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                                std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                                std::int64_t w8_stride, const float* ws, float* acc, std::int64_t acc_stride,
                                std::int32_t* scratch) {
  code_accumulate_int_scaled(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, ws, acc, acc_stride, scratch,
                             false);
}

void code_accumulate_int_tiles_scaled(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                                      std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                                      std::int64_t w8_stride, const float* ws, float* acc, std::int64_t acc_stride,
                                      std::int32_t* scratch) {
  code_accumulate_int_scaled(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, ws, acc, acc_stride, scratch,
                             true);
}

}  // namespace kvcal::runtime::detail
#endif  // HWY_ONCE
