#include "kvcal/io/attention_dump.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>

#include "io/h5.h"
#include "kvcal/core/half.h"

namespace kvcal {

using detail::H5Handle;

struct AttentionDump::Impl {
  H5Handle file;
};

AttentionDump::AttentionDump(const std::string& path) : impl_(std::make_unique<Impl>()), path_(path) {
  std::int64_t version = 0;
  impl_->file = detail::open_artifact(path, kAttentionDumpFormat, kAttentionDumpFormatVersion, &version);
  const hid_t f = impl_->file.get();
  model_ = detail::has_attr(f, "model") ? detail::read_attr_string(f, "model", path) : std::string();
  layers_ = detail::read_attr_int(f, "num_layers", path);
  q_heads_ = detail::read_attr_int(f, "num_q_heads", path);
  kv_heads_ = detail::read_attr_int(f, "num_kv_heads", path);
  KVCAL_CHECK(layers_ >= 1 && layers_ <= 4096, "{}: num_layers = {} is out of range", path, layers_);
  KVCAL_CHECK(kv_heads_ >= 1 && q_heads_ >= kv_heads_ && q_heads_ <= 4096 && q_heads_ % kv_heads_ == 0,
              "{}: num_q_heads = {} and num_kv_heads = {} do not form query groups", path, q_heads_, kv_heads_);
  H5Handle root = detail::open_group(f, "samples", path);
  for (const std::string& name : detail::list_links(root.get())) {
    const std::string ctx = fmt::format("{}: sample '{}'", path, name);
    H5Handle g = detail::open_group(root.get(), name, path);
    DumpSample s;
    s.name = name;
    s.prompt_len = detail::read_attr_int(g.get(), "prompt_len", ctx);
    KVCAL_CHECK(s.prompt_len >= 1 && s.prompt_len < (std::int64_t{1} << 31), "{}: prompt_len = {} is out of range", ctx,
                s.prompt_len);
    for (const char* ds_name : {"prefill", "decode"}) {
      H5Handle ds = detail::open_dataset(g.get(), ds_name, ctx);
      const detail::DatasetInfo info = detail::dataset_info(ds.get());
      const std::string dctx = fmt::format("{}, dataset '{}'", ctx, ds_name);
      KVCAL_CHECK(info.type_class == H5T_FLOAT &&
                      (info.float_kind == detail::FloatKind::f16 || info.float_kind == detail::FloatKind::f32),
                  "{}: must be float16 or float32", dctx);
      if (std::string(ds_name) == "prefill") {
        KVCAL_CHECK(info.dims.size() == 3, "{}: must be [L, H, N], has rank {}", dctx, info.dims.size());
        s.heads = info.dims[1];
        KVCAL_CHECK(info.dims[0] == layers_, "{}: {} layers, but num_layers = {}", dctx, info.dims[0], layers_);
        KVCAL_CHECK(info.dims[2] == s.prompt_len, "{}: {} keys, but prompt_len = {}", dctx, info.dims[2], s.prompt_len);
      } else {
        KVCAL_CHECK(info.dims.size() == 4, "{}: must be [T, L, H, N+T], has rank {}", dctx, info.dims.size());
        s.steps = info.dims[0];
        KVCAL_CHECK(info.dims[1] == layers_, "{}: {} layers, but num_layers = {}", dctx, info.dims[1], layers_);
        KVCAL_CHECK(info.dims[2] == s.heads, "{}: {} heads, but prefill has {}", dctx, info.dims[2], s.heads);
        KVCAL_CHECK(info.dims[3] == s.prompt_len + s.steps, "{}: last dimension {} is not N + T = {}", dctx,
                    info.dims[3], s.prompt_len + s.steps);
        KVCAL_CHECK(s.steps >= 1, "{}: no decode steps (T = 0); stability needs at least one", dctx);
      }
    }
    KVCAL_CHECK(s.steps <= (std::int64_t{1} << 31), "{}: {} decode steps is out of range", ctx, s.steps);
    const std::int64_t layer_values = s.steps * s.heads * (s.prompt_len + s.steps);
    KVCAL_CHECK(s.heads <= 4096 && layer_values <= (std::int64_t{1} << 34),
                "{}: one layer holds {} x {} x {} scores, more than kvcal reads at once", ctx, s.steps, s.heads,
                s.prompt_len + s.steps);
    KVCAL_CHECK(s.heads == q_heads_ || s.heads == kv_heads_,
                "{}: {} heads, but the root says num_q_heads = {} and num_kv_heads = {}", ctx, s.heads, q_heads_,
                kv_heads_);
    samples_.push_back(s);
  }
  KVCAL_CHECK(!samples_.empty(), "{}: no samples under /samples", path);
}

AttentionDump::~AttentionDump() = default;

namespace {

// Checks rows [rows, width] whose first valid[r] entries are the attention
// row and the rest zero padding.
void check_rows(const float* data, std::int64_t rows, std::int64_t width, std::int64_t valid, double tol,
                const std::string& ctx, const std::function<std::string(std::int64_t)>& where) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = data + r * width;
    double sum = 0;
    for (std::int64_t i = 0; i < valid; ++i) {
      const float v = row[i];
      KVCAL_CHECK(std::isfinite(v), "{}: {}: non-finite value at position {}", ctx, where(r), i);
      KVCAL_CHECK(v >= 0, "{}: {}: negative value {} at position {}", ctx, where(r), v, i);
      sum += v;
    }
    KVCAL_CHECK(std::abs(sum - 1.0) <= tol, "{}: {}: row sums to {:.6f}, not 1 (not softmax probabilities?)", ctx,
                where(r), sum);
    for (std::int64_t i = valid; i < width; ++i) {
      KVCAL_CHECK(row[i] == 0, "{}: {}: padding position {} holds {} (positions after N+t must be 0)", ctx, where(r), i,
                  row[i]);
    }
  }
}

}  // namespace

