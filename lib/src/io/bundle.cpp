#include "kvcal/io/bundle.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include <boost/property_tree/json_parser.hpp>
#include <boost/property_tree/ptree.hpp>

#include "io/bundle_internal.h"
#include "io/h5.h"
#include "kvcal/core/sha256.h"
#include "kvcal/core/version.h"
#include "kvcal/io/entropy_calibration.h"
#include "kvcal/io/head_profile.h"
#include "kvcal/io/masks.h"
#include "kvcal/io/validate.h"

namespace kvcal {

using boost::property_tree::ptree;
using detail::H5Handle;

ModelConfig read_model_config(const std::string& path) {
  ptree t;
  try {
    boost::property_tree::read_json(path, t);
  } catch (const std::exception& e) {
    fail("{}: not a readable JSON model config ({})", path, e.what());
  }
  auto get = [&](const char* key) -> std::int64_t {
    const auto v = t.get_optional<std::int64_t>(key);
    KVCAL_CHECK(v.has_value(), "{}: no integer '{}' (expected a HuggingFace config.json)", path, key);
    KVCAL_CHECK(*v >= 1 && *v <= (std::int64_t{1} << 20), "{}: '{}' = {} is out of range", path, key, *v);
    return *v;
  };
  ModelConfig c;
  c.layers = get("num_hidden_layers");
  c.q_heads = get("num_attention_heads");
  c.kv_heads = t.get_optional<std::int64_t>("num_key_value_heads") ? get("num_key_value_heads") : c.q_heads;
  if (t.get_optional<std::int64_t>("head_dim")) {
    c.head_dim = get("head_dim");
  } else {
    const std::int64_t hidden = get("hidden_size");
    KVCAL_CHECK(hidden % c.q_heads == 0, "{}: hidden_size {} is not a multiple of num_attention_heads {}", path, hidden,
                c.q_heads);
    c.head_dim = hidden / c.q_heads;
  }
  KVCAL_CHECK(c.q_heads % c.kv_heads == 0, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
              path, c.q_heads, c.kv_heads);
  return c;
}

namespace detail {

std::string dataset_sha256(hid_t ds) {
  H5Handle type(H5Dget_type(ds), H5Tclose);
  H5Handle space(H5Dget_space(ds), H5Sclose);
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  const std::size_t size = H5Tget_size(type.get());
  KVCAL_CHECK(n >= 0 && size > 0 && static_cast<double>(n) * static_cast<double>(size) < 4e9,
              "dataset too large to checksum");
  std::vector<unsigned char> bytes(static_cast<std::size_t>(n) * size);
  if (n > 0) KVCAL_CHECK(H5Dread(ds, type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data()) >= 0, "cannot read");
  Sha256 h;
  h.update(bytes.data(), bytes.size());
  return h.hex_digest();
}

void hash_datasets(hid_t loc, const std::string& prefix, std::map<std::string, std::string>& out) {
  for (const std::string& name : list_links(loc)) {
    H5Handle obj(H5Oopen(loc, name.c_str(), H5P_DEFAULT), H5Oclose);
    if (!obj.valid()) continue;
    const std::string path = prefix + "/" + name;
    if (H5Iget_type(obj.get()) == H5I_DATASET) {
      out[path] = dataset_sha256(obj.get());
    } else if (H5Iget_type(obj.get()) == H5I_GROUP) {
      hash_datasets(obj.get(), path, out);
    }
  }
}

void check_manifest(hid_t file, const std::string& path, std::vector<std::string>& problems) {
  ptree manifest;
  try {
    std::istringstream in(read_attr_string(file, "manifest", path));
    boost::property_tree::read_json(in, manifest);
  } catch (const std::exception& e) {
    problems.push_back(fmt::format("{}: the manifest is not valid JSON ({})", path, e.what()));
    return;
  }
  const auto listed = manifest.get_child_optional("datasets");
  if (!listed) {
    problems.push_back(path + ": the manifest lists no dataset checksums");
    return;
  }
  std::map<std::string, std::string> actual;
  try {
    hash_datasets(file, "", actual);
  } catch (const Error& e) {
    problems.push_back(fmt::format("{}: {}", path, e.what()));
    return;
  }
  std::set<std::string> seen;
  for (const auto& [name, value] : *listed) {
    seen.insert(name);
    const auto it = actual.find(name);
    if (it == actual.end()) {
      problems.push_back(fmt::format("{}: manifest lists {}, which the file lacks", path, name));
    } else if (it->second != value.get_value<std::string>()) {
      problems.push_back(fmt::format("{}: checksum mismatch in {} (SHA-256 {}, manifest {}): the data changed", path,
                                     name, it->second.substr(0, 16), value.get_value<std::string>().substr(0, 16)));
    }
  }
  for (const auto& [name, hash] : actual) {
    if (!seen.count(name)) problems.push_back(fmt::format("{}: {} is not in the manifest", path, name));
  }
}

}  // namespace detail

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// Copies every attribute of src onto dst (fixed-size types byte for byte,
// variable-length strings as strings).
void copy_attributes(hid_t src_loc, hid_t dst) {
  // Attributes of a file live on its root group.
  H5Handle src(H5Oopen(src_loc, ".", H5P_DEFAULT), H5Oclose);
  KVCAL_CHECK(src.valid(), "cannot open the attributes' object");
  H5O_info_t info;
  KVCAL_CHECK(H5Oget_info(src.get(), &info) >= 0, "cannot list attributes");
  const auto n = static_cast<int>(info.num_attrs);
  for (int i = 0; i < n; ++i) {
    H5Handle a(H5Aopen_by_idx(src.get(), ".", H5_INDEX_CRT_ORDER, H5_ITER_INC, static_cast<hsize_t>(i), H5P_DEFAULT,
                              H5P_DEFAULT),
               H5Aclose);
    if (!a.valid()) {
      a = H5Handle(
          H5Aopen_by_idx(src.get(), ".", H5_INDEX_NAME, H5_ITER_INC, static_cast<hsize_t>(i), H5P_DEFAULT, H5P_DEFAULT),
          H5Aclose);
    }
    KVCAL_CHECK(a.valid(), "cannot open attribute {}", i);
    char name[256] = {};
    H5Aget_name(a.get(), sizeof name, name);
    H5Handle type(H5Aget_type(a.get()), H5Tclose);
    if (H5Tget_class(type.get()) == H5T_STRING && H5Tis_variable_str(type.get()) > 0) {
      detail::write_attr(dst, name, detail::read_attr_string(src.get(), name, "copy"));
      continue;
    }
    H5Handle space(H5Aget_space(a.get()), H5Sclose);
    const hssize_t points = H5Sget_simple_extent_npoints(space.get());
    std::vector<unsigned char> buf(static_cast<std::size_t>(std::max<hssize_t>(points, 1)) * H5Tget_size(type.get()));
    KVCAL_CHECK(H5Aread(a.get(), type.get(), buf.data()) >= 0, "cannot read attribute '{}'", name);
    H5Handle out(H5Acreate2(dst, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    KVCAL_CHECK(out.valid() && H5Awrite(out.get(), type.get(), buf.data()) >= 0, "cannot write attribute '{}'", name);
  }
}

void copy_object(hid_t src, const std::string& from, hid_t dst, const std::string& to) {
  KVCAL_CHECK(H5Ocopy(src, from.c_str(), dst, to.c_str(), H5P_DEFAULT, H5P_DEFAULT) >= 0,
              "cannot copy {} into the bundle", from);
}

H5Handle open_read(const std::string& path) {
  H5Handle f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  KVCAL_CHECK(f.valid(), "{}: cannot open", path);
  return f;
}

void require_valid(const std::string& option, const std::string& path, const std::string& format) {
  const ValidationReport r = validate_artifact(path);
  KVCAL_CHECK(r.ok(), "{} {}: {} (run kvcal validate {})", option, path, r.problems.empty() ? "" : r.problems.front(),
              path);
  KVCAL_CHECK(r.format == format, "{} {}: a '{}' file, but '{}' is needed", option, path, r.format, format);
}

}  // namespace

void write_bundle(const std::string& out, const BundleInputs& in, const std::string& command_line) {
  KVCAL_CHECK(!in.model.empty(), "--model is required: the model the bundle is for");
  KVCAL_CHECK(!in.masks.empty(), "give at least one --masks file");
  KVCAL_CHECK(!in.heads.empty() && !in.entropy.empty(), "--heads and --entropy are required");
  detail::check_output_path(out);
  for (const auto& m : in.masks) require_valid("--masks", m, kMaskFormat);
  require_valid("--heads", in.heads, kHeadProfileFormat);
  require_valid("--entropy", in.entropy, kEntropyFormat);

  const HeadProfile heads = read_head_profile(in.heads);
  std::vector<MaskFile> masks;
  for (const auto& m : in.masks) masks.push_back(read_mask_file(m));
  std::string config_json;
  if (!in.model_config.empty()) {
    const ModelConfig c = read_model_config(in.model_config);
    KVCAL_CHECK(heads.layers == c.layers && heads.kv_heads == c.kv_heads,
                "--heads {}: the profile is {} layers x {} KV heads, but {} says num_hidden_layers = {}, "
                "num_key_value_heads = {}",
                in.heads, heads.layers, heads.kv_heads, in.model_config, c.layers, c.kv_heads);
    KVCAL_CHECK(heads.q_heads == c.q_heads, "--heads {}: {} query heads, but {} says num_attention_heads = {}",
                in.heads, heads.q_heads, in.model_config, c.q_heads);
    for (std::size_t i = 0; i < masks.size(); ++i) {
      for (const auto& r : masks[i].masks) {
        KVCAL_CHECK(r.mask.cols == c.head_dim,
                    "--masks {}: mask '{}' has {} channels, but the head dimension is {} ({})", in.masks[i], r.id,
                    r.mask.cols, c.head_dim, in.model_config);
      }
    }
    config_json = fmt::format(
        "{{\"source\": {}, \"sha256\": \"{}\", \"num_hidden_layers\": {}, \"num_attention_heads\": {}, "
        "\"num_key_value_heads\": {}, \"head_dim\": {}}}",
        json_string(in.model_config), sha256_file(in.model_config), c.layers, c.q_heads, c.kv_heads, c.head_dim);
  }

  detail::write_atomically_sealed(out, [&](hid_t f) {
    detail::write_provenance(f, kBundleFormat, kBundleFormatVersion, command_line);
    detail::write_attr(f, "model", in.model);
    std::string mask_parts;
    {
      H5Handle g = detail::create_group(f, "masks");
      std::set<std::string> used;
      for (std::size_t i = 0; i < in.masks.size(); ++i) {
        H5Handle src = open_read(in.masks[i]);
        std::string ids;
        for (const auto& r : masks[i].masks) {
          std::string id = r.id;
          if (used.count(id)) id = fmt::format("f{}_{}", i, r.id);
          KVCAL_CHECK(!used.count(id), "mask id '{}' appears twice", id);
          used.insert(id);
          copy_object(src.get(), "/masks/" + r.id, g.get(), id);
          ids += (ids.empty() ? "" : ", ") + json_string(id);
        }
        mask_parts += fmt::format(
            "{}{{\"source\": {}, \"sha256\": \"{}\", \"format\": \"{}\", \"format_version\": {}, "
            "\"masks\": [{}]}}",
            mask_parts.empty() ? "" : ", ", json_string(in.masks[i]), sha256_file(in.masks[i]), kMaskFormat,
            masks[i].format_version, ids);
      }
    }
    {
      H5Handle src = open_read(in.heads);
      H5Handle g = detail::create_group(f, "heads");
      copy_attributes(src.get(), g.get());
      H5Handle sg = detail::open_group(src.get(), "heads", in.heads);
      for (const auto& name : detail::list_links(sg.get())) copy_object(sg.get(), name, g.get(), name);
    }
    {
      H5Handle src = open_read(in.entropy);
      H5Handle g = detail::create_group(f, "entropy");
      copy_attributes(src.get(), g.get());
      for (const auto& name : detail::list_links(src.get())) copy_object(src.get(), name, g.get(), name);
    }
    const auto& o = heads.options;
    const EntropyCalibration ent = read_entropy_calibration(in.entropy);
    std::map<std::string, std::string> hashes;
    detail::hash_datasets(f, "", hashes);
    std::string ds;
    for (const auto& [name, hash] : hashes)
      ds += fmt::format("{}{}: \"{}\"", ds.empty() ? "" : ", ", json_string(name), hash);
    const std::string manifest = fmt::format(
        "{{\"format\": \"{}\", \"format_version\": {}, \"model\": {}, \"kvcal_version\": \"{}\", "
        "\"created_utc\": {}, \"parts\": {{\"masks\": [{}], "
        "\"heads\": {{\"source\": {}, \"sha256\": \"{}\", \"format\": \"{}\", \"format_version\": {}, \"parameters\": "
        "{{\"tau_stable\": {}, \"tau_sim\": {}, \"tau_drift\": {}, \"topk\": {}, \"topk_frac\": {}, \"pool_kernel\": "
        "{}, "
        "\"gqa\": \"{}\", \"budget\": {}, \"num_samples\": {}}}}}, "
        "\"entropy\": {{\"source\": {}, \"sha256\": \"{}\", \"format\": \"{}\", \"format_version\": {}, "
        "\"parameters\": "
        "{{\"page_size\": {}, \"percentile\": {}, \"unit\": \"{}\", \"page_varentropy\": \"{}\", \"rule\": \"{}\", "
        "\"entropy_threshold\": {}, \"varentropy_threshold\": {}}}}}}}{}, \"datasets\": {{{}}}}}",
        kBundleFormat, kBundleFormatVersion, json_string(in.model), kVersion,
        json_string(detail::read_attr_string(f, "created_utc", out)), mask_parts, json_string(in.heads),
        sha256_file(in.heads), kHeadProfileFormat, kHeadProfileFormatVersion, o.taxonomy.tau_stable, o.taxonomy.tau_sim,
        o.tau_drift, o.overlap.topk, o.overlap.topk_frac, o.overlap.pool_kernel, to_string(o.gqa), o.budget.budget,
        heads.num_samples, json_string(in.entropy), sha256_file(in.entropy), kEntropyFormat, kEntropyFormatVersion,
        ent.options.page.page_size, ent.options.percentile, to_string(ent.options.unit),
        to_string(ent.options.page.varentropy), to_string(ent.options.rule), ent.entropy_threshold,
        ent.varentropy_threshold, config_json.empty() ? "" : ", \"model_config\": " + config_json, ds);
    detail::write_attr(f, "manifest", manifest);
  });
}

BundleContents read_bundle(const std::string& path) {
  BundleContents b;
  std::int64_t version = 0;
  H5Handle f = detail::open_artifact(path, kBundleFormat, kBundleFormatVersion, &version);
  b.model = detail::read_attr_string(f.get(), "model", path);
  {
    const std::string where = path + ":/masks";
    H5Handle g = detail::open_group(f.get(), "masks", path);
    for (const std::string& id : detail::list_links(g.get())) {
      b.masks.push_back(detail::read_mask_group(g.get(), id, where, fmt::format("{}/{}", where, id)));
    }
  }
  {
    H5Handle g = detail::open_group(f.get(), "heads", path);
    b.heads = detail::read_head_profile(g.get(), g.get(), path + ":/heads", path + ":/heads");
  }
  {
    H5Handle g = detail::open_group(f.get(), "entropy", path);
    b.entropy = detail::read_entropy_calibration(g.get(), path + ":/entropy");
  }
  return b;
}

}  // namespace kvcal
