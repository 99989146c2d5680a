// Helpers shared by the kvcal._core binding files: array checks at the
// boundary (dtype, shape, strides, device) with one clear message, arrays
// handed to NumPy without copies, and the Python exception types.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace kvcal::py {

namespace nb = nanobind;

// Raised as TypeError / ValueError / OSError by the translators in module.cpp.
struct TypeErr {
  std::string what;
};
struct ValueErr {
  std::string what;
};
struct OsErr {
  std::string what;
};

template <typename... Args>
[[noreturn]] void type_error(fmt::format_string<Args...> f, Args&&... args) {
  throw TypeErr{fmt::format(f, std::forward<Args>(args)...)};
}
template <typename... Args>
[[noreturn]] void value_error(fmt::format_string<Args...> f, Args&&... args) {
  throw ValueErr{fmt::format(f, std::forward<Args>(args)...)};
}

// Any array coming in: NumPy, or a torch tensor / other producer through DLPack.
using AnyArray = nb::ndarray<nb::ro>;
using AnyArrayRw = nb::ndarray<>;

inline nb::dlpack::dtype dt_f16() { return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1}; }
template <typename T>
nb::dlpack::dtype dt() {
  return nb::dtype<T>();
}

inline const char* dtype_name(nb::dlpack::dtype d) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(d.code);
  if (code == C::Float)
    return d.bits == 16 ? "float16" : d.bits == 32 ? "float32" : d.bits == 64 ? "float64" : "float?";
  if (code == C::Int) return d.bits == 8 ? "int8" : d.bits == 16 ? "int16" : d.bits == 32 ? "int32" : "int64";
  if (code == C::UInt) return d.bits == 8 ? "uint8" : d.bits == 16 ? "uint16" : d.bits == 32 ? "uint32" : "uint64";
  if (code == C::Bool) return "bool";
  if (code == C::Bfloat) return "bfloat16";
  return "complex or other";
}

// Checks an array: dtype, number of dimensions, sizes (-1: any), the last
// dimension contiguous (or every dimension, `contiguous`), and a CPU device.
// `name` appears in the message.
template <typename A>
void check_array(const A& a, const char* name, nb::dlpack::dtype want, std::initializer_list<std::int64_t> shape,
                 bool contiguous = false) {
  if (a.device_type() != nb::device::cpu::value) {
    value_error("{}: a CPU array is needed (device arrays wait for the CUDA kernels); move it with .cpu()", name);
  }
  if (a.dtype() != want) {
    type_error("{}: dtype {} where {} is needed (convert with .astype / .to)", name, dtype_name(a.dtype()),
               dtype_name(want));
  }
  if (a.ndim() != shape.size()) {
    value_error("{}: {} dimension(s) where {} are needed", name, a.ndim(), shape.size());
  }
  std::size_t i = 0;
  for (std::int64_t s : shape) {
    if (s >= 0 && static_cast<std::int64_t>(a.shape(i)) != s) {
      value_error("{}: dimension {} has size {} where {} is needed", name, i, a.shape(i), s);
    }
    ++i;
  }
  const std::size_t nd = a.ndim();
  if (nd > 0 && a.shape(nd - 1) > 1 && a.stride(nd - 1) != 1) {
    value_error("{}: the last dimension must be contiguous (stride {} elements); pass np.ascontiguousarray(...)", name,
                a.stride(nd - 1));
  }
  for (std::size_t d = 0; d < nd; ++d) {
    if (a.stride(d) < 0) value_error("{}: negative strides are not supported; pass a copy", name);
  }
  if (contiguous) {
    std::int64_t expect = 1;
    for (std::size_t d = nd; d-- > 0;) {
      if (a.shape(d) > 1 && a.stride(d) != expect) {
        value_error("{}: a C-contiguous array is needed; pass np.ascontiguousarray(...)", name);
      }
      expect *= static_cast<std::int64_t>(a.shape(d));
    }
  }
}

template <typename T>
using NpArray = nb::ndarray<nb::numpy, T>;

// Moves a vector into a NumPy array without copying (the array owns it).
template <typename T>
NpArray<T> to_numpy(std::vector<T>&& v, std::initializer_list<std::size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule del(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return NpArray<T>(owned->data(), shape.size(), shape.begin(), del);
}
template <typename T>
NpArray<T> to_numpy(std::vector<T>&& v) {
  const std::size_t n = v.size();
  return to_numpy(std::move(v), {n});
}
// A read-only view of memory owned by the Python object `owner`.
template <typename T>
nb::ndarray<nb::numpy, const T> view(const T* data, std::initializer_list<std::size_t> shape, nb::handle owner) {
  return nb::ndarray<nb::numpy, const T>(data, shape.size(), shape.begin(), owner);
}

// Module parts, defined in masks.cpp, profile.cpp and runtime.cpp.
void bind_masks(nb::module_& m);
void bind_profile(nb::module_& m);
void bind_runtime(nb::module_& m);

}  // namespace kvcal::py
