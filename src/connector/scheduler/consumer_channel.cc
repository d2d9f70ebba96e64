#include "connector/scheduler/consumer_channel.h"

#include <algorithm>
#include <exception>
#include <iterator>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "connector/scheduler/bounded_executor.h"
#include "ecx/core/ids.h"

namespace ecx::scheduler {
namespace {

// The exception being handled, as a value (call it inside a catch block).
Status thrown_as_status() {
  try {
    throw;
  } catch (const std::exception& e) {
    return internal_error(std::string("control call threw: ") + e.what());
  } catch (...) {
    return internal_error("control call threw a non-standard exception");
  }
}

// Collaborator calls may be adapters over code that throws; nothing may escape
// an executor thread, so every call is converted into a value.
template <typename F>
auto call_safely(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (...) {
    return thrown_as_status();
  }
}

// The shards of the consumer whose first shard is `base`, confirmed by a discovery
// (`attempts` tries): never a guess such as the base address alone.
Result<std::vector<std::string>> confirmed_shards(ConsumerControl& control, const std::string& base, int attempts) {
  Result<std::vector<std::string>> shards = unavailable("not attempted");
  for (int a = 0; a < attempts; ++a) {
    shards = call_safely([&] { return control.discover_shards(base); });
    if (shards && !shards->empty()) return shards;
  }
  return unavailable(fmt::format("could not discover every EC consumer shard at {}: {}", base,
                                 shards ? std::string("no shards reported") : shards.status().message()));
}

using detail::shorten;
std::shared_ptr<spdlog::logger> logger() { return detail::coordinator_logger(); }

}  // namespace

// Outcome of one remote cancel, written by an executor thread and read by the
// scheduler thread once `done` is set.
struct ConsumerChannel::CancelTicket {
  explicit CancelTicket(std::string id) : transfer_id(std::move(id)) {}
  const std::string transfer_id;
  Status status;
  bool cancelled = false;
  std::size_t shards = 0;
  std::atomic<bool> done{false};
};

// Cancels waiting for the sender task. At most one sender runs: the first cancel
// goes out at once, and those queued while it is on the wire go together in its next
// frame (one round trip per shard for all of them), so batches grow with the load
// and a lone cancel never waits for company. Invariant: `waiting` is empty whenever
// `sending` is false.
struct ConsumerChannel::CancelQueue {
  std::mutex mutex;
  std::vector<std::shared_ptr<CancelTicket>> waiting;  // guarded by mutex
  bool sending = false;                                // a sender task is queued or running; guarded by mutex
  bool closing = false;  // the channel is closing: no further batch is sent; guarded by mutex
};

namespace {

// Sends one batch of cancels to every shard (each shard's failures retried up to
// `attempts` rounds) and completes the tickets. Runs on an executor thread.
template <typename Ticket>
void send_cancels(ConsumerControl& control, const std::string& base, int attempts,
                  const std::vector<std::shared_ptr<Ticket>>& batch) {
  const auto finish = [&batch](const std::vector<Status>& first_error, const std::vector<bool>& failing) {
    for (std::size_t k = 0; k < batch.size(); ++k) {
      batch[k]->status = failing[k] ? first_error[k] : Status::ok();
      batch[k]->done.store(true, std::memory_order_release);
    }
  };
  std::vector<Status> first_error(batch.size());
  std::vector<bool> failing(batch.size(), false);
  auto shards = confirmed_shards(control, base, attempts);
  if (!shards) {
    std::fill(first_error.begin(), first_error.end(), shards.status());
    std::fill(failing.begin(), failing.end(), true);
    finish(first_error, failing);
    return;
  }
  std::vector<std::vector<std::size_t>> todo(shards->size());  // per shard: tickets not cancelled there yet
  for (auto& t : todo) {
    t.resize(batch.size());
    for (std::size_t k = 0; k < batch.size(); ++k) t[k] = k;
  }
  for (int round = 0; round < attempts; ++round) {
    for (std::size_t s = 0; s < shards->size(); ++s) {
      if (todo[s].empty()) continue;
      std::vector<std::string> ids;
      ids.reserve(todo[s].size());
      for (std::size_t k : todo[s]) ids.push_back(batch[k]->transfer_id);
      std::vector<Result<bool>> answers;
      try {
        answers = control.cancel_many((*shards)[s], ids);
      } catch (...) {
        answers.assign(ids.size(), thrown_as_status());
      }
      if (answers.size() != ids.size()) {
        answers.assign(ids.size(), internal_error(fmt::format("the control collaborator answered {} of {} cancels",
                                                              answers.size(), ids.size())));
      }
      std::vector<std::size_t> failed;  // the next round retries only these
      for (std::size_t i = 0; i < ids.size(); ++i) {
        const std::size_t k = todo[s][i];
        if (!answers[i]) {
          if (first_error[k]) first_error[k] = answers[i].status();
          failed.push_back(k);
        } else {
          batch[k]->cancelled |= *answers[i];
        }
      }
      todo[s] = std::move(failed);
    }
  }
  for (const auto& t : todo) {
    for (std::size_t k : t) failing[k] = true;
  }
  for (auto& ticket : batch) ticket->shards = shards->size();
  finish(first_error, failing);
}

}  // namespace

// The sender task: one batch, then, when more waits, a fresh task behind whatever
// queued on the executor meanwhile (readiness rechecks), so that a steady stream of
// releases never holds an executor thread for good. The executor is the channel's,
// joined before it goes, so the pointer outlives every task.
struct ConsumerChannel::CancelSender {
  std::shared_ptr<CancelQueue> queue;
  std::shared_ptr<ConsumerControl> control;
  std::string base;
  int attempts = 1;
  BoundedExecutor* executor = nullptr;

