// HEX over a paged batch: the fixed-size page layout a GPU (or any engine)
// keeps a compressed KV cache in, the host-side book-keeping of a batch of
// requests (page pool, page tables, the work of each step), and a host
// executor that runs every step on host memory with the same code the CUDA
// kernels run (kvcal/runtime/hex_cuda.h). The host executor is the paged
// layout's reference: its pages are byte-identical to the device's, its
// attention matches HexLayerCache::attend on the same tokens.
//
// One layer, kv_heads KV heads, head_dim channels, HEX blocks of n_b tokens.
//
// Block pages: one page per (request, block, KV head), fixed size, each array
// starting on a 16-byte boundary (offsets in HexPageGeometry):
//   header      int32 kept_rows, int32 tokens (= n_b), 8 bytes zero
//   kept_index  uint16 [kept_capacity]        ascending token indices
//   k_kept      binary16 [kept_capacity][head_dim]
//   v_kept      binary16 [kept_capacity][head_dim]
//   k_codes     uint8 [n_b][row_bytes]         rows q < n_b - kept_rows used
//   v_codes     uint8 [n_b][row_bytes]
//   k_params    QuantParams [head_dim]         per channel (binary16 delta, min)
//   v_params    QuantParams [n_b]              per quantized token
//   k_sparse    binary16 [n_b][mask_degree]    expander entries of quantized rows
//   v_sparse    binary16 [n_b][mask_degree]
// The mask's columns are not in the page: every page shares one device copy
// ([n_b][mask_degree] int32). bits == 0 (the fp16 baseline): kept_capacity =
// n_b, every token kept in order, no index list, codes, parameters or entries.
// Unused space is zero. The fixed capacity costs bytes the CPU cache does not
// spend: page_bytes() is the true size, hex_block_bytes() the exact size of
// the same block in HexLayerCache (see HexPagedCache::bytes()).
//
// Residual pages: one per request, the not yet full block in fp16 and the
// heavy-hitter scores of its positions:
//   k       binary16 [kv_heads][n_b][head_dim]
//   v       binary16 [kv_heads][n_b][head_dim]
//   scores  float [kv_heads][n_b]    attention summed over each head's query group
// In append mode a token's score matters only until its block is compressed,
// so scores live here: the decode kernel adds to them with plain stores (one
// owner per position), and the keep rule sums them over the KV heads, which is
// HexLayerCache::observe's sum over all query heads.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcal/runtime/hex.h"

namespace kvcal::runtime {

KVCAL_HD constexpr std::int64_t hex_align16(std::int64_t n) { return (n + 15) & ~std::int64_t{15}; }

struct HexPageGeometry {
  std::int32_t block = 0, head_dim = 0, bits = 0, mask_degree = 0, kept_capacity = 0;

  KVCAL_HD std::int32_t row_bytes() const {
    return bits == 0 ? 0 : static_cast<std::int32_t>(packed_bytes(head_dim, bits));
  }
  KVCAL_HD std::int64_t off_kept_index() const { return 16; }
  KVCAL_HD std::int64_t off_k_kept() const {
    return off_kept_index() + (bits == 0 ? 0 : hex_align16(std::int64_t{kept_capacity} * 2));
  }
  KVCAL_HD std::int64_t kept_bytes() const { return hex_align16(std::int64_t{kept_capacity} * head_dim * 2); }
  KVCAL_HD std::int64_t off_v_kept() const { return off_k_kept() + kept_bytes(); }
  KVCAL_HD std::int64_t off_k_codes() const { return off_v_kept() + kept_bytes(); }
  KVCAL_HD std::int64_t codes_bytes() const { return hex_align16(std::int64_t{block} * row_bytes()); }
  KVCAL_HD std::int64_t off_v_codes() const { return off_k_codes() + codes_bytes(); }
  KVCAL_HD std::int64_t off_k_params() const { return off_v_codes() + codes_bytes(); }
  KVCAL_HD std::int64_t off_v_params() const {
    return off_k_params() + (bits == 0 ? 0 : hex_align16(std::int64_t{head_dim} * 4));
  }
  KVCAL_HD std::int64_t off_k_sparse() const {
    return off_v_params() + (bits == 0 ? 0 : hex_align16(std::int64_t{block} * 4));
  }
  KVCAL_HD std::int64_t sparse_bytes() const {
    return bits == 0 ? 0 : hex_align16(std::int64_t{block} * mask_degree * 2);
  }
  KVCAL_HD std::int64_t off_v_sparse() const { return off_k_sparse() + sparse_bytes(); }
  // Bytes of one page (a multiple of 16).
  KVCAL_HD std::int64_t page_bytes() const { return off_v_sparse() + sparse_bytes(); }

