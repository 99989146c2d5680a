// A serving engine's view: only kvcal::runtime (a shared library whose headers
// need nothing but the standard library). Streams keys and values through a
// HEX cache with a mask generated and certified on the fly, and checks that
// the fp16 method reproduces plain attention exactly.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvcal/runtime/hex.h"
#include "kvcal/runtime/mask_cache.h"

namespace rt = kvcal::runtime;

int main() {
  const std::int64_t heads = 2, dim = 64, tokens = 200, q_heads = 4;
  std::mt19937 rng(1);
  std::normal_distribution<float> g;
  std::vector<rt::half_bits> k(heads * tokens * dim), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = rt::float_to_half(g(rng));
    v[i] = rt::float_to_half(g(rng));
  }
  std::vector<float> q(q_heads * dim), ref(q.size()), out(q.size());
  for (float& x : q) x = g(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  for (std::int64_t h = 0; h < heads; ++h)
    rt::attend_fp16(q.data() + h * 2 * dim, 2, dim, k.data() + h * tokens * dim, v.data() + h * tokens * dim, tokens,
                    dim, dim, scale, ref.data() + h * 2 * dim, dim);
  rt::MaskCache masks;
  double worst_fp16 = 0, err_hex = 0, norm = 0;
  for (const char* method : {"fp16", "hex4"}) {
    const rt::HexOptions o = rt::hex_method(method);
    rt::HexLayerCache cache(heads, dim, o, masks.get(o.block, dim, o.sparsity));
    cache.append(k.data(), v.data(), tokens, tokens * dim, dim);
    cache.attend(q.data(), q_heads, scale, out.data());
    for (std::size_t i = 0; i < out.size(); ++i) {
      const double d = std::abs(static_cast<double>(out[i]) - ref[i]);
      if (method[0] == 'f')
        worst_fp16 = std::max(worst_fp16, d);
      else
        err_hex += d * d, norm += static_cast<double>(ref[i]) * ref[i];
    }
    std::printf("%s: %lld of %lld tokens compressed, %.1f%% of fp16\n", method,
                static_cast<long long>(cache.compressed_tokens()), static_cast<long long>(cache.tokens()),
                100.0 * static_cast<double>(cache.bytes()) / static_cast<double>(cache.fp16_bytes()));
  }
  const double rel = std::sqrt(err_hex / norm);
  const bool ok = worst_fp16 < 1e-5 && rel > 0 && rel < 0.2;
  std::printf("fp16 max |diff| %.2e, hex4 relative error %.4f: %s\n", worst_fp16, rel, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
