#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "io/h5.h"
#include "kvcal/core/error.h"
#include "kvcal/core/half.h"
#include "kvcal/graph/generate.h"
#include "kvcal/io/masks.h"
#include "temp_dir.h"

namespace kvcal {
namespace {
namespace fs = std::filesystem;

class IoTest : public test::TempDirTest {
 protected:
  bool only_file_is(const std::string& name) const {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir_)) n += e.path().filename() == name ? 1 : 100;
    return n == 1;
  }
};

MaskRecord make_record(const std::string& id, std::uint64_t seed) {
  MaskRecord r;
  r.id = id;
  r.mask = generate_random(resolve_shape(96, 128, 4, std::nullopt), seed);
  r.method = "random";
  r.seed = seed;
  r.certificate = certify(r.mask);
  return r;
}

TEST_F(IoTest, RoundTrip) {
  // A seed above 2^63 must survive the round trip (stored as uint64).
  const std::vector<MaskRecord> recs = {make_record("mask_0000", 1), make_record("mask_0001", 0xfedcba9876543210ULL)};
  write_mask_file(path("m.h5"), recs, "kvcal mask-gen --test");
  EXPECT_TRUE(only_file_is("m.h5")) << "temporary file left behind";
  const MaskFile f = read_mask_file(path("m.h5"));
  EXPECT_EQ(f.format_version, 1);
  EXPECT_EQ(f.command_line, "kvcal mask-gen --test");
  EXPECT_EQ(f.created_utc.size(), 20u);
  ASSERT_EQ(f.masks.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(f.masks[i].id, recs[i].id);
    EXPECT_EQ(f.masks[i].mask, recs[i].mask);
    EXPECT_EQ(f.masks[i].seed, recs[i].seed);
    EXPECT_EQ(f.masks[i].method, "random");
    EXPECT_EQ(f.masks[i].certificate.sigma2, recs[i].certificate.sigma2);
    EXPECT_EQ(f.masks[i].certificate.kind, recs[i].certificate.kind);
    EXPECT_EQ(f.masks[i].certificate.ramanujan, recs[i].certificate.ramanujan);
  }
}

TEST_F(IoTest, OverwriteIsAtomicAndFailedWriteLeavesNothing) {
  write_mask_file(path("m.h5"), {make_record("a", 1)}, "first");
  // A record with an invalid HDF5 name fails mid-write: the old file stays intact.
  MaskRecord bad = make_record("b", 2);
  bad.id = "";
  EXPECT_THROW(write_mask_file(path("m.h5"), {make_record("a", 3), bad}, "second"), Error);
  EXPECT_TRUE(only_file_is("m.h5"));
  EXPECT_EQ(read_mask_file(path("m.h5")).command_line, "first");
}

