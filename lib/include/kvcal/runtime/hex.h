// HEX KV-cache compression (CPU reference): per layer and KV head, tokens
// stream into an fp16 residual buffer; each full block of n_b tokens is
// compressed. Kept in fp16: the expander mask's entries (block tokens x
// channels), heavy-hitter tokens and the recent window. Everything else is
// KCVT-quantized: keys per channel over the block's tokens, values per token
// over the channels, at 2, 3 or 4 bits (see quant.h).
//
// The same framework runs the paper's ablation rows (Table 4) by switching
// components off: fp16, kcvtB, h2oB, expanderB, hexB; H2OEvictCache is the
// original H2O (keep heavy hitters and recent tokens, drop the rest).
//
// Choices the paper leaves open (documented in the README):
// - heavy hitters are chosen per block: the top ceil(hh_ratio * n_b) tokens
//   of the block by cumulative attention (summed over all query heads of the
//   layer and every observed query, as HEX §3.3 defines it; ties go to the
//   earlier token); tokens never attended (score 0) are not chosen;
// - the recent window is the last `recent` tokens of the whole sequence at the
//   moment a block is compressed (a prefix is compressed after all its tokens
//   arrived, so its last tokens stay in the residual buffer);
// - keys and values share one mask; kept entries are stored once per block;
// - quantization groups skip the expander's entries (outliers kept in fp16
//   do not widen the range), but the code grid covers them so rows stay dense;
// - full mode keeps the fp16 source of compressed tokens (it is an accuracy
//   reference) and recompresses every block with the current scores at each
//   block boundary; bytes() counts the compressed form only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcal/runtime/common.h"
#include "kvcal/runtime/mask_cache.h"
#include "kvcal/runtime/quant.h"

namespace kvcal::runtime {

enum class HexMode { append, full };

// How decode multiplies a block's codes: by the query's weights q_c delta_c
// (scores) and by the attention weights p_t delta_t (values).
// - float32: in float, code by code (the reference).
// - int14: per block and query, each set of weights is rounded to 14-bit
//   fixed point, w ~ s * v with s = max|w| / 8191 and integer |v| <= 8191,
//   and the products with the codes run on integer units (VNNI, PMADDUBSW,
//   or their portable equivalent) exactly, as two int8 limbs.
// - int8: the same with 8-bit weights, s = max|w| / 127 and |v| <= 127: one
//   byte dot product per code instead of two, at about 64 times the error
//   bound of int14.
// For both, a score moves by at most (s / 2) * sum_c code_c <= (s / 2) *
// (2^bits - 1) * head_dim from the float32 path, an output channel by at
// most (s / 2) * (2^bits - 1) * (quantized tokens) per block (bounds checked
// in the tests; kvcal eval-fidelity --methods hex4,hex4@int14,hex4@int8
// shows the effect on attention). 3-bit rows are widened to 4 bits per
// block (one nibble per code) and take the 4-bit kernels. Head dims with no
// integer kernel (not a multiple of 32 at 3 and 4 bits, of 64 at 2 bits)
// use float32.
enum class HexDot { float32, int14, int8 };

struct HexOptions {
  std::int64_t block = 96;  // n_b
  int bits = 4;             // 2, 3 or 4; 0 = no quantization (everything fp16)
  bool expander = true;
  bool heavy_hitters = true;
  bool recent = true;
  double hh_ratio = 0.02;
  std::int64_t recent_window = 8;
  double sparsity = 1.0 / 32;  // expander mask: ones per row / head_dim
  HexMode mode = HexMode::append;
  HexDot dot = HexDot::float32;
};

// The options of a named method: "fp16", "kcvt2|3|4", "h2o2|3|4",
// "expander2|3|4", "hex2|3|4", each but fp16 optionally followed by "@int14"
// (dot = int14), "@int8" (dot = int8) or "@float32". Other fields are taken from `base`. Throws
// Error for other names ("h2o-evict" is H2OEvictCache).
KVCAL_RUNTIME_API HexOptions hex_method(const std::string& name, const HexOptions& base = {});
KVCAL_RUNTIME_API void check_options(const HexOptions& options);  // throws Error naming the bad field

// One compressed block of one KV head: plain pointers and sizes, the layout
// GPU kernels consume. Token t of the block is either kept (listed in
// kept_index, ascending; its K and V rows in k_kept/v_kept) or quantized (the
// q-th quantized token in block order: codes row q, value parameters q, and
// its d1 expander entries, mask columns mask_indices[t*d1 .. (t+1)*d1), at
// k_sparse/v_sparse[q*d1 ..]). bits == 0: every token kept, no index list.
struct HexBlockView {
  std::int32_t tokens = 0, head_dim = 0, bits = 0;
  std::int32_t kept_rows = 0;
  const std::uint16_t* kept_index = nullptr;  // [kept_rows] (null when bits == 0)
  const half_bits* k_kept = nullptr;          // [kept_rows][head_dim]
  const half_bits* v_kept = nullptr;
  std::int32_t row_bytes = 0;             // packed_bytes(head_dim, bits)
  const std::uint8_t* k_codes = nullptr;  // [quant_rows][row_bytes]
  const std::uint8_t* v_codes = nullptr;
  const QuantParams* k_params = nullptr;       // [head_dim]: per channel
  const QuantParams* v_params = nullptr;       // [quant_rows]: per token
  std::int32_t mask_degree = 0;                // d1; 0: no expander entries
  const std::int32_t* mask_indices = nullptr;  // the shared mask's columns, [tokens * d1]
  const half_bits* k_sparse = nullptr;         // [quant_rows * d1]
  const half_bits* v_sparse = nullptr;
  // The key codes' layout: false, rows as above; true, the same bytes in
  // tiles for the CPU's integer score kernels (HexLayerCache stores its
  // blocks so where its method's dot is int8 or int14): tiles of 16 rows,
  // the last of the n <= 16 rows left, each row cut into units of 4 bytes
  // (2- and 4-bit codes) or 3 bytes (3-bit); unit g of row rr of the tile of
  // n rows from row t0 at t0 * row_bytes + (n g + rr) * unit. Pages
  // (hex_paged.h) and the GPU kernels hold rows; hex_page_write takes either.
  bool k_tiled = false;
  // The value codes' layout: false, rows; true, the same bytes as value
  // tiles for the CPU's integer value kernels (HexLayerCache stores 2- and
  // 4-bit blocks so where its method's dot is int8 or int14): groups of four
  // rows, byte c of row k of the group from row r at r * row_bytes + 4 c + k;
  // the quant_rows % 4 rows after the last group stay rows. Pages hold rows;
  // hex_page_write takes either.
  bool v_tiled = false;

