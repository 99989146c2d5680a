// HEX CPU kernels, compiled once per SIMD target (see kernels_cpu.h): this
// file is included again by hwy/foreach_target.h for each target, and
// HWY_DYNAMIC_DISPATCH picks the best one the host supports on each call.
// AVX3_DL (AVX-512 with VNNI, VBMI2, VPOPCNTDQ) is one of the compiled
// targets; Highway leaves it out unless asked before its first include.
// The integer kernels are compiled the same way in files of their own, for
// build time (their unrolled bodies are most of it, and the files build in
// parallel): the score kernels in scores_int_cpu.cpp, the value kernels in
// values_int_cpu.cpp, both also once more in each VPDPBUSD pass
// (avxvnni_pass.h), which this file's float kernels need not. The pieces the
// files share are in kernels_cpu-inl.h.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1
#endif
#include "runtime/hex/kernels_cpu.h"
#include "runtime/hex/key_side.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // _pdep_u64 (BMI2: part of the AVX2 and AVX-512 targets)
#endif

#undef KVCAL_KERNEL_NS
#define KVCAL_KERNEL_NS HWY_NAMESPACE
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/hex/kernels_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// After highway.h, once per target (kept apart so that include sorting
// cannot move it above foreach_target.h).
#include <hwy/contrib/math/math-inl.h>
// The pieces the kernel files share, once per target.
#include "runtime/hex/kernels_cpu-inl.h"

HWY_BEFORE_NAMESPACE();
namespace kvcal::runtime::detail {
namespace KVCAL_KERNEL_NS {
namespace hn = hwy::HWY_NAMESPACE;

float DotF(const float* a, const float* b, std::int64_t n) {
  const DF d;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  auto s0 = hn::Zero(d), s1 = hn::Zero(d);
  std::int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
    s1 = hn::MulAdd(hn::LoadU(d, a + i + N), hn::LoadU(d, b + i + N), s1);
  }
  for (; i + N <= n; i += N) s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
  float s = Sum(d, hn::Add(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void AxpyF(float w, const float* x, float* y, std::int64_t n) {
  const DF d;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto wv = hn::Set(d, w);
  std::int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::MulAdd(wv, hn::LoadU(d, x + i), hn::LoadU(d, y + i)), d, y + i);
  for (; i < n; ++i) y[i] += w * x[i];
}

// e^x for the shifted scores x = s - max <= 0 (NaN stays NaN). x = n ln 2 +
// r with n = round(x / ln 2), |r| <= ln 2 / 2 (ln 2 in two parts, so that r
// is exact to float precision), e^r = 1 + r + r^2 P(r) with Highway's Exp
// polynomial, times 2^n built from its exponent bits. Below ln(FLT_MIN) the
// weight would be subnormal: 0 instead, so that 2^n is always a normal float
// and one multiplication scales. Highway's Exp handles every sign and range
// in about 29 operations; this one needs 19 (16 on AVX-512, which scales by
// 2^n in one instruction). With FMA it is within 0.99 ulp of e^x for every
// float x in [ln(FLT_MIN), 0] (all 1.1e9 of them compared with the double
// exp once; AVX-512 and AVX2 compared over the same floats: equal, bit for
// bit); the kernel test samples 99 thousand on every target, with FMA or
// without, against 1 ulp, and compares the FMA targets of x86-64 bitwise.
template <class D>
HWY_INLINE hn::Vec<D> ExpNonPositive(D d, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const auto lo = hn::Set(d, -87.33654f);  // the float just above ln(FLT_MIN) = -87.3365447...
  const auto xc = hn::Max(lo, x);          // lo first: x86's MAXPS returns the second operand (NaN) on NaN
  const auto nf = hn::Round(hn::Mul(xc, hn::Set(d, 1.44269504088896341f)));
  auto r = hn::MulAdd(nf, hn::Set(d, -0.693145751953125f), xc);
  r = hn::MulAdd(nf, hn::Set(d, -1.428606765330187045e-6f), r);
  const auto r2 = hn::Mul(r, r);
  auto p = hn::MulAdd(hn::Set(d, 0.000198527617612853646278381f), r, hn::Set(d, 0.00139304355252534151077271f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.00833336077630519866943359f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.0416664853692054748535156f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.166666671633720397949219f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.5f));
  const auto y = hn::Add(hn::MulAdd(p, r2, r), hn::Set(d, 1.0f));
#if HWY_TARGET <= HWY_AVX3
  // y 2^n in one VSCALEFPS where the vectors are 512-bit, in place of the
  // exponent bits and the product below: both round the exact y 2^n once,
  // so the values are the same. bench_kernels softmax (a 32K row, one
  // thread, Intel Xeon guest): 16.7 -> 13.9 us.
  if constexpr (hn::MaxLanes(D()) == 16) {
    return hn::IfThenZeroElse(hn::Lt(x, lo), hn::Vec<D>{_mm512_scalef_ps(y.raw, nf.raw)});
  }
#endif
  // n in [-126, 0]: the biased exponent n + 127 is in [1, 127].
  const auto pow2 = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, nf), hn::Set(di, 127))));
  return hn::IfThenZeroElse(hn::Lt(x, lo), hn::Mul(y, pow2));
}

// The largest of n scores (-inf for n = 0).
HWY_INLINE float MaxRow(const float* r, std::int64_t n) {
  const DF d;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  // Four running maxima: one would wait on each MAXPS's latency (4 cycles
  // a vector on x86). bench_kernels softmax (a 32K row, one thread, Intel
  // Xeon guest): 17.5 -> 16.8-16.9 us.
  auto m0 = hn::Set(d, -std::numeric_limits<float>::infinity()), m1 = m0, m2 = m0, m3 = m0;
  std::int64_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    m0 = hn::Max(m0, hn::LoadU(d, r + i));
    m1 = hn::Max(m1, hn::LoadU(d, r + i + N));
    m2 = hn::Max(m2, hn::LoadU(d, r + i + 2 * N));
    m3 = hn::Max(m3, hn::LoadU(d, r + i + 3 * N));
  }
  for (; i + N <= n; i += N) m0 = hn::Max(m0, hn::LoadU(d, r + i));
  float m = hn::GetLane(hn::MaxOfLanes(d, hn::Max(hn::Max(m0, m1), hn::Max(m2, m3))));
  for (; i < n; ++i) m = std::max(m, r[i]);
  return m;
}

// r[i] = e^(r[i] - m) in place for scores r[i] <= m; returns their sum.
HWY_INLINE float ExpSumRow(float* r, std::int64_t n, float m) {
  const DF d;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto mvec = hn::Set(d, m);
  auto z0 = hn::Zero(d);
  std::int64_t i = 0;
  for (; i + N <= n; i += N) {
    const auto e = ExpNonPositive(d, hn::Sub(hn::LoadU(d, r + i), mvec));
    hn::StoreU(e, d, r + i);
    z0 = hn::Add(z0, e);
  }
  float z = Sum(d, z0);
  for (; i < n; ++i) {
    r[i] = std::exp(r[i] - m);
    z += r[i];
  }
  return z;
}

// Softmax of one row of n scores in place: max, then exp and sum, then scale.
void SoftmaxRow(float* r, std::int64_t n) {
  const DF d;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  const float z = ExpSumRow(r, n, MaxRow(r, n));
  const float inv = 1.0f / z;
  const auto iv = hn::Set(d, inv);
  std::int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, r + i), iv), d, r + i);
  for (; i < n; ++i) r[i] *= inv;
}

// One step of a softmax over a row in pieces (see online_softmax_row).
float OnlineSoftmaxRow(float* r, std::int64_t n, float* m, float* z) {
  const float mn = std::max(*m, MaxRow(r, n));
  // e^(m - mn): 1 where the maximum stays, 0 on the first piece (m = -inf).
  const float factor = mn == *m ? 1.0f : std::exp(*m - mn);
  const float sum = ExpSumRow(r, n, mn);
  *z = *z * factor + sum;
  *m = mn;
  return factor;
}

// One fp16 row as floats (row holds dim halves).
HWY_INLINE void RowToFloats(const half_bits* row, std::int64_t dim, float* out) {
  std::int64_t i = 0;
  if constexpr (kHardwareHalf) {
    const DF df;
    const DH dh;
    const auto N = static_cast<std::int64_t>(hn::Lanes(df));
    for (; i + N <= dim; i += N)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(row + i))), df, out + i);
  }
  for (; i < dim; ++i) out[i] = half_to_float(row[i]);
}

// fp16 scores a row at a time: the row widened into `row`, then one dot
// product per query (the rows HalfScores leaves to it).
void HalfScoresByRow(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k, std::int64_t rows,
                     std::int64_t dim, std::int64_t k_stride, float scale, float* out, std::int64_t out_stride,
                     float* row) {
  for (std::int64_t t = 0; t < rows; ++t) {
    RowToFloats(k + t * k_stride, dim, row);
    for (std::int64_t j = 0; j < nq; ++j) out[j * out_stride + t] = scale * DotF(q + j * q_stride, row, dim);
  }
}

// fp16 accumulation a row at a time: the row widened into `row`, then one
// axpy per query (what HalfAccumulate does without the row-wise kernel).
void HalfAccumulateByRow(const float* p, std::int64_t nq, std::int64_t p_stride, const half_bits* v, std::int64_t rows,
                         std::int64_t dim, std::int64_t v_stride, float* out, std::int64_t out_stride, float* row) {
  for (std::int64_t t = 0; t < rows; ++t) {
    RowToFloats(v + t * v_stride, dim, row);
    for (std::int64_t j = 0; j < nq; ++j) AxpyF(p[j * p_stride + t], row, out + j * out_stride, dim);
  }
}

// Codes of kPer phases from the bytes at p (one per float lane), as float
// vectors: phase k holds bits [k * bits, (k + 1) * bits) of each byte. (Plain
// variables, not arrays: SVE vectors are sizeless and cannot form arrays.)
template <int kPer>
HWY_INLINE void LoadPhases(const std::uint8_t* p, hn::Vec<DF>& c0, hn::Vec<DF>& c1, hn::Vec<DF>& c2, hn::Vec<DF>& c3) {
  const DF df;
  const DI di;
  const D8 d8;
  const auto b = hn::PromoteTo(di, hn::LoadU(d8, p));
  constexpr int kBits = 8 / kPer;
  const auto mask = hn::Set(di, (1 << kBits) - 1);
  if constexpr (kPer == 1) {  // one code per byte (rows unpacked by UnpackBytes)
    c0 = hn::ConvertTo(df, b);
    (void)mask;
    return;
  }
  c0 = hn::ConvertTo(df, hn::And(b, mask));
  if constexpr (kPer == 2) {
    c1 = hn::ConvertTo(df, hn::ShiftRight<4>(b));
  } else {
    c1 = hn::ConvertTo(df, hn::And(hn::ShiftRight<2>(b), mask));
    c2 = hn::ConvertTo(df, hn::And(hn::ShiftRight<4>(b), mask));
    c3 = hn::ConvertTo(df, hn::ShiftRight<6>(b));
  }
}

