// ecx._core: the process-wide metrics registry, as a snapshot and as Prometheus text.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/common.h"
#include "ecx/core/metrics.h"
#include "ecx/core/metrics_server.h"

namespace ecx::python {

void register_metrics(py::module_& m) {
  m.def(
      "metrics_snapshot", [] { return metrics::Registry::global().snapshot(); },
      "Every ECX metric of this process: {'ecx_name{label=\"v\"}': value}.");
  m.def(
      "metrics_text", [] { return metrics::Registry::global().prometheus_text(); },
      "Every ECX metric of this process in Prometheus text format.");

  py::class_<metrics::MetricsServer>(m, "MetricsServer", "GET /metrics over HTTP for this process's registry.")
      .def(py::init([](const std::string& host, int port) {
             py::gil_scoped_release release;
             return value_or_raise(metrics::MetricsServer::start(metrics::Registry::global(), host, port));
           }),
           py::arg("host"), py::arg("port"), "Binds host:port (0 picks a free port).")
      .def_property_readonly("port", &metrics::MetricsServer::port)
      .def(
          "stop",
          [](metrics::MetricsServer& s) {
            py::gil_scoped_release release;
            s.stop();
          },
          "Stops serving and joins the thread. Idempotent.");
}

}  // namespace ecx::python
