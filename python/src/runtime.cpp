// The runtime (kvcal::runtime): Bundle, MaskCache, HEX and H2O layer caches,
// CHESS page selection and its trigger, the HeteroCache plan and drift
// monitor. Arrays are read in place (no copy) and results handed to NumPy
// without copies; the GIL is released around the work.
#include <cmath>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common.h"
#include "kvcal/runtime/bundle.h"
#include "kvcal/runtime/chess.h"
#include "kvcal/runtime/hetero.h"
#include "kvcal/runtime/hex.h"
#include "kvcal/runtime/mask_cache.h"

namespace kvcal::py {

namespace rt = kvcal::runtime;

namespace {

struct PyMask {
  std::shared_ptr<const rt::Mask> m;
};

// A bundle that can be closed: every use after close() is a ValueError.
struct PyBundle {
  std::shared_ptr<rt::Bundle> b;
  const rt::Bundle& get() const {
    if (!b) value_error("the bundle is closed");
    return *b;
  }
};

struct PyHeadTable {
  std::shared_ptr<rt::Bundle> owner;  // keeps the table alive
  const rt::HeadTable* t = nullptr;
};

struct PyHexCache {
  mutable std::mutex mu;
  std::unique_ptr<rt::HexLayerCache> c;
  std::shared_ptr<const rt::Mask> mask;
  std::int64_t kv_heads = 0, head_dim = 0;
};

struct PyH2OCache {
  mutable std::mutex mu;
  std::unique_ptr<rt::H2OEvictCache> c;
  std::int64_t kv_heads = 0, q_heads = 0, head_dim = 0;
};

struct PyChessIndex {
  mutable std::mutex mu;
  std::unique_ptr<rt::ChessIndex> c;
};

struct PyMaskCache {
  std::unique_ptr<rt::MaskCache> c;
  std::shared_ptr<rt::Bundle> attached;  // the bundle must outlive the cache
};

// k and v [kv_heads, n, head_dim] float16 with the same strides.
std::tuple<const rt::half_bits*, const rt::half_bits*, std::int64_t, std::int64_t, std::int64_t> kv_args(
    const AnyArray& k, const AnyArray& v, std::int64_t heads, std::int64_t dim) {
  check_array(k, "k", dt_f16(), {heads, -1, dim});
  check_array(v, "v", dt_f16(), {heads, -1, dim});
  if (k.shape(1) != v.shape(1)) value_error("k has {} tokens, v has {}", k.shape(1), v.shape(1));
  const auto n = static_cast<std::int64_t>(k.shape(1));
  // A dimension of size 1 has an arbitrary stride: use the packed one.
  const std::int64_t hs = heads > 1 ? k.stride(0) : n * dim, ts = n > 1 ? k.stride(1) : dim;
  const std::int64_t vhs = heads > 1 ? v.stride(0) : n * dim, vts = n > 1 ? v.stride(1) : dim;
  if (hs != vhs || ts != vts) value_error("k and v must have the same strides (np.ascontiguousarray both)");
  return {static_cast<const rt::half_bits*>(k.data()), static_cast<const rt::half_bits*>(v.data()), n, hs, ts};
}

// attn [heads, tokens] float32, rows contiguous.
std::tuple<const float*, std::int64_t, std::int64_t, std::int64_t> attn_args(const AnyArray& a, std::int64_t heads) {
  check_array(a, "attn", dt<float>(), {heads, -1});
  const auto rows = static_cast<std::int64_t>(a.shape(0)), n = static_cast<std::int64_t>(a.shape(1));
  return {static_cast<const float*>(a.data()), rows, n, rows > 1 ? a.stride(0) : n};
}

float default_scale(std::optional<float> scale, std::int64_t dim) {
  if (scale) {
    if (!std::isfinite(*scale)) value_error("scale {} must be finite", *scale);
    return *scale;
  }
  return 1.0f / std::sqrt(static_cast<float>(dim));
}

// The output array: the caller's (written in place and returned as given)
// or a new one.
nb::object out_array(nb::handle out, std::size_t rows, std::size_t cols, float*& data) {
  if (!out.is_none()) {
    AnyArrayRw a;
    if (!nb::try_cast(out, a)) type_error("out: a writable float32 array (NumPy or CPU tensor) is needed");
    check_array(a, "out", dt<float>(), {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)}, true);
    data = static_cast<float*>(a.data());
    return nb::borrow(out);
  }
  std::vector<float> v(rows * cols);
  auto a = to_numpy(std::move(v), {rows, cols});
  data = a.data();
  return nb::cast(a);
}

rt::HexMode parse_mode(const std::string& s) {
  if (s == "append") return rt::HexMode::append;
  if (s == "full") return rt::HexMode::full;
  value_error("mode '{}': use append or full", s);
}

const char* role_name(rt::Role r) {
  switch (r) {
    case rt::Role::anchor:
      return "anchor";
    case rt::Role::volatile_head:
      return "volatile";
    case rt::Role::pivot:
      return "pivot";
    case rt::Role::satellite:
      return "satellite";
  }
  return "?";
}

}  // namespace

