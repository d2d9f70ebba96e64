// ecx._core: the native half of the Python package. Thin by design: it translates
// between Python objects and the C++ core, nothing more.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ecx/core/config.h"
#include "ecx/core/dtype.h"
#include "ecx/core/version.h"

namespace py = pybind11;

namespace {

// Boundary: a bad Status becomes a ValueError carrying the message.
template <typename T>
T value_or_raise(ecx::Result<T> result) {
  if (!result) throw py::value_error(result.status().message());
  return std::move(result).value();
}

py::dict config_to_dict(const ecx::Config& c) {
  py::dict d;
  d["role"] = std::string(ecx::role_name(c.role));
  d["ec_ip"] = c.ec_ip;
  d["ec_port"] = c.ec_port;
  d["buffer_size"] = c.buffer_size;
  d["buffer_device"] = c.buffer_device;
  d["control_timeout_s"] = c.control_timeout_s;
  d["push_wait_timeout_s"] = c.push_wait_timeout_s;
  d["transport"] = c.transport;
  d["checksum"] = c.checksum;
  py::list addresses;
  for (int r = 0; r < c.layout.tp_size; ++r) addresses.append(c.control_address(r));
  d["control_addresses"] = addresses;
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "ECX native core";
  m.attr("__version__") = ecx::library_version();

  m.def(
      "parse_config",
      [](const std::string& json_text, int tp_size, int tp_rank, int pp_size, int pp_rank, int dp_size, int dp_index) {
        ecx::ParallelLayout layout{tp_size, tp_rank, pp_size, pp_rank, dp_size, dp_index};
        return config_to_dict(value_or_raise(ecx::parse_config(json_text, layout)));
      },
      py::arg("json_text"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0, py::arg("pp_size") = 1,
      py::arg("pp_rank") = 0, py::arg("dp_size") = 1, py::arg("dp_index") = 0,
      "Validate an --ec-transfer-config JSON string; returns the resolved settings or raises ValueError.");

  m.def(
      "dtype_item_size",
      [](const std::string& name) { return ecx::dtype_item_size(value_or_raise(ecx::parse_dtype(name))); },
      py::arg("name"), "Bytes per element of a torch dtype name; ValueError for unknown names.");
}
