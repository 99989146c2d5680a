// Bundle::open: the seal (or a pinned digest) verified with plain reads, then
// kvcal validate's checks, then kvcal's typed readers, then the runtime's own
// checks of every field, above all of what an engine indexes with (defence in
// depth: a gap in the validator must not become an out-of-bounds read in a
// serving process).
#include "kvcal/runtime/bundle.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>

#include <fmt/format.h>

#include "kvcal/core/error.h"
#include "kvcal/graph/csr.h"
#include "kvcal/io/bundle.h"
#include "kvcal/io/seal.h"
#include "kvcal/io/validate.h"
#include "kvcal/spectral/certify.h"

namespace kvcal::runtime {

struct Bundle::Impl {
  std::string path, model, verified;
  std::vector<std::shared_ptr<const Mask>> masks;
  HeadTable heads;
  EntropyThresholds entropy;
};

namespace {

// HDF5 builds without --enable-threadsafe must not be entered by two threads
// at once; opening a bundle is rare, so one lock for every open is enough.
std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

// The message as one line, starting with the path (once).
std::string with_path(const std::string& path, std::string what) {
  std::replace(what.begin(), what.end(), '\n', ' ');
  std::replace(what.begin(), what.end(), '\r', ' ');
  const bool named = what.compare(0, path.size(), path) == 0 && what.size() > path.size() && what[path.size()] == ':';
  return named ? what : path + ": " + what;
}

// Every occurrence of `from` in `text` replaced by `to`.
std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  if (from.empty()) return text;
  for (std::size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The verified file, still open: libhdf5 is given /proc/self/fd/N where that
// exists, so it reads the very file (inode) that was hashed even when the
// path is replaced in between (an artifact store renaming a new version
// into place).
class VerifiedFile {
 public:
  VerifiedFile(const std::string& path, const BundleOpenOptions& o) : path_(path) {
    // O_NONBLOCK: a FIFO given as the path must not hang the open (fstat then refuses it).
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    KVCAL_CHECK(fd_ >= 0, "{}: cannot open ({})", path, std::strerror(errno));
    try {
      verify(o);
    } catch (...) {
      ::close(fd_);  // the destructor of a half-built object does not run
      throw;
    }
    const std::string proc = "/proc/self/fd/" + std::to_string(fd_);
    if (::access(proc.c_str(), R_OK) == 0) hdf5_path_ = proc;
  }
  ~VerifiedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  VerifiedFile(const VerifiedFile&) = delete;
  VerifiedFile& operator=(const VerifiedFile&) = delete;

  // The path libhdf5 opens.
  const std::string& hdf5_path() const { return hdf5_path_.empty() ? path_ : hdf5_path_; }
  // A message about hdf5_path() as one about the path the caller gave.
  std::string named(const std::string& what) const { return replace_all(what, hdf5_path_, path_); }
  const std::string& how() const { return how_; }
  bool sealed() const { return sealed_; }

 private:
  void verify(const BundleOpenOptions& o) {
    const std::string pin = lower(o.expected_sha256);
    KVCAL_CHECK(pin.empty() || (pin.size() == 64 && pin.find_first_not_of("0123456789abcdef") == std::string::npos),
                "expected_sha256 '{}' is not 64 hex digits", o.expected_sha256);
    const SealCheck c = check_seal_fd(fd_, path_, !pin.empty());  // throws on damage, truncation, mismatch
    KVCAL_CHECK(c.state != SealState::neither,
                "{}: neither an integrity seal nor the HDF5 signature at its start: damaged, or not a kvcal bundle",
                path_);
    if (!pin.empty()) {
      KVCAL_CHECK(c.file_sha256 == pin,
                  "{}: SHA-256 {} is not the pinned expected_sha256 {}: not the file that was shipped (damaged or "
                  "replaced)",
                  path_, c.file_sha256, pin);
    }
    if (c.state == SealState::sealed) {
      how_ = pin.empty() ? "seal" : "seal+pinned";
    } else if (!pin.empty()) {
      how_ = "pinned";
    } else {
      KVCAL_CHECK(o.allow_unverified,
                  "{}: a bundle without an integrity seal (format_version 1, written before kvcal sealed bundles), "
                  "refused unverified: re-bundle it with kvcal bundle, or check it with `kvcal validate {}` and open "
                  "it with allow_unverified (or pin its SHA-256 with expected_sha256)",
                  path_, path_);
      how_ = "unverified";
    }
    sealed_ = c.state == SealState::sealed;
  }

  std::string path_, hdf5_path_, how_;
  int fd_ = -1;
  bool sealed_ = false;
};

bool finite_in(double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; }

std::shared_ptr<const Mask> to_mask(const MaskRecord& r) {
  const CsrMask& m = r.mask;
  const std::string what = fmt::format("mask '{}'", r.id);
  constexpr std::int64_t kMaxSide = std::numeric_limits<std::int32_t>::max();
  KVCAL_CHECK(m.rows >= 1 && m.rows <= kMaxSide && m.cols >= 1 && m.cols <= kMaxSide, "{}: shape {}x{} out of range",
              what, m.rows, m.cols);
  const StructureReport s = check_structure(m, false);
  KVCAL_CHECK(s.ok(), "{}: {}", what, s.problems.empty() ? "" : s.problems.front());
  // The runtime finds row i at i * row_degree, so every row must hold the same count.
  KVCAL_CHECK(s.row_degree_min == s.row_degree_max,
              "{}: rows hold {} to {} ones; the runtime needs masks with one row degree", what, s.row_degree_min,
              s.row_degree_max);
  const std::int64_t d1 = s.row_degree_max;
  KVCAL_CHECK(d1 >= 1 && d1 <= m.cols, "{}: row degree {} outside [1, {}]", what, d1, m.cols);
  for (std::int64_t i = 0; i <= m.rows; ++i) {
    KVCAL_CHECK(m.indptr[static_cast<std::size_t>(i)] == i * d1, "{}: indptr[{}] is not {} * row degree", what, i, i);
  }
  const Certificate& c = r.certificate;
  KVCAL_CHECK(c.row_degree == d1 && c.col_degree == s.col_degree_max,
              "{}: attributes row_degree {} / col_degree {} differ from the CSR's {} / {}", what, c.row_degree,
              c.col_degree, d1, s.col_degree_max);
  const double tau = ramanujan_bound(d1, s.col_degree_max);
  KVCAL_CHECK(std::isfinite(c.ramanujan_bound) && std::abs(c.ramanujan_bound - tau) <= 1e-9 * std::max(1.0, tau),
              "{}: ramanujan_bound {} is not sqrt(d1 - 1) + sqrt(d2 - 1) = {}", what, c.ramanujan_bound, tau);
  KVCAL_CHECK(std::isfinite(c.sigma2) && c.sigma2 >= 0, "{}: sigma2 {} is not a finite value >= 0", what, c.sigma2);
  // The stored sigma2 is an estimate; a certified mask's lies at tau at most
  // (up to the estimate's tolerance).
  KVCAL_CHECK(!c.ramanujan || c.sigma2 <= tau * (1 + 1e-6) + 1e-12, "{}: claims Ramanujan, but sigma2 {} > tau {}",
              what, c.sigma2, tau);
  auto out = std::make_shared<Mask>();
  out->rows = m.rows;
  out->cols = m.cols;
  out->row_degree = d1;
  out->indptr = m.indptr;
  out->indices = m.indices;
  out->ramanujan = c.ramanujan || r.certificate_theorem == "LPS";
  out->sigma2 = c.sigma2;
  out->ramanujan_bound = c.ramanujan_bound;
  out->source = "bundle:" + r.id;
  return out;
}

HeadTable to_heads(const HeadProfile& p) {
  HeadTable t;
  const std::int64_t L = p.layers, H = p.kv_heads;
  KVCAL_CHECK(L >= 1 && L <= 4096 && H >= 1 && H <= 4096, "/heads: {} layers x {} KV heads out of range", L, H);
  // Query heads share KV heads in equal groups (GQA).
  KVCAL_CHECK(p.q_heads >= H && p.q_heads <= (std::int64_t{1} << 20) && p.q_heads % H == 0,
              "/heads: {} query heads are not a multiple of {} KV heads", p.q_heads, H);
  const auto n = static_cast<std::size_t>(L * H);
  KVCAL_CHECK(p.role.size() == n && p.pivot.size() == n && p.stability.size() == n && p.similarity.size() == n &&
                  p.budget_ratio.size() == n,
              "/heads: datasets do not hold {} x {} values", L, H);
  t.layers = L;
  t.kv_heads = H;
  t.q_heads = p.q_heads;
  t.role.resize(n);
  double mean = 0;
  for (std::int64_t l = 0; l < L; ++l) {
    for (std::int64_t h = 0; h < H; ++h) {
      const auto i = static_cast<std::size_t>(l * H + h);
      const int r = p.role[i];
      const std::int32_t pv = p.pivot[i];
      KVCAL_CHECK(r >= 1 && r <= 4, "/heads: layer {}, head {}: role {} is not 1..4", l, h, r);
      t.role[i] = static_cast<Role>(r);
      if (r == 3) {
        KVCAL_CHECK(pv == h, "/heads: layer {}, head {}: a pivot whose pivot is {}", l, h, pv);
      } else if (r == 4) {
        KVCAL_CHECK(pv >= 0 && pv < H && p.role[static_cast<std::size_t>(l * H + pv)] == 3,
                    "/heads: layer {}, head {}: a satellite of {}, which is not a pivot of the layer", l, h, pv);
      } else {
        KVCAL_CHECK(pv == -1, "/heads: layer {}, head {}: pivot {} on a head that is neither pivot nor satellite", l, h,
                    pv);
      }
      KVCAL_CHECK(finite_in(p.stability[i], 0, 1) && finite_in(p.similarity[i], 0, 1),
                  "/heads: layer {}, head {}: stability {} / similarity {} outside [0, 1]", l, h, p.stability[i],
                  p.similarity[i]);
      const float b = p.budget_ratio[i];
      KVCAL_CHECK(std::isfinite(b) && b > 0 && b <= 1, "/heads: layer {}, head {}: budget_ratio {} outside (0, 1]", l,
                  h, b);
      KVCAL_CHECK(!(r == 2 || r == 3) || b == 1.0f, "/heads: layer {}, head {}: a full head with budget_ratio {}", l, h,
                  b);
      mean += b;
    }
  }
  t.pivot = p.pivot;
  t.stability = p.stability;
  t.similarity = p.similarity;
  t.budget_ratio = p.budget_ratio;
  const auto& o = p.options;
  t.budget = o.budget.budget;
  KVCAL_CHECK(std::isfinite(t.budget) && t.budget > 0 && t.budget <= 1, "/heads: budget {} outside (0, 1]", t.budget);
  mean /= static_cast<double>(L * H);
  // The rule kvcal validate applies: budgets may only fall short of rho when every head is full.
  KVCAL_CHECK(std::abs(mean - t.budget) <= 1e-4 || mean >= 1.0 - 1e-6,
              "/heads: mean budget_ratio {:.6f} differs from budget {}", mean, t.budget);
  t.tau_stable = o.taxonomy.tau_stable;
  t.tau_sim = o.taxonomy.tau_sim;
  t.tau_drift = o.tau_drift;
  KVCAL_CHECK(finite_in(t.tau_stable, 0, 1) && finite_in(t.tau_sim, 0, 1) && finite_in(t.tau_drift, 0, 1),
              "/heads: tau_stable {} / tau_sim {} / tau_drift {} outside [0, 1]", t.tau_stable, t.tau_sim, t.tau_drift);
  t.drift_window = o.drift_window;
  KVCAL_CHECK(t.drift_window >= 1 && t.drift_window <= (1 << 20), "/heads: drift_window {} out of range",
              t.drift_window);
  t.topk = o.overlap.topk;
  KVCAL_CHECK(t.topk >= 1 && t.topk <= (std::int64_t{1} << 40), "/heads: topk {} out of range", t.topk);
  t.topk_frac = o.overlap.topk_frac;
  KVCAL_CHECK(finite_in(t.topk_frac, 0, 1), "/heads: topk_frac {} outside [0, 1]", t.topk_frac);
  t.pool_kernel = o.overlap.pool_kernel;
  KVCAL_CHECK(t.pool_kernel >= 1 && t.pool_kernel <= 4096, "/heads: pool_kernel {} outside [1, 4096]", t.pool_kernel);
  return t;
}

EntropyThresholds to_entropy(const EntropyCalibration& c) {
  EntropyThresholds e;
  e.entropy = c.entropy_threshold;
  e.varentropy = c.varentropy_threshold;
  KVCAL_CHECK(std::isfinite(e.entropy) && e.entropy >= 0 && std::isfinite(e.varentropy) && e.varentropy >= 0,
              "/entropy: thresholds {} / {} are not finite values >= 0", e.entropy, e.varentropy);
  e.rule_both = c.options.rule == TriggerRule::both;
  e.unit_bits = c.options.unit == EntropyUnit::bits;
  e.page_size = c.options.page.page_size;
  KVCAL_CHECK(e.page_size >= 1 && e.page_size <= (1 << 20), "/entropy: page_size {} outside [1, 2^20]", e.page_size);
  e.varentropy_temporal = c.options.page.varentropy == PageVarentropy::temporal;
  e.percentile = c.options.percentile;
  KVCAL_CHECK(std::isfinite(e.percentile) && e.percentile > 0 && e.percentile < 100,
              "/entropy: percentile {} outside (0, 100)", e.percentile);
  e.calibration_trigger_rate = c.trigger_rate;
  KVCAL_CHECK(finite_in(e.calibration_trigger_rate, 0, 1), "/entropy: trigger_rate {} outside [0, 1]",
              e.calibration_trigger_rate);
  return e;
}

}  // namespace

Bundle::Bundle() : impl_(std::make_unique<Impl>()) {}
Bundle::~Bundle() = default;

std::unique_ptr<Bundle> Bundle::open(const std::string& path) { return open(path, BundleOpenOptions{}); }

std::unique_ptr<Bundle> Bundle::open(const std::string& path, const BundleOpenOptions& options) {
  try {
    // The bytes first, with no lock held (hashing a large file takes a while)
    // and no libhdf5 call.
    const VerifiedFile file(path, options);
    const std::string& h5path = file.hdf5_path();
    BundleContents contents;
    {
      std::lock_guard<std::mutex> lock(hdf5_mutex());
      try {
        const ValidationReport report = validate_artifact(h5path, false);  // the seal is checked already
        if (!report.ok()) {
          const std::size_t more = report.problems.size() - 1;
          fail("{}{}", with_path(path, file.named(report.problems.front())),
               more == 0 ? std::string() : fmt::format(" ({} more; kvcal validate {} lists them)", more, path));
        }
        KVCAL_CHECK(report.format == kBundleFormat, "{}: a '{}' file, but a '{}' file is needed", path, report.format,
                    kBundleFormat);
        KVCAL_CHECK(file.sealed() || report.format_version < 2,
                    "{}: a format_version {} bundle without its integrity seal (its first 512 bytes were overwritten "
                    "or stripped): fetch it again, or re-bundle",
                    path, report.format_version);
        contents = read_bundle(h5path);
      } catch (const std::exception& e) {
        throw Error(file.named(e.what()));
      }
    }
    std::unique_ptr<Bundle> b(new Bundle());
    Impl& s = *b->impl_;
    s.path = path;
    s.verified = file.how();
    s.model = contents.model;
    for (const MaskRecord& r : contents.masks) s.masks.push_back(to_mask(r));
    s.heads = to_heads(contents.heads);
    s.entropy = to_entropy(contents.entropy);
    return b;
  } catch (const std::exception& e) {
    throw Error(with_path(path, e.what()));
  } catch (...) {
    throw Error(with_path(path, "unknown error while reading the bundle"));
  }
}

const std::string& Bundle::path() const { return impl_->path; }
const std::string& Bundle::verified() const { return impl_->verified; }
const std::string& Bundle::model() const { return impl_->model; }
const std::vector<std::shared_ptr<const Mask>>& Bundle::masks() const { return impl_->masks; }
const HeadTable& Bundle::heads() const { return impl_->heads; }
const EntropyThresholds& Bundle::entropy() const { return impl_->entropy; }

std::shared_ptr<const Mask> Bundle::find_mask(const MaskKey& key) const {
  for (const auto& m : impl_->masks) {
    if (m->rows == key.rows && m->cols == key.cols && m->row_degree == key.row_degree) return m;
  }
  return nullptr;
}

}  // namespace kvcal::runtime
