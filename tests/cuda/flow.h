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
#include <cstring>
#include <random>
#include <string>
#include <vector>

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
  std::int32_t per;  // blocks per decode item (0: the planner's choice)
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

  auto page_pool = be.alloc(static_cast<std::size_t>(pages * g.page_bytes()));
  auto res_pool = be.alloc(static_cast<std::size_t>(R * g.residual_bytes(H)));
  auto mask_dev = be.alloc(cache.mask_indices().size() * 4);
  auto err = be.alloc(4);
  ASSERT_TRUE(page_pool.p && res_pool.p && err.p);
  if (!cache.mask_indices().empty()) be.put(mask_dev.p, cache.mask_indices().data(), mask_dev.bytes);
  kc::HexDeviceLayer L;
  L.geometry = g;
  L.kv_heads = static_cast<std::int32_t>(H);
  L.pages = page_pool.template as<std::uint8_t>();
  L.residual = res_pool.template as<std::uint8_t>();
  L.mask = mask_dev.template as<std::int32_t>();
  L.pages_count = pages;
  L.residual_count = R;

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
    const auto k = random_halves(static_cast<std::size_t>(rows * H * d), rng, 1.0, 0.2);
    const auto v = random_halves(k.size(), rng, 0.5);
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
}

}  // namespace kvcal::runtime::flow
