// The decode kernels: work items over pages, then the merge of splits. Included by hex_decode.cu and by the host
// emulation (tests/cuda/emulated_kernels.cpp); see kernels_common.cuh.
// Include after <cuda_runtime.h> (nvcc) or tests/cuda/cuda_emulation.h.
//
// A work item walks its pages one after another. Each side of a page (key:
// kept indices, kept rows, codes, parameters, expander entries; value: kept
// rows, codes, parameters, entries) is copied into its own shared-memory stage
// with asynchronous 32-bit copies, rows padded to an odd number of words so
// that one thread per row reads them without bank conflicts, one unit ahead:
// a page's value side lands while it is scored, the next page's key side while
// its values are accumulated (with one stage where two do not fit, each side
// is copied when the other is used up). Per page, the thread block
//  1. waits for the key side, then scales the queries by the key groups' deltas
//     and sums q . min;
//  2. scores every token of the query group, one thread per quantized row, then
//     one per kept row (no divergence between the two but in one warp): codes
//     widened 32 at a time with compile-time shifts, the query terms read as
//     broadcast 16-byte loads;
//  3. starts the next key side, updates the running maximum, waits for the
//     value side, then the weights, and per-row weights w = p delta;
//  4. accumulates the values, one thread per channel over the quantized rows
//     (sum of w x code, plus sum of p min once), then the kept rows, then the
//     expander entries' corrections; then starts the next value side.
// The residual rows (the request's partial block) are read in place.
//
// With tensor cores (kMmaBits: 4- or 2-bit codes, head_dim a multiple of 64,
// sm_80 and later), steps 2 and 4 run the quantized rows through mma.m16n8k16 (binary16
// operands, float accumulators) instead: the codes, exact in binary16, are one
// operand; the other is the float factor split into a binary16 high part and
// a binary16 remainder (x = hi + lo to about 22 bits), both multiplied in, and
// scaled by a power of two per page so that neither leaves binary16's range.
//  - scores: A = 16 quantized rows x 16 channels of codes, B = [channel][hi and
//    lo of scale q delta per query]; channels are visited in the order the
//    words of a row unpack (see mma_key_channel), B built in that order;
//  - values: A = [hi and lo of p delta per query][16 rows], B = 16 rows x 8
//    channels of codes (two rows' bytes paired per register).
// Kept rows and expander entries stay on the CUDA cores.
#pragma once

#include <cstring>
#include <type_traits>

#include "runtime/cuda/kernels_common.cuh"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace kvcal::runtime::cuda::kernels {

constexpr int kDecodeThreads = 128;
// Registers for 5 resident blocks per SM, each with one page side in flight
// while it computes on the other. (At 6, 80 registers a thread, the staging
// one unit ahead spills 56-112 bytes at most group sizes; at 5, 16 at most.)
constexpr int kDecodeBlocksPerSm = 5;
// With tensor cores: 4 (at 5, 96 registers a thread, the fragments and the
// CUDA-core paths beside them spill 84-168 bytes).
constexpr int kDecodeBlocksPerSmMma = 4;
constexpr int kMaxGroup = 8;
constexpr int kMaxHeadDim = 128;

// binary16 -> float, exact (the hardware conversion on the device).
__device__ inline float h2f(half_bits h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  return half_to_float(h);
#endif
}

// A code (< 2^23) as a float, exact: 2^23 + c built in the mantissa, 2^23
// subtracted (two full-rate operations instead of one quarter-rate I2F).
// (Codes as 1 + c 2^-B in one LOP3, their factors scaled by 2^B and the
// factors' sum subtracted once per page, save the subtraction: on an H100
// within 3% either way, and the outputs' errors 2-3 times larger.)
__device__ inline float code_float(unsigned c) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(c | 0x4B000000u) - 8388608.0f;
#else
  return static_cast<float>(c);
#endif
}

__device__ inline float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ inline float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// ------------------------------------------------------------ tensor cores
// Two B-bit codes (B = 2 or 4) as binary16 (exact): bits 0..B-1 of x to the
// low half, bits 16..16+B-1 to the high half. On the device 1024 + code is
// built in the mantissa and 1024 subtracted (one LOP3 and one HSUB2 for two
// codes).
template <int B>
__device__ inline std::uint32_t codes_half2(std::uint32_t x) {
  constexpr std::uint32_t mask = ((1u << B) - 1u) * 0x00010001u;
#if defined(__CUDA_ARCH__)
  const std::uint32_t h = (x & mask) | 0x64006400u;
  const __half2 r =
      __hsub2(*reinterpret_cast<const __half2*>(&h), __half2(__ushort_as_half(0x6400u), __ushort_as_half(0x6400u)));
  return *reinterpret_cast<const std::uint32_t*>(&r);
#else
  return static_cast<std::uint32_t>(float_to_half(static_cast<float>(x & mask & 0xFFFFu))) |
         static_cast<std::uint32_t>(float_to_half(static_cast<float>((x & mask) >> 16))) << 16;
#endif
}

// Byte k of a to bits 0-7 and byte k of b to bits 16-23 (the other bits are
// don't-cares: codes_half2 masks them).
__device__ inline std::uint32_t pair_bytes(std::uint32_t a, std::uint32_t b, int k) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, static_cast<unsigned>(k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12)));
#else
  return ((a >> (8 * k)) & 0xFFu) | ((b >> (8 * k)) & 0xFFu) << 16;
#endif
}

// x as a binary16 high part and the binary16 rounding of the remainder.
__device__ inline void split_half(float x, half_bits& hi, half_bits& lo) {
#if defined(__CUDA_ARCH__)
  const __half h = __float2half_rn(x);
  hi = __half_as_ushort(h);
  lo = __half_as_ushort(__float2half_rn(x - __half2float(h)));
#else
  hi = float_to_half(x);
  lo = float_to_half(x - half_to_float(hi));
#endif
}

