#include "ecx/proxy/metrics.h"

#include <algorithm>

#include <fmt/format.h>

namespace ecx::proxy {

const std::vector<double>& Metrics::histogram_buckets() {
  static const std::vector<double> buckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                              0.25,   0.5,     1.0,    2.5,   5.0,    10.0,  30.0, 60.0,  120.0};
  return buckets;
}

Metrics::Family& Metrics::family(std::string_view name) {
  auto it = families_.find(name);
  if (it == families_.end()) it = families_.emplace(std::string(name), Family{"untyped", "", {}, {}}).first;
  return it->second;
}

void Metrics::describe(std::string_view name, std::string_view type, std::string_view help) {
  std::lock_guard lock(mutex_);
  auto& f = family(name);
  f.type = std::string(type);
  f.help = std::string(help);
}

void Metrics::add(std::string_view name, std::string_view labels, double value) {
  std::lock_guard lock(mutex_);
  auto& values = family(name).values;
  auto it = values.find(labels);
  if (it == values.end()) it = values.emplace(std::string(labels), 0.0).first;
  it->second += value;
}

void Metrics::set(std::string_view name, std::string_view labels, double value) {
  std::lock_guard lock(mutex_);
  auto& values = family(name).values;
  auto it = values.find(labels);
  if (it == values.end()) it = values.emplace(std::string(labels), 0.0).first;
  it->second = value;
}

void Metrics::observe(std::string_view name, std::string_view labels, double seconds) {
  std::lock_guard lock(mutex_);
  auto& histograms = family(name).histograms;
  auto it = histograms.find(labels);
  if (it == histograms.end()) {
    it =
        histograms.emplace(std::string(labels), Histogram{std::vector<std::uint64_t>(histogram_buckets().size()), 0, 0})
            .first;
  }
  const auto& bounds = histogram_buckets();
  const auto bucket = std::lower_bound(bounds.begin(), bounds.end(), seconds) - bounds.begin();
  if (static_cast<std::size_t>(bucket) < bounds.size()) ++it->second.buckets[static_cast<std::size_t>(bucket)];
  ++it->second.count;
  it->second.sum += seconds;
}

double Metrics::value(std::string_view name, std::string_view labels) const {
  std::lock_guard lock(mutex_);
  const auto f = families_.find(name);
  if (f == families_.end()) return 0;
  const auto v = f->second.values.find(labels);
  return v == f->second.values.end() ? 0 : v->second;
}

std::uint64_t Metrics::observations(std::string_view name, std::string_view labels) const {
  std::lock_guard lock(mutex_);
  const auto f = families_.find(name);
  if (f == families_.end()) return 0;
  const auto h = f->second.histograms.find(labels);
  return h == f->second.histograms.end() ? 0 : h->second.count;
}

std::string Metrics::label(std::string_view key, std::string_view value) {
  std::string out = fmt::format("{}=\"", key);
  for (const char c : value) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  out += '"';
  return out;
}

namespace {
std::string with_labels(std::string_view name, std::string_view labels, std::string_view extra = {}) {
  if (labels.empty() && extra.empty()) return std::string(name);
  if (labels.empty()) return fmt::format("{}{{{}}}", name, extra);
  if (extra.empty()) return fmt::format("{}{{{}}}", name, labels);
  return fmt::format("{}{{{},{}}}", name, labels, extra);
}
}  // namespace

std::string Metrics::render() const {
  std::lock_guard lock(mutex_);
  std::string out;
  auto sink = std::back_inserter(out);
  for (const auto& [name, f] : families_) {
    if (f.values.empty() && f.histograms.empty()) continue;
    if (!f.help.empty()) fmt::format_to(sink, "# HELP {} {}\n", name, f.help);
    fmt::format_to(sink, "# TYPE {} {}\n", name, f.type);
    for (const auto& [labels, v] : f.values) fmt::format_to(sink, "{} {}\n", with_labels(name, labels), v);
    const auto& bounds = histogram_buckets();
    for (const auto& [labels, h] : f.histograms) {
      std::uint64_t cumulative = 0;
      for (std::size_t i = 0; i < bounds.size(); ++i) {
        cumulative += h.buckets[i];
        fmt::format_to(sink, "{} {}\n", with_labels(name + "_bucket", labels, fmt::format("le=\"{}\"", bounds[i])),
                       cumulative);
      }
      fmt::format_to(sink, "{} {}\n", with_labels(name + "_bucket", labels, "le=\"+Inf\""), h.count);
      fmt::format_to(sink, "{} {}\n", with_labels(name + "_sum", labels), h.sum);
      fmt::format_to(sink, "{} {}\n", with_labels(name + "_count", labels), h.count);
    }
  }
  return out;
}

}  // namespace ecx::proxy