// Scalar code of slot-phase k of byte b.
template <int kPer>
HWY_INLINE float PhaseCode(unsigned b, int k) {
  if constexpr (kPer == 1) return static_cast<float>(b);
  constexpr int kBits = 8 / kPer;
  return static_cast<float>((b >> (k * kBits)) & ((1u << kBits) - 1u));
}

// acc + sum_k c_k * w[k * run ..] (the phases of one vector of bytes).
template <int kPer>
HWY_INLINE hn::Vec<DF> DotPhases(hn::Vec<DF> c0, hn::Vec<DF> c1, hn::Vec<DF> c2, hn::Vec<DF> c3, const float* w,
                                 std::int64_t run, hn::Vec<DF> acc) {
  const DF df;
  acc = hn::MulAdd(c0, hn::LoadU(df, w), acc);
  if constexpr (kPer >= 2) acc = hn::MulAdd(c1, hn::LoadU(df, w + run), acc);
  if constexpr (kPer == 4) {
    acc = hn::MulAdd(c2, hn::LoadU(df, w + 2 * run), acc);
    acc = hn::MulAdd(c3, hn::LoadU(df, w + 3 * run), acc);
  }
  return acc;
}

// Scores of kQ queries over phase-split rows (per = 1, 2 or 4): one load and
// unpacking of the codes serves every query of the group. 4 / kQ rows go
// together (kQ = 3: one row), so that their four sums reduce at once.
template <int kPer, int kQ>
void ScoresSplit(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run, const float* w,
                 std::int64_t w_stride, float* out, std::int64_t out_stride) {
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t vec_end = HWY_TARGET == HWY_SCALAR ? 0 : run / N * N;
  constexpr int kR = kQ == 1 ? 4 : kQ == 2 ? 2 : 1;  // rows per step
  for (std::int64_t r = 0; r < rows; r += kR) {
    const std::uint8_t* row[kR];
    for (int rr = 0; rr < kR; ++rr) {
      row[rr] = codes + std::min(r + rr, rows - 1) * row_bytes;       // past the last row: repeated, not written
      __builtin_prefetch(row[rr] + kPrefetchRows * row_bytes, 0, 3);  // past the end is harmless
    }
    // s[rr * kQ + j]: row r + rr, query j.
    float s[4] = {0, 0, 0, 0};
#if HWY_TARGET != HWY_SCALAR
    auto a0 = hn::Zero(df), a1 = a0, a2 = a0, a3 = a0;
    for (std::int64_t i = 0; i < vec_end; i += N) {
      for (int rr = 0; rr < kR; ++rr) {
        auto c0 = hn::Zero(df), c1 = c0, c2 = c0, c3 = c0;
        LoadPhases<kPer>(row[rr] + i, c0, c1, c2, c3);
        const auto upd = [&](int x, hn::Vec<DF>& a) {
          if (x >= rr * kQ && x < (rr + 1) * kQ)
            a = DotPhases<kPer>(c0, c1, c2, c3, w + (x - rr * kQ) * w_stride + i, run, a);
        };
        upd(0, a0);
        if constexpr (kR * kQ > 1) upd(1, a1);
        if constexpr (kR * kQ > 2) upd(2, a2);
        if constexpr (kR * kQ > 3) upd(3, a3);
      }
    }
    if (vec_end > 0) Sum4(df, a0, a1, a2, a3, s);
#endif
    for (int rr = 0; rr < kR && r + rr < rows; ++rr)
      for (int j = 0; j < kQ; ++j) {
        const float* wj = w + j * w_stride;
        float sj = s[rr * kQ + j];
        for (std::int64_t t = vec_end; t < run; ++t)
          for (int k = 0; k < kPer; ++k) sj += wj[k * run + t] * PhaseCode<kPer>(row[rr][t], k);
        out[j * out_stride + r + rr] = sj;
      }
  }
}

// Accumulators s_jk += a_j * c_k for one query j.
template <int kPer>
HWY_INLINE void AxpyPhases(hn::Vec<DF> a, hn::Vec<DF> c0, hn::Vec<DF> c1, hn::Vec<DF> c2, hn::Vec<DF> c3,
                           hn::Vec<DF>& s0, hn::Vec<DF>& s1, hn::Vec<DF>& s2, hn::Vec<DF>& s3) {
  s0 = hn::MulAdd(a, c0, s0);
  if constexpr (kPer >= 2) s1 = hn::MulAdd(a, c1, s1);
  if constexpr (kPer == 4) {
    s2 = hn::MulAdd(a, c2, s2);
    s3 = hn::MulAdd(a, c3, s3);
  }
}

// Accumulation of kQ queries over phase-split rows, one vector of bytes (kPer
// vectors of slots) at a time over all rows of the block, so that the
// accumulators stay in registers and each code is unpacked once per group.
template <int kPer, int kQ>
void AccumulateSplit(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                     const float* a, std::int64_t a_stride, float* acc, std::int64_t acc_stride, std::int64_t i = 0) {
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  for (; i + N <= run; i += N) {
    // s_jk: query j, phase k (loaded only where j < kQ and k < kPer).
    const auto ld = [&](int j, int k) {
      return (j < kQ && k < kPer) ? hn::LoadU(df, acc + j * acc_stride + k * run + i) : hn::Zero(df);
    };
    const auto st = [&](int j, int k, hn::Vec<DF> v) {
      if (j < kQ && k < kPer) hn::StoreU(v, df, acc + j * acc_stride + k * run + i);
    };
    auto s00 = ld(0, 0), s01 = ld(0, 1), s02 = ld(0, 2), s03 = ld(0, 3);
    auto s10 = ld(1, 0), s11 = ld(1, 1), s12 = ld(1, 2), s13 = ld(1, 3);
    auto s20 = ld(2, 0), s21 = ld(2, 1), s22 = ld(2, 2), s23 = ld(2, 3);
    auto s30 = ld(3, 0), s31 = ld(3, 1), s32 = ld(3, 2), s33 = ld(3, 3);
    for (std::int64_t r = 0; r < rows; ++r) {
      auto c0 = hn::Zero(df), c1 = c0, c2 = c0, c3 = c0;
      LoadPhases<kPer>(codes + r * row_bytes + i, c0, c1, c2, c3);
      AxpyPhases<kPer>(hn::Set(df, a[r]), c0, c1, c2, c3, s00, s01, s02, s03);
      if constexpr (kQ > 1) AxpyPhases<kPer>(hn::Set(df, a[a_stride + r]), c0, c1, c2, c3, s10, s11, s12, s13);
      if constexpr (kQ > 2) AxpyPhases<kPer>(hn::Set(df, a[2 * a_stride + r]), c0, c1, c2, c3, s20, s21, s22, s23);
      if constexpr (kQ > 3) AxpyPhases<kPer>(hn::Set(df, a[3 * a_stride + r]), c0, c1, c2, c3, s30, s31, s32, s33);
    }
    st(0, 0, s00), st(0, 1, s01), st(0, 2, s02), st(0, 3, s03);
    st(1, 0, s10), st(1, 1, s11), st(1, 2, s12), st(1, 3, s13);
    st(2, 0, s20), st(2, 1, s21), st(2, 2, s22), st(2, 3, s23);
    st(3, 0, s30), st(3, 1, s31), st(3, 2, s32), st(3, 3, s33);
  }
  for (; i < run; ++i)
    for (std::int64_t r = 0; r < rows; ++r) {
      const unsigned b = codes[r * row_bytes + i];
      for (int j = 0; j < kQ; ++j)
        for (int k = 0; k < kPer; ++k) acc[j * acc_stride + k * run + i] += a[j * a_stride + r] * PhaseCode<kPer>(b, k);
    }
}

// Rows in channel order (3-bit and odd widths) unpacked to one code per
// byte (row r at out + r * dim): the code kernels then treat them as
// one-phase rows. Eight 3-bit codes (three bytes) are spread to eight bytes
// with three shift-and-mask steps on a 64-bit word (SWAR), not code by code.
void UnpackBytes(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                 std::uint8_t* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* row = codes + r * row_bytes;
    std::uint8_t* o = out + r * dim;
    std::int64_t c = 0;
    if (bits == 3) {
      for (; c + 8 <= dim; c += 8) {
        const std::uint8_t* b = row + c / 8 * 3;
        std::uint64_t x = b[0] | (static_cast<std::uint64_t>(b[1]) << 8) | (static_cast<std::uint64_t>(b[2]) << 16);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2  // BMI2 is part of these targets: one bit deposit
        x = _pdep_u64(x, 0x0707070707070707ull);
#else
        x = (x & 0xfffu) | ((x & 0xfff000u) << 20);                             // codes 0-3 | 4-7 at bit 32
        x = (x & 0x0000003f0000003full) | ((x & 0x00000fc000000fc0ull) << 10);  // pairs at bits 0, 16, 32, 48
        x = (x & 0x0007000700070007ull) | ((x & 0x0038003800380038ull) << 5);   // one code per byte
#endif
        std::memcpy(o + c, &x, 8);  // little-endian: code k in byte k
      }
    }
    for (; c < dim; ++c) o[c] = static_cast<std::uint8_t>(packed_code(row, c, bits));
  }
}

template <int kQ>
void ScoresSplitQ(int per, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                  const float* w, std::int64_t w_stride, float* out, std::int64_t out_stride) {
  if (per == 1)
    ScoresSplit<1, kQ>(codes, rows, row_bytes, run, w, w_stride, out, out_stride);
  else if (per == 2)
    ScoresSplit<2, kQ>(codes, rows, row_bytes, run, w, w_stride, out, out_stride);
  else
    ScoresSplit<4, kQ>(codes, rows, row_bytes, run, w, w_stride, out, out_stride);
}

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// Accumulation with the rows in order, each row's kC vectors of bytes read
// at once (kQ * kC * kPer accumulators in registers): the codes stream
// through the cache a row at a time instead of being revisited once per
// vector of bytes. Returns the slot index it stopped at (a multiple of kC
// vectors); AccumulateSplit does the rest. Fixed-size targets only (arrays
// of vectors).
template <int kPer, int kQ, int kC>
KVCAL_FLATTEN std::int64_t AccumulateRows(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes,
                                          std::int64_t run, const float* a, std::int64_t a_stride, float* acc,
                                          std::int64_t acc_stride) {
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  constexpr int kA = kQ * kC * kPer;
  std::int64_t i = 0;
  for (; i + kC * N <= run; i += kC * N) {
    hn::Vec<DF> s[kA];  // s[(j * kC + c) * kPer + k]: query j, vector c, phase k
    const auto slot = [&](int x) {
      return acc + x / (kC * kPer) * acc_stride + x % kPer * run + i + x / kPer % kC * N;
    };
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA { s[x] = hn::LoadU(df, slot(x)); });
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint8_t* row = codes + r * row_bytes + i;
      __builtin_prefetch(row + kPrefetchRows * row_bytes, 0, 3);  // past the end is harmless
      Unroll<kC>([&](auto c) KVCAL_INLINE_LAMBDA {
        auto c0 = hn::Zero(df), c1 = c0, c2 = c0, c3 = c0;
        LoadPhases<kPer>(row + c * N, c0, c1, c2, c3);
        Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
          constexpr int kB = (j * kC + c) * kPer;
          const auto aj = hn::Set(df, a[j * a_stride + r]);
          s[kB] = hn::MulAdd(aj, c0, s[kB]);
          if constexpr (kPer >= 2) s[kB + 1] = hn::MulAdd(aj, c1, s[kB + 1]);
          if constexpr (kPer == 4) {
            s[kB + 2] = hn::MulAdd(aj, c2, s[kB + 2]);
            s[kB + 3] = hn::MulAdd(aj, c3, s[kB + 3]);
          }
        });
      });
    }
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA { hn::StoreU(s[x], df, slot(x)); });
  }
  return i;
}
#endif