// floor(log2 x) for x > 0 (subnormals as -127), 0 for x <= 0.
__device__ inline int floor_log2(float x) {
  if (!(x > 0.0f)) return 0;
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return static_cast<int>((b >> 23) & 0xFFu) - 127;
}
// 2^e, e clamped to [-120, 120] (a normal float; exact).
__device__ inline float pow2(int e) {
  e = e < -120 ? -120 : e > 120 ? 120 : e;
  const std::uint32_t b = static_cast<std::uint32_t>(e + 127) << 23;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// d += A B for one m16n8k16 tile (binary16 A row-major, B column-major, float
// accumulators), the PTX ISA's fragment layout: lane = 4 groupID + t,
//   a[0] = A[groupID][2t, 2t+1], a[1] = A[groupID+8][2t, 2t+1], a[2] and
//   a[3] the same at columns 2t+8, 2t+9; b[0] = B[2t, 2t+1][groupID], b[1] =
//   B[2t+8, 2t+9][groupID]; d[0], d[1] = D[groupID][2t, 2t+1], d[2], d[3] =
//   D[groupID+8][2t, 2t+1] (low half first in each register).
__device__ inline void mma16816(float d[4], const std::uint32_t a[4], const std::uint32_t b[2]) {
#if defined(KVCAL_CUDA_EMULATION)
  ::kvcal::emu::mma_m16n8k16(d, a, b);
#elif defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();  // not reached: hex_run_decode refuses tensor cores below compute capability 8.0
#endif
#endif
}

// The channel that column k (0-15) of key step ks meets in the score product
// at B bits (C = 32 / B codes a word, code q of word W is channel C W + q).
// Lane (groupID, t) of step group P = ks / (C / 4) reads word 4P + t of its
// rows and unpacks it as the code pairs (q, q + C / 2), q < C / 2, one mask
// each: pairs 2 hs and 2 hs + 1 (hs = ks % (C / 4)) are its columns 2t + e
// and 2t + 8 + e, e choosing the code of the pair.
template <int B>
__host__ __device__ inline int mma_key_channel(int ks, int k) {
  constexpr int C = 32 / B;
  const int P = ks / (C / 4), hs = ks % (C / 4), t = (k % 8) / 2, e = k % 2, upper = k / 8;
  return 4 * C * P + C * t + 2 * hs + upper + (C / 2) * e;
}

// Where channel c meets the score product (the inverse of mma_key_channel):
// key step, lane column t (threadID_in_group) and fragment element b_i.
struct MmaKeySlot {
  int step, t, i;
};
template <int B>
__host__ __device__ inline MmaKeySlot mma_key_slot(int c) {
  constexpr int C = 32 / B;
  const int P = c / (4 * C), t = c % (4 * C) / C, q = c % C, e = q / (C / 2), pair = q % (C / 2);
  return {C / 4 * P + pair / 2, t, e + 2 * (pair % 2)};
}

// Words of a staged row of `bytes` bytes: odd, so that 32 threads reading
// the same word of 32 rows hit 32 banks.
__host__ __device__ inline int odd_words(int bytes) { return bytes <= 0 ? 0 : ((bytes + 3) / 4) | 1; }

// Words of a row of `bytes` bytes that tensor-core fragments read: 4 mod 8,
// so that 8 rows x 4 consecutive words (or 4 row pairs x 8 words) fall in 32
// different banks.
__host__ __device__ inline int mma_words(int bytes) {
  const int w = (bytes + 3) / 4;
  return w + (12 - w % 8) % 8;
}

// Whether the tensor-core decode handles pages of this geometry.
__host__ __device__ inline bool mma_geometry(const HexPageGeometry& g) {
  return (g.bits == 4 || g.bits == 2) && g.head_dim % 64 == 0 && g.head_dim <= kMaxHeadDim;
}

// Where the stage buffer (32-bit words) holds one side of a page.
struct StageLayout {
  int kept_stride = 0, code_stride = 0;             // words per staged row
  int kept = 0, codes = 0, params = 0, sparse = 0;  // offsets in words
  int index = 0, words = 0;
  __host__ __device__ explicit StageLayout(const HexPageGeometry& g, bool mma = false) {
    const int cap = g.kept_capacity, nb = g.block, d = g.head_dim;
    kept_stride = odd_words(2 * d);
    code_stride = g.bits == 0 ? 0 : mma ? mma_words(g.row_bytes()) : odd_words(g.row_bytes());
    codes = kept + cap * kept_stride;
    params = codes + nb * code_stride;
    sparse = params + (g.bits == 0 ? 0 : (d > nb ? d : nb));
    index = sparse + (g.bits == 0 ? 0 : (nb * g.mask_degree + 1) / 2);
    words = index + (g.bits == 0 ? 0 : (cap + 1) / 2);
  }
};

// Queries padded to a multiple of 4 per channel (16-byte loads).
template <int G>
constexpr int kPadded = (G + 3) / 4 * 4;

// Column tiles of the tensor-core score product: the hi and lo parts of
// groups up to 4 share one tile of 8 columns, larger groups take two.
template <int G>
constexpr int kScoreTiles = G <= 4 ? 1 : 2;

// Rows of the tensor-core operands: a page's quantized rows rounded up to a
// multiple of 16; words per row of the value weights (binary16, 4 mod 8).
__host__ __device__ inline int mma_rows(const HexPageGeometry& g) { return (g.block + 15) / 16 * 16; }
__host__ __device__ inline int mma_weight_words(const HexPageGeometry& g) { return mma_words(2 * mma_rows(g)); }

// Dynamic shared memory of the decode kernel: 16-byte aligned arrays first.
template <int G>
struct DecodeShared {
  static constexpr int Gp = kPadded<G>;
  float *qs, *qd, *wq, *pk;  // [d][Gp], [d][Gp], [nb][Gp], [nb][Gp]
  // Tensor cores only: the score product's B fragments in lane order,
  // [d / 16][kScoreTiles][32 lanes][2 words]; the value weights, rows 0-7 the
  // hi parts of queries 0-7 and rows 8-15 their lo parts, [16][weight words].
  std::uint32_t *bfrag, *wh;
  float *kmin, *acc, *p;  // [d], [G][d], [G][nb]
  float *bias, *vbias, *m, *l, *alpha;
  float* mscale;                // tensor cores: the powers of two the key and value factors are scaled by
  std::int32_t *qt, *kt, *tq;   // quantized row -> token, kept row -> token, token -> quantized row or -1
  std::int32_t *col_ptr, *col;  // the mask by column: entries (t << 8 | e) of channel c at [col_ptr[c], col_ptr[c + 1])
  std::int32_t* mask;           // the mask's columns, [nb][d1]
  // A page's key side; its value side (StageLayout each): two stages, or
  // one for both (vstage == kstage) where two do not fit.
  std::uint32_t *kstage, *vstage;
  __host__ __device__ static std::size_t mma_words_b(const HexPageGeometry& g, bool mma) {
    return mma ? static_cast<std::size_t>(g.head_dim / 16) * kScoreTiles<G> * 64 : 0;
  }
  __host__ __device__ static std::size_t mma_words_w(const HexPageGeometry& g, bool mma) {
    return mma ? 16 * static_cast<std::size_t>(mma_weight_words(g)) : 0;
  }
  __host__ __device__ static std::size_t bytes(const HexPageGeometry& g, int stages = 2, bool mma = false) {
    const std::size_t d = g.head_dim, nb = g.block, d1 = g.bits == 0 ? 0 : g.mask_degree;
    return (2 * d * Gp + 2 * nb * Gp + mma_words_b(g, mma) + mma_words_w(g, mma) + d + G * d + G * nb + 5 * G + 2 +
            3 * nb + d + 1 + 2 * nb * d1 + static_cast<std::size_t>(stages) * StageLayout(g, mma).words) *
           4;
  }
  __device__ DecodeShared(unsigned char* s, const HexPageGeometry& g, int stages, bool mma = false) {
    const int d = g.head_dim, nb = g.block;
    qs = reinterpret_cast<float*>(s);
    qd = qs + d * Gp;
    wq = qd + d * Gp;
    pk = wq + nb * Gp;
    bfrag = reinterpret_cast<std::uint32_t*>(pk + nb * Gp);
    wh = bfrag + mma_words_b(g, mma);
    kmin = reinterpret_cast<float*>(wh + mma_words_w(g, mma));
    acc = kmin + d;
    p = acc + G * d;
    bias = p + G * nb;
    vbias = bias + G;
    m = vbias + G;
    l = m + G;
    alpha = l + G;
    mscale = alpha + G;
    qt = reinterpret_cast<std::int32_t*>(mscale + 2);
    kt = qt + nb;
    tq = kt + nb;
    col_ptr = tq + nb;
    col = col_ptr + d + 1;
    mask = col + nb * (g.bits == 0 ? 0 : g.mask_degree);
    kstage = reinterpret_cast<std::uint32_t*>(mask + nb * (g.bits == 0 ? 0 : g.mask_degree));
    vstage = stages == 2 ? kstage + StageLayout(g, mma).words : kstage;
  }
};

// One 32-bit word global -> shared without a register round trip
// (cp.async): copies are issued, committed as a group (copy_commit), and
// waited for (copy_wait_prior<n>: all but the n most recent groups), then a
// barrier makes them visible to the block. Devices before sm_80 copy at once.
__device__ inline void copy_word(std::uint32_t* dst, const std::uint32_t* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
#elif defined(KVCAL_CUDA_EMULATION)
  ::kvcal::emu::async_copy(dst, src);
#else
  *dst = *src;
#endif
}
__device__ inline void copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#elif defined(KVCAL_CUDA_EMULATION)
  ::kvcal::emu::async_commit();
#endif
}
template <int N>
__device__ inline void copy_wait_prior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#elif defined(KVCAL_CUDA_EMULATION)
  ::kvcal::emu::async_wait(N);