  KVCAL_HD std::int32_t quant_rows() const { return tokens - kept_rows; }
};

// Bytes a block actually stores: kept indices (2 B each), fp16 rows, codes,
// parameters (2 x fp16 per group, key groups only when a token is
// quantized), fp16 expander entries. The mask's indices are shared, not
// stored per block.
KVCAL_RUNTIME_API std::int64_t hex_block_bytes(const HexBlockView& b);

// The storage behind a HexBlockView.
struct HexBlock {
  std::int32_t tokens = 0, head_dim = 0, bits = 0;
  std::vector<std::uint16_t> kept_index;
  std::vector<half_bits> k_kept, v_kept;
  std::vector<std::uint8_t> k_codes, v_codes;
  std::vector<QuantParams> k_params, v_params;
  std::vector<half_bits> k_sparse, v_sparse;
  std::shared_ptr<const Mask> mask;  // null without expander entries
  bool k_tiled = false;              // k_codes in tiles (HexBlockView::k_tiled)
  bool v_tiled = false;              // v_codes as value tiles (HexBlockView::v_tiled)

  KVCAL_RUNTIME_API HexBlockView view() const;
  std::int64_t bytes() const { return hex_block_bytes(view()); }
};

// Compresses `tokens` tokens of one head (k and v rows at k + t*token_stride,
// head_dim contiguous halves each). keep_rows[t] != 0 keeps token t in fp16
// (may be null); mask (rows >= tokens, cols == head_dim) adds its entries
// (may be null); bits 0 keeps everything. Throws Error on non-finite input.
KVCAL_RUNTIME_API HexBlock hex_compress_block(const half_bits* k, const half_bits* v, std::int64_t tokens,
                                              std::int64_t head_dim, std::int64_t token_stride,
                                              const std::uint8_t* keep_rows, std::shared_ptr<const Mask> mask,
                                              int bits);

// Reference dequantization: k, v [tokens][head_dim] floats.
KVCAL_RUNTIME_API void hex_dequantize_block(const HexBlockView& b, float* k, float* v);

// scores[j * score_stride + t] = scale * q_j . k_t for nq queries (q_j at
// q + j * q_stride, head_dim floats) over the block's tokens, computed on the
// codes without materialising the keys.
KVCAL_RUNTIME_API void hex_block_scores(const HexBlockView& b, const float* q, std::int64_t nq, std::int64_t q_stride,
                                        float scale, float* scores, std::int64_t score_stride,
                                        HexDot dot = HexDot::float32);
// out_j += sum_t p[j * p_stride + t] * v_t, out_j at out + j * out_stride.
KVCAL_RUNTIME_API void hex_block_accumulate(const HexBlockView& b, const float* p, std::int64_t nq,
                                            std::int64_t p_stride, float* out, std::int64_t out_stride,
                                            HexDot dot = HexDot::float32);

// Plain attention over fp16 keys/values [tokens][head_dim] (row stride
// token_stride halves) for nq queries: out_j = softmax(scale q_j K^T) V.
// probs (optional) receives the weights, [nq][tokens].
KVCAL_RUNTIME_API void attend_fp16(const float* q, std::int64_t nq, std::int64_t q_stride, const half_bits* k,
                                   const half_bits* v, std::int64_t tokens, std::int64_t head_dim,
                                   std::int64_t token_stride, float scale, float* out, std::int64_t out_stride,
                                   float* probs = nullptr);

// The streaming HEX cache of one layer: every KV head, one shared mask.
class KVCAL_RUNTIME_API HexLayerCache {
 public:
  // `mask` is required when options.expander (rows == block, cols ==
  // head_dim), ignored otherwise.
  HexLayerCache(std::int64_t kv_heads, std::int64_t head_dim, const HexOptions& options,
                std::shared_ptr<const Mask> mask);
  ~HexLayerCache();
  HexLayerCache(HexLayerCache&&) noexcept;
  HexLayerCache& operator=(HexLayerCache&&) noexcept;

