// Writes small attention dumps with planted structure for the tests.
#pragma once

#include <hdf5.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "io/h5.h"

namespace kvcal::test {

struct SyntheticSample {
  std::string name;
  std::int64_t n = 0, steps = 0, heads = 0;  // heads as stored (Hq or Hkv)
  std::vector<float> prefill;                // [L, heads, n]
  std::vector<float> decode;                 // [T, L, heads, n + T]
};

// A row of `len` valid entries over `width`: mass 0.9 spread evenly on
// `peaks`, the remaining 0.1 spread evenly on every valid position.
inline std::vector<float> peaked_row(std::int64_t len, std::int64_t width, const std::vector<std::int64_t>& peaks) {
  std::vector<float> row(static_cast<std::size_t>(width), 0.0f);
  for (std::int64_t i = 0; i < len; ++i) row[i] = 0.1f / static_cast<float>(len);
  for (auto p : peaks) row[p] += 0.9f / static_cast<float>(peaks.size());
  return row;
}

// Writes a dump; `half` stores float16 (IEEE binary16) instead of float32.
inline void write_dump(const std::string& path, std::int64_t layers, std::int64_t hq, std::int64_t hkv,
                       const std::vector<SyntheticSample>& samples, bool half = false,
                       const std::function<void(hid_t)>& tamper = {}) {
  detail::h5_init();
  detail::H5Handle f(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  detail::write_attr(f.get(), "format", std::string("kvcal.attention_dump"));
  detail::write_attr(f.get(), "format_version", std::int64_t{1});
  detail::write_attr(f.get(), "model", std::string("synthetic"));
  detail::write_attr(f.get(), "num_layers", layers);
  detail::write_attr(f.get(), "num_q_heads", hq);
  detail::write_attr(f.get(), "num_kv_heads", hkv);
  detail::H5Handle root = detail::create_group(f.get(), "samples");
  detail::H5Handle f16(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  H5Tset_fields(f16.get(), 15, 10, 5, 0, 10);
  H5Tset_precision(f16.get(), 16);
  H5Tset_size(f16.get(), 2);
  H5Tset_ebias(f16.get(), 15);
  for (const auto& s : samples) {
    detail::H5Handle g = detail::create_group(root.get(), s.name);
    detail::write_attr(g.get(), "prompt_len", s.n);
    auto put = [&](const char* name, const std::vector<hsize_t>& dims, const std::vector<float>& data) {
      detail::H5Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
      detail::H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
      std::vector<hsize_t> chunk = dims;
      chunk[0] = 1;
      H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data());
      H5Pset_deflate(dcpl.get(), 1);
      detail::H5Handle ds(H5Dcreate2(g.get(), name, half ? f16.get() : H5T_IEEE_F32LE, space.get(), H5P_DEFAULT,
                                     dcpl.get(), H5P_DEFAULT),
                          H5Dclose);
      H5Dwrite(ds.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data());
    };
    put("prefill", {static_cast<hsize_t>(layers), static_cast<hsize_t>(s.heads), static_cast<hsize_t>(s.n)}, s.prefill);
    put("decode",
        {static_cast<hsize_t>(s.steps), static_cast<hsize_t>(layers), static_cast<hsize_t>(s.heads),
         static_cast<hsize_t>(s.n + s.steps)},
        s.decode);
  }
  if (tamper) tamper(f.get());
}

// The planted dump: 2 layers, 8 query heads in 4 KV groups, N = 160, T = 3.
// Peak sets: group g of a layer uses positions [10 g, 10 g + 8); a shifting
// head moves them by 40 (t + 1) at step t, away from every prefill set.
struct Kind {
  int group;
  bool stable;
};
inline const std::vector<std::vector<Kind>> kPlanted = {
    {{0, true}, {0, true}, {0, true}, {1, true}},     // layer 0: pivot 0 + satellites 1, 2; anchor 3
    {{0, false}, {0, false}, {1, false}, {2, true}},  // layer 1: pivot 0 + satellite 1; volatile 2; anchor 3
};

inline SyntheticSample planted_sample(const std::string& name, std::int64_t hq = 8) {
  const std::int64_t L = 2, hkv = 4, n = 160, T = 3, width = n + T, group = hq / hkv;
  SyntheticSample s;
  s.name = name;
  s.n = n;
  s.steps = T;
  s.heads = hq;
  s.prefill.resize(static_cast<std::size_t>(L * hq * n));
  s.decode.assign(static_cast<std::size_t>(T * L * hq * width), 0.0f);
  for (std::int64_t l = 0; l < L; ++l) {
    for (std::int64_t q = 0; q < hq; ++q) {
      const Kind k = kPlanted[l][q / group];
      std::vector<std::int64_t> peaks;
      for (int j = 0; j < 8; ++j) peaks.push_back(10 * k.group + j);
      const auto pre = peaked_row(n, n, peaks);
      std::copy(pre.begin(), pre.end(), s.prefill.begin() + (l * hq + q) * n);
      for (std::int64_t t = 0; t < T; ++t) {
        std::vector<std::int64_t> now = peaks;
        if (!k.stable) {
          for (auto& p : now) p = (p + 40 * (t + 1)) % n;
        }
        const auto row = peaked_row(n + t + 1, width, now);
        std::copy(row.begin(), row.end(), s.decode.begin() + ((t * L + l) * hq + q) * width);
      }
    }
  }
  return s;
}

}  // namespace kvcal::test
