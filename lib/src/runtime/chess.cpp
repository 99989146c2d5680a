#include "kvcal/runtime/chess.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "runtime/checks.h"

namespace kvcal::runtime {

using detail::fail;
using detail::require;

namespace {

bool ratio_ok(double r) { return std::isfinite(r) && r > 0 && r <= 1; }

// Level selection of Algorithm 1: S' = S * active; tau = quantile(S', 1 - rho);
// M = (S' >= tau) & active. `active` null: every unit active (the grids).
void select_level(const float* scores, std::int64_t n, const std::uint8_t* active, double rho, std::uint8_t* mask,
                  std::vector<float>& buf) {
  if (n == 0) return;
  buf.resize(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) buf[static_cast<std::size_t>(i)] = (!active || active[i]) ? scores[i] : 0.0f;
  const float tau = quantile(buf.data(), n, 1.0 - rho);
  for (std::int64_t i = 0; i < n; ++i)
    mask[i] = static_cast<std::uint8_t>(buf[static_cast<std::size_t>(i)] >= tau && (!active || active[i]));
}

}  // namespace

ChessOptions chess_preset(const char* name, const ChessOptions& base) {
  ChessOptions o = base;
  const std::string n = name ? name : "";
  if (n == "conservative") {
    o.rho_grid = o.rho_chunk = o.rho_page = 0.9;
  } else if (n == "moderate") {
    o.rho_grid = 0.8;
    o.rho_chunk = o.rho_page = 0.7;
  } else if (n == "aggressive") {
    o.rho_grid = 0.5;
    o.rho_chunk = 0.2;
    o.rho_page = 0.1;
  } else {
    throw Error("unknown CHESS setting '" + n + "' (known: conservative, moderate, aggressive)");
  }
  return o;
}

void check_options(const ChessOptions& o) {
  require(o.page_size >= 1 && o.page_size <= (1 << 20), "CHESS page size must be in [1, 2^20]");
  require(o.chunk_pages >= 1 && o.grid_chunks >= 1, "chunk pages and grid chunks must be >= 1");
  require(ratio_ok(o.rho_grid) && ratio_ok(o.rho_chunk) && ratio_ok(o.rho_page),
          "CHESS retention ratios must be in (0, 1]");
  require(o.sink_pages >= 0 && o.recent_pages >= 1, "sink pages must be >= 0 and recent pages >= 1");
}

float quantile(const float* values, std::int64_t n, double q) {
  require(n >= 1, "quantile of an empty set");
  require(q >= 0 && q <= 1, "quantile level must be in [0, 1]");
  std::vector<float> v(values, values + n);
  const double pos = q * static_cast<double>(n - 1);
  const auto lo = static_cast<std::int64_t>(std::floor(pos));
  const std::int64_t hi = std::min(lo + 1, n - 1);
  std::nth_element(v.begin(), v.begin() + lo, v.end());
  const float a = v[static_cast<std::size_t>(lo)];
  float b = a;
  if (hi != lo) b = *std::min_element(v.begin() + lo + 1, v.end());
  const double frac = pos - static_cast<double>(lo);
  return static_cast<float>(static_cast<double>(a) + frac * (static_cast<double>(b) - a));
}

void hierarchical_select(const float* gs, std::int64_t grids, const float* cs, const std::int32_t* chunk_grid,
                         std::int64_t chunks, const float* ps, const std::int32_t* page_chunk, std::int64_t pages,
                         double rg, double rc, double rp, std::uint8_t* gm, std::uint8_t* cm, std::uint8_t* pm) {
  require(ratio_ok(rg) && ratio_ok(rc) && ratio_ok(rp), "retention ratios must be in (0, 1]");
  std::vector<float> buf;
  std::vector<std::uint8_t> active;
  select_level(gs, grids, nullptr, rg, gm, buf);
  active.resize(static_cast<std::size_t>(chunks));
  for (std::int64_t c = 0; c < chunks; ++c) {
    require(chunk_grid[c] >= 0 && chunk_grid[c] < grids, "chunk parent out of range");
    active[static_cast<std::size_t>(c)] = gm[chunk_grid[c]];
  }
  select_level(cs, chunks, active.data(), rc, cm, buf);
  active.resize(static_cast<std::size_t>(pages));
  for (std::int64_t p = 0; p < pages; ++p) {
    require(page_chunk[p] >= 0 && page_chunk[p] < chunks, "page parent out of range");
    active[static_cast<std::size_t>(p)] = cm[page_chunk[p]];
  }
  select_level(ps, pages, active.data(), rp, pm, buf);
}

// ---------------------------------------------------------------- index

struct ChessIndex::Impl {
  std::int64_t dim = 0;
  ChessOptions opt;
  std::int64_t tokens = 0;
  std::vector<double> page_sum;  // running sum of the page being filled
  std::vector<float> store;      // [rows][dim]
  std::vector<std::int64_t> page_rows, chunk_rows, grid_rows;
  std::vector<std::int32_t> page_chunk, chunk_grid;
  std::vector<double> chunk_acc, grid_acc;  // sums of the open chunk's pages and the open grid's chunks