  // Residual page of a request (kv_heads heads), a multiple of 16 bytes.
  KVCAL_HD std::int64_t residual_rows_bytes(std::int64_t kv_heads) const {
    return hex_align16(kv_heads * block * head_dim * 2);
  }
  KVCAL_HD std::int64_t residual_bytes(std::int64_t kv_heads) const {
    return 2 * residual_rows_bytes(kv_heads) + hex_align16(kv_heads * block * 4);
  }
};

// The page geometry of a layer: kept_capacity = min(n_b, ceil(hh_ratio n_b)
// + recent_window) with the method's components (n_b at bits 0). Throws Error
// for invalid options or a mask degree outside [0, head_dim] (0 = no expander).
KVCAL_RUNTIME_API HexPageGeometry hex_page_geometry(const HexOptions& options, std::int64_t head_dim,
                                                    std::int64_t mask_degree);

// The block a page holds, as the CPU reference reads it (host or device).
KVCAL_HD inline HexBlockView hex_page_view(const HexPageGeometry& g, const std::uint8_t* page,
                                           const std::int32_t* mask_indices) {
  HexBlockView b;
  b.tokens = g.block;
  b.head_dim = g.head_dim;
  b.bits = g.bits;
  b.kept_rows = *reinterpret_cast<const std::int32_t*>(page);
  b.kept_index = g.bits == 0 ? nullptr : reinterpret_cast<const std::uint16_t*>(page + g.off_kept_index());
  b.k_kept = reinterpret_cast<const half_bits*>(page + g.off_k_kept());
  b.v_kept = reinterpret_cast<const half_bits*>(page + g.off_v_kept());
  b.row_bytes = g.row_bytes();
  b.k_codes = page + g.off_k_codes();
  b.v_codes = page + g.off_v_codes();
  b.k_params = reinterpret_cast<const QuantParams*>(page + g.off_k_params());
  b.v_params = reinterpret_cast<const QuantParams*>(page + g.off_v_params());
  b.mask_degree = g.bits == 0 ? 0 : g.mask_degree;
  b.mask_indices = b.mask_degree > 0 ? mask_indices : nullptr;
  b.k_sparse = reinterpret_cast<const half_bits*>(page + g.off_k_sparse());
  b.v_sparse = reinterpret_cast<const half_bits*>(page + g.off_v_sparse());
  return b;
}

// Writes a block compressed on the host (hex_compress_block, HexLayerCache)
// into a page of g.page_bytes() bytes (the upload path). Throws Error when the
// block does not fit the geometry (shape, bits, mask degree, kept rows above
// capacity).
KVCAL_RUNTIME_API void hex_page_write(const HexPageGeometry& g, const HexBlockView& block, std::uint8_t* page);

// Compresses one block of g.block tokens into a page with the device's code
// (run serially on the host): k and v rows at k + t * token_stride,
// keep_rows[t] != 0 keeps token t (at most kept_capacity of them; null: none),
// mask_indices the shared mask's columns (null when mask_degree == 0). The
// page is bit-identical to hex_page_write(hex_compress_block(...)) on the
// same input. Throws Error on non-finite input or too many kept rows.
KVCAL_RUNTIME_API void hex_compress_page(const HexPageGeometry& g, const half_bits* k, const half_bits* v,
                                         std::int64_t token_stride, const std::uint8_t* keep_rows,
                                         const std::int32_t* mask_indices, std::uint8_t* page);

// ---------------------------------------------------------------- a step's work

// Requests in the jobs and items below are positions in the plan's request
// list; pages are ids.
//
// A block that fills during a step: its n_b rows are the residual page's
// first `from_residual` rows, then new tokens [src_row, src_row + n_b -
// from_residual) of the step's token buffer. Its pages: page_ids[page_index +
// h] for KV head h. recent_from: rows >= recent_from are kept (the recent
// window); of the others, the heavy_hitters highest-scoring (residual scores
// summed over the KV heads; new rows score 0; ties to the earlier row) if
// their score is positive.
struct HexCompressJob {
  std::int32_t request = 0, residual_page = 0, from_residual = 0, src_row = 0;
  std::int32_t recent_from = 0, heavy_hitters = 0, page_index = 0;
};
// New tokens [src_row, src_row + count) written into a residual page from row
// dst_row on. keep_scores == 0: the page's block was compressed this step, its
// scores restart from 0 (rows below dst_row are cleared too).
struct HexAppendJob {
  std::int32_t request = 0, residual_page = 0, dst_row = 0, src_row = 0, count = 0, keep_scores = 1;
};

// A decode work item: query group of KV head `head` of request `request` over
// its blocks [first_block, first_block + blocks) and, when with_residual, its
// residual rows; partial results go to slot `split` (of the request's splits).
struct HexDecodeItem {
  std::int32_t request = 0, head = 0, first_block = 0, blocks = 0, with_residual = 0, split = 0;
};

// Everything a step needs, in flat arrays ready for upload.
struct HexStepPlan {
  // Tokens of the step's buffer: request r's new tokens are rows
  // [token_indptr[r], token_indptr[r + 1]) of [rows][kv_heads][head_dim].
  std::vector<std::int32_t> token_indptr;
  std::vector<HexCompressJob> compress;
  std::vector<HexAppendJob> append;
  std::vector<std::int32_t> page_ids;  // the new blocks' pages, kv_heads per job
};
struct HexDecodePlan {
  std::vector<HexDecodeItem> items;
  std::vector<std::int32_t> residual_rows;  // per request: tokens in its residual page (0 .. n_b - 1)
  std::vector<std::int32_t> residual_page;  // per request: its residual page id
  std::vector<std::int32_t> split_indptr;   // request r's partials: slots [split_indptr[r], split_indptr[r + 1])
  std::int32_t max_splits = 0;
};

// ---------------------------------------------------------------- the batch

// Host book-keeping of one layer's paged cache over a batch of requests:
// pages come from a pool of `pages` block pages and `residual_pages` residual
// pages (ids 0..n-1; the engine owns the memory, page p at base + p * stride).
// No device memory here; HexPagedHost executes the plans on the host,
// hex_cuda.h on a GPU.
class KVCAL_RUNTIME_API HexPagedCache {
 public:
  // mask: required when options.expander and options.bits != 0 (rows ==
  // options.block, cols == head_dim). Only append mode is paged.
  HexPagedCache(std::int64_t kv_heads, std::int64_t head_dim, const HexOptions& options,
                std::shared_ptr<const Mask> mask, std::int64_t pages, std::int64_t residual_pages);
  ~HexPagedCache();
  HexPagedCache(HexPagedCache&&) noexcept;
  HexPagedCache& operator=(HexPagedCache&&) noexcept;

