#pragma once
// Workloads shared by bench_scheduler (timings), `ecx bench scheduler` and scheduler_opcount
// (instruction counts under callgrind), so all three measure the same thing.
//
// Realistic keys: transfer ids are 32 hex digits (what the proxy mints), mm_hashes
// 64 (a hex digest, as the engine's item hashes are) — too long for a string's
// inline buffer, as in production. Every workload touches the same number of
// distinct table keys at every table size (kWorkingSet), so a larger table costs
// only what the table itself costs: its records and indexes spread over more
// memory. The benchmark's own inputs stay hot, as the engine's are (it builds the
// strings it passes just before the call): a key is a fixed prefix and an 8-digit
// hex tail, and each call rewrites the tail of one reused string in place, so no
// store of benchmark keys competes with the table for the cache.

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "connector/scheduler/transfer_params_json.h"
#include "ecx/connector/scheduler/coordinator.h"

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

inline constexpr char kHexDigits[] = "0123456789abcdef";
inline constexpr std::size_t kTailDigits = 8;  // up to 16^8 keys per key space

// Overwrites the last kTailDigits characters of `key` with the hex digits of `index`.
inline void set_tail(std::string& key, std::uint64_t index) {
  for (std::size_t d = 1; d <= kTailDigits; ++d, index >>= 4) key[key.size() - d] = kHexDigits[index & 15];
}

// Key `index` of key space `space`: 16 * `words` hex digits.
inline std::string make_key(std::uint64_t space, int words, std::uint64_t index) {
  std::string out(static_cast<std::size_t>(words) * 16, '0');
  for (int w = 0; w < words; ++w) {
    std::uint64_t v = mix(space * 4 + static_cast<std::uint64_t>(w));
    for (int d = 0; d < 16; ++d, v >>= 4)
      out[static_cast<std::size_t>(w) * 16 + static_cast<std::size_t>(d)] = kHexDigits[v & 15];
  }
  set_tail(out, index);
  return out;
}

// Key spaces: the table's records, fresh records a workload creates, requests.
inline std::string transfer_id(std::uint64_t i) { return make_key(1, 2, i); }
inline std::string mm_hash(std::uint64_t i) { return make_key(2, 4, i); }
inline std::string fresh_transfer_id(std::uint64_t i) { return make_key(3, 2, i); }
inline std::string fresh_mm_hash(std::uint64_t i) { return make_key(4, 4, i); }
inline std::string request_id(std::uint64_t i) { return "req-" + make_key(5, 2, i); }

inline TensorSpec small_spec() { return *TensorSpec::make({4, 16}, DType::bfloat16, 1ull << 40); }

inline TableLimits bench_limits() { return TableLimits{300s, kTombstoneBound, 1ull << 40}; }

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

// has_cache_item for kWorkingSet hashes of the table, spread over all of it
// (with repeats when it holds fewer records).
struct HasCacheItemLoop {
  explicit HasCacheItemLoop(std::int64_t live) : fixture(live) {
    for (std::size_t k = 0; k < kWorkingSet; ++k) records.push_back(mix(k) % static_cast<std::uint64_t>(live));
  }
  bool step() {
    set_tail(probe, records[next]);
    if (++next == records.size()) next = 0;
    return fixture.coordinator->has_cache_item(probe);
  }
  CoordinatorFixture fixture;
  std::vector<std::uint64_t> records;
  std::size_t next = 0;
  std::string probe = mm_hash(0);
};

// Deferred requests re-checked every step, each item waiting for its push:
// kWorkingSet waiting transfers in all, whatever the items per request. The
// request object is rewritten in place to name the next request and its items.
struct EnsureLoop {
  EnsureLoop(std::int64_t live, std::int64_t items_per_request)
      : fixture(live),
        items(static_cast<std::size_t>(items_per_request)),
        requests(kWorkingSet / static_cast<std::size_t>(items_per_request)) {
    view.request_id = request_id(0);
    nlohmann::json ec_items = nlohmann::json::array();
    for (std::size_t k = 0; k < items; ++k) {
      MmFeature feature;
      feature.identifier = fresh_mm_hash(0);
      feature.offset = static_cast<std::int64_t>(k) * 10;
      feature.length = 10;
      view.mm_features.push_back(feature);
      ec_items.push_back({{"transfer_id", fresh_transfer_id(0)}});
    }
    set_ec_transfer_params(view, nlohmann::json{{"ec_items", ec_items}});
    for (std::size_t r = 0; r < requests; ++r) step();  // every transfer now waits
  }
  bool step() {
    set_tail(view.request_id, next);
    for (std::size_t k = 0; k < items; ++k) {
      const std::uint64_t key = next * items + k;
      set_tail(view.mm_features[k].identifier, key);
      set_tail(*view.ec_transfer_params->items[k].transfer_id, key);
    }
    if (++next == requests) next = 0;
    return fixture.coordinator->ensure_cache_available(view, 0);
  }
  CoordinatorFixture fixture;
  std::size_t items;
  std::size_t requests;
  std::size_t next = 0;
  RequestView view;
};

// A table with `live` available records.
inline std::unique_ptr<TransferTable> make_table(std::int64_t live, TimePoint now) {
  auto table = std::make_unique<TransferTable>(bench_limits());
  for (std::int64_t i = 0; i < live; ++i) {
    const auto n = static_cast<std::uint64_t>(i);
    table->observe_ready(LoadSpec{mm_hash(n), transfer_id(n), small_spec(), false}, now);
  }
  return table;
}

// Fresh keys for records a workload creates and then retires. Like real
// transfer ids they never repeat (within 16^8 calls), so each lands on index
// slots no earlier call warmed.
struct FreshKeys {
  void next() {
    set_tail(transfer_id, at);
    set_tail(mm_hash, at);
    ++at;
  }
  std::string transfer_id = fresh_transfer_id(0);
  std::string mm_hash = fresh_mm_hash(0);
  std::uint64_t at = 0;
};

// One readiness for a new transfer among `live` others; the transfer is then
// cancelled so the table keeps its size (the figure is for the pair).
struct ObserveReadyLoop {
  explicit ObserveReadyLoop(std::int64_t live) : table(make_table(live, now)) {}
  void step() {
    keys.next();
    keep(table->observe_ready(LoadSpec{keys.mm_hash, keys.transfer_id, spec, false}, now));
    keep(table->cancel(keys.transfer_id, now));
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
    keys.next();
    table->wait_for_event(keys.transfer_id, request, keys.mm_hash, now, now);
    table->expire(now, cancels);
    table->forget_pending_request(request);  // the engine takes the notification each step
    keep(cancels.data());
  }
  TimePoint now = TimePoint{} + 1h;
  std::unique_ptr<TransferTable> table;
  FreshKeys keys;
  std::vector<std::string> cancels;
  std::string request = request_id(0);
};

}  // namespace ecx::scheduler::bench