TEST_F(IoTest, UnwritableTargets) {
  EXPECT_THROW(write_mask_file(path("missing_dir/m.h5"), {make_record("a", 1)}, ""), Error);
  EXPECT_THROW(write_mask_file(dir_.string(), {make_record("a", 1)}, ""), Error);
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(IoTest, RejectsForeignAndDamagedFiles) {
  EXPECT_THROW(read_mask_file(path("absent.h5")), Error);
  { std::ofstream(path("text.h5")) << "not an hdf5 file\n"; }
  EXPECT_THROW(read_mask_file(path("text.h5")), Error);
  { std::ofstream(path("empty.h5")); }
  EXPECT_THROW(read_mask_file(path("empty.h5")), Error);

  write_mask_file(path("good.h5"), {make_record("a", 1)}, "");
  const auto size = fs::file_size(path("good.h5"));
  for (auto cut : {size / 2, size - 100, std::uintmax_t{600}}) {
    fs::copy_file(path("good.h5"), path("cut.h5"), fs::copy_options::overwrite_existing);
    fs::resize_file(path("cut.h5"), cut);
    EXPECT_THROW(read_mask_file(path("cut.h5")), Error) << "truncated at " << cut;
  }

  // An HDF5 file with the wrong format, and one from a newer kvcal.
  detail::h5_init();
  {
    detail::H5Handle f(H5Fcreate(path("other.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    detail::write_attr(f.get(), "format", std::string("kvcal.bundle"));
    detail::write_attr(f.get(), "format_version", std::int64_t{1});
  }
  try {
    read_mask_file(path("other.h5"));
    ADD_FAILURE() << "foreign format accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kvcal.bundle"), std::string::npos) << e.what();
  }
  {
    detail::H5Handle f(H5Fcreate(path("newer.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    detail::write_attr(f.get(), "format", std::string("kvcal.masks"));
    detail::write_attr(f.get(), "format_version", std::int64_t{99});
  }
  EXPECT_THROW(read_mask_file(path("newer.h5")), Error);
  { detail::H5Handle f(H5Fcreate(path("plain.h5").c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose); }
  EXPECT_THROW(read_mask_file(path("plain.h5")), Error);
}

TEST_F(IoTest, RejectsInconsistentShapes) {
  write_mask_file(path("m.h5"), {make_record("a", 1)}, "");
  {
    detail::H5Handle f(H5Fopen(path("m.h5").c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
    detail::H5Handle g(H5Gopen2(f.get(), "/masks/a", H5P_DEFAULT), H5Gclose);
    detail::write_attr(g.get(), "rows", std::int64_t{50});  // indptr has 97 entries
  }
  EXPECT_THROW(read_mask_file(path("m.h5")), Error);
}

}  // namespace
}  // namespace kvcal

namespace kvcal {
namespace {

TEST(HalfToFloat, EveryBinary16ValueExact) {
  std::vector<std::uint16_t> all(65536 + 3);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i % 65536);
  std::vector<float> out(all.size());
  fp16::to_floats(all.data(), static_cast<std::int64_t>(all.size()), out.data());  // bulk + scalar tail
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::uint32_t h = all[i];
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    const int exp = static_cast<int>((h >> 10) & 0x1f);
    const int man = static_cast<int>(h & 0x3ff);
    if (exp == 31) {
      if (man == 0) {
        EXPECT_EQ(out[i], static_cast<float>(sign * INFINITY)) << h;
      } else {
        EXPECT_TRUE(std::isnan(out[i])) << h;
      }
      continue;
    }
    const double want = exp == 0 ? sign * std::ldexp(man, -24) : sign * std::ldexp(1024 + man, exp - 25);
    EXPECT_EQ(out[i], static_cast<float>(want)) << "binary16 " << h;
    EXPECT_EQ(std::signbit(out[i]), (h & 0x8000) != 0) << h;
  }
}

}  // namespace
}  // namespace kvcal

namespace kvcal {
namespace {

// h5py writes variable-length UTF-8 strings by default; both kinds must read.
TEST(StringAttributes, VariableAndFixedLengthUtf8) {
  const std::string path = (std::filesystem::temp_directory_path() / "kvcal_vlen_attr.h5").string();
  detail::h5_init();
  {
    detail::H5Handle f(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    for (H5T_cset_t cset : {H5T_CSET_UTF8, H5T_CSET_ASCII}) {
      detail::H5Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(type.get(), H5T_VARIABLE);
      H5Tset_cset(type.get(), cset);
      detail::H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
      const char* name = cset == H5T_CSET_UTF8 ? "vlen_utf8" : "vlen_ascii";
      detail::H5Handle a(H5Acreate2(f.get(), name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
      const char* value = cset == H5T_CSET_UTF8 ? "σ2 ≤ τ" : "plain";
      ASSERT_GE(H5Awrite(a.get(), type.get(), &value), 0);
    }
    detail::write_attr(f.get(), "fixed", std::string("fixed ü"));
  }
  detail::H5Handle f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  EXPECT_EQ(detail::read_attr_string(f.get(), "vlen_utf8", "t"), "σ2 ≤ τ");
  EXPECT_EQ(detail::read_attr_string(f.get(), "vlen_ascii", "t"), "plain");
  EXPECT_EQ(detail::read_attr_string(f.get(), "fixed", "t"), "fixed ü");
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kvcal
