#pragma once
// Workloads shared by bench_scheduler (timings) and scheduler_opcount
// (instruction counts under callgrind), so both measure the same thing.
//
// Realistic keys: transfer ids are 32 hex digits (what the proxy mints), mm_hashes
// 64 (a hex digest, as the engine's item hashes are) — too long for a string's
// inline buffer, as in production. Every workload touches the same number of
// distinct keys at every table size (kWorkingSet), so a larger table costs only
// what the table itself costs: its index spread over more memory.

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "ecx/scheduler/coordinator.h"

namespace ecx::scheduler::bench {

using namespace std::chrono_literals;

// Distinct keys each workload cycles through, at every table size.
inline constexpr std::size_t kWorkingSet = 1024;
// Terminal records kept: small and fixed, so "live records" is the table's size
// and the tombstone list cannot grow with the run.
inline constexpr std::uint64_t kTombstoneBound = 1024;

template <typename T>
inline void keep(T&& value) {
  asm volatile("" : : "g"(&value) : "memory");
}

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline std::string hex_key(std::uint64_t seed, int words) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(static_cast<std::size_t>(words) * 16, '0');
  for (int w = 0; w < words; ++w) {
    std::uint64_t v = mix(seed * 4 + static_cast<std::uint64_t>(w));
    for (int d = 0; d < 16; ++d, v >>= 4) out[static_cast<std::size_t>(w * 16 + d)] = kDigits[v & 15];
  }
  return out;
}

// Key spaces: the table's records, and fresh keys created by a workload.
inline std::string transfer_id(std::uint64_t i) { return hex_key(i, 2); }
inline std::string mm_hash(std::uint64_t i) { return hex_key(i + (1ull << 40), 4); }
inline std::string fresh_transfer_id(std::uint64_t i) { return hex_key(i + (2ull << 40), 2); }
inline std::string fresh_mm_hash(std::uint64_t i) { return hex_key(i + (3ull << 40), 4); }

inline TensorSpec small_spec() { return *TensorSpec::make({4, 16}, DType::bfloat16, 1ull << 40); }

inline TableLimits bench_limits() { return TableLimits{300s, kTombstoneBound, 1ull << 40}; }

// Cycles through a fixed set of values.
template <typename T>
class ProbeRing {
 public:
  explicit ProbeRing(std::vector<T> values) : values_(std::move(values)) {}
  const T& next() {
    const T& value = values_[at_];
    if (++at_ == values_.size()) at_ = 0;
    return value;
  }

 private:
  std::vector<T> values_;
  std::size_t at_ = 0;
};

// Queues readiness events handed out by drain().
class QueueEvents final : public EventSource {
 public:
  std::size_t drain(std::vector<TransferEvent>& out, std::size_t max_events) override {
    std::size_t n = 0;
    while (!queue.empty() && n < max_events) {
      out.push_back(std::move(queue.front()));
      queue.pop_front();
      ++n;
    }
    return n;
  }
  int shard_count() const override { return 1; }
  void close() override {}
  std::deque<TransferEvent> queue;
};

// A consumer coordinator whose table holds `live` available records.
struct CoordinatorFixture {
  explicit CoordinatorFixture(std::int64_t live)
      : clock(std::make_shared<ManualClock>()), events(std::make_shared<QueueEvents>()) {
    CoordinatorOptions o;
    o.is_consumer = true;
    o.table.tombstone_max = kTombstoneBound;
    coordinator = std::make_unique<SchedulerCoordinator>(o, clock, events, nullptr);
    for (std::int64_t i = 0; i < live; ++i) {
      TransferEvent e;
      e.transfer_id = transfer_id(static_cast<std::uint64_t>(i));
      e.mm_hash = mm_hash(static_cast<std::uint64_t>(i));
      e.spec = small_spec();
      events->queue.push_back(std::move(e));
    }
    while (!events->queue.empty()) {
      coordinator->build_connector_meta({});
      coordinator->has_cache_item("warm");
    }
    coordinator->build_connector_meta({});
    coordinator->has_cache_item("warm");  // the step's one drain happens here, not in the loop
  }
  std::shared_ptr<ManualClock> clock;
  std::shared_ptr<QueueEvents> events;
  std::unique_ptr<SchedulerCoordinator> coordinator;
};

