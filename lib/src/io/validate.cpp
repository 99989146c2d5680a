#include "kvcal/io/validate.h"

// GCC 12 reports a false -Wrestrict inside std::string concatenation here
// (GCC bug 105329).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wrestrict"
#endif

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>

#include "io/bundle_internal.h"
#include "io/h5.h"
#include "kvcal/graph/csr.h"
#include "kvcal/io/seal.h"

namespace kvcal {
namespace detail {
const std::vector<std::pair<std::string, std::string>>& embedded_schemas();
}  // namespace detail

using boost::property_tree::ptree;
using detail::H5Handle;
namespace fs = std::filesystem;

namespace {

struct Schemas {
  std::map<std::string, std::string> text;  // format -> JSON text
  std::map<std::string, ptree> tree;        // format -> parsed
};

const Schemas& schemas() {
  static const Schemas s = [] {
    Schemas out;
    for (const auto& [file, text] : detail::embedded_schemas()) {
      std::istringstream in(text);
      ptree t;
      boost::property_tree::read_json(in, t);
      const std::string format = t.get<std::string>("format");
      out.text[format] = text;
      out.tree[format] = std::move(t);
    }
    return out;
  }();
  return s;
}

// {"ref": "format:a.b.c"} stands for that subtree of another schema.
const ptree& resolve(const ptree& node) {
  const auto ref = node.get_optional<std::string>("ref");
  if (!ref) return node;
  const auto colon = ref->find(':');
  const auto& trees = schemas().tree;
  const auto it = trees.find(ref->substr(0, colon));
  KVCAL_CHECK(colon != std::string::npos && it != trees.end(), "schema reference '{}' is unknown", *ref);
  return it->second.get_child(ref->substr(colon + 1));
}

using Bindings = std::map<std::string, std::int64_t>;

// Why v breaks the spec's const / min / max / enum, or "" when it does not.
std::string range_violation(double v, const ptree& spec) {
  if (auto c = spec.get_optional<double>("const"); c && v != *c) return fmt::format("expected {}", *c);
  if (auto lo = spec.get_optional<double>("min")) {
    if (spec.get("exclusive_min", false) ? !(v > *lo) : !(v >= *lo)) return fmt::format("below its minimum {}", *lo);
  }
  if (auto hi = spec.get_optional<double>("max")) {
    if (spec.get("exclusive_max", false) ? !(v < *hi) : !(v <= *hi)) return fmt::format("above its maximum {}", *hi);
  }
  if (auto e = spec.get_child_optional("enum")) {
    for (const auto& [k, item] : *e) {
      if (item.get_value<double>() == v) return {};
    }
    return "not an allowed value";
  }
  return {};
}

// Evaluates a shape expression ("rows + 1", "num_layers", "prompt_len + T")
// against `actual`: a single unknown name is bound, otherwise the value is
// checked. Returns false on a mismatch.
bool match_dim(const std::string& expr, std::int64_t actual, Bindings& b) {
  std::istringstream in(expr);
  std::string tok;
  __extension__ __int128 known = 0;  // attribute values may be huge: no overflow
  int sign = 1;
  std::string unknown;
  int unknown_sign = 1;
  while (in >> tok) {
    if (tok == "+") {
      sign = 1;
    } else if (tok == "-") {
      sign = -1;
    } else if (std::isdigit(static_cast<unsigned char>(tok[0]))) {
      known += sign * std::stoll(tok);
    } else if (b.count(tok)) {
      known += sign * b[tok];
    } else {
      if (!unknown.empty()) return true;  // two unknowns: nothing to check
      unknown = tok;
      unknown_sign = sign;
    }
  }
  if (!unknown.empty()) {
    const auto value = unknown_sign * (actual - known);
    if (value >= std::numeric_limits<std::int64_t>::min() && value <= std::numeric_limits<std::int64_t>::max()) {
      b[unknown] = static_cast<std::int64_t>(value);
    }
    return true;
  }
  return known == actual;
}

std::string dtype_name(const detail::DatasetInfo& info, hid_t ds) {
  if (info.type_class == H5T_FLOAT) {
    switch (info.float_kind) {
      case detail::FloatKind::f16:
        return "float16";
      case detail::FloatKind::f32:
        return "float32";
      case detail::FloatKind::f64:
        return "float64";
      default:
        return "float(other)";
    }
  }
  if (info.type_class == H5T_INTEGER) {
    H5Handle type(H5Dget_type(ds), H5Tclose);
    const bool is_signed = H5Tget_sign(type.get()) == H5T_SGN_2;
    return fmt::format("{}int{}", is_signed ? "" : "u", 8 * H5Tget_size(type.get()));
  }
  return "other";
}

std::vector<std::string> string_list(const ptree& node) {
  std::vector<std::string> out;
  if (node.empty()) {
    out.push_back(node.get_value<std::string>());
  } else {
    for (const auto& [k, v] : node) out.push_back(v.get_value<std::string>());
  }
  return out;
}

class Validator {
 public:
  explicit Validator(std::vector<std::string>& problems) : problems_(problems) {}

