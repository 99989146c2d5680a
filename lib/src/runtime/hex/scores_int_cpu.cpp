// The HEX integer score kernels (code_scores_int: kernels_cpu.h), compiled
// once per SIMD target as kernels_cpu.cpp is, and once more in each VPDPBUSD
// pass (AVX-VNNI, AVX-512 VNNI: avxvnni_pass.h). A file of their own because
// their unrolled bodies are most of the kernels' compile time (on an AVX-512
// target about 60%, the integer value kernels, values_int_cpu.cpp, about a
// third): the files build in parallel.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1  // as kernels_cpu.cpp: the same targets in both
#endif
#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/hex/kernels_cpu.h"

#undef KVCAL_KERNEL_NS
#ifdef KVCAL_VNNI512_PASS
#define KVCAL_KERNEL_NS N_AVX3_VNNI
#elif defined(KVCAL_AVXVNNI_PASS)
#define KVCAL_KERNEL_NS N_AVX2_VNNI
#else
#define KVCAL_KERNEL_NS HWY_NAMESPACE
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/hex/scores_int_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#endif
#include "runtime/hex/kernels_cpu-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvcal::runtime::detail {
namespace KVCAL_KERNEL_NS {
#ifdef KVCAL_VNNI512_PASS
namespace hn = hwy::N_AVX3;
#elif defined(KVCAL_AVXVNNI_PASS)
namespace hn = hwy::N_AVX2;
#else
namespace hn = hwy::HWY_NAMESPACE;
#endif

#if HWY_TARGET != HWY_SCALAR
// Integer scores of kQ queries over phase-split rows: out[j][r] = sum over
// slots of w_j[slot] * code_r(slot), where w8 + j * w8_stride holds, in slot
// order, either one limb w (kL = 1, dim int8) or two, hi then lo (kL = 2,
// w = 128 hi + lo). run % Lanes(d8) == 0. Rows go four at a time: each row's
// per-query lane sums are parked in a small buffer and the four are reduced
// together.
template <int kBits, int kQ, int kL, class D8>
void ScoresInt(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
               std::int64_t dim, const std::int8_t* w8, std::int64_t w8_stride, std::int32_t* out,
               std::int64_t out_stride) {
  static_assert(kBits == 2 || kBits == 4, "3-bit rows are widened to 4-bit rows first");
  constexpr int kPer = IntPhases(kBits);
  const hn::Repartition<std::int8_t, D8> di8;
  const hn::Repartition<std::int32_t, D8> d32;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
  const auto N32 = static_cast<std::int64_t>(hn::Lanes(d32));
  HWY_ALIGN std::int32_t park[4 * kQ * hn::MaxLanes(d32)];
  for (std::int64_t r0 = 0; r0 < rows; r0 += 4) {
    for (std::int64_t rr = 0; rr < 4; ++rr) {
      const std::int64_t r = r0 + rr;
      if (r >= rows) {
        for (int j = 0; j < kQ; ++j) hn::Store(hn::Zero(d32), d32, park + (rr * kQ + j) * N32);
        continue;
      }
      const std::uint8_t* row = codes + r * row_bytes;
      __builtin_prefetch(row + kPrefetchRows * row_bytes, 0, 3);
      auto h0 = hn::Zero(d32), h1 = h0, h2 = h0, h3 = h0, l0 = h0, l1 = h0, l2 = h0, l3 = h0;
      for (std::int64_t i = 0; i < run; i += N) {
        const auto b = hn::LoadU(d8, row + i);
        const auto step = [&](auto c, std::int64_t off) {
          const auto dq = [&](int j, auto& h, auto& l) {
            const std::int8_t* wj = w8 + j * w8_stride + off + i;
            h = DotBytes(d8, c, hn::LoadU(di8, wj), h);
            if constexpr (kL == 2) l = DotBytes(d8, c, hn::LoadU(di8, wj + dim), l);
          };
          dq(0, h0, l0);
          if constexpr (kQ > 1) dq(1, h1, l1);
          if constexpr (kQ > 2) dq(2, h2, l2);
          if constexpr (kQ > 3) dq(3, h3, l3);
        };
        step(PhaseBytes<kBits, 0>(d8, b), 0);
        if constexpr (kPer >= 2) step(PhaseBytes<kBits, 1>(d8, b), run);
        if constexpr (kPer == 4) {
          step(PhaseBytes<kBits, 2>(d8, b), 2 * run);
          step(PhaseBytes<kBits, 3>(d8, b), 3 * run);
        }
      }
      std::int32_t* pk = park + rr * kQ * N32;
      hn::Store(MergeLimbs<kL>(h0, l0), d32, pk);
      if constexpr (kQ > 1) hn::Store(MergeLimbs<kL>(h1, l1), d32, pk + N32);
      if constexpr (kQ > 2) hn::Store(MergeLimbs<kL>(h2, l2), d32, pk + 2 * N32);
      if constexpr (kQ > 3) hn::Store(MergeLimbs<kL>(h3, l3), d32, pk + 3 * N32);
    }
    for (int j = 0; j < kQ; ++j) {
      std::int32_t t[4];
      SumOfLanes4(d32, hn::Load(d32, park + j * N32), hn::Load(d32, park + (kQ + j) * N32),
                  hn::Load(d32, park + (2 * kQ + j) * N32), hn::Load(d32, park + (3 * kQ + j) * N32), t);
      for (std::int64_t rr = 0; rr < 4 && r0 + rr < rows; ++rr) out[j * out_stride + r0 + rr] = t[rr];
    }
  }
}

#if !HWY_HAVE_SCALABLE
// ScoresInt with kR rows per step unrolled at compile time: the limbs' sums
// of each row and query merged in registers and reduced four at a time, the
// weights packed in their order of use; with kPairs, the sums are int16 pair
// sums until the row's end (at most kPairSums per lane: see ScoresIntGroups).
// Returns the rows done (a multiple of kR); ScoresInt does the rest.
template <int kBits, int kQ, int kL, int kR, bool kPairs, class D8>
KVCAL_FLATTEN std::int64_t ScoresIntRows(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes,
                                         std::int64_t run, std::int64_t dim, const std::int8_t* w8,
                                         std::int64_t w8_stride, std::int32_t* out, std::int64_t out_stride,
                                         bool far = true) {
  constexpr int kPer = IntPhases(kBits), kA = kR * kQ;
  const hn::Repartition<std::int8_t, D8> di8;
  const hn::Repartition<std::int32_t, D8> d32;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
  constexpr std::int64_t kPacked = 8192;
  if (kL * kQ * kPer * run > kPacked) return 0;
  HWY_ALIGN std::int8_t wp[kPacked];  // per vector i: [query][phase][limb] vectors of N bytes
  for (std::int64_t i = 0; i < run; i += N)
    for (int j = 0; j < kQ; ++j)
      for (int k = 0; k < kPer; ++k)
        for (int limb = 0; limb < kL; ++limb)
          hn::Store(hn::LoadU(di8, w8 + j * w8_stride + limb * dim + k * run + i), di8,
                    wp + i * kL * kQ * kPer + ((j * kPer + k) * kL + limb) * N);
  const AccTag<kPairs, D8> da;
  const Groups3<D8> g3;
  // 3 bits: never the last row, which a read in place would pass (IntBytes).
  const std::int64_t direct = kBits == 3 ? rows - 1 : rows;
  std::int64_t r = 0;
  for (; r + kR <= direct; r += kR) {
    hn::Vec<decltype(da)> h[kA], l[kA];
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA { h[x] = l[x] = hn::Zero(da); });
    for (std::int64_t i = 0; i < run; i += N) {
      Unroll<kR>([&](auto rr) KVCAL_INLINE_LAMBDA {
        // In groups, each row reads the weights afresh, as operands of the
        // products (see KVCAL_PIN; one query's weights stay in registers).
        const std::int8_t* wi = kQ > 1 ? Launder(wp + i * kL * kQ * kPer) : wp + i * kL * kQ * kPer;
        const std::uint8_t* row = codes + (r + rr) * row_bytes;
        if (i == 0) __builtin_prefetch(row + kPrefetchRows * row_bytes, 0, 3);  // past the end is harmless
        // Once per step, for the lines of its rows.
        if constexpr (decltype(rr)::value == 0)
          if (far && i == 0) PrefetchFar<kBits>(row, kR * row_bytes);
        const auto b = IntBytes<kBits>(d8, row + IntOffset<kBits>(i), g3);
        hn::Vec<D8> ph[kPer];
        Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA { ph[k] = PhaseBytes<kBits, k>(d8, b); });
        Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
          constexpr int x = decltype(rr)::value * kQ + decltype(j)::value;
          Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA {
            const std::int8_t* wk = wi + ((j * kPer + k) * kL) * N;
            h[x] = DotAcc<kPairs>(d8, ph[k], hn::Load(di8, wk), h[x]);
            if constexpr (kQ > 1) KVCAL_PIN(h[x]);
            if constexpr (kL == 2) {
              l[x] = DotAcc<kPairs>(d8, ph[k], hn::Load(di8, wk + N), l[x]);
              if constexpr (kQ > 1) KVCAL_PIN(l[x]);
            }
          });
        });
      });
    }
    hn::Vec<decltype(d32)> h32[kA];
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA {
      h32[x] = MergeLimbs<kL>(AddAcc<kPairs>(d8, h[x], hn::Zero(d32)), AddAcc<kPairs>(d8, l[x], hn::Zero(d32)));
    });
    HWY_ALIGN std::int32_t sum[(kA + 3) / 4 * 4];
    Unroll<kA / 4>([&](auto g) KVCAL_INLINE_LAMBDA {
      constexpr int b = 4 * decltype(g)::value;
      Sum4(d32, h32[b], h32[b + 1], h32[b + 2], h32[b + 3], sum + b);
    });
    Unroll<kA % 4>([&](auto x) KVCAL_INLINE_LAMBDA {
      sum[kA / 4 * 4 + x] = hn::GetLane(hn::SumOfLanes(d32, h32[kA / 4 * 4 + x]));
    });
    Unroll<kR>([&](auto rr) KVCAL_INLINE_LAMBDA {
      Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA { out[j * out_stride + r + rr] = sum[rr * kQ + j]; });
    });
  }
  return r;
}
#endif

