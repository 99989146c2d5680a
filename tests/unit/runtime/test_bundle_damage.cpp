// Damaged bundles opened in process by a program that links kvcal::runtime
// only, as a serving engine does: every input libhdf5 1.10.8 is known to
// crash on (fuzz/hdf5_crashes/), and fresh byte flips, truncations and
// appended bytes of a sealed bundle, must each be one clean runtime::Error
// naming the path: never a signal (a crash ends this test program, so ctest
// reports it), never a loaded bundle. Also the format_version 1 policy and
// the pinned digest, checked against sha256sum's.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "kvcal/runtime/bundle.h"
#include "temp_dir.h"

namespace {

using kvcal::runtime::Bundle;
using kvcal::runtime::BundleOpenOptions;
using kvcal::runtime::Error;
namespace fs = std::filesystem;

const std::string kSource = KVCAL_SOURCE_DIR;
const std::string kGoldenV1 = kSource + "/tests/golden/bundle_v1.kvcal.h5";
const std::string kGoldenV2 = kSource + "/tests/golden/bundle_v2.kvcal.h5";

std::vector<char> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_all(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// SHA-256 of a file by coreutils' sha256sum: an implementation independent of kvcal's.
std::string sha256sum(const std::string& path) {
  std::FILE* p = ::popen(("sha256sum '" + path + "'").c_str(), "r");
  if (!p) return {};
  char buf[65] = {};
  const std::size_t n = std::fread(buf, 1, 64, p);
  ::pclose(p);
  return n == 64 ? std::string(buf, 64) : std::string();
}

// Open must throw one runtime::Error: one line, starting with the path,
// naming `word` (when given). Returns the message.
std::string expect_refused(const std::string& path, const std::string& word, const BundleOpenOptions& o = {}) {
  try {
    Bundle::open(path, o);
    ADD_FAILURE() << path << ": opened";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(path + ":", 0), 0u) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find(word), std::string::npos) << "'" << word << "' not in: " << what;
    return what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << path << ": not a runtime::Error: " << e.what();
  }
  return {};
}

using BundleDamage = kvcal::test::TempDirTest;

// Descriptors this process holds (a refused open must not keep one).
std::size_t open_fds() {
  std::size_t n = 0;
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) n += e.exists() ? 1 : 0;
  return n;
}

TEST_F(BundleDamage, SealedGoldenOpens) {
  const auto b = Bundle::open(kGoldenV2);
  EXPECT_EQ(b->verified(), "seal");
  EXPECT_EQ(b->model(), "SmolLM2-135M-Instruct");
  EXPECT_EQ(b->masks().size(), 2u);
  EXPECT_EQ(b->heads().layers, 30);
  // The seal's text is readable at the start of the file.
  const std::vector<char> bytes = read_all(kGoldenV2);
  ASSERT_GT(bytes.size(), 512u);
  EXPECT_EQ(std::string(bytes.data(), 13), "kvcal-seal 1\n");
}

TEST_F(BundleDamage, KnownLibhdf5CrashesAreCleanErrorsInProcess) {
  const fs::path crashes = fs::path(kSource) / "fuzz" / "hdf5_crashes";
  int n = 0;
  for (const auto& entry : fs::directory_iterator(crashes)) {
    SCOPED_TRACE(entry.path().string());
    // A copy: the message must name the path the engine gave.
    const std::string p = path("crash.h5");
    write_all(p, read_all(entry.path().string()));
    expect_refused(p, "");
    ++n;
  }
  EXPECT_GE(n, 13);  // the inputs kept in fuzz/hdf5_crashes/ when this test was written
}

TEST_F(BundleDamage, EveryByteOfTheSealAndRandomFlipsAreRefused) {
  const std::vector<char> good = read_all(kGoldenV2);
  ASSERT_GT(good.size(), 1024u);
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<std::size_t> where;
  for (std::size_t i = 0; i < 512; ++i) where.push_back(i);  // every byte of the seal (user block)
  std::uniform_int_distribution<std::size_t> pos(512, good.size() - 1);
  for (int i = 0; i < 300; ++i) where.push_back(pos(rng));  // the HDF5 bytes it covers
  where.push_back(512);                                     // the HDF5 signature
  where.push_back(good.size() - 1);
  std::uniform_int_distribution<int> mask(1, 255);
  const std::string p = path("flip.h5");
  const std::size_t fds = open_fds();
  for (const std::size_t at : where) {
    SCOPED_TRACE("byte " + std::to_string(at));
    std::vector<char> bad = good;
    bad[at] = static_cast<char>(bad[at] ^ mask(rng));
    write_all(p, bad);
    const std::string what = expect_refused(p, "");
    if (at >= 512) {
      EXPECT_NE(what.find("checksum mismatch"), std::string::npos) << what;
    }
    // The explicit opt-out does not skip a seal that is there.
    if (at >= 512) {
      BundleOpenOptions o;
      o.allow_unverified = true;
      expect_refused(p, "checksum mismatch", o);
    }
  }
  EXPECT_EQ(open_fds(), fds) << "refused opens leak file descriptors";
  // The seal stripped (the user block zeroed): refused, the opt-out included.
  {
    std::vector<char> stripped = good;
    std::fill(stripped.begin(), stripped.begin() + 512, '\0');
    write_all(p, stripped);
    BundleOpenOptions o;
    o.allow_unverified = true;
    expect_refused(p, "neither an integrity seal nor the HDF5 signature", o);
  }
  // A run of garbage over the superblock.
  std::vector<char> bad = good;
  for (std::size_t i = 512; i < 600; ++i) bad[i] = static_cast<char>(rng());
  write_all(p, bad);
  expect_refused(p, "checksum mismatch");
}

