#include "kvcal/runtime/common.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvcal::runtime {

void halves_to_floats(const half_bits* in, std::int64_t n, float* out) {
  std::int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(in[i]);
}

void floats_to_halves(const float* in, std::int64_t n, half_bits* out) {
  std::int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) out[i] = float_to_half(in[i]);
}

}  // namespace kvcal::runtime
