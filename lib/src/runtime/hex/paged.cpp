// HEX over a paged batch on the host: page geometry and upload, the block
// codec run serially (page_codec.h, the device kernels' code), the batch's
// book-keeping (pool, page tables, step plans) and the host executor.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvcal/runtime/hex_paged.h"
#include "runtime/checks.h"
#include "runtime/hex/block.h"
#include "runtime/hex/page_codec.h"

namespace kvcal::runtime {

using detail::fail;
using detail::require;

// ---------------------------------------------------------------- pages

HexPageGeometry hex_page_geometry(const HexOptions& o, std::int64_t head_dim, std::int64_t mask_degree) {
  check_options(o);
  require(head_dim >= 1 && head_dim <= 4096, "head_dim must be in [1, 4096], got " + std::to_string(head_dim));
  require(mask_degree >= 0 && mask_degree <= head_dim,
          "mask degree must be in [0, head_dim], got " + std::to_string(mask_degree));
  require(o.mode == HexMode::append, "only append mode is paged (full mode recompresses every block)");
  HexPageGeometry g;
  g.block = static_cast<std::int32_t>(o.block);
  g.head_dim = static_cast<std::int32_t>(head_dim);
  g.bits = o.bits;
  if (o.bits == 0) {
    g.kept_capacity = g.block;
    return g;
  }
  g.mask_degree = o.expander ? static_cast<std::int32_t>(mask_degree) : 0;
  std::int64_t cap = 0;
  if (o.heavy_hitters && o.hh_ratio > 0)
    cap += static_cast<std::int64_t>(std::ceil(o.hh_ratio * static_cast<double>(o.block) - 1e-9));
  if (o.recent) cap += o.recent_window;
  g.kept_capacity = static_cast<std::int32_t>(std::min<std::int64_t>(cap, o.block));
  return g;
}

void hex_page_write(const HexPageGeometry& g, const HexBlockView& b, std::uint8_t* page) {
  require(b.tokens == g.block && b.head_dim == g.head_dim && b.bits == g.bits,
          "the block's shape or bits do not match the page geometry");
  require(b.bits == 0 || b.mask_degree == 0 || b.mask_degree == g.mask_degree,
          "the block's mask degree does not match the page geometry");
  require(
      b.kept_rows >= 0 && b.kept_rows <= g.kept_capacity,
      "the block keeps " + std::to_string(b.kept_rows) + " rows, the page holds " + std::to_string(g.kept_capacity));
  std::memset(page, 0, static_cast<std::size_t>(g.page_bytes()));
  auto* header = reinterpret_cast<std::int32_t*>(page);
  header[0] = b.kept_rows;
  header[1] = g.block;
  const std::int64_t d = g.head_dim, kept = b.kept_rows, quant = b.quant_rows();
  const auto put = [&](std::int64_t off, const void* src, std::int64_t bytes) {
    if (bytes > 0) std::memcpy(page + off, src, static_cast<std::size_t>(bytes));
  };
  put(g.off_k_kept(), b.k_kept, kept * d * 2);
  put(g.off_v_kept(), b.v_kept, kept * d * 2);
  if (g.bits == 0) return;
  put(g.off_kept_index(), b.kept_index, kept * 2);
  if (quant == 0) return;
  if (b.k_tiled) {  // pages hold rows
    require(g.row_bytes() % detail::KeyTileUnit(g.bits) == 0,
            "key tiles need rows of whole units (4 bytes, 3 for 3-bit codes)");
    detail::key_tiles_to_rows(b.k_codes, quant, g.row_bytes(), g.bits, page + g.off_k_codes());
  } else
    put(g.off_k_codes(), b.k_codes, quant * g.row_bytes());
  if (b.v_tiled)
    detail::value_tiles_to_rows(b.v_codes, quant, g.row_bytes(), page + g.off_v_codes());
  else
    put(g.off_v_codes(), b.v_codes, quant * g.row_bytes());
  put(g.off_k_params(), b.k_params, d * 4);
  put(g.off_v_params(), b.v_params, quant * 4);
  put(g.off_k_sparse(), b.k_sparse, quant * b.mask_degree * 2);
  put(g.off_v_sparse(), b.v_sparse, quant * b.mask_degree * 2);
}

namespace {

bool rows_finite(const codec::Rows& r, std::int32_t n, std::int32_t d) {
  for (std::int32_t t = 0; t < n; ++t)
    if (!detail::finite_halves(r.k(t), d) || !detail::finite_halves(r.v(t), d)) return false;
  return true;
}

}  // namespace

void hex_compress_page(const HexPageGeometry& g, const half_bits* k, const half_bits* v, std::int64_t token_stride,
                       const std::uint8_t* keep_rows, const std::int32_t* mask_indices, std::uint8_t* page) {
  require(g.block >= 1 && g.head_dim >= 1 && (g.bits == 0 || (g.bits >= 2 && g.bits <= 4)), "bad page geometry");
  require(token_stride >= g.head_dim, "token stride smaller than head_dim");
  require(g.mask_degree == 0 || mask_indices != nullptr, "the geometry has expander entries but no mask was given");
  std::int32_t kept = 0;
  for (std::int32_t t = 0; t < g.block; ++t) kept += keep_rows && keep_rows[t] ? 1 : 0;
  require(g.bits == 0 || kept <= g.kept_capacity,
          "the block keeps " + std::to_string(kept) + " rows, the page holds " + std::to_string(g.kept_capacity));
  codec::Block b;
  b.g = g;
  b.rows.ka = b.rows.kb = k;
  b.rows.va = b.rows.vb = v;
  b.rows.a_stride = b.rows.b_stride = token_stride;
  b.rows.split = g.block;
  if (!rows_finite(b.rows, g.block, g.head_dim)) fail("non-finite key or value in the block");
  b.mask = mask_indices;
  b.page = page;
  std::vector<std::int32_t> qtok(static_cast<std::size_t>(g.block));
  b.qtok = qtok.data();
  std::vector<std::uint8_t> none(static_cast<std::size_t>(g.block), 0);
  codec::compress_serial(b, keep_rows ? keep_rows : none.data());
}

// ---------------------------------------------------------------- the batch

struct HexPagedCache::Impl {
  std::int64_t heads = 0;
  HexOptions opt;
  HexPageGeometry g;
  std::shared_ptr<const Mask> mask;
  std::vector<std::int32_t> mask_indices;
  std::int64_t pool = 0, residual_pool = 0;
  std::vector<std::int32_t> free_pages, free_residual;  // stacks
  struct Request {
    bool alive = false;
    std::int64_t tokens = 0;
    std::int32_t residual = -1;
    std::vector<std::int32_t> pages;  // kv_heads per block
  };
  std::vector<Request> req;