TEST_F(BundleDamage, TruncationsAndAppendedBytesAreRefused) {
  const std::vector<char> good = read_all(kGoldenV2);
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<std::size_t> cuts = {0, 1, 7, 8, 13, 100, 511, 512, 513, 520, 1024, good.size() / 2, good.size() - 1};
  std::uniform_int_distribution<std::size_t> cut(0, good.size() - 1);
  for (int i = 0; i < 60; ++i) cuts.push_back(cut(rng));
  const std::string p = path("cut.h5");
  for (const std::size_t n : cuts) {
    SCOPED_TRACE("cut at " + std::to_string(n));
    write_all(p, std::vector<char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)));
    const std::string what = expect_refused(p, "");
    if (n > 512) {
      EXPECT_NE(what.find("truncated"), std::string::npos) << what;
    }
  }
  for (const std::size_t extra : {1u, 512u, 4096u}) {
    SCOPED_TRACE("appended " + std::to_string(extra));
    std::vector<char> longer = good;
    longer.resize(good.size() + extra, '\0');
    write_all(p, longer);
    expect_refused(p, "appended");
  }
}

TEST_F(BundleDamage, NotARegularFileIsRefusedWithoutBlocking) {
  expect_refused(path("absent.h5"), "cannot open");
  expect_refused(dir_.string(), "not a regular file");
  const std::string fifo = path("fifo.h5");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused(fifo, "not a regular file");  // no writer: a blocking open would hang here
}

TEST_F(BundleDamage, UnsealedVersion1IsRefusedUnlessOptedInOrPinned) {
  // Refused by default, saying what to do.
  const std::string what = expect_refused(kGoldenV1, "without an integrity seal");
  EXPECT_NE(what.find("kvcal validate"), std::string::npos) << what;
  EXPECT_NE(what.find("allow_unverified"), std::string::npos) << what;
  // Opened on request, unverified.
  BundleOpenOptions o;
  o.allow_unverified = true;
  const auto b = Bundle::open(kGoldenV1, o);
  EXPECT_EQ(b->verified(), "unverified");
  EXPECT_FALSE(b->masks().empty());
  // Or verified against a pinned digest.
  const std::string digest = sha256sum(kGoldenV1);
  ASSERT_EQ(digest.size(), 64u) << "sha256sum is needed";
  BundleOpenOptions pinned;
  pinned.expected_sha256 = digest;
  EXPECT_EQ(Bundle::open(kGoldenV1, pinned)->verified(), "pinned");
}

TEST_F(BundleDamage, PinnedDigestIsTheWholeFilesSha256) {
  const std::string digest = sha256sum(kGoldenV2);
  ASSERT_EQ(digest.size(), 64u) << "sha256sum is needed";
  BundleOpenOptions o;
  o.expected_sha256 = digest;
  EXPECT_EQ(Bundle::open(kGoldenV2, o)->verified(), "seal+pinned");
  for (char& c : o.expected_sha256) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_EQ(Bundle::open(kGoldenV2, o)->verified(), "seal+pinned");  // either case

  // Another valid, sealed bundle is not the pinned one.
  BundleOpenOptions other;
  other.expected_sha256 = digest;
  other.expected_sha256[10] = other.expected_sha256[10] == '0' ? '1' : '0';
  expect_refused(kGoldenV2, "expected_sha256", other);
  // An unsealed file whose digest is not the pin is refused even with the opt-out.
  other.allow_unverified = true;
  expect_refused(kGoldenV1, "expected_sha256", other);
  // A crafted file with a valid seal (fuzz/crafted_sealed/: libhdf5 overflows
  // a heap buffer on it) is stopped by a pin before libhdf5 reads it.
  for (const auto& entry : fs::directory_iterator(fs::path(kSource) / "fuzz" / "crafted_sealed")) {
    SCOPED_TRACE(entry.path().string());
    BundleOpenOptions shipped;
    shipped.expected_sha256 = digest;
    expect_refused(entry.path().string(), "expected_sha256", shipped);
  }
  // A malformed pin is an error, not a silent "no pin".
  BundleOpenOptions bad;
  bad.expected_sha256 = "abc";
  expect_refused(kGoldenV2, "64 hex digits", bad);
}

}  // namespace
