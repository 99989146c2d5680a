// Bulk binary16 conversions, compiled once per SIMD target (hwy/foreach_target.h
// includes this file again for each) and dispatched at run time.
// AVX3_DL (AVX-512 with VNNI, VBMI2, VPOPCNTDQ) is one of the compiled
// targets; Highway leaves it out unless asked before its first include.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1
#endif
#include "kvcal/core/half.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/half.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace kvcal::fp16 {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Only targets with a hardware conversion (F16C: x86-64 AVX2 and up; Arm
// NEON/SVE) take the vector path: it is exact there, as the scalar routine.
#if (HWY_ARCH_X86 && HWY_TARGET > HWY_AVX2) || HWY_TARGET == HWY_EMU128 || HWY_TARGET == HWY_SCALAR
constexpr bool kHardwareHalf = false;
#else
constexpr bool kHardwareHalf = true;
#endif

void ToFloats(const half_bits* in, std::int64_t n, float* out) {
  std::int64_t i = 0;
  if constexpr (kHardwareHalf) {
    const hn::ScalableTag<float> df;
    const hn::Rebind<hwy::float16_t, decltype(df)> dh;
    const auto N = static_cast<std::int64_t>(hn::Lanes(df));
    for (; i + N <= n; i += N)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(in + i))), df, out + i);
  }
  for (; i < n; ++i) out[i] = to_float(in[i]);
}

void FromFloats(const float* in, std::int64_t n, half_bits* out) {
  std::int64_t i = 0;
  if constexpr (kHardwareHalf) {
    const hn::ScalableTag<float> df;
    const hn::Rebind<hwy::float16_t, decltype(df)> dh;
    const auto N = static_cast<std::int64_t>(hn::Lanes(df));
    for (; i + N <= n; i += N)
      hn::StoreU(hn::DemoteTo(dh, hn::LoadU(df, in + i)), dh, reinterpret_cast<hwy::float16_t*>(out + i));
  }
  for (; i < n; ++i) out[i] = from_float(in[i]);
}

}  // namespace HWY_NAMESPACE
}  // namespace kvcal::fp16
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kvcal::fp16 {

HWY_EXPORT(ToFloats);
HWY_EXPORT(FromFloats);

void to_floats(const half_bits* in, std::int64_t n, float* out) { HWY_DYNAMIC_DISPATCH(ToFloats)(in, n, out); }
void from_floats(const float* in, std::int64_t n, half_bits* out) { HWY_DYNAMIC_DISPATCH(FromFloats)(in, n, out); }

}  // namespace kvcal::fp16
#endif  // HWY_ONCE
