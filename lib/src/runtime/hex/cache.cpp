// The HEX layer cache (streaming logic: residual fp16 rows, heavy-hitter
// scores, recent window, block compression as blocks fill) and the H2O
// eviction baseline. Block compression and decode are in block.cpp, the
// loops in kernels_cpu.cpp.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kvcal/runtime/hex.h"
#include "runtime/checks.h"
#include "runtime/hex/block.h"
#include "runtime/hex/kernels_cpu.h"

namespace kvcal::runtime {

using detail::fail;
using detail::require;
using namespace detail;  // NOLINT(google-build-using-namespace): the kernels and block helpers

// ---------------------------------------------------------------- options

HexOptions hex_method(const std::string& full_name, const HexOptions& base) {
  HexOptions o = base;
  std::string name = full_name;
  if (const auto at = name.find('@'); at != std::string::npos) {
    const std::string dot = name.substr(at + 1);
    name.resize(at);
    if (dot == "int14") {
      o.dot = HexDot::int14;
    } else if (dot == "int8") {
      o.dot = HexDot::int8;
    } else if (dot == "float32") {
      o.dot = HexDot::float32;
    } else {
      fail("unknown dot product '" + dot + "' in method '" + full_name + "' (known: @float32, @int14, @int8)");
    }
    if (name == "fp16") fail("method 'fp16' has no codes to multiply: '" + full_name + "' takes no @" + dot);
  }
  if (name == "fp16") {
    o.bits = 0;
    o.expander = o.heavy_hitters = o.recent = false;
    return o;
  }
  struct Row {
    const char* prefix;
    bool expander, hh;
  };
  for (const Row r :
       {Row{"kcvt", false, false}, Row{"h2o", false, true}, Row{"expander", true, false}, Row{"hex", true, true}}) {
    const std::string p = r.prefix;
    if (name.size() == p.size() + 1 && name.compare(0, p.size(), p) == 0 && name.back() >= '2' && name.back() <= '4') {
      o.bits = name.back() - '0';
      o.expander = r.expander;
      o.heavy_hitters = o.recent = r.hh;
      return o;
    }
  }
  fail("unknown method '" + full_name +
       "' (known: fp16, kcvt2|3|4, h2o2|3|4, expander2|3|4, hex2|3|4, h2o-evict; any but fp16 and h2o-evict may end "
       "in @int14 or @int8)");
}

void check_options(const HexOptions& o) {
  require(o.block >= 1 && o.block <= 65535, "block size must be in [1, 65535], got " + std::to_string(o.block));
  require(o.bits == 0 || (o.bits >= 2 && o.bits <= 4), "bits must be 0, 2, 3 or 4, got " + std::to_string(o.bits));
  require(std::isfinite(o.hh_ratio) && o.hh_ratio >= 0 && o.hh_ratio <= 1,
          "heavy-hitter ratio must be in [0, 1], got " + std::to_string(o.hh_ratio));
  require(o.recent_window >= 0, "recent window must be >= 0, got " + std::to_string(o.recent_window));
  require(std::isfinite(o.sparsity) && o.sparsity > 0 && o.sparsity <= 1,
          "expander sparsity must be in (0, 1], got " + std::to_string(o.sparsity));
}

// ---------------------------------------------------------------- layer cache

namespace {

// The compressed blocks of one head as streams: the key side of every
// block (parameters, kept indices, codes, expander entries) one block after
// the other, in the order the score pass reads them, and the value side
// likewise for the accumulation pass. A decode then reads sequential
// streams, which the hardware prefetcher follows; a HexBlock's nine separate
// allocations made every block start with stalls. (With the entries before
// the codes, as they once were, a score pass that reads the codes first and
// then the entries made hex4 decode of one query per KV head 5-18% slower on
// a Zen 5 host.) The kept tokens' fp16 rows go to two streams of their own,
// keys and values, so that the kept rows of consecutive blocks lie back to
// back and a decode takes those of many blocks in one pass of the fp16
// kernels (kept_scores, kept_accumulate) rather than two or three rows per
// block. Chunks never move, so the views stay valid as blocks are added.
class BlockStore {
 public:
  // Room for `add` (may throw; leaves the views unchanged).
  void reserve(const std::vector<HexBlock>& add) {
    std::size_t key = 0, value = 0, kept_key = 0, kept_value = 0;
    for (const HexBlock& b : add) {
      key += key_bytes(b);
      value += value_bytes(b);
      kept_key += size_of(b.k_kept);
      kept_value += size_of(b.v_kept);
    }
    keys_.reserve(key);
    values_.reserve(value);
    kept_keys_.reserve(kept_key);
    kept_values_.reserve(kept_value);
    views_.reserve(views_.size() + add.size());
  }
  // Copies b in; after reserve() covering it, nothing here throws.
  void push(const HexBlock& b) noexcept {
    HexBlockView v = b.view();
    v.k_params = keys_.copy(b.k_params);
    v.kept_index = b.kept_index.empty() ? nullptr : keys_.copy(b.kept_index);
    v.k_codes = keys_.copy(b.k_codes);
    v.k_sparse = keys_.copy(b.k_sparse);
    v.k_kept = kept_keys_.copy(b.k_kept);
    v.v_params = values_.copy(b.v_params);
    v.v_sparse = values_.copy(b.v_sparse);
    v.v_kept = kept_values_.copy(b.v_kept);
    v.v_codes = values_.copy(b.v_codes);
    views_.push_back(v);
  }
  const std::vector<HexBlockView>& views() const { return views_; }

