#include "ecx/core/metrics.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace ecx::metrics {
namespace {

constexpr std::string_view kPrefix = "ecx_";

std::string escape_label_value(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\' || c == '"') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string label_text(const Labels& labels, std::string_view extra_key = {}, std::string_view extra_value = {}) {
  if (labels.empty() && extra_key.empty()) return {};
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ',';
    first = false;
    out += fmt::format("{}=\"{}\"", k, escape_label_value(v));
  }
  if (!extra_key.empty()) {
    if (!first) out += ',';
    out += fmt::format("{}=\"{}\"", extra_key, extra_value);
  }
  out += '}';
  return out;
}

std::string format_value(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return fmt::format("{}", static_cast<long long>(v));
  return fmt::format("{}", v);
}

void atomic_add(std::atomic<double>& target, double by) noexcept {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + by, std::memory_order_relaxed)) {
  }
}

// Groups collector samples by name so HELP/TYPE are written once per family.
class GroupingSink final : public SampleSink {
 public:
  struct Family {
    std::string help;
    SampleType type = SampleType::gauge;
    std::vector<std::pair<Labels, double>> samples;
  };
  void sample(std::string_view name, std::string_view help, SampleType type, const Labels& labels,
              double value) override {
    auto& family = families[std::string(name)];
    if (family.help.empty()) family.help = std::string(help);
    family.type = type;
    family.samples.emplace_back(labels, value);
  }
  std::map<std::string, Family> families;
};

}  // namespace

void Gauge::add(double by) noexcept { atomic_add(value_, by); }

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  bounds_.erase(std::unique(bounds_.begin(), bounds_.end()), bounds_.end());
  counts_ = std::make_unique<std::atomic<std::uint64_t>[]>(bounds_.size() + 1);
}

void Histogram::observe(double value) noexcept {
  const auto it = std::lower_bound(bounds_.begin(), bounds_.end(), value);
  counts_[static_cast<std::size_t>(it - bounds_.begin())].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  atomic_add(sum_, value);
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.upper_bounds = bounds_;
  std::uint64_t running = 0;
  for (std::size_t i = 0; i <= bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative_counts.push_back(running);
  }
  s.count = running;
  s.sum = sum_.load(std::memory_order_relaxed);
  return s;
}

Histogram::Snapshot Histogram::Snapshot::since(const Snapshot& earlier) const {
  Snapshot out = *this;
  if (earlier.cumulative_counts.size() != cumulative_counts.size()) return out;
  for (std::size_t i = 0; i < out.cumulative_counts.size(); ++i) {
    out.cumulative_counts[i] -= std::min(out.cumulative_counts[i], earlier.cumulative_counts[i]);
  }
  out.count -= std::min(out.count, earlier.count);
  out.sum -= earlier.sum;
  return out;
}

double Histogram::Snapshot::quantile(double q) const {
  if (count == 0) return 0.0;
  const double rank = std::clamp(q, 0.0, 1.0) * static_cast<double>(count);
  for (std::size_t i = 0; i < cumulative_counts.size(); ++i) {
    if (static_cast<double>(cumulative_counts[i]) >= rank) {
      if (i == upper_bounds.size()) return upper_bounds.empty() ? 0.0 : upper_bounds.back();
      const double lower_bound = i == 0 ? 0.0 : upper_bounds[i - 1];
      const double below = i == 0 ? 0.0 : static_cast<double>(cumulative_counts[i - 1]);
      const double in_bucket = static_cast<double>(cumulative_counts[i]) - below;
      const double fraction = in_bucket > 0 ? (rank - below) / in_bucket : 1.0;
      return lower_bound + (upper_bounds[i] - lower_bound) * fraction;
    }
  }
  return upper_bounds.empty() ? 0.0 : upper_bounds.back();
}

std::vector<double> latency_buckets_seconds() {
  return {1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
          5e-2, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0,   30.0, 60.0};
}

std::string series_name(std::string_view name, const Labels& labels) {
  return std::string(kPrefix) + std::string(name) + label_text(labels);
}

