// ecx._core: the process-wide metrics registry, as a snapshot and as Prometheus text.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/common.h"
#include "ecx/core/metrics.h"

namespace ecx::python {

void register_metrics(py::module_& m) {
  m.def(
      "metrics_snapshot", [] { return metrics::Registry::global().snapshot(); },
      "Every ECX metric of this process: {'ecx_name{label=\"v\"}': value}.");
  m.def(
      "metrics_text", [] { return metrics::Registry::global().prometheus_text(); },
      "Every ECX metric of this process in Prometheus text format.");
}

}  // namespace ecx::python
