#include "ecx/producer/push_engine.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/control/client.h"
#include "ecx/core/node_stash.h"
#include "ecx/core/stages.h"
#include "ecx/core/thread_name.h"
#include "ecx/transport/factory.h"
#include "ecx/wire/payload_header.h"
#include "staging_area.h"

namespace ecx::producer {
namespace {

// Bound of the dispatcher's queue. Every entry is either an engine command or the
// result of an operation the dispatcher started (itself bounded by the push state),
// so reaching it means the dispatcher is wedged; refusing is better than growing.
constexpr std::size_t kInboxMax = 1 << 20;
// Lent sources whose registration a timed-out send still holds; beyond this many the
// engine gets its memory back regardless (the data plane cancels such sends).
constexpr std::size_t kMaxLentParked = 4096;
constexpr Duration kIdleWakeup = std::chrono::milliseconds(100);
// Inbox buffers up to this many items keep their memory between passes.
constexpr std::size_t kKeptBatchCapacity = 4096;
constexpr std::size_t kMaxAwaitingTopology = 65'536;

struct SubmitCommand {
  PushSpec spec;
  TimePoint planned;  // when the engine submitted it: where its source_wait starts
};
struct BindCommand {
  std::string mm_hash;
  SourceId source = 0;
  std::uint64_t nbytes = 0;
};
struct FinishedCommand {
  std::vector<std::string> request_ids;
};
struct AbandonSourcelessCommand {};
struct TopologyResult {
  std::string base;
  Result<control::Topology> topology;
};
struct TopologyRefresh {
  std::string base;
  Result<control::Topology> topology;
};
struct ReserveResult {  // of one item: every reserve goes in a request of its own
  std::string base;
  std::string transfer_id;
  int shard = 0;
  Result<wire::Reply> reply;
};
struct PayloadResult {
  std::string base;
  std::string transfer_id;
  int shard = 0;
  Status status;
};
struct CancelResult {
  std::string transfer_id;
  int shard = 0;
  Status status;
};
// One-sided (Mooncake) writes: the write settled, or its deadline passed first.
struct WriteSettled {
  PayloadCommand payload;
  Status status;
};
struct WriteOverdue {
  std::string transfer_id;
  int shard = 0;
};
using InboxItem = std::variant<SubmitCommand, BindCommand, FinishedCommand, AbandonSourcelessCommand, TopologyResult,
                               TopologyRefresh, ReserveResult, PayloadResult, CancelResult, WriteSettled, WriteOverdue>;

ReserveReply to_reply(const wire::ReserveResult& r) {
  switch (r.outcome) {
    case wire::ReserveOutcome::reserved:
      return reply::Reserved{r.reservation_id, r.generation, r.offset.value_or(0), r.write};
    case wire::ReserveOutcome::ready:
      return reply::Ready{r.reservation_id};
    case wire::ReserveOutcome::cancelled:
      return reply::Cancelled{};
    case wire::ReserveOutcome::retry:
      return reply::RetryAfter{std::chrono::milliseconds(std::max<std::uint32_t>(1, r.retry_after_ms))};
    case wire::ReserveOutcome::error:
      break;
  }
  return reply::Refused{r.error.is_ok() ? internal_error("reserve failed without a reason") : r.error};
}

}  // namespace

struct PushEngine::State : std::enable_shared_from_this<PushEngine::State> {
  Config config;
  std::shared_ptr<const Clock> clock;
  std::shared_ptr<spdlog::logger> log = ecx::log::get("producer");
  PushManager pushes;
  // The largest submit that goes without waking the dispatcher (can_submit_quietly):
  // direct_max_bytes as a push to any number of shards sees it.
  const std::uint64_t quiet_submit_max_bytes;
  std::unique_ptr<control::ControlClient> client;
  transport::OwnedTransport transport;  // its counters are read by the metrics collector too
  bool one_sided = false;  // the data plane writes where the consumer's reserve said (sender-chosen landing)
  std::unique_ptr<StagingArea> staging;  // encoder outputs until their pushes finish
  transport::RegionHandle staging_region;

  // Dispatcher queue. Only the dispatcher waits on inbox_cv. Threads waiting for its
  // progress wait on progress_cv, under the same mutex, woken only by what they wait
  // for: wait_idle by a pass that left nothing queued (or the last lent memory back),
  // wait_active_below by a pass that finished a push. On one shared variable every
  // enqueue and every pass woke both: at 9 MiB with 32 in flight, 4-55 wakes per 200
  // items found wait_active_below's bound not yet met.
  mutable std::mutex inbox_mutex;
  mutable std::condition_variable inbox_cv;
  mutable std::condition_variable progress_cv;
  // Two buffers that trade places each pass, so an enqueue at steady state allocates
  // nothing: a deque took a new block for about every item (and the dispatcher freed
  // the engine's and the data plane's blocks, the costly kind of free).
  std::vector<InboxItem> inbox;
  std::vector<InboxItem> batch;  // dispatcher only: the items of the pass under way
  bool stopping = false;
  bool accepting = true;
  std::thread dispatcher;

  // Dispatcher-only state.
  std::map<std::string, std::vector<PushSpec>> awaiting_topology;  // base address -> specs
  std::multimap<std::string, BindCommand> deferred_binds;          // mm_hash -> binds awaiting a topology
  std::size_t awaiting_count = 0;
  // Pushes and binds parked until a consumer's topology is known; read by pending().
  std::atomic<std::size_t> parked{0};
  void update_parked() {
    parked.store(awaiting_count + deferred_binds.size(), std::memory_order_release);
    submits_parked.store(awaiting_count, std::memory_order_release);
  }

  // Failures found outside the push state (discovery, staging).
  mutable std::mutex failures_mutex;
  std::vector<FailedSave> failures;