AttentionDump::RawLayer AttentionDump::read_raw_layer(const DumpSample& s, std::int64_t layer) const {
  KVCAL_CHECK(layer >= 0 && layer < layers_, "layer {} out of range", layer);
  const std::string ctx = fmt::format("{}: sample '{}'", path_, s.name);
  H5Handle g(H5Gopen2(impl_->file.get(), ("samples/" + s.name).c_str(), H5P_DEFAULT), H5Gclose);
  KVCAL_CHECK(g.valid(), "{}: cannot open the sample group", ctx);
  const std::int64_t H = s.heads, n = s.prompt_len, T = s.steps, width = n + T;
  RawLayer raw;
  raw.sample = &s;
  raw.layer = layer;
  {
    H5Handle ds = detail::open_dataset(g.get(), "prefill", ctx);
    raw.prefill_half = detail::read_raw_float_block(ds.get(), {layer, 0, 0}, {1, H, n}, raw.prefill16, raw.prefill32,
                                                    ctx + ", dataset 'prefill'");
  }
  {
    // One layer's chunks are read once: a chunk cache large enough for them.
    H5Handle dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
    H5Pset_chunk_cache(dapl.get(), 10007, std::size_t{64} << 20, 1.0);
    H5Handle ds(H5Dopen2(g.get(), "decode", dapl.get()), H5Dclose);
    KVCAL_CHECK(ds.valid(), "{}, dataset 'decode': cannot open", ctx);
    raw.decode_half = detail::read_raw_float_block(ds.get(), {0, layer, 0, 0}, {T, 1, H, width}, raw.decode16,
                                                   raw.decode32, ctx + ", dataset 'decode'");
  }
  return raw;
}

namespace {

typedef float vf16 __attribute__((vector_size(64)));
typedef std::int32_t vi16 __attribute__((vector_size(64)));

bool fast_row_check(const float* src, std::int64_t len, std::int64_t width, double tol) {
  const vf16 zero{}, big = vf16{} + std::numeric_limits<float>::max();
  vf16 acc{};
  vi16 good = vi16{} - 1;
  std::int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    vf16 x;
    std::memcpy(&x, src + i, sizeof x);
    good &= (x >= zero) & (x <= big);
    acc += x;
  }
  double sum = 0;
  bool ok = true;
  for (int l = 0; l < 16; ++l) sum += acc[l], ok &= good[l] != 0;
  for (; i < len; ++i) {
    ok &= (src[i] >= 0.0f) & (src[i] <= std::numeric_limits<float>::max());
    sum += src[i];
  }
  for (i = len; i < width; ++i) ok &= src[i] == 0.0f;
  return ok && std::abs(sum - 1.0) <= tol;
}