#endif
}

// A thread's share of copying rows of w = row_bytes / 4 words with nt
// threads: its first row and word, and the rows and words it steps by. The
// quotients come from a float reciprocal, exact for these small integers
// (tid, nt < 2^16 and w >= 1: each quotient's fraction is at least 0.5 / w
// from the next integer, far above the product's rounding error); a runtime
// integer division per quotient cost 4% of the decode's instructions.
struct RowShare {
  int w, r0, k0, dr, dk;
  __device__ RowShare(int row_bytes, int tid, int nt) : w(row_bytes / 4) {
    const float inv = 1.0f / static_cast<float>(w > 0 ? w : 1);
    r0 = static_cast<int>((static_cast<float>(tid) + 0.5f) * inv);
    dr = static_cast<int>((static_cast<float>(nt) + 0.5f) * inv);
    k0 = tid - r0 * w;
    dk = nt - dr * w;
  }
};

// Copies one contiguous run of `bytes` bytes to dst: asynchronous 32-bit
// copies when it allows, bytes otherwise.
__device__ inline void stage_run(std::uint32_t* dst, const std::uint8_t* src, int bytes, int tid, int nt) {
  if (bytes % 4 == 0 && (reinterpret_cast<std::uintptr_t>(src) & 3u) == 0) {
    const auto* s = reinterpret_cast<const std::uint32_t*>(src);
    for (int x = tid; x < bytes / 4; x += nt) copy_word(dst + x, s + x);
  } else {
    auto* db = reinterpret_cast<std::uint8_t*>(dst);
    for (int x = tid; x < bytes; x += nt) db[x] = src[x];
  }
}

// Copies `rows` rows of `row_bytes` bytes (contiguous at src) to dst, row r at
// word r * stride: asynchronous 32-bit copies when the rows allow, bytes
// otherwise.
__device__ inline void stage_rows(std::uint32_t* dst, int stride, const std::uint8_t* src, int rows, int row_bytes,
                                  int tid, int nt) {
  if (rows <= 0 || row_bytes <= 0) return;
  if (row_bytes % 4 == 0 && (reinterpret_cast<std::uintptr_t>(src) & 3u) == 0) {
    const RowShare sh(row_bytes, tid, nt);
    const auto* s = reinterpret_cast<const std::uint32_t*>(src);
    if (sh.dk == 0) {  // the same word of every dr-th row: pointers step, no index arithmetic
      const std::uint32_t* sp = s + sh.r0 * sh.w + sh.k0;
      std::uint32_t* dp = dst + sh.r0 * stride + sh.k0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      auto sa = static_cast<unsigned>(__cvta_generic_to_shared(dp));
      const unsigned step = 4u * static_cast<unsigned>(sh.dr * stride);
      for (int r = sh.r0; r < rows; r += sh.dr, sa += step, sp += nt)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sa), "l"(sp) : "memory");
#else
      for (int r = sh.r0; r < rows; r += sh.dr, dp += sh.dr * stride, sp += nt) copy_word(dp, sp);
#endif
      return;
    }
    int r = sh.r0, k = sh.k0;
    for (int x = tid; x < rows * sh.w; x += nt) {
      copy_word(dst + r * stride + k, s + x);
      r += sh.dr;
      k += sh.dk;
      if (k >= sh.w) {
        k -= sh.w;
        ++r;
      }
    }
  } else {
    auto* db = reinterpret_cast<std::uint8_t*>(dst);
    for (int x = tid; x < rows * row_bytes; x += nt) {
      const int r = x / row_bytes;
      db[r * stride * 4 + (x - r * row_bytes)] = src[x];
    }
  }
}

// s[j] += sum_c v[c][j] * x_c over the channels of one row.
template <int G>
__device__ inline void axpy_group(const float* v, float x, float* s) {
  constexpr int Gp = kPadded<G>;
  const float4* q4 = reinterpret_cast<const float4*>(v);
#pragma unroll
  for (int k = 0; k < Gp / 4; ++k) {
    const float4 q = q4[k];
    if (4 * k + 0 < G) s[4 * k + 0] = fmaf(q.x, x, s[4 * k + 0]);
    if (4 * k + 1 < G) s[4 * k + 1] = fmaf(q.y, x, s[4 * k + 1]);
    if (4 * k + 2 < G) s[4 * k + 2] = fmaf(q.z, x, s[4 * k + 2]);
    if (4 * k + 3 < G) s[4 * k + 3] = fmaf(q.w, x, s[4 * k + 3]);
  }
}

// s0[j] += v[j] * x0 and s1[j] += v[j] * x1: two channels of one row (one
// load of the row's weights).
template <int G>
__device__ inline void axpy_group2(const float* v, float x0, float x1, float* s0, float* s1) {
  constexpr int Gp = kPadded<G>;
  const float4* q4 = reinterpret_cast<const float4*>(v);
#pragma unroll
  for (int k = 0; k < Gp / 4; ++k) {
    const float4 q = q4[k];
    const float qv[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (4 * k + e < G) {
        s0[4 * k + e] = fmaf(qv[e], x0, s0[4 * k + e]);
        s1[4 * k + e] = fmaf(qv[e], x1, s1[4 * k + e]);
      }
  }
}

// s[j] += sum over channels [c0, c0 + 32) of v[c][j] * code_c, the 32 codes
// in B consecutive words (B bits each, little-endian).
template <int G, int B>
__device__ inline void dot32(const std::uint32_t* words, const float* v, float* s) {
  constexpr int Gp = kPadded<G>;
  std::uint32_t w[B];
#pragma unroll
  for (int k = 0; k < B; ++k) w[k] = words[k];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    constexpr unsigned mask = (1u << B) - 1u;
    const int bit = i * B, wi = bit / 32, sh = bit % 32;
    unsigned c = w[wi] >> sh;
    if (sh + B > 32) c |= w[wi + 1] << (32 - sh);
    axpy_group<G>(v + i * Gp, code_float(c & mask), s);
  }
}

