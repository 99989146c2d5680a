// HEX CPU kernels, compiled once per SIMD target (see kernels_cpu.h): this
// file is included again by hwy/foreach_target.h for each target, and
// HWY_DYNAMIC_DISPATCH picks the best one the host supports on each call.
// AVX3_DL (AVX-512 with VNNI, VBMI2, VPOPCNTDQ) is one of the compiled
// targets; Highway leaves it out unless asked before its first include.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1
#endif
#include "runtime/hex/kernels_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // _pdep_u64 (BMI2: part of the AVX2 and AVX-512 targets)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "runtime/hex/kernels_cpu.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// After highway.h, once per target (kept apart so that include sorting
// cannot move it above foreach_target.h).
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace kvcal::runtime::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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
constexpr std::int64_t kPrefetchRows = 6;

HWY_INLINE float Sum(DF d, hn::Vec<DF> v) { return hn::GetLane(hn::SumOfLanes(d, v)); }

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

// Softmax of one row of n scores in place: max, then exp and sum, then scale.
// Highway's Exp is within 1 ulp of std::exp and flushes arguments below -104
// to 0 (the weight is then below FLT_MIN anyway).
void SoftmaxRow(float* r, std::int64_t n) {
  const DF d;
  const auto N = static_cast<std::int64_t>(hn::Lanes(d));
  auto mv = hn::Set(d, -std::numeric_limits<float>::infinity());
  std::int64_t i = 0;
  for (; i + N <= n; i += N) mv = hn::Max(mv, hn::LoadU(d, r + i));
  float m = hn::GetLane(hn::MaxOfLanes(d, mv));
  for (; i < n; ++i) m = std::max(m, r[i]);
  const auto mvec = hn::Set(d, m);
  auto z0 = hn::Zero(d);
  for (i = 0; i + N <= n; i += N) {
    const auto e = hn::Exp(d, hn::Sub(hn::LoadU(d, r + i), mvec));
    hn::StoreU(e, d, r + i);
    z0 = hn::Add(z0, e);
  }
  float z = Sum(d, z0);
  for (; i < n; ++i) {
    r[i] = std::exp(r[i] - m);
    z += r[i];
  }
  const float inv = 1.0f / z;
  const auto iv = hn::Set(d, inv);
  for (i = 0; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, r + i), iv), d, r + i);
  for (; i < n; ++i) r[i] *= inv;
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

void HalfScores(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k, std::int64_t rows,
                std::int64_t dim, std::int64_t k_stride, float scale, float* out, std::int64_t out_stride, float* row) {
  for (std::int64_t t = 0; t < rows; ++t) {
    RowToFloats(k + t * k_stride, dim, row);
    for (std::int64_t j = 0; j < nq; ++j) out[j * out_stride + t] = scale * DotF(q + j * q_stride, row, dim);
  }
}