  mutable std::mutex counters_mutex;
  EngineCounters engine_counters;
  std::atomic<std::uint64_t> in_progress{0};  // items queued or being handled by the dispatcher
  // Submitted pushes not started yet: in the inbox (until the end of the pass that
  // handles them, when a started one counts as active) or waiting for their consumer's
  // topology. With the active ones, what an encoder bounding its work by
  // wait_active_below has in flight: counting only the active ones, an engine that
  // steps faster than the dispatcher passed its bound (a 64 KiB bench bounded at 32
  // had 110 pushes submitted and not finished on average, 376 at most).
  std::atomic<std::uint64_t> submits_queued{0};
  std::atomic<std::uint64_t> submits_parked{0};
  std::uint64_t unstarted() const {
    return submits_queued.load(std::memory_order_acquire) + submits_parked.load(std::memory_order_acquire);
  }
  std::uint64_t in_flight() const { return pushes.counters().active + unstarted(); }
  // Read from one snapshot of the push counters, before and after each pass.
  struct Progress {
    std::uint64_t in_flight = 0;
    std::uint64_t ended = 0;  // done, failed or cancelled
  };
  Progress progress() const {
    const auto c = pushes.counters();
    return {c.active + unstarted(), c.done + c.failed + c.cancelled};
  }

  State(const Config& c, std::shared_ptr<const Clock> clk) : State(c, std::move(clk), PushOptions::from_config(c)) {}
  State(const Config& c, std::shared_ptr<const Clock> clk, const PushOptions& options)
      : config(c),
        clock(std::move(clk)),
        pushes(options, clock),
        quiet_submit_max_bytes(std::min(options.direct_max_bytes, kDirectMaxBytesAcrossShards)) {}

  void count(std::uint64_t EngineCounters::*field, std::uint64_t by = 1) {
    std::lock_guard lock(counters_mutex);
    engine_counters.*field += by;
  }

  bool enqueue(InboxItem item) { return enqueue_or_keep(item); }
  // Moves `item` into the inbox, or leaves it as it was when the inbox is full. With
  // `wake` false the dispatcher is not woken for it: its next pass takes it.
  bool enqueue_or_keep(InboxItem& item, bool wake = true) {
    {
      std::lock_guard lock(inbox_mutex);
      if (inbox.size() >= kInboxMax) {
        std::lock_guard c(counters_mutex);
        ++engine_counters.inbox_dropped;
        return false;
      }
      inbox.push_back(std::move(item));
      in_progress.fetch_add(1, std::memory_order_acq_rel);
    }
    if (wake) inbox_cv.notify_one();
    return true;
  }

  // A submit the dispatcher need not be woken for: the push will go direct (no
  // reserve to send ahead of the encoder) to a consumer whose topology is known (no
  // discovery to start), so nothing can happen for it before its source is bound,
  // and that bind wakes the dispatcher, which then handles both in one pass. Woken
  // for each, the dispatcher slept and woke once more per item at 64 KiB.
  bool can_submit_quietly(const PushSpec& spec) const {
    if (quiet_submit_max_bytes == 0 || spec.spec.nbytes() > quiet_submit_max_bytes) return false;
    if (idle_waiters.load(std::memory_order_acquire) > 0) return false;  // wait_idle wants every pass now
    return client->has_topology(spec.consumer_address);
  }