template <int kPer, int kQ>
void AccumulateCodes(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                     const float* a, std::int64_t a_stride, float* acc, std::int64_t acc_stride) {
  std::int64_t i = 0;
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
  constexpr int kC = std::clamp(kAccVectors / (kQ * kPer), 1, 4);
  i = AccumulateRows<kPer, kQ, kC>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride);
#endif
  AccumulateSplit<kPer, kQ>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride, i);
}

template <int kQ>
void AccumulateSplitQ(int per, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                      const float* a, std::int64_t a_stride, float* acc, std::int64_t acc_stride) {
  if (per == 1)
    AccumulateCodes<1, kQ>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride);
  else if (per == 2)
    AccumulateCodes<2, kQ>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride);
  else
    AccumulateCodes<4, kQ>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride);
}

// Scores of kQ queries over 3-bit rows.
template <int kQ, class D>
void Scores3(D d, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
             const float* w, std::int64_t w_stride, float* out, std::int64_t out_stride) {
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  const LastRow3 last(run, N, codes + (rows - 1) * row_bytes);
#if HWY_TARGET != HWY_SCALAR
  const hn::RebindToUnsigned<D> du;
  const auto perm = hn::IndicesFromVec(du, GroupPermutation3(d));
  const auto shuffle = GroupShuffle3(d);
#endif
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* row = codes + r * row_bytes;
    __builtin_prefetch(row + kPrefetchRows * row_bytes, 0, 3);  // past the end is harmless
    float s[4] = {0, 0, 0, 0};
    std::int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
    const std::uint8_t* src = r + 1 < rows ? row : last.pad;
    auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
    for (; i < last.vec; i += N) {
      const auto g = LoadGroups3(d, src + 3 * i, perm, shuffle);
      const auto phase = [&](auto kc) {
        constexpr int k = decltype(kc)::value;
        const auto c = Code3<k>(d, g);
        const float* wk = w + k * run + i;
        a0 = hn::MulAdd(c, hn::LoadU(d, wk), a0);
        if constexpr (kQ > 1) a1 = hn::MulAdd(c, hn::LoadU(d, wk + w_stride), a1);
        if constexpr (kQ > 2) a2 = hn::MulAdd(c, hn::LoadU(d, wk + 2 * w_stride), a2);
        if constexpr (kQ > 3) a3 = hn::MulAdd(c, hn::LoadU(d, wk + 3 * w_stride), a3);
      };
      phase(std::integral_constant<int, 0>());
      phase(std::integral_constant<int, 1>());
      phase(std::integral_constant<int, 2>());
      phase(std::integral_constant<int, 3>());
      phase(std::integral_constant<int, 4>());
      phase(std::integral_constant<int, 5>());
      phase(std::integral_constant<int, 6>());
      phase(std::integral_constant<int, 7>());
    }
    s[0] = hn::GetLane(hn::SumOfLanes(d, a0));
    if constexpr (kQ > 1) s[1] = hn::GetLane(hn::SumOfLanes(d, a1));
    if constexpr (kQ > 2) s[2] = hn::GetLane(hn::SumOfLanes(d, a2));
    if constexpr (kQ > 3) s[3] = hn::GetLane(hn::SumOfLanes(d, a3));
#endif
    for (; i < run; ++i) {
      const std::uint32_t x = Group3(row, i);
      for (int j = 0; j < kQ; ++j)
        for (int k = 0; k < 8; ++k) s[j] += w[j * w_stride + k * run + i] * static_cast<float>((x >> (3 * k)) & 7u);
    }
    for (int j = 0; j < kQ; ++j) out[j * out_stride + r] = s[j];
  }
}

#if HWY_TARGET != HWY_SCALAR
// Accumulation of one query over 3-bit rows: all eight phases of a vector of
// groups in registers, one pass over the rows.
template <class D>
void Accumulate3One(D d, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                    const LastRow3& last, const float* a, float* acc) {
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  const hn::RebindToUnsigned<D> du;
  const auto perm = hn::IndicesFromVec(du, GroupPermutation3(d));
  const auto shuffle = GroupShuffle3(d);
  for (std::int64_t i = 0; i < last.vec; i += N) {
    auto s0 = hn::LoadU(d, acc + i), s1 = hn::LoadU(d, acc + run + i), s2 = hn::LoadU(d, acc + 2 * run + i);
    auto s3 = hn::LoadU(d, acc + 3 * run + i), s4 = hn::LoadU(d, acc + 4 * run + i);
    auto s5 = hn::LoadU(d, acc + 5 * run + i), s6 = hn::LoadU(d, acc + 6 * run + i);
    auto s7 = hn::LoadU(d, acc + 7 * run + i);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint8_t* row = codes + r * row_bytes;
      if (i == 0) __builtin_prefetch(row + kPrefetchRows * row_bytes, 0, 3);  // past the end is harmless
      const auto g = LoadGroups3(d, (r + 1 < rows ? row : last.pad) + 3 * i, perm, shuffle);
      const auto ar = hn::Set(d, a[r]);
      s0 = hn::MulAdd(ar, Code3<0>(d, g), s0);
      s1 = hn::MulAdd(ar, Code3<1>(d, g), s1);
      s2 = hn::MulAdd(ar, Code3<2>(d, g), s2);
      s3 = hn::MulAdd(ar, Code3<3>(d, g), s3);
      s4 = hn::MulAdd(ar, Code3<4>(d, g), s4);
      s5 = hn::MulAdd(ar, Code3<5>(d, g), s5);
      s6 = hn::MulAdd(ar, Code3<6>(d, g), s6);
      s7 = hn::MulAdd(ar, Code3<7>(d, g), s7);
    }
    hn::StoreU(s0, d, acc + i), hn::StoreU(s1, d, acc + run + i), hn::StoreU(s2, d, acc + 2 * run + i);
    hn::StoreU(s3, d, acc + 3 * run + i), hn::StoreU(s4, d, acc + 4 * run + i);
    hn::StoreU(s5, d, acc + 5 * run + i), hn::StoreU(s6, d, acc + 6 * run + i);
    hn::StoreU(s7, d, acc + 7 * run + i);
  }
}
#endif

// Accumulation of kQ queries over 3-bit rows, phases 4 kH .. 4 kH + 3: one
// vector of groups at a time over all rows, accumulators in registers.
template <int kQ, int kH, class D>
void Accumulate3Half(D d, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                     const LastRow3& last, const float* a, std::int64_t a_stride, float* acc, std::int64_t acc_stride) {
#if HWY_TARGET != HWY_SCALAR
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  const hn::RebindToUnsigned<D> du;
  const auto perm = hn::IndicesFromVec(du, GroupPermutation3(d));
  const auto shuffle = GroupShuffle3(d);
  for (std::int64_t i = 0; i < last.vec; i += N) {
    const auto ld = [&](int j, int k) {
      return j < kQ ? hn::LoadU(d, acc + j * acc_stride + (4 * kH + k) * run + i) : hn::Zero(d);
    };
    const auto st = [&](int j, int k, hn::Vec<D> v) {
      if (j < kQ) hn::StoreU(v, d, acc + j * acc_stride + (4 * kH + k) * run + i);
    };
    auto s00 = ld(0, 0), s01 = ld(0, 1), s02 = ld(0, 2), s03 = ld(0, 3);
    auto s10 = ld(1, 0), s11 = ld(1, 1), s12 = ld(1, 2), s13 = ld(1, 3);
    auto s20 = ld(2, 0), s21 = ld(2, 1), s22 = ld(2, 2), s23 = ld(2, 3);
    auto s30 = ld(3, 0), s31 = ld(3, 1), s32 = ld(3, 2), s33 = ld(3, 3);
    for (std::int64_t r = 0; r < rows; ++r) {
      if (kH == 0 && i == 0)
        __builtin_prefetch(codes + (r + kPrefetchRows) * row_bytes, 0, 3);  // harmless past the end
      const std::uint8_t* src = r + 1 < rows ? codes + r * row_bytes : last.pad;
      const auto g = LoadGroups3(d, src + 3 * i, perm, shuffle);
      const auto c0 = Code3<4 * kH>(d, g), c1 = Code3<4 * kH + 1>(d, g);
      const auto c2 = Code3<4 * kH + 2>(d, g), c3 = Code3<4 * kH + 3>(d, g);
      const auto axpy = [&](int j, hn::Vec<D>& x0, hn::Vec<D>& x1, hn::Vec<D>& x2, hn::Vec<D>& x3) {
        const auto aj = hn::Set(d, a[j * a_stride + r]);
        x0 = hn::MulAdd(aj, c0, x0);
        x1 = hn::MulAdd(aj, c1, x1);
        x2 = hn::MulAdd(aj, c2, x2);
        x3 = hn::MulAdd(aj, c3, x3);
      };
      axpy(0, s00, s01, s02, s03);
      if constexpr (kQ > 1) axpy(1, s10, s11, s12, s13);
      if constexpr (kQ > 2) axpy(2, s20, s21, s22, s23);
      if constexpr (kQ > 3) axpy(3, s30, s31, s32, s33);
    }
    st(0, 0, s00), st(0, 1, s01), st(0, 2, s02), st(0, 3, s03);
    st(1, 0, s10), st(1, 1, s11), st(1, 2, s12), st(1, 3, s13);
    st(2, 0, s20), st(2, 1, s21), st(2, 2, s22), st(2, 3, s23);
    st(3, 0, s30), st(3, 1, s31), st(3, 2, s32), st(3, 3, s33);
  }
#else
  (void)d, (void)codes, (void)rows, (void)row_bytes, (void)run, (void)last, (void)a, (void)a_stride, (void)acc,
      (void)acc_stride;
#endif
}