  void operator()() const {
    for (;;) {
      std::vector<std::shared_ptr<CancelTicket>> batch;
      {
        std::lock_guard lock(queue->mutex);
        if (stops()) return;
        batch.swap(queue->waiting);
      }
      send_cancels(*control, base, attempts, batch);
      {
        std::lock_guard lock(queue->mutex);
        if (stops()) return;
      }
      if (executor->try_submit(*this)) return;  // goes on in a fresh task
      // The executor's queue is full (or closing, seen above next round): go on here.
    }
  }

  // Under queue->mutex: nothing left to send, or closing (what still waits then stays
  // unsent; close counts it). The next cancel queued starts a sender again.
  bool stops() const {
    if (!queue->waiting.empty() && !queue->closing) return false;
    queue->sending = false;
    return true;
  }
};

// What the shards answered about one long-waiting transfer, written by an executor
// thread and read by the scheduler thread once `done` is set.
struct ConsumerChannel::RecheckTicket {
  explicit RecheckTicket(std::string id) : transfer_id(std::move(id)) {}
  const std::string transfer_id;
  std::vector<TransferEvent> ready;  // one per shard that holds it ready
  std::size_t shards = 0;            // how many the discovery found
  Status status;                     // the first failure to ask
  std::atomic<bool> done{false};
};

ConsumerChannel::ConsumerChannel(const CoordinatorOptions& options, TransferTable& table,
                                 std::shared_ptr<EventSource> events, std::shared_ptr<ConsumerControl> control)
    : options_(options),
      table_(table),
      events_(std::move(events)),
      control_(std::move(control)),
      executor_(std::make_unique<BoundedExecutor>("ecx-scheduler-control", options_.control_threads,
                                                  options_.control_queue_max)),
      cancel_queue_(std::make_shared<CancelQueue>()) {}

ConsumerChannel::~ConsumerChannel() { close(); }

void ConsumerChannel::close() {
  if (closed_) return;
  closed_ = true;
  std::size_t running = 0;
  for (const auto& t : pending_cancels_) running += t->done.load(std::memory_order_acquire) ? 0 : 1;
  {
    std::lock_guard lock(cancel_queue_->mutex);
    cancel_queue_->closing = true;
  }
  // Closing the control collaborator before the join ends the calls in flight at
  // once (as cancelled): shutdown never waits out a control deadline on a shard
  // that is gone or does not answer.
  executor_->close([this] {
    if (control_) control_->close();
  });
  std::size_t abandoned = 0;
  std::size_t dropped = 0;
  std::erase_if(pending_cancels_, [&](const std::shared_ptr<CancelTicket>& t) {
    if (!t->done.load(std::memory_order_acquire)) {  // its sender task was dropped: never sent
      ++dropped;
      return true;
    }
    if (t->status) {
      ++stats_.cancels_succeeded;
    } else {
      ++abandoned;
    }
    return true;
  });
  stats_.cancels_dropped += dropped;
  stats_.cancels_abandoned += abandoned;
  pending_rechecks_.clear();  // answers nobody takes now; their tasks were dropped or ended
  if (dropped > 0 || abandoned > 0) {
    logger()->warn(
        "EC scheduler closing: {} queued reservation cancels were not sent and {} of {} in flight were abandoned; "
        "the consumers' leases (reservation_ttl_s) expire them",
        dropped, abandoned, running);
  }
  if (events_) events_->close();
}

// ---------------------------------------------------------------- draining

void ConsumerChannel::drain(TimePoint now) {
  if (!drain_pending_ && now - drained_at_ < options_.drain_min_interval) return;
  drain_pending_ = false;
  drained_at_ = now;
  ++stats_.drains;
  poll_pending_cancels();
  // Recheck answers are taken before the events and applied after them: an event a
  // shard published before it answered is then counted as the event it is, not as
  // readiness recovered by asking.
  auto answered = take_answered_rechecks();
  // Events before deadlines: a readiness that reached the inbox while this engine was
  // busy must not lose to a push-wait deadline that passed in the meantime.
  if (events_ && !closed_) {
    event_buffer_.clear();
    events_->drain(event_buffer_, options_.max_events_per_drain);
    for (const auto& event : event_buffer_) accept_event(event, now);
  }
  apply_rechecks(answered, now);
  start_rechecks(now);
  cancel_buffer_.clear();
  table_.expire(now, cancel_buffer_);
  for (const auto& id : cancel_buffer_) queue_cancel(id, now);
}

void ConsumerChannel::accept_event(const TransferEvent& event, TimePoint now) {
  ++stats_.events_received;
  apply_event(event, now);
}

void ConsumerChannel::apply_event(const TransferEvent& event, TimePoint now) {
  Status valid = validate_transfer_id(event.transfer_id);
  if (valid) valid = validate_mm_hash(event.mm_hash);
  if (valid && event.kind == TransferEvent::Kind::ready && !event.spec)
    valid = invalid_argument("ready without a spec");
  if (!valid) {
    // Events cross a socket: a malformed one costs that event, not the engine.
    ++stats_.events_malformed;
    logger()->warn("Discarding a malformed EC readiness event for transfer_id={}: {}", shorten(event.transfer_id),
                   valid.message());
    return;
  }
  switch (event.kind) {
    case TransferEvent::Kind::abandoned:
    case TransferEvent::Kind::failed: {
      const bool failed = event.kind == TransferEvent::Kind::failed;
      ++(failed ? stats_.failed_events : stats_.abandoned_events);
      forget_shard_readiness(event.transfer_id);
      if (table_.observe_abandoned(event.transfer_id, event.mm_hash, now)) {
        logger()->warn("EC transfer_id={} (mm_hash={}) {} by consumer shard {}{}{}; requests needing it fail now",
                       shorten(event.transfer_id), shorten(event.mm_hash), failed ? "failed" : "was abandoned",
                       event.shard, event.reason.empty() ? "" : ": ", event.reason);
      }
      return;
    }
    case TransferEvent::Kind::ready:
      break;
  }
  if (const TransferRecord* r = table_.find(event.transfer_id); r && is_terminal(r->state())) {
    ++stats_.ready_ignored;  // cancelled is terminal even if readiness was already queued
    return;
  }
  if (!note_shard_ready(event, now)) return;
  if (table_.observe_ready(LoadSpec{event.mm_hash, event.transfer_id, *event.spec, false}, now)) {
    ++stats_.ready_accepted;
  } else {
    ++stats_.ready_ignored;
  }
}

bool ConsumerChannel::note_shard_ready(const TransferEvent& event, TimePoint now) {
  const int shard_count = events_ ? events_->shard_count() : 1;
  if (shard_count <= 1) return true;
  if (const TransferRecord* r = table_.find(event.transfer_id); r && r->state() != TransferState::waiting_event) {
    ++stats_.ready_ignored;
    return false;
  }
  if (event.shard < 0) {
    // Untagged readiness cannot be told apart from a repeat of another shard's.
    ++stats_.events_malformed;
    logger()->warn("Discarding an untagged EC readiness event for transfer_id={} from a {}-shard consumer",
                   shorten(event.transfer_id), shard_count);
    return false;
  }
  auto it = pending_shards_index_.find(event.transfer_id);
  if (it == pending_shards_index_.end()) {
    pending_shards_.push_back(PendingShards{event.transfer_id, {}, *event.spec});
    it = pending_shards_index_.emplace(event.transfer_id, std::prev(pending_shards_.end())).first;
  } else {
    pending_shards_.splice(pending_shards_.end(), pending_shards_, it->second);  // most recent last
  }
  PendingShards& entry = *it->second;
  if (!(entry.spec == *event.spec)) {
    // Every rank receives an identical copy; shards that disagree mean the
    // transfer cannot be loaded consistently.
    logger()->warn("EC shards disagree on transfer_id={}: {} vs {}; failing it", shorten(event.transfer_id),
                   entry.spec.to_string(), event.spec->to_string());
    forget_shard_readiness(event.transfer_id);
    table_.observe_abandoned(event.transfer_id, event.mm_hash, now);
    return false;
  }
  if (std::find(entry.shards.begin(), entry.shards.end(), event.shard) == entry.shards.end()) {
    entry.shards.push_back(event.shard);
  }
  if (entry.shards.size() < static_cast<std::size_t>(shard_count)) {
    ++stats_.awaiting_shards;
    while (pending_shards_.size() > options_.max_pending_shard_events) {
      ++stats_.partial_dropped;
      pending_shards_index_.erase(pending_shards_.front().transfer_id);
      pending_shards_.pop_front();
    }
    return false;
  }
  forget_shard_readiness(event.transfer_id);
  return true;
}

void ConsumerChannel::forget_shard_readiness(std::string_view transfer_id) {
  auto it = pending_shards_index_.find(transfer_id);
  if (it == pending_shards_index_.end()) return;
  pending_shards_.erase(it->second);
  pending_shards_index_.erase(it);
}

// ---------------------------------------------------------------- readiness recheck

void ConsumerChannel::start_rechecks(TimePoint now) {
  if (!control_ || options_.control_address.empty() || closed_ || options_.readiness_recheck <= Duration::zero() ||
      now < next_recheck_scan_) {
    return;
  }
  next_recheck_scan_ = now + options_.readiness_recheck / 4;
  std::erase_if(rechecked_at_, [this](const auto& entry) {
    const TransferRecord* r = table_.find(entry.first);
    return r == nullptr || r->state() != TransferState::waiting_event;
  });
  // Oldest waits first (the waiting list is in deadline order, and every wait gets
  // the same timeout); the walk stops at the first that has not waited long enough.
  constexpr std::size_t kMaxVisits = 1024;  // per scan: a backlog is worked through over several
  std::size_t visits = 0;
  table_.for_each_waiting([&](const TransferRecord& r) {
    if (pending_rechecks_.size() >= options_.max_rechecks_in_flight || ++visits > kMaxVisits) return false;
    if (!r.deadline() || *r.deadline() - options_.push_wait_timeout > now - options_.readiness_recheck) return false;
    if (r.invented_name()) return true;  // no shard knows the name
    auto [at, fresh] = rechecked_at_.try_emplace(r.transfer_id(), now);
    if (!fresh) {
      if (now - at->second < options_.readiness_recheck) return true;
      at->second = now;
    }
    queue_recheck(r.transfer_id());
    return true;
  });
}

void ConsumerChannel::queue_recheck(const std::string& transfer_id) {
  auto ticket = std::make_shared<RecheckTicket>(transfer_id);
  auto task = [control = control_, base = options_.control_address, ticket] {
    auto shards = confirmed_shards(*control, base, 1);
    if (!shards) {
      ticket->status = shards.status();
      ticket->done.store(true, std::memory_order_release);
      return;
    }
    ticket->shards = shards->size();
    for (std::size_t i = 0; i < shards->size(); ++i) {
      auto held = call_safely([&] { return control->transfer_status((*shards)[i], ticket->transfer_id); });
      if (!held) {
        if (ticket->status) ticket->status = held.status();
        continue;
      }
      if (!held->found || held->state != "ready" || !held->spec) continue;
      TransferEvent event;
      event.kind = TransferEvent::Kind::ready;
      event.transfer_id = ticket->transfer_id;
      event.mm_hash = held->mm_hash;
      event.shard = static_cast<int>(i);  // discovery lists the shards by TP rank, the events' tag
      event.spec = held->spec;
      event.reservation_id = held->reservation_id;
      ticket->ready.push_back(std::move(event));
    }
    ticket->done.store(true, std::memory_order_release);
  };
  // A full executor is no loss: the transfer is asked about at a later scan.
  if (!executor_->try_submit(std::move(task))) return;
  ++stats_.readiness_rechecks;
  pending_rechecks_.push_back(std::move(ticket));
}

std::vector<std::shared_ptr<ConsumerChannel::RecheckTicket>> ConsumerChannel::take_answered_rechecks() {
  std::vector<std::shared_ptr<RecheckTicket>> answered;
  std::erase_if(pending_rechecks_, [&](std::shared_ptr<RecheckTicket>& t) {
    if (!t->done.load(std::memory_order_acquire)) return false;
    answered.push_back(std::move(t));
    return true;
  });
  return answered;
}

void ConsumerChannel::apply_rechecks(const std::vector<std::shared_ptr<RecheckTicket>>& answered, TimePoint now) {
  for (const auto& t : answered) {
    if (!t->status) {
      ++stats_.rechecks_failed;
      logger()->debug("EC readiness recheck of transfer_id={} incomplete: {}", shorten(t->transfer_id),
                      t->status.message());
    }
    // Readiness counts per shard: applied only against the topology the events come from.
    const int subscribed = events_ ? events_->shard_count() : 0;
    if (!t->ready.empty() && (subscribed <= 0 || t->shards != static_cast<std::size_t>(subscribed))) continue;
    for (const auto& event : t->ready) {
      const TransferRecord* r = table_.find(event.transfer_id);
      if (r == nullptr || r->state() != TransferState::waiting_event) break;  // its event came meanwhile
      auto partial = pending_shards_index_.find(event.transfer_id);
      const bool known = partial != pending_shards_index_.end() &&
                         std::find(partial->second->shards.begin(), partial->second->shards.end(), event.shard) !=
                             partial->second->shards.end();
      if (known) continue;
      const std::uint64_t recovered = ++stats_.readiness_recovered;
      // The first few, then every 1000th: under overload they come in bursts.
      if (recovered <= 5 || recovered % 1000 == 0) {
        logger()->warn(
            "EC transfer_id={} (mm_hash={}) was ready on consumer shard {} but its readiness event had not come after "
            "{:.1f}s (lost to a full event backlog, or queued behind one); learnt by asking the shard ({} so far)",
            shorten(event.transfer_id), shorten(event.mm_hash), event.shard,
            duration_to_seconds(options_.readiness_recheck), recovered);
      }
      apply_event(event, now);
    }
  }
}

// ---------------------------------------------------------------- remote cancels

void ConsumerChannel::queue_cancel(std::string_view transfer_id, TimePoint now, std::string_view mm_hash,
                                   std::string_view request_id) {
  if (table_.cancel(transfer_id, now, mm_hash, request_id)) cancel_on_shards(transfer_id);
}

void ConsumerChannel::cancel_orphan(std::string_view transfer_id, TimePoint now) {
  (void)table_.cancel(transfer_id, now);
  cancel_on_shards(transfer_id);
}

void ConsumerChannel::cancel_on_shards(std::string_view transfer_id) {
  forget_shard_readiness(transfer_id);
  const TransferRecord* r = table_.find(transfer_id);
  // A taken transfer is released by its lease, not by a cancel: its records went at
  // the take, and a cancel would cost a round trip and leave a tombstone on every
  // shard, one per item, crowding out those that guard against late reserves.
  if ((r && (r->invented_name() || r->taken())) || !control_ || options_.control_address.empty()) {
    ++stats_.cancels_local_only;
    return;
  }
  auto ticket = std::make_shared<CancelTicket>(std::string(transfer_id));
  const auto drop = [&](std::string_view why) {
    ++stats_.cancels_dropped;
    logger()->warn("EC reservation cancel for transfer_id={} not queued ({}); the consumer's lease will expire it",
                   shorten(transfer_id), why);
  };
  if (closed_) return drop("closed");
  bool start_sender = false;
  {
    std::lock_guard lock(cancel_queue_->mutex);
    // The same bound as the executor's queue, counted in cancels.
    if (cancel_queue_->waiting.size() >= options_.control_queue_max) {
      drop("cancel queue full");
      return;
    }
    cancel_queue_->waiting.push_back(ticket);
    start_sender = !std::exchange(cancel_queue_->sending, true);
  }
  if (start_sender) {
    // Confirm the topology first (send_cancels): a cancel sent to the base address
    // alone would leave every other shard's reservation pinned.
    CancelSender sender{cancel_queue_, control_, options_.control_address, options_.cancel_attempts, executor_.get()};
    if (!executor_->try_submit(std::move(sender))) {
      {
        std::lock_guard lock(cancel_queue_->mutex);
        cancel_queue_->waiting.clear();  // only this ticket: nothing sent since `sending` was false
        cancel_queue_->sending = false;
      }
      drop("executor queue full");
      return;
    }
  }
  ++stats_.cancels_queued;
  pending_cancels_.push_back(std::move(ticket));
}

void ConsumerChannel::poll_pending_cancels() {
  std::erase_if(pending_cancels_, [this](const std::shared_ptr<CancelTicket>& t) {
    if (!t->done.load(std::memory_order_acquire)) return false;
    if (t->status) {
      ++stats_.cancels_succeeded;
      logger()->debug("EC reservation cancel for transfer_id={} done on {} shards (cancelled={})",
                      shorten(t->transfer_id), t->shards, t->cancelled);
    } else {
      ++stats_.cancels_failed;
      logger()->warn("EC reservation cancellation failed for transfer_id={}: {}", shorten(t->transfer_id),
                     t->status.message());
    }
    return true;
  });
}

}  // namespace ecx::scheduler