 private:
  static constexpr std::size_t kAlign = 16;  // each array starts on a vector boundary
  static std::size_t padded(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
  template <class T>
  static std::size_t size_of(const std::vector<T>& x) {
    return padded(x.size() * sizeof(T));
  }
  static std::size_t key_bytes(const HexBlock& b) {
    return size_of(b.k_params) + size_of(b.k_sparse) + size_of(b.k_codes) + size_of(b.kept_index);
  }
  static std::size_t value_bytes(const HexBlock& b) {
    return size_of(b.v_params) + size_of(b.v_sparse) + size_of(b.v_codes);
  }

  // Append-only storage in chunks that grow geometrically (64 KiB .. 4 MiB,
  // or one larger chunk for a large batch of blocks).
  class Stream {
   public:
    void reserve(std::size_t bytes) {
      if (bytes == 0 || (!chunks_.empty() && chunks_.back().size - chunks_.back().used >= bytes)) return;
      std::size_t size = chunks_.empty() ? kMinChunk : std::min(2 * chunks_.back().size, kMaxChunk);
      size = std::max(size, bytes);
      Chunk c{std::make_unique_for_overwrite<std::byte[]>(size), size, 0};
      if (chunks_.size() == chunks_.capacity()) chunks_.reserve(2 * chunks_.size() + 1);
      chunks_.push_back(std::move(c));
    }
    template <class T>
    const T* copy(const std::vector<T>& x) noexcept {
      if (x.empty()) return nullptr;
      Chunk& c = chunks_.back();
      auto* at = c.data.get() + c.used;
      std::memcpy(at, x.data(), x.size() * sizeof(T));
      c.used += size_of(x);
      return reinterpret_cast<const T*>(at);
    }

   private:
    static constexpr std::size_t kMinChunk = std::size_t{64} << 10, kMaxChunk = std::size_t{4} << 20;
    struct Chunk {
      std::unique_ptr<std::byte[]> data;
      std::size_t size = 0, used = 0;
    };
    std::vector<Chunk> chunks_;
  };
  Stream keys_, values_, kept_keys_, kept_values_;
  std::vector<HexBlockView> views_;
};

// Requests every line of [p, p + bytes), from the line holding its first
// byte through the line holding its last, with __builtin_prefetch's
// locality kHint (3: into L1; 1: the outer caches, PREFETCHT2).
template <int kHint>
void request_lines(const void* p, std::int64_t bytes) {
  if (!p || bytes <= 0) return;
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t end = at + static_cast<std::uintptr_t>(bytes);
  for (std::uintptr_t line = at & ~std::uintptr_t{63}; line < end; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, kHint);
}

// Requests every line of a block's kept rows, keys and values, for the outer
// caches (the hint of the kernels' far requests, PREFETCHT2). The decode
// reads them after a whole piece of blocks (kept_scores, kept_accumulate),
// from streams of their own, a few rows a block: requested while the piece's
// blocks are scored, they are in L2 by then. Decode over 32K tokens on a
// 2-vCPU Intel Xeon guest, one thread, 5 interleaved rounds: hex4@int8 1-4%
// less time with one query per KV head and 0-2% with four; h2o4@int8 (the
// kept rows without the entries) 1-4% less and 0-1% more.
void request_kept_rows(const HexBlockView& b) {
  if (b.bits == 0 || b.kept_rows == 0) return;
  const std::int64_t bytes = std::int64_t{b.kept_rows} * b.head_dim * static_cast<std::int64_t>(sizeof(half_bits));
  request_lines<1>(b.k_kept, bytes);
  request_lines<1>(b.v_kept, bytes);
}

// Requests a block's (delta, min) pairs of one side (n of them) into L1,
// one block ahead: the first thing each side of a block reads (converted
// to floats before the weights), which stalled there although the code
// kernels' far requests had asked for those lines (ToFloats had 2% of a
// profile of hex4@int8 decode at a group of 4, half of it on the
// conversion's load). Decode over 32K tokens on a 2-vCPU Intel Xeon guest,
// interleaved rounds against the library without: one thread, 3-6% less
// time with one query per KV head and 1-3% with four (4 rounds); two
// threads, from 1% more to 3% less time in 5 rounds at either group.
void request_params(const QuantParams* p, std::int64_t n) {
  request_lines<3>(p, n * static_cast<std::int64_t>(sizeof(QuantParams)));
}

}  // namespace

struct HexLayerCache::Impl {
  std::int64_t heads = 0, dim = 0;
  HexOptions opt;
  std::shared_ptr<const Mask> mask;
  std::int64_t tokens = 0;      // appended so far
  std::int64_t compressed = 0;  // tokens in blocks
  std::vector<double> score;    // heavy-hitter scores by position
  struct Head {
    BlockStore blocks;
    std::vector<half_bits> res_k, res_v;  // residual rows (and in full mode the source of every block before them)
  };
  std::vector<Head> head;