template <int kQ, class D>
void Accumulate3(D d, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                 const float* a, std::int64_t a_stride, float* acc, std::int64_t acc_stride) {
  const LastRow3 last(run, static_cast<std::int64_t>(hn::Lanes(d)), codes + (rows - 1) * row_bytes);
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kQ == 1) {
    Accumulate3One(d, codes, rows, row_bytes, run, last, a, acc);
  } else {
    Accumulate3Half<kQ, 0>(d, codes, rows, row_bytes, run, last, a, a_stride, acc, acc_stride);
    Accumulate3Half<kQ, 1>(d, codes, rows, row_bytes, run, last, a, a_stride, acc, acc_stride);
  }
#endif
  for (std::int64_t i = last.vec; i < run; ++i)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::uint32_t x = Group3(codes + r * row_bytes, i);
      for (int j = 0; j < kQ; ++j)
        for (int k = 0; k < 8; ++k)
          acc[j * acc_stride + k * run + i] += a[j * a_stride + r] * static_cast<float>((x >> (3 * k)) & 7u);
    }
}

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// How the score kernel reads one layout: Row(r) is row r's bytes, Unpack
// gives the kPhases code vectors of vector position i (phase k weighted by
// w[k * run + i]), Scalar the code of phase k at position i.
template <int kPer, class D>
struct SplitReader {  // phase-split rows, kPer = 1, 2 or 4 codes per byte
  static constexpr int kPhases = kPer;
  const std::uint8_t* codes;
  std::int64_t row_bytes;
  HWY_INLINE const std::uint8_t* Row(std::int64_t r) const { return codes + r * row_bytes; }
  HWY_INLINE const std::uint8_t* ScalarRow(std::int64_t r) const { return Row(r); }
  HWY_INLINE void Unpack(D d, const std::uint8_t* row, std::int64_t i, hn::Vec<D>* c) const {
    const hn::RebindToSigned<D> di;
    const hn::Rebind<std::uint8_t, decltype(di)> d8;
    const auto b = hn::PromoteTo(di, hn::LoadU(d8, row + i));
    constexpr int kBits = 8 / kPer;
    const auto mask = hn::Set(di, (1 << kBits) - 1);
    if constexpr (kPer == 1) {
      c[0] = hn::ConvertTo(d, b);
      (void)mask;
    } else {
      c[0] = hn::ConvertTo(d, hn::And(b, mask));
      c[kPer - 1] = hn::ConvertTo(d, hn::ShiftRight<8 - kBits>(b));
      if constexpr (kPer == 4) {
        c[1] = hn::ConvertTo(d, hn::And(hn::ShiftRight<2>(b), mask));
        c[2] = hn::ConvertTo(d, hn::And(hn::ShiftRight<4>(b), mask));
      }
    }
  }
  HWY_INLINE float Scalar(const std::uint8_t* row, std::int64_t i, int k) const { return PhaseCode<kPer>(row[i], k); }
};
template <class D>
struct GroupReader3 {  // 3-bit rows, eight phases per 24-bit group
  static constexpr int kPhases = 8;
  const std::uint8_t* codes;
  std::int64_t row_bytes, last;  // row `last` is read from `pad` (vectors read past a row's bytes)
  const std::uint8_t* pad;
  hn::Vec<D> perm_vec;  // kept as a vector: Indices are not regular types on every target
  hn::Vec<hn::Repartition<std::uint8_t, hn::RebindToUnsigned<D>>> shuffle;
  GroupReader3(D d, const std::uint8_t* c, std::int64_t rb, std::int64_t last_row, const std::uint8_t* last_pad)
      : codes(c),
        row_bytes(rb),
        last(last_row),
        pad(last_pad),
        perm_vec(hn::BitCast(d, GroupPermutation3(d))),
        shuffle(GroupShuffle3(d)) {}
  HWY_INLINE const std::uint8_t* Row(std::int64_t r) const { return r == last ? pad : codes + r * row_bytes; }
  HWY_INLINE const std::uint8_t* ScalarRow(std::int64_t r) const { return codes + r * row_bytes; }
  HWY_INLINE void Unpack(D d, const std::uint8_t* row, std::int64_t i, hn::Vec<D>* c) const {
    const hn::RebindToUnsigned<D> du;
    const auto g = LoadGroups3(d, row + 3 * i, hn::IndicesFromVec(du, hn::BitCast(du, perm_vec)), shuffle);
    Unroll<8>([&](auto k) KVCAL_INLINE_LAMBDA { c[k] = Code3<decltype(k)::value>(d, g); });
  }
  HWY_INLINE float Scalar(const std::uint8_t* row, std::int64_t i, int k) const {
    return static_cast<float>((Group3(row, i) >> (3 * k)) & 7u);
  }
};

// Scores of kQ queries over kR rows at a time: the kR * kQ sums are
// independent chains in registers (one accumulator per row and query, so
// that no chain of multiply-adds waits on the one before), reduced four at
// once. Vector positions [0, vec) go through Unpack, the rest scalar. Returns
// the rows done (a multiple of kR, at most `rows`); the caller does the rest.
template <int kR, int kQ, class D, class Reader>
KVCAL_FLATTEN std::int64_t ScoresRows(D d, const Reader& rd, std::int64_t rows, std::int64_t run, std::int64_t vec,
                                      const float* w, std::int64_t w_stride, float* out, std::int64_t out_stride) {
  constexpr int kP = Reader::kPhases, kA = kR * kQ;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  // The weights the vectors read, packed in their order of use (one pointer
  // and constant offsets instead of kQ * kP strided addresses per step).
  constexpr std::int64_t kPacked = 4096;
  if (kQ * kP * vec > kPacked) return 0;
  HWY_ALIGN float wp[kPacked];
  for (std::int64_t i = 0; i < vec; i += N)
    for (int j = 0; j < kQ; ++j)
      for (int k = 0; k < kP; ++k)
        hn::Store(hn::LoadU(d, w + j * w_stride + k * run + i), d, wp + (i * kQ * kP + j * kP * N + k * N));
  std::int64_t r = 0;
  for (; r + kR <= rows; r += kR) {
    const std::uint8_t* row[kR];
    Unroll<kR>([&](auto rr) KVCAL_INLINE_LAMBDA {
      row[rr] = rd.Row(r + rr);
      // Every line of the row ahead: at most its 2 run bytes (fp16 rows,
      // four lines at a head dim of 128; see kPrefetchRows), within the
      // row stride.
      const std::uint8_t* ahead = rd.Row(r + rr + kPrefetchRows);
      const std::int64_t span = std::min<std::int64_t>(2 * run, rd.Row(r + rr + kPrefetchRows + 1) - ahead);
      __builtin_prefetch(ahead, 0, 3);  // past the end is harmless
      for (std::int64_t o = 64; o < span; o += 64) __builtin_prefetch(ahead + o, 0, 3);
    });
    hn::Vec<D> s[kA];  // s[rr * kQ + j]: row r + rr, query j
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA { s[x] = hn::Zero(d); });
    for (std::int64_t i = 0; i < vec; i += N) {
      Unroll<kR>([&](auto rr) KVCAL_INLINE_LAMBDA {
        hn::Vec<D> c[kP];
        rd.Unpack(d, row[rr], i, c);
        Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
          constexpr int x = decltype(rr)::value * kQ + decltype(j)::value;
          const float* wj = wp + i * kQ * kP + j * kP * N;
          Unroll<kP>([&](auto k) KVCAL_INLINE_LAMBDA { s[x] = hn::MulAdd(c[k], hn::Load(d, wj + k * N), s[x]); });
        });
      });
    }
    HWY_ALIGN float sum[(kA + 3) / 4 * 4];
    Unroll<kA / 4>([&](auto g) KVCAL_INLINE_LAMBDA {
      constexpr int b = 4 * decltype(g)::value;
      Sum4(d, s[b], s[b + 1], s[b + 2], s[b + 3], sum + b);
    });
    Unroll<kA % 4>(
        [&](auto x) KVCAL_INLINE_LAMBDA { sum[kA / 4 * 4 + x] = hn::GetLane(hn::SumOfLanes(d, s[kA / 4 * 4 + x])); });
    if (vec < run)  // the scalar tail (rare: rows whose runs are not whole vectors)
      for (int rr = 0; rr < kR; ++rr)
        for (int j = 0; j < kQ; ++j)
          for (std::int64_t i = vec; i < run; ++i)
            for (int k = 0; k < kP; ++k)
              sum[rr * kQ + j] += w[j * w_stride + k * run + i] * rd.Scalar(rd.ScalarRow(r + rr), i, k);
    Unroll<kR>([&](auto rr) KVCAL_INLINE_LAMBDA {
      Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA { out[j * out_stride + r + rr] = sum[rr * kQ + j]; });
    });
  }
  return r;
}

// Rows per step of ScoresRows: eight independent sums where the registers
// allow (four on 16-register targets with eight-phase rows).
template <int kQ, int kPhases>
constexpr int ScoreRowsPerStep() {
  constexpr int sums = (kAccVectors < 16 && kPhases == 8) ? 4 : 8;
  return std::max(1, sums / kQ);
}
#endif

void WidenCodes3To4(const std::uint8_t* src, std::int64_t n, std::uint8_t* dst) { WidenCodes3<false>(src, n, dst); }