#if !HWY_HAVE_SCALABLE && KVCAL_ROW_KERNELS
// Scores of kQ >= 2 queries, four rows at a time, without a reduction per
// row and query: two rounds of 32-bit interleaving turn the four rows' vector
// at i into four vectors t_m whose 128-bit block b holds, in lane e, the four
// codes of row e at 32-bit position 4b + m. One byte dot product of t_m with
// the weights of position 4b + m broadcast over block b (Broadcast<m>,
// packed once per call) then adds to each lane a partial score of its row,
// and the blocks' sums (StoreBlockSum) are the four rows' scores, stored in
// one go. Per four rows and a group of four on AVX-512: 8 interleavings and
// about 20 reduction operations, against 52 reduction operations and 16
// scalar stores for the row-per-accumulator kernel (ScoresIntRows), whose
// reductions were most of its work beyond the products (bench_kernels, one
// block in cache, group 4, on a Zen 5 guest: int8 4-bit 247 -> 184 ns,
// int14 4-bit 485 -> 287; with the requests ahead below, 200 and 341).
// Taken for 4-bit rows (and for 3-bit rows: on AVX-512 read in place, see
// ScoresIntPer, elsewhere widened to 4 bits first); decode at a group
// of 4 on that guest, 5 interleaved rounds: hex4@int8 5% less time,
// hex4@int14 9%, kcvt4@int14 5%; kcvt4@int8 5-6.5% more in two such runs,
// 2.5-3.7% less in two later ones (README). 2-bit rows too: 20% faster in
// cache; in the decode no faster at first, then, with the expander entries'
// kernels a block at a time, hex2@int8 2.5-11% and kcvt2@int8 3.4-4.9% less
// time at a group of 4 (two 5-round runs, native).
// Accumulators per query and phase (kPairs: int16 pair sums, at most
// kPairSums a lane: 4 run / Lanes(d8) per phase, checked by ScoresIntFour).
// Returns the rows done: all of them (the last step overlapping the one
// before where rows is not a multiple of 4), or 0 where the packed weights
// do not fit or there are fewer than 4 rows (the caller's other kernels do
// the rows).
template <int kBits, int kQ, int kL, bool kPairs, class D8>
KVCAL_FLATTEN std::int64_t ScoresIntT4(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes,
                                       std::int64_t run, std::int64_t dim, const std::int8_t* w8,
                                       std::int64_t w8_stride, std::int32_t* out, std::int64_t out_stride,
                                       bool far = true) {
  static_assert(kBits >= 2 && kBits <= 4, "stored 2-, 3- or 4-bit rows");
  constexpr int kPer = IntPhases(kBits), kA = kQ * kPer;
  const hn::Repartition<std::int8_t, D8> di8;
  const hn::Repartition<std::int32_t, D8> d32;
  const hn::Repartition<std::uint32_t, D8> du32;
  const hn::Repartition<std::uint64_t, D8> du64;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
  constexpr std::int64_t kPacked = 16384;
  constexpr std::int64_t kTail = kBits == 3 ? 4096 : 1;  // 3 bits: the last four rows widened
  if (rows < 4 || 4 * kL * kA * run > kPacked || (kBits == 3 && 4 * run > kTail)) return 0;
  // Per vector i: [query][phase][m][limb] vectors of N bytes.
  HWY_ALIGN std::int8_t wp[kPacked];
  for (std::int64_t i = 0; i < run; i += N)
    for (int j = 0; j < kQ; ++j)
      for (int k = 0; k < kPer; ++k)
        for (int limb = 0; limb < kL; ++limb) {
          const auto w = hn::BitCast(du32, hn::LoadU(di8, w8 + j * w8_stride + limb * dim + k * run + i));
          std::int8_t* at = wp + i * 4 * kL * kA + ((j * kPer + k) * 4 * kL + limb) * N;
          hn::Store(hn::BitCast(di8, hn::Broadcast<0>(w)), di8, at);
          hn::Store(hn::BitCast(di8, hn::Broadcast<1>(w)), di8, at + kL * N);
          hn::Store(hn::BitCast(di8, hn::Broadcast<2>(w)), di8, at + 2 * kL * N);
          hn::Store(hn::BitCast(di8, hn::Broadcast<3>(w)), di8, at + 3 * kL * N);
        }
  const AccTag<kPairs, D8> da;
  // Rows are requested kT4Ahead ahead, every row's first line (a third of
  // the rows ahead of the other kernels' one line per row did not keep this
  // faster kernel fed: hex4@int8 decode at a group of 4 on a Zen 5 guest
  // took 20% more time than with ScoresIntRows at one line per step of four
  // rows, 48 rows ahead; 3% less at a line per row; 5-7% less 96 rows
  // ahead). The rows before the loop's first request are requested here.
  constexpr std::int64_t kT4Ahead = 2 * kPrefetchRows;
  for (std::int64_t k = 0; k < std::min(rows, kT4Ahead); ++k) __builtin_prefetch(codes + k * row_bytes, 0, 3);
  [[maybe_unused]] const Groups3<D8> g3;
  // Four rows of kB-bit codes from row, stride apart (kB = 3: stored 3-bit
  // rows read in place, not the block's last; 4: also 3-bit rows widened to
  // 4 bits), their scores to out + r.
  const auto step = [&](const std::uint8_t* row, std::int64_t stride, std::int64_t r, auto bits_c) KVCAL_INLINE_LAMBDA {
    constexpr int kB = decltype(bits_c)::value;
    hn::Vec<decltype(da)> h[kA], l[kA];
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA { h[x] = l[x] = hn::Zero(da); });
    const std::uint8_t* stored = codes + r * row_bytes;
    for (int k = 0; k < 4; ++k)  // past the end is harmless
      __builtin_prefetch(stored + (kT4Ahead + k) * row_bytes, 0, 3);
    if (far) PrefetchFar<kBits>(stored, 4 * row_bytes);
    for (std::int64_t i = 0; i < run; i += N) {
      const std::int8_t* wi = Launder(wp + i * 4 * kL * kA);
      const std::uint8_t* at = row + IntOffset<kB>(i);
      const auto c0 = hn::BitCast(du32, IntBytes<kB>(d8, at, g3));
      const auto c1 = hn::BitCast(du32, IntBytes<kB>(d8, at + stride, g3));
      const auto c2 = hn::BitCast(du32, IntBytes<kB>(d8, at + 2 * stride, g3));
      const auto c3 = hn::BitCast(du32, IntBytes<kB>(d8, at + 3 * stride, g3));
      const auto lo01 = hn::BitCast(du64, hn::InterleaveLower(du32, c0, c1));
      const auto hi01 = hn::BitCast(du64, hn::InterleaveUpper(du32, c0, c1));
      const auto lo23 = hn::BitCast(du64, hn::InterleaveLower(du32, c2, c3));
      const auto hi23 = hn::BitCast(du64, hn::InterleaveUpper(du32, c2, c3));
      const hn::Vec<D8> t[4] = {hn::BitCast(d8, hn::InterleaveLower(du64, lo01, lo23)),
                                hn::BitCast(d8, hn::InterleaveUpper(du64, lo01, lo23)),
                                hn::BitCast(d8, hn::InterleaveLower(du64, hi01, hi23)),
                                hn::BitCast(d8, hn::InterleaveUpper(du64, hi01, hi23))};
      Unroll<4>([&](auto m) KVCAL_INLINE_LAMBDA {
        hn::Vec<D8> ph[kPer];
        Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA { ph[k] = PhaseBytes<kB, k>(d8, t[m]); });
        Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
          Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA {
            constexpr int x = decltype(j)::value * kPer + decltype(k)::value;
            const std::int8_t* wk = wi + (x * 4 + decltype(m)::value) * kL * N;
            h[x] = DotAcc<kPairs>(d8, ph[k], hn::Load(di8, wk), h[x]);
            KVCAL_PIN(h[x]);
            if constexpr (kL == 2) {
              l[x] = DotAcc<kPairs>(d8, ph[k], hn::Load(di8, wk + N), l[x]);
              KVCAL_PIN(l[x]);
            }
          });
        });
      });
    }
    Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
      auto hs = hn::Zero(d32), ls = hn::Zero(d32);
      Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA {
        constexpr int x = decltype(j)::value * kPer + decltype(k)::value;
        hs = AddAcc<kPairs>(d8, h[x], hs);
        if constexpr (kL == 2) ls = AddAcc<kPairs>(d8, l[x], ls);
      });
      StoreBlockSum(d32, MergeLimbs<kL>(hs, ls), out + decltype(j)::value * out_stride + r);
    });
  };
  std::int64_t r = 0;
  if constexpr (kBits == 3) {
    // In place but for the block's last row (IntBytes<3> reads past its
    // row): the last four rows widened to 4-bit rows make the last step,
    // overlapping the one before where rows - 1 is not a multiple of 4.
    for (; r + 4 <= rows - 1; r += 4) step(codes + r * row_bytes, row_bytes, r, std::integral_constant<int, 3>());
    HWY_ALIGN std::uint8_t tail[kTail];
    WidenRows3<false>(codes + (rows - 4) * row_bytes, 4, row_bytes, 2 * run, tail);
    step(tail, run, rows - 4, std::integral_constant<int, 4>());
  } else {
    const auto stored = std::integral_constant<int, kBits>();
    for (; r + 4 <= rows; r += 4) step(codes + r * row_bytes, row_bytes, r, stored);
    // The last rows (fewer than four): one more step over the last four,
    // overlapping the one before, whose rows get the same sums (the weights
    // packed above serve it).
    if (r < rows) step(codes + (rows - 4) * row_bytes, row_bytes, rows - 4, stored);
  }
  return rows;
}