  void group(hid_t loc, const ptree& raw_node, const std::string& where, Bindings b) {
    const ptree& node = resolve(raw_node);
    if (auto a = node.get_child_optional("attributes")) attributes(loc, resolve(*a), where, b);
    if (auto d = node.get_child_optional("datasets")) datasets(loc, resolve(*d), where, b);
    if (auto g = node.get_child_optional("groups")) {
      for (const auto& [name, sub] : *g) {
        const ptree& s = resolve(sub);
        if (!detail::has_link(loc, name)) {
          if (!s.get("optional", false)) problem("{}: missing group '{}'", where, name);
          continue;
        }
        H5Handle child(H5Oopen(loc, name.c_str(), H5P_DEFAULT), H5Oclose);
        if (!child.valid() || H5Iget_type(child.get()) != H5I_GROUP) {
          problem("{}: '{}' is not a group", where, name);
          continue;
        }
        group(child.get(), s, where + "/" + name, b);
      }
    }
    if (auto c = node.get_child_optional("children")) {
      const ptree& each = resolve(c->get_child("*"));
      for (const std::string& name : detail::list_links(loc)) {
        H5Handle child(H5Oopen(loc, name.c_str(), H5P_DEFAULT), H5Oclose);
        if (!child.valid() || H5Iget_type(child.get()) != H5I_GROUP) {
          problem("{}: '{}' is not a group", where, name);
          continue;
        }
        group(child.get(), each, where + "/" + name, b);
      }
    }
  }

  template <typename... Args>
  void problem(fmt::format_string<Args...> f, Args&&... args) {
    problems_.push_back(fmt::format(f, std::forward<Args>(args)...));
  }

 private:
  void attributes(hid_t obj, const ptree& specs, const std::string& where, Bindings& b) {
    for (const auto& [name, spec] : specs) {
      if (!detail::has_attr(obj, name)) {
        if (!spec.get("optional", false)) problem("{}: missing attribute '{}'", where, name);
        continue;
      }
      const std::string type = spec.get<std::string>("type", "");
      try {
        if (type == "string") {
          const std::string v = detail::read_attr_string(obj, name, where);
          if (auto c = spec.get_optional<std::string>("const"); c && v != *c) {
            problem("{}: attribute '{}' is '{}', expected '{}'", where, name, v, *c);
          }
          if (auto e = spec.get_child_optional("enum")) {
            const auto allowed = string_list(*e);
            if (std::find(allowed.begin(), allowed.end(), v) == allowed.end()) {
              problem("{}: attribute '{}' is '{}', not one of {}", where, name, v, fmt::join(allowed, ", "));
            }
          }
        } else if (type == "int64") {
          const std::int64_t v = detail::read_attr_int(obj, name, where);
          number(static_cast<double>(v), spec, where, "attribute '" + name + "'");
          b[name] = v;
        } else if (type == "uint64") {
          const std::uint64_t v = detail::read_attr_uint(obj, name, where);
          number(static_cast<double>(v), spec, where, "attribute '" + name + "'");
          if (v <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
            b[name] = static_cast<std::int64_t>(v);
          }
        } else if (type == "float64") {
          const double v = detail::read_attr_double(obj, name, where);
          if (!std::isfinite(v)) problem("{}: attribute '{}' is not finite ({})", where, name, v);
          number(v, spec, where, "attribute '" + name + "'");
        }
      } catch (const Error& e) {
        problems_.push_back(e.what());
      }
    }
  }

  void number(double v, const ptree& spec, const std::string& where, const std::string& what) {
    const std::string why = range_violation(v, spec);
    if (!why.empty()) problem("{}: {} is {}, {}", where, what, v, why);
  }