  // Which tokens of the block starting at `start` stay in fp16.
  std::vector<std::uint8_t> keep_rows(std::int64_t start) const {
    const std::int64_t n = opt.block;
    std::vector<std::uint8_t> keep(static_cast<std::size_t>(n), 0);
    if (opt.recent)
      for (std::int64_t t = std::max<std::int64_t>(0, tokens - opt.recent_window - start); t < n; ++t)
        keep[static_cast<std::size_t>(t)] = 1;
    if (opt.heavy_hitters && opt.hh_ratio > 0) {
      const auto h = static_cast<std::int64_t>(std::ceil(opt.hh_ratio * static_cast<double>(n) - 1e-9));
      std::vector<std::int64_t> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      const auto s = [&](std::int64_t t) {
        const auto p = static_cast<std::size_t>(start + t);
        return p < score.size() ? score[p] : 0.0;
      };
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return s(a) > s(b); });
      for (std::int64_t i = 0; i < h && i < n; ++i) {
        const std::int64_t t = order[static_cast<std::size_t>(i)];
        if (s(t) > 0) keep[static_cast<std::size_t>(t)] = 1;
      }
    }
    return keep;
  }

  HexBlock compress(const Head& hd, const std::vector<std::uint8_t>& keep, std::int64_t offset) const {
    const half_bits* k = hd.res_k.data() + offset * dim;
    const half_bits* v = hd.res_v.data() + offset * dim;
    HexBlock b =
        compress_checked_block(k, v, opt.block, dim, dim, keep.data(), opt.expander ? mask : nullptr, opt.bits);
    // The integer kernels read the keys and values in tiles
    // (HexBlockView::k_tiled, v_tiled).
    if (opt.dot != HexDot::float32) {
      tile_keys(b);
      tile_values(b, dot_limbs(opt.dot));
    }
    return b;
  }