// Converts, validates and reduces `outer` blocks of H rows of `width` entries
// (row (o, q) valid over its first valid(o) entries) into `outer` blocks of
// hkv rows. Returns the first invalid row as (o, q), or (-1, -1).
std::pair<std::int64_t, std::int64_t> decode_rows(const std::uint16_t* half, const float* single, std::int64_t outer,
                                                  std::int64_t H, std::int64_t hkv, std::int64_t width,
                                                  const std::function<std::int64_t(std::int64_t)>& valid, GqaReduce gqa,
                                                  double tol, float* out, int threads) {
  const std::int64_t group = H / hkv;
  std::int64_t bad_o = -1, bad_q = -1;
  const bool parallel = threads > 1 && outer * H * width > 200000;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    std::vector<float> row(static_cast<std::size_t>(width));
#pragma omp for schedule(static)
    for (std::int64_t og = 0; og < outer * hkv; ++og) {
      const std::int64_t o = og / hkv, g = og % hkv, len = valid(o);
      float* dst = out + og * width;
      for (std::int64_t m = 0; m < group; ++m) {
        const std::int64_t q = g * group + m;
        const std::int64_t offset = (o * H + q) * width;
        const float* src = single ? single + offset : row.data();
        if (half) fp16::to_floats(half + offset, width, row.data());
        // Fast check: every valid entry in [0, FLT_MAX] (NaN fails), the sum
        // (16 float lanes, then double), and zero padding; the exact message
        // comes from check_rows later.
        bool ok = fast_row_check(src, len, width, tol);
        if (!ok) {
#pragma omp critical(kvcal_dump_error)
          if (bad_o < 0 || o * H + q < bad_o * H + bad_q) bad_o = o, bad_q = q;
        }
        if (m == 0) {
          std::copy(src, src + width, dst);
        } else if (gqa == GqaReduce::max) {
          for (std::int64_t i = 0; i < width; ++i) dst[i] = std::max(dst[i], src[i]);
        } else {
          for (std::int64_t i = 0; i < width; ++i) dst[i] += src[i];
        }
      }
      if (gqa == GqaReduce::mean && group > 1) {
        const float inv = 1.0f / static_cast<float>(group);
        for (std::int64_t i = 0; i < width; ++i) dst[i] *= inv;
      }
    }
  }
  return {bad_o, bad_q};
}

}  // namespace

LayerAttention AttentionDump::decode_layer(const RawLayer& raw, GqaReduce gqa, double tol, int threads) const {
  const DumpSample& s = *raw.sample;
  const std::int64_t H = s.heads, n = s.prompt_len, T = s.steps, width = n + T, layer = raw.layer;
  const std::string ctx = fmt::format("{}: sample '{}'", path_, s.name);
  if (threads <= 0) threads = omp_get_max_threads();
  LayerAttention out;
  out.heads = kv_heads_;
  out.n = n;
  out.steps = T;
  out.prefill.resize(static_cast<std::size_t>(kv_heads_ * n));
  out.decode.resize(static_cast<std::size_t>(T * kv_heads_ * width));

  // On a failed fast check, the offending row is converted again and
  // described exactly by check_rows (which throws).
  auto explain = [&](const std::uint16_t* half, const float* single, std::int64_t offset, std::int64_t w,
                     std::int64_t len, const std::string& dctx, const std::string& where) {
    std::vector<float> row(static_cast<std::size_t>(w));
    if (half) {
      fp16::to_floats(half + offset, w, row.data());
    } else {
      std::copy(single + offset, single + offset + w, row.data());
    }
    check_rows(row.data(), 1, w, len, tol, dctx, [&](std::int64_t) { return where; });
    fail("{}: {}: invalid row", dctx, where);
  };

  auto [po, pq] = decode_rows(
      raw.prefill_half ? raw.prefill16.data() : nullptr, raw.prefill_half ? nullptr : raw.prefill32.data(), 1, H,
      kv_heads_, n, [n](std::int64_t) { return n; }, gqa, tol, out.prefill.data(), threads);
  if (po >= 0) {
    explain(raw.prefill_half ? raw.prefill16.data() : nullptr, raw.prefill_half ? nullptr : raw.prefill32.data(),
            pq * n, n, n, ctx + ", dataset 'prefill'", fmt::format("layer {}, head {}", layer, pq));
  }
  auto [dt, dq] = decode_rows(
      raw.decode_half ? raw.decode16.data() : nullptr, raw.decode_half ? nullptr : raw.decode32.data(), T, H, kv_heads_,
      width, [n](std::int64_t t) { return n + t + 1; }, gqa, tol, out.decode.data(), threads);
  if (dt >= 0) {
    explain(raw.decode_half ? raw.decode16.data() : nullptr, raw.decode_half ? nullptr : raw.decode32.data(),
            (dt * H + dq) * width, width, n + dt + 1, ctx + ", dataset 'decode'",
            fmt::format("step {}, layer {}, head {}", dt, layer, dq));
  }
  return out;
}

LayerAttention AttentionDump::read_layer(const DumpSample& s, std::int64_t layer, GqaReduce gqa, double tol,
                                         int threads) const {
  return decode_layer(read_raw_layer(s, layer), gqa, tol, threads);
}

}  // namespace kvcal

