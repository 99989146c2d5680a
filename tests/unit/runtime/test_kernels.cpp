// The HEX CPU kernels (runtime/hex/kernels_cpu.h) and the bulk fp16
// conversions (kvcal/core/half.h) on every SIMD target compiled in that this
// CPU supports, each forced in turn, against references written here: codes
// extracted bit by bit, sums in double, binary16 decoded with ldexp.
//
// This test needs only Google Highway and GoogleTest (it compiles the kernel
// sources itself), so that a cross-compiled build of it runs under emulation
// (scripts/test_emulated.sh: qemu-aarch64, qemu-x86_64 -cpu Westmere).
// AVX3_DL (AVX-512 with VNNI, VBMI2, VPOPCNTDQ) is one of the compiled
// targets; Highway leaves it out unless asked before its first include.
#ifndef HWY_WANT_AVX3_DL
#define HWY_WANT_AVX3_DL 1
#endif
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <hwy/targets.h>

#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "kvcal/core/half.h"
#include "runtime/hex/entries_cpu.h"
#include "runtime/hex/kernels_cpu.h"
#include "runtime/hex/key_side.h"

namespace kvcal::runtime::detail {
namespace {

using i64 = std::int64_t;

// Code c of a packed row, one bit at a time (little-endian bit stream).
unsigned ref_code(const std::uint8_t* row, i64 c, int bits) {
  unsigned v = 0;
  for (int k = 0; k < bits; ++k) {
    const i64 bit = c * bits + k;
    v |= static_cast<unsigned>((row[bit / 8] >> (bit % 8)) & 1u) << k;
  }
  return v;
}

// Slot of channel c, from the layout rule in kernels_cpu.h.
i64 ref_slot(int bits, i64 dim, i64 c) {
  if (bits == 4 && dim % 2 == 0) return (c % 2) * (dim / 2) + c / 2;
  if (bits == 2 && dim % 4 == 0) return (c % 4) * (dim / 4) + c / 4;
  if (bits == 3 && dim % 8 == 0) return (c % 8) * (dim / 8) + c / 8;
  return c;
}

double ref_half(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double s = (h & 0x8000u) ? -1.0 : 1.0;
  if (e == 0x1f) return m ? std::numeric_limits<double>::quiet_NaN() : s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(static_cast<double>(m), -24);
  return s * std::ldexp(static_cast<double>(1024 + m), e - 25);
}

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Runs body once per target, with the dispatch forced to it; on AVX2 where
// the CPU has AVX-VNNI and on AVX3 where it has AVX-512 VNNI, twice: with the
// target's kernels (PMADDUBSW) and with the VPDPBUSD ones for the integer
// code kernels.
template <class F>
void on_every_target(F body) {
  const auto targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  const bool vnni_before = set_avx_vnni(false);
  for (const std::int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    for (const bool vnni : {false, true}) {
      if (vnni && !vnni_kernels_for(target)) continue;
      set_avx_vnni(vnni);
      SCOPED_TRACE(std::string("target ") + hwy::TargetName(target) + (vnni ? " with VPDPBUSD" : ""));
      ASSERT_STREQ(kernel_target(), hwy::TargetName(target));
      ASSERT_EQ(avx_vnni_active(), vnni);
      body();
    }
  }
  set_avx_vnni(vnni_before);
  hwy::SetSupportedTargetsForTest(0);
}

TEST(HexKernels, TargetsIncludeTheHostsBest) {
  const auto targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  std::string names;
  for (const auto t : targets) names += std::string(hwy::TargetName(t)) + " ";
  if (avx_vnni_available()) names += "(AVX2 also with AVX-VNNI) ";
  if (avx512_vnni_available()) names += "(AVX3 also with AVX-512 VNNI)";
  std::printf("SIMD targets tested on this CPU: %s\n", names.c_str());
  EXPECT_STREQ(kernel_target(), hwy::TargetName(targets.front()));
}

// The VPDPBUSD passes stand in for AVX2's integer kernels (AVX-VNNI) and
// AVX3's (AVX-512 VNNI) only: on every other target they stay out whatever
// the setting.
TEST(HexKernels, AvxVnniOnlyWhereTheDispatchChoseAvx2OrAvx3) {
  const auto targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  const bool before = set_avx_vnni(true);
  for (const std::int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(std::string("target ") + hwy::TargetName(target));
    const bool expected =
        (target == HWY_AVX2 && avx_vnni_available()) || (target == HWY_AVX3 && avx512_vnni_available());
    EXPECT_EQ(avx_vnni_active(), expected);
    EXPECT_EQ(vnni_kernels(), !expected            ? VnniKernels::kNone
                              : target == HWY_AVX2 ? VnniKernels::kAvx2
                                                   : VnniKernels::kAvx3);
    set_avx_vnni(false);
    EXPECT_FALSE(avx_vnni_active());
    set_avx_vnni(true);
  }
  hwy::SetSupportedTargetsForTest(0);
  set_avx_vnni(before);
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX2) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // The cpuid bit itself (leaf 7, subleaf 1, EAX bit 4), read here apart.
  // (Builds without the AVX2 target -- -march=native on an AVX-512 host --
  // or with sanitizers compile no AVX-VNNI kernels: unavailable there.)
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool cpu = __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 4)) != 0;
  EXPECT_EQ(avx_vnni_available(), cpu);
#endif
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX3) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
  // And AVX512_VNNI (leaf 7, subleaf 0, ECX bit 11), for the AVX3 pass.
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  const bool cpu512 = __get_cpuid_count(7, 0, &a7, &b7, &c7, &d7) != 0 && (c7 & (1u << 11)) != 0;
  EXPECT_EQ(avx512_vnni_available(), cpu512);
#endif
}

TEST(HexKernels, CodeScoresAndAccumulateMatchReference) {
  on_every_target([] {
    std::mt19937_64 rng(0x6b65726e);
    std::uniform_int_distribution<int> byte(0, 255);
    std::normal_distribution<float> g(0.0f, 1.0f);
    // Widths: 1 and odd (channel order), 4/6/12 (short runs, scalar tails),
    // 64/128 (vector loops), 130/132 (vector loops and tails); for 3 bits
    // 8/24/40 (groups in 128- and 256-bit vectors and tails), 192/200 (a
    // 512-bit vector and a tail).
    for (const i64 dim : {1, 3, 4, 6, 7, 8, 12, 24, 40, 64, 128, 130, 132, 192, 200})
      for (const int bits : {2, 3, 4})
        for (const i64 nq : {1, 2, 3, 4, 5, 8})
          for (const i64 rows : {1, 7, 33}) {
            SCOPED_TRACE("dim " + std::to_string(dim) + " bits " + std::to_string(bits) + " nq " + std::to_string(nq) +
                         " rows " + std::to_string(rows));
            const i64 rb = packed_bytes(dim, bits) + (rows % 2);  // a row stride wider than the row, sometimes
            std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * rb));
            for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
            const i64 ws = dim + 3, os = rows + 2;
            std::vector<float> w(static_cast<std::size_t>(nq * ws)), out(static_cast<std::size_t>(nq * os), -7.0f);
            for (auto& x : w) x = g(rng);
            code_scores(codes.data(), rows, rb, bits, dim, w.data(), nq, ws, out.data(), os);
            for (i64 j = 0; j < nq; ++j) {
              for (i64 r = 0; r < rows; ++r) {
                double s = 0, mag = 0;
                for (i64 c = 0; c < dim; ++c) {
                  const double term =
                      static_cast<double>(w[static_cast<std::size_t>(j * ws + ref_slot(bits, dim, c))]) *
                      ref_code(codes.data() + r * rb, c, bits);
                  s += term;
                  mag += std::fabs(term);
                }
                ASSERT_NEAR(out[static_cast<std::size_t>(j * os + r)], s, 1e-5 * mag + 1e-6)
                    << "q " << j << " row " << r;
              }
              for (i64 r = rows; r < os; ++r) ASSERT_EQ(out[static_cast<std::size_t>(j * os + r)], -7.0f);
            }
            // acc_j[slot] += sum_r a_jr code_r(slot), on top of what acc held.
            const i64 as = rows + 1, cs = dim + 2;
            std::vector<float> a(static_cast<std::size_t>(nq * as)), acc(static_cast<std::size_t>(nq * cs));
            for (auto& x : a) x = g(rng);
            for (auto& x : acc) x = g(rng);
            const auto acc0 = acc;
            code_accumulate(codes.data(), rows, rb, bits, dim, a.data(), nq, as, acc.data(), cs);
            for (i64 j = 0; j < nq; ++j) {
              for (i64 c = 0; c < dim; ++c) {
                const auto slot = static_cast<std::size_t>(j * cs + ref_slot(bits, dim, c));
                double s = acc0[slot], mag = std::fabs(acc0[slot]);
                for (i64 r = 0; r < rows; ++r) {
                  const double term = static_cast<double>(a[static_cast<std::size_t>(j * as + r)]) *
                                      ref_code(codes.data() + r * rb, c, bits);
                  s += term;
                  mag += std::fabs(term);
                }
                ASSERT_NEAR(acc[slot], s, 1e-5 * mag + 1e-6) << "q " << j << " channel " << c;
              }
              for (i64 c = dim; c < cs; ++c)
                ASSERT_EQ(acc[static_cast<std::size_t>(j * cs + c)], acc0[static_cast<std::size_t>(j * cs + c)]);
            }
            // The library's own scalar reference agrees (it is the contract the CUDA kernels are held to).
            std::vector<float> ref(out.size(), -7.0f);
            code_scores_reference(codes.data(), rows, rb, bits, dim, w.data(), nq, ws, ref.data(), os);
            for (std::size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-4 * (1 + std::fabs(ref[i])));
          }
  });
}

// The slot-to-channel step of decode.
TEST(HexKernels, AddSlotsIsExact) {
  on_every_target([] {
    std::mt19937_64 rng(0x736c6f74);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (const i64 dim : {1, 7, 8, 12, 64, 128, 200})
      for (const int bits : {2, 3, 4}) {
        SCOPED_TRACE("dim " + std::to_string(dim) + " bits " + std::to_string(bits));
        const Slots sl(bits, dim);
        std::vector<float> acc(static_cast<std::size_t>(dim)), out(static_cast<std::size_t>(dim + 1));
        for (auto& x : acc) x = g(rng);
        for (auto& x : out) x = g(rng);
        const auto out0 = out;
        const float bias = g(rng);
        add_slots(acc.data(), sl, bias, out.data());
        for (i64 c = 0; c < dim; ++c)
          ASSERT_EQ(out[static_cast<std::size_t>(c)],
                    out0[static_cast<std::size_t>(c)] + (bias + acc[static_cast<std::size_t>(ref_slot(bits, dim, c))]))
              << "channel " << c;
        ASSERT_EQ(out[static_cast<std::size_t>(dim)], out0[static_cast<std::size_t>(dim)]);  // untouched
      }
  });
}

