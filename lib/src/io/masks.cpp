#include "kvcal/io/masks.h"

#include <limits>

#include "io/bundle_internal.h"
#include "io/h5.h"
#include "kvcal/core/version.h"
#include "kvcal/graph/lps.h"

namespace kvcal {

using detail::H5Handle;

void write_mask_file(const std::string& path, const std::vector<MaskRecord>& masks, const std::string& command_line) {
  detail::write_atomically(path, [&](hid_t file) {
    detail::write_provenance(file, kMaskFormat, kMaskFormatVersion, command_line);
    H5Handle root = detail::create_group(file, "masks");
    for (const MaskRecord& rec : masks) {
      const Certificate& c = rec.certificate;
      H5Handle g = detail::create_group(root.get(), rec.id);
      detail::write_dataset_1d(g.get(), "indptr", rec.mask.indptr);
      detail::write_dataset_1d(g.get(), "indices", rec.mask.indices);
      detail::write_attr(g.get(), "rows", rec.mask.rows);
      detail::write_attr(g.get(), "cols", rec.mask.cols);
      detail::write_attr(g.get(), "row_degree", c.row_degree);
      detail::write_attr(g.get(), "col_degree", c.col_degree);
      detail::write_attr(g.get(), "biregular", std::int64_t{c.biregular});
      detail::write_attr(g.get(), "method", rec.method);
      detail::write_attr(g.get(), "seed", rec.seed);
      detail::write_attr(g.get(), "sigma1", c.sigma1);
      detail::write_attr(g.get(), "sigma2", c.sigma2);
      detail::write_attr(g.get(), "ramanujan_bound", c.ramanujan_bound);
      detail::write_attr(g.get(), "ramanujan", std::int64_t{c.ramanujan});
      detail::write_attr(g.get(), "certificate", std::string(to_string(c.kind)));
      detail::write_attr(g.get(), "certificate_margin", c.margin);
      detail::write_attr(g.get(), "failure_probability", c.failure_probability);
      detail::write_attr(g.get(), "transposed", std::int64_t{rec.transposed});
      detail::write_attr(g.get(), "lifts", static_cast<std::int64_t>(rec.lift_seeds.size()));
      if (!rec.lift_seeds.empty()) detail::write_attr(g.get(), "lift_seeds", rec.lift_seeds);
      if (rec.method == "lps") {
        detail::write_attr(g.get(), "lps_p", rec.lps_p);
        detail::write_attr(g.get(), "lps_q", rec.lps_q);
        detail::write_attr(g.get(), "construction", rec.construction);
        detail::write_attr(g.get(), "certificate_theorem",
                           rec.certificate_theorem.empty() ? std::string("none") : rec.certificate_theorem);
      }
    }
  });
}

void check_mask_output_path(const std::string& path) { detail::check_output_path(path); }

MaskFile read_mask_file(const std::string& path) {
  MaskFile out;
  H5Handle file = detail::open_artifact(path, kMaskFormat, kMaskFormatVersion, &out.format_version);
  out.kvcal_version = detail::read_attr_string(file.get(), "kvcal_version", path);
  out.command_line = detail::read_attr_string(file.get(), "command_line", path);
  out.created_utc = detail::read_attr_string(file.get(), "created_utc", path);
  H5Handle root = detail::open_group(file.get(), "masks", path);
  for (const std::string& id : detail::list_links(root.get())) {
    out.masks.push_back(detail::read_mask_group(root.get(), id, path, fmt::format("{}: mask '{}'", path, id)));
  }
  return out;
}

MaskRecord detail::read_mask_group(hid_t masks, const std::string& id, const std::string& where,
                                   const std::string& ctx) {
  H5Handle g = detail::open_group(masks, id, where);
  MaskRecord rec;
  rec.id = id;
  CsrMask& m = rec.mask;
  m.rows = detail::read_attr_int(g.get(), "rows", ctx);
  m.cols = detail::read_attr_int(g.get(), "cols", ctx);
  constexpr std::int64_t kMaxSide = std::numeric_limits<std::int32_t>::max();
  KVCAL_CHECK(m.rows >= 1 && m.rows <= kMaxSide && m.cols >= 1 && m.cols <= kMaxSide, "{}: shape {}x{} is out of range",
              ctx, m.rows, m.cols);
  m.indptr = detail::read_int64_1d(g.get(), "indptr", ctx, m.rows + 1);
  KVCAL_CHECK(static_cast<std::int64_t>(m.indptr.size()) == m.rows + 1,
              "{}: indptr has {} entries, expected rows + 1 = {}", ctx, m.indptr.size(), m.rows + 1);
  // A well-formed mask has at most rows * cols entries and indptr.back() of them.
  const std::int64_t max_nnz = std::min<std::int64_t>(m.rows * m.cols, std::int64_t{1} << 36);
  m.indices = detail::read_int32_1d(g.get(), "indices", ctx, max_nnz);
  rec.method = detail::read_attr_string(g.get(), "method", ctx);
  rec.seed = detail::read_attr_uint(g.get(), "seed", ctx);
  Certificate& c = rec.certificate;
  c.row_degree = detail::read_attr_int(g.get(), "row_degree", ctx);
  c.col_degree = detail::read_attr_int(g.get(), "col_degree", ctx);
  c.biregular = detail::read_attr_int(g.get(), "biregular", ctx) != 0;
  c.sigma1 = detail::read_attr_double(g.get(), "sigma1", ctx);
  c.sigma2 = detail::read_attr_double(g.get(), "sigma2", ctx);
  c.ramanujan_bound = detail::read_attr_double(g.get(), "ramanujan_bound", ctx);
  c.ramanujan = detail::read_attr_int(g.get(), "ramanujan", ctx) != 0;
  try {
    c.kind = parse_certificate_kind(detail::read_attr_string(g.get(), "certificate", ctx));
  } catch (const Error& e) {
    fail("{}: {}", ctx, e.what());  // name the file and mask, like every other read error
  }
  c.margin = detail::read_attr_double(g.get(), "certificate_margin", ctx);
  c.failure_probability = detail::read_attr_double(g.get(), "failure_probability", ctx);
  // Optional attributes (absent in files from before they existed).
  if (detail::has_attr(g.get(), "transposed")) rec.transposed = detail::read_attr_int(g.get(), "transposed", ctx) != 0;
  const std::int64_t lifts = detail::has_attr(g.get(), "lifts") ? detail::read_attr_int(g.get(), "lifts", ctx) : 0;
  KVCAL_CHECK(lifts >= 0 && lifts <= 62, "{}: lifts = {} is out of range", ctx, lifts);
  if (lifts > 0) {
    rec.lift_seeds = detail::read_attr_uint_array(g.get(), "lift_seeds", ctx, 62);
    KVCAL_CHECK(static_cast<std::int64_t>(rec.lift_seeds.size()) == lifts,
                "{}: lifts = {} but lift_seeds holds {} seeds", ctx, lifts, rec.lift_seeds.size());
  }
  if (rec.method == "lps") {
    rec.lps_p = detail::read_attr_int(g.get(), "lps_p", ctx);
    rec.lps_q = detail::read_attr_int(g.get(), "lps_q", ctx);
    rec.construction = detail::read_attr_string(g.get(), "construction", ctx);
    rec.certificate_theorem = detail::read_attr_string(g.get(), "certificate_theorem", ctx);
    if (rec.certificate_theorem == "none") rec.certificate_theorem.clear();
  }
  return rec;
}

Verification verify_record(const MaskRecord& rec, const CertifyOptions& options) {
  Verification v = verify_claims(rec.mask, rec.certificate, options);
  if (rec.certificate_theorem.empty()) return v;
  if (rec.certificate_theorem != "LPS") {
    v.false_claims.push_back(fmt::format("unknown certificate_theorem '{}'", rec.certificate_theorem));
    return v;
  }
  if (!rec.lift_seeds.empty()) {
    v.false_claims.push_back("claims the LPS theorem for a lifted mask (the theorem covers only the base)");
    return v;
  }
  const std::string problem = lps_problem(rec.lps_p, rec.lps_q);
  if (!problem.empty()) {
    v.false_claims.push_back(fmt::format("claims the LPS theorem, but {}", problem));
    return v;
  }
  try {
    const LpsGraph graph = build_lps_graph(rec.lps_p, rec.lps_q);
    CsrMask reference = lps_mask(graph, parse_lps_construction(rec.construction));
    if (rec.transposed) reference = transpose(reference);
    if (!(reference == rec.mask)) {
      v.false_claims.push_back(fmt::format("claims the LPS theorem but is not the {} mask of X^{{{},{}}}",
                                           rec.construction, rec.lps_p, rec.lps_q));
    }
  } catch (const Error& e) {
    v.false_claims.push_back(fmt::format("claims the LPS theorem, but: {}", e.what()));
  }
  return v;
}

}  // namespace kvcal
