// The per-token kernels around a block's code kernels (kernels_cpu.h): the
// expander entries (their differences x - min, the entry scores, the entry
// sums) and the value weights. Compiled once per SIMD target like
// kernels_cpu.cpp, dispatched with HWY_DYNAMIC_DISPATCH.
//
// They run over the runs of quantized tokens between a block's kept tokens,
// whose lengths are arbitrary: with two heavy hitters in a block of 96, a
// run averages about 31 tokens, and with 16 lanes about half of them went
// through scalar tails. Here a run's last vector ends at the run's end and
// overlaps the one before, runs shorter than a vector take a half or a
// quarter vector, and only runs of fewer than four tokens are scalar. (A
// version that staged each run's partial last vector through zero-padded
// copies and stored it under a mask was 10% slower in float HEX decode on a
// Zen 5 host than the scalar tails.)
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1
#endif
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

#include "runtime/hex/entries_cpu.h"
#include "runtime/hex/runs.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/hex/entries_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace kvcal::runtime::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Whether this target holds 128-float tables in AVX-512 registers (Table128,
// HalfTable128) and walks blocks in whole vectors of 16 tokens: defined
// afresh on every pass of this file, the scalar one included.
#undef KVCAL_TABLE128
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define KVCAL_TABLE128 1
#else
#define KVCAL_TABLE128 0
#endif

#if HWY_TARGET != HWY_SCALAR
using DF = hn::ScalableTag<float>;

// As in kernels_cpu.cpp: binary16 converted in hardware on AVX2 and up and
// on Arm; the older x86 targets and the emulation use the scalar routine.
#if (HWY_ARCH_X86 && HWY_TARGET > HWY_AVX2) || HWY_TARGET == HWY_EMU128
constexpr bool kHardwareHalf = false;
#else
constexpr bool kHardwareHalf = true;
#endif

// The kernels' per-vector lambdas, inlined: left to the compiler, even under
// HWY_FLATTEN, the key side's was a call per vector that reloaded its
// captures and the mins table (bench_kernels entry_diffs/128 on a Zen 5
// host: 174 ns as plain calls, 118 ns flattened, 86 ns inlined).
#ifndef KVCAL_ENTRY_INLINE
#define KVCAL_ENTRY_INLINE __attribute__((always_inline))
#endif

// The most lanes of a float vector on this target: the staging arrays hold
// four of them (up to four entries per token).
constexpr std::size_t kMaxLanes = hn::MaxLanes(DF());

// b[idx] for the lanes of idx (0 <= idx < the table's length).
struct Gather {
  const float* b;
  template <class D>
  HWY_INLINE hn::Vec<D> operator()(D d, hn::Vec<hn::RebindToSigned<D>> idx) const {
    return hn::GatherIndex(d, b, idx);
  }
};
#if KVCAL_TABLE128
// The same for tables of up to 128 floats, held in eight AVX-512 registers:
// VPERMT2PS looks up an index's low five bits in a pair of them, bits 5 and
// 6 pick the pair (nine vector operations for sixteen lanes, against the
// gather's sixteen loads). Narrower vectors (short runs) gather.
struct Table128 {
  const float* b;
  __m512 t[8];
  Table128(const float* table, std::int64_t n) : b(table) {
    for (std::int64_t k = 0; k < 8; ++k) {
      const std::int64_t left = std::clamp<std::int64_t>(n - 16 * k, 0, 16);
      t[k] = left > 0 ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1u), table + 16 * k)
                      : _mm512_setzero_ps();
    }
  }
  template <class D>
  HWY_INLINE hn::Vec<D> operator()(D d, hn::Vec<hn::RebindToSigned<D>> idx) const {
    if constexpr (std::is_same_v<D, DF>) {
      const __m512i i = idx.raw;
      const __m512 lo0 = _mm512_permutex2var_ps(t[0], i, t[1]);
      const __m512 lo1 = _mm512_permutex2var_ps(t[2], i, t[3]);
      const __m512 hi0 = _mm512_permutex2var_ps(t[4], i, t[5]);
      const __m512 hi1 = _mm512_permutex2var_ps(t[6], i, t[7]);
      const __mmask16 bit5 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(32));
      const __mmask16 bit6 = _mm512_test_epi32_mask(i, _mm512_set1_epi32(64));
      return hn::Vec<DF>{
          _mm512_mask_blend_ps(bit6, _mm512_mask_blend_ps(bit5, lo0, lo1), _mm512_mask_blend_ps(bit5, hi0, hi1))};
    } else {
      return hn::GatherIndex(d, b, idx);
    }
  }
};
// The same table as binary16 in four registers, for the key side's mins
// (binary16 values): 32 lanes of 16-bit indices at a time, VPERMT2W on
// index bits 0-5 in either pair and one blend on bit 6 (four operations
// for 32 lanes, against Table128's eighteen), the halves then widened with
// the entries' own conversions.
struct HalfTable128 {
  __m512i t[4];
  HalfTable128(const float* table, std::int64_t n) {
    for (std::int64_t k = 0; k < 4; ++k) {
      __m256i h[2];
      for (std::int64_t i = 0; i < 2; ++i) {
        const std::int64_t left = std::clamp<std::int64_t>(n - 32 * k - 16 * i, 0, 16);
        const __m512 f = left > 0
                             ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1u), table + 32 * k + 16 * i)
                             : _mm512_setzero_ps();
        h[i] = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // exact: binary16 values
      }
      t[k] = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
    }
  }
  HWY_INLINE __m512i operator()(__m512i idx) const {
    const __m512i lo = _mm512_permutex2var_epi16(t[0], idx, t[1]);
    const __m512i hi = _mm512_permutex2var_epi16(t[2], idx, t[3]);
    return _mm512_mask_blend_epi16(_mm512_test_epi16_mask(idx, _mm512_set1_epi16(64)), lo, hi);
  }
};
#endif

// f(v0, .., v{kG-1}): lane i of v_e is p[i * kG + e].
template <int kG, class D, class F>
HWY_INLINE void Deinterleaved(D d, const hn::TFromD<D>* HWY_RESTRICT p, F f) {
  if constexpr (kG == 1) {
    f(hn::LoadU(d, p));
  } else if constexpr (kG == 2) {
    hn::Vec<D> v0, v1;
    hn::LoadInterleaved2(d, p, v0, v1);
    f(v0, v1);
  } else if constexpr (kG == 3) {
    hn::Vec<D> v0, v1, v2;
    hn::LoadInterleaved3(d, p, v0, v1, v2);
    f(v0, v1, v2);
  } else {
    static_assert(kG == 4, "one to four entries per token");
    hn::Vec<D> v0, v1, v2, v3;
    hn::LoadInterleaved4(d, p, v0, v1, v2, v3);
    f(v0, v1, v2, v3);
  }
}

