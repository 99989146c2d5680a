// kvcal_make_fixtures <dir>: writes the malformed and lying mask files that
// tests/cli/run_cli_tests.sh feeds to `kvcal mask-certify`, and prints the
// name of each file it wrote.
//
//   bad_*.h5     files `kvcal mask-certify` must refuse to read (exit 1, one
//                stderr line): wrong format, version, types, sizes, attributes.
//   defect_*.h5  readable kvcal.masks files whose stored claims are false
//                (exit 1, verdict "FALSE CLAIMS"); written with kvcal's own
//                writer from hand-edited CSR masks and certificates.
//   good.h5      a valid file written the same way, as a control.
//   dump_good.h5 a planted attention dump (float16) for `kvcal profile-heads`;
//   dump_*.h5    attention dumps it must refuse (one stderr line, exit 1).
#include <hdf5.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/h5.h"
#include "kvcal/graph/generate.h"
#include "kvcal/io/masks.h"
#include "kvcal/spectral/certify.h"
#include "synthetic_dump.h"

namespace {

using kvcal::Certificate;
using kvcal::CsrMask;
using kvcal::MaskRecord;
using kvcal::detail::H5Handle;
namespace d = kvcal::detail;

std::string g_dir;

void wrote(const std::string& name) { std::printf("%s/%s\n", g_dir.c_str(), name.c_str()); }

// A fresh HDF5 file filled by `fill` through the C API.
void write_raw(const std::string& name, const std::function<void(hid_t)>& fill) {
  const std::string path = g_dir + "/" + name;
  H5Handle file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  KVCAL_CHECK(file.valid(), "cannot create {}", path);
  fill(file.get());
  wrote(name);
}

// A file through kvcal's own writer.
void write_kvcal(const std::string& name, std::vector<MaskRecord> masks) {
  kvcal::write_mask_file(g_dir + "/" + name, masks, "kvcal_make_fixtures");
  wrote(name);
}

// The first certified Ramanujan random mask of a shape (what mask-gen writes).
MaskRecord certified_mask(std::int64_t rows, std::int64_t cols, std::int64_t d1, kvcal::MaskMethod method,
                          bool want_ramanujan = true) {
  const kvcal::MaskShape shape = kvcal::resolve_shape(rows, cols, d1, std::nullopt);
  for (std::uint64_t seed = 1; seed < 100; ++seed) {
    MaskRecord rec;
    rec.mask = kvcal::generate(method, shape, seed);
    rec.certificate = kvcal::certify(rec.mask);
    if (rec.certificate.ramanujan != want_ramanujan) continue;
    rec.id = "mask_0000";
    rec.method = kvcal::to_string(method);
    rec.seed = seed;
    return rec;
  }
  kvcal::fail("no {} {}x{} mask in 99 seeds", want_ramanujan ? "Ramanujan" : "non-Ramanujan", rows, cols);
}

// How write_mask_group departs from the layout of write_mask_file.
struct Variant {
  std::string skip_attr;                        // leave this attribute out
  bool float_indices = false;                   // store indices as float64
  bool indices_2d = false;                      // store indices as a [nnz/2, 2] array
  std::int64_t indptr_extra = 0;                // entries added to (or, negative, cut from) indptr
  std::optional<std::int64_t> rows_attr;        // a different stored row count
  std::optional<std::string> certificate_attr;  // a different certificate kind
};

// A Variant with one field set by `set`.
template <typename Set>
Variant with(Set&& set) {
  Variant v;
  set(v);
  return v;
}

// Writes /masks/<id> by hand, mirroring write_mask_file but for `v`.
void write_mask_group(hid_t masks, const MaskRecord& rec, const Variant& v = {}) {
  H5Handle g = d::create_group(masks, rec.id);
  std::vector<std::int64_t> indptr = rec.mask.indptr;
  indptr.resize(static_cast<std::size_t>(static_cast<std::int64_t>(indptr.size()) + v.indptr_extra), indptr.back());
  d::write_dataset_1d(g.get(), "indptr", indptr);
  if (v.float_indices || v.indices_2d) {
    const std::vector<double> values(rec.mask.indices.begin(), rec.mask.indices.end());
    const int rank = v.indices_2d ? 2 : 1;
    const hsize_t dims[2] = {v.indices_2d ? values.size() / 2 : values.size(), 2};
    H5Handle space(H5Screate_simple(rank, dims, nullptr), H5Sclose);
    const hid_t file_type = v.float_indices ? H5T_IEEE_F64LE : H5T_STD_I32LE;
    H5Handle ds(H5Dcreate2(g.get(), "indices", file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                H5Dclose);
    const herr_t ok =
        v.float_indices ? H5Dwrite(ds.get(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data())
                        : H5Dwrite(ds.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, rec.mask.indices.data());
    KVCAL_CHECK(ds.valid() && ok >= 0, "cannot write indices of {}", rec.id);
  } else {
    d::write_dataset_1d(g.get(), "indices", rec.mask.indices);
  }
  const Certificate& c = rec.certificate;
  auto attr = [&](const std::string& name, auto value) {
    if (name != v.skip_attr) d::write_attr(g.get(), name, value);
  };
  attr("rows", v.rows_attr.value_or(rec.mask.rows));
  attr("cols", rec.mask.cols);
  attr("row_degree", c.row_degree);
  attr("col_degree", c.col_degree);
  attr("biregular", std::int64_t{c.biregular});
  attr("method", rec.method);
  attr("seed", static_cast<std::int64_t>(rec.seed));
  attr("sigma1", c.sigma1);
  attr("sigma2", c.sigma2);
  attr("ramanujan_bound", c.ramanujan_bound);
  attr("ramanujan", std::int64_t{c.ramanujan});
  attr("certificate", v.certificate_attr.value_or(kvcal::to_string(c.kind)));
  attr("certificate_margin", c.margin);
  attr("failure_probability", c.failure_probability);
}

// A hand-written mask file: provenance with this format and version, one mask.
void write_masks_variant(const std::string& name, const MaskRecord& rec, const Variant& v,
                         const std::string& format = kvcal::kMaskFormat,
                         std::int64_t version = kvcal::kMaskFormatVersion) {
  write_raw(name, [&](hid_t file) {
    d::write_provenance(file, format, version, "kvcal_make_fixtures");
    H5Handle masks = d::create_group(file, "masks");
    write_mask_group(masks.get(), rec, v);
  });
}

void write_bad_files(const MaskRecord& good) {
  write_raw("bad_not_kvcal.h5", [](hid_t file) {
    d::write_dataset_1d(file, "data", std::vector<std::int64_t>{1, 2, 3});
    d::write_attr(file, "title", std::string("some other program's file"));
  });
  write_raw("bad_format_int.h5", [](hid_t file) {
    d::write_attr(file, "format", std::int64_t{1});
    d::write_attr(file, "format_version", std::int64_t{1});
  });
  write_masks_variant("bad_bundle.h5", good, {}, "kvcal.bundle", 1);
  write_masks_variant("bad_version99.h5", good, {}, kvcal::kMaskFormat, 99);
  write_masks_variant("bad_version0.h5", good, {}, kvcal::kMaskFormat, 0);
  write_raw("bad_missing_root_attr.h5", [&](hid_t file) {
    d::write_provenance(file, kvcal::kMaskFormat, kvcal::kMaskFormatVersion, "kvcal_make_fixtures");
    H5Adelete(file, "created_utc");
    H5Handle masks = d::create_group(file, "masks");
    write_mask_group(masks.get(), good);
  });
  write_raw("bad_no_masks_group.h5", [](hid_t file) {
    d::write_provenance(file, kvcal::kMaskFormat, kvcal::kMaskFormatVersion, "kvcal_make_fixtures");
  });
  write_raw("bad_empty_masks.h5", [](hid_t file) {
    d::write_provenance(file, kvcal::kMaskFormat, kvcal::kMaskFormatVersion, "kvcal_make_fixtures");
    d::create_group(file, "masks");
  });
  write_raw("bad_masks_is_dataset.h5", [](hid_t file) {
    d::write_provenance(file, kvcal::kMaskFormat, kvcal::kMaskFormatVersion, "kvcal_make_fixtures");
    d::write_dataset_1d(file, "masks", std::vector<std::int64_t>{0});
  });
  write_masks_variant("bad_float_indices.h5", good, with([](Variant& v) { v.float_indices = true; }));
  write_masks_variant("bad_indices_2d.h5", good, with([](Variant& v) { v.indices_2d = true; }));
  write_masks_variant("bad_indptr_short.h5", good, with([](Variant& v) { v.indptr_extra = -1; }));
  write_masks_variant("bad_indptr_long.h5", good, with([](Variant& v) { v.indptr_extra = 1; }));
  write_masks_variant("bad_missing_sigma2.h5", good, with([](Variant& v) { v.skip_attr = "sigma2"; }));
  write_masks_variant("bad_missing_rows.h5", good, with([](Variant& v) { v.skip_attr = "rows"; }));
  write_masks_variant("bad_rows_negative.h5", good, with([](Variant& v) { v.rows_attr = -1; }));
  write_masks_variant("bad_rows_huge.h5", good, with([](Variant& v) { v.rows_attr = std::int64_t{1} << 40; }));
  write_masks_variant("bad_certificate_kind.h5", good, with([](Variant& v) { v.certificate_attr = "magic"; }));
}

void write_defects(const MaskRecord& good, const MaskRecord& not_ramanujan) {
  write_kvcal("good.h5", {good});

  auto edited = [&](auto&& edit) {
    MaskRecord rec = good;
    edit(rec.mask.indices.data() + rec.mask.indptr[0], rec.certificate);  // row 0 of the CSR
    return rec;
  };
  write_kvcal("defect_repeated_column.h5", {edited([](std::int32_t* row, Certificate&) { row[1] = row[0]; })});
  write_kvcal("defect_unsorted.h5", {edited([](std::int32_t* row, Certificate&) { std::swap(row[0], row[1]); })});
  write_kvcal("defect_out_of_range.h5", {edited([&](std::int32_t* row, Certificate&) {
                row[good.certificate.row_degree - 1] = static_cast<std::int32_t>(good.mask.cols);
              })});
  write_kvcal("defect_negative_index.h5", {edited([](std::int32_t* row, Certificate&) { row[0] = -1; })});
  write_kvcal("defect_wrong_degree.h5", {edited([](std::int32_t*, Certificate& c) { ++c.row_degree; })});
  write_kvcal("defect_wrong_sigma2.h5", {edited([](std::int32_t*, Certificate& c) {
                c.sigma2 *= 0.9;  // a better expander than it is; margin kept consistent
                c.margin = c.ramanujan_bound - c.sigma2;
              })});

  // A mask that is not Ramanujan, claiming it is (with an exact certificate).
  MaskRecord liar = not_ramanujan;
  Certificate& lc = liar.certificate;
  lc.ramanujan = true;
  lc.kind = kvcal::CertificateKind::exact;
  lc.failure_probability = 0;
  write_kvcal("defect_claims_ramanujan.h5", {liar});

  // Two disjoint 8x8 all-ones blocks: 8-regular, disconnected, sigma2 = sigma1 = 8.
  MaskRecord two;
  two.id = "mask_0000";
  two.method = "random";
  two.seed = 1;
  two.mask.rows = two.mask.cols = 16;
  two.mask.indptr.push_back(0);
  for (std::int32_t r = 0; r < 16; ++r) {
    for (std::int32_t c = 0; c < 8; ++c) two.mask.indices.push_back((r < 8 ? 0 : 8) + c);
    two.mask.indptr.push_back(two.mask.nnz());
  }
  Certificate& tc = two.certificate;
  tc.row_degree = tc.col_degree = 8;
  tc.biregular = true;
  tc.sigma1 = 8;
  tc.ramanujan_bound = kvcal::ramanujan_bound(8, 8);
  tc.sigma2 = tc.ramanujan_bound;
  tc.margin = 0;
  tc.ramanujan = true;
  tc.kind = kvcal::CertificateKind::exact;
  tc.failure_probability = 0;
  write_kvcal("defect_disconnected.h5", {two});
}

}  // namespace

void write_dumps() {
  namespace t = kvcal::test;
  auto dump = [](const std::string& name, const std::function<void(t::SyntheticSample&)>& edit,
                 const std::function<void(hid_t)>& tamper = {}) {
    t::SyntheticSample s = t::planted_sample("sample_0");
    if (edit) edit(s);
    t::write_dump(g_dir + "/" + name, 2, 8, 4, {s, t::planted_sample("sample_1")}, true, tamper);
    wrote(name);
  };
  dump("dump_good.h5", {});
  dump("dump_nan.h5", [](t::SyntheticSample& s) { s.decode[7] = std::nanf(""); });
  dump("dump_negative.h5", [](t::SyntheticSample& s) { s.prefill[2] = -0.25f; });
  dump("dump_unnormalized.h5", [](t::SyntheticSample& s) { s.prefill[1] += 0.5f; });
  dump("dump_padding.h5", [](t::SyntheticSample& s) { s.decode[162] = 0.01f; });
  dump("dump_layers.h5", {}, [](hid_t f) { d::write_attr(f, "num_layers", std::int64_t{5}); });
  dump("dump_missing.h5", {}, [](hid_t f) { H5Ldelete(f, "/samples/sample_0/decode", H5P_DEFAULT); });
  dump("dump_noattr.h5", {}, [](hid_t f) { H5Adelete(f, "num_q_heads"); });
  dump("dump_format.h5", {}, [](hid_t f) { d::write_attr(f, "format", std::string("kvcal.masks")); });

  // For calibrate-entropy: logits [163, 50] of both samples (one with a NaN),
  // and token statistics of the wrong length.
  auto with_logits = [](bool nan) {
    return [nan](hid_t f) {
      for (const char* name : {"/samples/sample_0", "/samples/sample_1"}) {
        H5Handle g(H5Gopen2(f, name, H5P_DEFAULT), H5Gclose);
        std::vector<float> z(163 * 50);
        for (std::size_t i = 0; i < z.size(); ++i) z[i] = static_cast<float>((i * 7919) % 101) / 10.0f;
        if (nan) z[3 * 50 + 2] = std::nanf("");
        d::write_dataset(g.get(), "logits", {163, 50}, z.data());
      }
    };
  };
  dump("dump_logits.h5", {}, with_logits(false));
  dump("dump_logits_nan.h5", {}, with_logits(true));
  dump("dump_stats_len.h5", {}, [](hid_t f) {
    H5Handle g(H5Gopen2(f, "/samples/sample_0", H5P_DEFAULT), H5Gclose);
    std::vector<float> h(100, 1.0f);
    d::write_dataset(g.get(), "token_entropy", {100}, h.data());
    d::write_dataset(g.get(), "token_varentropy", {100}, h.data());
  });
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: kvcal_make_fixtures <dir>\n");
    return 2;
  }
  g_dir = argv[1];
  try {
    d::h5_init();
    const MaskRecord good = certified_mask(96, 128, 4, kvcal::MaskMethod::random);
    const MaskRecord not_ramanujan = certified_mask(96, 128, 4, kvcal::MaskMethod::lift, false);
    write_bad_files(good);
    write_defects(good, not_ramanujan);
    write_dumps();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvcal_make_fixtures: %s\n", e.what());
    return 1;
  }
  return 0;
}
