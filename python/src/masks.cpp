// Masks: generate (every kvcal mask-gen method), certify, verify stored
// claims (kvcal mask-certify), read and write kvcal.masks files.
#include <filesystem>
#include <optional>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.h"
#include "kvcal/core/error.h"
#include "kvcal/graph/csr.h"
#include "kvcal/io/mask_gen.h"
#include "kvcal/io/masks.h"
#include "kvcal/spectral/certify.h"
#include "kvcal/spectral/verify.h"

namespace kvcal::py {

namespace {

CsrMask csr_from_arrays(std::int64_t rows, std::int64_t cols, const AnyArray& indptr, const AnyArray& indices) {
  check_array(indptr, "indptr", dt<std::int64_t>(), {-1}, true);
  check_array(indices, "indices", dt<std::int32_t>(), {-1}, true);
  if (rows < 0 || cols < 0) value_error("rows {} and cols {} must be non-negative", rows, cols);
  if (static_cast<std::int64_t>(indptr.shape(0)) != rows + 1) {
    value_error("indptr has {} entries where rows + 1 = {} are needed", indptr.shape(0), rows + 1);
  }
  CsrMask m;
  m.rows = rows;
  m.cols = cols;
  const auto* p = static_cast<const std::int64_t*>(indptr.data());
  const auto* q = static_cast<const std::int32_t*>(indices.data());
  m.indptr.assign(p, p + indptr.shape(0));
  m.indices.assign(q, q + indices.shape(0));
  return m;
}

CertifyOptions certify_options(std::int64_t exact_limit, double max_failure_probability, int threads) {
  if (exact_limit < 0) value_error("exact_limit {} must be 0 or more", exact_limit);
  if (!(max_failure_probability > 0 && max_failure_probability < 1)) {
    value_error("max_failure_probability {} must lie in (0, 1)", max_failure_probability);
  }
  if (threads < 0) value_error("threads {} must be 0 (all cores) or more", threads);
  CertifyOptions o;
  o.exact_limit = exact_limit;
  o.max_failure_probability = max_failure_probability;
  o.threads = threads;
  return o;
}

void require_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw OsErr{fmt::format("{}: no such file", path)};
}

}  // namespace