void bind_runtime(nb::module_& m) {
  // ------------------------------------------------------------ masks
  nb::class_<PyMask>(m, "Mask", "An immutable runtime expander mask (CSR, rows = block tokens, cols = channels).")
      .def(
          "__init__",
          [](PyMask* self, std::int64_t rows, std::int64_t cols, const AnyArray& indptr, const AnyArray& indices) {
            check_array(indptr, "indptr", dt<std::int64_t>(), {rows + 1}, true);
            check_array(indices, "indices", dt<std::int32_t>(), {-1}, true);
            if (rows < 1 || cols < 1 || indices.shape(0) % static_cast<std::size_t>(rows) != 0) {
              value_error("a {}x{} mask with {} entries: every row needs the same degree >= 1", rows, cols,
                          indices.shape(0));
            }
            auto mk = std::make_shared<rt::Mask>();
            mk->rows = rows;
            mk->cols = cols;
            mk->row_degree = static_cast<std::int64_t>(indices.shape(0)) / rows;
            const auto* p = static_cast<const std::int64_t*>(indptr.data());
            const auto* q = static_cast<const std::int32_t*>(indices.data());
            mk->indptr.assign(p, p + rows + 1);
            mk->indices.assign(q, q + indices.shape(0));
            mk->source = "python";
            new (self) PyMask{std::move(mk)};
          },
          nb::arg("rows"), nb::arg("cols"), nb::arg("indptr"), nb::arg("indices"),
          "A mask from CSR arrays (copied); the caches check its structure when they take it.")
      .def_prop_ro("rows", [](const PyMask& s) { return s.m->rows; })
      .def_prop_ro("cols", [](const PyMask& s) { return s.m->cols; })
      .def_prop_ro("row_degree", [](const PyMask& s) { return s.m->row_degree; })
      .def_prop_ro("ramanujan", [](const PyMask& s) { return s.m->ramanujan; })
      .def_prop_ro("sigma2", [](const PyMask& s) { return s.m->sigma2; })
      .def_prop_ro("ramanujan_bound", [](const PyMask& s) { return s.m->ramanujan_bound; })
      .def_prop_ro("source", [](const PyMask& s) { return s.m->source; })
      .def_prop_ro("nnz", [](const PyMask& s) { return s.m->nnz(); })
      .def_prop_ro("sparsity", [](const PyMask& s) { return s.m->sparsity(); })
      .def_prop_ro("nbytes", [](const PyMask& s) { return s.m->bytes(); })
      .def_prop_ro(
          "indptr",
          [](nb::handle self) {
            const auto& s = nb::cast<const PyMask&>(self);
            return view(s.m->indptr.data(), {s.m->indptr.size()}, self);
          },
          "int64 [rows + 1], read-only view")
      .def_prop_ro(
          "indices",
          [](nb::handle self) {
            const auto& s = nb::cast<const PyMask&>(self);
            return view(s.m->indices.data(), {s.m->indices.size()}, self);
          },
          "int32 [nnz], read-only view")
      .def("__repr__", [](const PyMask& s) {
        return fmt::format("Mask({}x{}, d1={}, ramanujan={}, source='{}')", s.m->rows, s.m->cols, s.m->row_degree,
                           s.m->ramanujan ? "True" : "False", s.m->source);
      });

  // ------------------------------------------------------------ bundle
  nb::class_<PyHeadTable>(m, "HeadTable", "The bundle's head profile; arrays [layers, kv_heads] (read-only views).")
      .def_prop_ro("layers", [](const PyHeadTable& s) { return s.t->layers; })
      .def_prop_ro("kv_heads", [](const PyHeadTable& s) { return s.t->kv_heads; })
      .def_prop_ro("q_heads", [](const PyHeadTable& s) { return s.t->q_heads; })
      .def_prop_ro(
          "role",
          [](nb::handle self) {
            const auto& s = nb::cast<const PyHeadTable&>(self);
            return view(reinterpret_cast<const std::int8_t*>(s.t->role.data()),
                        {static_cast<std::size_t>(s.t->layers), static_cast<std::size_t>(s.t->kv_heads)}, self);
          },
          "int8: 1 anchor, 2 volatile, 3 pivot, 4 satellite")
      .def(
          "role_name",
          [](const PyHeadTable& s, std::int64_t l, std::int64_t h) {
            if (l < 0 || l >= s.t->layers || h < 0 || h >= s.t->kv_heads)
              value_error("head ({}, {}) out of range", l, h);
            return std::string(role_name(s.t->role[static_cast<std::size_t>(l * s.t->kv_heads + h)]));
          },
          nb::arg("layer"), nb::arg("head"))
      .def_prop_ro("pivot",
                   [](nb::handle self) {
                     const auto& s = nb::cast<const PyHeadTable&>(self);
                     return view(s.t->pivot.data(),
                                 {static_cast<std::size_t>(s.t->layers), static_cast<std::size_t>(s.t->kv_heads)},
                                 self);
                   })
      .def_prop_ro("stability",
                   [](nb::handle self) {
                     const auto& s = nb::cast<const PyHeadTable&>(self);
                     return view(s.t->stability.data(),
                                 {static_cast<std::size_t>(s.t->layers), static_cast<std::size_t>(s.t->kv_heads)},
                                 self);
                   })
      .def_prop_ro("similarity",
                   [](nb::handle self) {
                     const auto& s = nb::cast<const PyHeadTable&>(self);
                     return view(s.t->similarity.data(),
                                 {static_cast<std::size_t>(s.t->layers), static_cast<std::size_t>(s.t->kv_heads)},
                                 self);
                   })
      .def_prop_ro("budget_ratio",
                   [](nb::handle self) {
                     const auto& s = nb::cast<const PyHeadTable&>(self);
                     return view(s.t->budget_ratio.data(),
                                 {static_cast<std::size_t>(s.t->layers), static_cast<std::size_t>(s.t->kv_heads)},
                                 self);
                   })
      .def_prop_ro("budget", [](const PyHeadTable& s) { return s.t->budget; })
      .def_prop_ro("tau_stable", [](const PyHeadTable& s) { return s.t->tau_stable; })
      .def_prop_ro("tau_sim", [](const PyHeadTable& s) { return s.t->tau_sim; })
      .def_prop_ro("tau_drift", [](const PyHeadTable& s) { return s.t->tau_drift; })
      .def_prop_ro("drift_window", [](const PyHeadTable& s) { return s.t->drift_window; })
      .def_prop_ro("topk", [](const PyHeadTable& s) { return s.t->topk; })
      .def_prop_ro("topk_frac", [](const PyHeadTable& s) { return s.t->topk_frac; })
      .def_prop_ro("pool_kernel", [](const PyHeadTable& s) { return s.t->pool_kernel; });

  nb::class_<rt::EntropyThresholds>(m, "EntropyThresholds", "The CHESS re-selection thresholds of a bundle.")
      .def_ro("entropy", &rt::EntropyThresholds::entropy)
      .def_ro("varentropy", &rt::EntropyThresholds::varentropy)
      .def_ro("rule_both", &rt::EntropyThresholds::rule_both)
      .def_ro("unit_bits", &rt::EntropyThresholds::unit_bits)
      .def_ro("page_size", &rt::EntropyThresholds::page_size)
      .def_ro("varentropy_temporal", &rt::EntropyThresholds::varentropy_temporal)
      .def_ro("percentile", &rt::EntropyThresholds::percentile)
      .def_ro("calibration_trigger_rate", &rt::EntropyThresholds::calibration_trigger_rate);

  nb::class_<PyBundle>(m, "Bundle", "A validated, read-only model bundle (kvcal.bundle); open with Bundle.open(path).")
      .def_static(
          "open",
          [](const std::string& path) {
            std::error_code ec;
            if (!std::filesystem::is_regular_file(path, ec)) throw OsErr{fmt::format("{}: no such file", path)};
            std::unique_ptr<rt::Bundle> b;
            {
              nb::gil_scoped_release release;
              b = rt::Bundle::open(path);
            }
            return PyBundle{std::shared_ptr<rt::Bundle>(std::move(b))};
          },
          nb::arg("path"), "Opens and validates a bundle; kvcal.Error names the first problem.")
      .def(
          "close", [](PyBundle& s) { s.b.reset(); }, "Releases the bundle; later use raises ValueError.")
      .def_prop_ro("closed", [](const PyBundle& s) { return !s.b; })
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PyBundle& s, nb::args) { s.b.reset(); })
      .def_prop_ro("path", [](const PyBundle& s) { return s.get().path(); })
      .def_prop_ro("model", [](const PyBundle& s) { return s.get().model(); })
      .def_prop_ro("masks",
                   [](const PyBundle& s) {
                     std::vector<PyMask> out;
                     for (const auto& mk : s.get().masks()) out.push_back(PyMask{mk});
                     return out;
                   })
      .def(
          "find_mask",
          [](const PyBundle& s, std::int64_t rows, std::int64_t cols, double sparsity) -> std::optional<PyMask> {
            auto mk = s.get().find_mask(rt::mask_key(rows, cols, sparsity));
            if (!mk) return std::nullopt;
            return PyMask{mk};
          },
          nb::arg("rows"), nb::arg("cols"), nb::arg("sparsity"), "The bundle's mask for a shape, or None.")
      .def_prop_ro("heads",
                   [](const PyBundle& s) {
                     s.get();
                     return PyHeadTable{s.b, &s.b->heads()};
                   })
      .def_prop_ro("entropy", [](const PyBundle& s) { return s.get().entropy(); });

  // ------------------------------------------------------------ mask cache
  nb::class_<PyMaskCache>(m, "MaskCache",
                          "Thread-safe LRU cache of expander masks: from memory, else an attached bundle, else "
                          "generated and certified on the fly.")
      .def(
          "__init__",
          [](PyMaskCache* self, std::size_t capacity, const std::string& method, std::uint64_t seed, int tries,
             bool require_ramanujan, int threads) {
            rt::MaskCacheOptions o;
            o.capacity = capacity;
            o.method = method;
            o.seed = seed;
            o.tries = tries;
            o.require_ramanujan = require_ramanujan;
            o.threads = threads;
            new (self) PyMaskCache{std::make_unique<rt::MaskCache>(o), nullptr};
          },
          nb::arg("capacity") = 16, nb::arg("method") = "lift", nb::arg("seed") = 0x6b7663616cULL,
          nb::arg("tries") = 16, nb::arg("require_ramanujan") = true, nb::arg("threads") = 1)
      .def(
          "attach",
          [](PyMaskCache& s, const PyBundle& b) {
            s.c->attach(&b.get());
            s.attached = b.b;
          },
          nb::arg("bundle"), "Misses look in the bundle before generating (the cache keeps it alive).")
      .def(
          "get",
          [](PyMaskCache& s, std::int64_t rows, std::int64_t cols, double sparsity) {
            std::shared_ptr<const rt::Mask> mk;
            {
              nb::gil_scoped_release release;
              mk = s.c->get(rows, cols, sparsity);
            }
            return PyMask{mk};
          },
          nb::arg("rows"), nb::arg("cols"), nb::arg("sparsity"))
      .def_prop_ro("stats",
                   [](const PyMaskCache& s) {
                     const rt::MaskCacheStats st = s.c->stats();
                     nb::dict d;
                     d["hits"] = st.hits;
                     d["misses"] = st.misses;
                     d["generated"] = st.generated;
                     d["from_bundle"] = st.from_bundle;
                     d["evictions"] = st.evictions;
                     return d;
                   })
      .def("__len__", [](const PyMaskCache& s) { return s.c->size(); })
      .def_prop_ro("capacity", [](const PyMaskCache& s) { return s.c->capacity(); });

  // ------------------------------------------------------------ HEX
  nb::class_<PyHexCache>(m, "HexLayerCache",
                         "The streaming HEX cache of one layer (every KV head): fp16, kcvtB, h2oB, expanderB, hexB.")
      .def(
          "__init__",
          [](PyHexCache* self, std::int64_t kv_heads, std::int64_t head_dim, const std::string& method,
             std::optional<PyMask> mask, std::int64_t block, double hh_ratio, std::int64_t recent_window,
             double sparsity, const std::string& mode) {
            rt::HexOptions base;
            base.block = block;
            base.hh_ratio = hh_ratio;
            base.recent_window = recent_window;
            base.sparsity = sparsity;
            base.mode = parse_mode(mode);
            const rt::HexOptions o = rt::hex_method(method, base);
            rt::check_options(o);
            std::shared_ptr<const rt::Mask> mk = mask ? mask->m : nullptr;
            auto c = std::make_unique<rt::HexLayerCache>(kv_heads, head_dim, o, mk);
            auto* p = new (self) PyHexCache();
            p->c = std::move(c);
            p->mask = mk;
            p->kv_heads = kv_heads;
            p->head_dim = head_dim;
          },
          nb::arg("kv_heads"), nb::arg("head_dim"), nb::arg("method") = "hex4", nb::arg("mask") = nb::none(),
          nb::kw_only(), nb::arg("block") = 96, nb::arg("hh_ratio") = 0.02, nb::arg("recent_window") = 8,
          nb::arg("sparsity") = 1.0 / 32, nb::arg("mode") = "append")
      .def(
          "append",
          [](PyHexCache& s, const AnyArray& k, const AnyArray& v) {
            auto [kp, vp, n, hs, ts] = kv_args(k, v, s.kv_heads, s.head_dim);
            nb::gil_scoped_release release;
            std::lock_guard lock(s.mu);
            s.c->append(kp, vp, n, hs, ts);
          },
          nb::arg("k"), nb::arg("v"), "k, v: float16 [kv_heads, n, head_dim] (read in place).")
      .def(
          "observe",
          [](PyHexCache& s, const AnyArray& attn) {
            auto [p, rows, n, stride] = attn_args(attn, -1);
            nb::gil_scoped_release release;
            std::lock_guard lock(s.mu);
            s.c->observe(p, rows, n, stride);
          },
          nb::arg("attn"), "attn: float32 [heads, tokens], weights added to the heavy-hitter scores.")
      .def(
          "attend",
          [](PyHexCache& s, const AnyArray& q, std::optional<float> scale, nb::handle out,
             bool return_probs) -> nb::object {
            check_array(q, "q", dt<float>(), {-1, s.head_dim}, true);
            const auto qh = static_cast<std::int64_t>(q.shape(0));
            const float sc = default_scale(scale, s.head_dim);
            float* o = nullptr;
            nb::object result = out_array(out, static_cast<std::size_t>(qh), static_cast<std::size_t>(s.head_dim), o);
            std::optional<NpArray<float>> probs;
            {
              std::lock_guard lock(s.mu);  // tokens() stable until attend returns
              if (return_probs) {
                probs = to_numpy(std::vector<float>(static_cast<std::size_t>(qh * s.c->tokens())),
                                 {static_cast<std::size_t>(qh), static_cast<std::size_t>(s.c->tokens())});
              }
              float* pp = probs ? probs->data() : nullptr;
              nb::gil_scoped_release release;
              s.c->attend(static_cast<const float*>(q.data()), qh, sc, o, pp);
            }
            if (return_probs) return nb::make_tuple(result, *probs);
            return result;
          },
          nb::arg("q"), nb::kw_only(), nb::arg("scale") = nb::none(), nb::arg("out").none() = nb::none(),
          nb::arg("return_probs") = false,
          "q: float32 [q_heads, head_dim]; returns out [q_heads, head_dim] (written into `out` when given), and the "
          "weights [q_heads, tokens] with return_probs.")
      .def(
          "dequantize",
          [](const PyHexCache& s, std::int64_t first_token) {
            std::lock_guard lock(s.mu);
            const std::int64_t block = s.c->options().block, done = s.c->compressed_tokens();
            if (first_token < 0 || first_token > done || first_token % block != 0) {
              value_error("first_token {} must be a block boundary in [0, {}]", first_token, done);
            }
            const std::int64_t n = done - first_token, d = s.head_dim, H = s.kv_heads;
            std::vector<float> k(static_cast<std::size_t>(H * n * d)), v(k.size());
            for (std::int64_t h = 0; h < H; ++h) {
              std::int64_t t = 0;
              for (const rt::HexBlockView& b : s.c->blocks(h)) {
                if (t >= first_token) {
                  const auto off = static_cast<std::size_t>((h * n + t - first_token) * d);
                  rt::hex_dequantize_block(b, k.data() + off, v.data() + off);
                }
                t += b.tokens;
              }
            }
            const auto shp = {static_cast<std::size_t>(H), static_cast<std::size_t>(n), static_cast<std::size_t>(d)};
            return std::make_pair(to_numpy(std::move(k), shp), to_numpy(std::move(v), shp));
          },
          nb::arg("first_token") = 0,
          "The compressed blocks' keys and values as the runtime decodes them, float32 [kv_heads, n, head_dim], "
          "from first_token (a block boundary) to compressed_tokens.")
      .def_prop_ro("tokens", [](const PyHexCache& s) { return s.c->tokens(); })
      .def_prop_ro("compressed_tokens", [](const PyHexCache& s) { return s.c->compressed_tokens(); })
      .def_prop_ro("kv_heads", [](const PyHexCache& s) { return s.kv_heads; })
      .def_prop_ro("head_dim", [](const PyHexCache& s) { return s.head_dim; })
      .def_prop_ro("block", [](const PyHexCache& s) { return s.c->options().block; })
      .def_prop_ro("bits", [](const PyHexCache& s) { return s.c->options().bits; })
      .def(
          "bytes", [](const PyHexCache& s) { return s.c->bytes(); }, "stored bytes: blocks + fp16 residual")
      .def(
          "fp16_bytes", [](const PyHexCache& s) { return s.c->fp16_bytes(); }, "the same tokens in fp16");

  nb::class_<PyH2OCache>(m, "H2OEvictCache",
                         "The original H2O eviction policy (heavy hitters + recent tokens, the rest dropped).")
      .def(
          "__init__",
          [](PyH2OCache* self, std::int64_t kv_heads, std::int64_t q_heads, std::int64_t head_dim, double budget) {
            auto c = std::make_unique<rt::H2OEvictCache>(kv_heads, q_heads, head_dim, budget);
            auto* p = new (self) PyH2OCache();
            p->c = std::move(c);
            p->kv_heads = kv_heads;
            p->q_heads = q_heads;
            p->head_dim = head_dim;
          },
          nb::arg("kv_heads"), nb::arg("q_heads"), nb::arg("head_dim"), nb::arg("budget"))
      .def(
          "append",
          [](PyH2OCache& s, const AnyArray& k, const AnyArray& v) {
            auto [kp, vp, n, hs, ts] = kv_args(k, v, s.kv_heads, s.head_dim);
            nb::gil_scoped_release release;
            std::lock_guard lock(s.mu);
            s.c->append(kp, vp, n, hs, ts);
          },
          nb::arg("k"), nb::arg("v"))
      .def(
          "observe",
          [](PyH2OCache& s, const AnyArray& attn) {
            auto [p, rows, n, stride] = attn_args(attn, s.q_heads);
            nb::gil_scoped_release release;
            std::lock_guard lock(s.mu);
            s.c->observe(p, n, stride);
          },
          nb::arg("attn"), "attn: float32 [q_heads, tokens]")
      .def(
          "attend",
          [](PyH2OCache& s, const AnyArray& q, std::optional<float> scale, nb::handle out,
             bool return_probs) -> nb::object {
            check_array(q, "q", dt<float>(), {s.q_heads, s.head_dim}, true);
            const float sc = default_scale(scale, s.head_dim);
            float* o = nullptr;
            nb::object result =
                out_array(out, static_cast<std::size_t>(s.q_heads), static_cast<std::size_t>(s.head_dim), o);
            std::optional<NpArray<float>> probs;
            {
              std::lock_guard lock(s.mu);
              if (return_probs) {
                probs = to_numpy(std::vector<float>(static_cast<std::size_t>(s.q_heads * s.c->tokens())),
                                 {static_cast<std::size_t>(s.q_heads), static_cast<std::size_t>(s.c->tokens())});
              }
              float* pp = probs ? probs->data() : nullptr;
              nb::gil_scoped_release release;
              s.c->attend(static_cast<const float*>(q.data()), sc, o, pp);
            }
            if (return_probs) return nb::make_tuple(result, *probs);
            return result;
          },
          nb::arg("q"), nb::kw_only(), nb::arg("scale") = nb::none(), nb::arg("out").none() = nb::none(),
          nb::arg("return_probs") = false)
      .def_prop_ro("tokens", [](const PyH2OCache& s) { return s.c->tokens(); })
      .def(
          "kept",
          [](const PyH2OCache& s, std::int64_t head) {
            if (head < 0 || head >= s.kv_heads) value_error("head {} out of range [0, {})", head, s.kv_heads);
            return s.c->kept(head);
          },
          nb::arg("head"))
      .def("bytes", [](const PyH2OCache& s) { return s.c->bytes(); })
      .def("fp16_bytes", [](const PyH2OCache& s) { return s.c->fp16_bytes(); });

  // ------------------------------------------------------------ CHESS
  nb::class_<PyChessIndex>(m, "ChessIndex", "CHESS page summaries of one request and its hierarchical selection.")
      .def(
          "__init__",
          [](PyChessIndex* self, std::int64_t dim, std::optional<std::string> preset, std::int64_t page_size,
             std::int64_t chunk_pages, std::int64_t grid_chunks, std::optional<double> rho_grid,
             std::optional<double> rho_chunk, std::optional<double> rho_page, std::int64_t sink_pages,
             std::int64_t recent_pages) {
            rt::ChessOptions o;
            o.page_size = page_size;
            o.chunk_pages = chunk_pages;
            o.grid_chunks = grid_chunks;
            o.sink_pages = sink_pages;
            o.recent_pages = recent_pages;
            if (preset) o = rt::chess_preset(preset->c_str(), o);
            if (rho_grid) o.rho_grid = *rho_grid;
            if (rho_chunk) o.rho_chunk = *rho_chunk;
            if (rho_page) o.rho_page = *rho_page;
            rt::check_options(o);
            auto c = std::make_unique<rt::ChessIndex>(dim, o);
            new (self) PyChessIndex();
            self->c = std::move(c);
          },
          nb::arg("dim"), nb::kw_only(), nb::arg("preset") = nb::none(), nb::arg("page_size") = 32,
          nb::arg("chunk_pages") = 4, nb::arg("grid_chunks") = 4, nb::arg("rho_grid") = nb::none(),
          nb::arg("rho_chunk") = nb::none(), nb::arg("rho_page") = nb::none(), nb::arg("sink_pages") = 1,
          nb::arg("recent_pages") = 2,
          "dim = layers * kv_heads * head_dim; preset 'conservative', 'moderate' (default ratios) or 'aggressive'.")
      .def(
          "append",
          [](PyChessIndex& s, const AnyArray& keys) {
            const std::int64_t dim = s.c->dim();
            const bool half = keys.dtype() == dt_f16();
            check_array(keys, "keys", half ? dt_f16() : dt<float>(), {-1, dim});
            const auto n = static_cast<std::int64_t>(keys.shape(0));
            const std::int64_t stride = n > 1 ? keys.stride(0) : dim;
            nb::gil_scoped_release release;
            std::lock_guard lock(s.mu);
            if (half) {
              s.c->append(static_cast<const rt::half_bits*>(keys.data()), n, stride);
            } else {
              s.c->append(static_cast<const float*>(keys.data()), n, stride);
            }
          },
          nb::arg("keys"), "keys: float32 or float16 [n, dim] (layer-major, then KV head, then channel).")
      .def_prop_ro("dim", [](const PyChessIndex& s) { return s.c->dim(); })
      .def_prop_ro("tokens", [](const PyChessIndex& s) { return s.c->tokens(); })
      .def_prop_ro("pages", [](const PyChessIndex& s) { return s.c->pages(); })
      .def_prop_ro("chunks", [](const PyChessIndex& s) { return s.c->chunks(); })
      .def_prop_ro("grids", [](const PyChessIndex& s) { return s.c->grids(); })
      .def(
          "summaries",
          [](const PyChessIndex& s) {
            std::lock_guard lock(s.mu);
            const std::int64_t rows = s.c->rows(), dim = s.c->dim();
            std::vector<float> v(s.c->store(), s.c->store() + rows * dim);
            return to_numpy(std::move(v), {static_cast<std::size_t>(rows), static_cast<std::size_t>(dim)});
          },
          "A copy of the summary store [rows, dim] (the store moves as pages complete).")
      .def(
          "page_row", [](const PyChessIndex& s, std::int64_t i) { return s.c->page_row(i); }, nb::arg("page"))
      .def(
          "chunk_row", [](const PyChessIndex& s, std::int64_t i) { return s.c->chunk_row(i); }, nb::arg("chunk"))
      .def(
          "grid_row", [](const PyChessIndex& s, std::int64_t i) { return s.c->grid_row(i); }, nb::arg("grid"))
      .def("anchor",
           [](const PyChessIndex& s) {
             std::lock_guard lock(s.mu);
             return to_numpy(s.c->anchor());
           })
      .def(
          "select",
          [](const PyChessIndex& s, std::optional<AnyArray> anchor) {
            std::vector<std::int32_t> pages;
            if (anchor) {
              check_array(*anchor, "anchor", dt<float>(), {s.c->dim()}, true);
              const auto* a = static_cast<const float*>(anchor->data());
              nb::gil_scoped_release release;
              std::lock_guard lock(s.mu);
              pages = s.c->select(a);
            } else {
              nb::gil_scoped_release release;
              std::lock_guard lock(s.mu);
              pages = s.c->select();
            }
            return to_numpy(std::move(pages));
          },
          nb::arg("anchor") = nb::none(),
          "Selected complete pages (int32, ascending) against anchor() or the given anchor [dim].");

  m.def(
      "select_batch",
      [](const std::vector<const PyChessIndex*>& requests) {
        std::vector<const rt::ChessIndex*> r;
        for (const PyChessIndex* p : requests) {
          if (!p) value_error("select_batch: None in the requests");
          r.push_back(p->c.get());
        }
        rt::PageTable t;
        {
          nb::gil_scoped_release release;
          t = rt::select_batch(r);
        }
        return nb::make_tuple(to_numpy(std::move(t.indptr)), to_numpy(std::move(t.indices)),
                              to_numpy(std::move(t.last_page_len)));
      },
      nb::arg("requests"), "The paged-attention layout (indptr, indices, last_page_len) of a batch's selections.");

  nb::class_<rt::ReselectionTrigger>(m, "ReselectionTrigger",
                                     "When to select again: per page of generated tokens, entropy and varentropy "
                                     "against the calibrated thresholds.")
      .def(
          "__init__",
          [](rt::ReselectionTrigger* self, double entropy_threshold, double varentropy_threshold, bool rule_both,
             bool varentropy_temporal, std::int64_t page_size, bool unit_bits) {
            rt::EntropyRule r;
            r.entropy_threshold = entropy_threshold;
            r.varentropy_threshold = varentropy_threshold;
            r.rule_both = rule_both;
            r.varentropy_temporal = varentropy_temporal;
            r.page_size = page_size;
            r.unit_bits = unit_bits;
            new (self) rt::ReselectionTrigger(r);
          },
          nb::arg("entropy_threshold"), nb::arg("varentropy_threshold"), nb::kw_only(), nb::arg("rule_both") = true,
          nb::arg("varentropy_temporal") = false, nb::arg("page_size") = 32, nb::arg("unit_bits") = false)
      .def_static(
          "from_bundle",
          [](const PyBundle& b) {
            const rt::EntropyThresholds& e = b.get().entropy();
            rt::EntropyRule r;
            r.entropy_threshold = e.entropy;
            r.varentropy_threshold = e.varentropy;
            r.rule_both = e.rule_both;
            r.varentropy_temporal = e.varentropy_temporal;
            r.page_size = e.page_size;
            r.unit_bits = e.unit_bits;
            return rt::ReselectionTrigger(r);
          },
          nb::arg("bundle"))
      .def("push", &rt::ReselectionTrigger::push, nb::arg("entropy"), nb::arg("varentropy"),
           "One generated token's entropy and varentropy (nats); True when it completes a page that triggers.")
      .def_prop_ro("pages", &rt::ReselectionTrigger::pages)
      .def_prop_ro("triggered", &rt::ReselectionTrigger::triggered);

  // ------------------------------------------------------------ HeteroCache
  nb::class_<rt::HeteroPlan>(m, "HeteroPlan", "Budgets of one context length; arrays [layers, kv_heads].")
      .def_ro("layers", &rt::HeteroPlan::layers)
      .def_ro("kv_heads", &rt::HeteroPlan::kv_heads)
      .def_ro("context", &rt::HeteroPlan::context)
      .def_prop_ro("full",
                   [](nb::handle self) {
                     const auto& p = nb::cast<const rt::HeteroPlan&>(self);
                     return view(p.full.data(),
                                 {static_cast<std::size_t>(p.layers), static_cast<std::size_t>(p.kv_heads)}, self);
                   })
      .def_prop_ro("budget",
                   [](nb::handle self) {
                     const auto& p = nb::cast<const rt::HeteroPlan&>(self);
                     return view(p.budget.data(),
                                 {static_cast<std::size_t>(p.layers), static_cast<std::size_t>(p.kv_heads)}, self);
                   })
      .def_prop_ro("pivot",
                   [](nb::handle self) {
                     const auto& p = nb::cast<const rt::HeteroPlan&>(self);
                     return view(p.pivot.data(),
                                 {static_cast<std::size_t>(p.layers), static_cast<std::size_t>(p.kv_heads)}, self);
                   })
      .def_ro("satellites", &rt::HeteroPlan::satellites)
      .def_ro("l_base", &rt::HeteroPlan::l_base)
      .def_ro("tau_drift", &rt::HeteroPlan::tau_drift)
      .def_ro("window", &rt::HeteroPlan::window)
      .def_ro("compressed_heads", &rt::HeteroPlan::compressed_heads)
      .def_ro("budget_sum", &rt::HeteroPlan::budget_sum);

  m.def(
      "make_hetero_plan",
      [](const PyHeadTable& heads, std::int64_t context, std::int64_t window) {
        return rt::make_hetero_plan(*heads.t, context, window);
      },
      nb::arg("heads"), nb::arg("context"), nb::arg("window") = 8);

  nb::class_<rt::DriftMonitor::Step>(m, "DriftStep")
      .def_ro("overlap", &rt::DriftMonitor::Step::overlap)
      .def_ro("checked", &rt::DriftMonitor::Step::checked)
      .def_ro("median", &rt::DriftMonitor::Step::median)
      .def_ro("drift", &rt::DriftMonitor::Step::drift);

  nb::class_<rt::DriftMonitor>(m, "DriftMonitor", "One pivot head's drift monitor (HeteroCache Algorithm 1).")
      .def(nb::init<std::int64_t, std::int64_t, double>(), nb::arg("l_base"), nb::arg("window"), nb::arg("tau_drift"))
      .def(
          "init",
          [](rt::DriftMonitor& s, const AnyArray& a) {
            check_array(a, "prefill_attention", dt<float>(), {-1}, true);
            s.init(static_cast<const float*>(a.data()), static_cast<std::int64_t>(a.shape(0)));
          },
          nb::arg("prefill_attention"), "float32 [n]: the pivot's prefill attention")
      .def(
          "step",
          [](rt::DriftMonitor& s, const AnyArray& a) {
            check_array(a, "attention", dt<float>(), {-1}, true);
            return s.step(static_cast<const float*>(a.data()), static_cast<std::int64_t>(a.shape(0)));
          },
          nb::arg("attention"), "float32 [n]: this decode step's attention")
      .def_prop_ro(
          "base", [](const rt::DriftMonitor& s) { return to_numpy(std::vector<std::int32_t>(s.base())); },
          nb::rv_policy::automatic, "the current base set (a copy)")
      .def_prop_ro("steps", &rt::DriftMonitor::steps)
      .def_prop_ro("drifts", &rt::DriftMonitor::drifts);
}

}  // namespace kvcal::py
