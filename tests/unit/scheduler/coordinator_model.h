#pragma once
// A model of the engine around the scheduler coordinator: random operation
// sequences (requests arriving, gates, allocations and frees, readiness events,
// worker reports, time passing, engine steps) with the coordinator's invariants
// checked after every operation, and at the end of a life: once every request
// finished and every deadline passed, nothing is left behind. The unit test drives
// it from seeds, the coordinator fuzzer from its input.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "connector/scheduler/transfer_params_json.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/scheduler/transfer_params.h"
#include "fake_collaborators.h"

namespace ecx::scheduler::testing {

using namespace std::chrono_literals;
using S = TransferState;

struct ModelRequest {
  RequestView view;
  bool admitted = false;
  // Transfer id → deadline of the waiting record this request last registered
  // on. A record dropped as an old tombstone and created again by a later wait
  // has a new deadline; the wait starts over.
  std::map<std::string, TimePoint> waits;
};

// Where the model's random decisions come from: a seeded generator (the unit test)
// or the fuzzer's input bytes.
class Choices {
 public:
  virtual ~Choices() = default;
  // A number in [0, n), n >= 1.
  virtual std::uint64_t pick(std::uint64_t n) = 0;
};

class SeededChoices final : public Choices {
 public:
  explicit SeededChoices(std::uint64_t seed) : rng_(seed) {}
  std::uint64_t pick(std::uint64_t n) override { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng_); }

 private:
  std::mt19937_64 rng_;
};