  void datasets(hid_t loc, const ptree& specs, const std::string& where, Bindings& b) {
    for (const auto& [name, spec] : specs) {
      if (!detail::has_link(loc, name)) {
        if (!spec.get("optional", false)) problem("{}: missing dataset '{}'", where, name);
        continue;
      }
      const std::string at = where + "/" + name;
      H5Handle ds(H5Oopen(loc, name.c_str(), H5P_DEFAULT), H5Oclose);
      if (!ds.valid() || H5Iget_type(ds.get()) != H5I_DATASET) {
        problem("{}: not a dataset", at);
        continue;
      }
      const detail::DatasetInfo info = detail::dataset_info(ds.get());
      if (auto dt = spec.get_child_optional("dtype")) {
        const auto allowed = string_list(*dt);
        const std::string actual = dtype_name(info, ds.get());
        if (std::find(allowed.begin(), allowed.end(), actual) == allowed.end()) {
          problem("{}: dtype {} is not {}", at, actual, fmt::join(allowed, " or "));
          continue;
        }
      }
      if (auto r = spec.get_optional<std::size_t>("rank"); r && info.dims.size() != *r) {
        problem("{}: rank {} , expected {}", at, info.dims.size(), *r);
        continue;
      }
      if (auto shape = spec.get_child_optional("shape")) {
        const auto exprs = string_list(*shape);
        for (std::size_t i = 0; i < exprs.size() && i < info.dims.size(); ++i) {
          if (!match_dim(exprs[i], info.dims[i], b)) {
            problem("{}: dimension {} is {}, but {} = {}", at, i, info.dims[i], exprs[i], expected(exprs[i], b));
          }
        }
      }
      const bool value_checks = spec.get_optional<double>("min") || spec.get_optional<double>("max") ||
                                spec.get_child_optional("enum") || spec.get("finite", false);
      if (value_checks && info.elements() <= (std::int64_t{1} << 26)) {
        try {
          const auto v = detail::read_dataset<double>(loc, name, info.dims, where);
          const bool need_finite =
              spec.get("finite", false) || spec.get_optional<double>("min") || spec.get_optional<double>("max");
          std::int64_t bad = 0, first = -1;
          for (std::size_t i = 0; i < v.size(); ++i) {
            const bool ok = need_finite ? std::isfinite(v[i]) && range_violation(v[i], spec).empty()
                                        : range_violation(v[i], spec).empty();
            if (!ok && bad++ == 0) first = static_cast<std::int64_t>(i);
          }
          if (bad > 0) {
            problem("{}: {} value(s) out of range or not finite (first at flat index {}: {})", at, bad, first,
                    v[static_cast<std::size_t>(first)]);
          }
        } catch (const Error& e) {
          problems_.push_back(e.what());
        }
      }
    }
  }

  static std::string expected(const std::string& expr, const Bindings& b) {
    std::istringstream in(expr);
    std::string tok, out;
    while (in >> tok) {
      const auto it = b.find(tok);
      out += it != b.end() ? std::to_string(it->second) : tok;
    }
    return out;
  }

