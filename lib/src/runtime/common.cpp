#include "kvcal/runtime/common.h"

#include "kvcal/core/half.h"
#include "runtime/hex/kernels_cpu.h"

namespace kvcal::runtime {

void halves_to_floats(const half_bits* in, std::int64_t n, float* out) { fp16::to_floats(in, n, out); }
void floats_to_halves(const float* in, std::int64_t n, half_bits* out) { fp16::from_floats(in, n, out); }

std::string simd_target() {
  std::string t = detail::kernel_target();
  switch (detail::vnni_kernels()) {  // the integer kernels on VPDPBUSD where the target has none
    case detail::VnniKernels::kAvx2:
      return t + "+AVX-VNNI";
    case detail::VnniKernels::kAvx3:
      return t + "+AVX512-VNNI";
    case detail::VnniKernels::kNone:
      break;
  }
  return t;
}

std::int64_t prefetch_far_bytes(int bits) { return detail::prefetch_far_bytes(bits); }
std::int64_t prefetch_near_rows(bool values) {
  const detail::NearRows n = detail::prefetch_near_rows();
  return values ? n.values : n.keys;
}

}  // namespace kvcal::runtime