// f(integral_constant<kG>) for g in 1 .. 4; nothing for other g (the
// callers' scalar loops then take every token).
template <class F>
HWY_INLINE void WithEntries(std::int64_t g, F f) {
  switch (g) {
    case 1:
      return f(std::integral_constant<int, 1>());
    case 2:
      return f(std::integral_constant<int, 2>());
    case 3:
      return f(std::integral_constant<int, 3>());
    case 4:
      return f(std::integral_constant<int, 4>());
    default:
      return;
  }
}

// The kG entries of Lanes(d) tokens as floats into out (token-major).
template <int kG, class D>
HWY_INLINE void EntriesToFloats(D d, const half_bits* HWY_RESTRICT x, float* HWY_RESTRICT out) {
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  if constexpr (kHardwareHalf) {
    const hn::Rebind<hwy::float16_t, D> dh;
    for (int k = 0; k < kG; ++k)
      hn::Store(hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(x + k * N))), d, out + k * N);
  } else {
    for (std::int64_t i = 0; i < kG * N; ++i) out[i] = half_to_float(x[i]);
  }
}

// f(v_0, .., v_{kG-1}) with lane i of v_e entry e of token i of the
// Lanes(d) tokens at x (token-major halves), as floats.
#if KVCAL_TABLE128
// On AVX-512, a whole vector's kG * 16 halves (at most 128 bytes) sit in two
// registers, and one VPERMT2W puts entries 2p and 2p + 1 of the 16 tokens in
// the two halves of a register, converted half by half: no round trip
// through memory and no float transposes (EntriesToFloats, then
// Deinterleaved, took 4 stores, 4 loads and about 12 shuffles for kG = 4).
template <int kG>
struct HalfPairIndex {  // v[p][k]: the half for lane k % 16 of entry 2p + k / 16
  alignas(64) std::uint16_t v[2][32];
  constexpr HalfPairIndex() : v{} {
    for (int p = 0; p < 2; ++p)
      for (int k = 0; k < 32; ++k) v[p][k] = static_cast<std::uint16_t>(k % 16 * kG + std::min(2 * p + k / 16, kG - 1));
  }
};
template <int kG>
inline constexpr HalfPairIndex<kG> kHalfPairIndex{};
#endif
#if KVCAL_TABLE128
// f(v_0, .., v_{kG-1}) for 16 tokens' kG >= 2 entries (token-major halves),
// tokens 0-7 in lo and 8-15 in hi for kG >= 3, all in lo for kG = 2.
template <int kG, class F>
HWY_INLINE void EntryPairs(__m512i lo, __m512i hi, F f) {
  const auto lo16 = [](__m512i w) { return hn::Vec<DF>{_mm512_cvtph_ps(_mm512_castsi512_si256(w))}; };
  const auto hi16 = [](__m512i w) { return hn::Vec<DF>{_mm512_cvtph_ps(_mm512_extracti64x4_epi64(w, 1))}; };
  const auto pair = [&](int p) {
    return _mm512_permutex2var_epi16(lo, _mm512_load_si512(kHalfPairIndex<kG>.v[p]), hi);
  };
  const __m512i w0 = pair(0);
  if constexpr (kG == 2) {
    f(lo16(w0), hi16(w0));
  } else {
    const __m512i w1 = pair(1);
    if constexpr (kG == 3)
      f(lo16(w0), hi16(w0), lo16(w1));
    else
      f(lo16(w0), hi16(w0), lo16(w1), hi16(w1));
  }
}
#endif
template <int kG, class D, class F>
HWY_INLINE void EntryVectors(D d, const half_bits* HWY_RESTRICT x, F f) {
#if KVCAL_TABLE128
  if constexpr (std::is_same_v<D, DF>) {
    static_assert(kMaxLanes == 16, "AVX-512: 16 float lanes");
    if constexpr (kG == 1) {
      f(hn::Vec<DF>{_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)))});
    } else {
      const __m512i lo = _mm512_loadu_si512(x);
      const __m512i hi = kG == 4   ? _mm512_loadu_si512(x + 32)
                         : kG == 3 ? _mm512_maskz_loadu_epi16(0xffffu, x + 32)
                                   : _mm512_setzero_si512();
      EntryPairs<kG>(lo, hi, f);
    }
    return;
  }
#endif
  HWY_ALIGN float xf[4 * kMaxLanes];
  EntriesToFloats<kG>(d, x, xf);
  Deinterleaved<kG>(d, xf, f);
}

// Tokens [0, n) in vectors: f(d, i, fresh) for the Lanes(d) tokens from i,
// d the widest float vector (whole, half or quarter on 512-bit targets)
// that n fills; the last vector ends at n and overlaps the one before
// where n is not a multiple of its lanes (its first Lanes - fresh lanes
// done already). Returns the tokens done: n, or 0 where n is shorter than
// the narrowest (the caller's scalar loop).
template <class F>
HWY_INLINE std::int64_t Vectors(std::int64_t n, F f) {
  const auto go = [&](auto d) {
    const auto N = static_cast<std::int64_t>(hn::Lanes(d));
    std::int64_t i = 0;
    for (; i + N <= n; i += N) f(d, i, N);
    if (i < n) f(d, n - N, n - i);
    return n;
  };
  const DF df;
  if (n >= static_cast<std::int64_t>(hn::Lanes(df))) return go(df);
  if constexpr (hn::MaxLanes(df) > 8) {
    if (n >= 8) return go(hn::CappedTag<float, 8>());
  }
  if constexpr (hn::MaxLanes(df) > 4) {
    if (n >= 4) return go(hn::CappedTag<float, 4>());
  }
  return 0;
}
#endif  // HWY_TARGET != HWY_SCALAR