  // A new empty request (takes one residual page); its id. Throws Error when
  // no residual page is free.
  std::int32_t add_request();
  // Gives the request's pages back; the id is invalid afterwards.
  void release(std::int32_t request);

  // Plans appending new_tokens[i] tokens to requests[i] (each request at most
  // once; others get none): pages for every block that fills, the compress
  // and append jobs. The cache's lengths and page tables advance when the
  // plan is made; the caller must run it (compress jobs before append jobs).
  // Strong guarantee: Error (unknown request, pool exhausted: how many pages
  // are needed and free) leaves everything as it was.
  HexStepPlan plan_append(const std::vector<std::int32_t>& requests, const std::vector<std::int32_t>& new_tokens);

  // Splits decode of `requests` (one query token each) into work items of at
  // most `blocks_per_item` blocks (>= 1; 0 picks one from target_items, the
  // number of items to aim for. For the CUDA decode, a small multiple of the
  // SMs (5 thread blocks fit one): on an H100, one request of 32K tokens
  // decodes in 130 us at 5 items per SM and 149 us at 16 (fewer splits to
  // merge, less setup per item); at batch 16, 10 to 32 per SM are within 3%.
  // bench_hex_cuda's BM_decode_items measures it.)
  HexDecodePlan plan_decode(const std::vector<std::int32_t>& requests, std::int32_t blocks_per_item = 0,
                            std::int32_t target_items = 528) const;
  // The same over a subset of each request's blocks: block_counts[i] blocks
  // of request i in the page table given to the decode (select_blocks), its
  // residual rows always. Error when a request would attend nothing.
  HexDecodePlan plan_decode(const std::vector<std::int32_t>& requests, const std::vector<std::int32_t>& block_counts,
                            std::int32_t blocks_per_item, std::int32_t target_items) const;