// The score of a quantized row against the group: codes (staged words) times
// q * delta, in chunks of 32 channels, then one code at a time.
template <int G>
__device__ inline void score_codes(const std::uint32_t* row, int bits, int d, const float* qd, float* s) {
  constexpr int Gp = kPadded<G>;
  int c = 0;
  for (; c + 32 <= d; c += 32) {  // a chunk of 32 codes starts on a word
    const std::uint32_t* w = row + c * bits / 32;
    if (bits == 4)
      dot32<G, 4>(w, qd + c * Gp, s);
    else if (bits == 3)
      dot32<G, 3>(w, qd + c * Gp, s);
    else
      dot32<G, 2>(w, qd + c * Gp, s);
  }
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(row);
  for (; c < d; ++c) axpy_group<G>(qd + c * Gp, code_float(packed_code(bytes, c, bits)), s);
}

// The score of an fp16 row (row[c] for c < d) against the group.
template <int G>
__device__ inline void score_halves(const half_bits* row, int d, const float* qs, float* s) {
  constexpr int Gp = kPadded<G>;
  if (d % 2 == 0 && (reinterpret_cast<std::uintptr_t>(row) & 3u) == 0) {
    const auto* w = reinterpret_cast<const std::uint32_t*>(row);
    for (int c = 0; c < d; c += 2) {
      const std::uint32_t x = w[c / 2];
      axpy_group<G>(qs + c * Gp, h2f(static_cast<half_bits>(x & 0xffffu)), s);
      axpy_group<G>(qs + (c + 1) * Gp, h2f(static_cast<half_bits>(x >> 16)), s);
    }
  } else {
    for (int c = 0; c < d; ++c) axpy_group<G>(qs + c * Gp, h2f(row[c]), s);
  }
}

// Whether pages of this geometry carry expander entries (and the decode the
// mask by column).
__host__ __device__ inline bool mask_columns(const HexPageGeometry& g) { return g.bits != 0 && g.mask_degree > 0; }