  std::vector<std::string>& problems_;
};

// Semantic checks that a schema cannot express.
void check_mask_groups(hid_t masks, const std::string& where, std::vector<std::string>& problems) {
  for (const std::string& id : detail::list_links(masks)) {
    const std::string ctx = where + "/" + id;
    try {
      H5Handle g = detail::open_group(masks, id, where);
      CsrMask m;
      m.rows = detail::read_attr_int(g.get(), "rows", ctx);
      m.cols = detail::read_attr_int(g.get(), "cols", ctx);
      if (m.rows < 1 || m.cols < 1 || m.rows > (std::int64_t{1} << 31) || m.cols > (std::int64_t{1} << 31)) {
        problems.push_back(fmt::format("{}: shape {}x{} out of range", ctx, m.rows, m.cols));
        continue;
      }
      m.indptr = detail::read_int64_1d(g.get(), "indptr", ctx, m.rows + 1);
      m.indices = detail::read_int32_1d(g.get(), "indices", ctx,
                                        std::min<std::int64_t>(m.rows * m.cols, std::int64_t{1} << 36));
      const StructureReport r = check_structure(m, false);
      for (const auto& p : r.problems) problems.push_back(ctx + ": " + p);
      if (!r.ok()) continue;
      const std::int64_t d1 = detail::read_attr_int(g.get(), "row_degree", ctx);
      const std::int64_t d2 = detail::read_attr_int(g.get(), "col_degree", ctx);
      const bool bireg = detail::read_attr_int(g.get(), "biregular", ctx) != 0;
      if (r.row_degree_min != r.row_degree_max || d1 != r.row_degree_max) {
        problems.push_back(
            fmt::format("{}: row_degree is {} but rows hold {}..{} ones", ctx, d1, r.row_degree_min, r.row_degree_max));
      }
      if (d2 != r.col_degree_max) {
        problems.push_back(
            fmt::format("{}: col_degree is {} but the largest column holds {}", ctx, d2, r.col_degree_max));
      }
      if (bireg != r.biregular) {
        problems.push_back(fmt::format("{}: biregular is {} but column degrees are {}..{}", ctx, int{bireg},
                                       r.col_degree_min, r.col_degree_max));
      }
    } catch (const Error& e) {
      problems.push_back(e.what());
    }
  }
}

void check_heads(hid_t attrs, hid_t data, const std::string& where, std::vector<std::string>& problems) {
  try {
    const std::int64_t L = detail::read_attr_int(attrs, "num_layers", where);
    const std::int64_t H = detail::read_attr_int(attrs, "num_kv_heads", where);
    if (L < 1 || H < 1 || L > 4096 || H > 4096) return;  // the schema pass reported it
    const auto role = detail::read_dataset<std::int32_t>(data, "role", {L, H}, where);
    const auto pivot = detail::read_dataset<std::int32_t>(data, "pivot", {L, H}, where);
    const auto budget = detail::read_dataset<double>(data, "budget_ratio", {L, H}, where);
    const double rho = detail::read_attr_double(attrs, "budget", where);
    double mean = 0;
    for (std::int64_t l = 0; l < L; ++l) {
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t i = l * H + h;
        const int r = role[i];
        const int p = pivot[i];
        const std::string at = fmt::format("{}: layer {}, head {}", where, l, h);
        if (r == 3 && p != h) problems.push_back(at + fmt::format(": a pivot whose pivot is {}", p));
        if (r == 4 && (p < 0 || p >= H || role[l * H + p] != 3)) {
          problems.push_back(at + fmt::format(": a satellite of {}, which is not a pivot of the layer", p));
        }
        if ((r == 1 || r == 2) && p != -1)
          problems.push_back(at + fmt::format(": pivot {} on a non-clustered head", p));
        if ((r == 2 || r == 3) && budget[i] != 1.0) {
          problems.push_back(at + fmt::format(": a full head (role {}) with budget_ratio {}", r, budget[i]));
        }
        mean += budget[i];
      }
    }
    mean /= static_cast<double>(L * H);
    if (std::abs(mean - rho) > 1e-4 && mean < 1.0 - 1e-6) {
      problems.push_back(fmt::format("{}: mean budget_ratio {:.6f} differs from budget {}", where, mean, rho));
    }
  } catch (const Error& e) {
    problems.push_back(e.what());
  }
}

void check_entropy(hid_t loc, const std::string& where, std::vector<std::string>& problems) {
  try {
    const std::int64_t pages = detail::read_attr_int(loc, "num_pages", where);
    H5Handle e = detail::open_dataset(loc, "entropy_edges", where);
    const auto info = detail::dataset_info(e.get());
    if (info.dims.size() != 1 || info.dims[0] < 2 || pages < 1) return;
    const std::int64_t bins = info.dims[0] - 1;
    for (const char* name : {"entropy_edges", "varentropy_edges"}) {
      const auto edges = detail::read_dataset<double>(loc, name, {bins + 1}, where);
      for (std::int64_t i = 0; i < bins; ++i) {
        if (!(edges[i] < edges[i + 1])) {
          problems.push_back(fmt::format("{}/{}: edges not ascending at {}", where, name, i));
          break;
        }
      }
    }
    const auto hist = detail::read_dataset<double>(loc, "histogram", {bins, bins}, where);
    double total = 0;
    for (double x : hist) total += x;
    if (total != static_cast<double>(pages)) {
      problems.push_back(fmt::format("{}/histogram: holds {} pages, num_pages is {}", where, total, pages));
    }
  } catch (const Error& e) {
    problems.push_back(e.what());
  }
}

}  // namespace

const std::string& schema_text(const std::string& format) {
  const auto& t = schemas().text;
  const auto it = t.find(format);
  KVCAL_CHECK(it != t.end(), "no schema for format '{}'", format);
  return it->second;
}