Counter& Registry::counter(std::string_view name, std::string_view help, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& family = counters_[std::string(name)];
  if (family.help.empty()) family.help = std::string(help);
  auto& slot = family.series[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& Registry::gauge(std::string_view name, std::string_view help, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& family = gauges_[std::string(name)];
  if (family.help.empty()) family.help = std::string(help);
  auto& slot = family.series[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& Registry::histogram(std::string_view name, std::string_view help, const Labels& labels,
                               std::vector<double> upper_bounds) {
  std::lock_guard lock(mutex_);
  auto& family = histograms_[std::string(name)];
  if (family.help.empty()) family.help = std::string(help);
  auto& slot = family.series[labels];
  if (!slot) slot = std::make_unique<Histogram>(std::move(upper_bounds));
  return *slot;
}

std::uint64_t Registry::add_collector(Collector collector) {
  std::lock_guard lock(mutex_);
  const auto id = next_collector_id_++;
  collectors_.emplace(id, std::move(collector));
  return id;
}

void Registry::remove_collector(std::uint64_t id) {
  std::lock_guard lock(mutex_);
  collectors_.erase(id);
}

std::string Registry::prometheus_text() const {
  std::lock_guard lock(mutex_);
  std::string out;
  auto header = [&out](std::string_view name, std::string_view help, std::string_view type) {
    out += fmt::format("# HELP {}{} {}\n# TYPE {}{} {}\n", kPrefix, name, help, kPrefix, name, type);
  };
  for (const auto& [name, family] : counters_) {
    header(name, family.help, "counter");
    for (const auto& [labels, c] : family.series) out += fmt::format("{} {}\n", series_name(name, labels), c->value());
  }
  for (const auto& [name, family] : gauges_) {
    header(name, family.help, "gauge");
    for (const auto& [labels, g] : family.series) {
      out += fmt::format("{} {}\n", series_name(name, labels), format_value(g->value()));
    }
  }
  for (const auto& [name, family] : histograms_) {
    header(name, family.help, "histogram");
    for (const auto& [labels, h] : family.series) {
      const auto s = h->snapshot();
      for (std::size_t i = 0; i < s.cumulative_counts.size(); ++i) {
        const std::string le = i < s.upper_bounds.size() ? format_value(s.upper_bounds[i]) : "+Inf";
        out += fmt::format("{}{}_bucket{} {}\n", kPrefix, name, label_text(labels, "le", le), s.cumulative_counts[i]);
      }
      out += fmt::format("{}{}_sum{} {}\n", kPrefix, name, label_text(labels), format_value(s.sum));
      out += fmt::format("{}{}_count{} {}\n", kPrefix, name, label_text(labels), s.count);
    }
  }
  GroupingSink sink;
  for (const auto& [id, collector] : collectors_) collector(sink);
  for (const auto& [name, family] : sink.families) {
    header(name, family.help, family.type == SampleType::counter ? "counter" : "gauge");
    for (const auto& [labels, value] : family.samples) {
      out += fmt::format("{} {}\n", series_name(name, labels), format_value(value));
    }
  }
  return out;
}

std::map<std::string, double> Registry::snapshot() const {
  std::lock_guard lock(mutex_);
  std::map<std::string, double> out;
  for (const auto& [name, family] : counters_) {
    for (const auto& [labels, c] : family.series) out[series_name(name, labels)] = static_cast<double>(c->value());
  }
  for (const auto& [name, family] : gauges_) {
    for (const auto& [labels, g] : family.series) out[series_name(name, labels)] = g->value();
  }
  for (const auto& [name, family] : histograms_) {
    for (const auto& [labels, h] : family.series) {
      const auto s = h->snapshot();
      out[series_name(std::string(name) + "_count", labels)] = static_cast<double>(s.count);
      out[series_name(std::string(name) + "_sum", labels)] = s.sum;
    }
  }
  GroupingSink sink;
  for (const auto& [id, collector] : collectors_) collector(sink);
  for (const auto& [name, family] : sink.families) {
    for (const auto& [labels, value] : family.samples) out[series_name(name, labels)] = value;
  }
  return out;
}

Registry& Registry::global() {
  static Registry instance;
  return instance;
}

}  // namespace ecx::metrics
