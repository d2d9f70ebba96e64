// ecx._core: configuration (vLLM's --ec-transfer-config JSON plus the parallel layout).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/common.h"
#include "ecx/core/config.h"

namespace ecx::python {
namespace {

ParallelLayout make_layout(int tp_size, int tp_rank, int pp_size, int pp_rank, int dp_size, int dp_index) {
  return ParallelLayout{tp_size, tp_rank, pp_size, pp_rank, dp_size, dp_index};
}

py::dict config_to_dict(const Config& c) {
  py::dict d;
  d["role"] = std::string(role_name(c.role));
  d["ec_ip"] = c.ec_ip;
  d["ec_port"] = c.ec_port;
  d["buffer_size"] = c.buffer_size;
  d["buffer_device"] = c.buffer_device;
  d["control_timeout_s"] = c.control_timeout_s;
  d["push_wait_timeout_s"] = c.push_wait_timeout_s;
  d["transport"] = c.transport;
  d["checksum"] = c.checksum;
  d["encoder_output_width"] = c.encoder_output_width;
  d["log_level"] = c.log_level;
  py::list addresses;
  for (int r = 0; r < c.layout.tp_size; ++r) addresses.append(c.control_address(r));
  d["control_addresses"] = addresses;
  return d;
}

}  // namespace

void register_config(py::module_& m) {
  py::class_<Config>(m, "Config", "A validated ECX configuration for one process of the engine.")
      .def_property_readonly("role", [](const Config& c) { return std::string(role_name(c.role)); })
      .def_property_readonly("is_producer", &Config::is_producer)
      .def_property_readonly("is_consumer", &Config::is_consumer)
      .def_readonly("ec_ip", &Config::ec_ip)
      .def_readonly("ec_port", &Config::ec_port)
      .def_readonly("buffer_size", &Config::buffer_size)
      .def_readonly("buffer_device", &Config::buffer_device)
      .def_readonly("engine_id", &Config::engine_id)
      .def_readonly("encoder_output_width", &Config::encoder_output_width)
      .def_readonly("push_wait_timeout_s", &Config::push_wait_timeout_s)
      .def_readonly("log_level", &Config::log_level)
      .def_readonly("metrics_port", &Config::metrics_port)
      .def_readonly("cross_encoder_cache", &Config::cross_encoder_cache)
      .def_readonly("zero_copy_loads", &Config::zero_copy_loads)
      .def_readonly("zero_copy_saves", &Config::zero_copy_saves)
      .def_readonly("store_url", &Config::store_url)
      .def_readonly("store_prefix", &Config::store_prefix)
      .def_readonly("store_model", &Config::store_model)
      .def_property_readonly("tp_size", [](const Config& c) { return c.layout.tp_size; })
      .def_property_readonly("tp_rank", [](const Config& c) { return c.layout.tp_rank; })
      .def_property_readonly("pp_size", [](const Config& c) { return c.layout.pp_size; })
      .def_property_readonly("pp_rank", [](const Config& c) { return c.layout.pp_rank; })
      .def_property_readonly("dp_size", [](const Config& c) { return c.layout.dp_size; })
      .def_property_readonly("dp_index", [](const Config& c) { return c.layout.dp_index; })
      .def("control_address", &Config::control_address, py::arg("tp_rank"),
           "tcp://<ec_ip>:<port> of a TP shard of this replica.")
      .def("describe", [](const Config& c) { return describe_config(c); })
      .def("to_dict", &config_to_dict)
      .def("__repr__", [](const Config& c) {
        return "<ecx.Config role=" + std::string(role_name(c.role)) +
               " control=" + c.control_address(c.layout.tp_rank) + ">";
      });

  m.def(
      "load_config",
      [](const std::string& json_text, int tp_size, int tp_rank, int pp_size, int pp_rank, int dp_size, int dp_index) {
        return value_or_raise(
            parse_config(json_text, make_layout(tp_size, tp_rank, pp_size, pp_rank, dp_size, dp_index)));
      },
      py::arg("json_text"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0, py::arg("pp_size") = 1,
      py::arg("pp_rank") = 0, py::arg("dp_size") = 1, py::arg("dp_index") = 0,
      "Parse and validate an --ec-transfer-config JSON string; ValueError names the offending key.");

  m.def(
      "parse_config",
      [](const std::string& json_text, int tp_size, int tp_rank, int pp_size, int pp_rank, int dp_size, int dp_index) {
        return config_to_dict(value_or_raise(
            parse_config(json_text, make_layout(tp_size, tp_rank, pp_size, pp_rank, dp_size, dp_index))));
      },
      py::arg("json_text"), py::arg("tp_size") = 1, py::arg("tp_rank") = 0, py::arg("pp_size") = 1,
      py::arg("pp_rank") = 0, py::arg("dp_size") = 1, py::arg("dp_index") = 0,
      "Validate an --ec-transfer-config JSON string; returns the resolved settings or raises ValueError.");

  m.def(
      "config_keys",
      [] {
        py::list out;
        for (const auto& k : ecx::config_keys()) {
          py::dict d;
          d["section"] = std::string(k.section);
          d["name"] = std::string(k.name);
          d["type"] = std::string(k.type);
          d["default"] = std::string(k.default_text);
          d["meaning"] = std::string(k.meaning);
          out.append(d);
        }
        return out;
      },
      "Every configuration key: section ('' or 'ec_connector_extra_config'), name, type, default, meaning.");
}

}  // namespace ecx::python