ValidationReport validate_artifact(const std::string& path, bool check_seal) {
  ValidationReport rep;
  rep.path = path;
  detail::h5_init();
  std::optional<SealState> seal;
  if (check_seal) {
    std::error_code ec;
    if (fs::is_regular_file(path, ec) && access(path.c_str(), R_OK) == 0) {
      try {
        const SealCheck c = kvcal::check_seal(path);
        seal = c.state;
        rep.integrity = describe_seal(c);
      } catch (const Error& e) {
        rep.problems.push_back(e.what());
        return rep;
      }
    }
  }
  try {
    H5Handle probe = detail::open_any_artifact(path, &rep.format);
    const auto& trees = schemas().tree;
    const auto it = trees.find(rep.format);
    KVCAL_CHECK(it != trees.end(), "{}: unknown format '{}'", path, rep.format);
    rep.format_version = detail::read_attr_int(probe.get(), "format_version", path);
    const auto supported = it->second.get<std::int64_t>("format_version");
    KVCAL_CHECK(rep.format_version >= 1 && rep.format_version <= supported,
                "{}: format_version {} of '{}' is newer than this kvcal reads ({}); upgrade kvcal", path,
                rep.format_version, rep.format, supported);
    Validator v(rep.problems);
    const hid_t f = probe.get();
    v.group(f, it->second.get_child("root"), path + ":", {});
    const std::size_t schema_problems = rep.problems.size();
    if (schema_problems > 0) return rep;  // semantic checks assume the schema holds
    if (rep.format == "kvcal.masks") {
      H5Handle g = detail::open_group(f, "masks", path);
      check_mask_groups(g.get(), path + ":/masks", rep.problems);
    } else if (rep.format == "kvcal.head_profile") {
      H5Handle g = detail::open_group(f, "heads", path);
      check_heads(f, g.get(), path + ":/heads", rep.problems);
    } else if (rep.format == "kvcal.entropy_calibration") {
      check_entropy(f, path + ":", rep.problems);
    } else if (rep.format == "kvcal.bundle") {
      H5Handle m = detail::open_group(f, "masks", path);
      check_mask_groups(m.get(), path + ":/masks", rep.problems);
      H5Handle h = detail::open_group(f, "heads", path);
      check_heads(h.get(), h.get(), path + ":/heads", rep.problems);
      H5Handle e = detail::open_group(f, "entropy", path);
      check_entropy(e.get(), path + ":/entropy", rep.problems);
      detail::check_manifest(f, path, rep.problems);
      if (seal && *seal != SealState::sealed && rep.format_version >= 2) {
        rep.problems.push_back(fmt::format(
            "{}: a format_version {} bundle without its integrity seal (the first 512 bytes were overwritten or "
            "stripped): fetch it again, or re-bundle",
            path, rep.format_version));
      }
    }
  } catch (const Error& e) {
    rep.problems.push_back(e.what());
  } catch (const std::exception& e) {
    rep.problems.push_back(fmt::format("{}: {}", path, e.what()));
  }
  return rep;
}

}  // namespace kvcal

// ---------------------------------------------------------------------------
// inspect

namespace kvcal {
namespace {

// A minimal JSON value for `kvcal inspect --json` (objects keep insertion order).
struct Json {
  enum Kind { null, number, string, boolean, array, object } kind = null;
  double num = 0;
  std::string str;
  bool flag = false;
  std::vector<Json> items;
  std::vector<std::string> keys;  // object members, in order (parallel to `values`)
  std::vector<Json> values;

  static Json of(double v) {
    Json j;
    j.kind = number;
    j.num = v;
    return j;
  }
  static Json of(std::int64_t v) { return of(static_cast<double>(v)); }
  static Json of(const std::string& v) {
    Json j;
    j.kind = string;
    j.str = v;
    return j;
  }
  static Json of(const char* v) { return of(std::string(v)); }
  static Json of(bool v) {
    Json j;
    j.kind = boolean;
    j.flag = v;
    return j;
  }
  static Json arr() {
    Json j;
    j.kind = array;
    return j;
  }
  static Json obj() {
    Json j;
    j.kind = object;
    return j;
  }
  Json& set(const std::string& k, Json v) {
    keys.push_back(k);
    values.push_back(std::move(v));
    return *this;
  }
  Json& push(Json v) {
    items.push_back(std::move(v));
    return *this;
  }
  const Json* get(const std::string& k) const {
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == k) return &values[i];
    }
    return nullptr;
  }

