// kvcal._core: the nanobind extension behind the kvcal package. Bindings
// convert and call; every algorithm is the C++ library's.
#include <nanobind/nanobind.h>

#include "common.h"
#include "kvcal/core/error.h"
#include "kvcal/core/version.h"
#include "kvcal/runtime/common.h"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  m.doc() = "kvcal's C++ library and runtime (see the kvcal package for the documented API)";
  m.attr("__version__") = KVCAL_VERSION_STRING;

  // kvcal::Error and kvcal::runtime::Error: bad arguments, bad files. Both
  // become kvcal.Error, a ValueError, with the library's message.
  static nb::exception<kvcal::Error> error(m, "Error", PyExc_ValueError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvcal::runtime::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    } catch (const kvcal::py::TypeErr& e) {
      PyErr_SetString(PyExc_TypeError, e.what.c_str());
    } catch (const kvcal::py::ValueErr& e) {
      PyErr_SetString(PyExc_ValueError, e.what.c_str());
    } catch (const kvcal::py::OsErr& e) {
      PyErr_SetString(PyExc_OSError, e.what.c_str());
    }
  });

  kvcal::py::bind_masks(m);
  kvcal::py::bind_profile(m);
  kvcal::py::bind_runtime(m);
}
