// Compile check: the runtime's shared layouts and inline helpers are usable in
// device code (KVCAL_HD = __host__ __device__). Built whenever CUDA is enabled;
// it dequantizes one block on the device the way a decode kernel would read it.
#include "kvcal/runtime/hex.h"

namespace rt = kvcal::runtime;

__global__ void dequantize_keys(rt::HexBlockView b, float* k) {
  const int t = blockIdx.x, c = threadIdx.x;
  if (t >= b.tokens || c >= b.head_dim) return;
  // Quantized row index of token t: tokens before it that are not kept.
  int kept = 0;
  while (kept < b.kept_rows && b.kept_index[kept] < t) ++kept;
  if (kept < b.kept_rows && b.kept_index[kept] == t) {
    k[t * b.head_dim + c] = rt::half_to_float(b.k_kept[kept * b.head_dim + c]);
    return;
  }
  const int q = t - kept;
  const unsigned code = rt::packed_code(b.k_codes + q * b.row_bytes, c, b.bits);
  float x = rt::dequantize_value(code, b.k_params[c]);
  for (int e = 0; e < b.mask_degree; ++e)
    if (b.mask_indices[t * b.mask_degree + e] == c) x = rt::half_to_float(b.k_sparse[q * b.mask_degree + e]);
  k[t * b.head_dim + c] = x;
}

void launch_dequantize_keys(const rt::HexBlockView& b, float* k) { dequantize_keys<<<b.tokens, b.head_dim>>>(b, k); }
