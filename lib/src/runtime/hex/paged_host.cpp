// HexPagedHost: the paged batch's steps on host memory. Compression runs the
// device codec (page_codec.h) item by item; decode runs each work item of the
// plan with the CPU block kernels into a partial softmax state (running max,
// sum of exponentials, unnormalised output) and merges the splits the way the
// device's flash-decoding merge does. The blocks' products follow the
// options' dot rule (HexOptions::dot) as HexLayerCache does; the device
// decode computes in float32 whatever the rule (hex_cuda.h).
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

struct HexPagedHost::Impl {
  HexPageGeometry g;
  HexOptions opt;
  std::int64_t heads = 0, pages = 0, residual_pages = 0;
  std::vector<std::int32_t> mask;
  std::vector<std::uint8_t> page_pool, residual_pool;

  std::uint8_t* page(std::int32_t id) {
    require(id >= 0 && id < pages, "block page id out of range");
    return page_pool.data() + static_cast<std::size_t>(id) * static_cast<std::size_t>(g.page_bytes());
  }
  std::uint8_t* residual(std::int32_t id) {
    require(id >= 0 && id < residual_pages, "residual page id out of range");
    return residual_pool.data() + static_cast<std::size_t>(id) * static_cast<std::size_t>(g.residual_bytes(heads));
  }
  half_bits* res_k(std::int32_t id, std::int64_t h) {
    return reinterpret_cast<half_bits*>(residual(id)) + h * g.block * g.head_dim;
  }
  half_bits* res_v(std::int32_t id, std::int64_t h) {
    return reinterpret_cast<half_bits*>(residual(id) + g.residual_rows_bytes(heads)) + h * g.block * g.head_dim;
  }
  float* res_scores(std::int32_t id, std::int64_t h) {
    return reinterpret_cast<float*>(residual(id) + 2 * g.residual_rows_bytes(heads)) + h * g.block;
  }
};

HexPagedHost::HexPagedHost(const HexPagedCache& cache) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.g = cache.geometry();
  m.opt = cache.options();
  m.heads = cache.kv_heads();
  m.pages = cache.pages();
  m.residual_pages = cache.residual_pages();
  require(m.pages == 0 || m.g.page_bytes() <= std::numeric_limits<std::int64_t>::max() / m.pages,
          "block page pool too large");
  m.mask = cache.mask_indices();
  m.page_pool.assign(static_cast<std::size_t>(m.pages * m.g.page_bytes()), 0);
  m.residual_pool.assign(static_cast<std::size_t>(m.residual_pages * m.g.residual_bytes(m.heads)), 0);
}
HexPagedHost::~HexPagedHost() = default;

const std::uint8_t* HexPagedHost::page(std::int32_t id) const { return impl_->page(id); }
const std::uint8_t* HexPagedHost::residual(std::int32_t id) const { return impl_->residual(id); }
std::uint8_t* HexPagedHost::residual(std::int32_t id) { return impl_->residual(id); }

