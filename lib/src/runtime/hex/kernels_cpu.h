// HEX CPU kernels: the dense and packed-code loops of decode, dispatched at
// run time (Google Highway) to the best SIMD target of the host: on x86-64
// SSE4, AVX2, AVX-512 and AVX-512 with VNNI/VBMI (AVX3_DL); on Arm NEON and
// SVE; a portable emulation otherwise. The caching logic (cache.cpp) and the
// block contract (block.cpp) call only these; a CUDA mirror (kernels.cu)
// implements the same contracts over device pointers.
//
// Raw pointers and sizes only; nothing allocates, nothing throws.
//
// Packed rows (the layout shared with the GPU kernels, see block.cpp and
// quant.h): a row of `dim` codes of `bits` bits is one little-endian bit
// stream. The kernels work on "slots": for 4-bit rows of even width the slot
// order is phase-major, [even channels | odd channels] (byte i holds slots i
// and run + i, run = dim / 2); for 2-bit rows of a width divisible by 4, four
// runs of run = dim / 4 (byte i holds slots i, run+i, 2run+i, 3run+i); for
// 3-bit rows of a width divisible by 8, eight runs of run = dim / 8 (the 24
// bits at byte 3i hold slots i, run+i, ..., 7run+i); other rows (odd widths,
// 3 bits otherwise) keep channel order. Weights and accumulators passed to
// the code kernels are in slot order (Slots::slot maps a channel). The slot
// order is how the kernels read the bytes, not a different byte layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvcal/runtime/common.h"
#include "kvcal/runtime/quant.h"