// The expander entries' kernels: the differences exact and entry-major (with
// an output stride past the tokens, whose gaps stay untouched), group_axpy
// and entry_scores within their roundings, all with strides.
TEST(HexKernels, EntryKernelsMatchReference) {
  on_every_target([] {
    std::mt19937_64 rng(0x656e7472);
    std::normal_distribution<float> g(0.0f, 1.0f);
    const auto n_ = [](i64 k) { return static_cast<std::size_t>(k); };
    // Runs shorter than a vector, of whole vectors and with a partial last
    // one; mins tables held in registers (up to 128 on AVX-512) or gathered.
    for (const i64 n : {0, 1, 5, 8, 16, 17, 31, 33, 100})
      for (const i64 grp : {1, 2, 3, 4, 5, 8, 12}) {
        const i64 tab = n % 3 == 0 ? 64 : n % 3 == 1 ? 128 : 200;
        SCOPED_TRACE("n " + std::to_string(n) + " entries per token " + std::to_string(grp) + " table " +
                     std::to_string(tab));
        const i64 os = n + 3;  // entry stride of the entry-major outputs
        std::vector<float> b(n_(tab)), params(n_(2 * n));
        std::vector<half_bits> x(n_(n * grp));  // the entries as a block stores them
        std::vector<std::int32_t> idx(n_(n * grp));
        for (auto& v : b) v = g(rng);
        for (auto& v : x) v = float_to_half(g(rng));
        for (auto& v : params) v = g(rng);
        for (auto& v : idx) v = static_cast<std::int32_t>(rng() % n_(tab));
        std::vector<float> kd(n_(grp * os), -3.0f), vd(n_(grp * os), -3.0f);
        key_entry_diffs(b.data(), tab, idx.data(), x.data(), n, grp, kd.data(), os);
        value_entry_diffs(params.data(), x.data(), n, grp, vd.data(), os);
        for (i64 e = 0; e < grp; ++e)
          for (i64 i = 0; i < os; ++i) {
            const auto k = n_(e * os + i);
            if (i >= n) {  // the gap between entries
              ASSERT_EQ(kd[k], -3.0f) << e << " " << i;
              ASSERT_EQ(vd[k], -3.0f) << e << " " << i;
              continue;
            }
            const auto src = n_(i * grp + e);
            const float xs = half_to_float(x[src]);
            ASSERT_EQ(kd[k], xs - b[n_(idx[src])]) << "key entry " << e << " of token " << i;
            ASSERT_EQ(vd[k], xs - params[n_(2 * i + 1)]) << "value entry " << e << " of token " << i;
          }
        // entry_scores over entry-major inputs of different strides.
        const i64 as = n + 1, xs = os;
        std::vector<float> a(n_(grp * as)), z(n_(n) + 1, -3.0f);
        for (auto& v : a) v = g(rng);
        for (auto& v : z) v = g(rng);
        const auto z0 = z;
        entry_scores(a.data(), as, kd.data(), xs, n, grp, z.data());
        for (i64 i = 0; i < n; ++i) {
          // Against a double sum: one rounding per term at most (fused or
          // not), each bounded by the running sum's magnitude.
          double want = z0[n_(i)], mag = std::fabs(z0[n_(i)]);
          for (i64 e = 0; e < grp; ++e) {
            const double t = static_cast<double>(a[n_(e * as + i)]) * kd[n_(e * xs + i)];
            want += t;
            mag += std::fabs(t);
          }
          ASSERT_NEAR(z[n_(i)], want, 1.2e-7 * static_cast<double>(2 * grp + 2) * mag) << i;
        }
        ASSERT_EQ(z[n_(n)], z0[n_(n)]);
        // group_axpy: entry-major x and y of different strides.
        const i64 ys = n + 2;
        std::vector<float> p(n_(n)), ya(n_(grp * ys));
        for (auto& v : p) v = g(rng);
        for (auto& v : ya) v = g(rng);
        const auto y0 = ya;
        group_axpy(p.data(), n, grp, vd.data(), os, ya.data(), ys);
        for (i64 e = 0; e < grp; ++e)
          for (i64 i = 0; i < ys; ++i) {
            const auto k = n_(e * ys + i);
            if (i >= n) {
              ASSERT_EQ(ya[k], y0[k]) << e << " " << i;
              continue;
            }
            // A fused multiply-add or a product then a sum: within two roundings.
            const float xv = vd[n_(e * os + i)];
            const double want = static_cast<double>(p[n_(i)]) * xv + y0[k];
            ASSERT_NEAR(ya[k], want, 2.5e-7 * (std::fabs(p[n_(i)] * xv) + std::fabs(y0[k]))) << i << " " << e;
          }
        // entry_query_weights: the queries' values at the entries' channels
        // (the table's sizes: queries of 64, 128 or 200 floats), scaled: one
        // product each, so exactly scale * q. Nothing written past n per query.
        for (const i64 nq : {1, 3, 4}) {
          const i64 qs = tab + 7, m = n * grp;
          std::vector<float> q(n_(nq * qs)), w(n_(nq * m) + 1, -3.0f);
          for (auto& v : q) v = g(rng);
          const float scale = 0.0883883f;
          entry_query_weights(q.data(), nq, qs, tab, scale, idx.data(), m, w.data());
          for (i64 j = 0; j < nq; ++j)
            for (i64 k = 0; k < m; ++k)
              ASSERT_EQ(w[n_(j * m + k)], scale * q[n_(j * qs + idx[n_(k)])]) << "query " << j << " entry " << k;
          ASSERT_EQ(w[n_(nq * m)], -3.0f);
        }
      }
  });
}

// The fused run kernels against double sums of their definitions, on every
// target: query counts that fill and pass the vector path's table of sums,
// blocks without kept tokens and with kept tokens first, last, side by side
// and spread (runs of every length from 0, overlapping their last vector or
// short enough for the scalar loop), integer and float code parts, entries
// per token inside and past the vectorised range, strides with gaps and kept
// tokens' outputs that stay untouched.
TEST(HexKernels, FusedRunKernelsMatchReference) {
  on_every_target([] {
    std::mt19937_64 rng(0x72756e73);
    std::normal_distribution<float> g(0.0f, 1.0f);
    const auto n_ = [](i64 k) { return static_cast<std::size_t>(k); };
    // Kept positions: a pattern applied to a block of `tokens` tokens.
    const auto kept_of = [](int pattern, i64 tokens) {
      std::vector<std::uint16_t> k;
      const auto add = [&](i64 t) {
        if (t >= 0 && t < tokens && (k.empty() || k.back() < t)) k.push_back(static_cast<std::uint16_t>(t));
      };
      switch (pattern) {
        case 1:  // first and last
          add(0), add(tokens - 1);
          break;
        case 2:  // side by side, then one run of 3 (scalar), then the rest
          add(5), add(6), add(10);
          break;
        case 3:  // a HEX block's: spread
          add(tokens / 3), add(2 * tokens / 3 + 1);
          break;
        case 4:  // every token
          for (i64 t = 0; t < tokens; ++t) add(t);
          break;
        default:
          break;
      }
      return k;
    };
    for (const i64 tokens : {0, 1, 3, 4, 7, 8, 16, 17, 31, 33, 96})
      for (int pattern = 0; pattern < 5; ++pattern)
        for (const i64 grp : {1, 2, 3, 4, 5})
          for (const i64 nq : {i64{1}, i64{2}, i64{3}, i64{4}, kRunQueries, kRunQueries + 1}) {
            if (pattern == 4 && grp != 4) continue;
            const std::vector<std::uint16_t> kept = kept_of(pattern, tokens);
            const i64 nk = static_cast<i64>(kept.size()), n = tokens - nk;  // n quantized rows
            std::vector<i64> row_of(n_(tokens), -1);                        // token -> quantized row, -1 kept
            for (i64 t = 0, r = 0, k = 0; t < tokens; ++t)
              if (k < nk && kept[n_(k)] == t)
                ++k;
              else
                row_of[n_(t)] = r++;
            const i64 tab = tokens % 2 == 0 ? 128 : 200;
            const bool integer = (tokens + nq + pattern) % 2 == 0;
            SCOPED_TRACE("tokens " + std::to_string(tokens) + " kept " + std::to_string(nk) + " entries " +
                         std::to_string(grp) + " queries " + std::to_string(nq) + (integer ? " integer" : " float"));
            std::vector<float> b(n_(tab)), params(n_(2 * n)), bias(n_(nq)), w(n_(nq));
            std::vector<half_bits> x(n_(n * grp));
            for (auto& v : b) v = half_to_float(float_to_half(g(rng)));  // binary16, as a block's mins
            for (auto& v : x) v = float_to_half(g(rng));
            for (auto& v : params) v = g(rng);
            for (auto& v : bias) v = g(rng);
            for (auto& v : w) v = 1e-3f * g(rng);
            // Key side: per quantized row cs, per token as, os, is.
            const i64 cs = n + 2, as = tokens + 1, os = tokens + 3, is = tokens + 5;
            std::vector<std::int32_t> qi(n_(nq * cs));
            std::vector<float> qf(n_(nq * cs)), a(n_(nq * grp * as)), out(n_(nq * os), -7.0f);
            for (auto& v : qi) v = static_cast<std::int32_t>(rng() % 20001) - 10000;
            for (auto& v : qf) v = g(rng);
            for (auto& v : a) v = g(rng);
            // The mask indices entry-major, with a gap after each entry's.
            std::vector<std::int32_t> idx(n_(grp * is), -1);
            for (i64 t = 0; t < tokens; ++t)
              for (i64 e = 0; e < grp; ++e) idx[n_(e * is + t)] = static_cast<std::int32_t>(rng() % n_(tab));
            // Without and with the 16-bit indices (the mins then looked up as
            // halves on AVX-512): the same results.
            std::vector<std::uint16_t> idx16;
            entry_channels16(idx.data(), is, tokens, grp, idx16);
            for (const bool halves : {false, true}) {
              SCOPED_TRACE(halves ? "16-bit indices" : "32-bit indices");
              std::fill(out.begin(), out.end(), -7.0f);
              key_run_scores(b.data(), tab, idx.data(), is, halves ? idx16.data() : nullptr, x.data(),
                             kept.empty() ? nullptr : kept.data(), nk, tokens, grp, nq, bias.data(), w.data(),
                             integer ? qi.data() : nullptr, integer ? nullptr : qf.data(), cs, a.data(), as, out.data(),
                             os);
              for (i64 j = 0; j < nq; ++j)
                for (i64 t = 0; t < os; ++t) {
                  const float got = out[n_(j * os + t)];
                  const i64 r = t < tokens ? row_of[n_(t)] : -1;
                  if (r < 0) {
                    ASSERT_EQ(got, -7.0f) << "query " << j << ": kept or past the block at " << t;
                    continue;
                  }
                  const double code = integer ? static_cast<double>(w[n_(j)]) * qi[n_(j * cs + r)] : qf[n_(j * cs + r)];
                  double want = bias[n_(j)] + code, mag = std::fabs(bias[n_(j)]) + std::fabs(code);
                  for (i64 e = 0; e < grp; ++e) {
                    const double v =
                        static_cast<double>(a[n_((j * grp + e) * as + t)]) *
                        (static_cast<double>(half_to_float(x[n_(r * grp + e)])) - b[n_(idx[n_(e * is + t)])]);
                    want += v;
                    mag += 2 * std::fabs(v);
                  }
                  ASSERT_NEAR(got, want, 1.2e-7 * static_cast<double>(2 * grp + 4) * mag)
                      << "query " << j << " token " << t;
                }
            }
            // Value side: per token ps, ys, per quantized row pa.
            const i64 ps = tokens + 1, pa = n + 2, ys = tokens + 4;
            std::vector<float> p(n_(nq * ps)), av(n_(nq * pa), -7.0f), y(n_(nq * grp * ys)), base(n_(nq));
            for (auto& v : p) v = std::fabs(g(rng));
            for (auto& v : y) v = g(rng);
            for (auto& v : base) v = g(rng);
            const auto y0 = y;
            const auto base0 = base;
            std::vector<float> amax(n_(nq) + 1, -7.0f);
            value_run_weights(params.data(), x.data(), kept.empty() ? nullptr : kept.data(), nk, tokens, grp, nq,
                              p.data(), ps, av.data(), pa, y.data(), ys, base.data(), amax.data());
            ASSERT_EQ(amax[n_(nq)], -7.0f) << "past the queries' maxima";
            for (i64 j = 0; j < nq; ++j) {
              // The largest weight, exactly (quantize_rows' scale comes from it).
              float big = 0.0f;
              for (i64 r = 0; r < n; ++r) big = std::max(big, std::fabs(av[n_(j * pa + r)]));
              ASSERT_EQ(amax[n_(j)], big) << "query " << j;
              double want = base0[n_(j)], mag = std::fabs(base0[n_(j)]);
              for (i64 t = 0; t < tokens; ++t) {
                const i64 r = row_of[n_(t)];
                if (r < 0) continue;
                const float pv = p[n_(j * ps + t)];
                ASSERT_EQ(av[n_(j * pa + r)], pv * params[n_(2 * r)]) << "query " << j << " token " << t;
                want += static_cast<double>(pv) * params[n_(2 * r + 1)];
                mag += std::fabs(static_cast<double>(pv) * params[n_(2 * r + 1)]);
              }
              for (i64 r = n; r < pa; ++r) ASSERT_EQ(av[n_(j * pa + r)], -7.0f) << "query " << j << " past the rows";
              ASSERT_NEAR(base[n_(j)], want, 1e-6 * mag + 1e-7) << "query " << j;
              for (i64 e = 0; e < grp; ++e)
                for (i64 t = 0; t < ys; ++t) {
                  const auto k = n_((j * grp + e) * ys + t);
                  const i64 r = t < tokens ? row_of[n_(t)] : -1;
                  if (r < 0) {
                    ASSERT_EQ(y[k], y0[k]) << "query " << j << " entry " << e << ": kept or past the block at " << t;
                    continue;
                  }
                  // The difference rounded once, then a fused or a plain product and sum.
                  const float diff = half_to_float(x[n_(r * grp + e)]) - params[n_(2 * r + 1)];
                  const double v = static_cast<double>(p[n_(j * ps + t)]) * diff;
                  ASSERT_NEAR(y[k], v + y0[k], 2.5e-7 * (std::fabs(v) + std::fabs(y0[k])))
                      << "query " << j << " entry " << e << " token " << t;
                }
            }
          }
  });
}

