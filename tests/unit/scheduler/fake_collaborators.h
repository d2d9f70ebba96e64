#pragma once
// In-process fakes of the coordinator's collaborators, and request builders (no
// test framework: the coordinator fuzzer uses them too).

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "connector/scheduler/transfer_params_json.h"
#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/coordinator.h"

namespace ecx::scheduler::testing {

inline TensorSpec spec_of(std::int64_t rows, std::int64_t width = 16, DType dtype = DType::bfloat16) {
  return *TensorSpec::make({rows, width}, dtype, 1ull << 40);
}

// Events queued by the test, delivered by drain().
class FakeEventSource final : public EventSource {
 public:
  explicit FakeEventSource(int shards = 1) : shards_(shards) {}
  std::size_t drain(std::vector<TransferEvent>& out, std::size_t max_events) override {
    ++drain_calls;
    std::size_t n = 0;
    while (!queue_.empty() && n < max_events) {
      out.push_back(std::move(queue_.front()));
      queue_.pop_front();
      ++n;
    }
    return n;
  }
  int shard_count() const override { return shards_; }
  void close() override { closed = true; }
  SubscriptionCounters subscription_counters() const override { return counters; }

  void push(TransferEvent e) { queue_.push_back(std::move(e)); }
  SubscriptionCounters counters;  // what subscription_counters() answers
  void ready(const std::string& transfer_id, const std::string& mm_hash, std::int64_t rows = 4, int shard = -1) {
    TransferEvent e;
    e.kind = TransferEvent::Kind::ready;
    e.transfer_id = transfer_id;
    e.mm_hash = mm_hash;
    e.shard = shard;
    e.spec = spec_of(rows);
    e.reservation_id = ReservationId(1, 2);
    push(std::move(e));
  }
  void ready_all_shards(const std::string& transfer_id, const std::string& mm_hash, std::int64_t rows = 4) {
    if (shards_ <= 1) return ready(transfer_id, mm_hash, rows);
    for (int s = 0; s < shards_; ++s) ready(transfer_id, mm_hash, rows, 14579 + s);
  }
  void abandoned(const std::string& transfer_id, const std::string& mm_hash, int shard = -1) {
    TransferEvent e;
    e.kind = TransferEvent::Kind::abandoned;
    e.transfer_id = transfer_id;
    e.mm_hash = mm_hash;
    e.shard = shard;
    push(std::move(e));
  }
  void set_shards(int n) { shards_ = n; }
  std::size_t queued() const { return queue_.size(); }

  int drain_calls = 0;
  bool closed = false;

 private:
  int shards_;
  std::deque<TransferEvent> queue_;
};

// Consumer control with scripted failures. Thread-safe: executor threads call it.
class FakeConsumerControl final : public ConsumerControl {
 public:
  explicit FakeConsumerControl(std::vector<std::string> shards) : shards_(std::move(shards)) {}