// ScoresIntT4 with int16 pair sums where each lane adds at most kPairSums of
// them per phase (4 run / Lanes(d8)), else int32 sums.
template <int kBits, int kQ, int kL, class D8>
HWY_INLINE std::int64_t ScoresIntFour(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes,
                                      std::int64_t run, std::int64_t dim, const std::int8_t* w8, std::int64_t w8_stride,
                                      std::int32_t* out, std::int64_t out_stride, bool far = true) {
  if (kPairTarget && 4 * run / static_cast<std::int64_t>(hn::Lanes(d8)) <= kPairSums)
    return ScoresIntT4<kBits, kQ, kL, kPairTarget>(d8, codes, rows, row_bytes, run, dim, w8, w8_stride, out, out_stride,
                                                   far);
  return ScoresIntT4<kBits, kQ, kL, false>(d8, codes, rows, row_bytes, run, dim, w8, w8_stride, out, out_stride, far);
}
#endif

// The scores of nq queries, four at a time. far: the kernels' requests
// far_bytes_by_bits ahead (PrefetchFar); false for rows widened into a chunk (see
// WidenedChunks3).
template <int kBits, int kL, class D8>
void ScoresIntGroups(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                     std::int64_t dim, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                     std::int32_t* out, std::int64_t out_stride, [[maybe_unused]] bool far = true) {
  for (std::int64_t j = 0; j < nq; j += 4) {
    const std::int8_t* wj = w8 + j * w8_stride;
    std::int32_t* oj = out + j * out_stride;
    const auto group = [&](auto kq) {
      constexpr int kQ = decltype(kq)::value;
      std::int64_t r = 0;
#if !HWY_HAVE_SCALABLE && KVCAL_ROW_KERNELS
      constexpr int kR = std::max(1, (kAccVectors / kL) / kQ);  // kL limbs per row and query
      const auto unrolled = [&](const std::uint8_t* c, std::int64_t n, std::int32_t* o, std::int64_t os) {
        // int16 pair sums where a row adds at most kPairSums of them per lane.
        if (kPairTarget && run / static_cast<std::int64_t>(hn::Lanes(d8)) * IntPhases(kBits) <= kPairSums)
          return ScoresIntRows<kBits, kQ, kL, kR, kPairTarget>(d8, c, n, row_bytes, run, dim, wj, w8_stride, o, os,
                                                               far);
        return ScoresIntRows<kBits, kQ, kL, kR, false>(d8, c, n, row_bytes, run, dim, wj, w8_stride, o, os, far);
      };
      // 4- and 2-bit rows on targets with 32 vector registers (AVX-512, NEON, not
      // timed on AVX2's 16, where kQ kPer accumulators and the four
      // transposed vectors would fill them): see ScoresIntT4.
      if constexpr (kQ >= 2 && (kBits == 4 || kBits == 2) && kAccVectors >= 16) {
        if (ScoresIntFour<kBits, kQ, kL>(d8, codes, rows, row_bytes, run, dim, wj, w8_stride, oj, out_stride, far) ==
            rows)
          return;
      }
      r = unrolled(codes, rows, oj, out_stride);
      // More than half a step of rows left (a HEX block's kept tokens leave
      // 94 rows of 96, 14 past the last step of 16): one more step over the
      // last kR rows, overlapping the step before, whose rows it writes
      // again with the same sums (ScoresInt took 1.7 times as long per row, by the
      // two kernels' shares of a profile of hex4@int8 on a Zen 5 host).
      if (r < rows && rows >= kR && 2 * (rows - r) > kR &&
          unrolled(codes + (rows - kR) * row_bytes, kR, oj + (rows - kR), out_stride) == kR)
        r = rows;
#endif
      if (r < rows)
        ScoresInt<kBits, kQ, kL>(d8, codes + r * row_bytes, rows - r, row_bytes, run, dim, wj, w8_stride, oj + r,
                                 out_stride);
    };
    switch (std::min<std::int64_t>(4, nq - j)) {
      case 1:
        group(std::integral_constant<int, 1>());
        break;
      case 2:
        group(std::integral_constant<int, 2>());
        break;
      case 3:
        group(std::integral_constant<int, 3>());
        break;
      default:
        group(std::integral_constant<int, 4>());
        break;
    }
  }
}

