// kvcal::runtime::Bundle: the golden bundle read as kvcal inspect and the raw
// HDF5 datasets say, a bundle written by kvcal round-trips, and every hostile
// input is one runtime::Error line naming the file, never a crash.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kvcal/core/sha256.h"
#include "kvcal/graph/generate.h"
#include "kvcal/io/bundle.h"
#include "kvcal/io/entropy_calibration.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/io/masks.h"
#include "kvcal/io/seal.h"
#include "kvcal/io/validate.h"
#include "kvcal/runtime/bundle.h"
#include "kvcal/spectral/certify.h"
#include "temp_dir.h"

namespace {

using kvcal::runtime::Bundle;
using kvcal::runtime::BundleOpenOptions;
using kvcal::runtime::Error;
using kvcal::runtime::MaskKey;
using kvcal::runtime::Role;

// format_version 1: no seal, opened with allow_unverified (tests of the seal
// itself: test_bundle_damage.cpp, which links kvcal::runtime only).
const std::string kGolden = std::string(KVCAL_SOURCE_DIR) + "/tests/golden/bundle_v1.kvcal.h5";
BundleOpenOptions unverified() {
  BundleOpenOptions o;
  o.allow_unverified = true;
  return o;
}

// Seals `path` again after an edit through HDF5 (which leaves the old seal
// in the user block, now wrong), so that only the content checks can object.
void reseal(const std::string& path) {
  {
    std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
    const std::string zeros(kvcal::kSealSize, '\0');
    io.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
  }
  kvcal::write_seal(path);
}

// --- raw HDF5, independent of kvcal's readers ---------------------------------

template <typename T>
std::vector<T> read_raw(const std::string& path, const std::string& name, hid_t memtype) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(f, 0) << path;
  const hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  EXPECT_GE(d, 0) << name;
  const hid_t space = H5Dget_space(d);
  std::vector<T> out(static_cast<std::size_t>(H5Sget_simple_extent_npoints(space)));
  EXPECT_GE(H5Dread(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()), 0) << name;
  H5Sclose(space);
  H5Dclose(d);
  H5Fclose(f);
  return out;
}

// A fixed-length string attribute (how kvcal writes strings).
std::string read_string_attr(hid_t obj, const char* name) {
  const hid_t a = H5Aopen(obj, name, H5P_DEFAULT);
  const hid_t t = H5Aget_type(a);
  std::string s(H5Tget_size(t), '\0');
  EXPECT_GE(H5Aread(a, t, s.data()), 0);
  H5Tclose(t);
  H5Aclose(a);
  return s.substr(0, s.find('\0'));
}

void write_string_attr(hid_t obj, const char* name, const std::string& value) {
  H5Adelete(obj, name);
  const hid_t t = H5Tcopy(H5T_C_S1);
  H5Tset_size(t, value.size());
  H5Tset_strpad(t, H5T_STR_NULLPAD);
  H5Tset_cset(t, H5T_CSET_UTF8);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(obj, name, t, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(a, t, value.data()), 0);
  H5Aclose(a);
  H5Sclose(space);
  H5Tclose(t);
}

std::string sha256_hex(const void* data, std::size_t size) {
  kvcal::Sha256 h;
  h.update(data, size);
  return h.hex_digest();
}

// Rewrites a whole dataset of `path` (values of T, native = stored layout) by
// `edit`, and, when fix_manifest, its checksum in the manifest too, so that
// only the content checks can object.
template <typename T, typename Edit>
void edit_dataset(const std::string& path, const std::string& name, hid_t memtype, Edit edit, bool fix_manifest) {
  std::vector<T> v = read_raw<T>(path, name, memtype);
  const std::string before = sha256_hex(v.data(), v.size() * sizeof(T));
  edit(v);
  const std::string after = sha256_hex(v.data(), v.size() * sizeof(T));
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  ASSERT_GE(H5Dwrite(d, memtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
  H5Dclose(d);
  if (fix_manifest) {
    std::string manifest = read_string_attr(f, "manifest");
    const auto at = manifest.find(before);
    ASSERT_NE(at, std::string::npos) << "the manifest lacks the checksum of " << name;
    manifest.replace(at, before.size(), after);
    write_string_attr(f, "manifest", manifest);
  }
  H5Fclose(f);
}

std::string copy_of(const std::string& from, const std::string& to) {
  std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing);
  return to;
}

// Open must fail with one line that starts with the path and names `word`.
void expect_refused(const std::string& path, const std::string& word, const BundleOpenOptions& o = {}) {
  try {
    Bundle::open(path, o);
    ADD_FAILURE() << path << ": opened";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(path + ":", 0), 0u) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find(word), std::string::npos) << "'" << word << "' not in: " << what;
    EXPECT_EQ(what.find(path + ": " + path), std::string::npos) << "path named twice: " << what;
  } catch (const std::exception& e) {
    ADD_FAILURE() << path << ": not a runtime::Error: " << e.what();
  }
}