// The dispatch both code kernels share: 3-bit rows to the group kernels,
// three(d, kq, run, j); channel-order rows unpacked to bytes first; then the
// phase-split kernels, split(kq, per, codes, row_bytes, run, j); queries j ..
// j + kq - 1 four at a time.
template <class Three, class Split>
HWY_INLINE void ForCodeLayout(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                              std::int64_t dim, std::int64_t nq, std::uint8_t* bytes, Three three, Split split) {
  const Slots sl(bits, dim);
  if (rows <= 0) return;
  if (sl.per == 8) {
    WithGroupTag3(sl.run, [&](auto d) { InGroupsOf4(nq, [&](auto kq, std::int64_t j) { three(d, kq, sl.run, j); }); });
    return;
  }
  if (sl.per == 1) {  // one code per byte first, read by every query
    UnpackBytes(codes, rows, row_bytes, bits, dim, bytes);
    codes = bytes;
    row_bytes = dim;
  }
  const int per = static_cast<int>(sl.per);
  InGroupsOf4(nq, [&](auto kq, std::int64_t j) { split(kq, per, codes, row_bytes, sl.run, j); });
}

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR && KVCAL_ROW_KERNELS
// fp16 rows for ScoresRows: one phase, a row's halves widened in registers.
template <class D>
struct HalfReader {
  static constexpr int kPhases = 1;
  const half_bits* rows;
  std::int64_t stride;  // in halves
  HWY_INLINE const std::uint8_t* Row(std::int64_t r) const {
    return reinterpret_cast<const std::uint8_t*>(rows + r * stride);
  }
  HWY_INLINE const std::uint8_t* ScalarRow(std::int64_t r) const { return Row(r); }
  HWY_INLINE void Unpack(D d, const std::uint8_t* row, std::int64_t i, hn::Vec<D>* c) const {
    const hn::Rebind<hwy::float16_t, D> dh;
    c[0] = hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(row) + i));
  }
  HWY_INLINE float Scalar(const std::uint8_t* row, std::int64_t i, int /*phase*/) const {
    return half_to_float(reinterpret_cast<const half_bits*>(row)[i]);
  }
};
#endif

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR && KVCAL_ROW_KERNELS
// fp16 accumulation with the rows in order and kQ * kC output vectors in
// registers (as AccumulateRows for codes): channels [i0, end) in steps of
// kC vectors, each row's halves widened in registers. Returns the channel it
// stopped at.
template <int kQ, int kC>
KVCAL_FLATTEN std::int64_t HalfAccumulateRows(const float* p, std::int64_t p_stride, const half_bits* v,
                                              std::int64_t rows, std::int64_t v_stride, std::int64_t i0,
                                              std::int64_t end, float* out, std::int64_t out_stride) {
  const DF df;
  const DH dh;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  constexpr int kA = kQ * kC;
  const bool whole = rows * (end - i0) * 2 <= 32768;  // the rows' channels fit L1 (see below)
  std::int64_t i = i0;
  for (; i + kC * N <= end; i += kC * N) {
    hn::Vec<DF> s[kA];  // s[j * kC + c]: query j, vector c
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA { s[x] = hn::LoadU(df, out + x / kC * out_stride + i + x % kC * N); });
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto* row = reinterpret_cast<const hwy::float16_t*>(v + r * v_stride + i);
      // Every line of the row ahead (see kPrefetchRows; past the end is
      // harmless). Rows that L1 holds between passes (a block's: 24 KiB at
      // a head dim of 128): the first pass requests all of the row's
      // channels [i0, end), the later ones nothing. More rows: each pass its
      // own channels' lines.
      const half_bits* ahead = v + (r + kPrefetchRows) * v_stride;
      const std::int64_t o0 = whole ? (i == i0 ? i0 : end) : i, o1 = whole ? end : i + kC * N;
      for (std::int64_t o = o0; o < o1; o += 32) __builtin_prefetch(ahead + o, 0, 3);
      Unroll<kC>([&](auto c) KVCAL_INLINE_LAMBDA {
        const auto x = hn::PromoteTo(df, hn::LoadU(dh, row + c * N));
        Unroll<kQ>([&](auto j) KVCAL_INLINE_LAMBDA {
          constexpr int kB = decltype(j)::value * kC + decltype(c)::value;
          s[kB] = hn::MulAdd(hn::Set(df, p[j * p_stride + r]), x, s[kB]);
        });
      });
    }
    Unroll<kA>([&](auto x) KVCAL_INLINE_LAMBDA { hn::StoreU(s[x], df, out + x / kC * out_stride + i + x % kC * N); });
  }
  return i;
}
#endif

// fp16 accumulation: with hardware conversions, the row-wise kernel over
// the whole vectors of channels, the channels left over scalar; otherwise a
// row at a time.
void HalfAccumulate(const float* p, std::int64_t nq, std::int64_t p_stride, const half_bits* v, std::int64_t rows,
                    std::int64_t dim, std::int64_t v_stride, float* out, std::int64_t out_stride, float* row) {
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR && KVCAL_ROW_KERNELS
  if constexpr (kHardwareHalf) {
    InGroupsOf4(nq, [&](auto kq, std::int64_t j) {
      constexpr int kQ = decltype(kq)::value;
      constexpr int kC = std::clamp(kAccVectors / kQ, 1, 4);
      const float* pj = p + j * p_stride;
      float* oj = out + j * out_stride;
      std::int64_t i = HalfAccumulateRows<kQ, kC>(pj, p_stride, v, rows, v_stride, 0, dim, oj, out_stride);
      i = HalfAccumulateRows<kQ, 1>(pj, p_stride, v, rows, v_stride, i, dim, oj, out_stride);
      for (std::int64_t r = 0; r < rows; ++r)
        for (int q = 0; q < kQ; ++q)
          for (std::int64_t c = i; c < dim; ++c)
            oj[q * out_stride + c] += pj[q * p_stride + r] * half_to_float(v[r * v_stride + c]);
    });
    return;
  }
#endif
  HalfAccumulateByRow(p, nq, p_stride, v, rows, dim, v_stride, out, out_stride, row);
}

// fp16 scores: with hardware conversions, rows through the row-unrolled
// kernel (independent sums per row and query, no widened copy of the row),
// scaled afterwards; the rest a row at a time.
void HalfScores(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k, std::int64_t rows,
                std::int64_t dim, std::int64_t k_stride, float scale, float* out, std::int64_t out_stride, float* row) {
  std::int64_t done = 0;
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR && KVCAL_ROW_KERNELS
  if constexpr (kHardwareHalf) {
    const DF df;
    const auto N = static_cast<std::int64_t>(hn::Lanes(df));
    const std::int64_t vec = dim / N * N;
    if (vec > 0) {
      done = rows;
      InGroupsOf4(nq, [&](auto kq, std::int64_t j) {
        constexpr int kQ = decltype(kq)::value;
        done = std::min(done, ScoresRows<ScoreRowsPerStep<kQ, 1>(), kQ>(df, HalfReader<DF>{k, k_stride}, rows, dim, vec,
                                                                        q + j * q_stride, q_stride,
                                                                        out + j * out_stride, out_stride));
      });
      for (std::int64_t j = 0; j < nq; ++j)
        for (std::int64_t t = 0; t < done; ++t) out[j * out_stride + t] *= scale;
    }
  }
#endif
  HalfScoresByRow(q, nq, q_stride, k + done * k_stride, rows - done, dim, k_stride, scale, out + done, out_stride, row);
}

void CodeScores(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                const float* w, std::int64_t nq, std::int64_t w_stride, float* out, std::int64_t out_stride,
                std::uint8_t* bytes) {
  ForCodeLayout(
      codes, rows, row_bytes, bits, dim, nq, bytes,
      [&](auto d, auto kq, std::int64_t run, std::int64_t j) {
        constexpr int kQ = decltype(kq)::value;
        std::int64_t r = 0;
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR && KVCAL_ROW_KERNELS
        // The last row read from a padded copy; the rows left over go to Scores3.
        const LastRow3 last(run, static_cast<std::int64_t>(hn::Lanes(d)), codes + (rows - 1) * row_bytes);
        r = ScoresRows<ScoreRowsPerStep<kQ, 8>(), kQ>(
            d, GroupReader3<decltype(d)>(d, codes, row_bytes, rows - 1, last.pad), rows, run, last.vec,
            w + j * w_stride, w_stride, out + j * out_stride, out_stride);
        if (r == rows) return;
#endif
        Scores3<kQ>(d, codes + r * row_bytes, rows - r, row_bytes, run, w + j * w_stride, w_stride,
                    out + j * out_stride + r, out_stride);
      },
      [&](auto kq, int per, const std::uint8_t* c, std::int64_t rb, std::int64_t run, std::int64_t j) {
        constexpr int kQ = decltype(kq)::value;
        std::int64_t r = 0;
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR && KVCAL_ROW_KERNELS
        const DF df;
        const std::int64_t vec =
            run / static_cast<std::int64_t>(hn::Lanes(df)) * static_cast<std::int64_t>(hn::Lanes(df));
        const auto rows_of = [&](auto per_c) {
          constexpr int kPer = decltype(per_c)::value;
          return ScoresRows<ScoreRowsPerStep<kQ, kPer>(), kQ>(df, SplitReader<kPer, DF>{c, rb}, rows, run, vec,
                                                              w + j * w_stride, w_stride, out + j * out_stride,
                                                              out_stride);
        };
        r = per == 1   ? rows_of(std::integral_constant<int, 1>())
            : per == 2 ? rows_of(std::integral_constant<int, 2>())
                       : rows_of(std::integral_constant<int, 4>());
#endif
        if (r < rows)
          ScoresSplitQ<kQ>(per, c + r * rb, rows - r, rb, run, w + j * w_stride, w_stride, out + j * out_stride + r,
                           out_stride);
      });
}

void CodeAccumulate(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                    const float* a, std::int64_t nq, std::int64_t a_stride, float* acc, std::int64_t acc_stride,
                    std::uint8_t* bytes) {
  ForCodeLayout(
      codes, rows, row_bytes, bits, dim, nq, bytes,
      [&](auto d, auto kq, std::int64_t run, std::int64_t j) {
        Accumulate3<decltype(kq)::value>(d, codes, rows, row_bytes, run, a + j * a_stride, a_stride,
                                         acc + j * acc_stride, acc_stride);
      },
      [&](auto kq, int per, const std::uint8_t* c, std::int64_t rb, std::int64_t run, std::int64_t j) {
        AccumulateSplitQ<decltype(kq)::value>(per, c, rows, rb, run, a + j * a_stride, a_stride, acc + j * acc_stride,
                                              acc_stride);
      });
}

// out[c] += bias + acc[slot(c)] for c < per * run (slot(c) = (c % per) *
// run + c / per): plain loops per phase count, which the compiler vectorises
// for the target with its interleaving shuffles.
template <int kPer>
HWY_INLINE void AddSlotsPer(const float* HWY_RESTRICT acc, std::int64_t run, float bias, float* HWY_RESTRICT out) {
  for (std::int64_t i = 0; i < run; ++i)
    for (int k = 0; k < kPer; ++k) out[kPer * i + k] += bias + acc[k * run + i];
}
void AddSlots(const float* acc, std::int64_t per, std::int64_t run, float bias, float* out) {
  switch (per) {
    case 1:
      return AddSlotsPer<1>(acc, run, bias, out);
    case 2:
      return AddSlotsPer<2>(acc, run, bias, out);
    case 4:
      return AddSlotsPer<4>(acc, run, bias, out);
    default:
      return AddSlotsPer<8>(acc, run, bias, out);
  }
}

// y[i] += w * x[i] from int32 x: a plain loop the compiler vectorises.
void AxpyInt(float w, const std::int32_t* HWY_RESTRICT x, float* HWY_RESTRICT y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += w * static_cast<float>(x[i]);
}

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// A query's code weights over the whole vectors of [0, dim), in channel
// order: prod[c] = scale q[c] delta[c]; b = sum_c scale q[c] min[c] (one
// fused multiply-add chain per lane, then SumOfLanes), m = max_c |prod[c]|.
// Returns where the vectors stop (the rest, if any, is the caller's).
HWY_INLINE std::int64_t QueryProducts(const float* HWY_RESTRICT qj, const float* HWY_RESTRICT delta,
                                      const float* HWY_RESTRICT kmin, float scale, std::int64_t dim,
                                      float* HWY_RESTRICT prod, float& b, float& m) {
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  const auto sv = hn::Set(df, scale);
  auto bv = hn::Zero(df), mv = bv;
  std::int64_t c = 0;
  for (; c + N <= dim; c += N) {
    const auto qs = hn::Mul(sv, hn::LoadU(df, qj + c));
    bv = hn::MulAdd(qs, hn::LoadU(df, kmin + c), bv);
    const auto w = hn::Mul(qs, hn::LoadU(df, delta + c));
    mv = hn::Max(mv, hn::Abs(w));
    hn::StoreU(w, df, prod + c);
  }
  b = hn::GetLane(hn::SumOfLanes(df, bv));
  m = hn::GetLane(hn::MaxOfLanes(df, mv));
  return c;
}