// out[e * os + i] = x[i * g + e] - b[idx[i * g + e]] for i < n, e < g
// (x as halves).
HWY_FLATTEN void KeyEntryDiffs(const float* HWY_RESTRICT b, std::int64_t b_size, const std::int32_t* HWY_RESTRICT idx,
                               const half_bits* HWY_RESTRICT x, std::int64_t n, std::int64_t g, float* HWY_RESTRICT out,
                               std::int64_t os) {
  std::int64_t done = 0;
#if HWY_TARGET != HWY_SCALAR
  const auto diffs = [&](auto kg, const auto& lookup) KVCAL_ENTRY_INLINE {
    constexpr int kG = decltype(kg)::value;
    // Each output depends on its own token only: an overlapping last vector
    // writes its repeated lanes again with the same values.
    done = Vectors(n, [&](auto d, std::int64_t i, std::int64_t) KVCAL_ENTRY_INLINE {
      const hn::RebindToSigned<decltype(d)> di;
      HWY_ALIGN float xf[4 * kMaxLanes];
      EntriesToFloats<kG>(d, x + i * kG, xf);
      Deinterleaved<kG>(d, xf, [&](auto... xv) {
        Deinterleaved<kG>(di, idx + i * kG, [&](auto... iv) {
          std::int64_t e = 0;
          (hn::StoreU(hn::Sub(xv, lookup(d, iv)), d, out + (e++) * os + i), ...);
        });
      });
    });
  };
  WithEntries(g, [&](auto kg) {
#if KVCAL_TABLE128
    if (b_size <= 128) return diffs(kg, Table128(b, b_size));
#endif
    diffs(kg, Gather{b});
  });
#endif
  (void)b_size;
  for (std::int64_t i = done; i < n; ++i)
    for (std::int64_t e = 0; e < g; ++e) out[e * os + i] = half_to_float(x[i * g + e]) - b[idx[i * g + e]];
}

// out[e * os + i] = x[i * g + e] - params[2 i + 1] for i < n, e < g (x as
// halves).
HWY_FLATTEN void ValueEntryDiffs(const float* HWY_RESTRICT params, const half_bits* HWY_RESTRICT x, std::int64_t n,
                                 std::int64_t g, float* HWY_RESTRICT out, std::int64_t os) {
  std::int64_t done = 0;
#if HWY_TARGET != HWY_SCALAR
  WithEntries(g, [&](auto kg) {
    constexpr int kG = decltype(kg)::value;
    done = Vectors(n, [&](auto d, std::int64_t i, std::int64_t) KVCAL_ENTRY_INLINE {
      HWY_ALIGN float xf[4 * kMaxLanes];
      EntriesToFloats<kG>(d, x + i * kG, xf);
      hn::Vec<decltype(d)> delta, mn;
      hn::LoadInterleaved2(d, params + 2 * i, delta, mn);
      (void)delta;
      Deinterleaved<kG>(d, xf, [&](auto... xv) {
        std::int64_t e = 0;
        (hn::StoreU(hn::Sub(xv, mn), d, out + (e++) * os + i), ...);
      });
    });
  });
#endif
  for (std::int64_t i = done; i < n; ++i)
    for (std::int64_t e = 0; e < g; ++e) out[e * os + i] = half_to_float(x[i * g + e]) - params[2 * i + 1];
}

// The key side's entry weights of nq queries (KeyEntries, once per decode
// and head): out[j * n + k] = scale * q_j[idx[k]] for k < n, q_j = q + j *
// q_stride, dim floats (0 <= idx < dim). Looked up in registers where a
// query fits the 128-float table (Table128), gathered otherwise.
void EntryQueryWeights(const float* HWY_RESTRICT q, std::int64_t nq, std::int64_t q_stride, std::int64_t dim,
                       float scale, const std::int32_t* HWY_RESTRICT idx, std::int64_t n, float* HWY_RESTRICT out) {
  for (std::int64_t j = 0; j < nq; ++j) {
    const float* qj = q + j * q_stride;
    float* oj = out + j * n;
    std::int64_t k = 0;
#if HWY_TARGET != HWY_SCALAR
    const auto rows = [&](const auto& lookup) KVCAL_ENTRY_INLINE {
      const DF df;
      const hn::RebindToSigned<DF> di;
      const auto N = static_cast<std::int64_t>(hn::Lanes(df));
      const auto sv = hn::Set(df, scale);
      for (; k + N <= n; k += N) hn::StoreU(hn::Mul(sv, lookup(df, hn::LoadU(di, idx + k))), df, oj + k);
    };
#if KVCAL_TABLE128
    if (dim <= 128)
      rows(Table128(qj, dim));
    else
      rows(Gather{qj});
#else
    (void)dim;
    rows(Gather{qj});
#endif
#else
    (void)dim;
#endif
    for (; k < n; ++k) oj[k] = scale * qj[idx[k]];
  }
}

// out[i] += sum_{e < g} a[e * as + i] * x[e * xs + i], each product added
// to the running sum in entry order.
void EntryScores(const float* HWY_RESTRICT a, std::int64_t as, const float* HWY_RESTRICT x, std::int64_t xs,
                 std::int64_t n, std::int64_t g, float* HWY_RESTRICT out) {
  std::int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  for (; i + N <= n; i += N) {
    auto s = hn::LoadU(df, out + i);
    for (std::int64_t e = 0; e < g; ++e)
      s = hn::MulAdd(hn::LoadU(df, a + e * as + i), hn::LoadU(df, x + e * xs + i), s);
    hn::StoreU(s, df, out + i);
  }
#endif
  for (; i < n; ++i) {
    float t = out[i];
    for (std::int64_t e = 0; e < g; ++e) t = std::fma(a[e * as + i], x[e * xs + i], t);
    out[i] = t;
  }
}

// y[e * ys + i] += p[i] * x[e * xs + i] for i < n, e < g.
void GroupAxpy(const float* HWY_RESTRICT p, std::int64_t n, std::int64_t g, const float* HWY_RESTRICT x,
               std::int64_t xs, float* HWY_RESTRICT y, std::int64_t ys) {
  std::int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  for (; i + N <= n; i += N) {
    const auto w = hn::LoadU(df, p + i);
    for (std::int64_t e = 0; e < g; ++e)
      hn::StoreU(hn::MulAdd(w, hn::LoadU(df, x + e * xs + i), hn::LoadU(df, y + e * ys + i)), df, y + e * ys + i);
  }
#endif
  for (; i < n; ++i)
    for (std::int64_t e = 0; e < g; ++e) y[e * ys + i] += p[i] * x[e * xs + i];
}