  std::int64_t rows() const { return static_cast<std::int64_t>(store.size()) / dim; }
  float* row(std::int64_t r) { return store.data() + r * dim; }
  const float* row(std::int64_t r) const { return store.data() + r * dim; }
  std::int64_t add_row() {
    store.resize(store.size() + static_cast<std::size_t>(dim), 0.0f);
    return rows() - 1;
  }

  void add_token(const float* k) {
    for (std::int64_t i = 0; i < dim; ++i) page_sum[static_cast<std::size_t>(i)] += k[i];
    ++tokens;
    if (tokens % opt.page_size == 0) close_page();
  }

  // A page completed: its vector, then the means of its chunk and grid.
  void close_page() {
    const auto p = static_cast<std::int64_t>(page_rows.size());
    const std::int64_t pr = add_row();
    page_rows.push_back(pr);
    const double inv = 1.0 / static_cast<double>(opt.page_size);
    for (std::int64_t i = 0; i < dim; ++i) row(pr)[i] = static_cast<float>(page_sum[static_cast<std::size_t>(i)] * inv);
    std::fill(page_sum.begin(), page_sum.end(), 0.0);
    const std::int64_t c = p / opt.chunk_pages;
    const bool new_chunk = p % opt.chunk_pages == 0;
    if (new_chunk) {
      chunk_rows.push_back(add_row());
      std::fill(chunk_acc.begin(), chunk_acc.end(), 0.0);
      const std::int64_t g = c / opt.grid_chunks;
      if (c % opt.grid_chunks == 0) {
        grid_rows.push_back(add_row());
        std::fill(grid_acc.begin(), grid_acc.end(), 0.0);
      }
      chunk_grid.push_back(static_cast<std::int32_t>(g));
    }
    page_chunk.push_back(static_cast<std::int32_t>(c));
    // Chunk vector: mean of its pages so far; grid vector: mean of its chunks' vectors.
    const std::int64_t in_chunk = p % opt.chunk_pages + 1;
    float* cv = row(chunk_rows[static_cast<std::size_t>(c)]);
    const float* pv = row(pr);
    const std::int64_t g = c / opt.grid_chunks;
    float* gv = row(grid_rows[static_cast<std::size_t>(g)]);
    const std::int64_t chunks_in_grid = c % opt.grid_chunks + 1;
    for (std::int64_t i = 0; i < dim; ++i) {
      const auto ii = static_cast<std::size_t>(i);
      const double old_c = in_chunk > 1 ? static_cast<double>(cv[i]) : 0.0;
      chunk_acc[ii] += pv[i];
      const double new_c = chunk_acc[ii] / static_cast<double>(in_chunk);
      cv[i] = static_cast<float>(new_c);
      // grid_acc holds the sum of the grid's closed chunks plus the open one's current mean.
      grid_acc[ii] += new_c - old_c;
      gv[i] = static_cast<float>(grid_acc[ii] / static_cast<double>(chunks_in_grid));
    }
  }
};

ChessIndex::ChessIndex(std::int64_t dim, const ChessOptions& options) : impl_(std::make_unique<Impl>()) {
  check_options(options);
  require(dim >= 1 && dim <= (std::int64_t{1} << 24), "CHESS vector dimension must be in [1, 2^24]");
  impl_->dim = dim;
  impl_->opt = options;
  impl_->page_sum.assign(static_cast<std::size_t>(dim), 0.0);
  impl_->chunk_acc.assign(static_cast<std::size_t>(dim), 0.0);
  impl_->grid_acc.assign(static_cast<std::size_t>(dim), 0.0);
}
ChessIndex::~ChessIndex() = default;
ChessIndex::ChessIndex(ChessIndex&&) noexcept = default;
ChessIndex& ChessIndex::operator=(ChessIndex&&) noexcept = default;

void ChessIndex::append(const float* keys, std::int64_t n, std::int64_t stride) {
  require(n >= 0 && (n == 0 || stride >= impl_->dim), "bad token count or stride");
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t i = 0; i < impl_->dim; ++i)
      if (!std::isfinite(keys[t * stride + i]))
        throw Error("non-finite key at token " + std::to_string(impl_->tokens + t));
  for (std::int64_t t = 0; t < n; ++t) impl_->add_token(keys + t * stride);
}

