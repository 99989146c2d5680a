#include <gtest/gtest.h>

#include <unistd.h>
#include <cmath>
#include <filesystem>
#include <limits>
#include <numeric>

#include "kvcal/core/error.h"
#include "kvcal/core/random.h"
#include "kvcal/io/entropy_calibration.h"
#include "kvcal/profile/entropy.h"
#include "synthetic_dump.h"
#include "temp_dir.h"

namespace kvcal {
namespace {
namespace fs = std::filesystem;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Independent reference in long double, straight from the definitions.
TokenStats reference(const std::vector<float>& z) {
  long double m = -INFINITY;
  for (float x : z) m = std::max<long double>(m, x);
  long double s = 0;
  for (float x : z) s += std::exp(static_cast<long double>(x) - m);
  const long double lse = m + std::log(s);
  long double h = 0;
  for (float x : z) {
    if (x == kNegInf) continue;
    const long double lp = x - lse;
    h -= std::exp(lp) * lp;
  }
  long double v = 0;
  for (float x : z) {
    if (x == kNegInf) continue;
    const long double lp = x - lse;
    v += std::exp(lp) * (lp + h) * (lp + h);
  }
  return {static_cast<double>(h), static_cast<double>(v)};
}

TEST(TokenStats, UniformIsLnVWithZeroVarentropy) {
  for (std::int64_t v : {1, 2, 15, 16, 17, 1000, 128256}) {
    const std::vector<float> z(static_cast<std::size_t>(v), 3.5f);
    const TokenStats t = token_stats(z.data(), v);
    EXPECT_NEAR(t.entropy, std::log(static_cast<double>(v)), 1e-6 * std::log(static_cast<double>(v) + 1)) << v;
    EXPECT_NEAR(t.varentropy, 0.0, 1e-9) << v;
  }
}

TEST(TokenStats, OneHotAndMasked) {
  std::vector<float> z(300, kNegInf);
  z[123] = 2.0f;
  TokenStats t = token_stats(z.data(), 300);
  // Masked logits weigh 2^-126 each (the clamp): far below any tolerance.
  EXPECT_NEAR(t.entropy, 0.0, 1e-30);
  EXPECT_NEAR(t.varentropy, 0.0, 1e-30);
  // Masked entries count for nothing: uniform over the 7 live ones (one in the scalar tail).
  for (int i : {0, 5, 50, 100, 200, 290, 299}) z[i] = -1.0f;
  z[123] = -1.0f;
  t = token_stats(z.data(), 300);
  EXPECT_NEAR(t.entropy, std::log(8.0), 1e-6);
  EXPECT_NEAR(t.varentropy, 0.0, 1e-9);
}

TEST(TokenStats, TwoPointClosedForm) {
  for (double gap : {0.0, 0.5, 3.0, 10.0, 40.0}) {
    std::vector<float> z(1001, kNegInf);
    z[7] = 1.0f;
    z[1000] = static_cast<float>(1.0 - gap);  // in the scalar tail
    const double p = 1.0 / (1.0 + std::exp(-gap)), q = 1 - p;
    const double h = -(p * std::log(p) + (q > 0 ? q * std::log(q) : 0));
    const double v = p * q * gap * gap;  // (ln p - ln q)^2 = gap^2
    const TokenStats t = token_stats(z.data(), 1001);
    EXPECT_NEAR(t.entropy, h, 1e-6) << gap;
    EXPECT_NEAR(t.varentropy, v, 1e-6 * std::max(1.0, v)) << gap;
  }
}

TEST(TokenStats, RandomRowsAgainstLongDouble) {
  Rng rng(5);
  for (std::int64_t v : {31, 4096, 50000}) {
    for (double scale : {0.1, 3.0, 20.0}) {
      std::vector<float> z(static_cast<std::size_t>(v));
      for (auto& x : z) x = static_cast<float>(scale * rng.normal());
      const TokenStats want = reference(z), got = token_stats(z.data(), v);
      SCOPED_TRACE(::testing::Message() << "V " << v << " scale " << scale);
      // float exp (2e-7 relative) and float lane sums over 16 terms: ~1e-6 relative.
      EXPECT_NEAR(got.entropy, want.entropy, 2e-6 * std::max(1.0, want.entropy));
      EXPECT_NEAR(got.varentropy, want.varentropy, 2e-5 * std::max(1.0, want.varentropy));
    }
  }
}

TEST(TokenStats, BadRows) {
  std::vector<float> z(40, 0.0f);
  z[33] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(token_stats(z.data(), 40), Error);
  z[33] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(token_stats(z.data(), 40), Error);
  const std::vector<float> masked(40, kNegInf);
  EXPECT_THROW(token_stats(masked.data(), 40), Error);
  EXPECT_THROW(token_stats(z.data(), 0), Error);
  std::vector<float> rows(3 * 40, 0.0f);
  rows[2 * 40 + 1] = std::numeric_limits<float>::quiet_NaN();
  std::vector<double> h(3), v(3);
  try {
    token_stats_rows(rows.data(), 3, 40, h.data(), v.data(), 2, 100);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("position 102"), std::string::npos) << e.what();
  }
}

TEST(Percentile, AgainstHandComputedValues) {
  EXPECT_EQ(percentile({1, 2, 3, 4}, 50), 2.5);
  std::vector<double> hundred(100);
  std::iota(hundred.begin(), hundred.end(), 1.0);
  EXPECT_NEAR(percentile(hundred, 99), 99.01, 1e-12);
  EXPECT_EQ(percentile(hundred, 0), 1);
  EXPECT_EQ(percentile(hundred, 100), 100);
  EXPECT_EQ(percentile({7}, 99), 7);
  // Against a brute-force sort of shuffled data.
  Rng rng(9);
  std::vector<double> v(1001);
  for (auto& x : v) x = rng.uniform();
  std::vector<double> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(percentile(v, 90), sorted[900]);  // (1001 - 1) * 0.9 is an exact rank
  EXPECT_THROW(percentile({}, 50), Error);
  EXPECT_THROW(percentile({1}, 101), Error);
}

TEST(PageStats, MeanTemporalAndPartialPages) {
  const std::vector<double> h = {1, 3, 2, 2, 5};
  const std::vector<double> v = {0.5, 0.5, 1, 3, 7};
  std::vector<double> pe, pv;
  PageOptions o;
  o.page_size = 2;
  page_stats(h, v, o, pe, pv);
  EXPECT_EQ(pe, (std::vector<double>{2, 2}));
  EXPECT_EQ(pv, (std::vector<double>{0.5, 2}));
  pe.clear(), pv.clear();
  o.varentropy = PageVarentropy::temporal;
  o.keep_partial = true;
  page_stats(h, v, o, pe, pv);
  EXPECT_EQ(pe, (std::vector<double>{2, 2, 5}));
  EXPECT_EQ(pv, (std::vector<double>{1, 0, 0}));  // population variance of {1, 3} is 1
  o.page_size = 0;
  EXPECT_THROW(page_stats(h, v, o, pe, pv), Error);
}

using EntropyFiles = test::TempDirTest;

// A planted dump (N = 160, T = 3: 163 positions) with logits [163, V].
std::string logits_dump(const std::string& file, std::int64_t v, bool half, std::uint64_t seed,
                        const std::function<void(std::vector<float>&)>& edit = {}) {
  Rng rng(seed);
  std::vector<float> z(static_cast<std::size_t>(163 * v));
  for (std::int64_t r = 0; r < 163; ++r) {
    const double scale = 0.5 + 4.0 * static_cast<double>(r % 7) / 7.0;
    for (std::int64_t i = 0; i < v; ++i) z[r * v + i] = static_cast<float>(scale * rng.normal());
  }
  if (edit) edit(z);
  test::write_dump(file, 2, 8, 4, {test::planted_sample("s")}, false, [&](hid_t f) {
    detail::H5Handle g(H5Gopen2(f, "/samples/s", H5P_DEFAULT), H5Gclose);
    const hsize_t dims[2] = {163, static_cast<hsize_t>(v)};
    detail::H5Handle space(H5Screate_simple(2, dims, nullptr), H5Sclose);
    detail::H5Handle type(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
    if (half) {
      H5Tset_fields(type.get(), 15, 10, 5, 0, 10);
      H5Tset_precision(type.get(), 16);
      H5Tset_size(type.get(), 2);
      H5Tset_ebias(type.get(), 15);
    }
    detail::H5Handle ds(H5Dcreate2(g.get(), "logits", type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                        H5Dclose);
    H5Dwrite(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, z.data());
  });
  return file;
}

TEST_F(EntropyFiles, LogitsFloat32AndFloat16EndToEnd) {
  for (bool half : {false, true}) {
    SCOPED_TRACE(half ? "float16" : "float32");
    const std::string f = logits_dump(path(half ? "h.h5" : "s.h5"), 1000, half, 3);
    EntropyOptions o;
    o.page.page_size = 16;
    o.percentile = 90;
    const EntropyCalibration c = calibrate_entropy({f}, o);
    EXPECT_EQ(c.num_tokens, 163);
    EXPECT_EQ(c.num_pages, 10);  // 163 / 16, the partial page dropped
    EXPECT_EQ(c.sources, (std::vector<std::string>{"logits"}));
    EXPECT_DOUBLE_EQ(c.entropy_threshold, percentile(c.page_entropy, 90));
    // The trigger rate is what the thresholds and the rule say.
    std::int64_t fired = 0;
    for (std::int64_t i = 0; i < c.num_pages; ++i) {
      fired += c.page_entropy[i] > c.entropy_threshold && c.page_varentropy[i] > c.varentropy_threshold;
    }
    EXPECT_DOUBLE_EQ(c.trigger_rate, static_cast<double>(fired) / static_cast<double>(c.num_pages));
    EXPECT_DOUBLE_EQ(std::accumulate(c.histogram.begin(), c.histogram.end(), 0.0), 10.0);
    EXPECT_EQ(c.entropy_edges.size(), 65u);
    write_entropy_calibration(path("e.h5"), c, "test");
    const EntropyCalibration back = read_entropy_calibration(path("e.h5"));
    EXPECT_EQ(back.page_entropy, c.page_entropy);
    EXPECT_EQ(back.entropy_threshold, c.entropy_threshold);
    EXPECT_EQ(back.histogram, c.histogram);
    EXPECT_EQ(back.options.rule, TriggerRule::both);
  }
}

// The steps the MPI layer splits over ranks: samples listed, computed one by
// one, finished in list order give calibrate_entropy's exact bytes.
TEST_F(EntropyFiles, ListPagesFinishEqualsCalibrateEntropy) {
  const std::string a = logits_dump(path("a.h5"), 300, true, 5), b = logits_dump(path("b.h5"), 77, false, 6);
  EntropyOptions o;
  o.page.page_size = 8;
  o.percentile = 95;
  const EntropyCalibration want = calibrate_entropy({a, b}, o);
  const std::vector<EntropySampleRef> refs = list_entropy_samples({a, b}, o);
  ASSERT_EQ(refs.size(), 2u);
  EXPECT_EQ(refs[1].file, 1u);
  EXPECT_EQ(refs[0].weight, 163 * 300);  // (N+T) x V logits
  EXPECT_EQ(refs[1].weight, 163 * 77);
  std::vector<EntropySamplePages> pages;
  for (const auto& r : refs) pages.push_back(entropy_sample_pages(r.file == 0 ? a : b, r.name, o));
  const EntropyCalibration got = finish_entropy_calibration(o, pages, want.input_sha256);
  EXPECT_EQ(got.page_entropy, want.page_entropy);
  EXPECT_EQ(got.page_varentropy, want.page_varentropy);
  EXPECT_EQ(got.histogram, want.histogram);
  EXPECT_EQ(got.entropy_edges, want.entropy_edges);
  EXPECT_EQ(got.entropy_threshold, want.entropy_threshold);
  EXPECT_EQ(got.varentropy_threshold, want.varentropy_threshold);
  EXPECT_EQ(got.trigger_rate, want.trigger_rate);
  EXPECT_EQ(got.num_tokens, 2 * 163);
  EXPECT_EQ(got.sources, want.sources);
  EXPECT_THROW(finish_entropy_calibration(o, {}, {}), Error);  // no page at all
}

TEST_F(EntropyFiles, BitsAreNatsOverLn2) {
  const std::string f = logits_dump(path("s.h5"), 257, false, 4);
  EntropyOptions nats, bits;
  bits.unit = EntropyUnit::bits;
  const auto a = calibrate_entropy({f}, nats), b = calibrate_entropy({f}, bits);
  EXPECT_NEAR(b.entropy_threshold, a.entropy_threshold / std::log(2.0), 1e-12);
  EXPECT_NEAR(b.varentropy_threshold, a.varentropy_threshold / (std::log(2.0) * std::log(2.0)), 1e-12);
}

TEST_F(EntropyFiles, TokenStatsInput) {
  test::write_dump(path("t.h5"), 2, 8, 4, {test::planted_sample("s")}, false, [](hid_t f) {
    detail::H5Handle g(H5Gopen2(f, "/samples/s", H5P_DEFAULT), H5Gclose);
    std::vector<float> h(163), v(163);
    for (int i = 0; i < 163; ++i) h[i] = static_cast<float>(i % 10), v[i] = static_cast<float>(i % 3);
    detail::write_dataset(g.get(), "token_entropy", {163}, h.data());
    detail::write_dataset(g.get(), "token_varentropy", {163}, v.data());
  });
  EntropyOptions o;
  o.page.page_size = 10;
  o.percentile = 50;
  const auto c = calibrate_entropy({path("t.h5")}, o);
  EXPECT_EQ(c.sources, (std::vector<std::string>{"token_stats"}));
  EXPECT_EQ(c.num_pages, 16);
  for (double e : c.page_entropy) EXPECT_DOUBLE_EQ(e, 4.5);  // each page holds 0..9
}

TEST_F(EntropyFiles, BadInputs) {
  auto expect_error = [&](const std::string& f, const std::string& word) {
    try {
      calibrate_entropy({f}, EntropyOptions{});
      ADD_FAILURE() << "accepted " << f;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  };
  expect_error(logits_dump(path("nan.h5"), 64, false, 1,
                           [](std::vector<float>& z) { z[5 * 64 + 3] = std::numeric_limits<float>::quiet_NaN(); }),
               "position 5");
  expect_error(logits_dump(path("inf.h5"), 64, false, 1,
                           [](std::vector<float>& z) { z[9] = std::numeric_limits<float>::infinity(); }),
               "+inf");
  expect_error(logits_dump(path("zero.h5"), 0, false, 1), "V = 0");
  // No statistics at all.
  test::write_dump(path("none.h5"), 2, 8, 4, {test::planted_sample("s")});
  expect_error(path("none.h5"), "neither");
  // Lengths that disagree with N + T.
  test::write_dump(path("len.h5"), 2, 8, 4, {test::planted_sample("s")}, false, [](hid_t f) {
    detail::H5Handle g(H5Gopen2(f, "/samples/s", H5P_DEFAULT), H5Gclose);
    std::vector<float> h(100, 1.0f);
    detail::write_dataset(g.get(), "token_entropy", {100}, h.data());
    detail::write_dataset(g.get(), "token_varentropy", {100}, h.data());
  });
  expect_error(path("len.h5"), "N + T = 163");
  EntropyOptions o;
  o.percentile = 100;
  EXPECT_THROW(calibrate_entropy({path("none.h5")}, o), Error);
}

}  // namespace
}  // namespace kvcal
