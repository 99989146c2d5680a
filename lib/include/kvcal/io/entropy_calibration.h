// Entropy/varentropy thresholds for CHESS re-selection (format
// "kvcal.entropy_calibration", format_version 1; schemas/entropy_calibration.v1.json).
//
// Inputs: attention dumps whose samples hold `logits` [N+T, V] (float16 or
// float32; read in row blocks, so V x rows never has to fit in memory) or the
// precomputed `token_entropy` and `token_varentropy` [N+T] (nats).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvcal/profile/entropy.h"

namespace kvcal {

inline constexpr const char* kEntropyFormat = "kvcal.entropy_calibration";
inline constexpr std::int64_t kEntropyFormatVersion = 1;

enum class EntropyUnit { nats, bits };
const char* to_string(EntropyUnit u);
EntropyUnit parse_entropy_unit(const std::string& name);  // throws kvcal::Error

struct EntropyOptions {
  PageOptions page;
  double percentile = 99;
  TriggerRule rule = TriggerRule::both;
  EntropyUnit unit = EntropyUnit::nats;
  std::int64_t bins = 64;
  int threads = 0;
};

struct EntropyCalibration {
  EntropyOptions options;
  double entropy_threshold = 0, varentropy_threshold = 0;
  double trigger_rate = 0;  // fraction of calibration pages above the thresholds by the rule
  std::int64_t num_pages = 0, num_tokens = 0;
  std::vector<double> page_entropy, page_varentropy;    // [num_pages]
  std::vector<double> entropy_edges, varentropy_edges;  // [bins + 1]
  std::vector<double> histogram;                        // [bins, bins]: entropy rows, varentropy columns
  std::vector<std::string> input_sha256;
  std::vector<std::string> sources;  // per sample: "logits" or "token_stats"
};

// Token statistics of every sample, pages, thresholds, trigger rate and the
// 2-D histogram. Progress goes to the log.
EntropyCalibration calibrate_entropy(const std::vector<std::string>& dump_paths, const EntropyOptions& options);

// calibrate_entropy in three steps, so that samples can be split over
// processes (the CLI's MPI layer) with the same bytes out: list the samples,
// compute one sample's pages anywhere, finish over every sample in list order
// (the serial order: pages are concatenated, then percentiles taken).
struct EntropySampleRef {
  std::size_t file = 0;     // index into the paths
  std::string name;         // group under /samples
  std::int64_t weight = 1;  // values to read: (N+T) x V logits, or N+T statistics (for splitting work)
};
struct EntropySamplePages {
  std::vector<double> page_entropy, page_varentropy;  // in the calibration's unit
  std::int64_t tokens = 0;
  std::string source;  // "logits" or "token_stats"
};
// Opens every dump (format checked) and lists its samples, file by file.
std::vector<EntropySampleRef> list_entropy_samples(const std::vector<std::string>& dump_paths,
                                                   const EntropyOptions& options);
EntropySamplePages entropy_sample_pages(const std::string& dump_path, const std::string& sample,
                                        const EntropyOptions& options);
EntropyCalibration finish_entropy_calibration(const EntropyOptions& options,
                                              const std::vector<EntropySamplePages>& samples,
                                              std::vector<std::string> input_sha256);

// The pages that trigger under the thresholds and rule (strictly above).
bool triggers(double page_entropy, double page_varentropy, double entropy_threshold, double varentropy_threshold,
              TriggerRule rule);

// One sample's token entropy and varentropy (nats), from its logits or its
// stored statistics; `expected` is N + T (0: unchecked). Returns the source
// ("logits" or "token_stats"). Throws kvcal::Error.
std::string read_token_stats(const std::string& dump_path, const std::string& sample, std::int64_t expected,
                             std::vector<double>& entropy, std::vector<double>& varentropy);

void write_entropy_calibration(const std::string& path, const EntropyCalibration& c, const std::string& command_line);
EntropyCalibration read_entropy_calibration(const std::string& path);

}  // namespace kvcal
