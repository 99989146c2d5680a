// Internal HDF5 helpers (C API with RAII handles). Every read treats the file
// as untrusted: types, ranks and sizes are checked before data is read.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvcal/core/error.h"

namespace kvcal::detail {

// Silences HDF5's own error-stack printing (kvcal reports errors itself).
void h5_init();

class H5Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Handle() = default;
  H5Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  H5Handle(const H5Handle&) = delete;
  H5Handle& operator=(const H5Handle&) = delete;
  H5Handle(H5Handle&& o) noexcept : id_(std::exchange(o.id_, H5I_INVALID_HID)), closer_(o.closer_) {}
  H5Handle& operator=(H5Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = std::exchange(o.id_, H5I_INVALID_HID);
      closer_ = o.closer_;
    }
    return *this;
  }
  ~H5Handle() { reset(); }
  void reset() {
    if (id_ >= 0 && closer_) closer_(id_);
    id_ = H5I_INVALID_HID;
  }
  hid_t get() const { return id_; }
  hid_t release() { return std::exchange(id_, H5I_INVALID_HID); }
  bool valid() const { return id_ >= 0; }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Opens an existing kvcal artifact for reading; checks it is HDF5 and that its
// root attribute `format` equals expected_format and `format_version` is
// at most max_version. Returns the file handle; sets *version.
// Opens any kvcal artifact (an HDF5 file with a root attribute `format`) and
// returns it; sets *format.
H5Handle open_any_artifact(const std::string& path, std::string* format);

H5Handle open_artifact(const std::string& path, const std::string& expected_format, std::int64_t max_version,
                       std::int64_t* version);

H5Handle open_group(hid_t loc, const std::string& name, const std::string& context);
H5Handle create_group(hid_t loc, const std::string& name);
bool has_link(hid_t loc, const std::string& name);
std::vector<std::string> list_links(hid_t loc);

// Attributes.
void write_attr(hid_t obj, const std::string& name, const std::string& value);
void write_attr(hid_t obj, const std::string& name, std::int64_t value);
void write_attr(hid_t obj, const std::string& name, std::uint64_t value);
void write_attr(hid_t obj, const std::string& name, double value);
bool has_attr(hid_t obj, const std::string& name);
void write_attr(hid_t obj, const std::string& name, const std::vector<std::uint64_t>& values);
// A 1-D unsigned integer attribute of at most max_elements values.
std::vector<std::uint64_t> read_attr_uint_array(hid_t obj, const std::string& name, const std::string& context,
                                                std::size_t max_elements);
std::string read_attr_string(hid_t obj, const std::string& name, const std::string& context);
std::int64_t read_attr_int(hid_t obj, const std::string& name, const std::string& context);
std::uint64_t read_attr_uint(hid_t obj, const std::string& name, const std::string& context);
double read_attr_double(hid_t obj, const std::string& name, const std::string& context);

// 1-D datasets. `max_elements` bounds what a hostile file can make us allocate.
void write_dataset_1d(hid_t loc, const std::string& name, const std::vector<std::int64_t>& data);
void write_dataset_1d(hid_t loc, const std::string& name, const std::vector<std::int32_t>& data);
std::vector<std::int64_t> read_int64_1d(hid_t loc, const std::string& name, const std::string& context,
                                        std::int64_t max_elements);
std::vector<std::int32_t> read_int32_1d(hid_t loc, const std::string& name, const std::string& context,
                                        std::int64_t max_elements);

// Element type of a floating-point dataset.
enum class FloatKind { f16, f32, f64, other };

struct DatasetInfo {
  H5T_class_t type_class = H5T_NO_CLASS;
  FloatKind float_kind = FloatKind::other;  // for H5T_FLOAT
  std::vector<std::int64_t> dims;
  std::int64_t elements() const;
};

// Opens dataset `name` (error naming `context` when missing or not a dataset).
H5Handle open_dataset(hid_t loc, const std::string& name, const std::string& context);
DatasetInfo dataset_info(hid_t dataset);

// Reads the hyperslab [start, start + count) of a float16 or float32 dataset
// without conversion: raw binary16 words into `half`, or floats into
// `single` (float64 is converted to float). Returns true for binary16.
bool read_raw_float_block(hid_t dataset, const std::vector<std::int64_t>& start, const std::vector<std::int64_t>& count,
                          std::vector<std::uint16_t>& half, std::vector<float>& single, const std::string& context);

// N-d datasets, optionally chunked and compressed (chunk empty: contiguous).
void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const float* data,
                   const std::vector<std::int64_t>& chunk = {});
void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const std::int8_t* data);
void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const std::int32_t* data);
void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const double* data);
// Reads a whole dataset of exactly `dims` elements converted to T (float,
// double, int8 or int32 memory types; HDF5 converts between numeric types).
template <typename T>
std::vector<T> read_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims,
                            const std::string& context);

// Provenance attributes every artifact carries at its root.
void write_provenance(hid_t file, const std::string& format, std::int64_t format_version,
                      const std::string& command_line);

// Writes an artifact atomically: the callback fills a fresh HDF5 file at a
// temporary path beside `path`; on success it is renamed over `path`, on any
// failure it is removed and the error rethrown.
template <typename Fill>
void write_atomically(const std::string& path, Fill&& fill);

// The same for a sealed artifact (kvcal/io/seal.h): the file gets a
// kSealSize-byte user block, and once libhdf5 has closed it the seal is
// written there, before the rename.
template <typename Fill>
void write_atomically_sealed(const std::string& path, Fill&& fill);

// Throws kvcal::Error when an artifact cannot be created at final_path: it is
// empty or a directory, or its directory is missing or not writable.
void check_output_path(const std::string& final_path);

// Non-template parts of write_atomically.
std::string make_temp_path(const std::string& path);
H5Handle create_file(const std::string& tmp_path, const std::string& final_path, std::uint64_t user_block = 0);
void commit_file(H5Handle& file, const std::string& tmp_path, const std::string& final_path, bool seal = false);
void discard_file(const std::string& tmp_path);

template <typename Fill>
void write_atomically(const std::string& path, Fill&& fill) {
  const std::string tmp = make_temp_path(path);
  try {
    H5Handle file = create_file(tmp, path);
    fill(file.get());
    commit_file(file, tmp, path);
  } catch (...) {
    discard_file(tmp);
    throw;
  }
}

std::uint64_t seal_user_block();

template <typename Fill>
void write_atomically_sealed(const std::string& path, Fill&& fill) {
  const std::string tmp = make_temp_path(path);
  try {
    H5Handle file = create_file(tmp, path, seal_user_block());
    fill(file.get());
    commit_file(file, tmp, path, true);
  } catch (...) {
    discard_file(tmp);
    throw;
  }
}

}  // namespace kvcal::detail