void HexPagedHost::run_append(const HexStepPlan& plan, const half_bits* k, const half_bits* v) {
  Impl& m = *impl_;
  const std::int32_t nb = m.g.block, d = m.g.head_dim;
  const std::int64_t H = m.heads, row = H * d;
  // Every block first: its rows are read from residual pages that the
  // append jobs then overwrite. Checked before any page is written.
  const auto rows_of = [&](const HexCompressJob& j, std::int64_t h) {
    return codec::Rows{m.res_k(j.residual_page, h),
                       m.res_v(j.residual_page, h),
                       k + j.src_row * row + h * d,
                       v + j.src_row * row + h * d,
                       d,
                       row,
                       j.from_residual};
  };
  for (const HexCompressJob& j : plan.compress) {
    require(j.from_residual >= 0 && j.from_residual <= nb && j.page_index >= 0 &&
                j.page_index + H <= static_cast<std::int64_t>(plan.page_ids.size()),
            "malformed compress job");
    for (std::int64_t h = 0; h < H; ++h) {
      const codec::Rows r = rows_of(j, h);
      for (std::int32_t t = 0; t < nb; ++t)
        if (!detail::finite_halves(r.k(t), d) || !detail::finite_halves(r.v(t), d))
          fail("non-finite key or value (request " + std::to_string(j.request) + ", KV head " + std::to_string(h) +
               ", block row " + std::to_string(t) + ")");
    }
  }
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(nb));
  std::vector<float> score(static_cast<std::size_t>(nb));
  std::vector<std::int32_t> qtok(static_cast<std::size_t>(nb));
  for (const HexCompressJob& j : plan.compress) {
    for (std::int32_t t = 0; t < nb; ++t) {  // the layer's score: the sum over KV heads, head order
      float s = 0.0f;
      if (t < j.from_residual)
        for (std::int64_t h = 0; h < H; ++h) s += m.res_scores(j.residual_page, h)[t];
      score[static_cast<std::size_t>(t)] = s;
    }
    for (std::int32_t t = 0; t < nb; ++t)
      keep[static_cast<std::size_t>(t)] = codec::keep_row(
          t, nb, j.heavy_hitters, j.recent_from, [&](std::int32_t u) { return score[static_cast<std::size_t>(u)]; });
    for (std::int64_t h = 0; h < H; ++h) {
      codec::Block b;
      b.g = m.g;
      b.rows = rows_of(j, h);
      b.mask = m.mask.data();
      b.page = m.page(plan.page_ids[static_cast<std::size_t>(j.page_index + h)]);
      b.qtok = qtok.data();
      codec::compress_serial(b, keep.data());
    }
  }
  for (const HexAppendJob& a : plan.append) {
    require(a.dst_row >= 0 && a.count >= 0 && a.dst_row + a.count <= nb, "malformed append job");
    for (std::int64_t h = 0; h < H; ++h) {
      float* sc = m.res_scores(a.residual_page, h);
      if (!a.keep_scores) std::fill(sc, sc + nb, 0.0f);
      for (std::int32_t i = 0; i < a.count; ++i) {
        std::memcpy(m.res_k(a.residual_page, h) + (a.dst_row + i) * d, k + (a.src_row + i) * row + h * d,
                    static_cast<std::size_t>(d) * 2);
        std::memcpy(m.res_v(a.residual_page, h) + (a.dst_row + i) * d, v + (a.src_row + i) * row + h * d,
                    static_cast<std::size_t>(d) * 2);
        sc[a.dst_row + i] = 0.0f;
      }
    }
  }
}