#if !HWY_HAVE_SCALABLE && KVCAL_ROW_KERNELS
// Scores of one query over 3-bit rows read in place (see Fused3); the rows
// after the last whole step of ScoresIntRows are widened first.
template <int kL, class D8>
void Scores3One(D8 d8, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                std::int64_t dim, const std::int8_t* w8, std::int64_t w8_stride, std::int32_t* out,
                std::int64_t out_stride) {
  constexpr int kR = std::max(1, kAccVectors / kL);
  std::int64_t r = 0;
  if (kPairTarget && run / static_cast<std::int64_t>(hn::Lanes(d8)) * 2 <= kPairSums)
    r = ScoresIntRows<3, 1, kL, kR, kPairTarget>(d8, codes, rows, row_bytes, run, dim, w8, w8_stride, out, out_stride);
  else
    r = ScoresIntRows<3, 1, kL, kR, false>(d8, codes, rows, row_bytes, run, dim, w8, w8_stride, out, out_stride);
  if (r < rows)
    WidenedChunks3<false>(codes + r * row_bytes, rows - r, row_bytes, dim,
                          [&](const std::uint8_t* wide, std::int64_t n, std::int64_t r0) {
                            ScoresInt<4, 1, kL>(d8, wide, n, run, run, dim, w8, w8_stride, out + r + r0, out_stride);
                          });
}
#endif