  static std::string quote(const std::string& s) {
    std::string out = "\"";
    for (unsigned char c : s) {
      if (c == '"' || c == '\\')
        out += '\\', out += static_cast<char>(c);
      else if (c == '\n')
        out += "\\n";
      else if (c < 0x20)
        out += fmt::format("\\u{:04x}", c);
      else
        out += static_cast<char>(c);
    }
    return out + "\"";
  }
  std::string dump(int indent = 0) const {
    const std::string pad(static_cast<std::size_t>(indent + 2), ' '), end(static_cast<std::size_t>(indent), ' ');
    switch (kind) {
      case null:
        return "null";
      case number:
        return std::isfinite(num) ? fmt::format("{}", num) : "null";
      case string:
        return quote(str);
      case boolean:
        return flag ? "true" : "false";
      case array: {
        if (items.empty()) return "[]";
        std::string s = "[\n";
        for (std::size_t i = 0; i < items.size(); ++i)
          s += pad + items[i].dump(indent + 2) + (i + 1 < items.size() ? ",\n" : "\n");
        return s + end + "]";
      }
      case object: {
        if (keys.empty()) return "{}";
        std::string s = "{\n";
        for (std::size_t i = 0; i < keys.size(); ++i) {
          s += pad + quote(keys[i]) + ": " + values[i].dump(indent + 2) + (i + 1 < keys.size() ? ",\n" : "\n");
        }
        return s + end + "}";
      }
    }
    return "null";
  }
};

Json attrs_json(hid_t obj, const std::vector<std::string>& names, const std::string& ctx) {
  Json j = Json::obj();
  for (const auto& n : names) {
    if (!detail::has_attr(obj, n)) continue;
    H5Handle a(H5Aopen(obj, n.c_str(), H5P_DEFAULT), H5Aclose);
    H5Handle t(H5Aget_type(a.get()), H5Tclose);
    const H5T_class_t c = H5Tget_class(t.get());
    if (c == H5T_STRING)
      j.set(n, Json::of(detail::read_attr_string(obj, n, ctx)));
    else if (c == H5T_INTEGER)
      j.set(n, Json::of(detail::read_attr_int(obj, n, ctx)));
    else if (c == H5T_FLOAT)
      j.set(n, Json::of(detail::read_attr_double(obj, n, ctx)));
  }
  return j;
}

Json masks_json(hid_t masks, const std::string& ctx) {
  Json list = Json::arr();
  for (const auto& id : detail::list_links(masks)) {
    H5Handle g = detail::open_group(masks, id, ctx);
    Json m = attrs_json(g.get(),
                        {"rows", "cols", "row_degree", "col_degree", "biregular", "method", "seed", "sigma1", "sigma2",
                         "ramanujan_bound", "certificate_margin", "ramanujan", "certificate", "failure_probability",
                         "lps_p", "lps_q", "construction", "lifts", "certificate_theorem"},
                        ctx + "/" + id);
    Json withid = Json::obj();
    withid.set("id", Json::of(id));
    for (std::size_t i = 0; i < m.keys.size(); ++i) withid.set(m.keys[i], std::move(m.values[i]));
    list.push(std::move(withid));
  }
  return list;
}

const std::vector<std::string> kHeadAttrs = {
    "model",     "num_layers", "num_kv_heads", "num_q_heads", "num_samples", "tau_stable", "tau_sim",
    "tau_drift", "topk",       "topk_frac",    "pool_kernel", "gqa",         "budget",     "taxonomy_order"};
const std::vector<std::string> kEntropyAttrs = {
    "page_size",         "percentile",           "unit",         "page_varentropy", "partial_pages", "rule",
    "entropy_threshold", "varentropy_threshold", "trigger_rate", "num_pages",       "num_tokens"};

Json heads_json(hid_t attrs, hid_t data, const std::string& ctx) {
  Json j = attrs_json(attrs, kHeadAttrs, ctx);
  const std::int64_t L = detail::read_attr_int(attrs, "num_layers", ctx),
                     H = detail::read_attr_int(attrs, "num_kv_heads", ctx);
  KVCAL_CHECK(L >= 1 && H >= 1 && L <= 4096 && H <= 4096, "{}: {} layers x {} heads is out of range", ctx, L, H);
  const auto role = detail::read_dataset<std::int32_t>(data, "role", {L, H}, ctx);
  const auto budget = detail::read_dataset<double>(data, "budget_ratio", {L, H}, ctx);
  static const char* names[] = {"", "anchor", "volatile", "pivot", "satellite"};
  Json counts = Json::obj();
  std::int64_t c[5] = {};
  for (int r : role) c[(r >= 1 && r <= 4) ? r : 0]++;
  for (int r = 1; r <= 4; ++r) counts.set(names[r], Json::of(c[r]));
  j.set("roles", std::move(counts));
  Json layers = Json::arr();
  for (std::int64_t l = 0; l < L; ++l) {
    std::string s;
    double b = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const int r = role[l * H + h];
      s += (h ? " " : "") + std::string(r >= 1 && r <= 4 ? names[r] : "?");
      b += budget[l * H + h];
    }
    layers.push(Json::obj()
                    .set("layer", Json::of(l))
                    .set("roles", Json::of(s))
                    .set("mean_budget", Json::of(b / static_cast<double>(H))));
  }
  j.set("layers", std::move(layers));
  return j;
}