  const Request& get(std::int32_t id) const {
    if (id < 0 || id >= static_cast<std::int32_t>(req.size()) || !req[static_cast<std::size_t>(id)].alive)
      fail("unknown request id " + std::to_string(id));
    return req[static_cast<std::size_t>(id)];
  }
  std::int32_t hh() const {
    if (!opt.heavy_hitters || opt.hh_ratio <= 0 || opt.bits == 0) return 0;
    return static_cast<std::int32_t>(std::ceil(opt.hh_ratio * static_cast<double>(opt.block) - 1e-9));
  }
};

HexPagedCache::HexPagedCache(std::int64_t kv_heads, std::int64_t head_dim, const HexOptions& options,
                             std::shared_ptr<const Mask> mask, std::int64_t pages, std::int64_t residual_pages)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  require(kv_heads >= 1 && kv_heads <= 1024, "kv_heads must be in [1, 1024], got " + std::to_string(kv_heads));
  require(pages >= 0 && pages <= std::numeric_limits<std::int32_t>::max() && residual_pages >= 1 &&
              residual_pages <= std::numeric_limits<std::int32_t>::max(),
          "page pools must hold 0..2^31-1 block pages and at least one residual page");
  const bool expander = options.expander && options.bits != 0;
  if (expander) {
    require(mask != nullptr, "the expander method needs a mask");
    require(mask->rows == options.block && mask->cols == head_dim,
            "the mask's shape " + std::to_string(mask->rows) + "x" + std::to_string(mask->cols) +
                " does not match block x head_dim = " + std::to_string(options.block) + "x" + std::to_string(head_dim));
    detail::check_mask(*mask);
  }
  m.g = hex_page_geometry(options, head_dim, expander ? mask->row_degree : 0);
  m.heads = kv_heads;
  m.opt = options;
  if (expander) {
    m.mask = std::move(mask);
    m.mask_indices = m.mask->indices;
  }
  m.pool = pages;
  m.residual_pool = residual_pages;
  // Stacks handing out the lowest ids first.
  for (std::int64_t p = pages - 1; p >= 0; --p) m.free_pages.push_back(static_cast<std::int32_t>(p));
  for (std::int64_t p = residual_pages - 1; p >= 0; --p) m.free_residual.push_back(static_cast<std::int32_t>(p));
}
HexPagedCache::~HexPagedCache() = default;
HexPagedCache::HexPagedCache(HexPagedCache&&) noexcept = default;
HexPagedCache& HexPagedCache::operator=(HexPagedCache&&) noexcept = default;