// a[i] = p[i] * params[2i]; returns sum_i p[i] * params[2i + 1]. The last
// vector overlaps the one before: its repeated lanes' products are written
// again alike and left out of the sum.
HWY_FLATTEN float ValueWeights(const float* HWY_RESTRICT params, const float* HWY_RESTRICT p, std::int64_t n,
                               float* HWY_RESTRICT a) {
  std::int64_t done = 0;
  float s = 0;
#if HWY_TARGET != HWY_SCALAR
  const DF df;
  auto sv = hn::Zero(df);
  done = Vectors(n, [&](auto d, std::int64_t i, std::int64_t fresh) KVCAL_ENTRY_INLINE {
    const auto N = static_cast<std::int64_t>(hn::Lanes(d));
    auto pv = hn::LoadU(d, p + i);
    hn::Vec<decltype(d)> dl, mn;
    hn::LoadInterleaved2(d, params + 2 * i, dl, mn);
    hn::StoreU(hn::Mul(pv, dl), d, a + i);
    if (fresh < N) pv = hn::IfThenZeroElse(hn::FirstN(d, static_cast<std::size_t>(N - fresh)), pv);
    if constexpr (std::is_same_v<decltype(d), DF>)
      sv = hn::MulAdd(pv, mn, sv);
    else
      s += hn::GetLane(hn::SumOfLanes(d, hn::Mul(pv, mn)));
  });
  s += hn::GetLane(hn::SumOfLanes(df, sv));
#endif
  for (std::int64_t i = done; i < n; ++i) {
    a[i] = p[i] * params[2 * i];
    s += p[i] * params[2 * i + 1];
  }
  return s;
}

// Calls f(t0, n, qr0) for each run of quantized tokens [t0, t0 + n) of a
// block of `tokens` tokens between its nk kept ones (kept: their positions,
// ascending), qr0 the quantized row of t0 (TokenRuns).
template <class F>
HWY_INLINE void Runs(const std::uint16_t* HWY_RESTRICT kept, std::int64_t nk, std::int64_t tokens, F f) {
  for (TokenRuns s{kept, nk, tokens}; s.next();)
    if (s.n > 0) f(s.t0, s.n, s.qr0);
}

#if KVCAL_TABLE128
// The quantized tokens of a block in whole vectors of 16 tokens on AVX-512,
// across its kept tokens, one vector per next(f): f(t, r, m, full, lo, hi)
// for tokens [t, t + 16), r the quantized row of the first lane of m, the
// lanes of quantized tokens (kept tokens and those past the block clear),
// lo/hi their kG (2 or 4) entries as EntryPairs takes them, expanded from
// consecutive rows (0 in clear lanes); false once no vector is left. The
// runs' overlapping last vectors (7 vectors for a block of 96 tokens with
// two kept, and a call per run) are gone: see KeyRunScores.
// full (std::true_type when m has every lane, std::false_type otherwise)
// lets f load its per-row arrays with plain loads where no lane is clear:
// most vectors of a block, as few tokens are kept. An expanding load from
// memory costs about 6 cycles of throughput on Zen 4 against 2 for a plain
// one (a loop of 16-lane loads: 1.9 against 0.55 ns a vector), and the two
// passes made 7 (one query) to 10 (four) of them per vector of 16 tokens.
template <int kG>
struct ExpandedCursor {
  static_assert(kG == 2 || kG == 4, "a token's entries in one 32- or 64-bit lane");
  const half_bits* HWY_RESTRICT x;
  const std::uint16_t* HWY_RESTRICT kept;
  std::int64_t nk, tokens;
  std::int64_t t = 0, k = 0, r = 0;
  template <class F>
  HWY_INLINE bool next(F&& f) {
    for (; t < tokens; t += 16) {
      std::uint32_t m = tokens - t >= 16 ? 0xffffu : (1u << (tokens - t)) - 1u;
      for (; k < nk && kept[k] < t + 16; ++k) m &= ~(1u << (kept[k] - t));
      if (m == 0) continue;
      const std::int64_t t0 = t, r0 = r;
      t += 16;
      if (m == 0xffffu) {
        const __m512i lo = _mm512_loadu_si512(x + r0 * kG);
        const __m512i hi = kG == 4 ? _mm512_loadu_si512(x + r0 * kG + 32) : _mm512_setzero_si512();
        r += 16;
        f(t0, r0, static_cast<__mmask16>(0xffffu), std::true_type{}, lo, hi);  // a constant mask: plain moves
        return true;
      }
      __m512i lo, hi;
      if constexpr (kG == 4) {
        const auto m0 = static_cast<__mmask8>(m & 0xffu), m1 = static_cast<__mmask8>(m >> 8);
        lo = _mm512_maskz_expandloadu_epi64(m0, x + r0 * 4);
        hi = _mm512_maskz_expandloadu_epi64(m1, x + (r0 + __builtin_popcount(m0)) * 4);
      } else {
        lo = _mm512_maskz_expandloadu_epi32(static_cast<__mmask16>(m), x + r0 * 2);
        hi = _mm512_setzero_si512();
      }
      r += __builtin_popcount(m);
      f(t0, r0, static_cast<__mmask16>(m), std::false_type{}, lo, hi);
      return true;
    }
    return false;
  }
};
template <int kG, class F>
HWY_INLINE void ExpandedVectors(const half_bits* HWY_RESTRICT x, const std::uint16_t* HWY_RESTRICT kept,
                                std::int64_t nk, std::int64_t tokens, F f) {
  for (ExpandedCursor<kG> c{x, kept, nk, tokens}; c.next(f);) {
  }
}
#endif