void HalfAccumulate(const float* p, std::int64_t nq, std::int64_t p_stride, const half_bits* v, std::int64_t rows,
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

// Scores of kQ queries over phase-split rows (per = 2 or 4): one load and
// unpacking of the codes serves every query of the group.
template <int kPer, int kQ>
void ScoresSplit(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run, const float* w,
                 std::int64_t w_stride, float* out, std::int64_t out_stride) {
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint8_t* row = codes + r * row_bytes;
    __builtin_prefetch(row + kPrefetchRows * row_bytes, 0, 3);  // past the end is harmless
    auto a0 = hn::Zero(df), a1 = a0, a2 = a0, a3 = a0;
    std::int64_t i = 0;
    for (; i + N <= run; i += N) {
      auto c0 = hn::Zero(df), c1 = c0, c2 = c0, c3 = c0;
      LoadPhases<kPer>(row + i, c0, c1, c2, c3);
      a0 = DotPhases<kPer>(c0, c1, c2, c3, w + i, run, a0);
      if constexpr (kQ > 1) a1 = DotPhases<kPer>(c0, c1, c2, c3, w + w_stride + i, run, a1);
      if constexpr (kQ > 2) a2 = DotPhases<kPer>(c0, c1, c2, c3, w + 2 * w_stride + i, run, a2);
      if constexpr (kQ > 3) a3 = DotPhases<kPer>(c0, c1, c2, c3, w + 3 * w_stride + i, run, a3);
    }
    float s[4] = {Sum(df, a0), kQ > 1 ? Sum(df, a1) : 0.0f, kQ > 2 ? Sum(df, a2) : 0.0f, kQ > 3 ? Sum(df, a3) : 0.0f};
    for (int j = 0; j < kQ; ++j) {
      const float* wj = w + j * w_stride;
      for (std::int64_t t = i; t < run; ++t)
        for (int k = 0; k < kPer; ++k) s[j] += wj[k * run + t] * PhaseCode<kPer>(row[t], k);
      out[j * out_stride + r] = s[j];
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
                     const float* a, std::int64_t a_stride, float* acc, std::int64_t acc_stride) {
  const DF df;
  const auto N = static_cast<std::int64_t>(hn::Lanes(df));
  std::int64_t i = 0;
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

template <int kQ>
void AccumulateSplitQ(int per, const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, std::int64_t run,
                      const float* a, std::int64_t a_stride, float* acc, std::int64_t acc_stride) {
  if (per == 1)
    AccumulateSplit<1, kQ>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride);
  else if (per == 2)
    AccumulateSplit<2, kQ>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride);
  else
    AccumulateSplit<4, kQ>(codes, rows, row_bytes, run, a, a_stride, acc, acc_stride);
}

// Queries are taken four at a time (a GQA group of 4 in one pass; the
// accumulators of larger groups would not stay in registers).
void CodeScores(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                const float* w, std::int64_t nq, std::int64_t w_stride, float* out, std::int64_t out_stride,
                std::uint8_t* bytes) {
  const Slots sl(bits, dim);
  if (sl.per == 1) {  // one code per byte first, read by every query
    UnpackBytes(codes, rows, row_bytes, bits, dim, bytes);
    codes = bytes;
    row_bytes = dim;
  }
  const int per = static_cast<int>(sl.per);
  for (std::int64_t j = 0; j < nq; j += 4) {
    const float* wj = w + j * w_stride;
    float* oj = out + j * out_stride;
    switch (std::min<std::int64_t>(4, nq - j)) {
      case 1:
        ScoresSplitQ<1>(per, codes, rows, row_bytes, sl.run, wj, w_stride, oj, out_stride);
        break;
      case 2:
        ScoresSplitQ<2>(per, codes, rows, row_bytes, sl.run, wj, w_stride, oj, out_stride);
        break;
      case 3:
        ScoresSplitQ<3>(per, codes, rows, row_bytes, sl.run, wj, w_stride, oj, out_stride);
        break;
      default:
        ScoresSplitQ<4>(per, codes, rows, row_bytes, sl.run, wj, w_stride, oj, out_stride);
        break;
    }
  }
}

void CodeAccumulate(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                    const float* a, std::int64_t nq, std::int64_t a_stride, float* acc, std::int64_t acc_stride,
                    std::uint8_t* bytes) {
  const Slots sl(bits, dim);
  if (sl.per == 1) {  // one code per byte first, read by every query
    UnpackBytes(codes, rows, row_bytes, bits, dim, bytes);
    codes = bytes;
    row_bytes = dim;
  }
  const int per = static_cast<int>(sl.per);
  for (std::int64_t j = 0; j < nq; j += 4) {
    const float* aj = a + j * a_stride;
    float* cj = acc + j * acc_stride;
    switch (std::min<std::int64_t>(4, nq - j)) {
      case 1:
        AccumulateSplitQ<1>(per, codes, rows, row_bytes, sl.run, aj, a_stride, cj, acc_stride);
        break;
      case 2:
        AccumulateSplitQ<2>(per, codes, rows, row_bytes, sl.run, aj, a_stride, cj, acc_stride);
        break;
      case 3:
        AccumulateSplitQ<3>(per, codes, rows, row_bytes, sl.run, aj, a_stride, cj, acc_stride);
        break;
      default:
        AccumulateSplitQ<4>(per, codes, rows, row_bytes, sl.run, aj, a_stride, cj, acc_stride);
        break;
    }
  }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace kvcal::runtime::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvcal::runtime::detail {

HWY_EXPORT(TargetName);
HWY_EXPORT(DotF);
HWY_EXPORT(AxpyF);
HWY_EXPORT(SoftmaxRow);
HWY_EXPORT(HalfScores);
HWY_EXPORT(HalfAccumulate);
HWY_EXPORT(CodeScores);
HWY_EXPORT(CodeAccumulate);

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

float dot(const float* a, const float* b, std::int64_t n) { return HWY_DYNAMIC_DISPATCH(DotF)(a, b, n); }
void axpy(float w, const float* x, float* y, std::int64_t n) { HWY_DYNAMIC_DISPATCH(AxpyF)(w, x, y, n); }
void softmax_row(float* r, std::int64_t n) { HWY_DYNAMIC_DISPATCH(SoftmaxRow)(r, n); }

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