Json inspect_json(const std::string& path) {
  // The seal first: a damaged sealed file never reaches libhdf5.
  std::error_code ec;
  KVCAL_CHECK(fs::is_regular_file(path, ec), "{}: no such file, or not a regular file", path);
  const SealCheck seal = check_seal(path);
  std::string format;
  H5Handle f = detail::open_any_artifact(path, &format);
  Json j = attrs_json(f.get(), {"format", "format_version", "kvcal_version", "created_utc", "command_line"}, path);
  j.set("path", Json::of(path));
  j.set("integrity", seal.state == SealState::sealed
                         ? Json::obj()
                               .set("seal", Json::of(std::string("sha256")))
                               .set("verified", Json::of(true))
                               .set("sha256", Json::of(seal.sha256))
                               .set("covered_bytes", Json::of(static_cast<std::int64_t>(seal.covered)))
                         : Json::obj().set("seal", Json::of(std::string("none"))).set("verified", Json::of(false)));
  if (format == "kvcal.masks") {
    H5Handle g = detail::open_group(f.get(), "masks", path);
    j.set("masks", masks_json(g.get(), path + ":/masks"));
  } else if (format == "kvcal.head_profile") {
    H5Handle g = detail::open_group(f.get(), "heads", path);
    j.set("heads", heads_json(f.get(), g.get(), path));
  } else if (format == "kvcal.entropy_calibration") {
    j.set("entropy", attrs_json(f.get(), kEntropyAttrs, path));
  } else if (format == "kvcal.attention_dump") {
    j.set("dump", attrs_json(f.get(), {"model", "num_layers", "num_q_heads", "num_kv_heads"}, path));
    Json samples = Json::arr();
    H5Handle root = detail::open_group(f.get(), "samples", path);
    for (const auto& name : detail::list_links(root.get())) {
      H5Handle g = detail::open_group(root.get(), name, path);
      Json s = Json::obj().set("name", Json::of(name));
      if (detail::has_attr(g.get(), "prompt_len"))
        s.set("prompt_len", Json::of(detail::read_attr_int(g.get(), "prompt_len", path)));
      Json ds = Json::arr();
      for (const auto& d : detail::list_links(g.get())) {
        H5Handle h(H5Oopen(g.get(), d.c_str(), H5P_DEFAULT), H5Oclose);
        if (!h.valid() || H5Iget_type(h.get()) != H5I_DATASET) continue;
        const auto info = detail::dataset_info(h.get());
        ds.push(
            Json::obj().set("name", Json::of(d)).set("dtype", Json::of(dtype_name(info, h.get()))).set("shape", [&] {
              Json a = Json::arr();
              for (auto x : info.dims) a.push(Json::of(x));
              return a;
            }()));
      }
      s.set("datasets", std::move(ds));
      samples.push(std::move(s));
    }
    j.set("samples", std::move(samples));
  } else if (format == "kvcal.bundle") {
    j.set("model", Json::of(detail::read_attr_string(f.get(), "model", path)));
    H5Handle m = detail::open_group(f.get(), "masks", path);
    j.set("masks", masks_json(m.get(), path + ":/masks"));
    H5Handle h = detail::open_group(f.get(), "heads", path);
    j.set("heads", heads_json(h.get(), h.get(), path + ":/heads"));
    H5Handle e = detail::open_group(f.get(), "entropy", path);
    j.set("entropy", attrs_json(e.get(), kEntropyAttrs, path + ":/entropy"));
  } else {
    fail("{}: unknown format '{}'", path, format);
  }
  return j;
}

std::string num(const Json* v) {
  if (!v) return "-";
  if (v->kind == Json::number) return fmt::format("{:.6g}", v->num);
  if (v->kind == Json::string) return v->str;
  return v->dump();
}