  // Appends n tokens to every head: head h's token i at k + h*head_stride +
  // i*token_stride (head_dim halves). Full blocks are compressed (a prefix
  // appended at once: all its full blocks, after all its tokens arrived).
  // Strong guarantee: on an exception the cache is unchanged.
  void append(const half_bits* k, const half_bits* v, std::int64_t n, std::int64_t head_stride,
              std::int64_t token_stride);

  // Adds attention weights to the heavy-hitter scores: s_t += sum_h
  // attn[h * head_stride + t] for t < tokens (any number of query heads).
  void observe(const float* attn, std::int64_t heads, std::int64_t tokens, std::int64_t head_stride);

  // Attention of q_heads queries (q [q_heads][head_dim], query head j reads
  // KV head j / (q_heads / kv_heads)) over the whole cache: out [q_heads][head_dim].
  // probs (optional): [q_heads][tokens()] attention weights.
  void attend(const float* q, std::int64_t q_heads, float scale, float* out, float* probs = nullptr) const;

  std::int64_t tokens() const;
  std::int64_t compressed_tokens() const;  // in blocks (the rest is the fp16 residual)
  std::int64_t bytes() const;              // blocks + fp16 residual, all heads
  std::int64_t fp16_bytes() const;         // the same tokens uncompressed: tokens * head_dim * 2 * 2 * kv_heads
  const HexOptions& options() const;
  // The blocks of one head (for GPU upload and inspection). The views point
  // into the cache: valid until the next append() (in full mode every block
  // is rebuilt at a block boundary).
  std::vector<HexBlockView> blocks(std::int64_t head) const;

 private:
  struct Impl;
  static void attend_head(const Impl& m, std::int64_t head, const float* q, std::int64_t group, float scale, float* out,
                          float* probs);
  std::unique_ptr<Impl> impl_;
};

// The original H2O policy as a baseline: each KV head keeps at most
// limit = ceil(budget * tokens) tokens in fp16: the ceil(limit / 2) most
// recent, the rest the heavy hitters by its own cumulative attention (summed
// over its query heads; ties evict the older token first); evicted tokens are
// gone for good.
class KVCAL_RUNTIME_API H2OEvictCache {
 public:
  H2OEvictCache(std::int64_t kv_heads, std::int64_t q_heads, std::int64_t head_dim, double budget);
  ~H2OEvictCache();
  H2OEvictCache(H2OEvictCache&&) noexcept;
  H2OEvictCache& operator=(H2OEvictCache&&) noexcept;

  void append(const half_bits* k, const half_bits* v, std::int64_t n, std::int64_t head_stride,
              std::int64_t token_stride);
  // attn [q_heads][...]: query head j counts for KV head j / group.
  void observe(const float* attn, std::int64_t tokens, std::int64_t head_stride);
  void attend(const float* q, float scale, float* out, float* probs = nullptr) const;

  std::int64_t tokens() const;
  std::int64_t kept(std::int64_t head) const;
  std::int64_t bytes() const;
  std::int64_t fp16_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcal::runtime