template <int kL, class D8>
void ScoresIntPer(D8 d8, int bits, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes,
                  std::int64_t run, std::int64_t dim, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                  std::int32_t* out, std::int64_t out_stride) {
  if (bits == 2) {
    ScoresIntGroups<2, kL>(d8, codes, rows, row_bytes, run, dim, w8, nq, w8_stride, out, out_stride);
  } else if (bits == 4) {
    ScoresIntGroups<4, kL>(d8, codes, rows, row_bytes, run, dim, w8, nq, w8_stride, out, out_stride);
  } else {
#if !HWY_HAVE_SCALABLE && KVCAL_ROW_KERNELS
    if constexpr (Fused3<kL>()) {
      if (nq == 1) return Scores3One<kL>(d8, codes, rows, row_bytes, run, dim, w8, w8_stride, out, out_stride);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
      // GQA groups on AVX-512, whose 32 registers hold the widening's
      // constants beside the sums: the rows read in place, four queries at a
      // time, so that waiting for them from memory overlaps the arithmetic
      // (widened first, the wait came before any arithmetic: hex3@int8 decode
      // at a group of 4 on a Zen 5 guest 5% slower); the rows from the last
      // unrolled step on, which hold the block's last row, widened. Two or
      // more queries take ScoresIntT4 on the rows in place (its last step
      // widened): slower than ScoresIntRows in cache (bench_kernels
      // kernel/scores/int8/3/4 on that guest, 3 interleaved rounds: 327-333
      // -> 354-358 ns), but hex3@int8 decode at a group of 4 took 10-13%
      // less time in three runs of 3 interleaved rounds (2.39-2.45 ->
      // 2.12-2.20 ms): the rows wait on memory, and the widening in
      // registers overlaps that wait.
      const bool pairs = kPairTarget && run / static_cast<std::int64_t>(hn::Lanes(d8)) * IntPhases(3) <= kPairSums;
      for (std::int64_t j = 0; j < nq; j += 4) {
        const std::int8_t* wj = w8 + j * w8_stride;
        std::int32_t* oj = out + j * out_stride;
        const auto group = [&](auto kq) {
          constexpr int kQ = decltype(kq)::value;
          constexpr int kR = std::max(1, (kAccVectors / kL) / kQ);
          if constexpr (kQ >= 2)  // four rows at a time, all of them where it can
            if (ScoresIntFour<3, kQ, kL>(d8, codes, rows, row_bytes, run, dim, wj, w8_stride, oj, out_stride) == rows)
              return rows;
          if (pairs)
            return ScoresIntRows<3, kQ, kL, kR, kPairTarget>(d8, codes, rows, row_bytes, run, dim, wj, w8_stride, oj,
                                                             out_stride);
          return ScoresIntRows<3, kQ, kL, kR, false>(d8, codes, rows, row_bytes, run, dim, wj, w8_stride, oj,
                                                     out_stride);
        };
        std::int64_t done = 0;
        const std::int64_t g = std::min<std::int64_t>(4, nq - j);
        switch (g) {
          case 1:
            done = group(std::integral_constant<int, 1>());
            break;
          case 2:
            done = group(std::integral_constant<int, 2>());
            break;
          case 3:
            done = group(std::integral_constant<int, 3>());
            break;
          default:
            done = group(std::integral_constant<int, 4>());
            break;
        }
        if (done < rows)  // this group's rows left (widened), for its queries only
          WidenedChunks3<false>(codes + done * row_bytes, rows - done, row_bytes, dim,
                                [&](const std::uint8_t* wide, std::int64_t n, std::int64_t r0) {
                                  ScoresIntGroups<4, kL>(d8, wide, n, run, run, dim, wj, g, w8_stride, oj + done + r0,
                                                         out_stride, false);
                                });
      }
      return;
#endif
    }
#endif
    WidenedChunks3<false, true>(
        codes, rows, row_bytes, dim, [&](const std::uint8_t* wide, std::int64_t n, std::int64_t r0) {
          ScoresIntGroups<4, kL>(d8, wide, n, run, run, dim, w8, nq, w8_stride, out + r0, out_stride, false);
        });
  }
}
#endif  // HWY_TARGET != HWY_SCALAR

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// The key tiles' score kernels (see key_tiles in kernels_cpu.h): the vector
// of a tile's unit column g (kU stored bytes a row: four of 2- or 4-bit
// codes, or eight 3-bit codes, read widened by IntBytes) holds one row per
// 32-bit lane, so a byte dot product with query j's weights of that unit,
// broadcast, adds to each lane a partial score of its own row. No
// transposition and no reduction across lanes (ScoresIntT4 spends 8
// interleavings and about 28 reduction operations per four rows on them, for
// 32 dot products at a group of 4): each lane ends as one row's score.

