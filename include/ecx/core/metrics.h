#pragma once
// Counters, gauges and latency histograms, readable as a snapshot and as Prometheus
// text (every name gets the `ecx_` prefix). Updates are lock-free atomics so they can
// sit on hot paths; registration and rendering take a mutex.
//
// Components that keep their own counter structs export them through a collector:
// a callback run at scrape time that emits samples, so no state is duplicated.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace ecx::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void inc(std::uint64_t by = 1) noexcept { value_.fetch_add(by, std::memory_order_relaxed); }
  std::uint64_t value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> value_{0};
};

class Gauge {
 public:
  void set(double v) noexcept { value_.store(v, std::memory_order_relaxed); }
  void add(double by) noexcept;
  double value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Cumulative buckets with fixed upper bounds (an implicit +Inf bucket at the end).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value) noexcept;

  struct Snapshot {
    std::vector<double> upper_bounds;
    std::vector<std::uint64_t> cumulative_counts;  // one per bound, then +Inf
    std::uint64_t count = 0;
    double sum = 0.0;
    // Linear interpolation inside the bucket holding quantile q (0..1).
    double quantile(double q) const;
    // What was observed after `earlier` (a snapshot of the same histogram).
    Snapshot since(const Snapshot& earlier) const;
  };
  Snapshot snapshot() const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> counts_;  // bounds_.size() + 1
  std::atomic<std::uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

// Default latency buckets in seconds: 10 us .. 60 s.
std::vector<double> latency_buckets_seconds();

enum class SampleType : unsigned char { counter, gauge };

// Receives samples from collectors at scrape time.
class SampleSink {
 public:
  virtual ~SampleSink() = default;
  virtual void sample(std::string_view name, std::string_view help, SampleType type, const Labels& labels,
                      double value) = 0;
  // A component's own integer counts, sampled as they are.
  void counter(std::string_view name, std::string_view help, std::uint64_t value, const Labels& labels = {}) {
    sample(name, help, SampleType::counter, labels, static_cast<double>(value));
  }
  void gauge(std::string_view name, std::string_view help, std::uint64_t value, const Labels& labels = {}) {
    sample(name, help, SampleType::gauge, labels, static_cast<double>(value));
  }
};

using Collector = std::function<void(SampleSink&)>;

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // Returns the metric for (name, labels), creating it on first use. References stay
  // valid for the registry's lifetime. Names are given without the `ecx_` prefix.
  Counter& counter(std::string_view name, std::string_view help, const Labels& labels = {});
  Gauge& gauge(std::string_view name, std::string_view help, const Labels& labels = {});
  Histogram& histogram(std::string_view name, std::string_view help, const Labels& labels = {},
                       std::vector<double> upper_bounds = latency_buckets_seconds());

  // Returns an id for remove_collector(). A collector must not call back into the registry.
  std::uint64_t add_collector(Collector collector);
  void remove_collector(std::uint64_t id);

  // Prometheus text exposition format 0.0.4.
  std::string prometheus_text() const;
  // "name{label=\"v\"}" -> value for every counter, gauge and collector sample, and
  // name_count / name_sum for histograms.
  std::map<std::string, double> snapshot() const;

  // A process-wide registry for components that are not handed one.
  static Registry& global();

 private:
  template <typename T>
  struct Family {
    std::string help;
    std::map<Labels, std::unique_ptr<T>> series;
  };
  mutable std::mutex mutex_;
  std::map<std::string, Family<Counter>, std::less<>> counters_;
  std::map<std::string, Family<Gauge>, std::less<>> gauges_;
  std::map<std::string, Family<Histogram>, std::less<>> histograms_;
  std::map<std::uint64_t, Collector> collectors_;
  std::uint64_t next_collector_id_ = 1;
};

// "name{a=\"x\",b=\"y\"}" with Prometheus escaping; the `ecx_` prefix is added.
std::string series_name(std::string_view name, const Labels& labels);

}  // namespace ecx::metrics