// Slots [i, i + Lanes) of each of the kPer phases from products in channel
// order: out[k * run + i + x] = prod[(i + x) * kPer + k] (one deinterleaving
// load per vector).
template <int kPer>
HWY_INLINE void ChannelsToSlots(const float* HWY_RESTRICT prod, std::int64_t run, std::int64_t i,
                                float* HWY_RESTRICT out) {
  const DF df;
  if constexpr (kPer == 2) {
    hn::Vec<DF> e, o;
    hn::LoadInterleaved2(df, prod + 2 * i, e, o);
    hn::StoreU(e, df, out + i);
    hn::StoreU(o, df, out + run + i);
  } else {
    static_assert(kPer == 4, "two or four phases");
    hn::Vec<DF> p0, p1, p2, p3;
    hn::LoadInterleaved4(df, prod + 4 * i, p0, p1, p2, p3);
    hn::StoreU(p0, df, out + i);
    hn::StoreU(p1, df, out + run + i);
    hn::StoreU(p2, df, out + 2 * run + i);
    hn::StoreU(p3, df, out + 3 * run + i);
  }
}
#endif

// The key side of a block (see kernels_cpu.h: key_weights). Channel-order
// products first, in vectors, then the slot order: for two and four phases
// one deinterleaving load per vector, else a scalar permutation.
void KeyWeights(const float* params, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                std::int64_t per, std::int64_t run, float* qd, float* kmin, float* bias, float* amax, float* tmp) {
  const std::int64_t dim = per * run;
  std::int64_t c0 = 0;
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  float* delta = tmp;
  for (; c0 + N <= dim; c0 += N) {
    hn::Vec<DF> dl, mn;
    hn::LoadInterleaved2(df, params + 2 * c0, dl, mn);
    hn::StoreU(dl, df, delta + c0);
    hn::StoreU(mn, df, kmin + c0);
  }
#endif
  for (std::int64_t c = c0; c < dim; ++c) {
    tmp[c] = params[2 * c];
    kmin[c] = params[2 * c + 1];
  }
  float* prod = tmp + dim;  // scale * q_c * delta_c in channel order
  for (std::int64_t j = 0; j < nq; ++j) {
    const float* qj = q + j * q_stride;
    float* qdj = qd + j * dim;
    std::int64_t c = 0;
    float b = 0, m = 0;
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
    c = QueryProducts(qj, tmp, kmin, scale, dim, prod, b, m);
#endif
    for (; c < dim; ++c) {
      const float qs = scale * qj[c];
      b += qs * kmin[c];
      prod[c] = qs * tmp[c];
      m = std::max(m, std::fabs(prod[c]));
    }
    bias[j] = b;
    amax[j] = m;
    std::int64_t i = 0;
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
    if (per == 2) {
      for (; i + N <= run; i += N) ChannelsToSlots<2>(prod, run, i, qdj);
    } else if (per == 4) {
      for (; i + N <= run; i += N) ChannelsToSlots<4>(prod, run, i, qdj);
    }
#endif
    for (; i < run; ++i)
      for (std::int64_t k = 0; k < per; ++k) qdj[k * run + i] = prod[i * per + k];
  }
}

// max |w[i]| over i < n (two accumulators: the max chain is the latency).
HWY_INLINE float MaxAbs(const float* w, std::int64_t n) {
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  auto m0 = hn::Zero(df), m1 = m0;
  std::int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    m0 = hn::Max(m0, hn::Abs(hn::LoadU(df, w + i)));
    m1 = hn::Max(m1, hn::Abs(hn::LoadU(df, w + i + N)));
  }
  if (i + N <= n) {
    m0 = hn::Max(m0, hn::Abs(hn::LoadU(df, w + i)));
    i += N;
  }
  if (i < n && n >= N) {  // the last vector, overlapping the one before
    m1 = hn::Max(m1, hn::Abs(hn::LoadU(df, w + n - N)));
    i = n;
  }
  float m = hn::GetLane(hn::MaxOfLanes(df, hn::Max(m0, m1)));
  for (; i < n; ++i) m = std::max(m, std::fabs(w[i]));
  return m;
}

// How QuantizeRow scales weights of largest magnitude m > 0 to levels L:
// v = round(w * pre * inv). Below 2^-100 (subnormal weights, say) L / m would
// overflow: the weights are scaled by 2^64 first, exactly, and v stays the
// same.
struct RoundingScale {
  bool tiny;
  float pre, inv;
  RoundingScale(float m, int levels)
      : tiny(m < 0x1p-100f), pre(tiny ? 0x1p64f : 1.0f), inv(static_cast<float>(levels) / (tiny ? m * pre : m)) {}
};

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// 64 weights, a to d in order, to int8 at the scale rs (levels 127): rounded
// by CVTPS2DQ (to nearest even), packed with saturation that never happens
// (|w| inv <= 127 (1 + 2^-24)^2 rounds to at most 127); the packs leave
// 128-bit lane k holding dwords a_k b_k c_k d_k, which one permutation puts
// in order.
HWY_INLINE __m512i RoundPack64(const RoundingScale& rs, __m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 iv16 = _mm512_set1_ps(rs.inv), pre16 = _mm512_set1_ps(rs.pre);
  const auto round = [&](__m512 x) {
    if (rs.tiny) x = _mm512_mul_ps(x, pre16);
    return _mm512_cvtps_epi32(_mm512_mul_ps(x, iv16));
  };
  const __m512i order16 = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i ab = _mm512_packs_epi32(round(a), round(b)), cd = _mm512_packs_epi32(round(c), round(d));
  return _mm512_permutexvar_epi32(order16, _mm512_packs_epi16(ab, cd));
}
#endif

// Fixed point of n weights (see quantize_weights8 and quantize_weights14):
// v = round(w * L / max|w|), L = 127 (kL = 1, out holds v) or 8191 (kL = 2,
// out holds hi = floor(v / 128), then lo = v - 128 hi). NearestInt rounds
// half to even on every target, like the scalar lrint. Returns max|w| / L.
// m is max|w|, computed here when negative (the callers that made the
// weights pass theirs: see KeyWeights, ValueRunWeights).
template <int kL>
HWY_INLINE float QuantizeRow(const float* w, std::int64_t n, std::int8_t* out, float m) {
  constexpr int kLevels = kL == 1 ? 127 : 8191;
  const DF df;
  const DI di;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  if (m < 0.0f) m = MaxAbs(w, n);
  if (!(m > 0.0f)) {
    std::fill(out, out + kL * n, std::int8_t{0});
    return 0.0f;
  }
  const RoundingScale rs(m, kLevels);
  const bool tiny = rs.tiny;
  const float pre = rs.pre, inv = rs.inv;
  std::int64_t i = 0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // |w| inv <= L (1 + 2^-24)^2 rounds to at most L = 127, so no clamp is
  // needed, and the saturating packs never saturate: 32 weights per step,
  // rounded by CVTPS2DQ (to nearest even, as NearestInt), packed to bytes
  // (in 128-bit lanes: dwords a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7) and
  // put in order by one dword permutation. Same values as the loop below.
  if constexpr (kL == 1) {
#if HWY_TARGET <= HWY_AVX3
    // 64 weights per step in 512-bit vectors, the same way: the packs leave
    // 128-bit lane k holding dwords a_k b_k c_k d_k (four weights each, a
    // to d the four vectors), which one permutation puts in order. Half the
    // instructions per weight: bench_kernels quantize/int8 (128 weights) 24.5
    // -> 19.1 ns and key_weights/4 (a block's key side for a group of four)
    // 142 -> 134 ns on a 2-vCPU Intel Xeon guest; decode over 32K tokens at
    // hex4@int8, two threads, 5 interleaved rounds: 1-4% less time with a
    // group of 4 in four rounds (2% more in one); with one query, from 2%
    // more to 1% less.
    for (; i + 64 <= n; i += 64)
      _mm512_storeu_si512(out + i, RoundPack64(rs, _mm512_loadu_ps(w + i), _mm512_loadu_ps(w + i + 16),
                                               _mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(w + i + 48)));
#endif
    const __m256 iv8 = _mm256_set1_ps(inv), pre8 = _mm256_set1_ps(pre);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const auto at = [&](std::int64_t k) {
      __m256 x = _mm256_loadu_ps(w + k);
      if (tiny) x = _mm256_mul_ps(x, pre8);
      return _mm256_cvtps_epi32(_mm256_mul_ps(x, iv8));
    };
    for (; i + 32 <= n; i += 32) {
      const __m256i ab = _mm256_packs_epi32(at(i), at(i + 8)), cd = _mm256_packs_epi32(at(i + 16), at(i + 24));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), order));
    }
  }
#endif
  const auto iv = hn::Set(df, inv), pv = hn::Set(df, pre);
  const auto top = hn::Set(di, kLevels), bottom = hn::Set(di, -kLevels), low7 = hn::Set(di, 127);
  const hn::Rebind<std::int8_t, DI> d8;  // every limb fits int8: no saturation happens
  const auto step = [&](std::int64_t k) {
    const auto x = hn::LoadU(df, w + k);
    const auto v = hn::Min(hn::Max(hn::NearestInt(hn::Mul(tiny ? hn::Mul(x, pv) : x, iv)), bottom), top);
    if constexpr (kL == 1) {
      hn::StoreU(hn::DemoteTo(d8, v), d8, out + k);
    } else {
      hn::StoreU(hn::DemoteTo(d8, hn::ShiftRight<7>(v)), d8, out + k);  // arithmetic: floor(v / 128)
      hn::StoreU(hn::DemoteTo(d8, hn::And(v, low7)), d8, out + n + k);  // v - 128 floor(v / 128)
    }
  };
  for (; i + N <= n; i += N) step(i);
  // The last vector overlapping the one before (a HEX block's 94 value
  // weights: 14 past the last whole vector), its repeated lanes rounded to
  // the same values again.
  if (i < n && n >= N) {
    step(n - N);
    i = n;
  }
  for (; i < n; ++i) {
    const float x = tiny ? w[i] * pre : w[i];
    const long v = std::clamp(std::lrint(x * inv), -static_cast<long>(kLevels), static_cast<long>(kLevels));
    if constexpr (kL == 1) {
      out[i] = static_cast<std::int8_t>(v);
    } else {
      out[i] = static_cast<std::int8_t>(v >> 7);
      out[n + i] = static_cast<std::int8_t>(v & 127);
    }
  }
  return m / static_cast<float>(kLevels);
}