// Reads each decision from the next byte (two for wide ranges); 0 once the input
// is used up, so every input is a finite sequence.
class ByteChoices final : public Choices {
 public:
  ByteChoices(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint64_t pick(std::uint64_t n) override {
    std::uint64_t v = next();
    if (n > 256) v = (v << 8) | next();
    return v % n;
  }
  bool exhausted() const { return at_ >= size_; }

 private:
  std::uint64_t next() { return at_ < size_ ? data_[at_++] : 0; }
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

// One random life of a consumer (sometimes also producer) coordinator.
class CoordinatorModel {
 public:
  // `remember_waiting` off: the load gate decides every re-check afresh.
  explicit CoordinatorModel(Choices& choices, bool remember_waiting = true) : choices_(choices) {
    auto options = consumer_options();
    options.remember_waiting = remember_waiting;
    options.is_producer = pick(4) == 0;
    options.encoder_output_width = 16;
    options.control_address.clear();  // no remote control: cancels stay local (no threads)
    options.push_wait_timeout = 10s;
    options.table.reservation_ttl = 30s;
    options.table.tombstone_max = 1 + pick(8);
    options.table.resident_capacity_bytes = 100 + pick(600);
    options.max_pending_shard_events = 1 + pick(4);
    // Mostly the default engine; sometimes one that loads synchronously, or one that
    // never fails requests through take_unavailable_requests.
    options.asynchronous_loads = pick(4) != 0;
    options.unavailable_reaches_engine = pick(4) != 0;
    shards_ = 1 + static_cast<int>(pick(2));
    clock_ = std::make_shared<ManualClock>();
    events_ = std::make_shared<FakeEventSource>(shards_);
    coordinator_ = std::make_unique<SchedulerCoordinator>(options, clock_, events_, nullptr);
  }

  // Runs `steps` random operations; returns the first violated invariant.
  std::string run(int steps) {
    for (int i = 0; i < steps; ++i) {
      const std::string op = random_op();
      if (trace_) std::fprintf(stderr, "  op #%d %s\n", i, describe(op).c_str());
      if (decisions_ != nullptr) decisions_->push_back(describe(op) + " | " + outcome_text());
      if (auto problem = check(); !problem.empty())
        return "after op #" + std::to_string(i) + " (" + op + "): " + problem;
    }
    return {};
  }

  // One traced operation: the time, the operation, the live records, the engine's
  // cache and the loads in flight after it.
  std::string describe(const std::string& op) const {
    std::string out = "@" + std::to_string(duration_to_seconds(clock_->now().time_since_epoch())) + "s: " + op + " |" +
                      records_text(/*live_only=*/true) + " | engine:";
    for (const auto& h : engine_cache_) out += " " + h;
    out += " | loading:";
    for (const auto& h : in_flight_) out += " " + h;
    return out;
  }

  const SchedulerCoordinator& coordinator() const { return *coordinator_; }

  // From now on, run() appends each operation's description (describe) and what the
  // engine was told (outcome_text) to `out`.
  void record_decisions(std::vector<std::string>* out) { decisions_ = out; }

  // Which live requests passed their gate, and every request told unavailable.
  std::string outcome_text() const {
    std::string out = "admitted:";
    for (const auto& [id, r] : live_)
      if (r.admitted) out += " " + id;
    out += " | unavailable:";
    for (const auto& id : notified_) out += " " + id;
    return out;
  }

  // The end of the life: every request finishes, the workers report every load
  // still out, the engine frees its entries and time passes every deadline. Then
  // nothing may be left: no live transfer record but resident copies, no
  // per-request or per-copy bookkeeping. Returns the first thing left behind.
  std::string settle() {
    for (auto& [id, r] : live_) coordinator_->request_finished(r.view);
    live_.clear();
    for (int round = 0; round < 5; ++round) {
      WorkerOutput out;
      for (auto* list : {&in_flight_, &late_}) {
        for (auto& h : *list) (pick(4) == 0 ? out.failed_loads : out.loaded).push_back(h);
        list->clear();
      }
      coordinator_->update_connector_output(out);
      StepView view;  // (the first closes the current step: nothing allocated in it can be evicted)
      if (round > 0) {
        view.free_encoder_mm_hashes.assign(engine_cache_.begin(), engine_cache_.end());
        engine_cache_.clear();
      }
      allocated_since_step_.clear();
      auto meta = coordinator_->build_connector_meta(view);
      for (auto& load : meta.loads) in_flight_.push_back(load.mm_hash);
      clock_->advance(11s);  // past the push wait (10 s); the rounds together pass the TTL (30 s)
      coordinator_->has_cache_item("probe");
      take();
    }
    if (!in_flight_.empty()) return "a load was planned after every request finished: " + in_flight_.front();
    if (auto problem = check(); !problem.empty()) return problem;
    std::string problem;
    coordinator_->table().for_each_record([&](const TransferRecord& r) {
      if (problem.empty() && !is_terminal(r.state()) && r.state() != S::resident)
        problem = "record " + r.transfer_id() + " still " + std::string(transfer_state_name(r.state()));
    });
    if (!problem.empty()) return problem;
    const auto b = coordinator_->bookkeeping();
    const std::pair<const char*, std::size_t> left[] = {
        {"requests counting on copies", b.requests_counting_on_copies},
        {"counted-on copies", b.counted_on_copies},
        {"unowned loads", b.unowned_loads},
        {"substitutes", b.substitutes},
        {"engine cache entries", b.engine_cache_entries},
        {"malformed requests pending", b.malformed_pending},
        {"push bindings", b.push_bindings},
        {"remembered waits", b.remembered_waits},
    };
    for (const auto& [what, n] : left) {
      if (n != 0)
        return std::to_string(n) + " " + what +
               " left after every request finished (records:" + records_text(/*live_only=*/false) + ")";
    }
    return {};
  }

  // " id/hash=STATE" for each record (tombstones too unless `live_only`).
  std::string records_text(bool live_only) const {
    std::string out;
    coordinator_->table().for_each_record([&](const TransferRecord& r) {
      if (!live_only || !is_terminal(r.state()))
        out += " " + r.transfer_id() + "/" + r.mm_hash() + "=" + std::string(transfer_state_name(r.state()));
    });
    return out;
  }

 private:
  std::uint64_t pick(std::uint64_t n) { return choices_.pick(n); }
  std::string hash_name(std::uint64_t i) { return "h" + std::to_string(i); }
  std::string transfer_name(std::uint64_t i) { return "t" + std::to_string(i); }

  ModelRequest* random_live() {
    if (live_.empty()) return nullptr;
    auto it = live_.begin();
    std::advance(it, static_cast<long>(pick(live_.size())));
    return &it->second;
  }

  std::string random_op() {
    switch (pick(12)) {
      case 0:
      case 1:
        return new_request();
      case 2:
      case 3:
        return ensure();
      case 4:
        return alloc_or_free();
      case 5:
        return finish();
      case 6:
      case 7:
        return event();
      case 8:
        return step();
      case 9:
        return worker_report();
      case 10:
        return advance();
      default:
        return engine_step();
    }
  }

  std::string new_request() {
    if (live_.size() >= 6) return "new(skipped)";
    ModelRequest r;
    r.view.request_id = "r" + std::to_string(next_request_++);
    nlohmann::json items = nlohmann::json::array();
    const auto n = 1 + pick(2);
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::string hash = hash_name(pick(5));
      r.view.mm_features.push_back(feature(hash, static_cast<std::int64_t>(i) * 10));
      nlohmann::json item = nlohmann::json::object();
      if (pick(10) != 0) item["transfer_id"] = transfer_name(pick(10));  // sometimes shared, sometimes colliding
      if (pick(3) == 0) item["mm_hash"] = hash;
      items.push_back(item);
    }
    if (pick(20) == 0)
      set_ec_transfer_params(r.view, nlohmann::json{{"ec_items", 5}});  // malformed
    else
      set_ec_transfer_params(r.view, nlohmann::json{{"ec_items", items}, {"consumer_zmq", "tcp://c:1"}});
    const std::string id = r.view.request_id;
    live_.emplace(id, std::move(r));
    std::string hashes;
    for (const auto& f : live_.at(id).view.mm_features) hashes += " " + f.identifier;
    return "new " + id + hashes + " " + items.dump();
  }

  void ensure_one(ModelRequest& r) {
    r.admitted = coordinator_->ensure_cache_available(r.view, 0) || r.admitted;
    if (r.admitted || !r.view.ec_transfer_params) return;
    for (std::size_t i = 0; i < r.view.mm_features.size(); ++i) {
      auto tid = resolve_transfer_id(&*r.view.ec_transfer_params, i, r.view.mm_features[i].identifier);
      if (!tid) continue;
      const auto* rec = coordinator_->table().find(*tid);
      if (rec && rec->state() == S::waiting_event && rec->deadline()) {
        const auto& w = rec->waiters();
        if (std::find(w.begin(), w.end(), r.view.request_id) != w.end()) {
          r.waits[std::string(*tid)] = *rec->deadline();
        }
      }
    }
  }

  std::string ensure() {
    ModelRequest* r = random_live();
    if (!r) return "ensure(none)";
    ensure_one(*r);
    return "ensure " + r->view.request_id;
  }

  std::string alloc_or_free() {
    ModelRequest* r = random_live();
    if (!r || !r->admitted) return "alloc(none)";
    const std::size_t i = pick(r->view.mm_features.size());
    if (pick(2) == 0) {
      coordinator_->update_state_after_alloc(r->view, i);
      engine_cache_.insert(r->view.mm_features[i].identifier);
      allocated_since_step_.insert(r->view.mm_features[i].identifier);
      return "alloc " + r->view.request_id;
    }
    coordinator_->update_state_after_free(r->view, i);
    return "free " + r->view.request_id;
  }

  std::string finish() {
    ModelRequest* r = random_live();
    if (!r) return "finish(none)";
    const std::string id = r->view.request_id;
    coordinator_->request_finished(r->view);
    live_.erase(id);
    return "finish " + id;
  }

  std::string event() {
    const std::string tid = transfer_name(pick(10));
    std::string hash = hash_name(pick(5));
    // Mostly the hash a live request binds to this id (so readiness is accepted).
    for (auto& [id, r] : live_) {
      if (!r.view.ec_transfer_params || pick(5) == 0) continue;
      for (std::size_t i = 0; i < r.view.mm_features.size(); ++i) {
        auto t = resolve_transfer_id(&*r.view.ec_transfer_params, i, r.view.mm_features[i].identifier);
        if (t && *t == tid) hash = r.view.mm_features[i].identifier;
      }
    }
    switch (pick(10)) {
      case 0:
        events_->abandoned(tid, hash, pick(2) ? 14579 : -1);
        return "abandoned " + tid;
      case 1: {
        TransferEvent bad;
        bad.transfer_id = pick(2) ? "" : tid;
        bad.mm_hash = hash;
        events_->push(bad);  // no spec, or no id
        return "malformed " + tid;
      }
      case 2:
        events_->ready(tid, hash, 4, pick(4) == 0 ? -1 : 14579 + static_cast<int>(pick(2)));
        return "ready(1 shard) " + tid;
      default:
        events_->ready_all_shards(tid, hash, pick(6) == 0 ? 12 : 4);
        return "ready " + tid;
    }
  }

  std::string step() {
    StepView view;
    for (auto it = engine_cache_.begin(); it != engine_cache_.end();) {
      if (pick(3) != 0) {
        ++it;
      } else if (allocated_since_step_.contains(*it)) {
        // The engine cannot evict what this step allocated (a request holds it):
        // a free of it means it was evicted and allocated again, and stays.
        view.free_encoder_mm_hashes.push_back(*it++);
      } else {
        view.free_encoder_mm_hashes.push_back(*it);
        it = engine_cache_.erase(it);
      }
    }
    allocated_since_step_.clear();
    auto meta = coordinator_->build_connector_meta(view);
    for (auto& load : meta.loads) in_flight_.push_back(load.mm_hash);
    return "step";
  }

  std::string worker_report() {
    WorkerOutput out;
    std::vector<std::string> keep;
    for (auto& h : in_flight_) {
      switch (pick(4)) {
        case 0:
          out.loaded.push_back(h);
          break;
        case 1:
          out.failed_loads.push_back(h);
          break;
        case 2:
          late_.push_back(h);  // reported only at the end of the life, long past its deadline
          break;
        default:
          keep.push_back(h);
          break;
      }
    }
    in_flight_ = std::move(keep);
    if (pick(5) == 0) out.reclaimed.push_back(hash_name(pick(5)));
    if (pick(5) == 0) out.failed_saves.push_back("r" + std::to_string(pick(next_request_ + 1)));
    coordinator_->update_connector_output(out);
    return "worker";
  }

  std::string advance() {
    clock_->advance(pick(3) == 0 ? Duration(std::chrono::milliseconds(pick(10)))
                                 : Duration(std::chrono::seconds(pick(15))));
    return "advance";
  }

  // The engine's loop: metadata, then every waiting request re-checked, then the
  // unavailable ones failed. After it, the deadline invariants must hold.
  std::string engine_step() {
    step();
    coordinator_->has_cache_item("probe");  // the first hook after a step drains
    for (auto& [id, r] : live_) {
      if (!r.admitted) ensure_one(r);
    }
    take();
    deadline_check_due_ = true;
    return "engine_step";
  }

  void take() {
    for (auto& id : coordinator_->take_unavailable_requests()) {
      if (!notified_.insert(id).second) duplicate_notification_ = id;
    }
  }

  std::string check() {
    if (Status s = coordinator_->table().check_invariants(); !s) return s.message();
    if (!duplicate_notification_.empty()) return "request notified twice: " + duplicate_notification_;
    take();
    if (!duplicate_notification_.empty()) return "request notified twice: " + duplicate_notification_;
    if (!deadline_check_due_) return {};
    deadline_check_due_ = false;
    const TimePoint now = clock_->now();
    std::string problem;
    coordinator_->table().for_each_record([&](const TransferRecord& r) {
      const bool timed = r.state() == S::waiting_event || r.state() == S::loading || r.state() == S::available;
      if (timed && r.deadline() && *r.deadline() <= now) {
        problem = "record " + r.transfer_id() + " in " + std::string(transfer_state_name(r.state())) +
                  " is past its deadline after a drain";
      }
    });
    if (!problem.empty()) return problem;
    // Every request waiting on a transfer whose deadline passed is ready, told
    // unavailable, or has an item on its way through another record of the hash.
    for (auto& [id, r] : live_) {
      if (r.admitted || notified_.contains(id)) continue;
      for (auto& [tid, deadline] : r.waits) {
        if (deadline > now) continue;
        const auto* rec = coordinator_->table().find(tid);
        if (rec && !is_terminal(rec->state()) && rec->state() != S::waiting_event) continue;  // it arrived
        std::string hash;
        for (std::size_t i = 0; i < r.view.mm_features.size(); ++i) {
          auto t = resolve_transfer_id(&*r.view.ec_transfer_params, i, r.view.mm_features[i].identifier);
          if (t && *t == tid) hash = r.view.mm_features[i].identifier;
        }
        // (waiting_event: the push of another request whose delivery this one lent,
        // which it now waits for under that push's own deadline.)
        if (coordinator_->table().has_state(hash, {S::waiting_event, S::available, S::loading, S::ready, S::resident}))
          continue;
        std::string detail = rec ? std::string(transfer_state_name(rec->state())) + " hash=" + rec->mm_hash() : "gone";
        return "request " + id + " still waits on " + tid + " (" + detail + ", item hash " + hash +
               ") past its deadline without being told";
      }
    }
    return {};
  }

  Choices& choices_;
  bool trace_ = std::getenv("ECX_SCHEDULER_MODEL_TRACE") != nullptr;
  int shards_ = 1;
  std::shared_ptr<ManualClock> clock_;
  std::shared_ptr<FakeEventSource> events_;
  std::unique_ptr<SchedulerCoordinator> coordinator_;
  std::map<std::string, ModelRequest> live_;
  std::set<std::string> engine_cache_;
  std::set<std::string> allocated_since_step_;
  std::vector<std::string> in_flight_;
  std::vector<std::string> late_;
  std::set<std::string> notified_;
  std::string duplicate_notification_;
  std::uint64_t next_request_ = 0;
  bool deadline_check_due_ = false;
  std::vector<std::string>* decisions_ = nullptr;
};

}  // namespace ecx::scheduler::testing