std::int32_t HexPagedCache::add_request() {
  Impl& m = *impl_;
  if (m.free_residual.empty())
    fail("no residual page free (" + std::to_string(m.residual_pool) + " in the pool, all in use)");
  std::size_t id = 0;
  while (id < m.req.size() && m.req[id].alive) ++id;
  if (id == m.req.size()) m.req.emplace_back();
  Impl::Request& r = m.req[id];
  r = Impl::Request{};
  r.alive = true;
  r.residual = m.free_residual.back();
  m.free_residual.pop_back();
  return static_cast<std::int32_t>(id);
}

void HexPagedCache::release(std::int32_t id) {
  Impl& m = *impl_;
  m.get(id);
  Impl::Request& r = m.req[static_cast<std::size_t>(id)];
  m.free_pages.insert(m.free_pages.end(), r.pages.rbegin(), r.pages.rend());
  m.free_residual.push_back(r.residual);
  r = Impl::Request{};
}

HexStepPlan HexPagedCache::plan_append(const std::vector<std::int32_t>& requests,
                                       const std::vector<std::int32_t>& new_tokens) {
  Impl& m = *impl_;
  require(requests.size() == new_tokens.size(), "requests and new_tokens differ in length");
  const std::int64_t nb = m.opt.block, H = m.heads;
  std::vector<std::uint8_t> seen(m.req.size(), 0);
  std::int64_t needed = 0, rows = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Impl::Request& r = m.get(requests[i]);
    if (seen[static_cast<std::size_t>(requests[i])]++) fail("request " + std::to_string(requests[i]) + " listed twice");
    require(new_tokens[i] >= 0, "negative token count for request " + std::to_string(requests[i]));
    rows += new_tokens[i];
    require(r.tokens + new_tokens[i] <= std::numeric_limits<std::int32_t>::max() &&
                rows <= std::numeric_limits<std::int32_t>::max(),
            "token count beyond 2^31 - 1");
    needed += ((r.tokens + new_tokens[i]) / nb - r.tokens / nb) * H;
  }
  if (needed > static_cast<std::int64_t>(m.free_pages.size()))
    fail("page pool exhausted: the step needs " + std::to_string(needed) + " block pages, " +
         std::to_string(m.free_pages.size()) + " of " + std::to_string(m.pool) + " are free");
  HexStepPlan plan;
  plan.token_indptr.assign(requests.size() + 1, 0);
  for (std::size_t i = 0; i < requests.size(); ++i) plan.token_indptr[i + 1] = plan.token_indptr[i] + new_tokens[i];
  plan.page_ids.reserve(static_cast<std::size_t>(needed));
  const std::int32_t hh = m.hh();
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Impl::Request& r = m.req[static_cast<std::size_t>(requests[i])];
    const std::int64_t n = new_tokens[i], L = r.tokens, total = L + n;
    const std::int64_t before = L / nb, after = total / nb, R = L - before * nb;
    for (std::int64_t k = 0; k < after - before; ++k) {
      HexCompressJob j;
      j.request = static_cast<std::int32_t>(i);
      j.residual_page = r.residual;
      j.from_residual = k == 0 ? static_cast<std::int32_t>(R) : 0;
      j.src_row = static_cast<std::int32_t>(plan.token_indptr[i] + (k == 0 ? 0 : nb - R + (k - 1) * nb));
      const std::int64_t start = (before + k) * nb;
      j.recent_from =
          m.opt.recent && m.opt.bits != 0
              ? static_cast<std::int32_t>(std::clamp<std::int64_t>(total - m.opt.recent_window - start, 0, nb))
              : static_cast<std::int32_t>(nb);
      j.heavy_hitters = hh;
      j.page_index = static_cast<std::int32_t>(plan.page_ids.size());
      for (std::int64_t h = 0; h < H; ++h) {
        plan.page_ids.push_back(m.free_pages.back());
        m.free_pages.pop_back();
      }
      plan.compress.push_back(j);
    }
    if (n == 0) continue;
    HexAppendJob a;
    a.request = static_cast<std::int32_t>(i);
    a.residual_page = r.residual;
    const std::int64_t left = total - after * nb;
    a.dst_row = after > before ? 0 : static_cast<std::int32_t>(R);
    a.count = static_cast<std::int32_t>(after > before ? left : n);
    a.src_row = static_cast<std::int32_t>(plan.token_indptr[i] + n - a.count);
    a.keep_scores = after > before ? 0 : 1;
    plan.append.push_back(a);
  }
  // Commit (the pages were taken above; nothing below throws but bad_alloc,
  // which the reserve calls raise before any change).
  for (std::size_t i = 0; i < requests.size(); ++i)
    m.req[static_cast<std::size_t>(requests[i])].pages.reserve(
        m.req[static_cast<std::size_t>(requests[i])].pages.size() + static_cast<std::size_t>(needed));
  std::size_t next = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    Impl::Request& r = m.req[static_cast<std::size_t>(requests[i])];
    const std::int64_t blocks = (r.tokens + new_tokens[i]) / nb - r.tokens / nb;
    for (std::int64_t p = 0; p < blocks * H; ++p) r.pages.push_back(plan.page_ids[next++]);
    r.tokens += new_tokens[i];
  }
  return plan;
}