// Rows j < rows of n weights at w + j * n, each to out + j * limbs * n with
// its scale in scales[j]; amax[j] = max|w_j| where the caller has them
// (null: computed here).
void QuantizeRows(int limbs, const float* w, std::int64_t rows, std::int64_t n, std::int8_t* out, float* scales,
                  const float* amax) {
  for (std::int64_t j = 0; j < rows; ++j) {
    const float m = amax ? amax[j] : -1.0f;
    scales[j] =
        limbs == 1 ? QuantizeRow<1>(w + j * n, n, out + j * n, m) : QuantizeRow<2>(w + j * n, n, out + j * 2 * n, m);
  }
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
// key_weights_int8 (key_side.h) for kV vectors of 16 channels and kPer
// phases: the operations of ToFloats, KeyWeights and QuantizeRow<1>, lane for
// lane and in the same order (the bias one fused multiply-add chain over the
// channel vectors, then SumOfLanes), so the same floats and bytes; but the
// (delta, min) pairs, the products and the slot vectors stay in registers
// from the halves to the int8 weights. The three steps apart (three calls,
// the products stored and read back deinterleaved, then again to quantize)
// took 103 ns for a group of four queries (bench_kernels key_weights/4),
// each query's bias and maximum a latency chain behind the one before.
template <int kV, int kPer>
HWY_INLINE void KeyWeightsInt8V(const half_bits* HWY_RESTRICT params, const float* HWY_RESTRICT q, std::int64_t nq,
                                std::int64_t q_stride, float scale, std::int8_t* HWY_RESTRICT w8,
                                float* HWY_RESTRICT ws, float* HWY_RESTRICT kmin, float* HWY_RESTRICT bias) {
  static_assert(kV % 4 == 0 && (kPer == 2 || kPer == 4), "whole groups of 64 weights, 2 or 4 phases");
  constexpr int kDim = 16 * kV;
  const DF df;
  using V = hn::Vec<DF>;
  alignas(64) static constexpr std::int32_t kEven[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static constexpr std::int32_t kOdd[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i even = _mm512_load_si512(kEven), odd = _mm512_load_si512(kOdd);
  const auto evens = [&](V a, V b) { return V{_mm512_permutex2var_ps(a.raw, even, b.raw)}; };
  const auto odds = [&](V a, V b) { return V{_mm512_permutex2var_ps(a.raw, odd, b.raw)}; };
  const hn::Rebind<hwy::float16_t, DF> dh;
  V dl[kV], mn[kV];
  for (int v = 0; v < kV; ++v) {  // 16 channels' (delta, min) pairs per 64 bytes
    const auto* h = reinterpret_cast<const hwy::float16_t*>(params + 32 * v);
    const V a = hn::PromoteTo(df, hn::LoadU(dh, h)), b = hn::PromoteTo(df, hn::LoadU(dh, h + 16));
    dl[v] = evens(a, b);
    mn[v] = odds(a, b);
    hn::StoreU(mn[v], df, kmin + 16 * v);
  }
  const auto sv = hn::Set(df, scale);
  for (std::int64_t j = 0; j < nq; ++j) {
    const float* qj = q + j * q_stride;
    V w[kV];
    auto bv = hn::Zero(df), mv = bv;
    for (int v = 0; v < kV; ++v) {
      const auto qs = hn::Mul(sv, hn::LoadU(df, qj + 16 * v));
      bv = hn::MulAdd(qs, mn[v], bv);
      w[v] = hn::Mul(qs, dl[v]);
      mv = hn::Max(mv, hn::Abs(w[v]));
    }
    bias[j] = hn::GetLane(hn::SumOfLanes(df, bv));
    const float m = hn::GetLane(hn::MaxOfLanes(df, mv));
    std::int8_t* out = w8 + j * kDim;
    if (!(m > 0.0f)) {
      std::memset(out, 0, kDim);
      ws[j] = 0.0f;
      continue;
    }
    // Slot vector u: slots [16u, 16u + 16), phase-major (Slots::slot).
    V s[kV];
    if constexpr (kPer == 2) {
      for (int u = 0; u < kV / 2; ++u) {
        s[u] = evens(w[2 * u], w[2 * u + 1]);
        s[kV / 2 + u] = odds(w[2 * u], w[2 * u + 1]);
      }
    } else {  // channels 4i + k: the even and odd halves of the even and odd ones
      V e[kV / 2], o[kV / 2];
      for (int u = 0; u < kV / 2; ++u) {
        e[u] = evens(w[2 * u], w[2 * u + 1]);
        o[u] = odds(w[2 * u], w[2 * u + 1]);
      }
      for (int u = 0; u < kV / 4; ++u) {
        s[u] = evens(e[2 * u], e[2 * u + 1]);              // k = 0
        s[kV / 4 + u] = evens(o[2 * u], o[2 * u + 1]);     // k = 1
        s[kV / 2 + u] = odds(e[2 * u], e[2 * u + 1]);      // k = 2
        s[3 * kV / 4 + u] = odds(o[2 * u], o[2 * u + 1]);  // k = 3
      }
    }
    const RoundingScale rs(m, 127);
    for (int g = 0; g < kV / 4; ++g)  // as QuantizeRow's 64 weights a step
      _mm512_storeu_si512(out + 64 * g,
                          RoundPack64(rs, s[4 * g].raw, s[4 * g + 1].raw, s[4 * g + 2].raw, s[4 * g + 3].raw));
    ws[j] = m / 127.0f;
  }
}
#endif

#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
// The widest block KeyWeightsInt8Lanes takes (its buffers on the stack).
constexpr std::int64_t kFusedKeyDim = 256;

// key_weights_int8 on the other fixed-size targets (and AVX-512's other
// widths): KeyWeights' vector path (QueryProducts, ChannelsToSlots) and
// QuantizeRow<1> per query in one call,
// with their operations (the same bytes and floats), from the halves on; the
// products go through two small buffers (channel order, then slot order)
// instead of the three steps' dispatched calls and passes over the group.
// run % Lanes == 0, dim <= kFusedKeyDim.
template <int kPer>
HWY_INLINE void KeyWeightsInt8Lanes(const half_bits* HWY_RESTRICT params, const float* HWY_RESTRICT q, std::int64_t nq,
                                    std::int64_t q_stride, float scale, std::int64_t run, std::int8_t* HWY_RESTRICT w8,
                                    float* HWY_RESTRICT ws, float* HWY_RESTRICT kmin, float* HWY_RESTRICT bias) {
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  const std::int64_t dim = kPer * run;
  HWY_ALIGN float delta[kFusedKeyDim], prod[kFusedKeyDim], slots[kFusedKeyDim];
  const auto* h = reinterpret_cast<const hwy::float16_t*>(params);
  for (std::int64_t c = 0; c < dim; c += N) {  // channels c .. c + N - 1: 2N halves, (delta, min) pairs
    const auto a = hn::PromoteTo(df, hn::LoadU(dh, h + 2 * c)), b = hn::PromoteTo(df, hn::LoadU(dh, h + 2 * c + N));
    hn::Store(hn::ConcatEven(df, b, a), df, delta + c);
    hn::StoreU(hn::ConcatOdd(df, b, a), df, kmin + c);
  }
  for (std::int64_t j = 0; j < nq; ++j) {
    float m = 0.0f;
    QueryProducts(q + j * q_stride, delta, kmin, scale, dim, prod, bias[j], m);
    for (std::int64_t i = 0; i < run; i += N) ChannelsToSlots<kPer>(prod, run, i, slots);
    ws[j] = QuantizeRow<1>(slots, dim, w8 + j * dim, m);
  }
}
#endif

// key_weights_int8 (key_side.h); false where this target or shape has no
// fused pass.
bool KeyWeightsInt8(const half_bits* params, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                    std::int64_t per, std::int64_t run, std::int8_t* w8, float* ws, float* kmin, float* bias) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  const auto go = [&](auto v, auto p) {
    KeyWeightsInt8V<decltype(v)::value, decltype(p)::value>(params, q, nq, q_stride, scale, w8, ws, kmin, bias);
    return true;
  };
  using P2 = std::integral_constant<int, 2>;
  using P4 = std::integral_constant<int, 4>;
  const std::int64_t dim = per * run;
  if (per == 2 || per == 4) {
    const bool two = per == 2;
    switch (dim) {
      case 64:
        return two ? go(std::integral_constant<int, 4>(), P2()) : go(std::integral_constant<int, 4>(), P4());
      case 128:
        return two ? go(std::integral_constant<int, 8>(), P2()) : go(std::integral_constant<int, 8>(), P4());
      case 256:
        return two ? go(std::integral_constant<int, 16>(), P2()) : go(std::integral_constant<int, 16>(), P4());
      default:
        break;
    }
  }
#endif
#if !HWY_HAVE_SCALABLE && HWY_TARGET != HWY_SCALAR
  if ((per == 2 || per == 4) && per * run <= kFusedKeyDim && run % static_cast<std::int64_t>(hn::Lanes(DF())) == 0) {
    if (per == 2)
      KeyWeightsInt8Lanes<2>(params, q, nq, q_stride, scale, run, w8, ws, kmin, bias);
    else
      KeyWeightsInt8Lanes<4>(params, q, nq, q_stride, scale, run, w8, ws, kmin, bias);
    return true;
  }
#else
  (void)params, (void)q, (void)nq, (void)q_stride, (void)scale, (void)per, (void)run, (void)w8, (void)ws, (void)kmin,
      (void)bias;
#endif
  return false;
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }
std::int64_t TargetId() { return HWY_TARGET; }

}  // namespace KVCAL_KERNEL_NS
}  // namespace kvcal::runtime::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvcal::runtime::detail {

HWY_EXPORT(TargetName);
HWY_EXPORT(TargetId);
HWY_EXPORT(DotF);
HWY_EXPORT(AxpyF);
HWY_EXPORT(SoftmaxRow);
HWY_EXPORT(OnlineSoftmaxRow);
HWY_EXPORT(HalfScores);
HWY_EXPORT(HalfAccumulate);
HWY_EXPORT(CodeScores);
HWY_EXPORT(CodeAccumulate);
HWY_EXPORT(WidenCodes3To4);
HWY_EXPORT(QuantizeRows);
HWY_EXPORT(AddSlots);
HWY_EXPORT(AxpyInt);
HWY_EXPORT(KeyWeights);
HWY_EXPORT(KeyWeightsInt8);