// kWorkingSet probes of the table's hashes, spread over the whole table (with
// repeats when it holds fewer records).
inline std::vector<std::string> hash_probes(std::int64_t live) {
  std::vector<std::string> probes;
  for (std::size_t k = 0; k < kWorkingSet; ++k) probes.push_back(mm_hash(mix(k) % static_cast<std::uint64_t>(live)));
  return probes;
}

// Deferred requests re-checked every step, each item waiting for its push:
// kWorkingSet waiting transfers in all, whatever the items per request.
inline std::vector<RequestView> waiting_requests(CoordinatorFixture& f, std::int64_t items) {
  std::vector<RequestView> requests;
  const std::size_t count = kWorkingSet / static_cast<std::size_t>(items);
  for (std::size_t r = 0; r < count; ++r) {
    RequestView view;
    view.request_id = "req-" + hex_key(r + (4ull << 40), 2);
    nlohmann::json ec_items = nlohmann::json::array();
    for (std::int64_t k = 0; k < items; ++k) {
      const std::uint64_t key = r * static_cast<std::uint64_t>(items) + static_cast<std::uint64_t>(k);
      MmFeature feature;
      feature.identifier = fresh_mm_hash(key);
      feature.offset = k * 10;
      feature.length = 10;
      view.mm_features.push_back(feature);
      ec_items.push_back({{"transfer_id", fresh_transfer_id(key)}});
    }
    view.set_ec_transfer_params(nlohmann::json{{"ec_items", ec_items}});
    f.coordinator->ensure_cache_available(view, 0);
    requests.push_back(std::move(view));
  }
  return requests;
}

// A table with `live` available records.
inline std::unique_ptr<TransferTable> make_table(std::int64_t live, TimePoint now) {
  auto table = std::make_unique<TransferTable>(bench_limits());
  for (std::int64_t i = 0; i < live; ++i) {
    const auto n = static_cast<std::uint64_t>(i);
    table->observe_ready(LoadSpec{mm_hash(n), transfer_id(n), small_spec(), false}, now);
  }
  return table;
}

// Fresh keys for records a workload creates and then retires. Twice the
// tombstone bound: a key comes round again only after its tombstone is gone.
struct FreshKeys {
  FreshKeys() {
    for (std::size_t i = 0; i < 2 * kTombstoneBound; ++i) {
      transfer_ids.push_back(fresh_transfer_id(i));
      mm_hashes.push_back(fresh_mm_hash(i));
    }
  }
  std::size_t next() {
    const std::size_t i = at;
    if (++at == transfer_ids.size()) at = 0;
    return i;
  }
  std::vector<std::string> transfer_ids;
  std::vector<std::string> mm_hashes;
  std::size_t at = 0;
};

// One readiness for a new transfer among `live` others; the transfer is then
// cancelled so the table keeps its size (the figure is for the pair).
struct ObserveReadyLoop {
  explicit ObserveReadyLoop(std::int64_t live) : table(make_table(live, now)) {}
  void step() {
    const std::size_t k = keys.next();
    keep(table->observe_ready(LoadSpec{keys.mm_hashes[k], keys.transfer_ids[k], spec, false}, now));
    keep(table->cancel(keys.transfer_ids[k], now));
  }
  TimePoint now = TimePoint{} + 1h;
  std::unique_ptr<TransferTable> table;
  FreshKeys keys;
  TensorSpec spec = small_spec();
};

// expire() at a step with nothing due (the common case), and with one record
// due (a waiting record created in the same step).
struct ExpireLoop {
  explicit ExpireLoop(std::int64_t live) : table(make_table(live, now)) {}
  void nothing_due() {
    cancels.clear();
    table->expire(now + 10s, cancels);
    keep(cancels.data());
  }
  void one_due() {
    cancels.clear();
    const std::size_t k = keys.next();
    table->wait_for_event(keys.transfer_ids[k], request_id, keys.mm_hashes[k], now, now);
    table->expire(now, cancels);
    table->forget_pending_request(request_id);  // the engine takes the notification each step
    keep(cancels.data());
  }
  TimePoint now = TimePoint{} + 1h;
  std::unique_ptr<TransferTable> table;
  FreshKeys keys;
  std::vector<std::string> cancels;
  std::string request_id = "req-" + hex_key(5ull << 40, 2);
};

}  // namespace ecx::scheduler::bench
