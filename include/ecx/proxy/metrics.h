#pragma once
// The proxy's metrics: counters, gauges and histograms named `ecx_proxy_*`, kept in
// and rendered by core's metrics::Registry (one Prometheus renderer for the whole
// project). Thread-safe.

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/core/metrics.h"

namespace ecx::proxy {

class Metrics {
 public:
  // Buckets (seconds) of every histogram: 100 µs .. 120 s.
  static const std::vector<double>& histogram_buckets();

  // Names are full (`ecx_proxy_...`); the registry owns the `ecx_` prefix.
  void add(std::string_view name, const metrics::Labels& labels = {}, double value = 1.0);
  void set(std::string_view name, const metrics::Labels& labels, double value);
  void observe(std::string_view name, const metrics::Labels& labels, double seconds);
  // The HELP line; a metric's type is that of its first update.
  void describe(std::string_view name, std::string_view help);

  double value(std::string_view name, const metrics::Labels& labels) const;  // counters and gauges; 0 when unset
  std::uint64_t observations(std::string_view name, const metrics::Labels& labels) const;

  std::string render() const { return registry_.prometheus_text(); }
  // For components that export their own series (the store's presence index).
  metrics::Registry& registry() { return registry_; }

 private:
  std::string help_of(std::string_view name) const;

  metrics::Registry registry_;
  mutable std::mutex mutex_;  // guards help_
  std::map<std::string, std::string, std::less<>> help_;
};

}  // namespace ecx::proxy
