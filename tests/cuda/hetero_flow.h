// The HeteroCache kernels' scenarios, driven through a backend (a GPU through
// hetero_cuda.h, or the host emulation of CUDA) and compared with hetero.h's
// CPU reference: top-k sets (ties, signed zeros, rows of 1 to 200K tokens),
// drift monitors step by step (overlaps, window medians, drift decisions,
// base sets), satellites' fetch lists, and the gather of K/V rows from host
// memory (bit-identical).
//
// A backend provides alloc(bytes) (.p, .bytes), host_alloc(bytes) (host
// memory the kernels can read: pinned and mapped on a GPU), put/get, and
// top_k(rows, k, max_k, out, len), drift_init(state, rows),
// drift_step(state, rows), satellites(state, rows, sats, when_drifted),
// gather(lists) taking device pointers.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvcal/runtime/hetero.h"
#include "kvcal/runtime/hetero_cuda.h"

namespace kvcal::runtime::hetero_flow {

namespace kc = kvcal::runtime::cuda;

// Host rows uploaded to the backend, with the device arrays of pointers and lengths.
template <class Backend>
struct DeviceRows {
  using Buffer = decltype(std::declval<Backend&>().alloc(0));
  std::vector<Buffer> rows;
  Buffer ptrs, lens;
  kc::AttentionRows view;
  DeviceRows(Backend& be, const std::vector<std::vector<float>>& data)
      : ptrs(be.alloc(data.size() * sizeof(float*))), lens(be.alloc(data.size() * 4)) {
    std::vector<const float*> p;
    std::vector<std::int32_t> n;
    for (const auto& r : data) {
      rows.push_back(be.alloc(std::max<std::size_t>(r.size(), 1) * 4));
      be.put(rows.back().p, r.data(), r.size() * 4);
      p.push_back(static_cast<const float*>(rows.back().p));
      n.push_back(static_cast<std::int32_t>(r.size()));
    }
    be.put(ptrs.p, p.data(), p.size() * sizeof(float*));
    be.put(lens.p, n.data(), n.size() * 4);
    view = kc::AttentionRows{static_cast<const float* const*>(ptrs.p), static_cast<const std::int32_t*>(lens.p),
                             static_cast<std::int32_t>(data.size())};
  }
};

template <class Backend>
void top_k(Backend& be) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> small(-3, 3);
  const auto row = [&](std::int32_t n, int kind) {
    std::vector<float> r(static_cast<std::size_t>(n));
    for (auto& x : r) {
      if (kind == 0) x = u(rng);                          // distinct
      if (kind == 1) x = static_cast<float>(small(rng));  // many ties
      if (kind == 2) x = small(rng) > 0 ? 0.0f : -0.0f;   // signed zeros: all tie
      if (kind == 3) x = std::exp(5 * u(rng));            // attention-like, positive
    }
    return r;
  };
  for (const std::int32_t n : {1, 2, 31, 256, 257, 1000, 200000}) {
    std::vector<std::vector<float>> data;
    std::vector<std::int32_t> k;
    if (n < 200000 || !be.emulated) {
      for (int kind = 0; kind < 4; ++kind)
        for (const std::int32_t kk : {0, 1, 7, n - 1, n, n + 5}) {
          data.push_back(row(n, kind));
          k.push_back(std::max(kk, 0));
        }
    } else {  // long rows cost the emulation two barriers per 2,048 entries: a few
      data.push_back(row(n, 1));
      k.push_back(2048);
      data.push_back(row(n, 3));
      k.push_back(n - 1);
    }
    const std::int32_t max_k = *std::max_element(k.begin(), k.end());
    DeviceRows<Backend> rows(be, data);
    auto kd = be.alloc(k.size() * 4), out = be.alloc(k.size() * std::max(max_k, 1) * 4), lend = be.alloc(k.size() * 4);
    be.put(kd.p, k.data(), k.size() * 4);
    be.top_k(rows.view, static_cast<const std::int32_t*>(kd.p), max_k, static_cast<std::int32_t*>(out.p),
             static_cast<std::int32_t*>(lend.p));
    std::vector<std::int32_t> got(k.size() * std::max(max_k, 1)), len(k.size());
    be.get(got.data(), out.p, got.size() * 4);
    be.get(len.data(), lend.p, len.size() * 4);
    for (std::size_t i = 0; i < data.size(); ++i) {
      const auto want = top_indices(data[i].data(), n, k[i]);
      ASSERT_EQ(len[i], static_cast<std::int32_t>(want.size())) << "n " << n << " row " << i;
      ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin() + static_cast<std::ptrdiff_t>(i * max_k)))
          << "n " << n << " row " << i << " k " << k[i];
    }
  }
}

