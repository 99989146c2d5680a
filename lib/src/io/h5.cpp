#include "io/h5.h"
#include "kvcal/io/temp_files.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include <fmt/ranges.h>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <system_error>

#include "kvcal/core/version.h"
#include "kvcal/io/seal.h"

namespace kvcal::detail {
namespace fs = std::filesystem;

void h5_init() {
  static std::once_flag once;
  std::call_once(once, [] { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); });
}

namespace {

H5Handle attr_handle(hid_t obj, const std::string& name, const std::string& context) {
  KVCAL_CHECK(has_attr(obj, name), "{}: missing attribute '{}'", context, name);
  H5Handle a(H5Aopen(obj, name.c_str(), H5P_DEFAULT), H5Aclose);
  KVCAL_CHECK(a.valid(), "{}: cannot open attribute '{}'", context, name);
  return a;
}

// Checks the attribute holds exactly one element of the given class.
void check_scalar(hid_t attr, H5T_class_t want, bool also_int, const std::string& name, const std::string& context) {
  H5Handle type(H5Aget_type(attr), H5Tclose);
  const H5T_class_t cls = H5Tget_class(type.get());
  KVCAL_CHECK(cls == want || (also_int && cls == H5T_INTEGER), "{}: attribute '{}' has the wrong type", context, name);
  H5Handle space(H5Aget_space(attr), H5Sclose);
  const hssize_t npoints = H5Sget_simple_extent_npoints(space.get());
  KVCAL_CHECK(npoints == 1, "{}: attribute '{}' must hold one value, not {}", context, name, npoints);
}

template <typename T>
void write_attr_native(hid_t obj, const std::string& name, hid_t mem_type, hid_t file_type, const T& value) {
  if (has_attr(obj, name)) H5Adelete(obj, name.c_str());
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  H5Handle attr(H5Acreate2(obj, name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  KVCAL_CHECK(attr.valid() && H5Awrite(attr.get(), mem_type, &value) >= 0, "cannot write attribute '{}'", name);
}

template <typename T>
void write_1d(hid_t loc, const std::string& name, hid_t mem_type, hid_t file_type, const std::vector<T>& data) {
  const hsize_t dims[1] = {static_cast<hsize_t>(data.size())};
  H5Handle space(H5Screate_simple(1, dims, nullptr), H5Sclose);
  H5Handle ds(H5Dcreate2(loc, name.c_str(), file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  KVCAL_CHECK(ds.valid(), "cannot create dataset '{}'", name);
  if (!data.empty()) {
    KVCAL_CHECK(H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) >= 0,
                "cannot write dataset '{}' (disk full?)", name);
  }
}

template <typename T>
std::vector<T> read_1d(hid_t loc, const std::string& name, const std::string& context, std::int64_t max_elements,
                       hid_t mem_type) {
  KVCAL_CHECK(has_link(loc, name), "{}: missing dataset '{}'", context, name);
  H5Handle ds(H5Dopen2(loc, name.c_str(), H5P_DEFAULT), H5Dclose);
  KVCAL_CHECK(ds.valid(), "{}: '{}' is not a dataset", context, name);
  H5Handle type(H5Dget_type(ds.get()), H5Tclose);
  KVCAL_CHECK(H5Tget_class(type.get()) == H5T_INTEGER, "{}: dataset '{}' must hold integers", context, name);
  H5Handle space(H5Dget_space(ds.get()), H5Sclose);
  KVCAL_CHECK(H5Sget_simple_extent_ndims(space.get()) == 1, "{}: dataset '{}' must be one-dimensional", context, name);
  hsize_t dims[1] = {0};
  H5Sget_simple_extent_dims(space.get(), dims, nullptr);
  KVCAL_CHECK(dims[0] <= static_cast<hsize_t>(max_elements),
              "{}: dataset '{}' has {} elements, more than the {} its shape allows", context, name, dims[0],
              max_elements);
  std::vector<T> out(static_cast<std::size_t>(dims[0]));
  if (!out.empty()) {
    KVCAL_CHECK(H5Dread(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) >= 0,
                "{}: cannot read dataset '{}' (file truncated or corrupted?)", context, name);
  }
  return out;
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

H5Handle open_any_artifact(const std::string& path, std::string* format) {
  h5_init();
  std::error_code ec;
  KVCAL_CHECK(fs::exists(path, ec), "{}: no such file", path);
  KVCAL_CHECK(fs::is_regular_file(path, ec), "{}: not a regular file", path);
  KVCAL_CHECK(access(path.c_str(), R_OK) == 0, "{}: permission denied", path);
  const htri_t is_h5 = H5Fis_hdf5(path.c_str());
  KVCAL_CHECK(is_h5 > 0, "{}: not an HDF5 file (wrong file, or damaged header)", path);
  H5Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  KVCAL_CHECK(file.valid(), "{}: cannot open the HDF5 file (truncated or corrupted?)", path);
  KVCAL_CHECK(has_attr(file.get(), "format"), "{}: an HDF5 file but not a kvcal artifact (no root attribute 'format')",
              path);
  *format = read_attr_string(file.get(), "format", path);
  return file;
}

H5Handle open_artifact(const std::string& path, const std::string& expected_format, std::int64_t max_version,
                       std::int64_t* version) {
  std::string format;
  H5Handle file = open_any_artifact(path, &format);
  KVCAL_CHECK(format == expected_format, "{}: a '{}' artifact, but a '{}' file is needed here", path, format,
              expected_format);
  const std::int64_t v = read_attr_int(file.get(), "format_version", path);
  KVCAL_CHECK(v >= 1 && v <= max_version,
              "{}: format_version {} of '{}' is not readable by kvcal {} (it reads versions 1..{}); upgrade kvcal",
              path, v, format, kVersion, max_version);
  if (version) *version = v;
  return file;
}

H5Handle open_group(hid_t loc, const std::string& name, const std::string& context) {
  KVCAL_CHECK(has_link(loc, name), "{}: missing group '{}'", context, name);
  H5Handle obj(H5Oopen(loc, name.c_str(), H5P_DEFAULT), H5Oclose);
  KVCAL_CHECK(obj.valid(), "{}: cannot open '{}'", context, name);
  KVCAL_CHECK(H5Iget_type(obj.get()) == H5I_GROUP, "{}: '{}' is not a group", context, name);
  return obj;
}

H5Handle create_group(hid_t loc, const std::string& name) {
  H5Handle g(H5Gcreate2(loc, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
  KVCAL_CHECK(g.valid(), "cannot create group '{}'", name);
  return g;
}

bool has_link(hid_t loc, const std::string& name) { return H5Lexists(loc, name.c_str(), H5P_DEFAULT) > 0; }

std::vector<std::string> list_links(hid_t loc) {
  std::vector<std::string> names;
  auto cb = [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
    return 0;
  };
  H5Literate(loc, H5_INDEX_NAME, H5_ITER_INC, nullptr, cb, &names);
  return names;
}

void write_attr(hid_t obj, const std::string& name, const std::string& value) {
  if (has_attr(obj, name)) H5Adelete(obj, name.c_str());
  H5Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<std::size_t>(value.size(), 1));
  H5Tset_strpad(type.get(), H5T_STR_NULLPAD);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  H5Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  H5Handle attr(H5Acreate2(obj, name.c_str(), type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  const char* data = value.empty() ? "" : value.data();
  KVCAL_CHECK(attr.valid() && H5Awrite(attr.get(), type.get(), data) >= 0, "cannot write attribute '{}'", name);
}

void write_attr(hid_t obj, const std::string& name, std::int64_t value) {
  write_attr_native(obj, name, H5T_NATIVE_INT64, H5T_STD_I64LE, value);
}

void write_attr(hid_t obj, const std::string& name, std::uint64_t value) {
  write_attr_native(obj, name, H5T_NATIVE_UINT64, H5T_STD_U64LE, value);
}

void write_attr(hid_t obj, const std::string& name, double value) {
  write_attr_native(obj, name, H5T_NATIVE_DOUBLE, H5T_IEEE_F64LE, value);
}

void write_attr(hid_t obj, const std::string& name, const std::vector<std::uint64_t>& values) {
  if (has_attr(obj, name)) H5Adelete(obj, name.c_str());
  const hsize_t dims[1] = {static_cast<hsize_t>(values.size())};
  H5Handle space(values.empty() ? H5Screate(H5S_NULL) : H5Screate_simple(1, dims, nullptr), H5Sclose);
  H5Handle attr(H5Acreate2(obj, name.c_str(), H5T_STD_U64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  KVCAL_CHECK(attr.valid(), "cannot write attribute '{}'", name);
  if (!values.empty()) {
    KVCAL_CHECK(H5Awrite(attr.get(), H5T_NATIVE_UINT64, values.data()) >= 0, "cannot write attribute '{}'", name);
  }
}

std::vector<std::uint64_t> read_attr_uint_array(hid_t obj, const std::string& name, const std::string& context,
                                                std::size_t max_elements) {
  H5Handle attr = attr_handle(obj, name, context);
  H5Handle type(H5Aget_type(attr.get()), H5Tclose);
  KVCAL_CHECK(H5Tget_class(type.get()) == H5T_INTEGER && H5Tget_sign(type.get()) == H5T_SGN_NONE,
              "{}: attribute '{}' must hold unsigned integers", context, name);
  H5Handle space(H5Aget_space(attr.get()), H5Sclose);
  const hssize_t npoints =
      H5Sget_simple_extent_type(space.get()) == H5S_NULL ? 0 : H5Sget_simple_extent_npoints(space.get());
  KVCAL_CHECK(npoints >= 0 && static_cast<std::size_t>(npoints) <= max_elements,
              "{}: attribute '{}' holds {} values, at most {} expected", context, name, npoints, max_elements);
  std::vector<std::uint64_t> out(static_cast<std::size_t>(npoints));
  if (!out.empty()) {
    KVCAL_CHECK(H5Aread(attr.get(), H5T_NATIVE_UINT64, out.data()) >= 0, "{}: cannot read attribute '{}'", context,
                name);
  }
  return out;
}

bool has_attr(hid_t obj, const std::string& name) { return H5Aexists(obj, name.c_str()) > 0; }

std::string read_attr_string(hid_t obj, const std::string& name, const std::string& context) {
  H5Handle attr = attr_handle(obj, name, context);
  check_scalar(attr.get(), H5T_STRING, false, name, context);
  H5Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tis_variable_str(type.get()) > 0) {
    H5Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.get(), H5T_VARIABLE);
    // HDF5 does not convert between character sets: read in the file's
    // (h5py writes variable-length UTF-8 strings by default).
    H5Tset_cset(mem.get(), H5Tget_cset(type.get()));
    char* value = nullptr;
    KVCAL_CHECK(H5Aread(attr.get(), mem.get(), &value) >= 0 && value, "{}: cannot read attribute '{}'", context, name);
    std::string out(value);
    H5free_memory(value);
    return out;
  }
  const std::size_t size = H5Tget_size(type.get());
  KVCAL_CHECK(size > 0 && size < (1u << 20), "{}: attribute '{}' has an implausible size", context, name);
  std::string out(size, '\0');
  KVCAL_CHECK(H5Aread(attr.get(), type.get(), out.data()) >= 0, "{}: cannot read attribute '{}'", context, name);
  out.resize(out.find('\0') == std::string::npos ? out.size() : out.find('\0'));
  while (!out.empty() && out.back() == ' ') out.pop_back();  // space-padded strings
  return out;
}

std::int64_t read_attr_int(hid_t obj, const std::string& name, const std::string& context) {
  H5Handle attr = attr_handle(obj, name, context);
  check_scalar(attr.get(), H5T_INTEGER, false, name, context);
  std::int64_t v = 0;
  KVCAL_CHECK(H5Aread(attr.get(), H5T_NATIVE_INT64, &v) >= 0, "{}: cannot read attribute '{}'", context, name);
  return v;
}

std::uint64_t read_attr_uint(hid_t obj, const std::string& name, const std::string& context) {
  H5Handle attr = attr_handle(obj, name, context);
  check_scalar(attr.get(), H5T_INTEGER, false, name, context);
  H5Handle type(H5Aget_type(attr.get()), H5Tclose);
  KVCAL_CHECK(H5Tget_sign(type.get()) == H5T_SGN_NONE || read_attr_int(obj, name, context) >= 0,
              "{}: attribute '{}' must not be negative", context, name);
  std::uint64_t v = 0;
  KVCAL_CHECK(H5Aread(attr.get(), H5T_NATIVE_UINT64, &v) >= 0, "{}: cannot read attribute '{}'", context, name);
  return v;
}

double read_attr_double(hid_t obj, const std::string& name, const std::string& context) {
  H5Handle attr = attr_handle(obj, name, context);
  check_scalar(attr.get(), H5T_FLOAT, true, name, context);
  double v = 0;
  KVCAL_CHECK(H5Aread(attr.get(), H5T_NATIVE_DOUBLE, &v) >= 0, "{}: cannot read attribute '{}'", context, name);
  return v;
}

void write_dataset_1d(hid_t loc, const std::string& name, const std::vector<std::int64_t>& data) {
  write_1d(loc, name, H5T_NATIVE_INT64, H5T_STD_I64LE, data);
}

void write_dataset_1d(hid_t loc, const std::string& name, const std::vector<std::int32_t>& data) {
  write_1d(loc, name, H5T_NATIVE_INT32, H5T_STD_I32LE, data);
}

std::vector<std::int64_t> read_int64_1d(hid_t loc, const std::string& name, const std::string& context,
                                        std::int64_t max_elements) {
  return read_1d<std::int64_t>(loc, name, context, max_elements, H5T_NATIVE_INT64);
}

std::vector<std::int32_t> read_int32_1d(hid_t loc, const std::string& name, const std::string& context,
                                        std::int64_t max_elements) {
  return read_1d<std::int32_t>(loc, name, context, max_elements, H5T_NATIVE_INT32);
}

std::int64_t DatasetInfo::elements() const {
  // Dimensions come from untrusted files: saturate instead of overflowing.
  std::int64_t n = 1;
  for (auto d : dims) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::numeric_limits<std::int64_t>::max();
  }
  return n;
}

H5Handle open_dataset(hid_t loc, const std::string& name, const std::string& context) {
  KVCAL_CHECK(has_link(loc, name), "{}: missing dataset '{}'", context, name);
  H5Handle obj(H5Oopen(loc, name.c_str(), H5P_DEFAULT), H5Oclose);
  KVCAL_CHECK(obj.valid() && H5Iget_type(obj.get()) == H5I_DATASET, "{}: '{}' is not a dataset", context, name);
  return obj;
}

DatasetInfo dataset_info(hid_t dataset) {
  DatasetInfo info;
  H5Handle type(H5Dget_type(dataset), H5Tclose);
  info.type_class = H5Tget_class(type.get());
  if (info.type_class == H5T_FLOAT) {
    const std::size_t size = H5Tget_size(type.get());
    std::size_t spos = 0, epos = 0, esize = 0, mpos = 0, msize = 0;
    H5Tget_fields(type.get(), &spos, &epos, &esize, &mpos, &msize);
    const bool little = H5Tget_order(type.get()) == H5T_ORDER_LE;
    if (size == 2 && little && spos == 15 && epos == 10 && esize == 5 && mpos == 0 && msize == 10 &&
        H5Tget_ebias(type.get()) == 15) {
      info.float_kind = FloatKind::f16;
    } else if (H5Tequal(type.get(), H5T_IEEE_F32LE) > 0 || H5Tequal(type.get(), H5T_IEEE_F32BE) > 0) {
      info.float_kind = FloatKind::f32;
    } else if (H5Tequal(type.get(), H5T_IEEE_F64LE) > 0 || H5Tequal(type.get(), H5T_IEEE_F64BE) > 0) {
      info.float_kind = FloatKind::f64;
    }
  }
  H5Handle space(H5Dget_space(dataset), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank > 0 && rank <= 8) {
    hsize_t dims[8];
    H5Sget_simple_extent_dims(space.get(), dims, nullptr);
    for (int i = 0; i < rank; ++i) {
      info.dims.push_back(static_cast<std::int64_t>(
          std::min<hsize_t>(dims[i], static_cast<hsize_t>(std::numeric_limits<std::int64_t>::max()))));
    }
  }
  return info;
}

namespace {

H5Handle select_block(hid_t dataset, const std::vector<std::int64_t>& start, const std::vector<std::int64_t>& count,
                      H5Handle& mem_space, const std::string& context) {
  H5Handle space(H5Dget_space(dataset), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  KVCAL_CHECK(rank == static_cast<int>(start.size()) && start.size() == count.size(), "{}: rank mismatch", context);
  std::vector<hsize_t> st(start.begin(), start.end()), ct(count.begin(), count.end());
  KVCAL_CHECK(H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, st.data(), nullptr, ct.data(), nullptr) >= 0,
              "{}: bad selection", context);
  // A memory space of the selection's own shape: with a 1-D one HDF5 1.10
  // maps element by element, more than ten times slower.
  mem_space = H5Handle(H5Screate_simple(rank, ct.data(), nullptr), H5Sclose);
  return space;
}

}  // namespace

bool read_raw_float_block(hid_t dataset, const std::vector<std::int64_t>& start, const std::vector<std::int64_t>& count,
                          std::vector<std::uint16_t>& half, std::vector<float>& single, const std::string& context) {
  const DatasetInfo info = dataset_info(dataset);
  std::int64_t total = 1;
  for (auto c : count) total *= c;
  H5Handle mem_space;
  H5Handle file_space = select_block(dataset, start, count, mem_space, context);
  herr_t status = 0;
  const bool is_half = info.float_kind == FloatKind::f16;
  if (is_half) {
    half.resize(static_cast<std::size_t>(total));
    H5Handle type(H5Dget_type(dataset), H5Tclose);
    if (total > 0) status = H5Dread(dataset, type.get(), mem_space.get(), file_space.get(), H5P_DEFAULT, half.data());
  } else if (info.float_kind == FloatKind::f32 || info.float_kind == FloatKind::f64) {
    single.resize(static_cast<std::size_t>(total));
    if (total > 0) {
      status = H5Dread(dataset, H5T_NATIVE_FLOAT, mem_space.get(), file_space.get(), H5P_DEFAULT, single.data());
    }
  } else {
    fail("{}: must be float16, float32 or float64", context);
  }
  KVCAL_CHECK(status >= 0, "{}: cannot read (file truncated or corrupted?)", context);
  return is_half;
}

namespace {
template <typename T>
void write_nd(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const T* data, hid_t mem_type,
              hid_t file_type, const std::vector<std::int64_t>& chunk) {
  std::vector<hsize_t> d(dims.begin(), dims.end());
  H5Handle space(H5Screate_simple(static_cast<int>(d.size()), d.data(), nullptr), H5Sclose);
  H5Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (!chunk.empty()) {
    std::vector<hsize_t> c(chunk.begin(), chunk.end());
    H5Pset_chunk(dcpl.get(), static_cast<int>(c.size()), c.data());
    H5Pset_shuffle(dcpl.get());
    H5Pset_deflate(dcpl.get(), 4);
  }
  H5Handle ds(H5Dcreate2(loc, name.c_str(), file_type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT), H5Dclose);
  KVCAL_CHECK(ds.valid(), "cannot create dataset '{}'", name);
  std::int64_t total = 1;
  for (auto x : dims) total *= x;
  if (total > 0) {
    KVCAL_CHECK(H5Dwrite(ds.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0,
                "cannot write dataset '{}' (disk full?)", name);
  }
}
}  // namespace

void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const float* data,
                   const std::vector<std::int64_t>& chunk) {
  write_nd(loc, name, dims, data, H5T_NATIVE_FLOAT, H5T_IEEE_F32LE, chunk);
}
void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const std::int8_t* data) {
  write_nd(loc, name, dims, data, H5T_NATIVE_INT8, H5T_STD_I8LE, {});
}
void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims,
                   const std::int32_t* data) {
  write_nd(loc, name, dims, data, H5T_NATIVE_INT32, H5T_STD_I32LE, {});
}
void write_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims, const double* data) {
  write_nd(loc, name, dims, data, H5T_NATIVE_DOUBLE, H5T_IEEE_F64LE, {});
}

template <typename T>
std::vector<T> read_dataset(hid_t loc, const std::string& name, const std::vector<std::int64_t>& dims,
                            const std::string& context) {
  H5Handle ds = open_dataset(loc, name, context);
  const DatasetInfo info = dataset_info(ds.get());
  KVCAL_CHECK(info.type_class == H5T_INTEGER || info.type_class == H5T_FLOAT, "{}: '{}' must be numeric", context,
              name);
  KVCAL_CHECK(info.dims == dims, "{}: '{}' has shape [{}], expected [{}]", context, name, fmt::join(info.dims, ", "),
              fmt::join(dims, ", "));
  hid_t mem;
  if constexpr (std::is_same_v<T, float>)
    mem = H5T_NATIVE_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    mem = H5T_NATIVE_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int8_t>)
    mem = H5T_NATIVE_INT8;
  else
    mem = H5T_NATIVE_INT32;
  std::vector<T> out(static_cast<std::size_t>(info.elements()));
  if (!out.empty()) {
    KVCAL_CHECK(H5Dread(ds.get(), mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) >= 0,
                "{}: cannot read '{}' (file truncated or corrupted?)", context, name);
  }
  return out;
}
template std::vector<float> read_dataset<float>(hid_t, const std::string&, const std::vector<std::int64_t>&,
                                                const std::string&);
template std::vector<double> read_dataset<double>(hid_t, const std::string&, const std::vector<std::int64_t>&,
                                                  const std::string&);
template std::vector<std::int8_t> read_dataset<std::int8_t>(hid_t, const std::string&, const std::vector<std::int64_t>&,
                                                            const std::string&);
template std::vector<std::int32_t> read_dataset<std::int32_t>(hid_t, const std::string&,
                                                              const std::vector<std::int64_t>&, const std::string&);

void write_provenance(hid_t file, const std::string& format, std::int64_t format_version,
                      const std::string& command_line) {
  write_attr(file, "format", format);
  write_attr(file, "format_version", format_version);
  write_attr(file, "kvcal_version", std::string(kVersion));
  write_attr(file, "command_line", command_line);
  write_attr(file, "created_utc", utc_now());
}

TempFileObserver& temp_observer() {
  static TempFileObserver observer;
  return observer;
}

}  // namespace kvcal::detail

namespace kvcal {
void set_temp_file_observer(TempFileObserver observer) { detail::temp_observer() = std::move(observer); }
}  // namespace kvcal

namespace kvcal::detail {

std::string make_temp_path(const std::string& path) {
  static std::atomic<unsigned> counter{0};
  std::string tmp = fmt::format("{}.tmp.{}.{}", path, static_cast<long>(getpid()), counter++);
  if (temp_observer()) temp_observer()(tmp);
  return tmp;
}

void check_output_path(const std::string& final_path) {
  std::error_code ec;
  const fs::path target(final_path);
  KVCAL_CHECK(!final_path.empty(), "output path is empty");
  KVCAL_CHECK(!fs::is_directory(target, ec), "cannot write {}: it is a directory", final_path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  KVCAL_CHECK(fs::is_directory(dir, ec), "cannot write {}: directory {} does not exist", final_path, dir.string());
  KVCAL_CHECK(access(dir.c_str(), W_OK) == 0, "cannot write {}: directory {} is not writable", final_path,
              dir.string());
}

std::uint64_t seal_user_block() { return kSealSize; }

H5Handle create_file(const std::string& tmp_path, const std::string& final_path, std::uint64_t user_block) {
  h5_init();
  check_output_path(final_path);
  H5Handle fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  KVCAL_CHECK(fcpl.valid() && (user_block == 0 || H5Pset_userblock(fcpl.get(), user_block) >= 0),
              "cannot set up the file creation of {}", final_path);
  H5Handle file(H5Fcreate(tmp_path.c_str(), H5F_ACC_EXCL, fcpl.get(), H5P_DEFAULT), H5Fclose);
  KVCAL_CHECK(file.valid(), "cannot create {} (permission denied, disk full or read-only file system?)", final_path);
  return file;
}

void commit_file(H5Handle& file, const std::string& tmp_path, const std::string& final_path, bool seal) {
  KVCAL_CHECK(H5Fflush(file.get(), H5F_SCOPE_GLOBAL) >= 0, "cannot write {} (disk full?)", final_path);
  const herr_t closed = H5Fclose(file.release());
  KVCAL_CHECK(closed >= 0, "cannot write {} (disk full?)", final_path);
  if (seal) write_seal(tmp_path);
  std::error_code ec;
  fs::rename(tmp_path, final_path, ec);
  KVCAL_CHECK(!ec, "cannot move the finished file into place at {}: {}", final_path, ec.message());
}

void discard_file(const std::string& tmp_path) {
  std::error_code ec;
  fs::remove(tmp_path, ec);
}

}  // namespace kvcal::detail

namespace kvcal {

namespace fs = std::filesystem;

void write_text_file(const std::string& path, const std::string& content) {
  detail::check_output_path(path);
  const std::string tmp = detail::make_temp_path(path);
  std::FILE* f = std::fopen(tmp.c_str(), "wx");
  KVCAL_CHECK(f != nullptr, "cannot create {} (permission denied, disk full or read-only file system?)", path);
  const bool wrote = std::fwrite(content.data(), 1, content.size(), f) == content.size();
  const bool closed = std::fclose(f) == 0;
  std::error_code ec;
  if (!wrote || !closed) {
    fs::remove(tmp, ec);
    fail("cannot write {} (disk full?)", path);
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    fail("cannot move the finished file into place at {}: {}", path, ec.message());
  }
}

}  // namespace kvcal
