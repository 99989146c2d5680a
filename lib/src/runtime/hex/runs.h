// A HEX block's tokens in token order as the runs of quantized tokens
// between its kept ones, for the decode paths (block.cpp) and the fused
// entry kernels (entries_cpu.cpp) alike.
#pragma once

#include <cstdint>

namespace kvcal::runtime::detail {

// Steps through the tokens [0, tokens) of a block whose nk kept tokens sit
// at kept[0 .. nk) (ascending): step k (0 <= k <= nk) holds the run of
// quantized tokens [t0, t0 + n) before kept token k, or before the block's
// end for k = nk (n = 0 where there is none), qr0 the quantized row of t0,
// and then, for k < nk, the kept token at `end`:
//   for (TokenRuns s{kept, nk, tokens}; s.next();) ...
// A cursor rather than a walk taking callbacks: the SIMD kernels' callbacks
// are compiled for their target (always inlined), and a function defined
// outside the target's code could not inline them.
struct TokenRuns {
  const std::uint16_t* kept;
  std::int64_t nk, tokens;
  std::int64_t k = -1, t0 = 0, n = 0, qr0 = 0, end = -1;

  // To the next step; false past the last. Always inlined: as a plain
  // inline function it moved GCC's inlining choices in the fused kernels
  // around it (their short runs' vectors became calls).
  [[gnu::always_inline]] bool next() {
    qr0 += n;
    t0 = end + 1;
    if (++k > nk) return false;
    end = k < nk ? kept[k] : tokens;
    n = end - t0;
    return true;
  }
  // Whether the step ends at a kept token (kept[k] == end).
  bool at_kept() const { return k < nk; }
};

}  // namespace kvcal::runtime::detail