  void add_failure(FailedSave failure) {
    log->warn("push of transfer_id={} (mm_hash={}) failed: {}", failure.transfer_id, failure.mm_hash, failure.reason);
    std::lock_guard lock(failures_mutex);
    if (failures.size() < 65'536) failures.push_back(std::move(failure));
  }
  // A push that never started: its own request is the one that fails.
  void add_failure(const PushSpec& spec, std::string reason) {
    add_failure({spec.transfer_id, spec.mm_hash, {spec.request_id}, std::move(reason)});
  }

  void release_source(SourceId id) {
    if (auto lent = staging->release(id)) give_back(std::move(*lent));
  }

  // A lent source nothing sends from any more: its registration goes, then the engine
  // gets its memory back, from the data plane's thread, without the dispatcher waiting
  // for it. A send that timed out may still read it (the data plane refuses to
  // deregister then): it is parked, and the dispatcher retries it each pass, waiting,
  // until it can. Nothing parked is given back before the data plane is gone.
  std::atomic<bool> lent_registration_works{false};  // see lend_source
  std::atomic<std::uint64_t> lent_returning{0};      // deregistrations queued, their memory not yet back
  std::atomic<int> idle_waiters{0};                  // threads in wait_idle()
  std::atomic<int> below_waiters{0};                 // threads in wait_active_below()
  // Deregistration refused (and why), handed to the dispatcher; `any_refused_lent`
  // spares its every pass the lock.
  std::mutex refused_lent_mutex;
  std::vector<std::pair<StagingArea::LentRelease, Status>> refused_lent;
  std::atomic<bool> any_refused_lent{false};
  std::vector<StagingArea::LentRelease> lent_parked;  // dispatcher only
  void give_back(StagingArea::LentRelease lent) {
    const auto region = lent.region;
    auto held = std::make_shared<StagingArea::LentRelease>(std::move(lent));
    lent_returning.fetch_add(1);
    transport->deregister_region_then(region, [this, held](const Status& removed) {
      if (removed) {
        held->give_back();
      } else {
        std::lock_guard lock(refused_lent_mutex);
        refused_lent.emplace_back(std::move(*held), removed);
        any_refused_lent.store(true);
      }
      // The engine is idle only once its memory is back: wake wait_idle() if it waits
      // (it counts itself in idle_waiters before it reads lent_returning).
      if (lent_returning.fetch_sub(1) == 1 && idle_waiters.load() > 0) {
        std::lock_guard lock(inbox_mutex);
        progress_cv.notify_all();
      }
    });
  }
  void park_lent(StagingArea::LentRelease lent, const Status& why) {
    if (lent_parked.size() < kMaxLentParked) {
      lent_parked.push_back(std::move(lent));
      return;
    }
    log->warn("a lent source's registration could not be removed ({}); its memory is given back anyway",
              why.to_string());
    lent.give_back();
  }
  void retry_parked_lent() {
    if (any_refused_lent.exchange(false)) {
      std::lock_guard lock(refused_lent_mutex);
      for (auto& [lent, why] : refused_lent) park_lent(std::move(lent), why);
      refused_lent.clear();
    }
    auto parked_now = std::move(lent_parked);
    lent_parked.clear();
    for (auto& lent : parked_now) {
      if (Status s = transport->deregister_region(lent.region); !s) {
        park_lent(std::move(lent), s);
      } else {
        lent.give_back();
      }
    }
  }

  // ---- dispatcher

  void run() {
    std::unique_lock lock(inbox_mutex);
    while (true) {
      const auto wakeup = pushes.next_wakeup();
      auto wait_for = kIdleWakeup;
      if (wakeup) wait_for = std::min<Duration>(wait_for, std::max<Duration>(Duration{0}, *wakeup - clock->now()));
      inbox_cv.wait_for(lock, wait_for, [this] { return stopping || !inbox.empty(); });
      if (stopping && inbox.empty()) break;
      batch.swap(inbox);
      lock.unlock();
      const Progress before = progress();
      Actions actions;
      std::uint64_t submits = 0;
      for (auto& item : batch) {
        if (std::holds_alternative<SubmitCommand>(item)) ++submits;
        std::visit([&](auto& value) { handle(value, actions); }, item);
      }
      actions.append(pushes.tick());
      execute(std::move(actions));
      retry_parked_lent();
      update_parked();
      submits_queued.fetch_sub(submits, std::memory_order_acq_rel);  // started, parked or failed by now
      const std::size_t handled = batch.size();
      batch.clear();
      // A burst's buffer is not kept for ever.
      if (batch.capacity() > kKeptBatchCapacity) std::vector<InboxItem>().swap(batch);
      const bool settled = in_progress.fetch_sub(handled, std::memory_order_acq_rel) == handled;
      // A push that ended, or a submit that failed or merged: a submit from another
      // thread during the pass can hide the first from the sum.
      const Progress after = progress();
      const bool finished_some = after.ended > before.ended || after.in_flight < before.in_flight;
      lock.lock();
      if ((settled && idle_waiters.load() > 0) || (finished_some && below_waiters.load() > 0)) {
        progress_cv.notify_all();
      }
    }
  }

  // Confirmed topologies by base address. A copy of the client's cache, so the hot
  // path does not copy it per payload; forgotten (in both) when a shard fails, as a
  // restarted consumer has new data-plane addresses.
  const control::Topology* topology_of(const std::string& base) {
    if (auto it = topologies.find(base); it != topologies.end()) return &it->second;
    auto cached = client->cached_topology(base);
    if (!cached) return nullptr;
    return &(topologies[base] = std::move(*cached));
  }
  // A shard failed in a way that may mean the consumer restarted (new data-plane
  // addresses): discover it again in the background. The known topology stays in use
  // until the new one arrives, so pushes in flight are not failed for lack of it.
  void refresh_topology(const std::string& base) {
    if (!refreshing.insert(base).second) return;
    log->info("re-discovering consumer {} after a shard failure", base);
    client->forget_topology(base);
    std::weak_ptr<State> weak = weak_from_this();
    client->discover_async(base, config.control_timeout(), [weak, base](Result<control::Topology> topology) {
      if (auto s = weak.lock()) s->enqueue(TopologyRefresh{base, std::move(topology)});
    });
  }
  std::set<std::string> refreshing;
  std::map<std::string, control::Topology> topologies;

  // Moves `spec` into the push it starts; a push that cannot start leaves it whole.
  void start_push(PushSpec& spec, int shards, Actions& actions) {
    auto started = pushes.start(std::move(spec), shards);
    if (!started) {
      // PushManager::start moves from the spec only when it starts the push.
      add_failure(spec, started.status().message());  // NOLINT(bugprone-use-after-move)
      return;
    }
    actions.append(std::move(*started));
  }

  // When each content's first push was planned, for the source_wait stage. Bounded:
  // content whose output never comes is forgotten wholesale at the bound.
  // Its nodes are reused (2.3 allocations per item before).
  using PlannedAt = std::unordered_map<std::string, TimePoint>;
  PlannedAt planned_at;
  NodeStash<PlannedAt> planned_nodes;
  static constexpr std::size_t kMaxPlannedAt = 16384;

  void note_planned(const std::string& mm_hash, TimePoint at) {
    if (planned_at.size() >= kMaxPlannedAt) planned_at.clear();
    planned_nodes.insert(planned_at, mm_hash, at);  // the first plan's time stays
  }
  void note_bound(const std::string& mm_hash) {
    if (auto it = planned_at.find(mm_hash); it != planned_at.end()) {
      stages::record(stages::Stage::source_wait, clock->now() - it->second);
      planned_nodes.erase(planned_at, it);
    }
  }

  void handle(SubmitCommand& command, Actions& actions) {
    note_planned(command.spec.mm_hash, command.planned);
    const std::string base = command.spec.consumer_address;  // a copy: the spec is moved below
    if (const auto* topology = topology_of(base)) {
      start_push(command.spec, static_cast<int>(topology->shards.size()), actions);
      return;
    }
    if (awaiting_count >= kMaxAwaitingTopology) {
      add_failure(command.spec, "too many pushes waiting for consumer discovery");
      return;
    }
    auto& waiting = awaiting_topology[base];
    const bool first = waiting.empty();
    waiting.push_back(std::move(command.spec));
    ++awaiting_count;
    log->debug("push of transfer_id={} waits for the topology of {}", waiting.back().transfer_id, base);
    if (first) {
      std::weak_ptr<State> weak = weak_from_this();
      client->discover_async(base, config.control_timeout(), [weak, base](Result<control::Topology> topology) {
        if (auto s = weak.lock()) s->enqueue(TopologyResult{base, std::move(topology)});
      });
    }
  }

  void handle(TopologyRefresh& result, Actions&) {
    refreshing.erase(result.base);
    if (result.topology) topologies[result.base] = std::move(*result.topology);
  }

  void handle(TopologyResult& result, Actions& actions) {
    log->debug("topology of {}: {}", result.base,
               result.topology ? fmt::format("{} shard(s)", result.topology->shards.size())
                               : result.topology.status().to_string());
    auto it = awaiting_topology.find(result.base);
    if (it == awaiting_topology.end()) return;
    auto specs = std::move(it->second);
    awaiting_topology.erase(it);
    awaiting_count -= specs.size();
    std::set<std::string> hashes;
    for (auto& spec : specs) {
      hashes.insert(spec.mm_hash);
      if (result.topology) {
        topologies[result.base] = *result.topology;
        start_push(spec, static_cast<int>(result.topology->shards.size()), actions);
      } else {
        count(&EngineCounters::topology_failures);
        add_failure(spec, fmt::format("could not discover every shard of the consumer at {}: {}", result.base,
                                      result.topology.status().message()));
      }
    }
    for (const auto& hash : hashes) {
      auto [first, last] = deferred_binds.equal_range(hash);
      std::vector<BindCommand> binds;
      for (auto b = first; b != last; ++b) binds.push_back(b->second);
      deferred_binds.erase(first, last);
      for (auto& bind : binds) handle(bind, actions);
    }
  }

  bool awaiting_content(const std::string& mm_hash) const {
    for (const auto& [base, specs] : awaiting_topology) {
      for (const auto& spec : specs) {
        if (spec.mm_hash == mm_hash) return true;
      }
    }
    return false;
  }

  void handle(BindCommand& command, Actions& actions) {
    note_bound(command.mm_hash);
    if (awaiting_content(command.mm_hash)) {
      deferred_binds.emplace(command.mm_hash, command);
      return;
    }
    auto result = pushes.bind_source(command.mm_hash, command.source, command.nbytes);
    if (std::find(result.release_sources.begin(), result.release_sources.end(), command.source) !=
        result.release_sources.end()) {
      count(&EngineCounters::sources_unused);  // no push waited for this content
    }
    actions.append(std::move(result));
  }

  void handle(FinishedCommand& command, Actions& actions) {
    actions.append(pushes.cancel_requests(command.request_ids));
  }

  void handle(AbandonSourcelessCommand&, Actions& actions) { actions.append(pushes.cancel_sourceless()); }

  void handle(ReserveResult& result, Actions& actions) {
    if (!result.reply) refresh_topology(result.base);
    const ReserveReply answer = [&]() -> ReserveReply {
      if (!result.reply) return reply::Refused{result.reply.status()};
      auto body = control::reply_body<wire::ReserveBatchReply>(std::move(result.reply));
      if (!body) return reply::Refused{body.status()};
      if (body->items.empty()) return reply::Refused{protocol_error("reply lacks this item")};
      return to_reply(body->items.front());
    }();
    actions.append(pushes.on_reserve_reply(result.transfer_id, result.shard, answer));
  }

  void handle(PayloadResult& result, Actions& actions) {
    // Only a peer failure suggests a restarted consumer; a refused payload (the
    // consumer no longer wants it) or a deadline does not.
    if (result.status.code() == StatusCode::unavailable) refresh_topology(result.base);
    actions.append(pushes.on_payload_result(result.transfer_id, result.shard, result.status));
  }

  void handle(CancelResult& result, Actions& actions) {
    actions.append(pushes.on_cancel_result(result.transfer_id, result.shard, result.status));
  }

  // ---- one-sided writes (Mooncake). A submitted write cannot be cancelled, so until
  // it settles neither its source slot nor its remote slot may be given back: the
  // abandon cancel and the source release of its push wait here for it.
  struct Unsettled {
    SourceId source = 0;
    bool overdue = false;
  };
  std::map<std::pair<std::string, int>, Unsettled> unsettled;
  std::vector<CancelCommand> parked_cancels;
  std::vector<SourceId> parked_releases;

  bool source_unsettled(SourceId id) const {
    return std::any_of(unsettled.begin(), unsettled.end(), [id](const auto& u) { return u.second.source == id; });
  }

  void handle(WriteOverdue& overdue, Actions& actions) {
    auto it = unsettled.find({overdue.transfer_id, overdue.shard});
    if (it == unsettled.end()) return;
    it->second.overdue = true;
    // The push fails now; what it holds stays held until the write settles.
    actions.append(pushes.on_payload_result(
        overdue.transfer_id, overdue.shard,
        timeout_error("the Mooncake write did not finish by push_wait_timeout_s (its slot and source stay held until "
                      "it settles)")));
  }

  void handle(WriteSettled& settled, Actions& actions) {
    const auto& p = settled.payload;
    auto it = unsettled.find({p.transfer_id, p.shard});
    const bool overdue = it != unsettled.end() && it->second.overdue;
    if (it != unsettled.end()) unsettled.erase(it);
    // Whatever waited for this write may go now.
    for (auto c = parked_cancels.begin(); c != parked_cancels.end();) {
      if (unsettled.count({c->transfer_id, c->shard}) == 0) {
        actions.cancels.push_back(std::move(*c));
        c = parked_cancels.erase(c);
      } else {
        ++c;
      }
    }
    for (auto r = parked_releases.begin(); r != parked_releases.end();) {
      if (!source_unsettled(*r)) {
        actions.release_sources.push_back(*r);
        r = parked_releases.erase(r);
      } else {
        ++r;
      }
    }
    if (overdue) return;  // the push already failed
    if (!settled.status) {
      refresh_topology(p.consumer_address);
      actions.append(pushes.on_payload_result(p.transfer_id, p.shard, settled.status));
      return;
    }
    // The bytes are in place: tell the shard, naming the reservation written.
    const auto* shard = shard_endpoint(p.consumer_address, p.shard);
    if (shard == nullptr) {
      actions.append(pushes.on_payload_result(p.transfer_id, p.shard, unavailable("consumer topology is not known")));
      return;
    }
    std::optional<std::uint64_t> checksum;
    if (const auto source = staging->find(p.source)) checksum = checksum_for(shard->hello, p.source, *source);
    std::weak_ptr<State> weak = weak_from_this();
    client->call_async(
        shard->control, wire::CompleteRequest{p.transfer_id, p.reservation_id, p.generation, checksum},
        config.control_timeout(),
        [weak, base = p.consumer_address, tid = p.transfer_id, shard = p.shard](Result<wire::Reply> reply) {
          auto s = weak.lock();
          if (!s) return;
          auto body = control::reply_body<wire::CompleteReply>(std::move(reply));
          Status status = body ? (body->completed ? Status::ok()
                                                  : conflict("the shard did not accept the completion "
                                                             "(reservation cancelled or replaced)"))
                               : body.status();
          s->enqueue(PayloadResult{base, tid, shard, status});
        });
  }

  // The checksum a shard that verifies (it announces the checksum feature) needs; a
  // shard that does not gets none, and the payload is not hashed for it (one hashed
  // while staging is sent anyway).
  std::optional<std::uint64_t> checksum_for(const wire::HelloReply& hello, SourceId id,
                                            const StagingArea::Source& source) {
    if (source.checksum || !hello.has_feature(wire::kFeatureChecksum)) return source.checksum;
    return staging->checksum(id);
  }

  // Whether a consumer shard lands payloads the way this producer's data plane moves
  // them: one-sided writes need a shard that publishes its segment and pool base.
  Status landing_matches(const wire::HelloReply& hello) const {
    const bool shard_one_sided = hello.has_feature(wire::kFeatureOneSided);
    if (shard_one_sided == one_sided && (!one_sided || (!hello.data.segment.empty() && hello.data.base != 0))) {
      return Status::ok();
    }
    return invalid_argument(
        fmt::format("the consumer shard's data plane is '{}' ({} landing), this producer's is '{}' ({} landing)",
                    hello.data.transport, shard_one_sided ? "sender-chosen" : "receiver-chosen", transport->name(),
                    transport::landing_choice_name(transport->capabilities().landing)));
  }

  void write_one_sided(const PayloadCommand& p, const wire::DataPlane& data, const StagingArea::Source& source,
                       Actions& more) {
    auto endpoint = transport->connect(data.segment);
    if (!endpoint) {
      refresh_topology(p.consumer_address);
      more.append(pushes.on_payload_result(p.transfer_id, p.shard, endpoint.status()));
      return;
    }
    std::weak_ptr<State> weak = weak_from_this();
    const auto [region, offset] = staging->location(source, staging_region);
    const auto status = transport->write(
        *endpoint, region, offset, p.nbytes, data.base + p.slot_offset, clock->now() + config.push_wait_timeout(),
        [weak, p](Status result) {
          if (auto s = weak.lock()) s->enqueue(WriteSettled{p, std::move(result)});
        },
        [weak, tid = p.transfer_id, shard = p.shard] {
          if (auto s = weak.lock()) s->enqueue(WriteOverdue{tid, shard});
        });
    if (!status) {
      more.append(pushes.on_payload_result(p.transfer_id, p.shard, status));
      return;
    }
    unsettled[{p.transfer_id, p.shard}] = Unsettled{p.source, false};
  }

  // The shard's endpoints and hello, from the confirmed topology; null if unknown.
  const control::ShardEndpoint* shard_endpoint(const std::string& base, int shard) {
    const auto* topology = topology_of(base);
    if (topology == nullptr || shard < 0 || static_cast<std::size_t>(shard) >= topology->shards.size()) {
      return nullptr;
    }
    return &topology->shards[static_cast<std::size_t>(shard)];
  }

  void execute(Actions actions) {
    // Several loops: executing may produce more actions only through results that
    // come back later (through the inbox), never synchronously, except for refusals.
    while (!actions.empty()) {
      Actions more;
      execute_reserves(actions.reserves, more);
      execute_payloads(actions.payloads, more);
      execute_cancels(actions.cancels, more);
      for (auto id : actions.release_sources) {
        if (source_unsettled(id)) {
          parked_releases.push_back(id);  // a one-sided write still reads it
        } else {
          release_source(id);
        }
      }
      actions = std::move(more);
    }
  }

  // One reserve_batch per item: a shard holds a request none of whose items fits until
  // one does (reserve_hold_ms), then answers the whole request, so items batched
  // together came back as retry_after whenever only some fitted (about one per image in
  // `ecx demo`, 0 with one item per request, at the same wall time).
  void execute_reserves(const std::vector<ReserveCommand>& reserves, Actions& more) {
    for (const auto& r : reserves) {
      const auto* shard = shard_endpoint(r.consumer_address, r.shard);
      if (shard == nullptr) {
        more.append(pushes.on_reserve_reply(r.transfer_id, r.shard,
                                            reply::Refused{unavailable("consumer topology is not known")}));
        continue;
      }
      std::weak_ptr<State> weak = weak_from_this();
      client->call_async(shard->control,
                         wire::ReserveBatchRequest{{wire::ReserveItem{r.transfer_id, r.mm_hash, r.spec, std::nullopt}}},
                         config.control_timeout(),
                         [weak, base = r.consumer_address, tid = r.transfer_id, shard_index = r.shard,
                          sent = clock->now()](Result<wire::Reply> reply) mutable {
                           auto s = weak.lock();
                           if (!s) return;
                           if (reply) stages::record(stages::Stage::reserve, s->clock->now() - sent);
                           s->enqueue(ReserveResult{base, tid, shard_index, std::move(reply)});
                         });
    }
  }

  void execute_payloads(const std::vector<PayloadCommand>& payloads, Actions& more) {
    for (const auto& p : payloads) {
      const auto* shard = shard_endpoint(p.consumer_address, p.shard);
      if (shard == nullptr) {
        more.append(pushes.on_payload_result(p.transfer_id, p.shard, unavailable("consumer topology is not known")));
        continue;
      }
      const auto& hello = shard->hello;
      const auto& data = hello.data;
      const std::optional<StagingArea::Source> source = staging->find(p.source);
      if (!source) {
        more.append(pushes.on_payload_result(p.transfer_id, p.shard, internal_error("source is not staged")));
        continue;
      }
      if (auto matches = landing_matches(hello); !matches) {
        more.append(pushes.on_payload_result(p.transfer_id, p.shard, matches));
        continue;
      }
      if (one_sided) {
        write_one_sided(p, data, *source, more);
        continue;
      }
      auto endpoint = transport->connect(data.address);
      if (!endpoint) {
        refresh_topology(p.consumer_address);
        more.append(pushes.on_payload_result(p.transfer_id, p.shard, endpoint.status()));
        continue;
      }
      if (p.direct && !hello.has_feature(wire::kFeatureDirect)) {
        more.append(
            pushes.on_payload_result(p.transfer_id, p.shard, unavailable("the shard does not take direct payloads")));
        continue;
      }
      wire::PayloadHeader header{
          p.transfer_id, p.reservation_id, p.generation, p.nbytes, checksum_for(hello, p.source, *source),
          std::nullopt};
      if (p.direct) header.direct = wire::DirectItem{p.mm_hash, *p.spec};
      std::weak_ptr<State> weak = weak_from_this();
      // Called once: its ids move on into the result.
      auto on_sent = [weak, base = p.consumer_address, tid = p.transfer_id, shard = p.shard,
                      sent = clock->now()](const Status& result) mutable {
        auto s = weak.lock();
        if (!s) return;
        if (result) stages::record(stages::Stage::wire, s->clock->now() - sent);
        s->enqueue(PayloadResult{std::move(base), std::move(tid), shard, result});
      };
      const auto bytes = wire::encode_payload_header(header);
      const TimePoint deadline = clock->now() + config.push_wait_timeout();
      // A direct payload needs the shard's verdict: it may turn the payload away.
      const auto [region, offset] = staging->location(*source, staging_region);
      const auto status =
          p.direct ? transport->send_confirmed(*endpoint, bytes, region, offset, p.nbytes, deadline, std::move(on_sent))
                   : transport->send(*endpoint, bytes, region, offset, p.nbytes, deadline, std::move(on_sent));
      if (!status) more.append(pushes.on_payload_result(p.transfer_id, p.shard, status));
    }
  }

  void execute_cancels(const std::vector<CancelCommand>& cancels, Actions& more) {
    for (const auto& c : cancels) {
      if (unsettled.count({c.transfer_id, c.shard}) != 0) {
        parked_cancels.push_back(c);  // the slot may still be written: abandon it once the write settles
        continue;
      }
      const auto* shard = shard_endpoint(c.consumer_address, c.shard);
      if (shard == nullptr) {
        more.append(pushes.on_cancel_result(c.transfer_id, c.shard, unavailable("consumer topology is not known")));
        continue;
      }
      std::weak_ptr<State> weak = weak_from_this();
      client->call_async(
          shard->control, wire::CancelRequest{c.transfer_id, c.reservation_id, true, c.refresh},
          config.control_timeout(), [weak, tid = c.transfer_id, shard = c.shard](Result<wire::Reply> reply) {
            auto s = weak.lock();
            if (!s) return;
            auto body = control::reply_body<wire::CancelReply>(std::move(reply));
            Status status =
                body ? (body->cancelled ? Status::ok() : conflict("the shard did not cancel")) : body.status();
            s->enqueue(CancelResult{tid, shard, status});
          });
    }
  }
};

Result<std::unique_ptr<PushEngine>> PushEngine::start(const Config& config, std::shared_ptr<const Clock> clock) {
  auto state = std::make_shared<State>(config, clock ? std::move(clock) : SteadyClock::shared());
  auto created = transport::create_data_plane(config, state->clock, transport::DataPlaneRole::sender);
  if (!created) return Status(created.status().code(), "data plane: " + created.status().message());
  state->transport = std::move(*created);
  // Shared staging only where the data plane uses it: a memfd gets no huge pages.
  auto staging = StagingArea::create(config, state->clock, state->transport->capabilities().shared_sources);
  if (!staging) return staging.status();
  state->staging = std::move(*staging);
  state->one_sided = state->transport->capabilities().landing == transport::LandingChoice::sender;
  auto region = state->staging->shared_fd() >= 0
                    ? state->transport->register_shared_region(state->staging->base(), state->staging->capacity(),
                                                               transport::SharedBacking{state->staging->shared_fd(), 0})
                    : state->transport->register_region(state->staging->base(), state->staging->capacity(),
                                                        transport::MemoryKind::host);
  if (!region) return region.status();
  state->staging_region = *region;

  auto client_options = control::ClientOptions::from_config(config);
  client_options.clock = state->clock;
  client_options.name = "ecx-producer";
  auto client = control::ControlClient::create(std::move(client_options));
  if (!client) return client.status();
  state->client = std::move(*client);
  state->dispatcher = std::thread([raw = state.get()] {
    name_this_thread("ecx-push");
    raw->run();
  });
  state->log->info("producer ready: staging pool {} ({}), data plane {}", format_bytes(state->staging->capacity()),
                   pool::memory_kind_name(state->staging->memory_kind()), transport::describe_data_plane(config));
  return std::unique_ptr<PushEngine>(new PushEngine(std::move(state)));  // NOLINT: private constructor
}

PushEngine::PushEngine(std::shared_ptr<State> state) : state_(std::move(state)) {}

PushEngine::~PushEngine() { shutdown(seconds_to_duration(state_->config.shutdown_drain_timeout_s)); }

void PushEngine::submit(PushSpec spec) {
  bool wake = true;
  {
    std::lock_guard lock(state_->inbox_mutex);
    if (!state_->accepting) {
      state_->add_failure(spec, "the producer is shutting down");
      return;
    }
    // Asked while accepting holds: shutdown drops the control client only after it
    // cleared accepting under this lock. (The client never takes this lock while it
    // holds its topology lock.)
    wake = !state_->can_submit_quietly(spec);
  }
  state_->count(&EngineCounters::submitted);
  state_->submits_queued.fetch_add(1, std::memory_order_acq_rel);
  InboxItem command = SubmitCommand{std::move(spec), state_->clock->now()};
  if (!state_->enqueue_or_keep(command, wake)) {
    state_->submits_queued.fetch_sub(1, std::memory_order_acq_rel);
    state_->add_failure(std::get<SubmitCommand>(command).spec, "the producer's queue is full");
  }
}

Status PushEngine::bind_source(std::string_view mm_hash, const void* data, std::uint64_t nbytes, SourceMemory memory) {
  auto& s = *state_;
  if (nbytes == 0) return invalid_argument("an encoder output of 0 bytes cannot be pushed");
  auto staged = s.staging->stage(data, nbytes, memory);
  if (!staged) {
    s.count(&EngineCounters::staging_failures);
    s.log->warn("cannot stage mm_hash={}: {}", mm_hash, staged.status().message());
    return staged.status();
  }
  const SourceId id = *staged;
  s.count(&EngineCounters::sources_bound);
  s.count(&EngineCounters::bytes_staged, nbytes);
  if (!s.enqueue(BindCommand{std::string(mm_hash), id, nbytes})) {
    s.release_source(id);
    return resource_exhausted("the producer's queue is full");
  }
  return Status::ok();
}

Status PushEngine::lend_source(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                               std::function<void()> release) {
  auto& s = *state_;
  if (nbytes == 0) return invalid_argument("an encoder output of 0 bytes cannot be pushed");
  // Once one lent output was registered, the rest are not waited for: the data plane
  // maps each before the send that reads it (a round trip to its thread per output was
  // the engine's longest wait in this call). Until then each is registered waiting, so
  // a data plane that cannot register the engine's memory is seen here, and the output
  // is copied instead; a deferred registration that fails fails its sends, naming why.
  void* base = const_cast<void*>(data);  // NOLINT: only read
  const bool defer = s.lent_registration_works.load(std::memory_order_relaxed);
  auto region = defer ? s.transport->register_region_deferred(base, nbytes, transport::MemoryKind::host)
                      : s.transport->register_region(base, nbytes, transport::MemoryKind::host);
  if (region && !defer) s.lent_registration_works.store(true, std::memory_order_relaxed);
  if (!region) {
    // Still sent, from a copy: the engine has its memory back at once.
    s.log->debug("cannot register mm_hash={}'s output in place ({}); staging a copy", mm_hash,
                 region.status().message());
    Status staged = bind_source(mm_hash, data, nbytes, SourceMemory::host);
    if (release) release();
    return staged;
  }
  const SourceId id = s.staging->lend(data, nbytes, *region, std::move(release));
  s.count(&EngineCounters::sources_bound);
  s.count(&EngineCounters::sources_lent);
  if (!s.enqueue(BindCommand{std::string(mm_hash), id, nbytes})) {
    if (auto lent = s.staging->release(id)) {  // never sent: its registration goes at once
      (void)s.transport->deregister_region(lent->region);
      lent->give_back();
    }
    return resource_exhausted("the producer's queue is full");
  }
  return Status::ok();
}

void PushEngine::requests_finished(std::span<const std::string> request_ids) {
  if (request_ids.empty()) return;
  state_->enqueue(FinishedCommand{std::vector<std::string>(request_ids.begin(), request_ids.end())});
}

std::vector<FailedSave> PushEngine::drain_failures() {
  std::vector<FailedSave> out;
  {
    std::lock_guard lock(state_->failures_mutex);
    out.swap(state_->failures);
  }
  for (auto& f : state_->pushes.drain_failures()) out.push_back(std::move(f));
  return out;
}

bool PushEngine::pending() const {
  return state_->in_progress.load(std::memory_order_acquire) > 0 ||
         state_->parked.load(std::memory_order_acquire) > 0 || state_->lent_returning.load() > 0 ||
         state_->pushes.pending();
}

namespace {

// Waits (real time, at most `timeout`) on progress_cv until `done()`, counted in
// `waiters` (idle_waiters or below_waiters: the dispatcher wakes each kind only for
// what it waits for, see progress_cv); the bounded slices only re-check. Returns done()
// at the end.
template <typename Done>
bool wait_on_dispatcher(PushEngine::State& s, std::atomic<int>& waiters, Duration timeout, Done done) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock lock(s.inbox_mutex);
  waiters.fetch_add(1);
  // A submit enqueued without waking the dispatcher (can_submit_quietly) is taken now:
  // a waiter wants the pass it would otherwise get at the next bind or idle wake.
  if (!s.inbox.empty()) s.inbox_cv.notify_one();
  struct Leave {
    std::atomic<int>& waiters;
    ~Leave() { waiters.fetch_sub(1); }
  } leave{waiters};
  while (!done()) {
    if (s.progress_cv.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() + kIdleWakeup)) ==
            std::cv_status::timeout &&
        std::chrono::steady_clock::now() >= deadline) {
      return done();
    }
  }
  return true;
}

}  // namespace

