// Model-based randomized test: seeded random operation sequences against the
// coordinator (fed by fake events and worker reports), checking invariants after
// every operation. A failure names its seed; rerun one with
// ECX_SCHEDULER_MODEL_SEED=<seed>.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>

#include "ecx/scheduler/coordinator.h"
#include "fakes.h"

namespace ecx::scheduler {
namespace {

using namespace std::chrono_literals;
using S = TransferState;

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

#ifdef ECX_SANITIZED
constexpr std::uint64_t kDefaultSequences = 1'000;  // sanitizers are ~10x slower
#else
constexpr std::uint64_t kDefaultSequences = 10'000;
#endif

struct ModelRequest {
  RequestView view;
  bool admitted = false;
  // Transfer id → deadline of the waiting record this request last registered
  // on. A record dropped as an old tombstone and created again by a later wait
  // has a new deadline; the wait starts over.
  std::map<std::string, TimePoint> waits;
};

class Sequence {
 public:
  explicit Sequence(std::uint64_t seed) : rng_(seed) {
    auto options = testing::consumer_options();
    options.is_producer = pick(4) == 0;
    options.encoder_output_width = 16;
    options.control_address.clear();  // no remote control: cancels stay local (no threads)
    options.push_wait_timeout = 10s;
    options.table.reservation_ttl = 30s;
    options.table.tombstone_max = 1 + pick(8);
    options.table.resident_capacity_bytes = 100 + pick(600);
    options.max_pending_shard_events = 1 + pick(4);
    shards_ = 1 + static_cast<int>(pick(2));
    clock_ = std::make_shared<ManualClock>();
    events_ = std::make_shared<testing::FakeEventSource>(shards_);
    coordinator_ = std::make_unique<SchedulerCoordinator>(options, clock_, events_, nullptr);
  }

  // Runs `steps` random operations; returns the first violated invariant.
  std::string run(int steps) {
    for (int i = 0; i < steps; ++i) {
      const std::string op = random_op();
      if (trace_)
        std::fprintf(stderr, "  op #%d @%.3fs: %s\n", i, duration_to_seconds(clock_->now().time_since_epoch()),
                     op.c_str());
      if (auto problem = check(); !problem.empty())
        return "after op #" + std::to_string(i) + " (" + op + "): " + problem;
    }
    return {};
  }

 private:
  std::uint64_t pick(std::uint64_t n) { return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng_); }
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
      r.view.mm_features.push_back(testing::feature(hash, static_cast<std::int64_t>(i) * 10));
      nlohmann::json item = nlohmann::json::object();
      if (pick(10) != 0) item["transfer_id"] = transfer_name(pick(10));  // sometimes shared, sometimes colliding
      if (pick(3) == 0) item["mm_hash"] = hash;
      items.push_back(item);
    }
    if (pick(20) == 0)
      r.view.set_ec_transfer_params(nlohmann::json{{"ec_items", 5}});  // malformed
    else
      r.view.set_ec_transfer_params(nlohmann::json{{"ec_items", items}, {"consumer_zmq", "tcp://c:1"}});
    const std::string id = r.view.request_id;
    live_.emplace(id, std::move(r));
    return "new " + id;
  }

  void ensure_one(ModelRequest& r) {
    const TimePoint now = clock_->now();
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
    (void)now;
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
      if (pick(3) == 0) {
        view.free_encoder_mm_hashes.push_back(*it);
        it = engine_cache_.erase(it);
      } else {
        ++it;
      }
    }
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
          break;  // this report was lost
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

  std::mt19937_64 rng_;
  bool trace_ = std::getenv("ECX_SCHEDULER_MODEL_TRACE") != nullptr;
  int shards_ = 1;
  std::shared_ptr<ManualClock> clock_;
  std::shared_ptr<testing::FakeEventSource> events_;
  std::unique_ptr<SchedulerCoordinator> coordinator_;
  std::map<std::string, ModelRequest> live_;
  std::set<std::string> engine_cache_;
  std::vector<std::string> in_flight_;
  std::set<std::string> notified_;
  std::string duplicate_notification_;
  std::uint64_t next_request_ = 0;
  bool deadline_check_due_ = false;
};

TEST(SchedulerModel, RandomSequencesKeepEveryInvariant) {
  const std::uint64_t sequences = env_number("ECX_SCHEDULER_MODEL_SEQUENCES", kDefaultSequences);
  const std::uint64_t first = env_number("ECX_SCHEDULER_MODEL_SEED", 0);
  const std::uint64_t count = std::getenv("ECX_SCHEDULER_MODEL_SEED") ? 1 : sequences;
  for (std::uint64_t seed = first; seed < first + count; ++seed) {
    Sequence sequence(seed);
    const std::string problem = sequence.run(80);
    ASSERT_TRUE(problem.empty()) << "seed " << seed << ": " << problem
                                 << "\n(rerun with ECX_SCHEDULER_MODEL_SEED=" << seed << ")";
  }
  RecordProperty("sequences", static_cast<int>(count));
}

}  // namespace
}  // namespace ecx::scheduler