void ChessIndex::append(const half_bits* keys, std::int64_t n, std::int64_t stride) {
  require(n >= 0 && (n == 0 || stride >= impl_->dim), "bad token count or stride");
  // The whole batch is checked first: a rejected call appends nothing.
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t i = 0; i < impl_->dim; ++i)
      if ((keys[t * stride + i] & 0x7c00u) == 0x7c00u)
        throw Error("non-finite key at token " + std::to_string(impl_->tokens + t));
  std::vector<float> row(static_cast<std::size_t>(impl_->dim));
  for (std::int64_t t = 0; t < n; ++t) {
    halves_to_floats(keys + t * stride, impl_->dim, row.data());
    impl_->add_token(row.data());
  }
}

std::int64_t ChessIndex::dim() const { return impl_->dim; }
std::int64_t ChessIndex::tokens() const { return impl_->tokens; }
std::int64_t ChessIndex::pages() const { return static_cast<std::int64_t>(impl_->page_rows.size()); }
std::int64_t ChessIndex::chunks() const { return static_cast<std::int64_t>(impl_->chunk_rows.size()); }
std::int64_t ChessIndex::grids() const { return static_cast<std::int64_t>(impl_->grid_rows.size()); }
const ChessOptions& ChessIndex::options() const { return impl_->opt; }
const float* ChessIndex::store() const { return impl_->store.data(); }
std::int64_t ChessIndex::rows() const { return impl_->rows(); }
std::int64_t ChessIndex::page_row(std::int64_t p) const {
  require(p >= 0 && p < pages(), "page index out of range");
  return impl_->page_rows[static_cast<std::size_t>(p)];
}
std::int64_t ChessIndex::chunk_row(std::int64_t c) const {
  require(c >= 0 && c < chunks(), "chunk index out of range");
  return impl_->chunk_rows[static_cast<std::size_t>(c)];
}
std::int64_t ChessIndex::grid_row(std::int64_t g) const {
  require(g >= 0 && g < grids(), "grid index out of range");
  return impl_->grid_rows[static_cast<std::size_t>(g)];
}

std::vector<float> ChessIndex::anchor() const {
  const Impl& m = *impl_;
  std::vector<double> acc(static_cast<std::size_t>(m.dim), 0.0);
  const std::int64_t P = pages();
  std::int64_t count = 0;
  if (P > 0) {
    for (std::int64_t p = std::max<std::int64_t>(0, P - m.opt.recent_pages); p < P; ++p, ++count) {
      const float* v = m.row(m.page_rows[static_cast<std::size_t>(p)]);
      for (std::int64_t i = 0; i < m.dim; ++i) acc[static_cast<std::size_t>(i)] += v[i];
    }
  } else {
    const std::int64_t partial = m.tokens % m.opt.page_size;
    require(partial > 0, "no keys yet: the anchor is undefined");
    for (std::int64_t i = 0; i < m.dim; ++i) acc[static_cast<std::size_t>(i)] = m.page_sum[static_cast<std::size_t>(i)];
    count = partial;
  }
  std::vector<float> out(static_cast<std::size_t>(m.dim));
  for (std::int64_t i = 0; i < m.dim; ++i)
    out[static_cast<std::size_t>(i)] =
        static_cast<float>(acc[static_cast<std::size_t>(i)] / static_cast<double>(count));
  return out;
}

std::vector<std::int32_t> ChessIndex::select() const {
  if (pages() == 0) return {};
  const std::vector<float> a = anchor();
  return select(a.data());
}