void HexPagedHost::run_decode(const HexDecodePlan& plan, const std::vector<std::int32_t>& requests,
                              const std::vector<std::int32_t>& indptr, const std::vector<std::int32_t>& indices,
                              const float* q, std::int64_t q_heads, float scale, float* out, bool observe) {
  Impl& m = *impl_;
  const std::int64_t H = m.heads, d = m.g.head_dim, nb = m.g.block;
  require(q_heads >= H && q_heads % H == 0, "query heads must be a multiple of KV heads");
  const auto nr = static_cast<std::int64_t>(requests.size());
  require(static_cast<std::int64_t>(plan.residual_rows.size()) == nr &&
              static_cast<std::int64_t>(plan.residual_page.size()) == nr &&
              static_cast<std::int64_t>(plan.split_indptr.size()) == nr + 1 &&
              static_cast<std::int64_t>(indptr.size()) == nr + 1,
          "the decode plan or page table does not match the request list");
  const std::int64_t group = q_heads / H, slots = plan.split_indptr.back();
  // Partials per (slot, query head): max, sum of exponentials, unnormalised output.
  std::vector<float> pm(static_cast<std::size_t>(slots * q_heads), -std::numeric_limits<float>::infinity());
  std::vector<float> pl(pm.size(), 0.0f);
  std::vector<float> pacc(static_cast<std::size_t>(slots * q_heads * d), 0.0f);
  std::vector<float> res_s(static_cast<std::size_t>(nr * q_heads * nb), 0.0f);  // residual rows' raw scores
  std::vector<float> s;
  for (const HexDecodeItem& it : plan.items) {
    const std::int64_t i = it.request, h = it.head;
    require(i >= 0 && i < nr && h >= 0 && h < H && it.split >= 0 &&
                it.split < plan.split_indptr[i + 1] - plan.split_indptr[i] && it.first_block >= 0 && it.blocks >= 0 &&
                (std::int64_t{it.first_block} + it.blocks) * H <= indptr[i + 1] - indptr[i],
            "malformed decode item");
    const std::int64_t R = it.with_residual ? plan.residual_rows[static_cast<std::size_t>(i)] : 0;
    const std::int64_t n = std::int64_t{it.blocks} * nb + R;
    if (n == 0) continue;
    const float* qh = q + (i * q_heads + h * group) * d;
    s.assign(static_cast<std::size_t>(group * n), 0.0f);
    const auto view = [&](std::int64_t b) {
      const std::int32_t id = indices[static_cast<std::size_t>(indptr[i] + (it.first_block + b) * H + h)];
      return hex_page_view(m.g, m.page(id), m.mask.data());
    };
    HexBlockView res;  // the residual rows as an all-kept fp16 block
    if (R > 0) {
      const std::int32_t rp = plan.residual_page[static_cast<std::size_t>(i)];
      res.tokens = res.kept_rows = static_cast<std::int32_t>(R);
      res.head_dim = static_cast<std::int32_t>(d);
      res.k_kept = m.res_k(rp, h);
      res.v_kept = m.res_v(rp, h);
    }
    for (std::int64_t b = 0; b < it.blocks; ++b)
      hex_block_scores(view(b), qh, group, d, scale, s.data() + b * nb, n, m.opt.dot);
    if (R > 0) hex_block_scores(res, qh, group, d, scale, s.data() + it.blocks * nb, n);
    const std::size_t slot = static_cast<std::size_t>(plan.split_indptr[i] + it.split);
    for (std::int64_t j = 0; j < group; ++j) {
      float* sj = s.data() + j * n;
      const std::size_t at = slot * static_cast<std::size_t>(q_heads) + static_cast<std::size_t>(h * group + j);
      for (std::int64_t t = 0; t < R; ++t)
        res_s[static_cast<std::size_t>((i * q_heads + h * group + j) * nb + t)] = sj[it.blocks * nb + t];
      float mx = sj[0];
      for (std::int64_t t = 1; t < n; ++t) mx = std::max(mx, sj[t]);
      float sum = 0.0f;
      for (std::int64_t t = 0; t < n; ++t) sum += (sj[t] = std::exp(sj[t] - mx));
      pm[at] = mx;
      pl[at] = sum;
    }
    float* acc = pacc.data() + (slot * q_heads + h * group) * d;
    for (std::int64_t b = 0; b < it.blocks; ++b)
      hex_block_accumulate(view(b), s.data() + b * nb, group, n, acc, d, m.opt.dot);
    if (R > 0) hex_block_accumulate(res, s.data() + it.blocks * nb, group, n, acc, d);
  }
  // Merge the splits of each query head.
  for (std::int64_t i = 0; i < nr; ++i)
    for (std::int64_t j = 0; j < q_heads; ++j) {
      const std::int64_t s0 = plan.split_indptr[i], s1 = plan.split_indptr[i + 1];
      float mx = -std::numeric_limits<float>::infinity();
      for (std::int64_t sl = s0; sl < s1; ++sl) mx = std::max(mx, pm[static_cast<std::size_t>(sl * q_heads + j)]);
      float sum = 0.0f;
      float* o = out + (i * q_heads + j) * d;
      std::fill(o, o + d, 0.0f);
      for (std::int64_t sl = s0; sl < s1; ++sl) {
        const float l = pl[static_cast<std::size_t>(sl * q_heads + j)];
        if (l == 0.0f) continue;  // an empty split
        const float w = std::exp(pm[static_cast<std::size_t>(sl * q_heads + j)] - mx);
        sum += l * w;
        const float* a = pacc.data() + (sl * q_heads + j) * d;
        for (std::int64_t c = 0; c < d; ++c) o[c] += w * a[c];
      }
      const float inv = 1.0f / sum;
      for (std::int64_t c = 0; c < d; ++c) o[c] *= inv;
      if (!observe) continue;
      // The residual rows' weights, summed over the query group into their KV head's scores.
      const std::int64_t R = plan.residual_rows[static_cast<std::size_t>(i)];
      float* sc = m.res_scores(plan.residual_page[static_cast<std::size_t>(i)], j / group);
      for (std::int64_t t = 0; t < R; ++t)
        sc[t] += std::exp(res_s[static_cast<std::size_t>((i * q_heads + j) * nb + t)] - mx) / sum;
    }
}

}  // namespace kvcal::runtime