// The fused key side of the int8 path (key_weights_int8) against its three
// steps apart (halves_to_floats, key_weights, quantize_rows): the same bytes,
// scales, mins and biases, bit for bit, on every target that takes the
// shape; taken on every fixed-size SIMD target for 2- to 4-bit rows of 64,
// 128 and 256 channels. Weights of every magnitude: the zero, tiny (below
// 2^-100) and huge key groups of QuantizeRow's special cases.
TEST(HexKernels, FusedKeyWeightsEqualTheirSteps) {
  on_every_target([] {
    std::mt19937_64 rng(0x6b657977);
    std::normal_distribution<float> g(0.0f, 1.0f);
    const std::int64_t target = kernel_target_id();
    const bool fixed =
        target != HWY_SCALAR && (target & (HWY_SVE | HWY_SVE2 | HWY_SVE_256 | HWY_SVE2_128 | HWY_RVV)) == 0;
    int fused = 0;
    for (const i64 dim : {8, 64, 96, 128, 130, 256})
      for (const int bits : {2, 3, 4})
        for (const i64 nq : {1, 3, 4, 8})
          for (const int kind : {0, 1, 2, 3}) {  // plain, zero deltas, tiny, huge
            SCOPED_TRACE("dim " + std::to_string(dim) + " bits " + std::to_string(bits) + " nq " + std::to_string(nq) +
                         " kind " + std::to_string(kind));
            const auto n = [](i64 k) { return static_cast<std::size_t>(k); };
            const Slots sl = int_slots(bits, dim);
            const i64 qs = dim + 3;
            std::vector<half_bits> params(n(2 * dim));
            for (i64 c = 0; c < dim; ++c) {
              const float delta = kind == 1 ? 0.0f : kind == 2 ? 0x1p-14f * std::fabs(g(rng)) : std::fabs(g(rng));
              params[n(2 * c)] = float_to_half(kind == 3 ? 60000.0f : delta);
              params[n(2 * c + 1)] = float_to_half(g(rng));
            }
            std::vector<float> q(n(nq * qs));
            for (auto& x : q) x = kind == 2 ? 0x1p-100f * g(rng) : kind == 3 ? 1e30f * g(rng) : g(rng);
            const float scale = 0.0884f;
            // The steps apart.
            std::vector<float> pf(n(2 * dim)), qd(n(nq * dim)), kmin0(n(dim)), bias0(n(nq)), amax(n(nq)),
                tmp(n(2 * dim)), ws0(n(nq));
            std::vector<std::int8_t> w80(n(nq * dim));
            kvcal::fp16::to_floats(params.data(), 2 * dim, pf.data());
            key_weights(pf.data(), q.data(), nq, qs, scale, sl, qd.data(), kmin0.data(), bias0.data(), amax.data(),
                        tmp.data());
            quantize_rows(1, qd.data(), nq, dim, w80.data(), ws0.data(), amax.data());
            // Fused, into outputs one element longer, filled with a marker.
            std::vector<float> kmin(n(dim) + 1, -5.0f), bias(n(nq) + 1, -5.0f), ws(n(nq) + 1, -5.0f);
            std::vector<std::int8_t> w8(n(nq * dim) + 1, 99);
            const bool took = key_weights_int8(params.data(), q.data(), nq, qs, scale, sl, w8.data(), ws.data(),
                                               kmin.data(), bias.data());
            const bool shape = (dim == 64 || dim == 128 || dim == 256) && (sl.per == 2 || sl.per == 4);
            if (fixed && shape) {
              ASSERT_TRUE(took);
            }
            if (!took) {  // nothing written
              for (const float x : kmin) {
                ASSERT_EQ(x, -5.0f);
              }
              for (const std::int8_t x : w8) {
                ASSERT_EQ(x, 99);
              }
              continue;
            }
            ++fused;
            for (i64 k = 0; k < nq * dim; ++k) ASSERT_EQ(w8[n(k)], w80[n(k)]) << "weight " << k;
            for (i64 j = 0; j < nq; ++j) {
              ASSERT_EQ(std::memcmp(&ws[n(j)], &ws0[n(j)], sizeof(float)), 0) << "scale " << j;
              ASSERT_EQ(std::memcmp(&bias[n(j)], &bias0[n(j)], sizeof(float)), 0) << "bias " << j;
            }
            for (i64 c = 0; c < dim; ++c) ASSERT_EQ(kmin[n(c)], kmin0[n(c)]) << "min " << c;
            ASSERT_EQ(w8[n(nq * dim)], 99);  // nothing past the outputs
            ASSERT_EQ(kmin[n(dim)], -5.0f);
            ASSERT_EQ(bias[n(nq)], -5.0f);
            ASSERT_EQ(ws[n(nq)], -5.0f);
            if (kind == 1) {
              for (i64 j = 0; j < nq; ++j) ASSERT_EQ(ws[n(j)], 0.0f);  // no weights: all zero
            }
          }
    if (fixed) {
      ASSERT_GE(fused, 3 * 3 * 4 * 4);  // dims 64, 128, 256, every width, count and kind
    }
  });
}

// The per-block weights of the key and value sides against double sums and
// the slot order written out by hand.
TEST(HexKernels, BlockWeightsMatchReference) {
  on_every_target([] {
    std::mt19937_64 rng(0x77656967);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (const i64 dim : {1, 3, 4, 8, 12, 40, 64, 128, 130, 200})
      for (const int bits : {2, 3, 4})
        for (const i64 nq : {1, 3, 4}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " bits " + std::to_string(bits) + " nq " + std::to_string(nq));
          const Slots sl(bits, dim);
          const i64 qs = dim + 5;
          std::vector<float> params(static_cast<std::size_t>(2 * dim)), q(static_cast<std::size_t>(nq * qs));
          for (auto& x : params) x = g(rng);
          for (auto& x : q) x = g(rng);
          const auto n = [](i64 k) { return static_cast<std::size_t>(k); };
          std::vector<float> qd(n(nq * dim) + 1, -5.0f), kmin(n(dim) + 1, -5.0f), bias(n(nq) + 1, -5.0f),
              amax(n(nq) + 1, -5.0f);
          std::vector<float> tmp(n(2 * dim));
          const float scale = 0.37f;
          key_weights(params.data(), q.data(), nq, qs, scale, sl, qd.data(), kmin.data(), bias.data(), amax.data(),
                      tmp.data());
          for (i64 j = 0; j < nq; ++j) {
            // The largest code weight, exactly (quantize_rows' scale comes from it).
            float big = 0.0f;
            for (i64 c = 0; c < dim; ++c) big = std::max(big, std::fabs(qd[n(j * dim + c)]));
            ASSERT_EQ(amax[n(j)], big) << "query " << j;
            double b = 0, mag = 0;
            for (i64 c = 0; c < dim; ++c) {
              const double qc = static_cast<double>(scale) * q[n(j * qs + c)];
              const double want = qc * params[n(2 * c)];
              ASSERT_NEAR(qd[n(j * dim + ref_slot(bits, dim, c))], want, 3e-7 * std::fabs(want)) << "channel " << c;
              b += qc * params[n(2 * c + 1)];
              mag += std::fabs(qc * params[n(2 * c + 1)]);
            }
            ASSERT_NEAR(bias[n(j)], b, 1e-6 * mag + 1e-7) << "query " << j;
          }
          for (i64 c = 0; c < dim; ++c) ASSERT_EQ(kmin[n(c)], params[n(2 * c + 1)]);
          ASSERT_EQ(qd[n(nq * dim)], -5.0f);  // nothing written past the outputs
          ASSERT_EQ(kmin[n(dim)], -5.0f);
          ASSERT_EQ(bias[n(nq)], -5.0f);
          ASSERT_EQ(amax[n(nq)], -5.0f);
        }
    for (const i64 rows : {0, 1, 5, 15, 16, 17, 33, 94, 96}) {  // partial vectors of every width
      std::vector<float> params(static_cast<std::size_t>(2 * rows)), p(static_cast<std::size_t>(rows));
      for (auto& x : params) x = g(rng);
      for (auto& x : p) x = std::fabs(g(rng));
      std::vector<float> a(static_cast<std::size_t>(rows) + 1, -5.0f);
      const float s = value_weights(params.data(), p.data(), rows, a.data());
      double want = 0, mag = 0;
      for (i64 i = 0; i < rows; ++i) {
        const auto k = static_cast<std::size_t>(i);
        ASSERT_EQ(a[k], p[k] * params[2 * k]) << "row " << i;  // one product, exact to the rounding
        want += static_cast<double>(p[k]) * params[2 * k + 1];
        mag += std::fabs(static_cast<double>(p[k]) * params[2 * k + 1]);
      }
      ASSERT_NEAR(s, want, 1e-6 * mag + 1e-7) << "rows " << rows;
      ASSERT_EQ(a[static_cast<std::size_t>(rows)], -5.0f);
    }
  });
}