void text_masks(const Json& list, std::string& out) {
  out += fmt::format("  {:<14} {:>13} {:>5} {:>5} {:>7} {:>10} {:>10} {:>10}  {}\n", "mask", "shape", "d1", "d2",
                     "method", "sigma2", "tau", "margin", "certificate");
  for (const auto& m : list.items) {
    out +=
        fmt::format("  {:<14} {:>13} {:>5} {:>5} {:>7} {:>10} {:>10} {:>10}  {}{}\n", num(m.get("id")),
                    num(m.get("rows")) + "x" + num(m.get("cols")), num(m.get("row_degree")), num(m.get("col_degree")),
                    num(m.get("method")), num(m.get("sigma2")), num(m.get("ramanujan_bound")),
                    num(m.get("certificate_margin")), num(m.get("certificate")),
                    m.get("certificate_theorem") && m.get("certificate_theorem")->str == "LPS" ? " + LPS theorem" : "");
  }
}

void text_heads(const Json& h, std::string& out) {
  out += fmt::format(
      "  heads: {} layers x {} KV heads ({} query heads), {} samples; tau_stable {}, tau_sim {}, budget {}\n",
      num(h.get("num_layers")), num(h.get("num_kv_heads")), num(h.get("num_q_heads")), num(h.get("num_samples")),
      num(h.get("tau_stable")), num(h.get("tau_sim")), num(h.get("budget")));
  const Json* r = h.get("roles");
  out += fmt::format("  roles: {} anchor, {} volatile, {} pivot, {} satellite\n", num(r->get("anchor")),
                     num(r->get("volatile")), num(r->get("pivot")), num(r->get("satellite")));
  for (const auto& l : h.get("layers")->items) {
    out += fmt::format("    layer {:>3}: {}  (mean budget {:.3f})\n", num(l.get("layer")), l.get("roles")->str,
                       l.get("mean_budget")->num);
  }
}

void text_entropy(const Json& e, std::string& out) {
  out += fmt::format(
      "  entropy: p{} thresholds H > {} and V > {} ({}), rule {}, pages of {} tokens ({} pages), "
      "trigger rate {}\n",
      num(e.get("percentile")), num(e.get("entropy_threshold")), num(e.get("varentropy_threshold")), num(e.get("unit")),
      num(e.get("rule")), num(e.get("page_size")), num(e.get("num_pages")), num(e.get("trigger_rate")));
}

}  // namespace

std::string inspect_artifact(const std::string& path, bool json) {
  const Json j = inspect_json(path);
  if (json) return j.dump() + "\n";
  std::string out = fmt::format("{}: {} v{} (kvcal {}, {})\n", path, num(j.get("format")), num(j.get("format_version")),
                                num(j.get("kvcal_version")), num(j.get("created_utc")));
  const std::string format = j.get("format")->str;
  if (format == "kvcal.masks") text_masks(*j.get("masks"), out);
  if (format == "kvcal.head_profile") text_heads(*j.get("heads"), out);
  if (format == "kvcal.entropy_calibration") text_entropy(*j.get("entropy"), out);
  if (format == "kvcal.bundle") {
    const Json* seal = j.get("integrity");
    out += seal->get("verified")->kind == Json::boolean && seal->get("verified")->flag
               ? fmt::format("  integrity: SHA-256 seal verified ({} over {} bytes)\n", seal->get("sha256")->str,
                             num(seal->get("covered_bytes")))
               : std::string(
                     "  integrity: no seal (written before format_version 2; kvcal::runtime refuses it by "
                     "default: re-bundle)\n");
    out += fmt::format("  model: {}\n", j.get("model")->str);
    text_masks(*j.get("masks"), out);
    text_heads(*j.get("heads"), out);
    text_entropy(*j.get("entropy"), out);
  }
  if (format == "kvcal.attention_dump") {
    const Json* d = j.get("dump");
    out += fmt::format("  model {}: {} layers, {} query heads, {} KV heads\n", num(d->get("model")),
                       num(d->get("num_layers")), num(d->get("num_q_heads")), num(d->get("num_kv_heads")));
    for (const auto& s : j.get("samples")->items) {
      std::string ds;
      for (const auto& x : s.get("datasets")->items) {
        std::string shape;
        for (const auto& v : x.get("shape")->items) shape += (shape.empty() ? "" : "x") + num(&v);
        ds += fmt::format("{}{} {}[{}]", ds.empty() ? "" : ", ", x.get("name")->str, x.get("dtype")->str, shape);
      }
      out += fmt::format("  sample {} (N = {}): {}\n", s.get("name")->str, num(s.get("prompt_len")), ds);
    }
  }
  return out;
}

}  // namespace kvcal