HexDecodePlan HexPagedCache::plan_decode(const std::vector<std::int32_t>& requests, std::int32_t blocks_per_item,
                                         std::int32_t target_items) const {
  std::vector<std::int32_t> counts;
  for (const std::int32_t id : requests)
    counts.push_back(static_cast<std::int32_t>(impl_->get(id).tokens / impl_->opt.block));
  return plan_decode(requests, counts, blocks_per_item, target_items);
}

HexDecodePlan HexPagedCache::plan_decode(const std::vector<std::int32_t>& requests,
                                         const std::vector<std::int32_t>& block_counts, std::int32_t blocks_per_item,
                                         std::int32_t target_items) const {
  const Impl& m = *impl_;
  require(blocks_per_item >= 0, "blocks per item must be >= 0");
  require(target_items >= 1, "the target number of work items must be >= 1");
  require(block_counts.size() == requests.size(), "one block count per request is needed");
  const std::int64_t nb = m.opt.block;
  std::int64_t total_blocks = 0;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Impl::Request& r = m.get(requests[i]);
    const std::int64_t B = block_counts[i], R = r.tokens % nb;
    require(B >= 0 && B <= r.tokens / nb, "request " + std::to_string(requests[i]) + ": block count out of range");
    require(B + R >= 1, "request " + std::to_string(requests[i]) + " has no tokens to attend");
    total_blocks += B;
  }
  std::int64_t per = blocks_per_item;
  if (per == 0) {  // enough items to fill the device, blocks spread evenly
    const std::int64_t want = std::max<std::int64_t>(1, target_items / m.heads);
    per = std::max<std::int64_t>(1, (total_blocks + want - 1) / want);
  }
  HexDecodePlan plan;
  plan.split_indptr.assign(requests.size() + 1, 0);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Impl::Request& r = m.req[static_cast<std::size_t>(requests[i])];
    const std::int64_t B = block_counts[i], R = r.tokens % nb;
    const std::int64_t splits = std::max<std::int64_t>(1, (B + per - 1) / per);
    plan.residual_rows.push_back(static_cast<std::int32_t>(R));
    plan.residual_page.push_back(r.residual);
    plan.split_indptr[i + 1] = plan.split_indptr[i] + static_cast<std::int32_t>(splits);
    plan.max_splits = std::max(plan.max_splits, static_cast<std::int32_t>(splits));
    for (std::int64_t h = 0; h < m.heads; ++h)
      for (std::int64_t s = 0; s < splits; ++s) {
        HexDecodeItem it;
        it.request = static_cast<std::int32_t>(i);
        it.head = static_cast<std::int32_t>(h);
        it.first_block = static_cast<std::int32_t>(s * per);
        it.blocks = static_cast<std::int32_t>(std::min(per, B - s * per));
        it.with_residual = s == splits - 1 && R > 0 ? 1 : 0;
        it.split = static_cast<std::int32_t>(s);
        plan.items.push_back(it);
      }
  }
  return plan;
}