const char* role_name(Role r) {
  switch (r) {
    case Role::anchor:
      return "anchor";
    case Role::volatile_head:
      return "volatile";
    case Role::pivot:
      return "pivot";
    case Role::satellite:
      return "satellite";
  }
  return "?";
}

// --- fixtures written with kvcal's own writers --------------------------------

kvcal::MaskRecord certified_record(const std::string& id, std::int64_t rows, std::int64_t cols, std::int64_t d1) {
  const kvcal::MaskShape shape = kvcal::resolve_shape(rows, cols, d1, std::nullopt);
  for (std::uint64_t seed = 1; seed < 64; ++seed) {
    kvcal::MaskRecord r;
    r.id = id;
    r.method = "random";
    r.seed = seed;
    r.mask = kvcal::generate_random(shape, seed);
    r.certificate = kvcal::certify(r.mask);
    if (r.certificate.ramanujan) return r;
  }
  ADD_FAILURE() << "no certified " << rows << "x" << cols << " mask";
  return {};
}

kvcal::HeadProfile head_profile() {
  kvcal::HeadProfile p;
  p.model = "test/model";
  p.layers = 2;
  p.kv_heads = 4;
  p.q_heads = 8;
  p.num_samples = 2;
  // layer 0: pivot, its satellite, anchor, volatile; layer 1: anchor, satellite, pivot, satellite
  p.role = {3, 4, 1, 2, 1, 4, 3, 4};
  p.pivot = {0, 0, -1, -1, -1, 2, 2, 2};
  p.budget_ratio = {1.0f, 0.25f, 0.5f, 1.0f, 0.125f, 0.25f, 1.0f, 0.375f};  // mean 0.5625
  p.stability = {0.9f, 0.8f, 0.7f, 0.1f, 0.6f, 0.5f, 0.3f, 0.55f};
  p.similarity = {0.0f, 0.7f, 0.2f, 0.1f, 0.3f, 0.8f, 0.9f, 0.75f};
  p.pairwise.assign(2 * 4 * 4, 0.5f);
  p.options.taxonomy.tau_stable = 0.4;
  p.options.taxonomy.tau_sim = 0.6;
  p.options.tau_drift = 0.3;
  p.options.overlap.topk = 64;
  p.options.overlap.topk_frac = 0.05;
  p.options.overlap.pool_kernel = 3;
  p.options.gqa = kvcal::GqaReduce::max;
  p.options.budget.budget = 0.5625;
  p.dump_sha256 = {"00", "11"};
  return p;
}

kvcal::EntropyCalibration entropy_calibration() {
  kvcal::EntropyCalibration c;
  c.options.page.page_size = 16;
  c.options.page.varentropy = kvcal::PageVarentropy::temporal;
  c.options.percentile = 95;
  c.options.rule = kvcal::TriggerRule::either;
  c.options.unit = kvcal::EntropyUnit::bits;
  c.entropy_threshold = 1.5;
  c.varentropy_threshold = 0.75;
  c.trigger_rate = 0.25;
  c.num_pages = 4;
  c.num_tokens = 64;
  c.page_entropy = {0.5, 1.0, 1.6, 2.0};
  c.page_varentropy = {0.1, 0.5, 0.8, 0.2};
  c.entropy_edges = {0.5, 1.25, 2.0};
  c.varentropy_edges = {0.1, 0.45, 0.8};
  c.histogram = {1, 1, 1, 1};
  c.input_sha256 = {"22"};
  c.sources = {"logits"};
  return c;
}