void bind_masks(nb::module_& m) {
  nb::class_<Certificate>(m, "Certificate", "The spectral certificate of a mask (HEX §3.2, App. A.1).")
      .def_ro("row_degree", &Certificate::row_degree, "d1 (maximum row degree)")
      .def_ro("col_degree", &Certificate::col_degree, "d2 (maximum column degree)")
      .def_ro("biregular", &Certificate::biregular)
      .def_ro("sigma1", &Certificate::sigma1, "largest singular value")
      .def_ro("sigma2", &Certificate::sigma2, "second singular value")
      .def_ro("ramanujan_bound", &Certificate::ramanujan_bound, "tau = sqrt(d1 - 1) + sqrt(d2 - 1)")
      .def_ro("ramanujan", &Certificate::ramanujan, "sigma2 <= tau proven")
      .def_prop_ro(
          "kind", [](const Certificate& c) { return std::string(to_string(c.kind)); },
          "'exact', 'probabilistic' or 'none'")
      .def_ro("margin", &Certificate::margin, "tau - sigma2")
      .def_ro("failure_probability", &Certificate::failure_probability)
      .def_ro("estimate_converged", &Certificate::estimate_converged)
      .def_ro("lanczos_steps", &Certificate::lanczos_steps)
      .def("__repr__", [](const Certificate& c) {
        return fmt::format("Certificate(d1={}, d2={}, sigma2={:.6f}, tau={:.6f}, ramanujan={}, kind='{}')",
                           c.row_degree, c.col_degree, c.sigma2, c.ramanujan_bound, c.ramanujan ? "True" : "False",
                           to_string(c.kind));
      });

  nb::class_<MaskRecord>(m, "MaskRecord",
                         "One mask of a kvcal.masks file: the CSR (indptr int64 [rows+1], indices int32 [nnz]) and "
                         "what it claims.")
      .def(
          "__init__",
          [](MaskRecord* r, std::int64_t rows, std::int64_t cols, const AnyArray& indptr, const AnyArray& indices,
             const Certificate& certificate, const std::string& id, const std::string& method, std::uint64_t seed) {
            new (r) MaskRecord();
            r->mask = csr_from_arrays(rows, cols, indptr, indices);
            r->certificate = certificate;
            r->id = id;
            r->method = method;
            r->seed = seed;
          },
          nb::arg("rows"), nb::arg("cols"), nb::arg("indptr"), nb::arg("indices"), nb::arg("certificate"),
          nb::arg("id") = "mask_0000", nb::arg("method") = "random", nb::arg("seed") = 0,
          "A record to write with write_masks (the arrays are copied).")
      .def_rw("id", &MaskRecord::id)
      .def_prop_ro("rows", [](const MaskRecord& r) { return r.mask.rows; })
      .def_prop_ro("cols", [](const MaskRecord& r) { return r.mask.cols; })
      .def_prop_ro("nnz", [](const MaskRecord& r) { return r.mask.nnz(); })
      .def_prop_ro(
          "indptr",
          [](nb::handle self) {
            const auto& r = nb::cast<const MaskRecord&>(self);
            return view(r.mask.indptr.data(), {r.mask.indptr.size()}, self);
          },
          "int64 [rows + 1], a read-only view (no copy)")
      .def_prop_ro(
          "indices",
          [](nb::handle self) {
            const auto& r = nb::cast<const MaskRecord&>(self);
            return view(r.mask.indices.data(), {r.mask.indices.size()}, self);
          },
          "int32 [nnz], a read-only view (no copy)")
      .def_ro("method", &MaskRecord::method)
      .def_ro("seed", &MaskRecord::seed)
      .def_ro("certificate", &MaskRecord::certificate)
      .def_ro("lps_p", &MaskRecord::lps_p)
      .def_ro("lps_q", &MaskRecord::lps_q)
      .def_ro("construction", &MaskRecord::construction)
      .def_ro("certificate_theorem", &MaskRecord::certificate_theorem)
      .def_ro("transposed", &MaskRecord::transposed)
      .def_ro("lift_seeds", &MaskRecord::lift_seeds)
      .def("__repr__", [](const MaskRecord& r) {
        return fmt::format("MaskRecord(id='{}', {}x{}, method='{}', seed={}, ramanujan={})", r.id, r.mask.rows,
                           r.mask.cols, r.method, r.seed, r.certificate.ramanujan ? "True" : "False");
      });

  nb::class_<MaskFile>(m, "MaskFile", "A kvcal.masks file as read.")
      .def_ro("format_version", &MaskFile::format_version)
      .def_ro("kvcal_version", &MaskFile::kvcal_version)
      .def_ro("command_line", &MaskFile::command_line)
      .def_ro("created_utc", &MaskFile::created_utc)
      .def_ro("masks", &MaskFile::masks);

  nb::class_<Verification>(m, "Verification", "What mask-certify re-derives for one record.")
      .def_prop_ro("ok", &Verification::ok, "no stored claim is false")
      .def_ro("false_claims", &Verification::false_claims)
      .def_ro("recertified", &Verification::recertified)
      .def_ro("recomputed", &Verification::recomputed)
      .def_prop_ro("structure_problems", [](const Verification& v) { return v.structure.problems; });

  m.def(
      "generate_masks",
      [](std::int64_t rows, std::int64_t cols, std::optional<std::int64_t> row_degree, std::optional<double> sparsity,
         const std::string& method, std::uint64_t seed, std::int64_t count, std::int64_t tries, std::int64_t lps_p,
         std::int64_t lps_q, const std::string& construction, bool transpose, std::int64_t lift_to,
         bool allow_non_ramanujan, std::int64_t exact_limit, double max_failure_probability, int threads) {
        MaskGenOptions o;
        o.method = method;
        o.rows = rows;
        o.cols = cols;
        o.row_degree = row_degree;
        o.sparsity = sparsity;
        o.seed = seed;
        o.count = count;
        o.tries = tries;
        o.lps_p = lps_p;
        o.lps_q = lps_q;
        o.construction = construction;
        o.transpose = transpose;
        o.lift_to = lift_to;
        o.allow_non_ramanujan = allow_non_ramanujan;
        o.certify = certify_options(exact_limit, max_failure_probability, threads);
        nb::gil_scoped_release release;
        return generate_masks(o);
      },
      nb::arg("rows") = 0, nb::arg("cols") = 0, nb::kw_only(), nb::arg("row_degree") = nb::none(),
      nb::arg("sparsity") = nb::none(), nb::arg("method") = "random", nb::arg("seed") = 1, nb::arg("count") = 1,
      nb::arg("tries") = 16, nb::arg("lps_p") = 0, nb::arg("lps_q") = 0, nb::arg("construction") = "",
      nb::arg("transpose") = false, nb::arg("lift_to") = 0, nb::arg("allow_non_ramanujan") = false,
      nb::arg("exact_limit") = 8192, nb::arg("max_failure_probability") = 1e-9, nb::arg("threads") = 0,
      "Certified expander masks, as `kvcal mask-gen` makes them (same options and seeds: byte-identical CSR).\n"
      "Method 'random' or 'lift' takes rows, cols and one of row_degree / sparsity; method 'lps' takes lps_p,\n"
      "lps_q and construction. transpose, lift_to (certified 2-lifts), count distinct masks, tries per mask.\n"
      "Returns a list of MaskRecord; raises kvcal.Error when no candidate certifies (allow_non_ramanujan\n"
      "keeps the best instead).");

  m.def(
      "certify",
      [](std::int64_t rows, std::int64_t cols, const AnyArray& indptr, const AnyArray& indices,
         std::int64_t exact_limit, double max_failure_probability, int threads) {
        const CsrMask mask = csr_from_arrays(rows, cols, indptr, indices);
        const CertifyOptions o = certify_options(exact_limit, max_failure_probability, threads);
        const StructureReport s = check_structure(mask, false);
        if (!s.ok()) value_error("not a well-formed CSR mask: {}", s.problems.front());
        nb::gil_scoped_release release;
        return certify(mask, o);
      },
      nb::arg("rows"), nb::arg("cols"), nb::arg("indptr"), nb::arg("indices"), nb::kw_only(),
      nb::arg("exact_limit") = 8192, nb::arg("max_failure_probability") = 1e-9, nb::arg("threads") = 0,
      "The spectral certificate of a CSR mask (indptr int64 [rows+1], indices int32 [nnz], ascending per row).");

  m.def(
      "verify",
      [](const MaskRecord& record, std::int64_t exact_limit, int threads) {
        const CertifyOptions o = certify_options(exact_limit, 1e-9, threads);
        nb::gil_scoped_release release;
        return verify_record(record, o);
      },
      nb::arg("record"), nb::kw_only(), nb::arg("exact_limit") = 8192, nb::arg("threads") = 0,
      "Re-derives every claim stored with a mask record from its CSR (what `kvcal mask-certify` checks).");

  m.def(
      "read_masks",
      [](const std::string& path) {
        require_file(path);
        nb::gil_scoped_release release;
        return read_mask_file(path);
      },
      nb::arg("path"), "Reads a kvcal.masks file (every record with its stored claims).");

  m.def(
      "write_masks",
      [](const std::string& path, const std::vector<MaskRecord>& masks, const std::string& command_line) {
        if (masks.empty()) value_error("write_masks: no masks to write");
        try {
          check_mask_output_path(path);
        } catch (const kvcal::Error& e) {
          throw OsErr{e.what()};
        }
        for (const MaskRecord& r : masks) {
          const StructureReport s = check_structure(r.mask, false);
          if (!s.ok()) value_error("{}: not a well-formed CSR mask: {}", r.id, s.problems.front());
        }
        nb::gil_scoped_release release;
        write_mask_file(path, masks, command_line);
      },
      nb::arg("path"), nb::arg("masks"), nb::arg("command_line") = "kvcal (Python) write_masks",
      "Writes mask records to a kvcal.masks file atomically (temporary file, then rename).");
}

}  // namespace kvcal::py