TEST(HexKernels, HalfRowsAndDenseLoopsMatchReference) {
  on_every_target([] {
    std::mt19937_64 rng(0x68616c66);
    std::normal_distribution<float> g(0.0f, 1.0f);
    // Query counts that split into groups of 4 with different rows per step,
    // row counts with remainders after those steps (and fewer rows than a
    // step: a block's kept tokens), widths with tails.
    for (const i64 dim : {1, 5, 16, 31, 128, 133, 200})
      for (const i64 nq : {1, 3, 4, 5})
        for (const i64 rows : {1, 2, 3, 9, 33}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " nq " + std::to_string(nq) + " rows " + std::to_string(rows));
          const i64 ks = dim + 1;
          std::vector<std::uint16_t> k(static_cast<std::size_t>(rows * ks));
          for (auto& h : k) h = fp16::from_float(g(rng));
          std::vector<float> q(static_cast<std::size_t>(nq * dim)), out(static_cast<std::size_t>(nq * rows));
          for (auto& x : q) x = g(rng);
          half_scores(q.data(), nq, dim, k.data(), rows, dim, ks, 0.5f, out.data(), rows);
          std::vector<float> acc(static_cast<std::size_t>(nq * dim), 1.0f);
          half_accumulate(out.data(), nq, rows, k.data(), rows, dim, ks, acc.data(), dim);
          for (i64 j = 0; j < nq; ++j) {
            std::vector<double> sj(static_cast<std::size_t>(rows));
            for (i64 t = 0; t < rows; ++t) {
              double s = 0, mag = 0;
              for (i64 c = 0; c < dim; ++c) {
                const double term =
                    q[static_cast<std::size_t>(j * dim + c)] * ref_half(k[static_cast<std::size_t>(t * ks + c)]);
                s += term, mag += std::fabs(term);
              }
              sj[static_cast<std::size_t>(t)] = 0.5 * s;
              ASSERT_NEAR(out[static_cast<std::size_t>(j * rows + t)], 0.5 * s, 1e-5 * mag + 1e-6);
            }
            for (i64 c = 0; c < dim; ++c) {
              double s = 1, mag = 1;
              for (i64 t = 0; t < rows; ++t) {
                const double term = static_cast<double>(out[static_cast<std::size_t>(j * rows + t)]) *
                                    ref_half(k[static_cast<std::size_t>(t * ks + c)]);
                s += term, mag += std::fabs(term);
              }
              ASSERT_NEAR(acc[static_cast<std::size_t>(j * dim + c)], s, 1e-5 * mag);
            }
          }
          // dot and axpy
          std::vector<float> x(static_cast<std::size_t>(dim)), y(x.size());
          for (auto& v : x) v = g(rng);
          for (auto& v : y) v = g(rng);
          double d = 0, mag = 0;
          for (i64 i = 0; i < dim; ++i) d += static_cast<double>(x[i]) * y[i], mag += std::fabs(x[i] * y[i]);
          ASSERT_NEAR(dot(x.data(), y.data(), dim), d, 1e-6 * mag + 1e-7);
          const auto y0 = y;
          axpy(-1.5f, x.data(), y.data(), dim);
          for (i64 i = 0; i < dim; ++i)  // fused or not: one or two roundings
            ASSERT_NEAR(y[i], y0[i] - 1.5 * x[i], 1e-6 * (std::fabs(y0[i]) + 1.5 * std::fabs(x[i])));
        }
  });
}

// The integer kernels are exact: every target must give the reference's
// int32 sums bit for bit, with one limb (int8) and two (int14), and the
// reference must equal the float reference fed the same integer weights (a
// check of its slot mapping and of the limbs' meaning). 3-bit rows are read
// in place (the last one of a block from a widened copy): row counts around
// the kernels' steps of 4 and 8 rows, buffers of exactly the rows' size for
// even counts.
TEST(HexKernels, IntegerCodeKernelsEqualReferenceExactly) {
  on_every_target([] {
    std::mt19937_64 rng(0x696e7431);
    std::uniform_int_distribution<int> byte(0, 255), hi(-64, 63), lo(0, 127), w8(-127, 127);
    for (const int limbs : {1, 2})
      for (const i64 dim : {16, 32, 64, 96, 128, 192, 256, 12, 130})
        for (const int bits : {2, 3, 4})
          for (const i64 nq : {1, 2, 3, 4, 5})
            for (const i64 rows : {1, 2, 3, 4, 5, 7, 8, 9, 14, 16, 17, 30, 33, 96, 97}) {
              SCOPED_TRACE("limbs " + std::to_string(limbs) + " dim " + std::to_string(dim) + " bits " +
                           std::to_string(bits) + " nq " + std::to_string(nq) + " rows " + std::to_string(rows));
              const i64 rb = (dim * bits + 7) / 8 + (rows % 2);  // padded rows for odd row counts
              std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * rb));
              for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
              // n weights of `limbs` limbs at w (hi then lo), extreme values included.
              const auto fill = [&](std::int8_t* w, i64 n, i64 salt) {
                for (i64 c = 0; c < n; ++c) {
                  const bool edge = (c + salt) % 17 == 0;
                  if (limbs == 1) {
                    w[c] = static_cast<std::int8_t>(edge ? (c % 2 ? 127 : -127) : w8(rng));
                  } else {
                    w[c] = static_cast<std::int8_t>(edge ? (c % 2 ? 63 : -64) : hi(rng));
                    w[n + c] = static_cast<std::int8_t>(edge ? 127 : lo(rng));
                  }
                }
              };
              const auto value = [&](const std::int8_t* w, i64 n, i64 c) {
                return limbs == 1 ? static_cast<float>(w[c]) : static_cast<float>(128 * w[c] + w[n + c]);
              };
              // Scores: weights per query, with a stride past their end.
              const i64 ws = limbs * dim + 3;
              std::vector<std::int8_t> w(static_cast<std::size_t>(nq * ws), 99);
              for (i64 j = 0; j < nq; ++j) fill(w.data() + j * ws, dim, j);
              const i64 os = rows + 2;
              std::vector<std::int32_t> out(static_cast<std::size_t>(nq * os), -7), ref(out);
              code_scores_int(codes.data(), rows, rb, bits, dim, limbs, w.data(), nq, ws, out.data(), os);
              code_scores_int_reference(codes.data(), rows, rb, bits, dim, limbs, w.data(), nq, ws, ref.data(), os);
              ASSERT_EQ(out, ref);
              // The float kernels' slot order is the stored one; the integer
              // kernels' differs for 3 bits (int_slots).
              const Slots fs(bits, dim), is = int_slots(bits, dim);
              std::vector<float> wf(static_cast<std::size_t>(nq * dim));
              for (i64 j = 0; j < nq; ++j)
                for (i64 c = 0; c < dim; ++c)
                  wf[static_cast<std::size_t>(j * dim + fs.slot(c))] = value(w.data() + j * ws, dim, is.slot(c));
              std::vector<float> fref(static_cast<std::size_t>(nq * os));
              code_scores_reference(codes.data(), rows, rb, bits, dim, wf.data(), nq, dim, fref.data(), os);
              for (i64 j = 0; j < nq; ++j)
                for (i64 r = 0; r < rows; ++r)
                  ASSERT_EQ(static_cast<float>(ref[static_cast<std::size_t>(j * os + r)]),
                            fref[static_cast<std::size_t>(j * os + r)]);
              // Accumulation: weights per query over the rows, acc starts non-zero.
              const i64 as = limbs * rows + 1, cs = dim + 5;
              std::vector<std::int8_t> a(static_cast<std::size_t>(nq * as), 99);
              for (i64 j = 0; j < nq; ++j) fill(a.data() + j * as, rows, j + 5);
              std::vector<std::int32_t> acc(static_cast<std::size_t>(nq * cs));
              for (auto& x : acc) x = static_cast<std::int32_t>(byte(rng)) - 100;
              auto accref = acc;
              const auto acc0 = acc;
              code_accumulate_int(codes.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, acc.data(), cs);
              code_accumulate_int_reference(codes.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, accref.data(),
                                            cs);
              ASSERT_EQ(acc, accref);
              // The reference against float sums of the same integer weights.
              std::vector<float> af(static_cast<std::size_t>(nq * rows)),
                  facc(static_cast<std::size_t>(nq * dim), 0.0f);
              for (i64 j = 0; j < nq; ++j)
                for (i64 r = 0; r < rows; ++r)
                  af[static_cast<std::size_t>(j * rows + r)] = value(a.data() + j * as, rows, r);
              code_accumulate_reference(codes.data(), rows, rb, bits, dim, af.data(), nq, rows, facc.data(), dim);
              for (i64 j = 0; j < nq; ++j)
                for (i64 c = 0; c < dim; ++c)
                  ASSERT_EQ(static_cast<float>(accref[static_cast<std::size_t>(j * cs + is.slot(c))] -
                                               acc0[static_cast<std::size_t>(j * cs + is.slot(c))]),
                            facc[static_cast<std::size_t>(j * dim + fs.slot(c))]);
              // Scaled into floats (the decode's form): the same exact sums
              // times ws[j], added to rows that start non-zero, against the
              // sums in double. Bound: a few roundings of the sum of the
              // terms' magnitudes (the float reference fed |w|, exact here:
              // below 2^24), as chunked 3-bit rows add scaled partial sums.
              std::vector<float> sw(static_cast<std::size_t>(nq)), fs0(static_cast<std::size_t>(nq * cs));
              for (i64 j = 0; j < nq; ++j)
                sw[static_cast<std::size_t>(j)] = std::ldexp((j % 2 ? -1.0f : 1.0f) * (1.0f + 0.37f * j), -12);
              for (auto& x : fs0) x = static_cast<float>(byte(rng)) - 100.5f;
              auto fsum = fs0;
              std::vector<std::int32_t> scratch(static_cast<std::size_t>(nq * dim), 12345);
              code_accumulate_int_scaled(codes.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, sw.data(),
                                         fsum.data(), cs, scratch.data());
              std::vector<float> aabs(af.size()), mag(static_cast<std::size_t>(nq * dim), 0.0f);
              for (std::size_t k = 0; k < af.size(); ++k) aabs[k] = std::fabs(af[k]);
              code_accumulate_reference(codes.data(), rows, rb, bits, dim, aabs.data(), nq, rows, mag.data(), dim);
              for (i64 j = 0; j < nq; ++j) {
                const double wj = sw[static_cast<std::size_t>(j)];
                for (i64 c = 0; c < dim; ++c) {
                  const auto at = static_cast<std::size_t>(j * cs + is.slot(c));
                  const double exact = fs0[at] + wj * static_cast<double>(accref[at] - acc0[at]);
                  const double bound =
                      std::ldexp(4.0, -24) *
                      (std::fabs(fs0[at]) + std::fabs(wj) * mag[static_cast<std::size_t>(j * dim + fs.slot(c))]);
                  ASSERT_NEAR(fsum[at], exact, bound) << "query " << j << " channel " << c;
                }
                for (i64 x = dim; x < cs; ++x)  // past the row: untouched
                  ASSERT_EQ(fsum[static_cast<std::size_t>(j * cs + x)], fs0[static_cast<std::size_t>(j * cs + x)]);
              }
            }
  });
}

// Random bits-bit rows of 128 codes, four queries' int8 weights for scores
// (w) and for values (a), and the scalar references' sums of both (one limb).
struct RandomCodeRows {
  static constexpr i64 dim = 128, nq = 4;
  i64 rows, rb;
  std::vector<std::uint8_t> codes;
  std::vector<std::int8_t> w, a;
  std::vector<std::int32_t> sref, aref;
  RandomCodeRows(int bits, i64 n, std::mt19937_64& rng)
      : rows(n),
        rb(dim * bits / 8),
        codes(static_cast<std::size_t>(n * rb)),
        w(static_cast<std::size_t>(nq * dim)),
        a(static_cast<std::size_t>(nq * n)),
        sref(static_cast<std::size_t>(nq * n)),
        aref(static_cast<std::size_t>(nq * dim)) {
    std::uniform_int_distribution<int> byte(0, 255), w8(-127, 127);
    for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
    for (auto& x : w) x = static_cast<std::int8_t>(w8(rng));
    for (auto& x : a) x = static_cast<std::int8_t>(w8(rng));
    code_scores_int_reference(codes.data(), rows, rb, bits, dim, 1, w.data(), nq, dim, sref.data(), rows);
    code_accumulate_int_reference(codes.data(), rows, rb, bits, dim, 1, a.data(), nq, rows, aref.data(), dim);
  }
};