// acc[i kX + (j kPer + k) kL + l] += the products of slice i's column vector
// x[i] (unit g) with query j's limb l of phase k's weights (kX = kQ kPer kL
// sums a slice). Query by query, each broadcast weight serving every slice
// at once: with the slices' calls apart, GCC 12 kept all kX weights of the
// first alive for the second (at a group of 4 on AVX-512: 16 sums, 8
// weights, 4 phase vectors and 2 masks in 32 registers), copied sums from
// register to register around each VPDPBUSD and spilled two of them to the
// stack, whose store-to-load latency then bound the loop.
template <int kBits, int kQ, int kL, int kN, class D8>
HWY_INLINE void TileProducts(D8 d8, const hn::Vec<D8>* x, const std::int8_t* w8, std::int64_t w8_stride,
                             std::int64_t run, std::int64_t dim, std::int64_t g,
                             hn::Vec<hn::Repartition<std::int32_t, D8>>* acc) {
  constexpr int kPer = IntPhases(kBits), kSp = CodeBits(kBits);
  constexpr int kX = kQ * kPer * kL;
  const hn::Repartition<std::int8_t, D8> di8;
  const hn::Repartition<std::int32_t, D8> d32;
  hn::Vec<D8> ph[kN][kPer];
  Unroll<kN>([&](auto i) KVCAL_INLINE_LAMBDA {
    Unroll<kPer>([&](auto k)
                     KVCAL_INLINE_LAMBDA { ph[i][k] = KernelPhaseBytes<kMaskedPhases, kBits, k, kSp>(d8, x[i]); });
  });
  Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
    Unroll<kPer>([&](auto k) KVCAL_INLINE_LAMBDA {
      Unroll<kL>([&](auto l) KVCAL_INLINE_LAMBDA {
        std::int32_t word;
        std::memcpy(&word, w8 + j * w8_stride + l * dim + k * run + 4 * g, sizeof word);
        const auto w = hn::BitCast(di8, hn::Set(d32, word));
        constexpr int x0 = (decltype(j)::value * kPer + decltype(k)::value) * kL + decltype(l)::value;
        Unroll<kN>([&](auto i) KVCAL_INLINE_LAMBDA { acc[i * kX + x0] = DotBytes(d8, ph[i][k], w, acc[i * kX + x0]); });
      });
    });
  });
}

// Query j's scores from its sums (TileProducts).
template <int kBits, int kL, class V>
HWY_INLINE V TileScore(const V* acc) {
  constexpr int kPer = IntPhases(kBits), kSp = CodeBits(kBits);
  V h = hn::Zero(hn::DFromV<V>()), lo = h;
  Unroll<kPer>([&](auto k) {
    h = hn::Add(h, PhaseScaled<kMaskedPhases, k, kSp>(acc[k * kL]));
    if constexpr (kL == 2) lo = hn::Add(lo, PhaseScaled<kMaskedPhases, k, kSp>(acc[k * kL + 1]));
  });
  return MergeLimbs<kL>(h, lo);
}