class RuntimeBundle : public kvcal::test::TempDirTest {
 protected:
  // A valid bundle of two mask files (96x64 and 96x128 with d1 4; 48x64 with d1 4),
  // the head profile and the entropy calibration above.
  std::string write_test_bundle() {
    masks_a_ = {certified_record("mask_0000", 96, 64, 4), certified_record("mask_0001", 96, 128, 4)};
    masks_b_ = {certified_record("mask_0000", 48, 64, 4)};
    kvcal::write_mask_file(path("a.h5"), masks_a_, "test");
    kvcal::write_mask_file(path("b.h5"), masks_b_, "test");
    kvcal::write_head_profile(path("heads.h5"), head_profile(), "test");
    kvcal::write_entropy_calibration(path("entropy.h5"), entropy_calibration(), "test");
    kvcal::BundleInputs in;
    in.model = "test/model-bundle";
    in.masks = {path("a.h5"), path("b.h5")};
    in.heads = path("heads.h5");
    in.entropy = path("entropy.h5");
    kvcal::write_bundle(path("bundle.h5"), in, "test");
    return path("bundle.h5");
  }
  std::vector<kvcal::MaskRecord> masks_a_, masks_b_;
};

TEST_F(RuntimeBundle, GoldenBundleReadsAsKvcalSeesIt) {
  const auto b = Bundle::open(kGolden, unverified());
  EXPECT_EQ(b->path(), kGolden);
  EXPECT_EQ(b->verified(), "unverified");
  boost::property_tree::ptree j;
  std::istringstream in(kvcal::inspect_artifact(kGolden, true));
  boost::property_tree::read_json(in, j);
  EXPECT_EQ(b->model(), j.get<std::string>("model"));

  // Masks: inspect's attributes and the raw CSR datasets.
  const auto& jm = j.get_child("masks");
  ASSERT_EQ(b->masks().size(), jm.size());
  ASSERT_EQ(b->masks().size(), 1u);
  const auto& m = *b->masks().front();
  const auto& jm0 = jm.front().second;
  EXPECT_EQ(m.source, "bundle:" + jm0.get<std::string>("id"));
  EXPECT_EQ(m.rows, jm0.get<std::int64_t>("rows"));
  EXPECT_EQ(m.cols, jm0.get<std::int64_t>("cols"));
  EXPECT_EQ(m.row_degree, jm0.get<std::int64_t>("row_degree"));
  EXPECT_DOUBLE_EQ(m.sigma2, jm0.get<double>("sigma2"));
  EXPECT_DOUBLE_EQ(m.ramanujan_bound, jm0.get<double>("ramanujan_bound"));
  EXPECT_EQ(m.ramanujan, jm0.get<int>("ramanujan") == 1);
  EXPECT_EQ(m.indptr, read_raw<std::int64_t>(kGolden, "/masks/mask_0000/indptr", H5T_NATIVE_INT64));
  EXPECT_EQ(m.indices, read_raw<std::int32_t>(kGolden, "/masks/mask_0000/indices", H5T_NATIVE_INT32));
  EXPECT_EQ(b->find_mask(MaskKey{96, 64, 4}), b->masks().front());
  EXPECT_EQ(b->find_mask(MaskKey{96, 64, 2}), nullptr);
  EXPECT_EQ(b->find_mask(MaskKey{64, 96, 4}), nullptr);

  // Heads: inspect's parameters and per-layer roles and budgets, and the raw datasets.
  const auto& t = b->heads();
  const auto& jh = j.get_child("heads");
  EXPECT_EQ(t.layers, jh.get<std::int64_t>("num_layers"));
  EXPECT_EQ(t.kv_heads, jh.get<std::int64_t>("num_kv_heads"));
  EXPECT_EQ(t.q_heads, jh.get<std::int64_t>("num_q_heads"));
  EXPECT_DOUBLE_EQ(t.tau_stable, jh.get<double>("tau_stable"));
  EXPECT_DOUBLE_EQ(t.tau_sim, jh.get<double>("tau_sim"));
  EXPECT_DOUBLE_EQ(t.tau_drift, jh.get<double>("tau_drift"));
  EXPECT_EQ(t.topk, jh.get<std::int64_t>("topk"));
  EXPECT_DOUBLE_EQ(t.topk_frac, jh.get<double>("topk_frac"));
  EXPECT_EQ(t.pool_kernel, jh.get<std::int64_t>("pool_kernel"));
  EXPECT_DOUBLE_EQ(t.budget, jh.get<double>("budget"));
  const std::size_t n = static_cast<std::size_t>(t.layers * t.kv_heads);
  ASSERT_EQ(t.role.size(), n);
  std::map<std::string, std::int64_t> counts;
  for (Role r : t.role) ++counts[role_name(r)];
  for (const char* name : {"anchor", "volatile", "pivot", "satellite"}) {
    EXPECT_EQ(counts[name], jh.get<std::int64_t>(std::string("roles.") + name)) << name;
  }
  std::int64_t l = 0;
  for (const auto& [unused, layer] : jh.get_child("layers")) {
    std::string roles;
    double budget = 0;
    for (std::int64_t h = 0; h < t.kv_heads; ++h) {
      const auto i = static_cast<std::size_t>(l * t.kv_heads + h);
      roles += (h ? " " : "") + std::string(role_name(t.role[i]));
      budget += t.budget_ratio[i];
      EXPECT_EQ(t.full(l, h), t.role[i] == Role::pivot || t.role[i] == Role::volatile_head);
    }
    EXPECT_EQ(roles, layer.get<std::string>("roles")) << "layer " << l;
    EXPECT_NEAR(budget / static_cast<double>(t.kv_heads), layer.get<double>("mean_budget"), 1e-12) << "layer " << l;
    ++l;
  }
  EXPECT_EQ(l, t.layers);
  const auto role = read_raw<std::int8_t>(kGolden, "/heads/role", H5T_NATIVE_INT8);
  ASSERT_EQ(role.size(), n);
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(static_cast<int>(t.role[i]), role[i]);
  EXPECT_EQ(t.pivot, read_raw<std::int32_t>(kGolden, "/heads/pivot", H5T_NATIVE_INT32));
  EXPECT_EQ(t.stability, read_raw<float>(kGolden, "/heads/stability", H5T_NATIVE_FLOAT));
  EXPECT_EQ(t.similarity, read_raw<float>(kGolden, "/heads/similarity", H5T_NATIVE_FLOAT));
  EXPECT_EQ(t.budget_ratio, read_raw<float>(kGolden, "/heads/budget_ratio", H5T_NATIVE_FLOAT));

  // Entropy thresholds.
  const auto& e = b->entropy();
  const auto& je = j.get_child("entropy");
  EXPECT_DOUBLE_EQ(e.entropy, je.get<double>("entropy_threshold"));
  EXPECT_DOUBLE_EQ(e.varentropy, je.get<double>("varentropy_threshold"));
  EXPECT_EQ(e.rule_both, je.get<std::string>("rule") == "and");
  EXPECT_EQ(e.unit_bits, je.get<std::string>("unit") == "bits");
  EXPECT_EQ(e.page_size, je.get<std::int64_t>("page_size"));
  EXPECT_EQ(e.varentropy_temporal, je.get<std::string>("page_varentropy") == "temporal");
  EXPECT_DOUBLE_EQ(e.percentile, je.get<double>("percentile"));
  EXPECT_DOUBLE_EQ(e.calibration_trigger_rate, je.get<double>("trigger_rate"));
}