// The mask by column, once per decode launch: channel c's entries (t << 8 |
// e for mask[t][e] == c) in row order at [mask_col_ptr[c], mask_col_ptr[c +
// 1]), for the value pass to add the entries' corrections without atomics.
// A warp per channel (kColumnsPerWarp in turn): one pass over the mask counts
// the entries below c (c's start) and in c, a second places c's entries,
// ballots ranking them in order. (One block doing every channel took 23 us
// on an H100, serially before the decode.)
constexpr int kColumnThreads = 128;
constexpr int kColumnsPerWarp = 4;
__host__ __device__ inline int mask_column_blocks(int head_dim) {
  constexpr int per_block = kColumnThreads / 32 * kColumnsPerWarp;
  return (head_dim + per_block - 1) / per_block;
}
__device__ inline int warp_sum_int(int x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__global__ void __launch_bounds__(kColumnThreads) hex_mask_columns_kernel(HexDeviceLayer L, HexDecodeArgs A) {
  const int d = L.geometry.head_dim, md = L.geometry.mask_degree, n = L.geometry.block * md;
  const int lane = threadIdx.x % 32, first = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * kColumnsPerWarp;
  for (int c = first; c < first + kColumnsPerWarp && c < d; ++c) {
    int below = 0, here = 0;
    for (int x = lane; x < n; x += 32) {
      const int m = L.mask[x];
      below += m >= 0 && m < c ? 1 : 0;
      here += m == c ? 1 : 0;
    }
    below = warp_sum_int(below);
    here = warp_sum_int(here);
    if (lane == 0) {
      A.mask_col_ptr[c] = below;
      if (c == d - 1) A.mask_col_ptr[d] = below + here;
    }
    int at = below;
    for (int x0 = 0; x0 < n && here > 0; x0 += 32) {
      const int x = x0 + lane;
      const bool mine = x < n && L.mask[x] == c;
      const unsigned ballot = __ballot_sync(0xffffffffu, mine);
      if (mine) A.mask_col[at + __popc(ballot & ((1u << lane) - 1u))] = (x / md) << 8 | (x % md);
      at += __popc(ballot);
    }
  }
}

// kMmaBits: 0, the CUDA cores; 4 or 2, tensor cores for pages of that width.
template <int G, int kMmaBits = 0>
__global__ void __launch_bounds__(kDecodeThreads, kMmaBits ? kDecodeBlocksPerSmMma : kDecodeBlocksPerSm)
    hex_decode_kernel(HexDeviceLayer L, HexDecodeArgs A, const float* q, float scale, bool observe, int stages) {
  constexpr int Gp = kPadded<G>;
  constexpr int NT = kScoreTiles<G>;
  constexpr bool kMma = kMmaBits != 0;
  constexpr int MB = kMma ? kMmaBits : 4;  // (bits of the tensor-core paths)
  constexpr int CPW = 32 / MB;             // codes per 32-bit word
  const HexPageGeometry g = L.geometry;
  const int H = L.kv_heads, d = g.head_dim, nb = g.block, QH = A.q_heads;
  const int tid = threadIdx.x, nt = blockDim.x, warp = tid / 32, lane = tid % 32, warps = nt / 32;
  const HexDecodeItem item = A.items[blockIdx.x];
  const int i = item.request, h = item.head;
  const DecodeShared<G> S(dynamic_shared(), g, stages, kMma);
  const StageLayout lay(g, kMma);
  const int g8 = lane >> 2, tig = lane & 3;  // a lane's place in the tensor-core fragments

  const float* qh = q + (static_cast<std::int64_t>(i) * QH + h * G) * d;
  const int R = item.with_residual ? A.residual_rows[i] : 0;
  const int units = item.blocks + (R > 0 ? 1 : 0);
  // Page u of the item (u < item.blocks).
  const auto page = [&](int u) {
    const std::int32_t id = A.page_indices[A.page_indptr[i] + (item.first_block + u) * H + h];
    return hex_page_view(g, L.pages + static_cast<std::int64_t>(id) * g.page_bytes(), L.mask);
  };
  // With two stages, the sides of a page are staged one unit ahead: the key
  // side of unit u + 1 is copied while unit u's values are computed, its
  // value side while unit u + 1 is scored. Each call commits one group of
  // copies (empty past the pages), so that the groups go K0 V0 K1 V1 ... and
  // "all but the most recent group" is always the side about to be used.
  // With one stage, each side is copied when the previous one is used up,
  // and waited for in full.
  const bool two = stages == 2;
  const auto wait_side = [&] {
    if (two)
      copy_wait_prior<1>();
    else
      copy_wait_prior<0>();
  };
  // One side of page u (u < item.blocks) into its stage: kept rows, and with
  // codes the kept indices (keys), codes, parameters and expander entries.
  const auto stage_side = [&](int u, bool key) {
    if (u < item.blocks) {
      const HexBlockView b = page(u);
      const int K = b.bits == 0 ? b.tokens : b.kept_rows, Q = b.tokens - K;
      std::uint32_t* st = key ? S.kstage : S.vstage;
      const auto bytes = [](const void* p) { return static_cast<const std::uint8_t*>(p); };
      stage_rows(st + lay.kept, lay.kept_stride, bytes(key ? b.k_kept : b.v_kept), K, 2 * d, tid, nt);
      if (b.bits != 0) {
        if (key) stage_run(st + lay.index, bytes(b.kept_index), 2 * K, tid, nt);
        if (Q > 0) {
          stage_rows(st + lay.codes, lay.code_stride, key ? b.k_codes : b.v_codes, Q, b.row_bytes, tid, nt);
          stage_run(st + lay.params, bytes(key ? b.k_params : b.v_params), 4 * (key ? d : Q), tid, nt);
          stage_run(st + lay.sparse, bytes(key ? b.k_sparse : b.v_sparse), 2 * Q * b.mask_degree, tid, nt);
        }
      }
    }
    copy_commit();
  };
  const auto stage_keys = [&](int u) { stage_side(u, true); };
  const auto stage_values = [&](int u) { stage_side(u, false); };
  // The mask and the mask by column (the same for every page; see
  // hex_mask_columns_kernel): the first group of copies, waited for with the
  // first page's key side.
  const int md = mask_columns(g) && L.mask ? g.mask_degree : 0;
  for (int x = tid; x < nb * md; x += nt)
    copy_word(reinterpret_cast<std::uint32_t*>(S.mask + x), reinterpret_cast<const std::uint32_t*>(L.mask + x));
  for (int x = tid; x <= d && md > 0; x += nt)
    copy_word(reinterpret_cast<std::uint32_t*>(S.col_ptr + x),
              reinterpret_cast<const std::uint32_t*>(A.mask_col_ptr + x));
  for (int x = tid; x < nb * md; x += nt)
    copy_word(reinterpret_cast<std::uint32_t*>(S.col + x), reinterpret_cast<const std::uint32_t*>(A.mask_col + x));
  copy_commit();
  stage_keys(0);
  if (two) stage_values(0);
  for (int x = tid; x < d * Gp; x += nt) {
    const int c = x / Gp, j = x % Gp;
    S.qs[x] = j < G ? scale * qh[j * d + c] : 0.0f;
  }
  for (int x = tid; x < G * d; x += nt) S.acc[x] = 0.0f;
  if (kMma) {  // the value weights and score columns of queries G..7 stay zero (pages write those below G)
    for (int x = tid; x < 16 * mma_weight_words(g); x += nt) S.wh[x] = 0u;
    for (int x = tid; x < (d / 16) * NT * 64; x += nt) S.bfrag[x] = 0u;
  }
  if (tid < G) {
    S.m[tid] = -INFINITY;
    S.l[tid] = 0.0f;
  }
  float qmax = 0.0f;  // tensor cores, warp 0: the largest |scale q| of the item, once known
  bool have_qmax = false;
  for (int u = 0; u < units; ++u) {
    const bool is_res = u == item.blocks;
    HexBlockView b;
    int n;
    const half_bits* kk;  // kept key rows: staged (pages) or in place (residual)
    int kk_stride;        // in halves
    if (!is_res) {
      b = page(u);
      n = nb;
      kk = reinterpret_cast<const half_bits*>(S.kstage + lay.kept);
      kk_stride = 2 * lay.kept_stride;
    } else {  // the residual rows: an all-kept fp16 block
      const std::uint8_t* base = L.residual + static_cast<std::int64_t>(A.residual_page[i]) * g.residual_bytes(H);
      b.tokens = b.kept_rows = R;
      b.head_dim = d;
      b.bits = 0;
      b.k_kept = reinterpret_cast<const half_bits*>(base) + static_cast<std::int64_t>(h) * nb * d;
      b.v_kept =
          reinterpret_cast<const half_bits*>(base + g.residual_rows_bytes(H)) + static_cast<std::int64_t>(h) * nb * d;
      n = R;
      kk = b.k_kept;
      kk_stride = d;
    }
    const int K = b.bits == 0 ? n : b.kept_rows, Q = n - K, bits = b.bits;
    const int d1 = bits != 0 ? b.mask_degree : 0;
    const bool coded = bits != 0 && Q > 0;
    const auto* index = reinterpret_cast<const std::uint16_t*>(S.kstage + lay.index);
    // 1. The key side, staged (only the value side may still be in flight).
    wait_side();
    __syncthreads();
    // Which token each quantized and each kept row is.
    for (int t = tid; t < n; t += nt) {
      if (bits == 0) {
        S.kt[t] = t;
        S.tq[t] = -1;
        continue;
      }
      int r = 0;
      while (r < K && index[r] < t) ++r;
      if (r < K && index[r] == t) {
        S.kt[r] = t;
        S.tq[t] = -1;
      } else {
        S.qt[t - r] = t;
        S.tq[t] = t - r;
      }
    }
    const auto* kpar = reinterpret_cast<const QuantParams*>(S.kstage + lay.params);
    if (kMma && coded) {
      // The power of two that keeps scale q delta within binary16 (below
      // 2^14): from the largest |scale q| of the item and delta of the page.
      if (warp == 0) {
        if (!have_qmax) {  // at the item's first coded page (warp 0 keeps it in registers)
          for (int x = lane; x < d * Gp; x += 32) qmax = fmaxf(qmax, fabsf(S.qs[x]));
          qmax = warp_max(qmax);
          have_qmax = true;
        }
        float md2 = 0.0f;
        for (int c = lane; c < d; c += 32) md2 = fmaxf(md2, fabsf(h2f(kpar[c].delta)));
        md2 = warp_max(md2);
        if (lane == 0) S.mscale[0] = pow2(12 - floor_log2(qmax) - floor_log2(md2));
      }
      for (int c = tid; c < d; c += nt) S.kmin[c] = h2f(kpar[c].min);
      __syncthreads();
      // B of the score product, scattered from each (channel, query): its hi
      // part goes to column j, its lo part to column 4 + j (one tile) or to
      // column j of tile 1 (two tiles); see mma_key_channel for the order.
      const float kscale = S.mscale[0];
      auto* bh = reinterpret_cast<half_bits*>(S.bfrag);
      for (int x = tid; x < d * G; x += nt) {
        const int c = x / G, j = x % G;
        half_bits hi, lo;
        split_half(S.qs[c * Gp + j] * h2f(kpar[c].delta) * kscale, hi, lo);
        const MmaKeySlot k = mma_key_slot<MB>(c);  // element b_i of lane 4 n + t
        const auto at = [&](int T, int n) { return 4 * ((k.step * NT + T) * 32 + 4 * n + k.t) + k.i; };
        bh[at(0, j)] = hi;
        bh[NT == 1 ? at(0, 4 + j) : at(1, j)] = lo;
      }
    }
    if (!kMma && coded)
      for (int x = tid; x < d * Gp; x += nt) {
        const int c = x / Gp, j = x % Gp;
        const QuantParams pc = kpar[c];
        if (j == 0) S.kmin[c] = h2f(pc.min);
        S.qd[x] = S.qs[x] * h2f(pc.delta);
      }
    if (coded)  // the bias q . min, from the staged parameters (no barrier for kmin)
      for (int j = warp; j < G; j += warps) {
        float s = 0.0f;
        for (int c = lane; c < d; c += 32) s += S.qs[c * Gp + j] * h2f(kpar[c].min);
        s = warp_sum(s);
        if (lane == 0) S.bias[j] = s;
      }
    __syncthreads();
    // 2. Scores: quantized rows, then kept rows.
    const auto* ks = reinterpret_cast<const half_bits*>(S.kstage + lay.sparse);
    if constexpr (kMma) {
      if (coded) {  // warps over tiles of 16 quantized rows
        const float unscale = 1.0f / S.mscale[0];
        for (int mt = warp; mt < (Q + 15) / 16; mt += warps) {
          float acc[NT][4];
#pragma unroll
          for (int T = 0; T < NT; ++T) acc[T][0] = acc[T][1] = acc[T][2] = acc[T][3] = 0.0f;
          const int r0 = mt * 16 + g8, r1 = r0 + 8;  // rows past Q read row Q - 1; their scores are dropped
          const std::uint32_t* row0 = S.kstage + lay.codes + (r0 < Q ? r0 : Q - 1) * lay.code_stride;
          const std::uint32_t* row1 = S.kstage + lay.codes + (r1 < Q ? r1 : Q - 1) * lay.code_stride;
          for (int P = 0; P < d / (4 * CPW); ++P) {
            const std::uint32_t w0 = row0[4 * P + tig], w1 = row1[4 * P + tig];
#pragma unroll
            for (int hs = 0; hs < CPW / 4; ++hs) {  // pairs 2 hs and 2 hs + 1: shifts 2 hs MB and (2 hs + 1) MB
              const std::uint32_t a[4] = {codes_half2<MB>(w0 >> (2 * hs * MB)), codes_half2<MB>(w1 >> (2 * hs * MB)),
                                          codes_half2<MB>(w0 >> ((2 * hs + 1) * MB)),
                                          codes_half2<MB>(w1 >> ((2 * hs + 1) * MB))};
#pragma unroll
              for (int T = 0; T < NT; ++T) {
                const std::uint32_t* bp = S.bfrag + 2 * (((CPW / 4 * P + hs) * NT + T) * 32 + lane);
                const std::uint32_t b[2] = {bp[0], bp[1]};
                mma16816(acc[T], a, b);
              }
            }
          }
          // hi + lo of queries 2 q2 and 2 q2 + 1, rows r0 and r1. With one
          // tile, lanes tig and tig ^ 2 hold the same sums (q2 = tig % 2)
          // and take one row each.
          float sc[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            sc[e] = NT == 1 ? acc[0][e] + __shfl_xor_sync(0xffffffffu, acc[0][e], 2) : acc[0][e] + acc[NT - 1][e];
          const int q2 = NT == 1 ? (tig & 1) : tig;
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int row = rr == 0 ? r0 : r1;
            if ((NT == 1 && rr != (tig >> 1)) || row >= Q || 2 * q2 >= G) continue;
            const int t = S.qt[row];
            float v0 = fmaf(sc[2 * rr], unscale, S.bias[2 * q2]);
            float v1 = 2 * q2 + 1 < G ? fmaf(sc[2 * rr + 1], unscale, S.bias[2 * q2 + 1]) : 0.0f;
            for (int x = 0; x < d1; ++x) {  // expander entries: x replaces min_c
              const int c = S.mask[t * d1 + x];
              const float diff = h2f(ks[row * d1 + x]) - S.kmin[c];
              v0 = fmaf(S.qs[c * Gp + 2 * q2], diff, v0);
              v1 = fmaf(S.qs[c * Gp + 2 * q2 + 1], diff, v1);  // (Gp is even: in bounds)
            }
            S.p[2 * q2 * nb + t] = v0;
            if (2 * q2 + 1 < G) S.p[(2 * q2 + 1) * nb + t] = v1;
          }
        }
      }
    }
    if (kMma && coded)
      // Kept rows a warp each, channels over the lanes: one thread per row
      // (d G multiply-adds in a chain) would be the page's longest path
      // beside the tiles.
      for (int r = warp; r < K; r += warps) {
        const half_bits* row = kk + static_cast<std::int64_t>(r) * kk_stride;
        float s[G];
#pragma unroll
        for (int j = 0; j < G; ++j) s[j] = 0.0f;
        for (int c = lane; c < d; c += 32) axpy_group<G>(S.qs + c * Gp, h2f(row[c]), s);
#pragma unroll
        for (int j = 0; j < G; ++j) s[j] = warp_sum(s[j]);
        if (lane == 0)
#pragma unroll
          for (int j = 0; j < G; ++j) S.p[j * nb + S.kt[r]] = s[j];
      }
    for (int x = kMma && coded ? n : tid; x < n; x += nt) {  // (tensor cores: pages without codes)
      float s[G];
      int t;
      if (x < Q) {
        t = S.qt[x];
#pragma unroll
        for (int j = 0; j < G; ++j) s[j] = S.bias[j];
        score_codes<G>(S.kstage + lay.codes + x * lay.code_stride, bits, d, S.qd, s);
        for (int e = 0; e < d1; ++e) {  // expander entries: x replaces min_c
          const int c = S.mask[t * d1 + e];
          axpy_group<G>(S.qs + c * Gp, h2f(ks[x * d1 + e]) - S.kmin[c], s);
        }
      } else {
        const int r = x - Q;
        t = S.kt[r];
#pragma unroll
        for (int j = 0; j < G; ++j) s[j] = 0.0f;
        score_halves<G>(kk + static_cast<std::int64_t>(r) * kk_stride, d, S.qs, s);
      }
#pragma unroll
      for (int j = 0; j < G; ++j) S.p[j * nb + t] = s[j];
      if (observe && is_res)
#pragma unroll
        for (int j = 0; j < G; ++j) A.res_scores[(static_cast<std::int64_t>(i) * QH + h * G + j) * nb + t] = s[j];
    }
    __syncthreads();
    // 3. The next unit's key side into the stage just read (one stage: this
    // unit's value side); the running maximum; this unit's value side,
    // staged (only the next key side may still be in flight).
    if (two)
      stage_keys(u + 1);
    else
      stage_values(u);
    for (int j = warp; j < G; j += warps) {
      float mx = -INFINITY;
      for (int t = lane; t < n; t += 32) mx = fmaxf(mx, S.p[j * nb + t]);
      mx = warp_max(mx);
      if (lane == 0) {
        const float nm = fmaxf(S.m[j], mx);
        S.alpha[j] = expf(S.m[j] - nm);
        S.m[j] = nm;
      }
    }
    wait_side();
    __syncthreads();
    const auto* vpar = reinterpret_cast<const QuantParams*>(S.vstage + lay.params);
#pragma unroll
    for (int j = 0; j < G; ++j)
      for (int t = tid; t < n; t += nt) S.p[j * nb + t] = expf(S.p[j * nb + t] - S.m[j]);
    for (int c = tid; c < d; c += nt)
#pragma unroll
      for (int j = 0; j < G; ++j) S.acc[j * d + c] *= S.alpha[j];
    if (kMma && coded && warp == 0) {  // p <= 1: p delta below 2^14 once scaled
      float mv = 0.0f;
      for (int x = lane; x < Q; x += 32) mv = fmaxf(mv, fabsf(h2f(vpar[x].delta)));
      mv = warp_max(mv);
      if (lane == 0) S.mscale[1] = pow2(13 - floor_log2(mv));
    }
    __syncthreads();
    // Weights per row: w = p delta for quantized rows (their sum of p min
    // added to every channel once), p for kept rows.
    for (int j = warp; j < G; j += warps) {
      float s = 0.0f, sm = 0.0f;
      for (int t = lane; t < n; t += 32) s += S.p[j * nb + t];
      for (int x = lane; x < Q && coded; x += 32) sm += S.p[j * nb + S.qt[x]] * h2f(vpar[x].min);
      s = warp_sum(s);
      sm = warp_sum(sm);
      if (lane == 0) {
        S.l[j] = S.l[j] * S.alpha[j] + s;
        S.vbias[j] = sm;
      }
    }
    if (kMma && coded) {  // A of the value product: hi parts in rows 0-7, lo parts in rows 8-15
      const int rows = mma_rows(g), ww = 2 * mma_weight_words(g);
      auto* wh = reinterpret_cast<half_bits*>(S.wh);
      const float vs = S.mscale[1];
      for (int x = tid; x < G * rows; x += nt) {
        const int j = x / rows, row = x % rows;
        const float w = row < Q ? S.p[j * nb + S.qt[row]] * h2f(vpar[row].delta) * vs : 0.0f;
        split_half(w, wh[j * ww + row], wh[(8 + j) * ww + row]);
      }
    }
    for (int x = kMma ? Q * Gp + tid : tid; x < n * Gp; x += nt) {
      const int row = x / Gp, j = x % Gp;
      if (row < Q) {
        S.wq[x] = j < G ? S.p[j * nb + S.qt[row]] * h2f(vpar[row].delta) : 0.0f;
      } else {
        const int r = row - Q;
        S.pk[r * Gp + j] = j < G ? S.p[j * nb + S.kt[r]] : 0.0f;
      }
    }
    __syncthreads();
    // 4. Values: one thread per channel, nt / d row lanes.
    if constexpr (kMma) {
      if (coded) {
        // Warps over (8 CPW channels, 16 rows): lane groupID reads word 8 cg
        // + groupID of the rows (code q of word W is channel CPW W + q), CPW
        // column tiles of 8 channels, 4 at a time. Words past a row (2 bits,
        // head_dim 64) read its last word; those channels are dropped.
        constexpr int CPB = 8 / MB;  // codes per byte
        const int RW = d / CPW, CG = (RW + 7) / 8, cg = warp % CG, ww = mma_weight_words(g);
        const float unscale = 1.0f / S.mscale[1];
        const int word = 8 * cg + g8 < RW ? 8 * cg + g8 : RW - 1;
        const std::uint32_t* codes = S.vstage + lay.codes + word;
#pragma unroll 1
        for (int pass = 0; pass < CPW / 4; ++pass) {  // tiles 4 pass .. 4 pass + 3
          float acc[4][4];
#pragma unroll
          for (int T = 0; T < 4; ++T) acc[T][0] = acc[T][1] = acc[T][2] = acc[T][3] = 0.0f;
          for (int kt = warp / CG; kt < (Q + 15) / 16; kt += warps / CG) {
            const int t0 = 16 * kt;
            const std::uint32_t a[4] = {S.wh[g8 * ww + t0 / 2 + tig], S.wh[(8 + g8) * ww + t0 / 2 + tig],
                                        S.wh[g8 * ww + t0 / 2 + 4 + tig], S.wh[(8 + g8) * ww + t0 / 2 + 4 + tig]};
            // Rows t0 + 2 tig (+1, +8, +9); past Q, row Q - 1 (weight 0).
            const auto at = [&](int r) { return codes[(r < Q ? r : Q - 1) * lay.code_stride]; };
            const int r = t0 + 2 * tig;
            const std::uint32_t wa = at(r), wb = at(r + 1), wc = at(r + 8), wd = at(r + 9);
#pragma unroll
            for (int tt = 0; tt < 4; ++tt) {  // tile T = 4 pass + tt: code T % CPB of byte T / CPB
              const int T = 4 * pass + tt, k = T / CPB, sh = (T % CPB) * MB;
              const std::uint32_t x01 = pair_bytes(wa, wb, k), x89 = pair_bytes(wc, wd, k);
              const std::uint32_t bt[2] = {codes_half2<MB>(x01 >> sh), codes_half2<MB>(x89 >> sh)};
              mma16816(acc[tt], a, bt);
            }
          }
          // Tile T, column 2 tig (+1) is channel CPW (8 cg + 2 tig) + T (+CPW);
          // rows groupID and groupID + 8 the hi and lo parts of query groupID.
          if (g8 < G)
#pragma unroll
            for (int tt = 0; tt < 4; ++tt) {
              const int c0 = CPW * (8 * cg + 2 * tig) + 4 * pass + tt;
              if (c0 < d) atomicAdd(&S.acc[g8 * d + c0], (acc[tt][0] + acc[tt][2]) * unscale);
              if (c0 + CPW < d) atomicAdd(&S.acc[g8 * d + c0 + CPW], (acc[tt][1] + acc[tt][3]) * unscale);
            }
        }
      }
    }
    // One thread per pair of channels (c0 even and c1 = c0 + 1: at 2 and 4
    // bits one byte holds both codes, and one load of the row's weights
    // serves both), nt / ceil(d / 2) row lanes.
    // (H100, 32K tokens, with the staging without divisions: 1-8% faster
    // at groups 1 to 4, 4% slower at 8. At 8, one channel a thread spilled
    // less but was no faster.)
    const int pairs = (d + 1) / 2, lanes = nt / pairs, lt = tid / pairs, c0 = 2 * (tid % pairs);
    const bool has1 = c0 + 1 < d;       // odd head_dim: the last pair has one channel
    const int c1 = has1 ? c0 + 1 : c0;  // (its twin recomputes c0, discarded)
    if (lt < lanes) {
      float a0[G], a1[G];
#pragma unroll
      for (int j = 0; j < G; ++j) a0[j] = a1[j] = lt == 0 && coded ? S.vbias[j] : 0.0f;
      if (!kMma && coded) {
        const unsigned mask = (1u << bits) - 1u;
        // Pointers stepped row by row (no address arithmetic per row).
        const std::uint8_t* p8 = reinterpret_cast<const std::uint8_t*>(S.vstage + lay.codes) + lt * 4 * lay.code_stride;
        const float* w = S.wq + lt * Gp;
        const int step8 = lanes * 4 * lay.code_stride, stepw = lanes * Gp;
        const int rows = lt < Q ? (Q - lt + lanes - 1) / lanes : 0;
        if (8 % bits == 0) {  // 2 and 4 bits: both codes in byte c0 bits / 8, one load per row, unrolled
          p8 += (c0 * bits) >> 3;
          const int sh0 = (c0 * bits) & 7, sh1 = has1 ? sh0 + bits : sh0;
          const auto row = [&](int k) {
            const unsigned x = p8[k * step8];
            axpy_group2<G>(w + k * stepw, code_float((x >> sh0) & mask), code_float((x >> sh1) & mask), a0, a1);
          };
          int x = 0;
          for (; x + 4 <= rows; x += 4, p8 += 4 * step8, w += 4 * stepw) {  // no exit test between the four
            row(0);
            row(1);
            row(2);
            row(3);
          }
          for (; x < rows; ++x, p8 += step8, w += stepw) row(0);
        } else {  // 3 bits: a code may straddle two bytes
          const int b0 = (c0 * bits) >> 3, sh0 = (c0 * bits) & 7, b1 = (c1 * bits) >> 3, sh1 = (c1 * bits) & 7;
          const bool two0 = sh0 + bits > 8, two1 = sh1 + bits > 8;
          for (int x = 0; x < rows; ++x, p8 += step8, w += stepw) {
            unsigned x0 = p8[b0], x1 = p8[b1];
            if (two0) x0 |= static_cast<unsigned>(p8[b0 + 1]) << 8;
            if (two1) x1 |= static_cast<unsigned>(p8[b1 + 1]) << 8;
            axpy_group2<G>(w, code_float((x0 >> sh0) & mask), code_float((x1 >> sh1) & mask), a0, a1);
          }
        }
      }
      if (is_res) {  // kept rows: in place (global memory), or staged (shared memory: no generic loads)
        for (int r = lt; r < K; r += lanes) {
          const half_bits* v = b.v_kept + static_cast<std::int64_t>(r) * d;
          axpy_group2<G>(S.pk + r * Gp, h2f(v[c0]), h2f(v[c1]), a0, a1);
        }
      } else {  // staged rows start on a word and c0 is even: one 32-bit load for both halves
        const std::uint32_t* v = S.vstage + lay.kept + lt * lay.kept_stride + c0 / 2;
        const float* pk = S.pk + lt * Gp;
        const int stepv = lanes * lay.kept_stride, stepk = lanes * Gp;
        for (int r = lt; r < K; r += lanes, v += stepv, pk += stepk) {
          const std::uint32_t x = *v;
          axpy_group2<G>(pk, h2f(static_cast<half_bits>(x & 0xffffu)),
                         h2f(static_cast<half_bits>(has1 ? x >> 16 : x & 0xffffu)), a0, a1);
        }
      }
      if (d1 > 0 && coded) {  // expander entries of each channel: the true value replaces min
        const auto* vs = reinterpret_cast<const half_bits*>(S.vstage + lay.sparse);
        const auto entries = [&](int c, float* a) {
          for (int x = S.col_ptr[c] + lt; x < S.col_ptr[c + 1]; x += lanes) {
            const int t = S.col[x] >> 8, e = S.col[x] & 0xff, row = t < n ? S.tq[t] : -1;
            if (row < 0) continue;
            const float corr = h2f(vs[row * d1 + e]) - h2f(vpar[row].min);
#pragma unroll
            for (int j = 0; j < G; ++j) a[j] = fmaf(S.p[j * nb + t], corr, a[j]);
          }
        };
        entries(c0, a0);
        if (has1) entries(c1, a1);
      }
      // (several row lanes per channel: atomics; with tensor cores the tiles' sums go in beside these)
#pragma unroll
      for (int j = 0; j < G; ++j) {
        atomicAdd(&S.acc[j * d + c0], a0[j]);
        if (has1) atomicAdd(&S.acc[j * d + c1], a1[j]);
      }
    }
    __syncthreads();
    if (two)  // into the stage just read
      stage_values(u + 1);
    else
      stage_keys(u + 1);
  }
  const std::int64_t slot = A.split_indptr[i] + item.split;
  for (int x = tid; x < G * d; x += nt) A.part_acc[(slot * QH + h * G) * d + x] = S.acc[x];
  if (tid < G) {
    A.part_max[slot * QH + h * G + tid] = S.m[tid];
    A.part_sum[slot * QH + h * G + tid] = S.l[tid];
  }
}

// Calls f(std::integral_constant<int, group>{}) for a group size in [1, kMaxGroup]
// (above: kMaxGroup).
template <int G = 1, class F>
inline void with_group(int group, F&& f) {
  if constexpr (G < kMaxGroup) {
    if (group > G) return with_group<G + 1>(group, static_cast<F&&>(f));
  }
  f(std::integral_constant<int, G>{});
}

// The merge of a request's splits: blocks over (request, KV head, 32 of the
// group's G d outputs). Each block finds its queries' largest partial maximum
// and sum (a warp per query, lanes over the splits), then its warps take the
// splits in turn (lanes over the outputs: 128-byte reads), a tile of split
// weights at a time in shared memory; the warps' sums are added in a fixed
// order (the outputs are the same from run to run).
constexpr int kMergeThreads = 128;
constexpr int kMergeOutputs = 32;
constexpr int kMergeTile = 128;
__host__ __device__ inline int merge_blocks(int requests, int kv_heads, int q_heads, int head_dim) {
  const int G = kv_heads > 0 ? q_heads / kv_heads : 0;
  return requests * kv_heads * ((G * head_dim + kMergeOutputs - 1) / kMergeOutputs);
}

__global__ void __launch_bounds__(kMergeThreads)
    hex_merge_kernel(HexDeviceLayer L, HexDecodeArgs A, float* out, bool observe) {
  const HexPageGeometry g = L.geometry;
  const int H = L.kv_heads, d = g.head_dim, nb = g.block, QH = A.q_heads, G = QH / H;
  const int chunks = (G * d + kMergeOutputs - 1) / kMergeOutputs;
  const int ih = blockIdx.x / chunks, chunk = blockIdx.x % chunks, i = ih / H, h = ih % H;
  const int tid = threadIdx.x, nt = blockDim.x, warp = tid / 32, lane = tid % 32, warps = nt / 32;
  const int s0 = A.split_indptr[i], s1 = A.split_indptr[i + 1];
  __shared__ float M[kMaxGroup], inv[kMaxGroup], w[kMergeTile * kMaxGroup], part[kMergeThreads];
  for (int jj = warp; jj < G; jj += warps) {
    const std::int64_t j = h * G + jj;
    float mx = -INFINITY;
    for (int s = s0 + lane; s < s1; s += 32) mx = fmaxf(mx, A.part_max[s * QH + j]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int s = s0 + lane; s < s1; s += 32) sum += A.part_sum[s * QH + j] * expf(A.part_max[s * QH + j] - mx);
    sum = warp_sum(sum);
    if (lane == 0) {
      M[jj] = mx;
      inv[jj] = 1.0f / sum;
    }
  }
  __syncthreads();
  const int x = chunk * kMergeOutputs + lane, jj = x < G * d ? x / d : 0, c = x % d;
  const std::int64_t j = h * G + jj;
  float o = 0.0f;
  for (int t0 = s0; t0 < s1; t0 += kMergeTile) {
    const int n = s1 - t0 < kMergeTile ? s1 - t0 : kMergeTile;
    for (int y = tid; y < n * G; y += nt)
      w[y] = expf(A.part_max[static_cast<std::int64_t>(t0 + y / G) * QH + h * G + y % G] - M[y % G]);
    __syncthreads();
    if (x < G * d) {
      const float* pa = A.part_acc + (static_cast<std::int64_t>(t0) * QH + j) * d + c;
#pragma unroll 4
      for (int s = warp; s < n; s += warps) o = fmaf(pa[static_cast<std::int64_t>(s) * QH * d], w[s * G + jj], o);
    }
    __syncthreads();
  }
  part[tid] = o;
  __syncthreads();
  if (warp == 0 && x < G * d) {
    float sum = 0.0f;
    for (int k = 0; k < warps; ++k) sum += part[k * 32 + lane];
    out[(static_cast<std::int64_t>(i) * QH + j) * d + c] = sum * inv[jj];
  }
  if (!observe || chunk != 0) return;
  const int R = A.residual_rows[i];
  float* sc =
      reinterpret_cast<float*>(L.residual + static_cast<std::int64_t>(A.residual_page[i]) * g.residual_bytes(H) +
                               2 * g.residual_rows_bytes(H)) +
      static_cast<std::int64_t>(h) * nb;
  for (int t = tid; t < R; t += nt) {
    float wt = 0.0f;
    for (int q = 0; q < G; ++q)
      wt += expf(A.res_scores[(static_cast<std::int64_t>(i) * QH + h * G + q) * nb + t] - M[q]) * inv[q];
    sc[t] += wt;
  }
}

}  // namespace kvcal::runtime::cuda::kernels