#if KVCAL_TABLE128
// KeyRunScores' path on AVX-512 for 2 or 4 entries a token (see
// key_run_scores): whole vectors across the kept tokens, masked loads and
// stores per token, expanded loads per quantized row; one vector of 16
// tokens, every query, per next(). In this form (the walk's state and the
// job's fields in a struct, against lambdas over the function's locals and
// a loop with the walk inside) the same operations took 20% less time:
// bench_kernels run_entries/keys on a 2-vCPU Intel Xeon guest (AVX3_DL),
// interleaved runs of 5, group 1 114-117 -> 96-99 ns, group 4 168-173 ->
// 134-141 ns.
// The job is a copy of its own: through the caller's reference GCC loaded
// its fields again after every store of scores (bench_kernels
// run_entries/keys, Zen 5, 2 interleaved runs: group 4 112-113 -> 91-92 ns,
// group 1 48-50 -> 45-47 ns; the queries' loop unrolled at compile time
// besides was no faster).
template <int kG, class Lookup>
struct KeyRunPass {
  const KeyRunJob job;
  Lookup lookup;
  ExpandedCursor<kG> cursor;
  KeyRunPass(const KeyRunJob& j, const Lookup& l) : job(j), lookup(l), cursor{j.x, j.kept, j.nk, j.tokens} {}
  // The next vector with quantized tokens; false once the block is done.
  HWY_INLINE bool next() {
    return cursor.next(
        [&](std::int64_t t, std::int64_t r, __mmask16 m, auto full, __m512i lo, __m512i hi) KVCAL_ENTRY_INLINE {
          const DF d;
          const auto queries = [&](auto... diff) KVCAL_ENTRY_INLINE {
            for (std::int64_t j = 0; j < job.nq; ++j) {
              __m512 c;
              if constexpr (decltype(full)::value)
                c = job.qi ? _mm512_cvtepi32_ps(_mm512_loadu_si512(job.qi + j * job.cs + r))
                           : _mm512_loadu_ps(job.qf + j * job.cs + r);
              else
                c = job.qi ? _mm512_cvtepi32_ps(_mm512_maskz_expandloadu_epi32(m, job.qi + j * job.cs + r))
                           : _mm512_maskz_expandloadu_ps(m, job.qf + j * job.cs + r);
              const auto code = job.qi ? hn::Mul(hn::Set(d, job.w[j]), hn::Vec<DF>{c}) : hn::Vec<DF>{c};
              auto s = hn::Add(hn::Set(d, job.bias[j]), code);
              const float* aj = job.a + j * kG * job.as + t;
              std::int64_t e = 0;
              ((s = hn::MulAdd(hn::Vec<DF>{_mm512_maskz_loadu_ps(m, aj + (e++) * job.as)}, diff, s)), ...);
              _mm512_mask_storeu_ps(job.out + j * job.os + t, m, s.raw);
            }
          };
          if constexpr (std::is_same_v<std::decay_t<decltype(lookup)>, HalfTable128>) {
            // The mins of the vector's entries as halves, by entry pair
            // (idx16: entries 2p and 2p + 1 of the 16 tokens in one register).
            const auto pair = [&](int p) {
              return lookup(_mm512_loadu_si512(job.idx16 + t * kG + 32 * static_cast<std::int64_t>(p)));
            };
            EntryPairs<kG>(lo, hi, [&](auto... xv) KVCAL_ENTRY_INLINE {
              const __m512i m0 = pair(0), m1 = kG == 4 ? pair(1) : m0;
              const hn::Vec<DF> mins[4] = {hn::Vec<DF>{_mm512_cvtph_ps(_mm512_castsi512_si256(m0))},
                                           hn::Vec<DF>{_mm512_cvtph_ps(_mm512_extracti64x4_epi64(m0, 1))},
                                           hn::Vec<DF>{_mm512_cvtph_ps(_mm512_castsi512_si256(m1))},
                                           hn::Vec<DF>{_mm512_cvtph_ps(_mm512_extracti64x4_epi64(m1, 1))}};
              [&]<std::size_t... kE>(std::index_sequence<kE...>) KVCAL_ENTRY_INLINE {
                queries(hn::Sub(xv, mins[kE])...);
              }
              (std::make_index_sequence<kG>());
            });
          } else {
            EntryPairs<kG>(lo, hi, [&](auto... xv) KVCAL_ENTRY_INLINE {
              [&]<std::size_t... kE>(std::index_sequence<kE...>) KVCAL_ENTRY_INLINE {
                queries(hn::Sub(xv, lookup(d, hn::Vec<hn::RebindToSigned<DF>>{_mm512_maskz_loadu_epi32(
                                                  m, job.idx + static_cast<std::int64_t>(kE) * job.is + t)}))...);
              }
              (std::make_index_sequence<kG>());
            });
          }
        });
  }
};
#endif