TEST_F(RuntimeBundle, WrittenBundleRoundTrips) {
  const std::string path = write_test_bundle();
  const auto b = Bundle::open(path);
  EXPECT_EQ(b->verified(), "seal");
  EXPECT_EQ(b->model(), "test/model-bundle");
  // mask_0000 of b.h5 is renamed apart from a.h5's (write_bundle's rule)
  ASSERT_EQ(b->masks().size(), 3u);
  const std::vector<std::pair<std::string, const kvcal::MaskRecord*>> expected = {
      {"f1_mask_0000", &masks_b_[0]}, {"mask_0000", &masks_a_[0]}, {"mask_0001", &masks_a_[1]}};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const auto& m = *b->masks()[i];
    const kvcal::MaskRecord& r = *expected[i].second;
    SCOPED_TRACE(expected[i].first);
    EXPECT_EQ(m.source, "bundle:" + expected[i].first);
    EXPECT_EQ(m.rows, r.mask.rows);
    EXPECT_EQ(m.cols, r.mask.cols);
    EXPECT_EQ(m.row_degree, r.certificate.row_degree);
    EXPECT_EQ(m.indptr, r.mask.indptr);
    EXPECT_EQ(m.indices, r.mask.indices);
    EXPECT_TRUE(m.ramanujan);
    EXPECT_EQ(m.sigma2, r.certificate.sigma2);
    EXPECT_EQ(m.ramanujan_bound, r.certificate.ramanujan_bound);
    EXPECT_EQ(b->find_mask(MaskKey{m.rows, m.cols, m.row_degree}), b->masks()[i]);
  }
  EXPECT_EQ(b->find_mask(MaskKey{96, 64, 2}), nullptr);

  const kvcal::HeadProfile p = head_profile();
  const auto& t = b->heads();
  EXPECT_EQ(t.layers, 2);
  EXPECT_EQ(t.kv_heads, 4);
  EXPECT_EQ(t.q_heads, 8);
  for (std::size_t i = 0; i < p.role.size(); ++i) EXPECT_EQ(static_cast<int>(t.role[i]), p.role[i]) << i;
  EXPECT_EQ(t.pivot, p.pivot);
  EXPECT_EQ(t.stability, p.stability);
  EXPECT_EQ(t.similarity, p.similarity);
  EXPECT_EQ(t.budget_ratio, p.budget_ratio);
  EXPECT_EQ(t.budget, 0.5625);
  EXPECT_EQ(t.tau_stable, 0.4);
  EXPECT_EQ(t.tau_sim, 0.6);
  EXPECT_EQ(t.tau_drift, 0.3);
  EXPECT_EQ(t.topk, 64);
  EXPECT_EQ(t.topk_frac, 0.05);
  EXPECT_EQ(t.pool_kernel, 3);
  EXPECT_TRUE(t.full(0, 0));   // pivot
  EXPECT_FALSE(t.full(0, 1));  // satellite
  EXPECT_FALSE(t.full(0, 2));  // anchor
  EXPECT_TRUE(t.full(0, 3));   // volatile

  const auto& e = b->entropy();
  EXPECT_EQ(e.entropy, 1.5);
  EXPECT_EQ(e.varentropy, 0.75);
  EXPECT_FALSE(e.rule_both);
  EXPECT_TRUE(e.unit_bits);
  EXPECT_EQ(e.page_size, 16);
  EXPECT_TRUE(e.varentropy_temporal);
  EXPECT_EQ(e.percentile, 95);
  EXPECT_EQ(e.calibration_trigger_rate, 0.25);
}