// The far requests' distance (prefetch.cpp): 8 KiB for 3- and 4-bit codes
// and none for 2-bit ones; 16 KiB for 4-bit codes on AMD families 0x19 and
// 0x1a with AVX-512 (Zen 4, Zen 5) and 4 KiB for 2-bit codes on 0x1a with
// AVX-512; KVCAL_PREFETCH_FAR's bytes in [0, 1 MiB] for all three instead,
// anything else in it ignored; and the integer code kernels' results the same
// at any distance (the requests past the end of the codes, up to a MiB beyond
// these small buffers, read nothing).
TEST(HexKernels, FarRequestDistanceIsChosenPerCpuAndLeavesResultsAlone) {
  using T = std::tuple<i64, i64, i64>;  // bits 2, 3, 4
  const auto chosen = [](unsigned amd_family, bool avx512, const char* env) {
    const FarBytes f = choose_prefetch_far(amd_family, avx512, env);
    return T(f.bits2, f.bits3, f.bits4);
  };
  EXPECT_EQ(chosen(0, false, nullptr), T(0, 8192, 8192));
  EXPECT_EQ(chosen(0, true, nullptr), T(0, 8192, 8192));         // Intel with AVX-512
  EXPECT_EQ(chosen(0x19, false, nullptr), T(0, 8192, 8192));     // Zen 3
  EXPECT_EQ(chosen(0x19, true, nullptr), T(0, 8192, 16384));     // Zen 4
  EXPECT_EQ(chosen(0x1a, true, nullptr), T(4096, 8192, 16384));  // Zen 5
  EXPECT_EQ(chosen(0x1a, false, nullptr), T(0, 8192, 8192));     // AVX-512 off (OS or hypervisor)
  EXPECT_EQ(chosen(0x17, true, nullptr), T(0, 8192, 8192));      // an AMD family not timed
  EXPECT_EQ(chosen(0x1b, true, nullptr), T(0, 8192, 8192));
  EXPECT_EQ(chosen(0x19, true, "4096"), T(4096, 4096, 4096));
  EXPECT_EQ(chosen(0x1a, true, "0"), T(0, 0, 0));
  EXPECT_EQ(chosen(0, false, "1048576"), T(1048576, 1048576, 1048576));
  for (const char* bad : {"", "1048577", "99999999", "-1", "12k", "8 KiB", " 64", "0x100"})
    EXPECT_EQ(chosen(0x1a, true, bad), T(4096, 8192, 16384)) << "'" << bad << "'";
  EXPECT_EQ(prefetch_far_bytes(1), 0);
  EXPECT_EQ(prefetch_far_bytes(5), 0);

  struct Restore {
    FarBytes f;
    ~Restore() { set_prefetch_far(f); }
  } restore{set_prefetch_far(FarBytes{})};
  on_every_target([] {
    std::mt19937_64 rng(0x66617231);
    for (const int bits : {2, 3, 4}) {
      const RandomCodeRows c(bits, 96, rng);
      for (const i64 far : {i64{0}, i64{64}, i64{8192}, i64{16384}, i64{1} << 20}) {
        SCOPED_TRACE("bits " + std::to_string(bits) + " far " + std::to_string(far));
        set_prefetch_far(FarBytes{far, far, far});
        ASSERT_EQ(prefetch_far_bytes(bits), far);
        std::vector<std::int32_t> s(c.sref.size(), -7), acc(c.aref.size(), 0);
        code_scores_int(c.codes.data(), c.rows, c.rb, bits, c.dim, 1, c.w.data(), c.nq, c.dim, s.data(), c.rows);
        code_accumulate_int(c.codes.data(), c.rows, c.rb, bits, c.dim, 1, c.a.data(), c.nq, c.rows, acc.data(), c.dim);
        ASSERT_EQ(s, c.sref);
        ASSERT_EQ(acc, c.aref);
      }
    }
  });
}

// The near requests' distance (prefetch.cpp): 96 rows for the key tiles and
// 64 for the values unless KVCAL_PREFETCH_NEAR holds a whole number of rows
// in [0, 4096], which sets both (anything else in it ignored); and the tile
// kernels' results the same at any distance (requests past the end of the
// codes, up to 4096 rows beyond these small buffers, read nothing).
TEST(HexKernels, NearRequestDistanceLeavesResultsAlone) {
  using T = std::pair<i64, i64>;  // keys, values
  const auto chosen = [](const char* env) {
    const NearRows n = choose_prefetch_near(env);
    return T(n.keys, n.values);
  };
  EXPECT_EQ(chosen(nullptr), T(96, 64));
  EXPECT_EQ(chosen("48"), T(48, 48));
  EXPECT_EQ(chosen("0"), T(0, 0));
  EXPECT_EQ(chosen("4096"), T(4096, 4096));
  for (const char* bad : {"", "4097", "99999999", "-1", "48 rows", " 48", "0x30", "1e3"})
    EXPECT_EQ(chosen(bad), T(96, 64)) << "'" << bad << "'";

  struct Restore {
    NearRows n;
    ~Restore() { set_prefetch_near(n); }
  } restore{set_prefetch_near(NearRows{})};
  EXPECT_EQ(prefetch_near_rows().keys, 96);
  EXPECT_EQ(prefetch_near_rows().values, 64);
  on_every_target([] {
    std::mt19937_64 rng(0x6e656172);
    for (const int bits : {2, 3, 4}) {
      const RandomCodeRows c(bits, 94, rng);
      const auto& codes = c.codes;
      const auto &w = c.w, &a = c.a;
      const auto &sref = c.sref, &aref = c.aref;
      const i64 dim = c.dim, rows = c.rows, nq = c.nq, rb = c.rb;
      std::vector<std::uint8_t> ktiles(codes.size()), vtiles(codes.size());
      const bool keys_tiled = key_tiles_layout(bits, dim), values_tiled = value_tiles_layout(bits, dim, 1);
      if (keys_tiled) rows_to_key_tiles(codes.data(), rows, rb, bits, ktiles.data());
      if (values_tiled) rows_to_value_tiles(codes.data(), rows, rb, vtiles.data());
      for (const i64 near : {i64{0}, i64{1}, i64{48}, i64{96}, i64{4096}}) {
        SCOPED_TRACE("bits " + std::to_string(bits) + " near " + std::to_string(near));
        set_prefetch_near(NearRows{near, near});
        ASSERT_EQ(prefetch_near_rows().keys, near);
        ASSERT_EQ(prefetch_near_rows().values, near);
        std::vector<std::int32_t> s(sref.size(), -7), acc(aref.size(), 0);
        if (keys_tiled)
          code_scores_int_tiles(ktiles.data(), rows, rb, bits, dim, 1, w.data(), nq, dim, s.data(), rows);
        else
          code_scores_int(codes.data(), rows, rb, bits, dim, 1, w.data(), nq, dim, s.data(), rows);
        if (values_tiled)
          code_accumulate_int_tiles(vtiles.data(), rows, rb, bits, dim, 1, a.data(), nq, rows, acc.data(), dim);
        else
          code_accumulate_int(codes.data(), rows, rb, bits, dim, 1, a.data(), nq, rows, acc.data(), dim);
        ASSERT_EQ(s, sref);
        ASSERT_EQ(acc, aref);
      }
    }
  });
}

// Key tiles (the layer cache's key layout for the integer score kernels):
// the layout checked byte by byte against its definition, the round trip
// exact, and the tiled score kernel equal to the row reference bit for bit on
// every target, with one limb and two, whole tiles and a last one of fewer rows,
// random codes and the extremes (every code at its maximum, every weight at
// its limb's limit). Buffers of exactly the codes' size (3-bit tiles are read
// widened, four bytes for three: the last one must not read past the end).
TEST(HexKernels, KeyTilesScoreAsRows) {
  on_every_target([] {
    std::mt19937_64 rng(0x74696c65);
    std::uniform_int_distribution<int> byte(0, 255), hi(-64, 63), lo(0, 127), w8(-127, 127);
    for (const int bits : {2, 3, 4})
      for (const i64 dim : {32, 64, 128, 256})
        for (const int limbs : {1, 2})
          for (const bool extreme : {false, true})
            for (const i64 rows : {0, 1, 15, 16, 17, 31, 32, 33, 47, 94, 96, 100}) {
              if (!key_tiles_layout(bits, dim)) continue;
              SCOPED_TRACE("bits " + std::to_string(bits) + " dim " + std::to_string(dim) + " limbs " +
                           std::to_string(limbs) + " extreme " + std::to_string(extreme) + " rows " +
                           std::to_string(rows));
              const i64 rb = dim * bits / 8, unit = KeyTileUnit(bits);
              ASSERT_EQ(rb % unit, 0);
              std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * rb), 0xff);
              if (!extreme)
                for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
              std::vector<std::uint8_t> tiles(codes.size()), back(codes.size());
              rows_to_key_tiles(codes.data(), rows, rb, bits, tiles.data());
              for (i64 r = 0; r < rows; ++r)
                for (i64 i = 0; i < rb; ++i) {
                  const i64 t0 = r / 16 * 16, n = std::min<i64>(16, rows - t0);  // the tile's first row, its rows
                  const i64 at = t0 * rb + (i / unit * n + r % 16) * unit + i % unit;
                  ASSERT_EQ(tiles[static_cast<std::size_t>(at)], codes[static_cast<std::size_t>(r * rb + i)])
                      << "row " << r << " byte " << i;
                }
              key_tiles_to_rows(tiles.data(), rows, rb, bits, back.data());
              ASSERT_EQ(back, codes);
              for (const i64 nq : {1, 2, 3, 4, 5, 6}) {
                const i64 ws = limbs * dim + 5, os = rows + 3;
                std::vector<std::int8_t> w(static_cast<std::size_t>(nq * ws), 99);
                for (i64 j = 0; j < nq; ++j)
                  for (i64 c = 0; c < dim; ++c) {
                    std::int8_t* wj = w.data() + j * ws;
                    if (limbs == 1) {
                      wj[c] = static_cast<std::int8_t>(extreme ? (j % 2 ? 127 : -127) : w8(rng));
                    } else {
                      wj[c] = static_cast<std::int8_t>(extreme ? (j % 2 ? 63 : -64) : hi(rng));
                      wj[dim + c] = static_cast<std::int8_t>(extreme ? (j % 2 ? 127 : 0) : lo(rng));
                    }
                  }
                std::vector<std::int32_t> out(static_cast<std::size_t>(nq * os), -7), ref(out);
                code_scores_int_tiles(tiles.data(), rows, rb, bits, dim, limbs, w.data(), nq, ws, out.data(), os);
                code_scores_int_reference(codes.data(), rows, rb, bits, dim, limbs, w.data(), nq, ws, ref.data(), os);
                ASSERT_EQ(out, ref) << "nq " << nq;  // past each query's rows: untouched (-7) in both
              }
            }
  });
}