  // Compresses the full blocks waiting in the residual buffers. Strong
  // guarantee: the new blocks are built, and room for them made, before a
  // commit of operations that cannot throw, so a failure (bad_alloc) leaves
  // the cache as it was.
  void flush() {
    const std::int64_t n = opt.block;
    const std::int64_t waiting = tokens - compressed;
    const std::int64_t new_blocks = waiting / n;
    if (new_blocks == 0) return;
    const auto H = static_cast<std::size_t>(heads);
    std::vector<std::vector<HexBlock>> built(H);
    if (opt.mode == HexMode::append) {
      for (std::int64_t b = 0; b < new_blocks; ++b) {
        const auto keep = keep_rows(compressed + b * n);
        for (std::size_t h = 0; h < H; ++h) built[h].push_back(compress(head[h], keep, b * n));
      }
      for (std::size_t h = 0; h < H; ++h) head[h].blocks.reserve(built[h]);
      // Commit: nothing below throws.
      for (std::size_t h = 0; h < H; ++h) {
        Head& hd = head[h];
        for (const HexBlock& blk : built[h]) hd.blocks.push(blk);
        hd.res_k.erase(hd.res_k.begin(), hd.res_k.begin() + new_blocks * n * dim);
        hd.res_v.erase(hd.res_v.begin(), hd.res_v.begin() + new_blocks * n * dim);
      }
      compressed += new_blocks * n;
      return;
    }
    // Full mode: every block again, from the fp16 source kept in res_k/res_v.
    const std::int64_t blocks = (compressed + new_blocks * n) / n;
    for (std::int64_t b = 0; b < blocks; ++b) {
      const auto keep = keep_rows(b * n);
      for (std::size_t h = 0; h < H; ++h) built[h].push_back(compress(head[h], keep, b * n));
    }
    std::vector<BlockStore> fresh(H);
    for (std::size_t h = 0; h < H; ++h) {
      fresh[h].reserve(built[h]);
      for (const HexBlock& blk : built[h]) fresh[h].push(blk);
    }
    for (std::size_t h = 0; h < H; ++h) std::swap(head[h].blocks, fresh[h]);
    compressed += new_blocks * n;
  }

  // Offset of the residual (uncompressed) rows inside res_k/res_v.
  std::int64_t residual_offset() const { return opt.mode == HexMode::full ? compressed : 0; }
};

HexLayerCache::HexLayerCache(std::int64_t kv_heads, std::int64_t head_dim, const HexOptions& options,
                             std::shared_ptr<const Mask> mask)
    : impl_(std::make_unique<Impl>()) {
  check_options(options);
  require(kv_heads >= 1 && head_dim >= 1, "a layer cache needs at least one KV head and one channel");
  if (options.expander && options.bits != 0) {
    require(mask != nullptr, "the expander method needs a mask");
    require(mask->rows == options.block && mask->cols == head_dim,
            "the mask's shape " + std::to_string(mask->rows) + "x" + std::to_string(mask->cols) +
                " does not match block x head_dim = " + std::to_string(options.block) + "x" + std::to_string(head_dim));
    check_mask(*mask);
  }
  impl_->heads = kv_heads;
  impl_->dim = head_dim;
  impl_->opt = options;
  impl_->mask = std::move(mask);
  impl_->head.resize(static_cast<std::size_t>(kv_heads));
}
HexLayerCache::~HexLayerCache() = default;
HexLayerCache::HexLayerCache(HexLayerCache&&) noexcept = default;
HexLayerCache& HexLayerCache::operator=(HexLayerCache&&) noexcept = default;

void HexLayerCache::append(const half_bits* k, const half_bits* v, std::int64_t n, std::int64_t head_stride,
                           std::int64_t token_stride) {
  Impl& m = *impl_;
  require(n >= 0, "negative token count");
  require(n <= 1 || token_stride >= m.dim, "token stride smaller than head_dim");
  for (std::int64_t h = 0; h < m.heads; ++h)
    for (std::int64_t i = 0; i < n; ++i) {
      const half_bits* kr = k + h * head_stride + i * token_stride;
      const half_bits* vr = v + h * head_stride + i * token_stride;
      if (!finite_halves(kr, m.dim) || !finite_halves(vr, m.dim))
        fail("non-finite key or value (head " + std::to_string(h) + ", token " + std::to_string(m.tokens + i) + ")");
    }
  // Room first (may throw, changes nothing), then the rows (cannot throw).
  for (auto& hd : m.head) {
    hd.res_k.reserve(hd.res_k.size() + static_cast<std::size_t>(n * m.dim));
    hd.res_v.reserve(hd.res_v.size() + static_cast<std::size_t>(n * m.dim));
  }
  const std::size_t before = m.head.front().res_k.size();
  for (std::int64_t h = 0; h < m.heads; ++h) {
    auto& hd = m.head[static_cast<std::size_t>(h)];
    for (std::int64_t i = 0; i < n; ++i) {
      const half_bits* kr = k + h * head_stride + i * token_stride;
      const half_bits* vr = v + h * head_stride + i * token_stride;
      hd.res_k.insert(hd.res_k.end(), kr, kr + m.dim);
      hd.res_v.insert(hd.res_v.end(), vr, vr + m.dim);
    }
  }
  m.tokens += n;
  try {
    m.flush();
  } catch (...) {  // undo: the cache is as before the call
    m.tokens -= n;
    for (auto& hd : m.head) {
      hd.res_k.resize(before);
      hd.res_v.resize(before);
    }
    throw;
  }
}