namespace {
// A row of floats per thread for the kernels that convert or unpack a row
// before their vector loop (grown, never shrunk: no allocation per call).
float* row_scratch(std::int64_t n) {
  thread_local std::vector<float> row;
  if (static_cast<std::int64_t>(row.size()) < n) row.resize(static_cast<std::size_t>(n));
  return row.data();
}
// Codes unpacked to bytes, for channel-order rows only (else unused).
std::uint8_t* byte_scratch(int bits, std::int64_t rows, std::int64_t dim) {
  thread_local std::vector<std::uint8_t> bytes;
  if (Slots(bits, dim).per != 1) return nullptr;
  if (static_cast<std::int64_t>(bytes.size()) < rows * dim) bytes.resize(static_cast<std::size_t>(rows * dim));
  return bytes.data();
}
}  // namespace

const char* kernel_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

std::int64_t kernel_target_id() { return HWY_DYNAMIC_DISPATCH(TargetId)(); }

float dot(const float* a, const float* b, std::int64_t n) { return HWY_DYNAMIC_DISPATCH(DotF)(a, b, n); }
void axpy(float w, const float* x, float* y, std::int64_t n) { HWY_DYNAMIC_DISPATCH(AxpyF)(w, x, y, n); }
void softmax_row(float* r, std::int64_t n) { HWY_DYNAMIC_DISPATCH(SoftmaxRow)(r, n); }
float online_softmax_row(float* r, std::int64_t n, float& m, float& z) {
  return HWY_DYNAMIC_DISPATCH(OnlineSoftmaxRow)(r, n, &m, &z);
}

void half_scores(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k, std::int64_t rows,
                 std::int64_t dim, std::int64_t k_stride, float scale, float* out, std::int64_t out_stride) {
  HWY_DYNAMIC_DISPATCH(HalfScores)(q, nq, q_stride, k, rows, dim, k_stride, scale, out, out_stride, row_scratch(dim));
}

void half_accumulate(const float* p, std::int64_t nq, std::int64_t p_stride, const half_bits* v, std::int64_t rows,
                     std::int64_t dim, std::int64_t v_stride, float* out, std::int64_t out_stride) {
  HWY_DYNAMIC_DISPATCH(HalfAccumulate)(p, nq, p_stride, v, rows, dim, v_stride, out, out_stride, row_scratch(dim));
}

void code_scores(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                 const float* w, std::int64_t nq, std::int64_t w_stride, float* out, std::int64_t out_stride) {
  HWY_DYNAMIC_DISPATCH(CodeScores)
  (codes, rows, row_bytes, bits, dim, w, nq, w_stride, out, out_stride, byte_scratch(bits, rows, dim));
}

void code_accumulate(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                     const float* a, std::int64_t nq, std::int64_t a_stride, float* acc, std::int64_t acc_stride) {
  HWY_DYNAMIC_DISPATCH(CodeAccumulate)
  (codes, rows, row_bytes, bits, dim, a, nq, a_stride, acc, acc_stride, byte_scratch(bits, rows, dim));
}

void add_slots(const float* acc, const Slots& sl, float bias, float* out) {
  HWY_DYNAMIC_DISPATCH(AddSlots)(acc, sl.per, sl.run, bias, out);
}
void axpy_int(float w, const std::int32_t* x, float* y, std::int64_t n) { HWY_DYNAMIC_DISPATCH(AxpyInt)(w, x, y, n); }
void key_weights(const float* params, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                 const Slots& sl, float* qd, float* kmin, float* bias, float* amax, float* tmp) {
  HWY_DYNAMIC_DISPATCH(KeyWeights)(params, q, nq, q_stride, scale, sl.per, sl.run, qd, kmin, bias, amax, tmp);
}
bool key_weights_int8(const half_bits* params, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                      const Slots& sl, std::int8_t* w8, float* ws, float* kmin, float* bias) {
  return HWY_DYNAMIC_DISPATCH(KeyWeightsInt8)(params, q, nq, q_stride, scale, sl.per, sl.run, w8, ws, kmin, bias);
}
bool int_dot_layout(int bits, std::int64_t dim) {
  if (bits == 3) return dim % 8 == 0 && dim / 2 <= kIntWide3Bytes && int_dot_layout(4, dim);
  const Slots sl(bits, dim);
  return (bits == 2 || bits == 4) && sl.per > 1 && sl.run % 16 == 0;
}

bool key_tiles_layout(int bits, std::int64_t dim) { return int_dot_layout(bits, dim); }

void rows_to_value_tiles(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, std::uint8_t* out) {
  const std::int64_t whole = rows / kValueTileRows * kValueTileRows;
  for (std::int64_t r = 0; r < whole; r += kValueTileRows)
    for (std::int64_t k = 0; k < kValueTileRows; ++k)
      for (std::int64_t b = 0; b < row_bytes; ++b)
        out[r * row_bytes + kValueTileRows * b + k] = in[(r + k) * row_bytes + b];
  if (rows > whole)  // the rows after the last whole group, as they are
    std::memcpy(out + whole * row_bytes, in + whole * row_bytes, static_cast<std::size_t>((rows - whole) * row_bytes));
}

void value_tiles_to_rows(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, std::uint8_t* out) {
  const std::int64_t whole = rows / kValueTileRows * kValueTileRows;
  for (std::int64_t r = 0; r < whole; r += kValueTileRows)
    for (std::int64_t k = 0; k < kValueTileRows; ++k)
      for (std::int64_t b = 0; b < row_bytes; ++b)
        out[(r + k) * row_bytes + b] = in[r * row_bytes + kValueTileRows * b + k];
  if (rows > whole)  // the rows after the last whole group, as they are
    std::memcpy(out + whole * row_bytes, in + whole * row_bytes, static_cast<std::size_t>((rows - whole) * row_bytes));
}

namespace {
// Calls f(tile offset, row offset, n) for each unit: n bytes at the first
// offset in the tile layout, at the second in the rows.
template <class F>
void for_each_unit(std::int64_t rows, std::int64_t row_bytes, int bits, F f) {
  const std::int64_t unit = KeyTileUnit(bits), units = row_bytes / unit;
  for (std::int64_t t0 = 0; t0 < rows; t0 += kKeyTileRows) {
    const std::int64_t n = std::min(kKeyTileRows, rows - t0);  // the tile's rows
    for (std::int64_t rr = 0; rr < n; ++rr)
      for (std::int64_t g = 0; g < units; ++g)
        f(t0 * row_bytes + (g * n + rr) * unit, (t0 + rr) * row_bytes + g * unit, unit);
  }
}
}  // namespace

void rows_to_key_tiles(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, int bits, std::uint8_t* out) {
  for_each_unit(rows, row_bytes, bits, [&](std::int64_t at_tile, std::int64_t at_row, std::int64_t n) {
    std::memcpy(out + at_tile, in + at_row, static_cast<std::size_t>(n));
  });
}

void key_tiles_to_rows(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, int bits, std::uint8_t* out) {
  for_each_unit(rows, row_bytes, bits, [&](std::int64_t at_tile, std::int64_t at_row, std::int64_t n) {
    std::memcpy(out + at_row, in + at_tile, static_cast<std::size_t>(n));
  });
}

void widen_codes3(const std::uint8_t* codes, std::int64_t rows, std::int64_t dim, std::uint8_t* out) {
  HWY_DYNAMIC_DISPATCH(WidenCodes3To4)(codes, rows * dim / 8, out);
}

float quantize_weights14(const float* w, std::int64_t n, std::int8_t* limbs) {
  float scale = 0.0f;
  HWY_DYNAMIC_DISPATCH(QuantizeRows)(2, w, 1, n, limbs, &scale, nullptr);
  return scale;
}

float quantize_weights8(const float* w, std::int64_t n, std::int8_t* v8) {
  float scale = 0.0f;
  HWY_DYNAMIC_DISPATCH(QuantizeRows)(1, w, 1, n, v8, &scale, nullptr);
  return scale;
}

void quantize_rows(int limbs, const float* w, std::int64_t rows, std::int64_t n, std::int8_t* out, float* scales,
                   const float* amax) {
  HWY_DYNAMIC_DISPATCH(QuantizeRows)(limbs, w, rows, n, out, scales, amax);
}

namespace {
// The integer weight of limb-split weights w (n of them) at i.
std::int32_t limb_weight(const std::int8_t* w, std::int64_t n, int limbs, std::int64_t i) {
  return limbs == 1 ? std::int32_t{w[i]} : 128 * w[i] + w[n + i];
}
}  // namespace

void code_accumulate_int_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                                   std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                                   std::int64_t w8_stride, std::int32_t* acc, std::int64_t acc_stride) {
  const Slots sl = int_slots(bits, dim);
  for (std::int64_t j = 0; j < nq; ++j) {
    const std::int8_t* w = w8 + j * w8_stride;
    for (std::int64_t c = 0; c < dim; ++c) {
      std::int32_t s = 0;
      for (std::int64_t r = 0; r < rows; ++r)
        s += limb_weight(w, rows, limbs, r) * static_cast<std::int32_t>(packed_code(codes + r * row_bytes, c, bits));
      acc[j * acc_stride + sl.slot(c)] += s;
    }
  }
}

void code_scores_int_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                               std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                               std::int64_t w8_stride, std::int32_t* out, std::int64_t out_stride) {
  const Slots sl = int_slots(bits, dim);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < nq; ++j) {
      const std::int8_t* w = w8 + j * w8_stride;
      std::int32_t s = 0;
      for (std::int64_t c = 0; c < dim; ++c)
        s += limb_weight(w, dim, limbs, sl.slot(c)) *
             static_cast<std::int32_t>(packed_code(codes + r * row_bytes, c, bits));
      out[j * out_stride + r] = s;
    }
}

void code_scores_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                           std::int64_t dim, const float* w, std::int64_t nq, std::int64_t w_stride, float* out,
                           std::int64_t out_stride) {
  const Slots sl(bits, dim);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < nq; ++j) {
      double s = 0;
      for (std::int64_t c = 0; c < dim; ++c)
        s += static_cast<double>(w[j * w_stride + sl.slot(c)]) * packed_code(codes + r * row_bytes, c, bits);
      out[j * out_stride + r] = static_cast<float>(s);
    }
}

void code_accumulate_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                               std::int64_t dim, const float* a, std::int64_t nq, std::int64_t a_stride, float* acc,
                               std::int64_t acc_stride) {
  const Slots sl(bits, dim);
  for (std::int64_t j = 0; j < nq; ++j)
    for (std::int64_t c = 0; c < dim; ++c) {
      double s = acc[j * acc_stride + sl.slot(c)];
      for (std::int64_t r = 0; r < rows; ++r)
        s += static_cast<double>(a[j * a_stride + r]) * packed_code(codes + r * row_bytes, c, bits);
      acc[j * acc_stride + sl.slot(c)] = static_cast<float>(s);
    }
}

}  // namespace kvcal::runtime::detail
#endif  // HWY_ONCE
