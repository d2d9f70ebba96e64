#pragma once
// Shared helpers of the ecx._core bindings: Status/Result at the Python boundary,
// and conversions between Python's plain values and the core's value types.

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <pybind11/pybind11.h>

#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::python {

namespace py = pybind11;

// Boundary: a bad Status becomes a ValueError (bad input) or a RuntimeError
// (anything else), carrying the message.
[[noreturn]] void raise_status(const Status& status);

template <typename T>
T value_or_raise(Result<T> result) {
  if (!result) raise_status(result.status());
  return std::move(result).value();
}

inline void ok_or_raise(const Status& status) {
  if (!status) raise_status(status);
}

// Shape and dtype name as they cross the boundary; any dtype spelling torch uses
// ("torch.bfloat16", "bfloat16", "half") is accepted.
TensorSpec make_spec(const std::vector<std::int64_t>& shape, const std::string& dtype, std::uint64_t max_nbytes);
std::vector<std::int64_t> shape_of(const TensorSpec& spec);
std::string dtype_of(const TensorSpec& spec);

void register_config(py::module_& m);
void register_logging(py::module_& m);
void register_metrics(py::module_& m);
void register_scheduler(py::module_& m);
void register_worker(py::module_& m);

}  // namespace ecx::python