void HexPagedCache::select_blocks(const std::vector<std::int32_t>& requests,
                                  const std::vector<std::int32_t>& sel_indptr, const std::vector<std::int32_t>& sel,
                                  std::vector<std::int32_t>& indptr, std::vector<std::int32_t>& indices,
                                  std::vector<std::int32_t>& counts) const {
  const Impl& m = *impl_;
  require(sel_indptr.size() == requests.size() + 1 && sel_indptr.front() == 0 &&
              sel_indptr.back() == static_cast<std::int32_t>(sel.size()),
          "the selection's indptr does not match the requests and indices");
  indptr.assign(1, 0);
  indices.clear();
  counts.clear();
  const std::int64_t H = m.heads;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const Impl::Request& r = m.get(requests[i]);
    const std::int64_t B = r.tokens / m.opt.block;
    require(sel_indptr[i] <= sel_indptr[i + 1], "the selection's indptr is not ascending");
    std::int32_t n = 0, last = -1;
    for (std::int32_t k = sel_indptr[i]; k < sel_indptr[i + 1]; ++k) {
      const std::int32_t b = sel[static_cast<std::size_t>(k)];
      require(b > last && b <= B && (b < B || k == sel_indptr[i + 1] - 1), "request " + std::to_string(requests[i]) +
                                                                               ": selected page " + std::to_string(b) +
                                                                               " is out of range or out of order");
      last = b;
      if (b == B) continue;  // the partial page: the residual rows
      for (std::int64_t h = 0; h < H; ++h) indices.push_back(r.pages[static_cast<std::size_t>(b * H + h)]);
      ++n;
    }
    counts.push_back(n);
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
  }
}

void HexPagedCache::page_table(const std::vector<std::int32_t>& requests, std::vector<std::int32_t>& indptr,
                               std::vector<std::int32_t>& indices) const {
  const Impl& m = *impl_;
  indptr.assign(1, 0);
  indices.clear();
  for (const std::int32_t id : requests) {
    const Impl::Request& r = m.get(id);
    indices.insert(indices.end(), r.pages.begin(), r.pages.end());
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
  }
}

std::int32_t HexPagedCache::residual_page(std::int32_t request) const { return impl_->get(request).residual; }
std::int64_t HexPagedCache::tokens(std::int32_t request) const { return impl_->get(request).tokens; }
std::int64_t HexPagedCache::blocks(std::int32_t request) const { return impl_->get(request).tokens / impl_->opt.block; }
std::int64_t HexPagedCache::pages() const { return impl_->pool; }
std::int64_t HexPagedCache::residual_pages() const { return impl_->residual_pool; }
std::int64_t HexPagedCache::free_pages() const { return static_cast<std::int64_t>(impl_->free_pages.size()); }
std::int64_t HexPagedCache::free_residual_pages() const {
  return static_cast<std::int64_t>(impl_->free_residual.size());
}
std::int64_t HexPagedCache::bytes(std::int32_t request) const {
  const Impl& m = *impl_;
  const Impl::Request& r = m.get(request);
  return static_cast<std::int64_t>(r.pages.size()) * m.g.page_bytes() + m.g.residual_bytes(m.heads);
}
const HexPageGeometry& HexPagedCache::geometry() const { return impl_->g; }
const HexOptions& HexPagedCache::options() const { return impl_->opt; }
std::int64_t HexPagedCache::kv_heads() const { return impl_->heads; }
const std::vector<std::int32_t>& HexPagedCache::mask_indices() const { return impl_->mask_indices; }

}  // namespace kvcal::runtime