// Value tiles (the layer cache's value layout for the integer value
// kernels): the layout checked byte by byte against its definition, the
// round trip exact, and both kernels over tiles giving the sums over rows bit
// for bit -- the int32 sums against the scalar reference, the scaled sums
// against the row kernel's -- for groups of queries up to and past those the
// kernels take at once, the last group of four rows whole or not, and weights
// at their extremes. 3-bit tiles are a layout of the kernels where
// value_tiles_layout says so (VBMI, int8); elsewhere they are untiled for
// the reference, whose sums, scaled once, the kernels' equal there.
TEST(HexKernels, ValueTilesAccumulateAsRows) {
  on_every_target([] {
    std::mt19937_64 rng(0x76746c73);
    std::uniform_int_distribution<int> byte(0, 255), hi(-64, 63), lo(0, 127), w8(-127, 127);
    for (const int limbs : {1, 2}) {
      EXPECT_TRUE(value_tiles_layout(4, 128, limbs));
      EXPECT_TRUE(value_tiles_layout(2, 128, limbs));
      EXPECT_FALSE(value_tiles_layout(3, 32, limbs));   // vectors of 16 bytes
      EXPECT_FALSE(value_tiles_layout(3, 160, limbs));  // the same
    }
    EXPECT_FALSE(value_tiles_layout(3, 128, 2));
    if (value_tiles_layout(3, 128, 1)) {
      EXPECT_STREQ(kernel_target(), "AVX3_DL");
      EXPECT_TRUE(value_tiles_layout(3, 64, 1));
      EXPECT_TRUE(value_tiles_layout(3, 256, 1));
    }
    for (const int bits : {2, 3, 4})
      for (const i64 dim : {32, 64, 128, 256})
        for (const int limbs : {1, 2})
          for (const bool extreme : {false, true})
            for (const i64 rows : {0, 1, 2, 3, 4, 5, 7, 8, 33, 94, 95, 96, 97}) {
              if (!int_dot_layout(bits, dim)) continue;
              SCOPED_TRACE("bits " + std::to_string(bits) + " dim " + std::to_string(dim) + " limbs " +
                           std::to_string(limbs) + " extreme " + std::to_string(extreme) + " rows " +
                           std::to_string(rows));
              const i64 rb = packed_bytes(dim, bits);
              std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * rb), 0xff);
              if (!extreme)
                for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
              std::vector<std::uint8_t> tiles(codes.size()), back(codes.size());
              rows_to_value_tiles(codes.data(), rows, rb, tiles.data());
              for (i64 r = 0; r < rows; ++r)
                for (i64 i = 0; i < rb; ++i) {
                  const i64 g = r / 4 * 4;  // the group's first row; rows past the last whole group stay rows
                  const i64 at = g + 4 <= rows ? g * rb + 4 * i + r % 4 : r * rb + i;
                  ASSERT_EQ(tiles[static_cast<std::size_t>(at)], codes[static_cast<std::size_t>(r * rb + i)])
                      << "row " << r << " byte " << i;
                }
              value_tiles_to_rows(tiles.data(), rows, rb, back.data());
              ASSERT_EQ(back, codes);
              const i64 cs = dim + 5;
              for (const i64 nq : {1, 2, 3, 4, 5, 8, 9}) {
                const i64 as = limbs * rows + 3;
                std::vector<std::int8_t> a(static_cast<std::size_t>(nq * as), 99);
                for (i64 j = 0; j < nq; ++j)
                  for (i64 r = 0; r < rows; ++r) {
                    std::int8_t* aj = a.data() + j * as;
                    if (limbs == 1) {
                      aj[r] = static_cast<std::int8_t>(extreme ? (j % 2 ? 127 : -127) : w8(rng));
                    } else {
                      aj[r] = static_cast<std::int8_t>(extreme ? (j % 2 ? 63 : -64) : hi(rng));
                      aj[rows + r] = static_cast<std::int8_t>(extreme ? (j % 2 ? 127 : 0) : lo(rng));
                    }
                  }
                std::vector<std::int32_t> acc0(static_cast<std::size_t>(nq * cs));
                for (auto& x : acc0) x = byte(rng) - 128;
                auto acc = acc0, ref = acc0;
                code_accumulate_int_tiles(tiles.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, acc.data(), cs);
                code_accumulate_int_reference(codes.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, ref.data(),
                                              cs);
                ASSERT_EQ(acc, ref) << "nq " << nq;  // past each query's row: untouched in both
                std::vector<float> sw(static_cast<std::size_t>(nq)), f0(static_cast<std::size_t>(nq * cs));
                for (i64 j = 0; j < nq; ++j)
                  sw[static_cast<std::size_t>(j)] = std::ldexp((j % 2 ? -1.0f : 1.0f) * (1.0f + 0.37f * j), -12);
                for (auto& x : f0) x = static_cast<float>(byte(rng)) - 100.5f;
                auto ft = f0, fr = f0;
                std::vector<std::int32_t> scratch(static_cast<std::size_t>(nq * dim), 12345);
                code_accumulate_int_tiles_scaled(tiles.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, sw.data(),
                                                 ft.data(), cs, scratch.data());
                if (bits == 3 && !value_tiles_layout(3, dim, limbs)) {  // untiled, the reference's sums scaled once
                  std::vector<std::int32_t> sums(static_cast<std::size_t>(nq * dim), 0);
                  code_accumulate_int_reference(codes.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, sums.data(),
                                                dim);
                  for (i64 j = 0; j < nq; ++j)
                    axpy_int(sw[static_cast<std::size_t>(j)], sums.data() + j * dim, fr.data() + j * cs, dim);
                } else {
                  code_accumulate_int_scaled(codes.data(), rows, rb, bits, dim, limbs, a.data(), nq, as, sw.data(),
                                             fr.data(), cs, scratch.data());
                }
                ASSERT_EQ(ft, fr) << "nq " << nq;
              }
            }
  });
}

// The value kernels over tiles read nothing past a block's codes (the 3-bit
// read loads a tile's windows with masks, a quarter of each vector left
// out): the codes end where a page the process may not read begins, so a
// read past them faults. Sums as the reference's over the rows.
TEST(HexKernels, ValueTilesReadNothingPastTheirBytes) {
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t readable = (256 / 2 * 97 + page - 1) / page * page;  // the largest block below
  void* map = mmap(nullptr, readable + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  ASSERT_EQ(mprotect(static_cast<std::uint8_t*>(map) + readable, page, PROT_NONE), 0);
  on_every_target([&] {
    std::mt19937_64 rng(0x67756172);
    std::uniform_int_distribution<int> byte(0, 255), w8(-127, 127);
    for (const int bits : {2, 3, 4})
      for (const i64 dim : {64, 128, 256})
        for (const i64 rows : {4, 8, 94, 96, 97})
          for (const i64 nq : {1, 4}) {
            SCOPED_TRACE("bits " + std::to_string(bits) + " dim " + std::to_string(dim) + " rows " +
                         std::to_string(rows) + " nq " + std::to_string(nq));
            const i64 rb = packed_bytes(dim, bits), n = rows * rb;
            std::vector<std::uint8_t> codes(static_cast<std::size_t>(n));
            for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
            std::uint8_t* tiles = static_cast<std::uint8_t*>(map) + readable - n;  // the last bytes before the page
            rows_to_value_tiles(codes.data(), rows, rb, tiles);
            std::vector<std::int8_t> a(static_cast<std::size_t>(nq * rows));
            for (auto& x : a) x = static_cast<std::int8_t>(w8(rng));
            std::vector<std::int32_t> acc(static_cast<std::size_t>(nq * dim), 5), ref(acc);
            code_accumulate_int_tiles(tiles, rows, rb, bits, dim, 1, a.data(), nq, rows, acc.data(), dim);
            code_accumulate_int_reference(codes.data(), rows, rb, bits, dim, 1, a.data(), nq, rows, ref.data(), dim);
            ASSERT_EQ(acc, ref);
          }
  });
  munmap(map, readable + page);
}

// Wide 3-bit rows, up to the widest the integer kernels take (dim / 2 =
// kIntWide3Bytes): their widened copies still fit the kernels' buffers.
TEST(HexKernels, IntegerCodeKernelsTakeWide3BitRows) {
  on_every_target([] {
    std::mt19937_64 rng(0x77696465);
    std::uniform_int_distribution<int> byte(0, 255), w8(-127, 127);
    EXPECT_FALSE(int_dot_layout(3, 2 * kIntWide3Bytes + 32));
    for (const i64 dim : {i64{4096}, i64{4128}, i64{8192}, 2 * kIntWide3Bytes})
      for (const int limbs : {1, 2})
        for (const i64 nq : {1, 2})
          for (const i64 rows : {1, 5, 9}) {
            SCOPED_TRACE("dim " + std::to_string(dim) + " limbs " + std::to_string(limbs) + " nq " +
                         std::to_string(nq) + " rows " + std::to_string(rows));
            ASSERT_TRUE(int_dot_layout(3, dim));
            const i64 rb = dim * 3 / 8;
            std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * rb));
            for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
            std::vector<std::int8_t> w(static_cast<std::size_t>(nq * limbs * dim));
            for (auto& x : w) x = static_cast<std::int8_t>(limbs == 1 ? w8(rng) : byte(rng) % 64);
            std::vector<std::int32_t> out(static_cast<std::size_t>(nq * rows)), ref(out);
            code_scores_int(codes.data(), rows, rb, 3, dim, limbs, w.data(), nq, limbs * dim, out.data(), rows);
            code_scores_int_reference(codes.data(), rows, rb, 3, dim, limbs, w.data(), nq, limbs * dim, ref.data(),
                                      rows);
            ASSERT_EQ(out, ref);
            std::vector<std::int8_t> a(static_cast<std::size_t>(nq * limbs * rows));
            for (auto& x : a) x = static_cast<std::int8_t>(limbs == 1 ? w8(rng) : byte(rng) % 64);
            std::vector<std::int32_t> acc(static_cast<std::size_t>(nq * dim), 3), accref(acc);
            code_accumulate_int(codes.data(), rows, rb, 3, dim, limbs, a.data(), nq, limbs * rows, acc.data(), dim);
            code_accumulate_int_reference(codes.data(), rows, rb, 3, dim, limbs, a.data(), nq, limbs * rows,
                                          accref.data(), dim);
            ASSERT_EQ(acc, accref);
            // Scaled into floats by 2^-8 (exact: these sums are below 2^24 in magnitude).
            const std::vector<float> sw(static_cast<std::size_t>(nq), 1.0f / 256);
            std::vector<float> fsum(static_cast<std::size_t>(nq * dim), 0.5f);
            std::vector<std::int32_t> scratch(static_cast<std::size_t>(nq * dim));
            code_accumulate_int_scaled(codes.data(), rows, rb, 3, dim, limbs, a.data(), nq, limbs * rows, sw.data(),
                                       fsum.data(), dim, scratch.data());
            for (std::size_t k = 0; k < fsum.size(); ++k)
              ASSERT_EQ(fsum[k], 0.5f + static_cast<float>(accref[k] - 3) / 256) << "element " << k;
          }
  });
}

// The integer kernels at their extremes: every code at its maximum and every
// weight at the limit of its limb, so that the kernels' partial sums (int16
// pair sums on targets without a one-instruction dot product) reach their
// largest magnitude. Closed forms: sum = code_max * (sum of the weights).
TEST(HexKernels, IntegerCodeKernelsHoldTheirExtremes) {
  on_every_target([] {
    for (const int limbs : {1, 2})
      for (const int bits : {2, 3, 4})
        for (const i64 dim : {64, 128, 256, 512})
          for (const int sign : {-1, 1}) {
            SCOPED_TRACE("limbs " + std::to_string(limbs) + " bits " + std::to_string(bits) + " dim " +
                         std::to_string(dim) + " sign " + std::to_string(sign));
            const i64 rows = 97, nq = 4, rb = dim * bits / 8;
            const std::int64_t code = (1 << bits) - 1;
            const std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * rb), 0xff);
            // One limb: -128 or 127. Two: hi -64 (lo 0) or hi 63, lo 127.
            const std::int8_t hi = limbs == 1 ? (sign < 0 ? -128 : 127) : (sign < 0 ? -64 : 63);
            const std::int8_t lo = sign < 0 ? 0 : 127;
            const std::int64_t weight = limbs == 1 ? hi : 128 * hi + lo;
            const auto fill = [&](i64 n, i64 stride) {
              std::vector<std::int8_t> w(static_cast<std::size_t>(nq * stride));
              for (i64 j = 0; j < nq; ++j)
                for (i64 c = 0; c < n; ++c) {
                  w[static_cast<std::size_t>(j * stride + c)] = hi;
                  if (limbs == 2) w[static_cast<std::size_t>(j * stride + n + c)] = lo;
                }
              return w;
            };
            const auto w = fill(dim, limbs * dim);
            std::vector<std::int32_t> out(static_cast<std::size_t>(nq * rows));
            code_scores_int(codes.data(), rows, rb, bits, dim, limbs, w.data(), nq, limbs * dim, out.data(), rows);
            for (const std::int32_t x : out) ASSERT_EQ(x, code * weight * dim);
            const auto a = fill(rows, limbs * rows);
            std::vector<std::int32_t> acc(static_cast<std::size_t>(nq * dim), 0);
            code_accumulate_int(codes.data(), rows, rb, bits, dim, limbs, a.data(), nq, limbs * rows, acc.data(), dim);
            for (const std::int32_t x : acc) ASSERT_EQ(x, code * weight * rows);
          }
  });
}

