#include "kvcal/io/attention_dump.h"

#include <cmath>
#include <functional>

#include "io/h5.h"

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
      KVCAL_CHECK(info.type_class == H5T_FLOAT && info.float_kind != detail::FloatKind::other,
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

LayerAttention AttentionDump::read_layer(const DumpSample& s, std::int64_t layer, GqaReduce gqa, double tol) const {
  KVCAL_CHECK(layer >= 0 && layer < layers_, "layer {} out of range", layer);
  const std::string ctx = fmt::format("{}: sample '{}'", path_, s.name);
  H5Handle g(H5Gopen2(impl_->file.get(), ("samples/" + s.name).c_str(), H5P_DEFAULT), H5Gclose);
  KVCAL_CHECK(g.valid(), "{}: cannot open the sample group", ctx);
  const std::int64_t H = s.heads, n = s.prompt_len, T = s.steps, width = n + T;

  std::vector<float> prefill(static_cast<std::size_t>(H * n));
  {
    H5Handle ds = detail::open_dataset(g.get(), "prefill", ctx);
    const std::string dctx = ctx + ", dataset 'prefill'";
    detail::read_float_block(ds.get(), {layer, 0, 0}, {1, H, n}, prefill.data(), dctx);
    check_rows(prefill.data(), H, n, n, tol, dctx,
               [layer](std::int64_t h) { return fmt::format("layer {}, head {}", layer, h); });
  }
  std::vector<float> decode(static_cast<std::size_t>(T * H * width));
  {
    // One layer's chunks are read once: a chunk cache large enough for them.
    H5Handle dapl(H5Pcreate(H5P_DATASET_ACCESS), H5Pclose);
    H5Pset_chunk_cache(dapl.get(), 10007, std::size_t{64} << 20, 1.0);
    H5Handle ds(H5Dopen2(g.get(), "decode", dapl.get()), H5Dclose);
    const std::string dctx = ctx + ", dataset 'decode'";
    KVCAL_CHECK(ds.valid(), "{}: cannot open", dctx);
    detail::read_float_block(ds.get(), {0, layer, 0, 0}, {T, 1, H, width}, decode.data(), dctx);
    for (std::int64_t t = 0; t < T; ++t) {
      check_rows(decode.data() + t * H * width, H, width, n + t + 1, tol, dctx,
                 [t, layer](std::int64_t h) { return fmt::format("step {}, layer {}, head {}", t, layer, h); });
    }
  }
  LayerAttention out;
  out.heads = kv_heads_;
  out.n = n;
  out.steps = T;
  out.prefill = reduce_gqa(prefill, 1, H, kv_heads_, n, gqa);
  out.decode = reduce_gqa(decode, T, H, kv_heads_, width, gqa);
  return out;
}

}  // namespace kvcal