// Attention rows of growing length whose 16 heavy positions (the top-16 of
// every row) move at steps 9 and 17 for pivots 0 and 1 (pivot 2 keeps its
// own): the windows holding a move drift, the others do not.
inline std::vector<float> attention(std::int32_t n, int step, int pivot, std::mt19937_64& rng) {
  std::vector<float> r(static_cast<std::size_t>(n));
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& x : r) x = u(rng);
  const int phase = pivot == 2 ? 0 : (step < 9 ? 0 : (step < 17 ? 1 : 2));
  for (int j = 0; j < 16; ++j) r[static_cast<std::size_t>((37 * j + 101 * phase + 13 * pivot) % 300)] = 4.0f + j;
  return r;
}

template <class Backend>
void drift(Backend& be) {
  const std::int32_t P = 3, L = 16, W = 4;
  const double tau = 0.6;
  std::mt19937_64 rng(9);
  const std::size_t bytes = kc::drift_state_bytes(P, L, W);
  auto mem = be.alloc(bytes);
  const kc::DriftState s = kc::drift_state(mem.p, bytes, P, L, W, tau);
  std::vector<DriftMonitor> ref;
  for (int p = 0; p < P; ++p) ref.emplace_back(L, W, tau);
  std::vector<std::vector<float>> pre;
  for (int p = 0; p < P; ++p) pre.push_back(attention(300, 0, p, rng));
  DeviceRows<Backend> pre_rows(be, pre);
  be.drift_init(s, pre_rows.view);
  for (int p = 0; p < P; ++p) ref[static_cast<std::size_t>(p)].init(pre[static_cast<std::size_t>(p)].data(), 300);
  // Satellites: pivot 0 has two (l_s 5 and 40), pivot 2 one (l_s 400 > n: all).
  const std::vector<std::int32_t> pivot_of = {0, 0, 2}, ks = {5, 40, 400};
  const std::int32_t max_k = 400, S = 3;
  auto pod = be.alloc(S * 4), kd = be.alloc(S * 4), tok = be.alloc(S * max_k * 4), lend = be.alloc(S * 4);
  be.put(pod.p, pivot_of.data(), S * 4);
  be.put(kd.p, ks.data(), S * 4);
  const kc::Satellites sats{static_cast<const std::int32_t*>(pod.p), static_cast<const std::int32_t*>(kd.p), S, max_k,
                            static_cast<std::int32_t*>(tok.p),       static_cast<std::int32_t*>(lend.p)};
  std::vector<kc::DriftResult> res(P);
  std::vector<std::int32_t> base(static_cast<std::size_t>(P * L)), base_len(P), sat_tokens(S * max_k), sat_len(S);
  int drifts = 0, checks = 0;
  for (int step = 1; step <= 24; ++step) {
    std::vector<std::vector<float>> data;
    const std::int32_t n = 300 + step;
    for (int p = 0; p < P; ++p) data.push_back(attention(n, step, p, rng));
    DeviceRows<Backend> rows(be, data);
    be.drift_step(s, rows.view);
    be.satellites(s, rows.view, sats, true);
    be.get(res.data(), s.result, P * sizeof(kc::DriftResult));
    be.get(base.data(), s.base, base.size() * 4);
    be.get(base_len.data(), s.base_len, P * 4);
    be.get(sat_tokens.data(), tok.p, sat_tokens.size() * 4);
    be.get(sat_len.data(), lend.p, S * 4);
    for (int p = 0; p < P; ++p) {
      DriftMonitor& m = ref[static_cast<std::size_t>(p)];
      const DriftMonitor::Step want = m.step(data[static_cast<std::size_t>(p)].data(), n);
      const kc::DriftResult& got = res[static_cast<std::size_t>(p)];
      ASSERT_EQ(got.overlap, want.overlap) << "step " << step << " pivot " << p;
      ASSERT_EQ(got.checked != 0, want.checked);
      ASSERT_EQ(got.median, want.median);
      ASSERT_EQ(got.drift != 0, want.drift);
      ASSERT_EQ(got.steps, m.steps());
      ASSERT_EQ(got.drifts, m.drifts());
      ASSERT_EQ(base_len[static_cast<std::size_t>(p)], static_cast<std::int32_t>(m.base().size()));
      ASSERT_TRUE(std::equal(m.base().begin(), m.base().end(), base.begin() + p * L));
      drifts += got.drift;
      checks += got.checked;
    }
    for (int i = 0; i < S; ++i) {
      const int p = pivot_of[static_cast<std::size_t>(i)];
      if (!res[static_cast<std::size_t>(p)].drift) {
        ASSERT_EQ(sat_len[static_cast<std::size_t>(i)], 0);
        continue;
      }
      const auto want = top_indices(data[static_cast<std::size_t>(p)].data(), n, ks[static_cast<std::size_t>(i)]);
      ASSERT_EQ(sat_len[static_cast<std::size_t>(i)], static_cast<std::int32_t>(want.size()));
      ASSERT_TRUE(std::equal(want.begin(), want.end(), sat_tokens.begin() + i * max_k));
    }
  }
  EXPECT_EQ(checks, P * 24 / W);
  EXPECT_EQ(drifts, 4);  // pivots 0 and 1 at the windows ending at steps 12 and 20
}