void HexLayerCache::observe(const float* attn, std::int64_t heads, std::int64_t tokens, std::int64_t head_stride) {
  Impl& m = *impl_;
  require(heads >= 0 && tokens >= 0, "negative attention shape");
  // Checked before anything is added: a rejected call leaves the scores as they were.
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t t = 0; t < tokens; ++t)
      require(std::isfinite(attn[h * head_stride + t]), "non-finite attention weight");
  if (static_cast<std::int64_t>(m.score.size()) < tokens) m.score.resize(static_cast<std::size_t>(tokens), 0.0);
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t t = 0; t < tokens; ++t) m.score[static_cast<std::size_t>(t)] += attn[h * head_stride + t];
}

void HexLayerCache::attend(const float* q, std::int64_t q_heads, float scale, float* out, float* probs) const {
  const Impl& m = *impl_;
  require(q_heads >= m.heads && q_heads % m.heads == 0, "query heads must be a multiple of KV heads");
  require(m.tokens >= 1, "attention over an empty cache");
  const std::int64_t group = q_heads / m.heads, d = m.dim, S = m.tokens;
  // Exceptions (bad_alloc) must not leave the OpenMP region: the first one is
  // kept and rethrown after it.
  std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic, 1) if (m.heads > 1 && S * d * group > (1 << 16))
  for (std::int64_t h = 0; h < m.heads; ++h) {
    try {
      attend_head(m, h, q, group, scale, out, probs);
    } catch (...) {
#pragma omp critical(kvcal_hex_attend)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

void HexLayerCache::attend_head(const Impl& m, std::int64_t h, const float* q, std::int64_t group, float scale,
                                float* out, float* probs) {
  const std::int64_t d = m.dim, S = m.tokens;
  const Impl::Head& hd = m.head[static_cast<std::size_t>(h)];
  const float* qh = q + h * group * d;
  float* oh = out + h * group * d;
  // The head's tokens go in pieces of whole blocks, about kPieceWeights
  // weights each (32 KiB: the piece's scores stay in L1 from scoring through
  // the softmax to the value pass), with a running softmax per query (max,
  // sum of exponentials, output scaled to that max) and one normalisation at
  // the end: two passes over each piece's weights instead of three over the
  // whole row, and no buffer of S weights per query unless the caller asks
  // for the probabilities. The output does not depend on whether it does:
  // the same weights are computed either way, in probs or in scratch.
  // (By then a piece's key side has passed through L1 too: at a group of 4
  // its scores come back from L2. Still, decode over 32K tokens at hex4@int8
  // on a 2-vCPU Intel Xeon guest, two threads, 4 interleaved rounds against
  // 8192: 4096 weights took 2-4% more time at a group of 4, 2048 5-10%
  // more; 16384 from 4% less to no change at a group of 4 and 1-2% more
  // with one query, 32768 4-7% more with one query.)
  // The fp16 method (bits 0) takes the whole context as one piece, so that
  // it equals attend_fp16 bit for bit (the reference eval-fidelity measures
  // against: its fp16 row has no error).
  constexpr std::int64_t kPieceWeights = 8192;
  const std::int64_t target = m.opt.bits == 0 ? S : std::max<std::int64_t>(1, kPieceWeights / group);
  const std::vector<HexBlockView>& blocks = hd.blocks.views();
  const std::size_t nb = blocks.size();
  thread_local std::vector<float> local;
  float* const row = probs ? probs + h * group * S : nullptr;  // query j's at row + j * S
  const std::int64_t p_stride = probs ? S : 0;
  thread_local std::vector<float> mx, z, piece_max;  // per query; per piece and query (probs only)
  thread_local std::vector<std::int64_t> piece_at;   // the pieces' first tokens (probs only)
  mx.assign(static_cast<std::size_t>(group), -std::numeric_limits<float>::infinity());
  z.assign(static_cast<std::size_t>(group), 0.0f);
  piece_max.clear();
  piece_at.clear();
  for (std::int64_t j = 0; j < group; ++j) std::fill(oh + j * d, oh + (j + 1) * d, 0.0f);
  // The mask's entries, shared by the blocks; the thread's, so that their
  // buffers are not allocated again for every head and step.
  thread_local KeyEntries ke;
  thread_local ValueEntries ve;
  ke.reset();
  ve.reset();
  // The weights of tokens [pos, pos + n): in probs, or in scratch (stride n).
  const auto weights = [&](std::int64_t pos, std::int64_t n, std::int64_t& stride) {
    if (row) {
      stride = p_stride;
      return row + pos;
    }
    if (static_cast<std::int64_t>(local.size()) < group * n) local.resize(static_cast<std::size_t>(group * n));
    stride = n;
    return local.data();
  };
  // The running softmax over a piece's scores (query j's at p + j * stride).
  const auto soften = [&](float* p, std::int64_t stride, std::int64_t pos, std::int64_t n) {
    for (std::int64_t j = 0; j < group; ++j) {
      const float f =
          online_softmax_row(p + j * stride, n, mx[static_cast<std::size_t>(j)], z[static_cast<std::size_t>(j)]);
      if (f != 1.0f) {
        for (std::int64_t c = 0; c < d; ++c) oh[j * d + c] *= f;
        ve.scale(j, f);
      }
    }
    if (row) {
      piece_at.push_back(pos);
      piece_max.insert(piece_max.end(), mx.begin(), mx.end());
    }
  };
  // Segments: the blocks, then the residual rows (segment nb, if any).
  const std::int64_t off = m.residual_offset();
  const std::int64_t in_blocks = m.compressed;
  const std::size_t segments = nb + (S > in_blocks ? 1 : 0);
  const auto seg_tokens = [&](std::size_t k) {
    return k < nb ? static_cast<std::int64_t>(blocks[k].tokens) : S - in_blocks;
  };
  std::int64_t pos = 0;
  for (std::size_t i = 0; i < segments;) {
    std::size_t e = i + 1;
    std::int64_t n = seg_tokens(i);
    for (; e < segments && n + seg_tokens(e) <= target; ++e) n += seg_tokens(e);
    std::int64_t stride = 0;
    float* p = weights(pos, n, stride);
    // The piece's blocks, their kept tokens all in one go after them.
    const std::size_t piece_blocks = std::min(e, nb) - std::min(i, nb);
    for (std::size_t k = i, at = 0; k < e; at += static_cast<std::size_t>(seg_tokens(k)), ++k) {
      if (k < nb) {
        request_kept_rows(blocks[k]);
        if (k + 1 < nb && blocks[k + 1].bits != 0) request_params(blocks[k + 1].k_params, blocks[k + 1].head_dim);
        block_scores(blocks[k], qh, group, d, scale, p + at, stride, m.opt.dot, ke, false);
      } else {
        half_scores(qh, group, d, hd.res_k.data() + off * d, seg_tokens(k), d, d, scale, p + at, stride);
      }
    }
    if (piece_blocks > 0) kept_scores(blocks.data() + i, piece_blocks, qh, group, d, scale, p, stride);
    soften(p, stride, pos, n);
    // The residual rows (the last segment) after the kept ones: the fp16
    // rows added into the output in token order.
    std::int64_t at = 0;
    for (std::size_t k = i; k < e && k < nb; at += seg_tokens(k), ++k) {
      if (k + 1 < nb && blocks[k + 1].bits != 0) request_params(blocks[k + 1].v_params, blocks[k + 1].quant_rows());
      block_accumulate(blocks[k], p + at, group, stride, oh, d, m.opt.dot, ve, false);
    }
    if (piece_blocks > 0) kept_accumulate(blocks.data() + i, piece_blocks, p, group, stride, oh, d);
    if (e > nb) half_accumulate(p + at, group, stride, hd.res_v.data() + off * d, seg_tokens(nb), d, d, oh, d);
    pos += n;
    i = e;
  }
  ve.flush();
  for (std::int64_t j = 0; j < group; ++j) {
    const float inv = 1.0f / z[static_cast<std::size_t>(j)];
    for (std::int64_t c = 0; c < d; ++c) oh[j * d + c] *= inv;
  }
  if (!row) return;
  // The probabilities: each piece's weights from its maximum to the last.
  const std::size_t pieces = piece_at.size();
  for (std::size_t k = 0; k < pieces; ++k) {
    const std::int64_t p0 = piece_at[k], p1 = k + 1 < pieces ? piece_at[k + 1] : S;
    for (std::int64_t j = 0; j < group; ++j) {
      const auto jj = static_cast<std::size_t>(j);
      const float f = std::exp(piece_max[k * static_cast<std::size_t>(group) + jj] - mx[jj]) / z[jj];
      float* pj = row + j * S;
      for (std::int64_t t = p0; t < p1; ++t) pj[t] *= f;
    }
  }
}

std::int64_t HexLayerCache::tokens() const { return impl_->tokens; }
std::int64_t HexLayerCache::compressed_tokens() const { return impl_->compressed; }
std::int64_t HexLayerCache::bytes() const {
  std::int64_t total = 0;
  for (const auto& hd : impl_->head)
    for (const HexBlockView& b : hd.blocks.views()) total += hex_block_bytes(b);
  total += (impl_->tokens - impl_->compressed) * impl_->dim * 2 * 2 * impl_->heads;
  return total;
}
std::int64_t HexLayerCache::fp16_bytes() const { return impl_->tokens * impl_->dim * 2 * 2 * impl_->heads; }
const HexOptions& HexLayerCache::options() const { return impl_->opt; }
std::vector<HexBlockView> HexLayerCache::blocks(std::int64_t head) const {
  require(head >= 0 && head < impl_->heads, "head index out of range");
  return impl_->head[static_cast<std::size_t>(head)].blocks.views();
}

// ---------------------------------------------------------------- H2O eviction

struct H2OEvictCache::Impl {
  std::int64_t heads = 0, q_heads = 0, dim = 0;
  double budget = 0;
  std::int64_t tokens = 0;
  struct Head {
    std::vector<half_bits> k, v;  // every token (the simulation keeps them; evicted ones are never read)
    std::vector<std::uint8_t> kept;
    std::vector<double> score;
    std::int64_t kept_count = 0;
  };
  std::vector<Head> head;

  std::int64_t limit() const {
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(budget * static_cast<double>(tokens) - 1e-9)));
  }
  void evict() {
    const std::int64_t lim = limit();
    const std::int64_t recent = (lim + 1) / 2;  // half the budget for the most recent tokens
    for (Head& hd : head) {
      if (hd.kept_count <= lim) continue;
      // Candidates: kept tokens outside the recent window, lowest score first (older first on ties).
      std::vector<std::int64_t> cand;
      for (std::int64_t t = 0; t < tokens - recent; ++t)
        if (hd.kept[static_cast<std::size_t>(t)]) cand.push_back(t);
      const auto sc = [&](std::int64_t t) {
        return static_cast<std::size_t>(t) < hd.score.size() ? hd.score[static_cast<std::size_t>(t)] : 0.0;
      };
      std::stable_sort(cand.begin(), cand.end(), [&](std::int64_t a, std::int64_t b) { return sc(a) < sc(b); });
      for (std::size_t i = 0; i < cand.size() && hd.kept_count > lim; ++i) {
        hd.kept[static_cast<std::size_t>(cand[i])] = 0;
        --hd.kept_count;
      }
    }
  }
};