bool PushEngine::wait_idle(Duration timeout) const {
  return wait_on_dispatcher(*state_, state_->idle_waiters, timeout, [this] { return !pending(); });
}

bool PushEngine::wait_active_below(std::uint64_t limit, Duration timeout) const {
  return wait_on_dispatcher(*state_, state_->below_waiters, timeout, [&] { return state_->in_flight() < limit; });
}

EngineCounters PushEngine::counters() const {
  EngineCounters c;
  {
    std::lock_guard lock(state_->counters_mutex);
    c = state_->engine_counters;
  }
  c.pushes = state_->pushes.counters();
  c.unstarted = state_->unstarted();
  c.staging_used_bytes = state_->staging->used_bytes();
  c.staging_capacity = state_->staging->capacity();
  return c;
}

std::uint64_t PushEngine::export_metrics(metrics::Registry& registry) const {
  std::weak_ptr<State> weak = state_;
  return registry.add_collector([weak](metrics::SampleSink& sink) {
    auto s = weak.lock();
    if (!s) return;
    const auto p = s->pushes.counters();
    auto counter = [&](std::string_view name, std::string_view help, std::string_view outcome, std::uint64_t v) {
      metrics::Labels labels;
      if (!outcome.empty()) labels.emplace_back("outcome", std::string(outcome));
      sink.counter(name, help, v, labels);
    };
    constexpr std::string_view kPushes = "Pushes by outcome";
    counter("producer_pushes_total", kPushes, "done", p.done);
    counter("producer_pushes_total", kPushes, "failed", p.failed);
    counter("producer_pushes_total", kPushes, "cancelled", p.cancelled);
    counter("producer_retry_afters_total", "Reserves answered with retry-after (consumer pool full)", "",
            p.retry_afters);
    counter("producer_payloads_total", "Payload sends by outcome", "ok", p.payloads_sent);
    counter("producer_payloads_total", "Payload sends by outcome", "failed", p.payloads_failed);
    constexpr std::string_view kDirect = "Direct payloads (sent without a reservation): sent, and turned away";
    counter("producer_direct_payloads_total", kDirect, "sent", p.direct_sent);
    counter("producer_direct_payloads_total", kDirect, "turned_away", p.direct_turned_away);
    if (const auto t = s->transport.stats()) {
      constexpr std::string_view kShared =
          "Payloads sent as their place in the shared staging pool (same-host consumer copies them out), and those "
          "a consumer could not map and was sent as bytes";
      counter("producer_shared_payloads_total", kShared, "sent", t->shared_sends);
      counter("producer_shared_payloads_total", kShared, "fell_back", t->shared_fallbacks);
    }
    counter("producer_abandons_total", "Abandon cancels sent", "", p.abandons_sent);
    counter("producer_yields_total",
            "Reservations given back while a sibling shard of the same push waited for space (reserved again with it)",
            "", p.yields);
    sink.gauge("producer_active_pushes", "Pushes not yet terminal", p.active);
    sink.gauge(
        "producer_unstarted_pushes",
        "Pushes submitted and not started yet (queued for the dispatcher, or waiting for the consumer's topology)",
        s->unstarted());
    sink.gauge("producer_staging_used_bytes", "Staging pool bytes held", s->staging->used_bytes());
    EngineCounters engine;
    {
      std::lock_guard lock(s->counters_mutex);
      engine = s->engine_counters;
    }
    constexpr std::string_view kSources =
        "Encoder outputs bound: copied into the staging pool, or lent (zero_copy_saves)";
    counter("producer_sources_total", kSources, "staged", engine.sources_bound - engine.sources_lent);
    counter("producer_sources_total", kSources, "lent", engine.sources_lent);
  });
}