  // CHESS over a HEX cache (CHESS pages of n_b tokens = HEX blocks): from a
  // selection in the paged-attention layout (select_batch or cuda::chess_select:
  // per request ascending page indices, its partial page last), the page
  // table of only the selected blocks (the partial page is the residual,
  // always attended) and their counts, for plan_decode(requests, counts, ...).
  // Throws Error for indices out of range or not ascending.
  void select_blocks(const std::vector<std::int32_t>& requests, const std::vector<std::int32_t>& selection_indptr,
                     const std::vector<std::int32_t>& selection_indices, std::vector<std::int32_t>& indptr,
                     std::vector<std::int32_t>& indices, std::vector<std::int32_t>& block_counts) const;

  // The block page table of `requests` (paged-attention layout): request i's
  // pages for block b, head h at indices[indptr[i] + b * kv_heads + h].
  void page_table(const std::vector<std::int32_t>& requests, std::vector<std::int32_t>& indptr,
                  std::vector<std::int32_t>& indices) const;
  std::int32_t residual_page(std::int32_t request) const;

  std::int64_t tokens(std::int32_t request) const;
  std::int64_t blocks(std::int32_t request) const;  // compressed blocks
  std::int64_t pages() const;                       // pool sizes
  std::int64_t residual_pages() const;
  std::int64_t free_pages() const;
  std::int64_t free_residual_pages() const;
  // Device bytes the request occupies: its block pages and residual page.
  std::int64_t bytes(std::int32_t request) const;
  const HexPageGeometry& geometry() const;
  const HexOptions& options() const;
  std::int64_t kv_heads() const;
  // The mask's columns, [n_b][mask_degree] (empty without an expander).
  const std::vector<std::int32_t>& mask_indices() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs HexPagedCache's plans on host memory with the device kernels' code
// (the reference for hex_cuda.h and a CPU fallback): a pool of block pages
// and residual pages, step token buffers [rows][kv_heads][head_dim] binary16.
// The decode's code products follow the cache options' rule (HexOptions::dot,
// as HexLayerCache's); the device decode computes them in float32 whatever
// the rule, so it is compared with a host whose options say float32.
class KVCAL_RUNTIME_API HexPagedHost {
 public:
  explicit HexPagedHost(const HexPagedCache& cache);  // pools sized like the cache's
  ~HexPagedHost();

  // Compress jobs, then append jobs. Throws Error on non-finite rows of a
  // block being compressed.
  void run_append(const HexStepPlan& plan, const half_bits* k, const half_bits* v);

  // One query token per request of the plan: q [requests][q_heads][head_dim]
  // floats, out likewise; q_heads a multiple of kv_heads. observe: add each
  // residual token's weight, summed over the query group, to its score.
  // page_indptr/page_indices: HexPagedCache::page_table of the same requests.
  void run_decode(const HexDecodePlan& plan, const std::vector<std::int32_t>& requests,
                  const std::vector<std::int32_t>& page_indptr, const std::vector<std::int32_t>& page_indices,
                  const float* q, std::int64_t q_heads, float scale, float* out, bool observe);

  const std::uint8_t* page(std::int32_t id) const;
  const std::uint8_t* residual(std::int32_t id) const;
  std::uint8_t* residual(std::int32_t id);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcal::runtime