H2OEvictCache::H2OEvictCache(std::int64_t kv_heads, std::int64_t q_heads, std::int64_t head_dim, double budget)
    : impl_(std::make_unique<Impl>()) {
  require(kv_heads >= 1 && head_dim >= 1 && q_heads >= kv_heads && q_heads % kv_heads == 0,
          "bad H2O cache shape (query heads must be a multiple of KV heads)");
  require(std::isfinite(budget) && budget > 0 && budget <= 1, "H2O budget must be in (0, 1]");
  impl_->heads = kv_heads;
  impl_->q_heads = q_heads;
  impl_->dim = head_dim;
  impl_->budget = budget;
  impl_->head.resize(static_cast<std::size_t>(kv_heads));
}
H2OEvictCache::~H2OEvictCache() = default;
H2OEvictCache::H2OEvictCache(H2OEvictCache&&) noexcept = default;
H2OEvictCache& H2OEvictCache::operator=(H2OEvictCache&&) noexcept = default;

void H2OEvictCache::append(const half_bits* k, const half_bits* v, std::int64_t n, std::int64_t head_stride,
                           std::int64_t token_stride) {
  Impl& m = *impl_;
  require(n >= 0, "negative token count");
  require(n <= 1 || token_stride >= m.dim, "token stride smaller than head_dim");
  for (std::int64_t h = 0; h < m.heads; ++h)
    for (std::int64_t i = 0; i < n; ++i)
      require(finite_halves(k + h * head_stride + i * token_stride, m.dim) &&
                  finite_halves(v + h * head_stride + i * token_stride, m.dim),
              "non-finite key or value");
  for (std::int64_t h = 0; h < m.heads; ++h) {
    auto& hd = m.head[static_cast<std::size_t>(h)];
    for (std::int64_t i = 0; i < n; ++i) {
      const half_bits* kr = k + h * head_stride + i * token_stride;
      const half_bits* vr = v + h * head_stride + i * token_stride;
      hd.k.insert(hd.k.end(), kr, kr + m.dim);
      hd.v.insert(hd.v.end(), vr, vr + m.dim);
      hd.kept.push_back(1);
    }
    hd.kept_count += n;
  }
  m.tokens += n;
  m.evict();
}