// The key side of a block's quantized tokens, for nq queries at once (token
// t of the block, quantized row r; the kept tokens' outputs untouched):
//   out[j * os + t] = bias[j] + code_j(r)
//                     + sum_{e < g} a[(j * g + e) * as + t] * (x[r * g + e] - b[idx[e * is + t]])
// with code_j(r) = w[j] * qi[j * cs + r] (integer sums; qi non-null) or
// qf[j * cs + r], the products added in entry order. The differences are
// made once per vector of tokens and kept in registers for every query:
// KeyEntryDiffs, then EntryScores and the code part per query, wrote them
// out and read them back, and made three passes over the run. One call per
// block: a call per run (three in a block of 96 with two kept tokens) spent
// half the time of one query's entries on the calls' set-up and the runs'
// overlapping last vectors (bench_kernels run_entries on a Zen 5 host, group
// 1 / 4, ns: a call per run 150 / 260, runs walked here 121 / 238, whole
// vectors across the kept tokens on AVX-512 (ExpandedVectors) 104 / 203).
HWY_FLATTEN void KeyRunScores(const KeyRunJob& job) {
  const float* HWY_RESTRICT b = job.b;
  const std::int32_t* HWY_RESTRICT idx = job.idx;
  const half_bits* HWY_RESTRICT x = job.x;
  const std::uint16_t* HWY_RESTRICT kept = job.kept;
  const float* HWY_RESTRICT bias = job.bias;
  const float* HWY_RESTRICT w = job.w;
  const std::int32_t* HWY_RESTRICT qi = job.qi;
  const float* HWY_RESTRICT qf = job.qf;
  const float* HWY_RESTRICT a = job.a;
  float* HWY_RESTRICT out = job.out;
  const std::int64_t b_size = job.b_size, is = job.is, nk = job.nk, tokens = job.tokens, g = job.g, nq = job.nq,
                     cs = job.cs, as = job.as, os = job.os;
  const std::uint16_t* idx16 = job.idx16;
  // Tokens [t0 + from, t0 + n) of the run at t0 (quantized row qr0), one by one.
  const auto scalar = [&](std::int64_t t0, std::int64_t n, std::int64_t qr0, std::int64_t from) {
    for (std::int64_t j = 0; j < nq; ++j)
      for (std::int64_t i = from; i < n; ++i) {
        const std::int64_t t = t0 + i, r = qr0 + i;
        const float code = qi ? w[j] * static_cast<float>(qi[j * cs + r]) : qf[j * cs + r];
        float s = bias[j] + code;
        for (std::int64_t e = 0; e < g; ++e)
          s = std::fma(a[(j * g + e) * as + t], half_to_float(x[r * g + e]) - b[idx[e * is + t]], s);
        out[j * os + t] = s;
      }
  };
  bool vectors = false;
#if HWY_TARGET != HWY_SCALAR
  const auto block = [&](auto kg, const auto& lookup) KVCAL_ENTRY_INLINE {
    constexpr int kG = decltype(kg)::value;
    Runs(kept, nk, tokens, [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) KVCAL_ENTRY_INLINE {
      // Each output depends on its own token only: an overlapping last
      // vector writes its repeated lanes again with the same values.
      const std::int64_t done = Vectors(n, [&](auto d, std::int64_t i, std::int64_t) KVCAL_ENTRY_INLINE {
        const hn::RebindToSigned<decltype(d)> di;
        const std::int64_t t = t0 + i, r = qr0 + i;
        const auto queries = [&](auto... diff) KVCAL_ENTRY_INLINE {
          for (std::int64_t j = 0; j < nq; ++j) {
            const auto code = qi ? hn::Mul(hn::Set(d, w[j]), hn::ConvertTo(d, hn::LoadU(di, qi + j * cs + r)))
                                 : hn::LoadU(d, qf + j * cs + r);
            auto s = hn::Add(hn::Set(d, bias[j]), code);
            const float* aj = a + j * kG * as + t;
            std::int64_t e = 0;
            ((s = hn::MulAdd(hn::LoadU(d, aj + (e++) * as), diff, s)), ...);
            hn::StoreU(s, d, out + j * os + t);
          }
        };
        EntryVectors<kG>(d, x + r * kG, [&](auto... xv) KVCAL_ENTRY_INLINE {
          [&]<std::size_t... kE>(std::index_sequence<kE...>) KVCAL_ENTRY_INLINE {
            queries(hn::Sub(xv, lookup(d, hn::LoadU(di, idx + static_cast<std::int64_t>(kE) * is + t)))...);
          }
          (std::make_index_sequence<kG>());
        });
      });
      scalar(t0, n, qr0, done);
    });
  };
#if KVCAL_TABLE128
  // Whole vectors across the kept tokens (KeyRunPass).
  const auto expanded = [&](auto kg, const auto& lookup) KVCAL_ENTRY_INLINE {
    for (KeyRunPass<decltype(kg)::value, std::decay_t<decltype(lookup)>> pass(job, lookup); pass.next();) {
    }
  };
#endif
  WithEntries(g, [&](auto kg) {
    vectors = true;
#if KVCAL_TABLE128
    // The runs (block) instantiated only where the expanded path does not
    // take the block.
    if constexpr (decltype(kg)::value == 2 || decltype(kg)::value == 4) {
      if (b_size <= 128 && idx16) return expanded(kg, HalfTable128(b, b_size));
      if (b_size <= 128) return expanded(kg, Table128(b, b_size));
      return expanded(kg, Gather{b});
    } else {
      if (b_size <= 128) return block(kg, Table128(b, b_size));
      return block(kg, Gather{b});
    }
#else
    block(kg, Gather{b});
#endif
  });
#endif
  (void)b_size;
  (void)idx16;
  if (!vectors)
    Runs(kept, nk, tokens, [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) { scalar(t0, n, qr0, 0); });
}