namespace kvcal {

std::int64_t AttentionDump::qkv_head_dim(const DumpSample& s) const {
  const std::string ctx = fmt::format("{}: sample '{}'", path_, s.name);
  H5Handle g(H5Gopen2(impl_->file.get(), ("samples/" + s.name).c_str(), H5P_DEFAULT), H5Gclose);
  KVCAL_CHECK(g.valid(), "{}: cannot open the sample group", ctx);
  int present = 0;
  for (const char* name : {"queries", "keys", "values"}) present += H5Lexists(g.get(), name, H5P_DEFAULT) > 0;
  if (present == 0) return 0;
  KVCAL_CHECK(present == 3, "{}: holds only some of queries, keys and values (record with --qkv)", ctx);
  std::int64_t dh = -1;
  for (const char* name : {"queries", "keys", "values"}) {
    const std::string dctx = fmt::format("{}, dataset '{}'", ctx, name);
    H5Handle ds = detail::open_dataset(g.get(), name, ctx);
    const detail::DatasetInfo info = detail::dataset_info(ds.get());
    KVCAL_CHECK(info.type_class == H5T_FLOAT &&
                    (info.float_kind == detail::FloatKind::f16 || info.float_kind == detail::FloatKind::f32),
                "{}: must be float16 or float32", dctx);
    KVCAL_CHECK(info.dims.size() == 4, "{}: must have rank 4, has {}", dctx, info.dims.size());
    const bool q = std::string(name) == "queries";
    const std::vector<std::int64_t> want =
        q ? std::vector<std::int64_t>{s.steps, layers_, q_heads_, info.dims[3]}
          : std::vector<std::int64_t>{layers_, kv_heads_, s.prompt_len + s.steps, info.dims[3]};
    KVCAL_CHECK(info.dims == want, "{}: shape [{}], expected [{}]", dctx, fmt::join(info.dims, ", "),
                fmt::join(want, ", "));
    KVCAL_CHECK(info.dims[3] >= 1 && info.dims[3] <= 4096, "{}: head dim {} is out of range", dctx, info.dims[3]);
    KVCAL_CHECK(dh < 0 || dh == info.dims[3], "{}: head dim {} differs from the other datasets' {}", dctx, info.dims[3],
                dh);
    dh = info.dims[3];
  }
  // One layer's queries, keys and values are read at once: refuse what could not fit.
  const double layer_bytes = 2.0 * static_cast<double>(dh) *
                             (static_cast<double>(s.steps) * static_cast<double>(q_heads_) +
                              2.0 * static_cast<double>(kv_heads_) * static_cast<double>(s.prompt_len + s.steps));
  KVCAL_CHECK(layer_bytes <= static_cast<double>(std::int64_t{1} << 34),
              "{}: one layer's queries, keys and values take {:.3g} GB, more than kvcal reads at once (16 GiB)", ctx,
              layer_bytes / 1e9);
  return dh;
}

AttentionDump::QkvLayer AttentionDump::read_qkv_layer(const DumpSample& s, std::int64_t layer) const {
  KVCAL_CHECK(layer >= 0 && layer < layers_, "layer {} out of range", layer);
  QkvLayer out;
  out.head_dim = qkv_head_dim(s);
  KVCAL_CHECK(out.head_dim > 0, "{}: sample '{}' holds no queries/keys/values (record with --qkv)", path_, s.name);
  const std::string ctx = fmt::format("{}: sample '{}'", path_, s.name);
  H5Handle g(H5Gopen2(impl_->file.get(), ("samples/" + s.name).c_str(), H5P_DEFAULT), H5Gclose);
  KVCAL_CHECK(g.valid(), "{}: cannot open the sample group", ctx);
  const std::int64_t dh = out.head_dim, S = s.prompt_len + s.steps;
  const auto read = [&](const char* name, const std::vector<std::int64_t>& start,
                        const std::vector<std::int64_t>& count, std::vector<std::uint16_t>& dst) {
    H5Handle ds = detail::open_dataset(g.get(), name, ctx);
    std::vector<float> single;
    const bool half =
        detail::read_raw_float_block(ds.get(), start, count, dst, single, fmt::format("{}, dataset '{}'", ctx, name));
    if (!half) {
      dst.resize(single.size());
      for (std::size_t i = 0; i < single.size(); ++i) dst[i] = fp16::from_float(single[i]);
    }
  };
  read("queries", {0, layer, 0, 0}, {s.steps, 1, q_heads_, dh}, out.queries);
  read("keys", {layer, 0, 0, 0}, {1, kv_heads_, S, dh}, out.keys);
  read("values", {layer, 0, 0, 0}, {1, kv_heads_, S, dh}, out.values);
  return out;
}

}  // namespace kvcal