TEST_F(RuntimeBundle, MissingForeignAndDamagedFilesAreErrors) {
  expect_refused(path("absent.h5"), "absent.h5");
  { std::ofstream(path("text.h5")) << "not HDF5 at all\n"; }
  expect_refused(path("text.h5"), "text.h5");
  { std::ofstream(path("empty.h5")); }
  expect_refused(path("empty.h5"), "empty.h5");
  expect_refused(dir_.string(), dir_.string());  // a directory

  const auto size = std::filesystem::file_size(kGolden);
  for (const auto cut : {size / 8, size / 2, size * 3 / 4, size - 1}) {
    SCOPED_TRACE(cut);
    const std::string p = copy_of(kGolden, path("cut.h5"));
    std::filesystem::resize_file(p, cut);
    expect_refused(p, "cut.h5", unverified());
  }

  // Other kvcal artifacts: valid files, but not bundles.
  kvcal::write_mask_file(path("masks.h5"), {certified_record("mask_0000", 96, 64, 2)}, "test");
  expect_refused(path("masks.h5"), "without an integrity seal");  // by default, before libhdf5 reads it
  expect_refused(path("masks.h5"), "kvcal.masks", unverified());
  kvcal::write_head_profile(path("heads.h5"), head_profile(), "test");
  expect_refused(path("heads.h5"), "kvcal.head_profile", unverified());
}

// Flips bit 0 of byte `byte` of a contiguous dataset's stored data on disk.
void flip_stored_bit(const std::string& path, const char* dataset, std::size_t byte) {
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  const hid_t d = H5Dopen2(f, dataset, H5P_DEFAULT);
  const haddr_t offset = H5Dget_offset(d);  // contiguous: where the raw bytes lie
  H5Dclose(d);
  H5Fclose(f);
  ASSERT_NE(offset, HADDR_UNDEF) << dataset;
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(offset + byte));
  char c = 0;
  io.get(c);
  io.seekp(static_cast<std::streamoff>(offset + byte));
  io.put(static_cast<char>(c ^ 0x01));
}

TEST_F(RuntimeBundle, ChangedBytesAreChecksumMismatches) {
  // The lowest mantissa bit of one stability value: still a valid profile,
  // so only the manifest's checksum can tell.
  const std::string p = copy_of(kGolden, path("flip.h5"));
  flip_stored_bit(p, "/heads/stability", 4 * 4);
  expect_refused(p, "checksum mismatch in /heads/stability", unverified());
  // A byte of a mask index: out of range (or a checksum mismatch), refused either way.
  const std::string r = copy_of(kGolden, path("index.h5"));
  flip_stored_bit(r, "/masks/mask_0000/indices", 9);
  expect_refused(r, "mask_0000", unverified());

  // A value changed through HDF5, manifest left alone.
  const std::string q = copy_of(kGolden, path("stability.h5"));
  edit_dataset<float>(
      q, "/heads/stability", H5T_NATIVE_FLOAT, [](std::vector<float>& v) { v[4] = 0.5f * v[4] + 0.25f; }, false);
  expect_refused(q, "checksum", unverified());
}