// Whole tiles, kS slices (vectors of kRows rows of a tile's unit columns) at
// a time, for independent sums. The lines near_rows_keys rows ahead of each
// read (96 rows; prefetch.cpp) are requested into L1 (as
// ScoresIntT4 does; on a Zen 5 host a tile ahead came too late:
// hex4@int8 decode over 32K tokens, one thread, 4-5% slower at a group of 1
// than the row layout, then on a par), and those far_bytes_by_bits ahead
// (PrefetchFar): one of each per line read.
template <int kBits, int kQ, int kL, class D8>
KVCAL_FLATTEN void ScoresIntTiles(D8 d8, const std::uint8_t* codes, std::int64_t tiles, std::int64_t row_bytes,
                                  std::int64_t run, std::int64_t dim, const std::int8_t* w8, std::int64_t w8_stride,
                                  std::int32_t* out, std::int64_t out_stride) {
  constexpr std::int64_t kU = KeyTileUnit(kBits), kT = kKeyTileRows;
  constexpr auto kRows = static_cast<std::int64_t>(hn::MaxLanes(d8) / 4);  // rows per vector
  static_assert(kT % kRows == 0, "a tile's unit column is whole vectors");
  constexpr std::int64_t kV = kT / kRows;         // vectors per unit column
  constexpr int kX = kQ * IntPhases(kBits) * kL;  // sums per slice
  // (Three slices at a group of 4 on AVX-512, 24 sums: 4 bits 10% slower
  // in cache, 3 bits, whose read holds constants in registers, 40%.)
  constexpr int kS = std::max(1, std::min(4, kAccVectors / kX));
  // kJoint: a unit column's products query by query over all slices
  // (TileProducts), where a slice has eight or more sums; with fewer, slice
  // by slice as the codes arrive. (The joint order with one query, 4-bit
  // codes: faster in cache, bench_kernels scores_tiles/int8/4/1/96 93-103 ->
  // 82-90 ns, but from memory hex4@int8 and kcvt4@int8 decode over 32K
  // tokens, one thread, Zen 5, 5 rounds: hex4 4-12% more time, kcvt4 from
  // 4% less to 22% more.)
  constexpr bool kJoint = kX >= 8;
  const hn::Repartition<std::int32_t, D8> d32;
  const Groups3<D8> g3;
  const std::int64_t units = row_bytes / kU, slices = tiles * kV, column = kT * kU, ahead = near_rows_keys * row_bytes;
  [[maybe_unused]] HWY_ALIGN std::uint8_t pad[hn::MaxLanes(d8)] = {};
  const auto pass = [&](std::int64_t s0, auto n_c) KVCAL_INLINE_LAMBDA {
    constexpr int kN = decltype(n_c)::value;
    const std::uint8_t* base[kN];
    Unroll<kN>([&](auto i) { base[i] = codes + (s0 + i) / kV * kT * row_bytes + (s0 + i) % kV * kRows * kU; });
    hn::Vec<decltype(d32)> acc[kN * kX];
    Unroll<kN * kX>([&](auto x) { acc[x] = hn::Zero(d32); });
    // Unit column g of the pass's slices. The 3-bit read takes N bytes for
    // its 3N / 4, so the block's last vector (last unit column of the last
    // slice; last = std::true_type) goes through a copy, in a turn of its
    // own after the loop. With that test inside the loop, GCC 12 kept the
    // sums in no fixed registers: eight register moves, two spilled sums
    // and the read's constants loaded again every turn. bench_kernels
    // scores_tiles/int8/3/4/96 on a 2-vCPU Intel Xeon guest (AVX3_DL):
    // 513-677 ns with the test inside, 294-417 without (4 bits: 296-469).
    const auto unit = [&](std::int64_t g, auto last) KVCAL_INLINE_LAMBDA {
      hn::Vec<D8> x[kN];
      Unroll<kN>([&](auto i) KVCAL_INLINE_LAMBDA {
        const std::uint8_t* p = base[i] + g * column;
        __builtin_prefetch(p + ahead, 0, 3);
        PrefetchFar<kBits>(p, 1);
        if constexpr (std::decay_t<decltype(last)>::value && decltype(i)::value == kN - 1) {
          std::memcpy(pad, p, static_cast<std::size_t>(kRows * kU));
          p = pad;
        }
        x[i] = IntBytes<kBits>(d8, p, g3);
        if constexpr (!kJoint) TileProducts<kBits, kQ, kL, 1>(d8, &x[i], w8, w8_stride, run, dim, g, acc + i * kX);
      });
      if constexpr (kJoint) TileProducts<kBits, kQ, kL, kN>(d8, x, w8, w8_stride, run, dim, g, acc);
    };
    const bool last = kBits == 3 && s0 + kN == slices;
    const std::int64_t whole = last ? units - 1 : units;
    for (std::int64_t g = 0; g < whole; ++g) unit(g, std::false_type());
    if (last) unit(units - 1, std::true_type());
    Unroll<kN>([&](auto i) {
      const std::int64_t s = s0 + i;
      Unroll<kQ>([&](auto j) {
        hn::StoreU(TileScore<kBits, kL>(acc + i * kX + j * (kX / kQ)), d32,
                   out + j * out_stride + s / kV * kT + s % kV * kRows);
      });
    });
  };
  std::int64_t s = 0;
  for (; s + kS <= slices; s += kS) pass(s, std::integral_constant<int, kS>());
  for (; s < slices; ++s) pass(s, std::integral_constant<int, 1>());
}

// The last tile of n < 16 rows (unit columns n kU bytes apart): a vector
// read at a column holds its rows in its first lanes and the next column's
// in the rest, whose sums are dropped; reads that would pass the tile's end
// go through a copy.
template <int kBits, int kQ, int kL, class D8>
KVCAL_FLATTEN void ScoresIntLastTile(D8 d8, const std::uint8_t* codes, std::int64_t n, std::int64_t row_bytes,
                                     std::int64_t run, std::int64_t dim, const std::int8_t* w8, std::int64_t w8_stride,
                                     std::int32_t* out, std::int64_t out_stride) {
  constexpr std::int64_t kU = KeyTileUnit(kBits);
  constexpr auto kRows = static_cast<std::int64_t>(hn::MaxLanes(d8) / 4);
  constexpr int kX = kQ * IntPhases(kBits) * kL;
  const hn::Repartition<std::int32_t, D8> d32;
  const Groups3<D8> g3;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d8));
  const std::int64_t units = row_bytes / kU, column = n * kU;
  const std::uint8_t* end = codes + n * row_bytes;
  HWY_ALIGN std::uint8_t pad[hn::MaxLanes(d8)] = {};
  [[maybe_unused]] HWY_ALIGN std::int32_t lanes[hn::MaxLanes(d32)];
  for (std::int64_t r0 = 0; r0 < n; r0 += kRows) {
    hn::Vec<decltype(d32)> acc[kX];
    Unroll<kX>([&](auto x) { acc[x] = hn::Zero(d32); });
    for (std::int64_t g = 0; g < units; ++g) {
      const std::uint8_t* p = codes + g * column + r0 * kU;
      if (p + N > end) {
#if HWY_TARGET <= HWY_AVX3
        // A masked load (no access past the mask's bytes).
        if constexpr (kBits != 3) {
          const auto x = hn::MaskedLoad(hn::FirstN(d8, static_cast<std::size_t>(end - p)), d8, p);
          TileProducts<kBits, kQ, kL, 1>(d8, &x, w8, w8_stride, run, dim, g, acc);
          continue;
        }
#endif
        std::memcpy(pad, p, static_cast<std::size_t>(end - p));
        p = pad;
      }
      const auto x = IntBytes<kBits>(d8, p, g3);
      TileProducts<kBits, kQ, kL, 1>(d8, &x, w8, w8_stride, run, dim, g, acc);
    }
    const auto m = static_cast<std::size_t>(std::min(kRows, n - r0));
    Unroll<kQ>([&](auto j) {
      const auto v = TileScore<kBits, kL>(acc + j * (kX / kQ));
      std::int32_t* o = out + j * out_stride + r0;
#if HWY_TARGET <= HWY_AVX3
      hn::BlendedStore(v, hn::FirstN(d32, m), d32, o);  // a masked store
#else
      hn::Store(v, d32, lanes);
      for (std::size_t r = 0; r < m; ++r) o[r] = lanes[r];
#endif
    });
  }
}

