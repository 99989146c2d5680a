// The paged HEX flow driven through a backend that runs the kernels (a GPU,
// or the host emulation of CUDA) and compared with the host executor of the
// same plans (HexPagedHost, itself checked against HexLayerCache in
// test_hex_paged.cpp): after every step the backend's block pages equal the
// host's byte for byte (codes, parameters, kept sets, expander entries), the
// residual rows likewise, and attention outputs and heavy-hitter scores agree
// within the tolerances stated below.
//
// A backend provides alloc(bytes) (a buffer with .p, .bytes, as<T>()),
// put/get (host to backend and back), step(layer, plan, k, v, error) and
// decode(layer, plan, page_indptr, page_indices, q_heads, q, scale, out, observe).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvcal/runtime/chess_cuda.h"
#include "kvcal/runtime/hex.h"
#include "kvcal/runtime/hex_cuda.h"
#include "kvcal/runtime/hex_paged.h"
#include "runtime/hex_test_util.h"

namespace kvcal::runtime::flow {

using i64 = std::int64_t;
namespace kc = kvcal::runtime::cuda;

struct Shape {
  std::string method;
  i64 kv_heads, group, head_dim, block;
  std::vector<i64> prefill;  // one request per entry
  int decode_steps;
  std::int32_t per;                 // blocks per decode item (0: the planner's choice)
  double k_scale = 1, v_scale = 1;  // the keys' and values' magnitudes (standard deviations 1 and 0.5 times these)
};

// Output tolerance: both sides compute scores and the online softmax in float
// over the same codes, in different orders (per thread and per split on the
// device, per block on the host) and with different exp implementations
// (expf on the device: 2 ulp); each output is a convex combination of value
// rows, so the error is a few ulps of the largest row magnitude, times the
// log of the number of terms merged. 1e-4 relative to the head's largest
// output (at least 1e-3) is two orders above that and far below any
// indexing or decoding error (a wrong token moves outputs by ~1 / tokens of
// a row's magnitude at these contexts, codes by a quantization step).
constexpr double kOutTol = 1e-4;
// Heavy-hitter scores: sums of softmax weights over steps, abs error per step
// a few ulps of 1.
constexpr double kScoreTol = 1e-5;

// A layer's memory on the backend, sized and filled from the cache: the block
// and residual page pools, the mask's columns.
template <class Backend>
struct BackendLayer {
  using Buffer = decltype(std::declval<Backend&>().alloc(0));
  Buffer pages, residual, mask;
  kc::HexDeviceLayer L;
  BackendLayer(Backend& be, const HexPagedCache& cache)
      : pages(be.alloc(static_cast<std::size_t>(cache.pages() * cache.geometry().page_bytes()))),
        residual(be.alloc(
            static_cast<std::size_t>(cache.residual_pages() * cache.geometry().residual_bytes(cache.kv_heads())))),
        mask(be.alloc(cache.mask_indices().size() * 4)) {
    if (!cache.mask_indices().empty()) be.put(mask.p, cache.mask_indices().data(), mask.bytes);
    L.geometry = cache.geometry();
    L.kv_heads = static_cast<std::int32_t>(cache.kv_heads());
    L.pages = pages.template as<std::uint8_t>();
    L.residual = residual.template as<std::uint8_t>();
    L.mask = mask.template as<std::int32_t>();
    L.pages_count = cache.pages();
    L.residual_count = cache.residual_pages();
  }
};

template <class Backend>
void run_flow(const Shape& s, Backend& be) {
  SCOPED_TRACE(s.method + " H " + std::to_string(s.kv_heads) + " group " + std::to_string(s.group) + " d " +
               std::to_string(s.head_dim) + " block " + std::to_string(s.block));
  std::mt19937_64 rng(11 + s.head_dim + s.group);
  HexOptions o = hex_method(s.method);
  o.block = s.block;
  o.hh_ratio = 0.05;
  o.recent_window = 4;
  const i64 H = s.kv_heads, d = s.head_dim, QH = H * s.group;
  const i64 d1 = o.expander && o.bits != 0 ? std::max<i64>(1, d / 32) : 0;
  std::shared_ptr<const Mask> mask = d1 ? make_mask(s.block, d, d1, 5) : nullptr;
  const auto R = static_cast<std::int32_t>(s.prefill.size());
  i64 max_tokens = 0;
  for (const i64 n : s.prefill) max_tokens = std::max(max_tokens, n + s.decode_steps);
  const i64 pages = R * H * (max_tokens / s.block + 1);
  HexPagedCache cache(H, d, o, mask, pages, R);
  HexPagedHost host(cache);
  const HexPageGeometry& g = cache.geometry();
  double worst = 0;  // the largest output error seen, relative as the tolerance is

  BackendLayer<Backend> layer(be, cache);
  const kc::HexDeviceLayer& L = layer.L;
  auto& page_pool = layer.pages;
  auto& res_pool = layer.residual;
  auto err = be.alloc(4);

  std::vector<std::int32_t> ids;
  for (std::int32_t r = 0; r < R; ++r) ids.push_back(cache.add_request());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::vector<std::uint8_t> got_page(static_cast<std::size_t>(g.page_bytes()));
  std::vector<std::uint8_t> got_res(static_cast<std::size_t>(g.residual_bytes(H)));
  for (int step = 0; step <= s.decode_steps; ++step) {
    std::vector<std::int32_t> counts;
    for (std::int32_t r = 0; r < R; ++r)
      counts.push_back(step == 0 ? static_cast<std::int32_t>(s.prefill[static_cast<std::size_t>(r)]) : 1);
    const HexStepPlan plan = cache.plan_append(ids, counts);
    const i64 rows = plan.token_indptr.back();
    const auto k = random_halves(static_cast<std::size_t>(rows * H * d), rng, s.k_scale, 0.2 * s.k_scale);
    const auto v = random_halves(k.size(), rng, 0.5 * s.v_scale);
    host.run_append(plan, k.data(), v.data());
    auto kd = be.alloc(k.size() * 2), vd = be.alloc(v.size() * 2);
    be.put(kd.p, k.data(), kd.bytes);
    be.put(vd.p, v.data(), vd.bytes);
    be.step(L, plan, kd.template as<half_bits>(), vd.template as<half_bits>(), err.template as<int>());
    std::vector<std::int32_t> indptr, indices;
    cache.page_table(ids, indptr, indices);
    for (const std::int32_t id : indices) {
      be.get(got_page.data(), page_pool.template as<std::uint8_t>() + id * g.page_bytes(), got_page.size());
      ASSERT_EQ(0, std::memcmp(got_page.data(), host.page(id), got_page.size())) << "step " << step << " page " << id;
    }
    const HexDecodePlan dp = cache.plan_decode(ids, s.per, 132 * 4);
    const auto q = random_floats(static_cast<std::size_t>(R * QH * d), rng);
    std::vector<float> want(q.size()), got(q.size());
    host.run_decode(dp, ids, indptr, indices, q.data(), QH, scale, want.data(), true);
    auto qd = be.alloc(q.size() * 4), od = be.alloc(q.size() * 4);
    be.put(qd.p, q.data(), qd.bytes);
    be.decode(L, dp, indptr, indices, static_cast<std::int32_t>(QH), qd.template as<float>(), scale,
              od.template as<float>(), true);
    be.get(got.data(), od.p, od.bytes);
    for (i64 j = 0; j < R * QH; ++j) {
      double err_max = 0, norm = 0;
      for (i64 c = 0; c < d; ++c) {
        err_max = std::max(err_max, std::abs(double(want[j * d + c]) - got[j * d + c]));
        norm = std::max(norm, std::abs(double(want[j * d + c])));
      }
      ASSERT_LE(err_max, kOutTol * std::max(norm, 1e-3)) << "step " << step << " query head " << j;
      worst = std::max(worst, err_max / std::max(norm, 1e-3));
    }
    // Residual pages: rows identical, scores within tolerance.
    const i64 rows_bytes = g.residual_rows_bytes(H);
    for (std::int32_t r = 0; r < R; ++r) {
      const std::int32_t rp = cache.residual_page(ids[r]);
      be.get(got_res.data(), res_pool.template as<std::uint8_t>() + rp * g.residual_bytes(H), got_res.size());
      const i64 live = dp.residual_rows[r];
      for (i64 h = 0; h < H; ++h) {
        const i64 off = h * s.block * d * 2;
        ASSERT_EQ(0,
                  std::memcmp(got_res.data() + off, host.residual(rp) + off, static_cast<std::size_t>(live * d * 2)));
        ASSERT_EQ(0, std::memcmp(got_res.data() + rows_bytes + off, host.residual(rp) + rows_bytes + off,
                                 static_cast<std::size_t>(live * d * 2)));
        const auto* sg = reinterpret_cast<const float*>(got_res.data() + 2 * rows_bytes) + h * s.block;
        const auto* sw = reinterpret_cast<const float*>(host.residual(rp) + 2 * rows_bytes) + h * s.block;
        for (i64 t = 0; t < live; ++t) ASSERT_NEAR(sg[t], sw[t], kScoreTol * (1 + step)) << "row " << t;
      }
    }
    // Keep the two sides on identical scores, so that kept sets stay
    // comparable byte for byte (a float tie broken differently would
    // otherwise diverge them for good).
    for (std::int32_t r = 0; r < R; ++r) {
      const std::int32_t rp = cache.residual_page(ids[r]);
      be.put(res_pool.template as<std::uint8_t>() + rp * g.residual_bytes(H), host.residual(rp),
             static_cast<std::size_t>(g.residual_bytes(H)));
    }
  }
  int flag = 0;
  be.get(&flag, err.p, 4);
  EXPECT_EQ(flag, 0);
  std::printf("[ flow     ] %s G %d d %d: largest output error %.2e of the head's largest output (tolerance %.0e)\n",
              s.method.c_str(), static_cast<int>(s.group), static_cast<int>(d), worst, kOutTol);
}

// CHESS over a HEX cache, end to end on the backend: HEX pages and CHESS
// summaries fed the same keys (CHESS pages = HEX blocks), the selection made
// on the backend, the decode over the selected blocks and the residual only
// (HexPagedCache::select_blocks, plan_decode over their counts). Checked
// against attention computed here in double over exactly those tokens,
// decoded from the host executor's pages (byte-identical to the backend's,
// as run_flow shows): within kOutTol; and some blocks are left out.
template <class Backend>
void run_chess_hex(Backend& be) {
  std::mt19937_64 rng(23);
  const i64 H = 2, group = 4, d = 64, nb = 16, QH = H * group;
  HexOptions o = hex_method("hex4");
  o.block = nb;
  o.recent_window = 2;
  ChessOptions co = chess_preset("aggressive");
  co.page_size = nb;
  co.chunk_pages = 2;
  co.grid_chunks = 2;
  co.recent_pages = 1;
  const auto mask = make_mask(nb, d, 2, 8);
  const std::vector<std::int32_t> prefill = {16 * 9 + 5, 16 * 20, 40};
  const auto R = static_cast<std::int32_t>(prefill.size());
  const i64 pages = R * H * 32;
  HexPagedCache cache(H, d, o, mask, pages, R);
  HexPagedHost host(cache);
  const HexPageGeometry& g = cache.geometry();
  BackendLayer<Backend> layer(be, cache);
  const kc::HexDeviceLayer& L = layer.L;
  const auto D = static_cast<std::int32_t>(H * d);
  const std::size_t cbytes = kc::chess_batch_bytes(R, D, 32, co);
  auto cmem = be.alloc(cbytes);
  const kc::ChessDeviceBatch cb = kc::chess_batch(cmem.p, cbytes, R, D, 32, co);
  auto t_indptr = be.alloc((R + 1) * 4), t_indices = be.alloc(static_cast<std::size_t>(R) * 33 * 4),
       t_last = be.alloc(R * 4), tok_d = be.alloc(R * 4), before_d = be.alloc(R * 4), tip_d = be.alloc((R + 1) * 4);
  const kc::ChessPageTable table{t_indptr.template as<std::int32_t>(), t_indices.template as<std::int32_t>(),
                                 t_last.template as<std::int32_t>()};
  std::vector<std::int32_t> ids, tokens(static_cast<std::size_t>(R), 0);
  for (std::int32_t r = 0; r < R; ++r) ids.push_back(cache.add_request());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto err = be.alloc(4);
  bool left_out = false;
  for (int step = 0; step <= 6; ++step) {
    std::vector<std::int32_t> counts;
    for (std::int32_t r = 0; r < R; ++r) counts.push_back(step == 0 ? prefill[static_cast<std::size_t>(r)] : 1);
    const HexStepPlan plan = cache.plan_append(ids, counts);
    const i64 rows = plan.token_indptr.back();
    // Keys with a per-block offset, so that blocks differ in their relevance.
    auto k = random_halves(static_cast<std::size_t>(rows * H * d), rng, 1.0, 0.0);
    for (std::int32_t r = 0; r < R; ++r)
      for (i64 t = 0; t < counts[static_cast<std::size_t>(r)]; ++t) {
        const i64 block = (tokens[static_cast<std::size_t>(r)] + t) / nb;
        for (i64 c = 0; c < H * d; ++c) {
          auto& h = k[static_cast<std::size_t>((plan.token_indptr[static_cast<std::size_t>(r)] + t) * H * d + c)];
          h = float_to_half(half_to_float(h) + static_cast<float>((block * 7 + c) % 5) - 2.0f);
        }
      }
    const auto v = random_halves(k.size(), rng, 0.5);
    host.run_append(plan, k.data(), v.data());
    auto kd = be.alloc(k.size() * 2), vd = be.alloc(v.size() * 2);
    be.put(kd.p, k.data(), kd.bytes);
    be.put(vd.p, v.data(), vd.bytes);
    be.step(L, plan, kd.template as<half_bits>(), vd.template as<half_bits>(), err.template as<int>());
    be.put(tip_d.p, plan.token_indptr.data(), (R + 1) * 4);
    be.put(before_d.p, tokens.data(), R * 4);
    be.chess_append(cb, kd.template as<half_bits>(), H * d, 0, D, tip_d.template as<std::int32_t>(),
                    before_d.template as<std::int32_t>());
    for (std::int32_t r = 0; r < R; ++r) tokens[static_cast<std::size_t>(r)] += counts[static_cast<std::size_t>(r)];
    be.put(tok_d.p, tokens.data(), R * 4);
    be.chess_select(cb, tok_d.template as<std::int32_t>(), table);
    std::vector<std::int32_t> sel_indptr(static_cast<std::size_t>(R + 1));
    be.get(sel_indptr.data(), t_indptr.p, sel_indptr.size() * 4);
    std::vector<std::int32_t> sel(static_cast<std::size_t>(sel_indptr.back()));
    be.get(sel.data(), t_indices.p, sel.size() * 4);
    std::vector<std::int32_t> indptr, indices, blocks;
    cache.select_blocks(ids, sel_indptr, sel, indptr, indices, blocks);
    for (std::int32_t r = 0; r < R; ++r) left_out |= blocks[static_cast<std::size_t>(r)] < cache.blocks(ids[r]);
    const HexDecodePlan dp = cache.plan_decode(ids, blocks, 2, 64);
    const auto q = random_floats(static_cast<std::size_t>(R * QH * d), rng);
    std::vector<float> got(q.size()), exec(q.size());
    auto qd = be.alloc(q.size() * 4), od = be.alloc(q.size() * 4);
    be.put(qd.p, q.data(), qd.bytes);
    be.decode(L, dp, indptr, indices, static_cast<std::int32_t>(QH), qd.template as<float>(), scale,
              od.template as<float>(), false);
    be.get(got.data(), od.p, od.bytes);
    host.run_decode(dp, ids, indptr, indices, q.data(), QH, scale, exec.data(), false);
    // Independent reference: the selected blocks decoded, the residual rows, a double softmax.
    for (std::int32_t r = 0; r < R; ++r)
      for (i64 h = 0; h < H; ++h) {
        std::vector<double> kk, vv;
        std::vector<float> kb(static_cast<std::size_t>(nb * d)), vb(kb.size());
        for (std::int32_t b = 0; b < blocks[static_cast<std::size_t>(r)]; ++b) {
          const std::int32_t id = indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(r)] + b * H + h)];
          hex_dequantize_block(hex_page_view(g, host.page(id), cache.mask_indices().data()), kb.data(), vb.data());
          kk.insert(kk.end(), kb.begin(), kb.end());
          vv.insert(vv.end(), vb.begin(), vb.end());
        }
        const i64 res_rows = dp.residual_rows[static_cast<std::size_t>(r)];
        const auto* rk = reinterpret_cast<const half_bits*>(host.residual(cache.residual_page(ids[r]))) + h * nb * d;
        const auto* rv =
            reinterpret_cast<const half_bits*>(host.residual(cache.residual_page(ids[r])) + g.residual_rows_bytes(H)) +
            h * nb * d;
        for (i64 x = 0; x < res_rows * d; ++x) {
          kk.push_back(half_to_float(rk[x]));
          vv.push_back(half_to_float(rv[x]));
        }
        const i64 n = static_cast<i64>(kk.size()) / d;
        for (i64 j = 0; j < group; ++j) {
          const float* qj = q.data() + (r * QH + h * group + j) * d;
          std::vector<double> w(static_cast<std::size_t>(n));
          double mx = -1e300, sum = 0;
          for (i64 t = 0; t < n; ++t) {
            double s = 0;
            for (i64 c = 0; c < d; ++c) s += double(qj[c]) * kk[static_cast<std::size_t>(t * d + c)];
            w[static_cast<std::size_t>(t)] = s * scale;
            mx = std::max(mx, w[static_cast<std::size_t>(t)]);
          }
          for (auto& x : w) sum += (x = std::exp(x - mx));
          double err_max = 0, err_exec = 0, norm = 0;
          for (i64 c = 0; c < d; ++c) {
            double o2 = 0;
            for (i64 t = 0; t < n; ++t) o2 += w[static_cast<std::size_t>(t)] * vv[static_cast<std::size_t>(t * d + c)];
            o2 /= sum;
            const std::size_t at = static_cast<std::size_t>((r * QH + h * group + j) * d + c);
            err_max = std::max(err_max, std::abs(o2 - got[at]));
            err_exec = std::max(err_exec, std::abs(o2 - exec[at]));
            norm = std::max(norm, std::abs(o2));
          }
          ASSERT_LE(err_max, kOutTol * std::max(norm, 1e-3)) << "step " << step << " request " << r << " head " << h;
          ASSERT_LE(err_exec, kOutTol * std::max(norm, 1e-3)) << "host executor, step " << step;
        }
      }
  }
  EXPECT_TRUE(left_out);  // the selection did leave blocks out
}

}  // namespace kvcal::runtime::flow
