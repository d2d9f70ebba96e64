// ecx._core: the native half of the Python package. Thin by design: it translates
// between Python objects and the C++ core, nothing more. Calls that may wait (thread
// joins, socket setup, copies) release the GIL.
#include <pybind11/pybind11.h>

#include "bindings/common.h"
#include "ecx/core/dtype.h"
#include "ecx/core/version.h"

namespace ecx::python {

[[noreturn]] void raise_status(const Status& status) {
  if (status.code() == StatusCode::invalid_argument) throw py::value_error(status.message());
  throw std::runtime_error(status.to_string());
}

TensorSpec make_spec(const std::vector<std::int64_t>& shape, const std::string& dtype, std::uint64_t max_nbytes) {
  auto parsed = parse_dtype(dtype);
  if (!parsed) raise_status(parsed.status());
  return value_or_raise(TensorSpec::make(shape, *parsed, max_nbytes));
}

std::vector<std::int64_t> shape_of(const TensorSpec& spec) { return spec.shape_vector(); }
std::string dtype_of(const TensorSpec& spec) { return std::string(dtype_name(spec.dtype())); }

}  // namespace ecx::python

PYBIND11_MODULE(_core, m) {
  namespace py = pybind11;
  m.doc() = "ECX native core";
  m.attr("__version__") = ecx::library_version();
  m.def(
      "dtype_item_size",
      [](const std::string& name) { return ecx::dtype_item_size(ecx::python::value_or_raise(ecx::parse_dtype(name))); },
      py::arg("name"), "Bytes per element of a torch dtype name; ValueError for unknown names.");
  m.def(
      "dtype_name",
      [](const std::string& name) {
        return std::string(ecx::dtype_name(ecx::python::value_or_raise(ecx::parse_dtype(name))));
      },
      py::arg("name"), "Canonical name (without 'torch.') of a torch dtype name; ValueError for unknown names.");
  ecx::python::register_config(m);
  ecx::python::register_logging(m);
  ecx::python::register_metrics(m);
  ecx::python::register_scheduler(m);
  ecx::python::register_worker(m);
}