  Result<std::vector<std::string>> discover_shards(const std::string& base_address) override {
    std::unique_lock lock(mutex_);
    record_thread();
    discover_addresses.push_back(base_address);
    ++discover_calls;
    Result<std::vector<std::string>> out = shards_;
    if (discover_failures > 0) {
      --discover_failures;
      out = unavailable("did not report its shards");
    }
    changed_.notify_all();
    return out;
  }
  Result<bool> cancel(const std::string& shard_address, const std::string& transfer_id) override {
    std::unique_lock lock(mutex_);
    record_thread();
    // A gated call waits (bounded) until the test opens the gate, or the control
    // client is closed (then it ends at once, cancelled, like a real one).
    ++started_cancel_calls;
    changed_.notify_all();
    changed_.wait_for(lock, std::chrono::seconds(10), [&] { return !gated || closed; });
    cancel_calls.emplace_back(shard_address, transfer_id);
    Result<bool> out = true;
    if (gated && closed) out = cancelled("the control client is shutting down");
    if (auto it = cancel_failures.find(shard_address); it != cancel_failures.end() && it->second > 0) {
      --it->second;
      out = timeout_error("control request timed out");
    }
    if (auto it = cancel_failures_for.find({shard_address, transfer_id});
        it != cancel_failures_for.end() && it->second > 0) {
      --it->second;
      out = timeout_error("control request timed out");
    }
    ++finished_cancel_calls;
    changed_.notify_all();
    return out;
  }
  // Records how the ids were grouped, then asks one at a time (the default).
  std::vector<Result<bool>> cancel_many(const std::string& shard_address,
                                        const std::vector<std::string>& transfer_ids) override {
    {
      std::lock_guard lock(mutex_);
      cancel_many_calls.emplace_back(shard_address, transfer_ids);
    }
    return ConsumerControl::cancel_many(shard_address, transfer_ids);
  }
  // Answers from `held` (the shard's reservation of the transfer), else not found.
  Result<ShardTransfer> transfer_status(const std::string& shard_address, const std::string& transfer_id) override {
    std::unique_lock lock(mutex_);
    record_thread();
    status_calls.emplace_back(shard_address, transfer_id);
    Result<ShardTransfer> out = ShardTransfer{};
    if (auto it = held.find({shard_address, transfer_id}); it != held.end()) out = it->second;
    changed_.notify_all();
    return out;
  }
  void close() override {
    std::lock_guard lock(mutex_);
    closed = true;
    changed_.notify_all();
  }
  // Waits (bounded) until `n` status RPCs were answered; false on the deadline.
  bool wait_status_calls(std::size_t n, std::chrono::seconds limit = std::chrono::seconds(10)) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, limit, [&] { return status_calls.size() >= n; });
  }
  bool wait_started_cancels(std::size_t n, std::chrono::seconds limit = std::chrono::seconds(10)) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, limit, [&] { return started_cancel_calls >= n; });
  }

  // Waits (bounded) until `n` cancel RPCs finished; false on the deadline.
  bool wait_cancels(std::size_t n, std::chrono::seconds limit = std::chrono::seconds(10)) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, limit, [&] { return finished_cancel_calls >= n; });
  }
  bool wait_discovers(std::size_t n, std::chrono::seconds limit = std::chrono::seconds(10)) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, limit, [&] { return discover_calls >= n; });
  }
  void open_gate() {
    std::lock_guard lock(mutex_);
    gated = false;
    changed_.notify_all();
  }
  template <typename F>
  auto locked(F&& f) {
    std::lock_guard lock(mutex_);
    return f();
  }

  // Guarded by the mutex (read them through locked() while the executor runs).
  std::vector<std::string> discover_addresses;
  std::size_t discover_calls = 0;
  int discover_failures = 0;
  std::vector<std::pair<std::string, std::string>> cancel_calls;
  std::vector<std::pair<std::string, std::vector<std::string>>> cancel_many_calls;  // (shard, ids) per call
  std::size_t finished_cancel_calls = 0;
  std::size_t started_cancel_calls = 0;
  std::map<std::string, int> cancel_failures;                              // by shard: its next N cancels time out
  std::map<std::pair<std::string, std::string>, int> cancel_failures_for;  // by (shard, transfer id)
  std::vector<std::pair<std::string, std::string>> status_calls;
  std::map<std::pair<std::string, std::string>, ShardTransfer> held;  // (shard address, transfer id)
  std::set<std::thread::id> threads;
  bool gated = false;
  bool closed = false;

 private:
  void record_thread() { threads.insert(std::this_thread::get_id()); }
  std::vector<std::string> shards_;
  std::mutex mutex_;
  std::condition_variable changed_;
};

inline MmFeature feature(const std::string& identifier, std::int64_t offset = 0, std::int64_t length = 10,
                         std::int64_t rows = 4, const std::string& modality = "image") {
  MmFeature f;
  f.identifier = identifier;
  f.modality = modality;
  f.offset = offset;
  f.length = length;
  f.num_encoder_embeds = rows;
  return f;
}

// A request whose item i names transfer_ids[i] (matched by position; "" = no entry id).
inline RequestView request(const std::string& request_id, const std::vector<std::string>& hashes,
                           const std::vector<std::string>& transfer_ids, const std::string& consumer = "") {
  RequestView r;
  r.request_id = request_id;
  nlohmann::json items = nlohmann::json::array();
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    r.mm_features.push_back(feature(hashes[i], static_cast<std::int64_t>(i) * 10));
    nlohmann::json item = nlohmann::json::object();
    if (i < transfer_ids.size() && !transfer_ids[i].empty()) item["transfer_id"] = transfer_ids[i];
    items.push_back(item);
  }
  nlohmann::json params = {{"ec_items", items}};
  if (!consumer.empty()) params["consumer_zmq"] = consumer;
  set_ec_transfer_params(r, params);
  return r;
}

inline CoordinatorOptions consumer_options() {
  CoordinatorOptions o;
  o.is_consumer = true;
  o.is_producer = false;
  o.control_address = "tcp://127.0.0.1:14579";
  o.push_wait_timeout = std::chrono::seconds(60);
  o.table.reservation_ttl = std::chrono::seconds(300);
  o.table.tombstone_max = 65536;
  o.table.resident_capacity_bytes = 1 << 20;
  o.control_threads = 2;
  return o;
}

inline CoordinatorOptions producer_options() {
  CoordinatorOptions o = consumer_options();
  o.is_consumer = false;
  o.is_producer = true;
  o.encoder_output_width = 16;
  o.encoder_dtype = DType::bfloat16;
  return o;
}

}  // namespace ecx::scheduler::testing