void H2OEvictCache::observe(const float* attn, std::int64_t tokens, std::int64_t head_stride) {
  Impl& m = *impl_;
  const std::int64_t group = m.q_heads / m.heads;
  require(tokens >= 0, "negative attention shape");
  for (std::int64_t j = 0; j < m.q_heads; ++j)
    for (std::int64_t t = 0; t < tokens; ++t)
      require(std::isfinite(attn[j * head_stride + t]), "non-finite attention weight");
  for (std::int64_t j = 0; j < m.q_heads; ++j) {
    auto& sc = m.head[static_cast<std::size_t>(j / group)].score;
    if (static_cast<std::int64_t>(sc.size()) < tokens) sc.resize(static_cast<std::size_t>(tokens), 0.0);
    for (std::int64_t t = 0; t < tokens; ++t) sc[static_cast<std::size_t>(t)] += attn[j * head_stride + t];
  }
}

void H2OEvictCache::attend(const float* q, float scale, float* out, float* probs) const {
  const Impl& m = *impl_;
  require(m.tokens >= 1, "attention over an empty cache");
  const std::int64_t group = m.q_heads / m.heads, d = m.dim, S = m.tokens;
  if (probs) std::fill(probs, probs + m.q_heads * S, 0.0f);
  for (std::int64_t h = 0; h < m.heads; ++h) {
    const auto& hd = m.head[static_cast<std::size_t>(h)];
    std::vector<half_bits> k, v;
    std::vector<std::int64_t> pos;
    for (std::int64_t t = 0; t < S; ++t)
      if (hd.kept[static_cast<std::size_t>(t)]) {
        k.insert(k.end(), hd.k.begin() + t * d, hd.k.begin() + (t + 1) * d);
        v.insert(v.end(), hd.v.begin() + t * d, hd.v.begin() + (t + 1) * d);
        pos.push_back(t);
      }
    const auto n = static_cast<std::int64_t>(pos.size());
    std::vector<float> p(static_cast<std::size_t>(group * n));
    attend_fp16(q + h * group * d, group, d, k.data(), v.data(), n, d, d, scale, out + h * group * d, d, p.data());
    if (probs)
      for (std::int64_t j = 0; j < group; ++j)
        for (std::int64_t i = 0; i < n; ++i)
          probs[(h * group + j) * S + pos[static_cast<std::size_t>(i)]] = p[static_cast<std::size_t>(j * n + i)];
  }
}

std::int64_t H2OEvictCache::tokens() const { return impl_->tokens; }
std::int64_t H2OEvictCache::kept(std::int64_t head) const {
  require(head >= 0 && head < impl_->heads, "head index out of range");
  return impl_->head[static_cast<std::size_t>(head)].kept_count;
}
std::int64_t H2OEvictCache::bytes() const {
  std::int64_t n = 0;
  for (const auto& hd : impl_->head) n += hd.kept_count;
  return n * impl_->dim * 2 * 2;
}
std::int64_t H2OEvictCache::fp16_bytes() const { return impl_->tokens * impl_->dim * 2 * 2 * impl_->heads; }

}  // namespace kvcal::runtime