// The value kernel over a block of more rows than its int32 sums of masked
// phases could hold at the extremes: phase k's codes are summed times 2^(k b)
// on some targets (up to 240 for 4 bits), and 70001 rows of 240 * -128 pass
// -2^31 unless the kernel adds them up a span of rows at a time. Closed
// form as above; the same check on every target.
TEST(HexKernels, IntegerValueKernelHoldsLongBlocksAtTheExtremes) {
  on_every_target([] {
    for (const int bits : {2, 4})
      for (const i64 nq : {1, 4}) {
        SCOPED_TRACE("bits " + std::to_string(bits) + " nq " + std::to_string(nq));
        const i64 rows = 70001, dim = 128, rb = dim * bits / 8;
        const std::int64_t code = (1 << bits) - 1, weight = -128;
        const std::vector<std::uint8_t> codes(static_cast<std::size_t>(rows * rb), 0xff);
        const std::vector<std::int8_t> a(static_cast<std::size_t>(nq * rows), static_cast<std::int8_t>(weight));
        std::vector<std::int32_t> acc(static_cast<std::size_t>(nq * dim), 0);
        code_accumulate_int(codes.data(), rows, rb, bits, dim, 1, a.data(), nq, rows, acc.data(), dim);
        for (const std::int32_t x : acc) ASSERT_EQ(x, code * weight * rows);
      }
  });
}

// 3-bit rows widened to 4 bits for the integer kernels: every code of every
// row, bit by bit, from buffers of exactly the rows' size (a read past the
// end is an error under the sanitizers and valgrind).
TEST(HexKernels, WidenCodes3KeepsEveryCode) {
  on_every_target([] {
    std::mt19937_64 rng(0x33746f34);
    std::uniform_int_distribution<int> byte(0, 255);
    for (const i64 dim : {8, 16, 24, 32, 64, 128, 136, 256})
      for (const i64 rows : {1, 2, 3, 5, 33, 96}) {
        SCOPED_TRACE("dim " + std::to_string(dim) + " rows " + std::to_string(rows));
        std::vector<std::uint8_t> src(static_cast<std::size_t>(rows * dim * 3 / 8));
        for (auto& b : src) b = static_cast<std::uint8_t>(byte(rng));
        std::vector<std::uint8_t> wide(static_cast<std::size_t>(rows * dim / 2), 0xa5);
        widen_codes3(src.data(), rows, dim, wide.data());
        for (i64 r = 0; r < rows; ++r)
          for (i64 c = 0; c < dim; ++c)
            ASSERT_EQ(ref_code(wide.data() + r * dim / 2, c, 4), ref_code(src.data() + r * dim * 3 / 8, c, 3))
                << "row " << r << " channel " << c;
      }
    // The integer kernels take 3-bit rows exactly where they take the widened 4-bit rows.
    for (const i64 dim : {8, 16, 32, 64, 96, 128, 130, 256}) EXPECT_EQ(int_dot_layout(3, dim), int_dot_layout(4, dim));
  });
}

TEST(HexKernels, QuantizeWeights14IsTheSameOnEveryTargetAndBounded) {
  std::mt19937_64 rng(0x71313477);
  std::normal_distribution<float> g(0.0f, 1.0f);
  struct Case {
    std::vector<float> w;
  };
  std::vector<Case> cases;
  for (const i64 n : {1, 5, 16, 17, 30, 64, 94, 96, 128, 257}) {
    Case c;
    for (i64 i = 0; i < n; ++i) c.w.push_back(g(rng) * (i % 9 == 0 ? 50.0f : 1.0f));
    cases.push_back(c);
    Case z;  // all zero, and zero but for one negative entry
    z.w.assign(static_cast<std::size_t>(n), 0.0f);
    cases.push_back(z);
    z.w.back() = -3e-30f;
    cases.push_back(z);
  }
  cases.push_back({{8191.0f, 0.5f, 1.5f, -0.5f, -1.5f, 2.5f, -8191.0f, 127.5f, -128.5f}});  // ties to even
  std::vector<std::vector<std::int8_t>> first;
  std::vector<float> first_scale;
  bool have_first = false;
  on_every_target([&] {
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const auto& w = cases[k].w;
      const auto n = static_cast<i64>(w.size());
      std::vector<std::int8_t> limbs(static_cast<std::size_t>(2 * n), 99);
      const float s = quantize_weights14(w.data(), n, limbs.data());
      double m = 0;
      for (const float x : w) m = std::max(m, std::fabs(static_cast<double>(x)));
      ASSERT_NEAR(s, m / 8191, 1e-7 * m);
      for (i64 i = 0; i < n; ++i) {
        const int hi = limbs[static_cast<std::size_t>(i)], lo = limbs[static_cast<std::size_t>(n + i)];
        ASSERT_GE(hi, -64);
        ASSERT_LE(hi, 63);
        ASSERT_GE(lo, 0);
        ASSERT_LE(lo, 127);
        const double v = 128.0 * hi + lo;
        ASSERT_LE(std::fabs(v), 8191.0);
        // Within half a step, plus the rounding of w * 8191 / max|w|.
        ASSERT_LE(std::fabs(w[static_cast<std::size_t>(i)] - s * v), s * (0.5 + 1e-3) + 1e-45) << "at " << i;
      }
      if (k + 1 == cases.size()) {  // m = 8191: v = w rounded half to even
        const std::vector<double> want = {8191, 0, 2, -0, -2, 2, -8191, 128, -128};
        for (i64 i = 0; i < n; ++i)
          ASSERT_EQ(128.0 * limbs[static_cast<std::size_t>(i)] + limbs[static_cast<std::size_t>(n + i)],
                    want[static_cast<std::size_t>(i)])
              << "at " << i;
      }
      if (!have_first) {
        first.push_back(limbs);
        first_scale.push_back(s);
      } else {
        ASSERT_EQ(limbs, first[k]);
        ASSERT_EQ(s, first_scale[k]);
      }
    }
    have_first = true;
  });
}

TEST(HexKernels, QuantizeWeights8IsTheSameOnEveryTargetAndBounded) {
  std::mt19937_64 rng(0x71383877);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<std::vector<float>> cases;
  for (const i64 n : {1, 5, 16, 17, 30, 64, 94, 96, 128, 257}) {
    std::vector<float> w;
    for (i64 i = 0; i < n; ++i) w.push_back(g(rng) * (i % 9 == 0 ? 50.0f : 1.0f));
    cases.push_back(w);
    std::vector<float> z(static_cast<std::size_t>(n), 0.0f);  // all zero, then one tiny negative entry
    cases.push_back(z);
    z.back() = -3e-30f;
    cases.push_back(z);
  }
  cases.push_back({127.0f, 0.5f, 1.5f, -0.5f, -2.5f, 2.5f, -127.0f, 126.5f, -125.5f});  // ties to even
  std::vector<std::vector<std::int8_t>> first;
  std::vector<float> first_scale;
  bool have_first = false;
  on_every_target([&] {
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const auto& w = cases[k];
      const auto n = static_cast<i64>(w.size());
      std::vector<std::int8_t> v(static_cast<std::size_t>(n) + 1, 99);  // one sentinel past the end
      const float s = quantize_weights8(w.data(), n, v.data());
      EXPECT_EQ(v.back(), 99);
      double m = 0;
      for (const float x : w) m = std::max(m, std::fabs(static_cast<double>(x)));
      ASSERT_NEAR(s, m / 127, 1e-7 * m);
      {  // max|w| handed in (as key_weights and value_run_weights find it): the same bytes and scale
        const auto mf = static_cast<float>(m);
        std::vector<std::int8_t> r(static_cast<std::size_t>(n) + 1, 99);
        float rs = -1.0f;
        quantize_rows(1, w.data(), 1, n, r.data(), &rs, &mf);
        ASSERT_EQ(rs, s);
        ASSERT_EQ(r, v);
      }
      for (i64 i = 0; i < n; ++i) {
        const int x = v[static_cast<std::size_t>(i)];
        ASSERT_GE(x, -127);
        ASSERT_LE(x, 127);
        // Within half a step, plus the rounding of w * 127 / max|w|.
        ASSERT_LE(std::fabs(w[static_cast<std::size_t>(i)] - s * x), s * (0.5 + 1e-3) + 1e-45) << "at " << i;
      }
      if (k + 1 == cases.size()) {  // m = 127: v = w rounded half to even
        const std::vector<int> want = {127, 0, 2, 0, -2, 2, -127, 126, -126};
        for (i64 i = 0; i < n; ++i) ASSERT_EQ(v[static_cast<std::size_t>(i)], want[static_cast<std::size_t>(i)]) << i;
      }
      if (!have_first) {
        first.push_back(v);
        first_scale.push_back(s);
      } else {
        ASSERT_EQ(v, first[k]);
        ASSERT_EQ(s, first_scale[k]);
      }
    }
    have_first = true;
  });
}

// Weights so small (subnormal here) that L / max|w| overflows a float: the
// fixed point must still be round(w L / max|w|), the same on every target.
TEST(HexKernels, QuantizeWeightsOfSubnormalWeights) {
  std::mt19937_64 rng(0x73756221);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<std::vector<float>> cases;
  for (const i64 n : {5, 64, 96, 257}) {
    std::vector<float> w;
    for (i64 i = 0; i < n; ++i) w.push_back(g(rng) * 1e-40f);
    w[static_cast<std::size_t>(n / 2)] = 0.0f;
    cases.push_back(w);
  }
  std::vector<std::vector<std::int8_t>> first8, first14;
  bool have_first = false;
  on_every_target([&] {
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const auto& w = cases[k];
      const auto n = static_cast<i64>(w.size());
      float m = 0;
      for (const float x : w) m = std::max(m, std::fabs(x));
      ASSERT_GT(m, 0.0f);
      ASSERT_LT(m, std::numeric_limits<float>::min());
      std::vector<std::int8_t> v8(static_cast<std::size_t>(n)), v14(static_cast<std::size_t>(2 * n));
      ASSERT_EQ(quantize_weights8(w.data(), n, v8.data()), m / 127.0f);
      ASSERT_EQ(quantize_weights14(w.data(), n, v14.data()), m / 8191.0f);
      {  // max|w| handed in: the same limbs and scales (the subnormal scaling too)
        std::vector<std::int8_t> r8(static_cast<std::size_t>(n)), r14(static_cast<std::size_t>(2 * n));
        float s8 = -1.0f, s14 = -1.0f;
        quantize_rows(1, w.data(), 1, n, r8.data(), &s8, &m);
        quantize_rows(2, w.data(), 1, n, r14.data(), &s14, &m);
        ASSERT_EQ(s8, m / 127.0f);
        ASSERT_EQ(s14, m / 8191.0f);
        ASSERT_EQ(r8, v8);
        ASSERT_EQ(r14, v14);
      }
      for (i64 i = 0; i < n; ++i) {
        const double exact = static_cast<double>(w[static_cast<std::size_t>(i)]) / m;
        ASSERT_LE(std::fabs(v8[static_cast<std::size_t>(i)] - 127.0 * exact), 0.5 + 1e-3) << "at " << i;
        const double v = 128.0 * v14[static_cast<std::size_t>(i)] + v14[static_cast<std::size_t>(n + i)];
        ASSERT_LE(std::fabs(v - 8191.0 * exact), 0.5 + 1e-3) << "at " << i;
      }
      ASSERT_EQ(v8[static_cast<std::size_t>(n / 2)], 0);
      if (!have_first) {
        first8.push_back(v8);
        first14.push_back(v14);
      } else {
        ASSERT_EQ(v8, first8[k]);
        ASSERT_EQ(v14, first14[k]);
      }
    }
    have_first = true;
  });
}