// The value side of a block's quantized tokens (as KeyRunScores: token t,
// quantized row r; the kept tokens' y untouched), for nq <= kRunQueries
// queries at once in vectors (p_j = p + j * ps; params[2r] = delta_r,
// params[2r + 1] = min_r):
//   a[j * as + r] = p_j[t] * delta_r,  base[j] += sum_r p_j[t] * min_r,
//   y[(j * g + e) * ys + t] += p_j[t] * (x[r * g + e] - min_r).
// The differences once per vector of tokens for every query (ValueEntryDiffs,
// then ValueWeights and GroupAxpy per query, made three passes); one call
// per block, as KeyRunScores.
HWY_FLATTEN void ValueRunWeights(const float* HWY_RESTRICT params, const half_bits* HWY_RESTRICT x,
                                 const std::uint16_t* HWY_RESTRICT kept, std::int64_t nk, std::int64_t tokens,
                                 std::int64_t g, std::int64_t nq, const float* HWY_RESTRICT p, std::int64_t ps,
                                 float* HWY_RESTRICT a, std::int64_t as, float* HWY_RESTRICT y, std::int64_t ys,
                                 float* HWY_RESTRICT base, float* HWY_RESTRICT amax) {
  for (std::int64_t j = 0; j < nq; ++j) amax[j] = 0.0f;
  const auto scalar = [&](std::int64_t t0, std::int64_t n, std::int64_t qr0, std::int64_t from) {
    if (from >= n) return;
    for (std::int64_t j = 0; j < nq; ++j) {
      float s = 0.0f;
      for (std::int64_t i = from; i < n; ++i) {
        const std::int64_t t = t0 + i, r = qr0 + i;
        const float pv = p[j * ps + t];
        a[j * as + r] = pv * params[2 * r];
        amax[j] = std::max(amax[j], std::fabs(a[j * as + r]));
        s += pv * params[2 * r + 1];
        for (std::int64_t e = 0; e < g; ++e)
          y[(j * g + e) * ys + t] += pv * (half_to_float(x[r * g + e]) - params[2 * r + 1]);
      }
      base[j] += s;
    }
  };
  bool vectors = false;
#if HWY_TARGET != HWY_SCALAR
  if (nq <= kRunQueries) {
    const DF df;
    const auto NF = static_cast<std::int64_t>(hn::Lanes(df));
    HWY_ALIGN float sums[kRunQueries * kMaxLanes];   // per query, its lanes' sums of p * min
    HWY_ALIGN float maxes[kRunQueries * kMaxLanes];  // and their largest |p * delta|
    // Zeroed only where they are used, a vector per query and array. (Both
    // a loop of floats and a loop of zero vectors became two `rep stos`,
    // whose start-up alone had 7-11% of this kernel's samples in profiles
    // of hex4@int8 decode at a group of 4; the zero kept opaque to the
    // compiler, the loop stays stores.)
    const auto zero_sums = [&] {
      auto z = hn::Zero(df);
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && (defined(__GNUC__) || defined(__clang__))
      asm("" : "+x"(z.raw));
#endif
      for (std::int64_t j = 0; j < nq; ++j) {
        hn::Store(z, df, sums + j * NF);
        hn::Store(z, df, maxes + j * NF);
      }
    };
    // The runs of quantized tokens between the kept ones, as KeyRunScores.
    const auto block = [&](auto kg) KVCAL_ENTRY_INLINE {
      constexpr int kG = decltype(kg)::value;
      zero_sums();
      Runs(kept, nk, tokens, [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) KVCAL_ENTRY_INLINE {
        const std::int64_t done = Vectors(n, [&](auto d, std::int64_t i, std::int64_t fresh) KVCAL_ENTRY_INLINE {
          const auto N = static_cast<std::int64_t>(hn::Lanes(d));
          const std::int64_t t = t0 + i, r = qr0 + i;
          hn::Vec<decltype(d)> dl, mn;
          hn::LoadInterleaved2(d, params + 2 * r, dl, mn);
          // The overlapping last vector's repeated lanes: their weights
          // written again alike, left out of the sums.
          const auto again = hn::FirstN(d, static_cast<std::size_t>(N - fresh));
          const auto queries = [&](auto... diff) KVCAL_ENTRY_INLINE {
            for (std::int64_t j = 0; j < nq; ++j) {
              auto pv = hn::LoadU(d, p + j * ps + t);
              const auto w = hn::Mul(pv, dl);
              hn::StoreU(w, d, a + j * as + r);
              float* mj = maxes + j * NF;  // repeated lanes: the same weights again
              hn::Store(hn::Max(hn::Load(d, mj), hn::Abs(w)), d, mj);
              if (fresh < N) pv = hn::IfThenZeroElse(again, pv);
              float* sj = sums + j * NF;
              hn::Store(hn::MulAdd(pv, mn, hn::Load(d, sj)), d, sj);
              float* yj = y + j * kG * ys + t;
              std::int64_t e = 0;
              ((hn::StoreU(hn::MulAdd(pv, diff, hn::LoadU(d, yj + e * ys)), d, yj + e * ys), ++e), ...);
            }
          };
          EntryVectors<kG>(d, x + r * kG, [&](auto... xv) KVCAL_ENTRY_INLINE { queries(hn::Sub(xv, mn)...); });
        });
        scalar(t0, n, qr0, done);
      });
    };
#if KVCAL_TABLE128
    // kq: the number of queries fixed at compile time (1 or 2),
    // the lanes' sums and maxima then kept in registers, or 0: nq at run
    // time, its sums and maxima in memory (sums, maxes) from vector to
    // vector. The same operations in the same order either way.
    const auto expanded = [&](auto kg, auto kq) KVCAL_ENTRY_INLINE {
      constexpr int kG = decltype(kg)::value;
      constexpr int kQ = decltype(kq)::value;
      const std::int64_t queries_n = kQ > 0 ? kQ : nq;
      hn::Vec<DF> vsum[kQ > 0 ? kQ : 1], vmax[kQ > 0 ? kQ : 1];
      for (int j = 0; j < (kQ > 0 ? kQ : 1); ++j) vsum[j] = vmax[j] = hn::Zero(df);
      if constexpr (kQ == 0) zero_sums();
      // Whole vectors across the kept tokens (ExpandedVectors): p, y
      // masked per token (0 in clear lanes, which then add nothing to the
      // sums), the (delta, min) pairs expanded per quantized row, a
      // compressed back to its rows.
      alignas(64) static constexpr std::int32_t kEven[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
      alignas(64) static constexpr std::int32_t kOdd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
      const __m512i even = _mm512_load_si512(kEven), odd = _mm512_load_si512(kOdd);
      ExpandedVectors<kG>(
          x, kept, nk, tokens,
          [&](std::int64_t t, std::int64_t r, __mmask16 m, auto full, __m512i lo, __m512i hi) KVCAL_ENTRY_INLINE {
            __m512 p0, p1;
            if constexpr (decltype(full)::value) {
              p0 = _mm512_loadu_ps(params + 2 * r);
              p1 = _mm512_loadu_ps(params + 2 * r + 16);
            } else {
              const auto m0 = static_cast<__mmask8>(m & 0xffu);
              p0 = _mm512_castsi512_ps(_mm512_maskz_expandloadu_epi64(m0, params + 2 * r));
              p1 = _mm512_castsi512_ps(_mm512_maskz_expandloadu_epi64(static_cast<__mmask8>(m >> 8),
                                                                      params + 2 * (r + __builtin_popcount(m0))));
            }
            const hn::Vec<DF> dl{_mm512_permutex2var_ps(p0, even, p1)}, mn{_mm512_permutex2var_ps(p0, odd, p1)};
            const auto rows = static_cast<__mmask16>((1u << __builtin_popcount(m)) - 1u);
            const auto queries = [&](auto... diff) KVCAL_ENTRY_INLINE {
              for (std::int64_t j = 0; j < queries_n; ++j) {
                const hn::Vec<DF> pv{_mm512_maskz_loadu_ps(m, p + j * ps + t)};
                const auto w = hn::Mul(pv, dl);  // 0 in clear lanes
                if constexpr (decltype(full)::value)
                  _mm512_storeu_ps(a + j * as + r, w.raw);
                else
                  _mm512_mask_storeu_ps(a + j * as + r, rows, _mm512_maskz_compress_ps(m, w.raw));
                if constexpr (kQ > 0) {
                  vmax[j] = hn::Max(vmax[j], hn::Abs(w));
                  vsum[j] = hn::MulAdd(pv, mn, vsum[j]);
                } else {
                  float* mj = maxes + j * NF;
                  hn::Store(hn::Max(hn::Load(df, mj), hn::Abs(w)), df, mj);
                  float* sj = sums + j * NF;
                  hn::Store(hn::MulAdd(pv, mn, hn::Load(df, sj)), df, sj);
                }
                float* yj = y + j * kG * ys + t;
                std::int64_t e = 0;
                ((_mm512_mask_storeu_ps(yj + e * ys, m,
                                        hn::MulAdd(pv, diff, hn::Vec<DF>{_mm512_maskz_loadu_ps(m, yj + e * ys)}).raw),
                  ++e),
                 ...);
              }
            };
            EntryPairs<kG>(lo, hi, [&](auto... xv) KVCAL_ENTRY_INLINE { queries(hn::Sub(xv, mn)...); });
          });
      if constexpr (kQ > 0)  // for the reduction below, as the memory form leaves them
        for (int j = 0; j < kQ; ++j) {
          hn::Store(vsum[j], df, sums + j * NF);
          hn::Store(vmax[j], df, maxes + j * NF);
        }
    };
#endif
    WithEntries(g, [&](auto kg) {
      vectors = true;
#if KVCAL_TABLE128
      // The runs (block) instantiated only where the expanded path does
      // not take the block.
      if constexpr (decltype(kg)::value == 2 || decltype(kg)::value == 4) {
        // One or two queries with their sums and maxima in registers, not
        // read and written back to memory every vector (bench_kernels
        // run_entries/values, Zen 4 guest, 3 interleaved runs: one query
        // 99-115 -> 59-81 ns). For four queries in registers the kernel
        // was no faster (192-220 -> 194-291 ns) and the decode at a group
        // of 4 took up to 7% more time, so three or more keep theirs in
        // memory.
        switch (nq) {
          case 1:
            return expanded(kg, std::integral_constant<int, 1>{});
          case 2:
            return expanded(kg, std::integral_constant<int, 2>{});
          default:
            return expanded(kg, std::integral_constant<int, 0>{});
        }
      } else {
        block(kg);
      }
#else
      block(kg);
#endif
    });
    if (vectors)
      for (std::int64_t j = 0; j < nq; ++j) {
        base[j] += hn::GetLane(hn::SumOfLanes(df, hn::Load(df, sums + j * NF)));
        amax[j] = std::max(amax[j], hn::GetLane(hn::MaxOfLanes(df, hn::Load(df, maxes + j * NF))));
      }
  }
#endif
  if (!vectors)
    Runs(kept, nk, tokens, [&](std::int64_t t0, std::int64_t n, std::int64_t qr0) { scalar(t0, n, qr0, 0); });
}

}  // namespace HWY_NAMESPACE
}  // namespace kvcal::runtime::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvcal::runtime::detail {