void PushEngine::shutdown(Duration timeout) {
  auto& s = *state_;
  {
    std::lock_guard lock(s.inbox_mutex);
    if (!s.accepting) return;
    s.accepting = false;
  }
  // One budget for the whole shutdown, so it ends within `timeout` whatever the
  // consumers do: three quarters for the pushes in flight, the rest for the abandon
  // cancels of what never got a source (so a live consumer frees those slots now,
  // not at the reservation TTL). A dead consumer answers neither; its leases expire.
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + timeout;
  if (!wait_idle(timeout * 3 / 4)) {
    s.log->warn(
        "producer shutdown: {} push(es) still in flight and {} push(es) or source(s) waiting for a consumer's topology "
        "after "
        "{:.2f} s; abandoning them",
        s.pushes.counters().active, s.parked.load(std::memory_order_acquire), duration_to_seconds(timeout * 3 / 4));
  }
  s.enqueue(AbandonSourcelessCommand{});
  const auto left = std::max<Duration>(
      Duration::zero(), std::chrono::duration_cast<Duration>(deadline - std::chrono::steady_clock::now()));
  if (!wait_idle(left)) {
    s.log->warn(
        "producer shutdown: {} push(es), sources or cancels unfinished after {:.2f} s; the consumers' "
        "reservation leases release what they hold",
        s.pushes.counters().active + s.parked.load(std::memory_order_acquire), duration_to_seconds(timeout));
  }
  {
    std::lock_guard lock(s.inbox_mutex);
    s.stopping = true;
  }
  s.inbox_cv.notify_all();
  s.progress_cv.notify_all();
  if (s.dispatcher.joinable()) s.dispatcher.join();
  s.client.reset();
  if (s.transport && s.staging_region.valid()) (void)s.transport->deregister_region(s.staging_region);
  s.transport.release();
  // The data plane is gone: nothing reads the engine's lent memory any more.
  auto lent = std::move(s.lent_parked);
  {
    std::lock_guard lock(s.refused_lent_mutex);
    for (auto& refused : s.refused_lent) lent.push_back(std::move(refused.first));
    s.refused_lent.clear();
  }
  for (auto& rest : s.staging->release_all_lent()) lent.push_back(std::move(rest));
  for (auto& l : lent) l.give_back();
}

}  // namespace ecx::producer