// A bundle just written by kvcal: each flipped byte (random positions, seed
// printed) is refused by the seal before libhdf5 reads the file, and the
// same edits through HDF5 are refused too unless the file is sealed again.
TEST_F(RuntimeBundle, FreshBundleFlipsAreSealMismatches) {
  const std::string src = write_test_bundle();
  const auto size = std::filesystem::file_size(src);
  ASSERT_GT(size, kvcal::kSealSize);
  const std::uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::uint64_t> at(kvcal::kSealSize, size - 1);
  for (int i = 0; i < 50; ++i) {
    const std::string p = copy_of(src, path("flip.h5"));
    const std::uint64_t byte = at(rng);
    SCOPED_TRACE(byte);
    std::fstream io(p, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(static_cast<std::streamoff>(byte));
    char c = 0;
    io.get(c);
    io.seekp(static_cast<std::streamoff>(byte));
    io.put(static_cast<char>(c ^ 0x10));
    io.close();
    expect_refused(p, "checksum mismatch");
    EXPECT_FALSE(kvcal::validate_artifact(p).ok());
  }
  const std::string q = copy_of(src, path("edited.h5"));
  edit_dataset<float>(
      q, "/heads/stability", H5T_NATIVE_FLOAT, [](std::vector<float>& v) { v[0] = 0.5f * v[0]; }, true);
  expect_refused(q, "checksum mismatch");  // the seal
  reseal(q);
  EXPECT_NO_THROW(Bundle::open(q));  // a valid edit, sealed again
}

// Roles and pivots out of range, with the manifest updated to match: the
// content checks refuse them, not the checksums.
TEST_F(RuntimeBundle, HeadRolesAndPivotsOutOfRangeAreErrors) {
  const std::string src = write_test_bundle();
  {
    const std::string p = copy_of(src, path("role.h5"));
    edit_dataset<std::int8_t>(
        p, "/heads/role", H5T_NATIVE_INT8, [](std::vector<std::int8_t>& v) { v[2] = 7; }, true);
    reseal(p);
    expect_refused(p, "role");
  }
  {
    const std::string p = copy_of(src, path("role0.h5"));
    edit_dataset<std::int8_t>(
        p, "/heads/role", H5T_NATIVE_INT8, [](std::vector<std::int8_t>& v) { v[2] = 0; }, true);
    reseal(p);
    expect_refused(p, "role");
  }
  {
    // a satellite whose pivot is beyond the layer's heads
    const std::string p = copy_of(src, path("pivot.h5"));
    edit_dataset<std::int32_t>(
        p, "/heads/pivot", H5T_NATIVE_INT32, [](std::vector<std::int32_t>& v) { v[5] = 4; }, true);
    reseal(p);
    expect_refused(p, "satellite");
  }
  {
    // a satellite of a head that is not a pivot
    const std::string p = copy_of(src, path("pivot_anchor.h5"));
    edit_dataset<std::int32_t>(
        p, "/heads/pivot", H5T_NATIVE_INT32, [](std::vector<std::int32_t>& v) { v[1] = 2; }, true);
    reseal(p);
    expect_refused(p, "satellite");
  }
  {
    const std::string p = copy_of(src, path("pivot_neg.h5"));
    edit_dataset<std::int32_t>(
        p, "/heads/pivot", H5T_NATIVE_INT32, [](std::vector<std::int32_t>& v) { v[7] = -2147483647 - 1; }, true);
    reseal(p);
    expect_refused(p, "satellite");
  }
  {
    const std::string p = copy_of(src, path("budget.h5"));
    edit_dataset<float>(
        p, "/heads/budget_ratio", H5T_NATIVE_FLOAT, [](std::vector<float>& v) { v[2] = std::nanf(""); }, true);
    reseal(p);
    expect_refused(p, "budget_ratio");
  }
  {
    // a mask index beyond the columns
    const std::string p = copy_of(src, path("index.h5"));
    edit_dataset<std::int32_t>(
        p, "/masks/mask_0000/indices", H5T_NATIVE_INT32, [](std::vector<std::int32_t>& v) { v[3] = 1 << 30; }, true);
    reseal(p);
    expect_refused(p, "mask_0000");
  }
  // The untouched source still opens.
  EXPECT_NO_THROW(Bundle::open(src));
}

}  // namespace