HWY_EXPORT(KeyEntryDiffs);
HWY_EXPORT(ValueEntryDiffs);
HWY_EXPORT(EntryScores);
HWY_EXPORT(GroupAxpy);
HWY_EXPORT(ValueWeights);
HWY_EXPORT(KeyRunScores);
HWY_EXPORT(ValueRunWeights);
HWY_EXPORT(EntryQueryWeights);

void key_entry_diffs(const float* b, std::int64_t b_size, const std::int32_t* idx, const half_bits* x, std::int64_t n,
                     std::int64_t g, float* out, std::int64_t out_stride) {
  HWY_DYNAMIC_DISPATCH(KeyEntryDiffs)(b, b_size, idx, x, n, g, out, out_stride);
}
void value_entry_diffs(const float* params, const half_bits* x, std::int64_t n, std::int64_t g, float* out,
                       std::int64_t out_stride) {
  HWY_DYNAMIC_DISPATCH(ValueEntryDiffs)(params, x, n, g, out, out_stride);
}
void entry_scores(const float* a, std::int64_t a_stride, const float* x, std::int64_t x_stride, std::int64_t n,
                  std::int64_t g, float* out) {
  HWY_DYNAMIC_DISPATCH(EntryScores)(a, a_stride, x, x_stride, n, g, out);
}
void group_axpy(const float* p, std::int64_t n, std::int64_t g, const float* x, std::int64_t x_stride, float* y,
                std::int64_t y_stride) {
  HWY_DYNAMIC_DISPATCH(GroupAxpy)(p, n, g, x, x_stride, y, y_stride);
}
float value_weights(const float* params, const float* p, std::int64_t n, float* a) {
  return HWY_DYNAMIC_DISPATCH(ValueWeights)(params, p, n, a);
}
void key_run_scores(const float* b, std::int64_t b_size, const std::int32_t* idx, std::int64_t idx_stride,
                    const std::uint16_t* idx16, const half_bits* x, const std::uint16_t* kept, std::int64_t kept_rows,
                    std::int64_t tokens, std::int64_t g, std::int64_t nq, const float* bias, const float* w,
                    const std::int32_t* qi, const float* qf, std::int64_t code_stride, const float* a,
                    std::int64_t a_stride, float* out, std::int64_t out_stride) {
  HWY_DYNAMIC_DISPATCH(KeyRunScores)
  (KeyRunJob{b,  b_size, idx, idx_stride, idx16, x,           kept, kept_rows, tokens, g,
             nq, bias,   w,   qi,         qf,    code_stride, a,    a_stride,  out,    out_stride});
}
void entry_channels16(const std::int32_t* idx, std::int64_t idx_stride, std::int64_t tokens, std::int64_t g,
                      std::vector<std::uint16_t>& out) {
  const std::int64_t vectors = (tokens + 15) / 16;
  out.assign(static_cast<std::size_t>(vectors * g * 16), 0);
  for (std::int64_t v = 0; v < vectors; ++v)
    for (std::int64_t e = 0; e < g; ++e)
      for (std::int64_t k = 0; k < 16 && 16 * v + k < tokens; ++k)
        out[static_cast<std::size_t>((v * g + e) * 16 + k)] =
            static_cast<std::uint16_t>(idx[e * idx_stride + 16 * v + k]);
}
void entry_query_weights(const float* q, std::int64_t nq, std::int64_t q_stride, std::int64_t dim, float scale,
                         const std::int32_t* idx, std::int64_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(EntryQueryWeights)(q, nq, q_stride, dim, scale, idx, n, out);
}
void value_run_weights(const float* params, const half_bits* x, const std::uint16_t* kept, std::int64_t kept_rows,
                       std::int64_t tokens, std::int64_t g, std::int64_t nq, const float* p, std::int64_t p_stride,
                       float* a, std::int64_t a_stride, float* y, std::int64_t y_stride, float* base, float* amax) {
  HWY_DYNAMIC_DISPATCH(ValueRunWeights)
  (params, x, kept, kept_rows, tokens, g, nq, p, p_stride, a, a_stride, y, y_stride, base, amax);
}

}  // namespace kvcal::runtime::detail
#endif  // HWY_ONCE