std::vector<std::int32_t> ChessIndex::select(const float* anchor) const {
  const Impl& m = *impl_;
  const std::int64_t P = pages(), C = chunks(), G = grids(), R = m.rows();
  if (P == 0) return {};
  // One product scores every row of the store: grids, chunks and pages.
  std::vector<float> s(static_cast<std::size_t>(R));
#pragma omp parallel for schedule(static) if (R * m.dim > (1 << 20))
  for (std::int64_t r = 0; r < R; ++r) {
    const float* v = m.row(r);
    float acc = 0;
#pragma omp simd reduction(+ : acc)
    for (std::int64_t i = 0; i < m.dim; ++i) acc += anchor[i] * v[i];
    s[static_cast<std::size_t>(r)] = acc;
  }
  std::vector<float> gs(static_cast<std::size_t>(G)), cs(static_cast<std::size_t>(C)), ps(static_cast<std::size_t>(P));
  for (std::int64_t g = 0; g < G; ++g)
    gs[static_cast<std::size_t>(g)] = s[static_cast<std::size_t>(m.grid_rows[static_cast<std::size_t>(g)])];
  for (std::int64_t c = 0; c < C; ++c)
    cs[static_cast<std::size_t>(c)] = s[static_cast<std::size_t>(m.chunk_rows[static_cast<std::size_t>(c)])];
  for (std::int64_t p = 0; p < P; ++p)
    ps[static_cast<std::size_t>(p)] = s[static_cast<std::size_t>(m.page_rows[static_cast<std::size_t>(p)])];
  std::vector<std::uint8_t> gm(static_cast<std::size_t>(G)), cm(static_cast<std::size_t>(C)),
      pm(static_cast<std::size_t>(P));
  hierarchical_select(gs.data(), G, cs.data(), m.chunk_grid.data(), C, ps.data(), m.page_chunk.data(), P,
                      m.opt.rho_grid, m.opt.rho_chunk, m.opt.rho_page, gm.data(), cm.data(), pm.data());
  for (std::int64_t p = 0; p < std::min(P, m.opt.sink_pages); ++p) pm[static_cast<std::size_t>(p)] = 1;
  for (std::int64_t p = std::max<std::int64_t>(0, P - m.opt.recent_pages); p < P; ++p)
    pm[static_cast<std::size_t>(p)] = 1;
  std::vector<std::int32_t> out;
  for (std::int64_t p = 0; p < P; ++p)
    if (pm[static_cast<std::size_t>(p)]) out.push_back(static_cast<std::int32_t>(p));
  return out;
}

PageTable select_batch(const std::vector<const ChessIndex*>& requests) {
  PageTable t;
  for (const ChessIndex* r : requests) {
    require(r != nullptr, "null request");
    std::vector<std::int32_t> sel = r->select();
    const std::int64_t B = r->options().page_size;
    const std::int64_t partial = r->tokens() % B;
    if (partial > 0) sel.push_back(static_cast<std::int32_t>(r->pages()));
    t.indices.insert(t.indices.end(), sel.begin(), sel.end());
    t.indptr.push_back(static_cast<std::int32_t>(t.indices.size()));
    t.last_page_len.push_back(static_cast<std::int32_t>(sel.empty() ? 0 : (partial > 0 ? partial : B)));
  }
  return t;
}

// ---------------------------------------------------------------- trigger

ReselectionTrigger::ReselectionTrigger(const EntropyRule& rule) : rule_(rule) {
  require(rule.page_size >= 1, "trigger page size must be >= 1");
  require(std::isfinite(rule.entropy_threshold) && std::isfinite(rule.varentropy_threshold),
          "trigger thresholds must be finite");
}

bool ReselectionTrigger::push(double entropy, double varentropy) {
  require(std::isfinite(entropy) && std::isfinite(varentropy), "non-finite token entropy or varentropy");
  if (rule_.unit_bits) {
    const double ln2 = std::log(2.0);
    entropy /= ln2;
    varentropy /= ln2 * ln2;
  }
  entropy_.push_back(entropy);
  varentropy_.push_back(varentropy);
  if (static_cast<std::int64_t>(entropy_.size()) < rule_.page_size) return false;
  const auto n = static_cast<double>(entropy_.size());
  double h = 0, v = 0;
  for (std::size_t i = 0; i < entropy_.size(); ++i) h += entropy_[i], v += varentropy_[i];
  h /= n;
  v /= n;
  if (rule_.varentropy_temporal) {
    double acc = 0;
    for (const double e : entropy_) acc += (e - h) * (e - h);
    v = acc / n;
  }
  entropy_.clear();
  varentropy_.clear();
  ++pages_;
  const bool e = h > rule_.entropy_threshold, va = v > rule_.varentropy_threshold;
  const bool fire = rule_.rule_both ? (e && va) : (e || va);
  triggered_ += fire;
  return fire;
}

std::int64_t ReselectionTrigger::pages() const { return pages_; }
std::int64_t ReselectionTrigger::triggered() const { return triggered_; }
const EntropyRule& ReselectionTrigger::rule() const { return rule_; }

}  // namespace kvcal::runtime