// One gather of three lists (37 rows, none, 17) of max_k rows of d halves,
// host rows `stride` halves apart.
template <class Backend>
void gather_shape(Backend& be, std::int32_t d, std::int64_t stride, std::int32_t max_k) {
  SCOPED_TRACE("head_dim " + std::to_string(d) + " stride " + std::to_string(stride));
  std::mt19937_64 rng(2);
  const std::int32_t tokens = 500, lists = 3;
  std::uniform_int_distribution<int> bits(0, 0x7bff);
  using HostBuffer = decltype(be.host_alloc(0));
  using Buffer = decltype(be.alloc(0));
  std::vector<HostBuffer> hk, hv;
  std::vector<Buffer> dk, dv;
  std::vector<const half_bits*> hkp, hvp;
  std::vector<half_bits*> dkp, dvp;
  for (int i = 0; i < lists; ++i) {
    hk.push_back(be.host_alloc(static_cast<std::size_t>(tokens * stride * 2)));
    hv.push_back(be.host_alloc(static_cast<std::size_t>(tokens * stride * 2)));
    for (std::int64_t j = 0; j < tokens * stride; ++j) {
      static_cast<half_bits*>(hk.back().p)[j] = static_cast<half_bits>(bits(rng));
      static_cast<half_bits*>(hv.back().p)[j] = static_cast<half_bits>(bits(rng));
    }
    dk.push_back(be.alloc(static_cast<std::size_t>(max_k * d * 2)));
    dv.push_back(be.alloc(static_cast<std::size_t>(max_k * d * 2)));
    hkp.push_back(static_cast<const half_bits*>(hk.back().p));
    hvp.push_back(static_cast<const half_bits*>(hv.back().p));
    dkp.push_back(static_cast<half_bits*>(dk.back().p));
    dvp.push_back(static_cast<half_bits*>(dv.back().p));
  }
  std::vector<std::int32_t> lens = {std::min(37, max_k), 0, std::min(17, max_k)},
                            tok(static_cast<std::size_t>(lists * max_k));
  std::uniform_int_distribution<int> pick(0, tokens - 1);
  for (auto& t : tok) t = pick(rng);
  auto a_hk = be.alloc(lists * sizeof(void*)), a_hv = be.alloc(lists * sizeof(void*));
  auto a_dk = be.alloc(lists * sizeof(void*)), a_dv = be.alloc(lists * sizeof(void*));
  auto a_tok = be.alloc(tok.size() * 4), a_len = be.alloc(lists * 4);
  be.put(a_hk.p, hkp.data(), lists * sizeof(void*));
  be.put(a_hv.p, hvp.data(), lists * sizeof(void*));
  be.put(a_dk.p, dkp.data(), lists * sizeof(void*));
  be.put(a_dv.p, dvp.data(), lists * sizeof(void*));
  be.put(a_tok.p, tok.data(), tok.size() * 4);
  be.put(a_len.p, lens.data(), lists * 4);
  const kc::GatherLists g{static_cast<const half_bits* const*>(a_hk.p),
                          static_cast<const half_bits* const*>(a_hv.p),
                          static_cast<half_bits* const*>(a_dk.p),
                          static_cast<half_bits* const*>(a_dv.p),
                          static_cast<const std::int32_t*>(a_tok.p),
                          static_cast<const std::int32_t*>(a_len.p),
                          lists,
                          max_k,
                          d,
                          stride};
  be.gather(g);
  std::vector<half_bits> gk(static_cast<std::size_t>(max_k * d)), gv(gk.size());
  for (int i = 0; i < lists; ++i) {
    be.get(gk.data(), dk[static_cast<std::size_t>(i)].p, gk.size() * 2);
    be.get(gv.data(), dv[static_cast<std::size_t>(i)].p, gv.size() * 2);
    for (int t = 0; t < lens[static_cast<std::size_t>(i)]; ++t)
      for (int c = 0; c < d; ++c) {
        const std::size_t src = static_cast<std::size_t>(tok[static_cast<std::size_t>(i * max_k + t)] * stride + c);
        ASSERT_EQ(gk[static_cast<std::size_t>(t * d + c)], hkp[static_cast<std::size_t>(i)][src]) << i << " " << t;
        ASSERT_EQ(gv[static_cast<std::size_t>(t * d + c)], hvp[static_cast<std::size_t>(i)][src]) << i << " " << t;
      }
  }
}

// Rows that move as 16-byte pieces (head_dim and stride multiples of 8:
// within one block's loads, and over several rounds of them) and rows that
// move a half at a time (head_dim 36, an odd stride).
template <class Backend>
void gather(Backend& be) {
  gather_shape(be, 64, 128, 37);  // host rows interleave something else
  gather_shape(be, 256, 256, 40);
  gather_shape(be, 36, 37, 37);
}

}  // namespace kvcal::runtime::hetero_flow
