// Attention dumps (format "kvcal.attention_dump", format_version 1; see
// schemas/attention_dump.v1.json): attention rows recorded on calibration
// prompts by scripts/record_attention.py.
//
// Root attributes: format, format_version, model, num_layers L,
// num_q_heads Hq, num_kv_heads Hkv. One group per sample under
// /samples/<name>, attribute prompt_len N, datasets
//   prefill float16|float32 [L, H, N]        last prompt token over the N prompt keys;
//   decode  float16|float32 [T, L, H, N+T]   decode step t over N+t+1 keys, zero padded;
// H = Hq (query heads, reduced here to KV heads) or H = Hkv.
// The reader validates everything it returns and reads one layer of one
// sample at a time, so memory stays bounded whatever the dump's size.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcal/profile/heads.h"

namespace kvcal {

inline constexpr const char* kAttentionDumpFormat = "kvcal.attention_dump";
inline constexpr std::int64_t kAttentionDumpFormatVersion = 1;

struct DumpSample {
  std::string name;
  std::int64_t prompt_len = 0;  // N
  std::int64_t steps = 0;       // T
  std::int64_t heads = 0;       // H as stored (Hq or Hkv)
};

class AttentionDump {
 public:
  // Opens and checks the root attributes and every sample's shapes.
  explicit AttentionDump(const std::string& path);
  ~AttentionDump();
  AttentionDump(const AttentionDump&) = delete;
  AttentionDump& operator=(const AttentionDump&) = delete;

  const std::string& path() const { return path_; }
  const std::string& model() const { return model_; }
  std::int64_t layers() const { return layers_; }
  std::int64_t q_heads() const { return q_heads_; }
  std::int64_t kv_heads() const { return kv_heads_; }
  const std::vector<DumpSample>& samples() const { return samples_; }

  // Layer `layer` of a sample, validated (finite, non-negative rows summing to
  // 1 within row_tolerance, zero padding) and reduced to KV heads.
  LayerAttention read_layer(const DumpSample& sample, std::int64_t layer, GqaReduce gqa, double row_tolerance = 2e-2,
                            int threads = 0) const;

  // The two halves of read_layer, so that reading the next layer (HDF5, one
  // thread) can overlap decoding the current one (any thread).
  struct RawLayer {
    const DumpSample* sample = nullptr;
    std::int64_t layer = 0;
    bool prefill_half = false, decode_half = false;
    std::vector<std::uint16_t> prefill16, decode16;
    std::vector<float> prefill32, decode32;
  };
  RawLayer read_raw_layer(const DumpSample& sample, std::int64_t layer) const;
  LayerAttention decode_layer(const RawLayer& raw, GqaReduce gqa, double row_tolerance = 2e-2, int threads = 0) const;

  // Decode queries and all keys/values of one layer (recorded with --qkv),
  // as IEEE binary16 patterns (float32 datasets are rounded to binary16).
  struct QkvLayer {
    std::int64_t head_dim = 0;
    std::vector<std::uint16_t> queries;       // [T][Hq][Dh]
    std::vector<std::uint16_t> keys, values;  // [Hkv][N+T][Dh]
  };
  // Dh when the sample holds queries, keys and values of consistent shapes;
  // 0 when it holds none of them; throws kvcal::Error when they are
  // malformed or only some are present.
  std::int64_t qkv_head_dim(const DumpSample& sample) const;
  QkvLayer read_qkv_layer(const DumpSample& sample, std::int64_t layer) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string path_, model_;
  std::int64_t layers_ = 0, q_heads_ = 0, kv_heads_ = 0;
  std::vector<DumpSample> samples_;
};

}  // namespace kvcal