// The scores of nq queries, four at a time, over `rows` rows in key tiles
// (int_dot_layout(bits, dim)), in the target's full vectors (a tile's unit
// column is 64 bytes: one AVX-512 vector, two of AVX2, four of 128 bits).
// One vector width, not WithIntKernel's three: a third of the
// instantiations, whose unrolled bodies take the sanitizer builds minutes.
void TileScores(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride, std::int32_t* out,
                std::int64_t out_stride) {
  const std::int64_t tiles = rows / kKeyTileRows, at = tiles * kKeyTileRows;
  const std::int64_t run = int_slots(bits, dim).run;
  const hn::ScalableTag<std::uint8_t> d8;
  const auto with = [&](auto kl) {
    constexpr int kL = decltype(kl)::value;
    // Queries j .. j + kQ - 1.
    const auto group = [&](auto kq, std::int64_t j) {
      constexpr int kQ = decltype(kq)::value;
      const std::int8_t* wj = w8 + j * w8_stride;
      std::int32_t* oj = out + j * out_stride;
      const auto both = [&](auto bits_c) {
        constexpr int kBits = decltype(bits_c)::value;
        // The last tile's lines into L1 before the whole tiles: the tiles'
        // near requests reach past the block's codes, not back to the
        // block's own last tile, which otherwise waited on them. hex4@int8
        // decode over 32K tokens, one thread, Zen 5, 7 interleaved rounds:
        // 2-16% less time with one query in 6 (2% more in one), hex2@int8
        // 3-12% less in all 7; a group of 4 within 0.96-1.02.
        if (j == 0)
          for (std::int64_t o = at * row_bytes; o < rows * row_bytes; o += 64) __builtin_prefetch(codes + o, 0, 3);
        if (tiles > 0)
          ScoresIntTiles<kBits, kQ, kL>(d8, codes, tiles, row_bytes, run, dim, wj, w8_stride, oj, out_stride);
        if (rows > at)
          ScoresIntLastTile<kBits, kQ, kL>(d8, codes + at * row_bytes, rows - at, row_bytes, run, dim, wj, w8_stride,
                                           oj + at, out_stride);
      };
      if (bits == 2)
        both(std::integral_constant<int, 2>());
      else if (bits == 3)
        both(std::integral_constant<int, 3>());
      else
        both(std::integral_constant<int, 4>());
    };
#if KVCAL_ROW_KERNELS
    InGroupsOf4(nq, group);
#else
    // Sanitizer builds: groups of 4 and single queries only (half the
    // instantiations; their instrumented bodies are most of this file's
    // compile time there).
    std::int64_t j = 0;
    for (; j + 4 <= nq; j += 4) group(std::integral_constant<int, 4>(), j);
    for (; j < nq; ++j) group(std::integral_constant<int, 1>(), j);
#endif
  };
  if (limbs == 1)
    with(std::integral_constant<int, 1>());
  else
    with(std::integral_constant<int, 2>());
}
#endif

void CodeScoresInt(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                   int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride, std::int32_t* out,
                   std::int64_t out_stride) {
#if HWY_TARGET != HWY_SCALAR
  if (WithIntKernel(bits, dim, limbs, [&](auto d8, auto kl, std::int64_t run) {
        ScoresIntPer<decltype(kl)::value>(d8, bits, codes, rows, row_bytes, run, dim, w8, nq, w8_stride, out,
                                          out_stride);
      }))
    return;
#endif
  code_scores_int_reference(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, out, out_stride);
}

// code_scores_int over rows in the key_tiles layout.
void CodeScoresIntTiles(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                        std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                        std::int32_t* out, std::int64_t out_stride) {
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
  if (rows > 0 && int_dot_layout(bits, dim)) {
    TileScores(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, out, out_stride);
    return;
  }
#endif
  // Elsewhere the rows untiled first.
  thread_local std::vector<std::uint8_t> plain;
  plain.resize(static_cast<std::size_t>(rows * row_bytes));
  key_tiles_to_rows(codes, rows, row_bytes, bits, plain.data());
  CodeScoresInt(plain.data(), rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, out, out_stride);
}

}  // namespace KVCAL_KERNEL_NS
}  // namespace kvcal::runtime::detail
HWY_AFTER_NAMESPACE();

#define KVCAL_AVXVNNI_FILE "runtime/hex/scores_int_cpu.cpp"
#include "runtime/hex/avxvnni_pass.h"  // IWYU pragma: keep

#if HWY_ONCE && !defined(KVCAL_AVXVNNI_PASS)
namespace kvcal::runtime::detail {

HWY_EXPORT(CodeScoresInt);
HWY_EXPORT(CodeScoresIntTiles);

void code_scores_int(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                     int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride, std::int32_t* out,
                     std::int64_t out_stride) {
  KVCAL_VNNI_DISPATCH(CodeScoresInt(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, out, out_stride));
  HWY_DYNAMIC_DISPATCH(CodeScoresInt)(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, out, out_stride);
}

void code_scores_int_tiles(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                           std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                           std::int32_t* out, std::int64_t out_stride) {
  KVCAL_VNNI_DISPATCH(CodeScoresIntTiles(codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, out, out_stride));
  HWY_DYNAMIC_DISPATCH(CodeScoresIntTiles)
  (codes, rows, row_bytes, bits, dim, limbs, w8, nq, w8_stride, out, out_stride);
}

}  // namespace kvcal::runtime::detail
#endif  // HWY_ONCE
