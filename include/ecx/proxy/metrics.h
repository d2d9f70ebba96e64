#pragma once
// Prometheus text exposition for the proxy: counters, gauges and histograms, every
// name prefixed `ecx_proxy_`. Thread-safe; rendering takes a consistent snapshot.

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace ecx::proxy {

class Metrics {
 public:
  // Buckets (seconds) of every histogram: 100 µs .. 120 s.
  static const std::vector<double>& histogram_buckets();

  // `labels` is a rendered label set such as R"(stage="encode")" (see label()).
  void add(std::string_view name, std::string_view labels, double value = 1.0);
  void set(std::string_view name, std::string_view labels, double value);
  void observe(std::string_view name, std::string_view labels, double seconds);
  // HELP and TYPE lines; a metric must be described before it is rendered.
  void describe(std::string_view name, std::string_view type, std::string_view help);

  double value(std::string_view name, std::string_view labels) const;  // counters and gauges; 0 when unset
  std::uint64_t observations(std::string_view name, std::string_view labels) const;

  std::string render() const;

  // key="escaped value"
  static std::string label(std::string_view key, std::string_view value);

 private:
  struct Histogram {
    std::vector<std::uint64_t> buckets;  // cumulative counts are computed on render
    std::uint64_t count = 0;
    double sum = 0;
  };
  struct Family {
    std::string type;
    std::string help;
    std::map<std::string, double, std::less<>> values;
    std::map<std::string, Histogram, std::less<>> histograms;
  };
  Family& family(std::string_view name);

  mutable std::mutex mutex_;
  std::map<std::string, Family, std::less<>> families_;
};

}  // namespace ecx::proxy
