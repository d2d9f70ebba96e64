#include "ecx/proxy/metrics.h"

namespace ecx::proxy {
namespace {

// "ecx_proxy_x" -> "proxy_x": the registry adds the prefix itself.
std::string_view registry_name(std::string_view name) {
  constexpr std::string_view kPrefix = "ecx_";
  return name.starts_with(kPrefix) ? name.substr(kPrefix.size()) : name;
}

}  // namespace

const std::vector<double>& Metrics::histogram_buckets() {
  static const std::vector<double> buckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                              0.25,   0.5,     1.0,    2.5,   5.0,    10.0,  30.0, 60.0,  120.0};
  return buckets;
}

void Metrics::describe(std::string_view name, std::string_view help) {
  std::lock_guard lock(mutex_);
  help_[std::string(name)] = std::string(help);
}

std::string Metrics::help_of(std::string_view name) const {
  std::lock_guard lock(mutex_);
  auto it = help_.find(name);
  return it == help_.end() ? std::string() : it->second;
}

void Metrics::add(std::string_view name, const metrics::Labels& labels, double value) {
  if (value < 0) return;  // counters only go up (0 still creates the series)
  registry_.counter(registry_name(name), help_of(name), labels).inc(static_cast<std::uint64_t>(value));
}

void Metrics::set(std::string_view name, const metrics::Labels& labels, double value) {
  registry_.gauge(registry_name(name), help_of(name), labels).set(value);
}

void Metrics::observe(std::string_view name, const metrics::Labels& labels, double seconds) {
  registry_.histogram(registry_name(name), help_of(name), labels, histogram_buckets()).observe(seconds);
}

double Metrics::value(std::string_view name, const metrics::Labels& labels) const {
  const auto snapshot = registry_.snapshot();
  const auto it = snapshot.find(metrics::series_name(registry_name(name), labels));
  return it == snapshot.end() ? 0 : it->second;
}

std::uint64_t Metrics::observations(std::string_view name, const metrics::Labels& labels) const {
  const auto snapshot = registry_.snapshot();
  const auto it = snapshot.find(metrics::series_name(std::string(registry_name(name)) + "_count", labels));
  return it == snapshot.end() ? 0 : static_cast<std::uint64_t>(it->second);
}

}  // namespace ecx::proxy