TEST(HexKernels, SoftmaxRowMatchesDoubleReference) {
  on_every_target([] {
    std::mt19937_64 rng(0x736f6674);
    std::normal_distribution<float> g(0.0f, 1.0f);
    // Lengths around the vector widths; scores spread over 60 units, so that
    // weights below FLT_MIN (exp argument < -104 after the shift) occur.
    for (const i64 n : {1, 2, 15, 16, 17, 63, 64, 65, 1000})
      for (const float spread : {0.1f, 8.0f, 60.0f}) {
        SCOPED_TRACE("n " + std::to_string(n) + " spread " + std::to_string(spread));
        std::vector<float> r(static_cast<std::size_t>(n));
        for (auto& x : r) x = spread * g(rng);
        if (n > 3) r[2] = r[1];  // a tie
        const auto in = r;
        softmax_row(r.data(), n);
        double m = -1e300, z = 0;
        for (const float x : in) m = std::max(m, static_cast<double>(x));
        for (const float x : in) z += std::exp(static_cast<double>(x) - m);
        double total = 0;
        for (i64 i = 0; i < n; ++i) {
          const double arg = static_cast<double>(in[static_cast<std::size_t>(i)]) - m;
          const double want = std::exp(arg) / z;
          // The argument x - max rounded to float (relative error 2^-24 of
          // |arg| in the result), exp within 1 ulp, the sum and the scaling a
          // few more roundings, the float sum of n terms up to n 2^-24 (one
          // lane on the scalar target); weights below FLT_MIN may be 0.
          const double tol = (6e-8 * std::fabs(arg) + 4e-7 + 6e-8 * static_cast<double>(n)) * want + 1.2e-38;
          ASSERT_NEAR(r[static_cast<std::size_t>(i)], want, tol) << "at " << i;
          ASSERT_GE(r[static_cast<std::size_t>(i)], 0.0f);
          total += r[static_cast<std::size_t>(i)];
        }
        ASSERT_NEAR(total, 1.0, 1e-6);
      }
  });
}

// A softmax over a row in pieces (online_softmax_row, as attend() runs it):
// the running maximum is the row's, the running sum the double sum of
// e^(x - max), and each piece's weights, scaled by the factors of the later
// pieces and divided by the sum, the double softmax. Rows whose maximum grows
// in a later piece (scores rising along the row) and falls (falling), pieces
// of 1 to 40 scores.
TEST(HexKernels, OnlineSoftmaxPiecesMatchDoubleSoftmax) {
  on_every_target([] {
    std::mt19937_64 rng(0x6f6e6c6e);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::uniform_int_distribution<i64> piece(1, 40);
    for (const i64 n : {1, 7, 64, 300})
      for (const float slope : {0.05f, 0.0f, -0.05f}) {
        SCOPED_TRACE("n " + std::to_string(n) + " slope " + std::to_string(slope));
        std::vector<float> r(static_cast<std::size_t>(n));
        for (i64 i = 0; i < n; ++i) r[static_cast<std::size_t>(i)] = 4.0f * g(rng) + slope * static_cast<float>(i);
        const auto in = r;
        std::vector<i64> starts;
        std::vector<float> factors;
        float m = -std::numeric_limits<float>::infinity(), z = 0.0f;
        for (i64 at = 0; at < n;) {
          const i64 len = std::min(n - at, piece(rng));
          const float before = m;
          const float f = online_softmax_row(r.data() + at, len, m, z);
          float pm = before;
          for (i64 i = at; i < at + len; ++i) pm = std::max(pm, in[static_cast<std::size_t>(i)]);
          ASSERT_EQ(m, pm);
          if (at == 0) {
            ASSERT_EQ(f, 0.0f);
          } else if (m == before) {
            ASSERT_EQ(f, 1.0f);
          } else {
            ASSERT_NEAR(f, std::exp(static_cast<double>(before) - m), 1e-6 * std::exp(static_cast<double>(before) - m));
          }
          starts.push_back(at);
          factors.push_back(f);
          at += len;
        }
        double dm = -1e300, dz = 0;
        for (const float x : in) dm = std::max(dm, static_cast<double>(x));
        for (const float x : in) dz += std::exp(static_cast<double>(x) - dm);
        ASSERT_EQ(static_cast<double>(m), dm);
        ASSERT_NEAR(z, dz, 1e-5 * dz);
        for (std::size_t k = 0; k < starts.size(); ++k) {
          double later = 1.0;  // the factors of the pieces after k
          for (std::size_t l = k + 1; l < factors.size(); ++l) later *= factors[l];
          const i64 end = k + 1 < starts.size() ? starts[k + 1] : n;
          for (i64 i = starts[k]; i < end; ++i) {
            const double want = std::exp(static_cast<double>(in[static_cast<std::size_t>(i)]) - dm) / dz;
            const double got = static_cast<double>(r[static_cast<std::size_t>(i)]) * later / z;
            ASSERT_NEAR(got, want, 2e-6 * want + 1e-30) << "at " << i;
          }
        }
      }
  });
}

// The running maximum found wherever the row's maximum lies: rows of every
// length around the vector widths and their multiples (the maximum is kept
// in four running vectors, then lanes, then a scalar tail), the maximum at
// each place in turn among lower scores; past the row's end, larger scores
// that a wrong bound would pick up.
TEST(HexKernels, OnlineSoftmaxFindsTheMaximumAnywhere) {
  on_every_target([] {
    std::mt19937_64 rng(0x6d617872);
    std::uniform_real_distribution<float> u(-30.0f, 10.0f);
    for (const i64 n : {1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300}) {
      std::vector<float> base(static_cast<std::size_t>(n + 64), 100.0f);  // the tail: 100 past the row
      for (i64 i = 0; i < n; ++i) base[static_cast<std::size_t>(i)] = u(rng);
      for (i64 at = 0; at < n; ++at) {
        SCOPED_TRACE("n " + std::to_string(n) + " maximum at " + std::to_string(at));
        auto r = base;
        r[static_cast<std::size_t>(at)] = 11.0f + static_cast<float>(at % 3);  // above every other score
        float m = -std::numeric_limits<float>::infinity(), z = 0.0f;
        online_softmax_row(r.data(), n, m, z);
        ASSERT_EQ(m, 11.0f + static_cast<float>(at % 3));
        ASSERT_GE(z, 1.0f);
        ASSERT_EQ(r[static_cast<std::size_t>(at)], 1.0f);  // e^0
      }
    }
  });
}

// The exponential inside softmax_row, seen directly: a row of one 0 (the
// maximum) and scores x <= -25, whose weights e^x sum to less than half an
// ulp of 1, so that the sum is exactly 1 and each weight is e^x as computed.
// Every 257th float in [-87.34, -25]: within 1 ulp of the double exp where
// e^x is a normal float, below FLT_MIN (0 allowed) under it.
TEST(HexKernels, SoftmaxExponentialWithinOneUlp) {
  std::vector<float> xs;
  std::uint32_t bits;
  const float top = -25.0f;
  std::memcpy(&bits, &top, sizeof bits);
  for (;; bits += 257) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    if (x < -87.34f) break;
    xs.push_back(x);
  }
  for (const float x : {-87.3365f, -87.33654f, -87.3366f, -87.4f, -103.0f, -104.5f, -200.0f}) xs.push_back(x);
  // And every float from ln(FLT_MIN) up for 20000 ulps, where y 2^n may be
  // subnormal before the cut-off makes it 0.
  const float lo = -87.33654f;
  std::memcpy(&bits, &lo, sizeof bits);
  for (int k = 0; k < 20000; ++k, --bits) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    xs.push_back(x);
  }
  // Rows of 1024 (whole vectors on every target: a row's last scores past
  // them take the scalar exp), the last one filled up with -200.
  const std::size_t n = 1023;  // weights per row besides the maximum
  while (xs.size() % n != 0) xs.push_back(-200.0f);
  // The x86-64 targets with FMA (AVX2, AVX-512) make the same weights bit for
  // bit (the AVX-512 ones scale by 2^n with VSCALEFPS, AVX2 through the
  // exponent bits).
  std::map<std::string, std::vector<float>> fma_weights;
  on_every_target([&] {
    const std::string name = kernel_target();
    const bool fma_x86 = name == "AVX2" || name.rfind("AVX3", 0) == 0;
    const std::string target = name + (avx_vnni_active() ? " with VPDPBUSD" : "");
    for (std::size_t at = 0; at < xs.size(); at += n) {
      std::vector<float> r{0.0f};
      for (std::size_t i = at; i < std::min(xs.size(), at + n); ++i) r.push_back(xs[i]);
      softmax_row(r.data(), static_cast<i64>(r.size()));
      if (fma_x86) fma_weights[target].insert(fma_weights[target].end(), r.begin() + 1, r.end());
      ASSERT_EQ(r[0], 1.0f);
      for (std::size_t i = 1; i < r.size(); ++i) {
        const float x = xs[at + i - 1];
        const double want = std::exp(static_cast<double>(x));
        if (want < static_cast<double>(std::numeric_limits<float>::min())) {
          ASSERT_LT(r[i], std::numeric_limits<float>::min()) << "x " << x;
          ASSERT_GE(r[i], 0.0f) << "x " << x;
          continue;
        }
        const auto wf = static_cast<float>(want);
        const double ulp = static_cast<double>(std::nextafter(wf, 1.0f)) - static_cast<double>(wf);
        ASSERT_LE(std::fabs(static_cast<double>(r[i]) - want), ulp) << "x " << x;
      }
    }
  });
  if (fma_weights.empty()) return;
  const auto& [first_target, first] = *fma_weights.begin();
  for (const auto& [target, w] : fma_weights) {
    ASSERT_EQ(w.size(), xs.size());
    for (std::size_t i = 0; i < w.size(); ++i)
      ASSERT_EQ(bits_of(w[i]), bits_of(first[i])) << target << " against " << first_target << ", x " << xs[i];
  }
}

TEST(Fp16Bulk, EveryBinary16ValueOnEveryTarget) {
  std::vector<std::uint16_t> all(65536 + 5);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i % 65536);
  on_every_target([&] {
    std::vector<float> out(all.size());
    fp16::to_floats(all.data(), static_cast<std::int64_t>(all.size()), out.data());
    for (std::size_t i = 0; i < all.size(); ++i) {
      const double r = ref_half(all[i]);
      if (std::isnan(r)) {
        ASSERT_TRUE(std::isnan(out[i])) << i;
      } else {
        ASSERT_EQ(static_cast<double>(out[i]), r) << std::hex << all[i];
        ASSERT_EQ(std::signbit(out[i]), std::signbit(r)) << std::hex << all[i];
      }
    }
  });
}

TEST(Fp16Bulk, FloatsToHalvesRoundLikeTheScalarRoutineOnEveryTarget) {
  // Ties, subnormals, overflow, signed zeros and random values; the scalar
  // routine's rounding is checked against hand values in test_quant.cpp.
  std::vector<float> in;
  for (const float f : {0.0f, -0.0f, 65504.0f, 65519.0f, 65520.0f, -1e9f, std::numeric_limits<float>::infinity(),
                        std::ldexp(1.0f, -24), std::ldexp(3.0f, -25), std::ldexp(5.0f, -25), std::ldexp(1.0f, -26),
                        1.0f + std::ldexp(1.0f, -11), 1.0f + std::ldexp(3.0f, -11), std::ldexp(2047.0f, -25)})
    in.push_back(f);
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<std::uint32_t> u;
  while (in.size() < 20000) {
    float f;
    const std::uint32_t b = (u(rng) & 0x8fffffffu) | 0x30000000u;  // exponents around the binary16 range
    std::memcpy(&f, &b, 4);
    in.push_back(f);
  }
  on_every_target([&] {
    std::vector<std::uint16_t> out(in.size());
    fp16::from_floats(in.data(), static_cast<std::int64_t>(in.size()), out.data());
    for (std::size_t i = 0; i < in.size(); ++i)
      ASSERT_EQ(out[i], fp16::from_float(in[i])) << "f = " << in[i] << " bits " << std::hex << bits_of(in[i]);
  });
}

}  // namespace
}  // namespace kvcal::runtime::detail