namespace kvcal::runtime::detail {

// Slot order of a packed row (see the file comment).
struct Slots {
  int bits;
  std::int64_t dim, per, run;
  Slots(int b, std::int64_t d) : bits(b), dim(d) {
    if ((b == 4 && d % 2 == 0) || (b == 2 && d % 4 == 0))
      per = 8 / b;
    else if (b == 3 && d % 8 == 0)
      per = 8;
    else
      per = 1;
    run = d / per;
  }
  std::int64_t slot(std::int64_t c) const { return per == 1 ? c : (c % per) * run + c / per; }
};

// The name of the target the kernels run on now ("AVX3_DL", "AVX2", "SSE4",
// "NEON", "SVE", "EMU128", ...).
const char* kernel_target();
// Its Highway target bit (HWY_AVX3_DL, HWY_AVX2, ...).
std::int64_t kernel_target_id();
// VPDPBUSD where Highway's target has none: x86-64 CPUs without AVX-512 but
// with AVX-VNNI (VEX VPDPBUSD) run the integer code kernels (code_scores_int,
// code_accumulate_int) on it in place of AVX2's PMADDUBSW, and AVX-512 CPUs
// with VNNI but not VBMI (Highway's AVX3 target: Cascade Lake, Cooper Lake)
// on EVEX VPDPBUSD in place of AVX3's PMADDUBSW, with identical results (see
// avxvnni_pass.h). *_available: the CPU has the instruction (and this build
// compiled the kernels for it); vnni_kernels_for(target): whether they stand
// in for that target here; vnni_kernels / avx_vnni_active: which are in use
// now (the dispatch chose such a target and set_avx_vnni has not turned them
// off). set_avx_vnni (both kinds; KVCAL_AVX_VNNI=0 in the environment starts
// it off) returns the previous setting (tests and benchmarks compare both
// paths).
enum class VnniKernels { kNone, kAvx2, kAvx3 };
bool avx_vnni_available();
bool avx512_vnni_available();
bool vnni_kernels_for(std::int64_t target);
VnniKernels vnni_kernels();
bool avx_vnni_active();
bool set_avx_vnni(bool allow);

// How far ahead of the rows they read, in bytes, the integer code kernels
// request the lines of kBits-bit rows still in memory (PrefetchFar in
// kernels_cpu-inl.h), by bits (2, 3 and 4; 0: none). Chosen once when the
// library loads (prefetch.cpp): choose_prefetch_far for this CPU and
// KVCAL_PREFETCH_FAR.
extern std::int64_t far_bytes_by_bits[5];
struct FarBytes {
  std::int64_t bits3 = 8192, bits4 = 8192, bits2 = 0;
};
// 8 KiB for 3- and 4-bit codes, none for 2-bit ones; 16 KiB for 4-bit codes
// where the CPU is AMD family 0x19 or 0x1a with AVX-512 (Zen 4, Zen 5), and
// 4 KiB for 2-bit codes on 0x1a with AVX-512 (Zen 5) (amd_family: the CPU's
// family where it is AMD's, 0 otherwise). env, the value of
// KVCAL_PREFETCH_FAR (null: unset), sets the three distances instead where
// it is a whole number of bytes in [0, 1 MiB] and is ignored otherwise
// (prefetch_far_bytes tells what is in effect).
FarBytes choose_prefetch_far(unsigned amd_family, bool avx512, const char* env);
// The distance in effect for bits-bit codes (0 for other widths).
std::int64_t prefetch_far_bytes(int bits);
// Sets the three distances (tests, benchmarks; not while kernels run) and
// returns the previous ones.
FarBytes set_prefetch_far(FarBytes f);

// How many rows ahead of the rows they read the integer code kernels
// request lines into L1 (their near requests): the key tiles' kernel
// (ScoresIntTiles, scores_int_cpu.cpp) and the value kernel's first pass
// (AccumulateIntQ, values_int_cpu.cpp). Set once when the library loads
// (prefetch.cpp): choose_prefetch_near for KVCAL_PREFETCH_NEAR.
extern std::int64_t near_rows_keys, near_rows_values;
struct NearRows {
  std::int64_t keys = 96, values = 64;
};
// 96 rows for the key tiles and 64 for the values on every CPU (prefetch.cpp
// has the timings of other distances). env, the value of KVCAL_PREFETCH_NEAR
// (null: unset), sets both instead where it is a whole number of rows in
// [0, 4096] and is ignored otherwise (prefetch_near_rows tells what is in
// effect): for timing other distances without a rebuild.
NearRows choose_prefetch_near(const char* env);
NearRows prefetch_near_rows();
// Sets both (tests, benchmarks; not while kernels run) and returns the
// previous ones.
NearRows set_prefetch_near(NearRows n);

// sum_i a[i] * b[i].
float dot(const float* a, const float* b, std::int64_t n);
// y[i] += w * x[i].
void axpy(float w, const float* x, float* y, std::int64_t n);
// r[i] = exp(r[i] - max r) / sum_j exp(r[j] - max r), in place (n >= 1).
void softmax_row(float* r, std::int64_t n);
// One piece of a softmax over a row taken in pieces (flash-decoding's running
// state): with m the largest score and z the sum of e^(s - m) over the
// earlier pieces (m = -inf, z = 0 before the first), sets m to
// max(m, max r), rescales z to it and adds this piece's terms, and replaces
// r[i] by e^(r[i] - m). Returns the factor e^(m_before - m) by which anything
// summed with the earlier pieces' weights must be scaled (1 if the maximum
// stayed, 0 on the first piece).
float online_softmax_row(float* r, std::int64_t n, float& m, float& z);

// Scores over fp16 rows: out[j * out_stride + t] = scale * q_j . k_t for
// t < rows (k_t at k + t * k_stride, dim halves) and j < nq (q_j at q + j * q_stride).
void half_scores(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k, std::int64_t rows,
                 std::int64_t dim, std::int64_t k_stride, float scale, float* out, std::int64_t out_stride);
// out_j += sum_t p[j * p_stride + t] * v_t over fp16 rows (out_j at out + j * out_stride).
void half_accumulate(const float* p, std::int64_t nq, std::int64_t p_stride, const half_bits* v, std::int64_t rows,
                     std::int64_t dim, std::int64_t v_stride, float* out, std::int64_t out_stride);

// Scores over packed rows (row r at codes + r * row_bytes):
//   out[j * out_stride + r] = sum_slot w[j * w_stride + slot] * code_r(slot)
// for r < rows and j < nq. A GQA group shares one pass over the codes.
void code_scores(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                 const float* w, std::int64_t nq, std::int64_t w_stride, float* out, std::int64_t out_stride);
// Value accumulation over packed rows:
//   acc[j * acc_stride + slot] += sum_r a[j * a_stride + r] * code_r(slot).
void code_accumulate(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                     const float* a, std::int64_t nq, std::int64_t a_stride, float* acc, std::int64_t acc_stride);

// out[c] += bias + acc[sl.slot(c)] for c < sl.dim (acc and out apart).
void add_slots(const float* acc, const Slots& sl, float bias, float* out);
// y[i] += w * x[i] for i < n, from int32 x.
void axpy_int(float w, const std::int32_t* x, float* y, std::int64_t n);
// The key side of a block for nq queries (q_j at q + j * q_stride), from its
// key groups as floats, params[2c] = delta_c and params[2c + 1] = min_c for
// c < sl.dim:
//   qd[j * dim + sl.slot(c)] = scale * q_j[c] * delta_c   (the code weights)
//   kmin[c] = min_c,  bias[j] = sum_c scale * q_j[c] * min_c,
//   amax[j] = max_c |qd[j * dim + c]|   (for quantize_rows).
// tmp holds 2 * dim floats of scratch.
void key_weights(const float* params, const float* q, std::int64_t nq, std::int64_t q_stride, float scale,
                 const Slots& sl, float* qd, float* kmin, float* bias, float* amax, float* tmp);
// value_weights: entries_cpu.h.

// Integer scores (the fixed-point decode paths): integer weights of one or
// two int8 limbs, so that unsigned-code x signed-byte dot products --
// VPDPBUSD, PMADDUBSW, SDOT -- serve them. With limbs == 1 (int8) w8 + j *
// w8_stride holds w[dim] in [-127, 127]; with limbs == 2 (int14) it holds hi
// then lo, w = 128 hi + lo with hi in [-64, 63] and lo in [0, 127]; slot
// order either way. out[j * out_stride + r] = sum_slot w_j[slot] *
// code_r(slot), exact in int32 and identical on every target. Only for
// layouts where int_dot_layout(bits, dim) (phase-split rows whose runs are
// multiples of 16 bytes; 3-bit rows whose 4-bit rows would be such rows, up
// to dim / 2 = kIntWide3Bytes); other rows use the reference. Slot order:
// int_slots(bits, dim), which for 3-bit rows is the 4-bit order of the same
// channels (the kernels widen 3-bit codes to two per byte as they read them).
bool int_dot_layout(int bits, std::int64_t dim);
inline constexpr std::int64_t kIntWide3Bytes = 8192;
// The slot order of the integer kernels: the stored one, 3-bit rows in the
// 4-bit order.
inline Slots int_slots(int bits, std::int64_t dim) { return Slots(bits == 3 ? 4 : bits, dim); }
// 3-bit rows (dim % 8 == 0, so rows are contiguous: 3 dim / 8 bytes each)
// widened to the 4-bit rows of the same codes (dim / 2 bytes each, row r at
// out + r * dim / 2): every code in its own nibble. The integer kernels read
// 3-bit rows this way where they do not read them in place.
void widen_codes3(const std::uint8_t* codes, std::int64_t rows, std::int64_t dim, std::uint8_t* out);
void code_scores_int(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits, std::int64_t dim,
                     int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride, std::int32_t* out,
                     std::int64_t out_stride);
// Key tiles: the layout of a block's key codes where the cache stores them
// for the integer score kernels (HexBlockView::k_tiled). The rows go in
// tiles of kKeyTileRows, the last holding the n <= 16 rows left; each row is
// cut into units of KeyTileUnit(bits) bytes (four bytes of 2- or 4-bit
// codes; three bytes, eight codes, of 3-bit ones), and unit g of row rr of
// the tile of n rows that starts at row t0 lies at byte t0 * row_bytes + (n
// g + rr) * unit. The same bytes as the rows, rearranged: bytes() is
// unchanged. A vector of a whole tile's unit column holds one row per 32-bit
// lane (3-bit units widened to four bytes as they are read), which the score
// kernel multiplies by broadcast query weights without transposing the rows
// or reducing across lanes; a vector of the last tile's column holds its n
// rows in its first lanes (the rest are dropped).
inline constexpr std::int64_t kKeyTileRows = 16;
constexpr std::int64_t KeyTileUnit(int bits) { return bits == 3 ? 3 : 4; }
// Whether key tiles serve rows of `bits`-bit codes and dim channels (the
// integer kernels' layout, rows of whole units).
bool key_tiles_layout(int bits, std::int64_t dim);
// rows (row-major, row_bytes each) to the tile layout and back; in and out
// apart, rows * row_bytes bytes each.
void rows_to_key_tiles(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, int bits, std::uint8_t* out);
void key_tiles_to_rows(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, int bits, std::uint8_t* out);
// code_scores_int over rows stored as key tiles (the same sums).
void code_scores_int_tiles(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                           std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                           std::int32_t* out, std::int64_t out_stride);
// Value tiles: the layout of a block's value codes where the cache stores
// them for the integer value kernels (HexBlockView::v_tiled). Rows go in
// groups of kValueTileRows = 4, byte b of row k of the group that starts at
// row r at byte r * row_bytes + 4 b + k; the rows % 4 rows left after the
// last whole group stay rows, where they were. The same bytes as the rows,
// rearranged. A vector of a group's bytes holds four rows' bytes of N / 4
// byte positions, one position per 32-bit lane, as VPDPBUSD (or its
// equivalent) multiplies them by the four rows' weights: the value kernel
// over rows transposes each group of rows into that order first.
inline constexpr std::int64_t kValueTileRows = 4;
// Whether the integer value kernels read value tiles of rows of `bits`-bit
// codes and dim channels with `limbs` limbs of weights: 2 and 4 bits in the
// integer kernels' layout; 3 bits where the kernel target in use reads them
// (VBMI, one limb, vectors of 32 or 64 bytes: dim % 64 == 0), which makes
// this a property of the host, for the caches it runs. Other layouts are
// untiled for the reference (as every target does for tiles it does not
// read: correct, not fast).
bool value_tiles_layout(int bits, std::int64_t dim, int limbs);
// rows (row-major, row_bytes each) to value tiles and back; in and out
// apart, rows * row_bytes bytes each.
void rows_to_value_tiles(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, std::uint8_t* out);
void value_tiles_to_rows(const std::uint8_t* in, std::int64_t rows, std::int64_t row_bytes, std::uint8_t* out);
// Integer value accumulation: acc[j * acc_stride + slot] += sum_r w_j[r] *
// code_r(slot), exact, w8 + j * w8_stride holding the rows' weights as
// above (with two limbs: hi for the rows, then lo for the rows).
void code_accumulate_int(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                         std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq, std::int64_t w8_stride,
                         std::int32_t* acc, std::int64_t acc_stride);
// The same sums, scaled into floats: acc[j * acc_stride + slot] += ws[j] *
// sum_r w_j[r] * code_r(slot). Each call's exact integer sums are scaled
// once (for 3-bit rows widened in chunks, once per chunk), so the result is
// that of code_accumulate_int into zeroed rows followed by axpy_int, within
// a rounding or two. scratch holds nq * dim int32 for the layouts the
// integer kernels do not take (their reference runs there).
void code_accumulate_int_scaled(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                                std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                                std::int64_t w8_stride, const float* ws, float* acc, std::int64_t acc_stride,
                                std::int32_t* scratch);
// Both over rows stored as value tiles (the same sums, bit for bit).
void code_accumulate_int_tiles(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                               std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                               std::int64_t w8_stride, std::int32_t* acc, std::int64_t acc_stride);
void code_accumulate_int_tiles_scaled(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                                      std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                                      std::int64_t w8_stride, const float* ws, float* acc, std::int64_t acc_stride,
                                      std::int32_t* scratch);
// The 14-bit fixed-point weights of the int14 path: v_i = round(w_i * 8191
// / max|w|) (half to even), as two int8 limbs: hi = floor(v / 128) in
// limbs[0, n), lo = v - 128 hi in limbs[n, 2n). Returns s = max|w| / 8191 (0
// for all-zero weights): |w_i - s v_i| <= s / 2 plus one rounding of w_i *
// 8191 / max|w|. The same result on every target.
float quantize_weights14(const float* w, std::int64_t n, std::int8_t* limbs);
// The 8-bit weights of the int8 path: v8_i = round(w_i * 127 / max|w|)
// (half to even) in [-127, 127]. Returns s = max|w| / 127 (0 for all-zero
// weights), with the same bound as above for s. The same on every target.
float quantize_weights8(const float* w, std::int64_t n, std::int8_t* v8);
// Both for rows of weights: row j < rows (n weights at w + j * n) to out + j
// * limbs * n (limbs 1: int8, 2: int14), its scale to scales[j]. amax, if
// not null, holds max|w_j| per row as the caller found it while making the
// weights (exactly: the results are the same either way); null, it is found
// here.
void quantize_rows(int limbs, const float* w, std::int64_t rows, std::int64_t n, std::int8_t* out, float* scales,
                   const float* amax = nullptr);
void code_accumulate_int_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                                   std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                                   std::int64_t w8_stride, std::int32_t* acc, std::int64_t acc_stride);
void code_scores_int_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                               std::int64_t dim, int limbs, const std::int8_t* w8, std::int64_t nq,
                               std::int64_t w8_stride, std::int32_t* out, std::int64_t out_stride);

// The scalar reference of the two code kernels (the contract every target and
// the CUDA kernels are tested against).
void code_scores_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                           std::int64_t dim, const float* w, std::int64_t nq, std::int64_t w_stride, float* out,
                           std::int64_t out_stride);
void code_accumulate_reference(const std::uint8_t* codes, std::int64_t rows, std::int64_t row_bytes, int bits,
                               std::int64_t dim, const float* a, std::int64_t nq, std::int64_t a_stride, float* acc,
                               std::int64_t acc_stride);

}  // namespace kvcal::runtime::detail
