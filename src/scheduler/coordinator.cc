#include "ecx/scheduler/coordinator.h"

#include <algorithm>
#include <exception>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ecx/core/ids.h"
#include "ecx/core/logging.h"
#include "ecx/core/metrics.h"
#include "scheduler/bounded_executor.h"

namespace ecx::scheduler {
namespace {

constexpr std::uint64_t kMaxUnresolvedWarnings = 5;  // then every 1000th

std::shared_ptr<spdlog::logger> logger() {
  static auto instance = ecx::log::get("scheduler");
  return instance;
}

std::string_view shorten(std::string_view id, std::size_t n = 64) { return id.substr(0, n); }

// Process-wide (ecx.metrics_snapshot(), Prometheus text): items whose push can no
// longer arrive on an engine that never fails requests through take_unavailable_requests.
metrics::Counter& unreachable_items(std::string_view outcome) {
  return metrics::Registry::global().counter(
      "scheduler_unreachable_items_total",
      "EC items whose push cannot arrive, on a vLLM that never polls take_unavailable_requests, by outcome",
      {{"outcome", std::string(outcome)}});
}

// Collaborator calls may be adapters over code that throws; nothing may escape
// an executor thread, so every call is converted into a value.
template <typename F>
auto call_safely(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    return internal_error(std::string("control call threw: ") + e.what());
  } catch (...) {
    return internal_error("control call threw a non-standard exception");
  }
}

}  // namespace

// Outcome of one remote cancel, written by an executor thread and read by the
// scheduler thread once `done` is set.
struct SchedulerCoordinator::CancelTicket {
  explicit CancelTicket(std::string id) : transfer_id(std::move(id)) {}
  const std::string transfer_id;
  Status status;
  bool cancelled = false;
  std::size_t shards = 0;
  std::atomic<bool> done{false};
};

CoordinatorOptions CoordinatorOptions::from_config(const Config& config, DType model_dtype,
                                                   std::int64_t model_hidden_width) {
  CoordinatorOptions o;
  o.is_producer = config.is_producer();
  o.is_consumer = config.is_consumer();
  o.control_address = config.control_address(0);
  o.push_wait_timeout = config.push_wait_timeout();
  o.table.reservation_ttl = config.reservation_ttl();
  o.table.tombstone_max = config.tombstone_max;
  o.table.resident_capacity_bytes = config.effective_resident_capacity();
  o.cross_encoder_cache = config.cross_encoder_cache;
  o.encoder_output_width = config.encoder_output_width > 0 ? config.encoder_output_width : model_hidden_width;
  o.encoder_dtype = model_dtype;
  o.max_tensor_bytes = config.effective_max_tensor_bytes();
  o.max_pending_shard_events = config.event_queue_max;
  o.max_notified_remembered = config.tombstone_max;
  return o;
}

SchedulerCoordinator::SchedulerCoordinator(CoordinatorOptions options, std::shared_ptr<const Clock> clock,
                                           std::shared_ptr<EventSource> events,
                                           std::shared_ptr<ConsumerControl> control)
    : options_(std::move(options)),
      clock_(clock ? std::move(clock) : SteadyClock::shared()),
      events_(std::move(events)),
      control_(std::move(control)),
      executor_(std::make_unique<BoundedExecutor>("ecx-scheduler-control", options_.control_threads,
                                                  options_.control_queue_max)),
      table_(options_.table) {
  if (options_.cancel_attempts < 1) options_.cancel_attempts = 1;
}

SchedulerCoordinator::~SchedulerCoordinator() { close(); }

void SchedulerCoordinator::close() {
  if (closed_) return;
  closed_ = true;
  std::size_t running = 0;
  for (const auto& t : pending_cancels_) running += t->done.load(std::memory_order_acquire) ? 0 : 1;
  // Closing the control collaborator before the join ends the calls in flight at
  // once (as cancelled): shutdown never waits out a control deadline on a shard
  // that is gone or does not answer.
  const std::size_t dropped = executor_->close([this] {
    if (control_) control_->close();
  });
  std::size_t abandoned = 0;
  std::erase_if(pending_cancels_, [&](const std::shared_ptr<CancelTicket>& t) {
    if (!t->done.load(std::memory_order_acquire)) return true;  // its task was dropped: counted in `dropped`
    if (t->status) {
      ++stats_.cancels_succeeded;
    } else {
      ++abandoned;
    }
    return true;
  });
  stats_.cancels_dropped += dropped;
  stats_.cancels_abandoned += abandoned;
  if (dropped > 0 || abandoned > 0) {
    logger()->warn(
        "EC scheduler closing: {} queued reservation cancels were not sent and {} of {} in flight were abandoned; "
        "the consumers' leases (reservation_ttl_s) expire them",
        dropped, abandoned, running);
  }
  if (events_) events_->close();
}

bool SchedulerCoordinator::has_pending_push_work() const noexcept {
  if (closed_) return false;
  if (pending_saves_) return true;
  if (!options_.asynchronous_loads) return false;
  return std::any_of(gate_loads_.begin(), gate_loads_.end(),
                     [this](const std::string& h) { return table_.has_state(h, {TransferState::loading}); });
}

// ---------------------------------------------------------------- draining

void SchedulerCoordinator::drain(TimePoint now) {
  if (!drain_pending_ && now - drained_at_ < options_.drain_min_interval) return;
  drain_pending_ = false;
  drained_at_ = now;
  ++stats_.drains;
  poll_pending_cancels();
  // Events before deadlines: a readiness that reached the inbox while this engine was
  // busy must not lose to a push-wait deadline that passed in the meantime.
  if (events_ && !closed_) {
    event_buffer_.clear();
    events_->drain(event_buffer_, options_.max_events_per_drain);
    for (const auto& event : event_buffer_) accept_event(event, now);
  }
  cancel_buffer_.clear();
  table_.expire(now, cancel_buffer_);
  for (const auto& id : cancel_buffer_) queue_cancel(id, now);
}

void SchedulerCoordinator::accept_event(const TransferEvent& event, TimePoint now) {
  ++stats_.events_received;
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

bool SchedulerCoordinator::note_shard_ready(const TransferEvent& event, TimePoint now) {
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

void SchedulerCoordinator::forget_shard_readiness(std::string_view transfer_id) {
  auto it = pending_shards_index_.find(transfer_id);
  if (it == pending_shards_index_.end()) return;
  pending_shards_.erase(it->second);
  pending_shards_index_.erase(it);
}

// ---------------------------------------------------------------- remote cancels

void SchedulerCoordinator::queue_cancel(std::string_view transfer_id, TimePoint now, std::string_view mm_hash,
                                        std::string_view request_id) {
  if (!table_.cancel(transfer_id, now, mm_hash, request_id)) return;
  forget_shard_readiness(transfer_id);
  const TransferRecord* r = table_.find(transfer_id);
  if ((r && r->invented_name()) || !control_ || options_.control_address.empty()) {
    ++stats_.cancels_local_only;
    return;
  }
  auto ticket = std::make_shared<CancelTicket>(std::string(transfer_id));
  auto task = [control = control_, base = options_.control_address, attempts = options_.cancel_attempts, ticket] {
    // Confirm the topology first: a cancel sent to the base address alone would
    // leave every other shard's reservation pinned.
    Result<std::vector<std::string>> shards = unavailable("not attempted");
    for (int a = 0; a < attempts; ++a) {
      shards = call_safely([&] { return control->discover_shards(base); });
      if (shards && !shards->empty()) break;
    }
    if (!shards || shards->empty()) {
      ticket->status = unavailable(fmt::format("could not discover every EC consumer shard at {}: {}", base,
                                               shards ? std::string("no shards reported") : shards.status().message()));
      ticket->done.store(true, std::memory_order_release);
      return;
    }
    ticket->shards = shards->size();
    std::vector<std::string> pending = std::move(*shards);
    Status first_error;
    for (int round = 0; round < attempts && !pending.empty(); ++round) {
      std::vector<std::string> failed;
      for (const auto& addr : pending) {
        Result<bool> reply = call_safely([&] { return control->cancel(addr, ticket->transfer_id); });
        if (!reply) {
          if (first_error) first_error = reply.status();
          failed.push_back(addr);
        } else {
          ticket->cancelled |= *reply;
        }
      }
      pending = std::move(failed);  // the next round retries only the shards that failed
    }
    ticket->status = pending.empty() ? Status::ok() : first_error;
    ticket->done.store(true, std::memory_order_release);
  };
  if (closed_ || !executor_->try_submit(std::move(task))) {
    ++stats_.cancels_dropped;
    logger()->warn("EC reservation cancel for transfer_id={} not queued ({}); the consumer's lease will expire it",
                   shorten(transfer_id), closed_ ? "closed" : "executor queue full");
    return;
  }
  ++stats_.cancels_queued;
  pending_cancels_.push_back(std::move(ticket));
}

void SchedulerCoordinator::poll_pending_cancels() {
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

// ---------------------------------------------------------------- helpers

std::string SchedulerCoordinator::fallback_id(const RequestView& request, std::size_t index) {
  return fmt::format("{}:{}", request.request_id, index);
}

void SchedulerCoordinator::warn_unresolved(const RequestView& request, std::size_t index, std::string_view where) {
  ++stats_.unresolved_transfer_ids;
  const std::uint64_t count = ++unresolved_warnings_;
  if (count > kMaxUnresolvedWarnings && count % 1000 != 0) return;
  // A caller that cannot resolve a transfer id falls back to a name the other
  // side does not know, so the two stop agreeing: reservations are never
  // released and surface minutes later as a full pool. Say it loudly.
  const auto* params = request.ec_transfer_params ? &*request.ec_transfer_params : nullptr;
  std::vector<std::string> hashes;
  if (params) {
    for (std::size_t i = 0; i < params->items.size() && i < 4; ++i) {
      hashes.push_back(params->items[i].mm_hash ? std::string(shorten(*params->items[i].mm_hash, 16)) : "None");
    }
  }
  logger()->warn(
      "EC could not resolve a transfer id at {} for req={} index={}: feature identifier={} does not match any of the "
      "{} ec_items {} (ec_transfer_params present={}). Occurrence {}. ec_items[].mm_hash must echo an engine-reported "
      "identifier, or be omitted so the entry is matched by position.",
      where, shorten(request.request_id), index, shorten(request.mm_features[index].identifier, 16),
      params ? params->items.size() : 0, hashes, params != nullptr, count);
}

void SchedulerCoordinator::mark_request_unavailable(std::string_view request_id) {
  malformed_pending_.emplace(request_id);
}

void SchedulerCoordinator::note_borrow(const TransferRecord& used, std::string_view own_transfer_id, TimePoint now) {
  // A resident copy is shared by design (its request finished); an invented name
  // belongs to no other request.
  if (used.transfer_id() == own_transfer_id || used.invented_name() || (used.spec() && used.spec()->local) ||
      released_own_.contains(used.transfer_id())) {
    return;
  }
  if (auto substitute = substitute_for_lender_.find(own_transfer_id);
      substitute != substitute_for_lender_.end() && substitute->second.transfer_id == used.transfer_id()) {
    forget_substitute(own_transfer_id);  // the lender now uses what it was owed
    return;
  }
  if (substitute_for_lender_.contains(used.transfer_id()) || lender_of_substitute_.contains(own_transfer_id)) return;
  logger()->debug(
      "EC transfer_id={} serves a request that named transfer_id={}; the latter is kept for the former's "
      "request",
      shorten(used.transfer_id()), shorten(own_transfer_id));
  substitute_for_lender_.emplace(used.transfer_id(), Substitute{std::string(own_transfer_id), now});
  lender_of_substitute_.emplace(own_transfer_id, used.transfer_id());
  substitute_order_.emplace_back(now, used.transfer_id());
  while (substitute_order_.size() > options_.max_notified_remembered) forget_oldest_substitute();
}

void SchedulerCoordinator::expire_substitutes(TimePoint now) {
  while (!substitute_order_.empty() && substitute_order_.front().first + options_.table.reservation_ttl <= now) {
    forget_oldest_substitute();
  }
}

void SchedulerCoordinator::forget_oldest_substitute() {
  const auto& [since, lender_id] = substitute_order_.front();
  // (An entry of a substitute forgotten meanwhile, or of a newer one for the same lender, is skipped.)
  if (auto it = substitute_for_lender_.find(lender_id); it != substitute_for_lender_.end() && it->second.since == since)
    forget_substitute(lender_id);
  substitute_order_.pop_front();
}

void SchedulerCoordinator::count_on_copy(const std::string& request_id, const std::string& mm_hash) {
  auto& hashes = copies_counted_on_[request_id];
  if (std::find(hashes.begin(), hashes.end(), mm_hash) != hashes.end()) return;
  hashes.push_back(mm_hash);
  ++copy_counts_[mm_hash];
}

void SchedulerCoordinator::stop_counting_on_copy(const std::string& mm_hash) {
  auto it = copy_counts_.find(mm_hash);
  if (it != copy_counts_.end() && --it->second == 0) copy_counts_.erase(it);
}

void SchedulerCoordinator::forget_substitute(std::string_view lender_id) {
  auto it = substitute_for_lender_.find(lender_id);
  if (it == substitute_for_lender_.end()) return;
  if (auto back = lender_of_substitute_.find(it->second.transfer_id); back != lender_of_substitute_.end()) {
    lender_of_substitute_.erase(back);
  }
  substitute_for_lender_.erase(it);
}

void SchedulerCoordinator::finish_substitute_side(std::string_view lender_id, bool lender, TimePoint now,
                                                  std::string_view mm_hash) {
  auto it = substitute_for_lender_.find(lender_id);
  if (it == substitute_for_lender_.end()) return;
  (lender ? it->second.lender_done : it->second.borrower_done) = true;
  if (!it->second.lender_done || !it->second.borrower_done) return;
  const std::string substitute_id = it->second.transfer_id;
  forget_substitute(lender_id);
  queue_cancel(substitute_id, now, mm_hash);
}

bool SchedulerCoordinator::report_malformed(const RequestView& request) {
  if (!request.has_malformed_params()) return false;
  if (!notified_.contains(request.request_id) && !malformed_pending_.contains(request.request_id)) {
    ++stats_.malformed_requests;
    logger()->warn(
        "EC request {} carries malformed ec_transfer_params ({}); failing it with a retryable error where vLLM polls "
        "take_unavailable_requests, else its items are encoded locally",
        shorten(request.request_id), request.ec_transfer_params_error);
    mark_request_unavailable(request.request_id);
  }
  return true;
}

Result<TensorSpec> SchedulerCoordinator::output_spec(const MmFeature& feature) const {
  if (feature.output_spec) return *feature.output_spec;
  if (options_.encoder_output_width <= 0) {
    return invalid_argument("the encoder output width is unknown (set encoder_output_width)");
  }
  return TensorSpec::make({feature.num_encoder_embeds, options_.encoder_output_width}, options_.encoder_dtype,
                          options_.max_tensor_bytes);
}

// ---------------------------------------------------------------- producer

void SchedulerCoordinator::prepare_push(const RequestView& request, std::size_t index) {
  const EcTransferParams* params = request.ec_transfer_params ? &*request.ec_transfer_params : nullptr;
  const MmFeature& feature = request.mm_features[index];
  const bool has_consumer = params && !params->consumer_zmq.empty();
  std::string transfer_id;
  if (auto resolved = resolve_transfer_id(params, index, feature.identifier)) {
    transfer_id = std::string(*resolved);
  } else {
    // Still push: once the proxy rewrote the item into embeds the consumer has no
    // media to fall back on. But the consumer cannot cancel this invented name.
    if (has_consumer) warn_unresolved(request, index, "push prepare");
    transfer_id = fallback_id(request, index);
  }
  if (!has_consumer) return;
  auto& mine = bindings_by_request_[request.request_id];
  if (std::find(mine.begin(), mine.end(), transfer_id) != mine.end()) return;  // planned once per transfer
  if (auto it = push_bindings_.find(transfer_id); it != push_bindings_.end()) {
    if (it->second.mm_hash != feature.identifier || it->second.consumer_zmq != params->consumer_zmq) {
      // Another payload or destination under the same name: drop the newcomer.
      ++stats_.push_conflicts;
      logger()->warn(
          "EC transfer_id={} is already planned for mm_hash={} to {}; refusing mm_hash={} to {} for request {}",
          shorten(transfer_id), shorten(it->second.mm_hash), it->second.consumer_zmq, shorten(feature.identifier),
          params->consumer_zmq, shorten(request.request_id));
      mark_request_unavailable(request.request_id);
      return;
    }
    ++it->second.requests;  // the same encoding named twice: one push serves both
    mine.push_back(transfer_id);
    return;
  }
  auto spec = output_spec(feature);
  if (!spec) {
    logger()->warn("EC cannot plan the push of mm_hash={} for request {}: {}", shorten(feature.identifier),
                   shorten(request.request_id), spec.status().message());
    mark_request_unavailable(request.request_id);
    return;
  }
  pushes_.push_back(PushSpec{feature.identifier, *spec, params->consumer_zmq, transfer_id, request.request_id});
  push_bindings_.emplace(transfer_id, PushBinding{feature.identifier, params->consumer_zmq, 1});
  mine.push_back(transfer_id);
  ++stats_.pushes_planned;
}

// ---------------------------------------------------------------- hooks

bool SchedulerCoordinator::has_cache_item(std::string_view identifier) {
  if (!options_.is_consumer) return false;
  drain(clock_->now());
  const bool have =
      table_.has_state(identifier, {TransferState::ready, TransferState::resident, TransferState::available});
  if (have) claimed_this_step_.emplace(identifier);
  return have;
}

void SchedulerCoordinator::note_awaiting_push(std::string_view mm_hash, std::string_view waiting_id, bool invented,
                                              std::string_view request_id, TimePoint now) {
  const TransferRecord* r =
      table_.wait_for_event(waiting_id, request_id, mm_hash, now, now + options_.push_wait_timeout, invented);
  if (r == nullptr || r->state() != TransferState::waiting_event || !r->deadline() || now < *r->deadline()) return;
  const double waited = duration_to_seconds(now - *r->deadline() + options_.push_wait_timeout);
  table_.mark_unavailable(waiting_id, now);
  logger()->warn(
      "EC waited {:.1f}s for a push of mm_hash={} (transfer_id={}) that never arrived; requests needing it fail with "
      "a retryable error.",
      waited, shorten(mm_hash), shorten(waiting_id));
}

bool SchedulerCoordinator::ensure_cache_available(const RequestView& request, std::int64_t num_computed_tokens) {
  if (report_malformed(request)) return !options_.unavailable_reaches_engine && release_malformed(request);
  if (options_.is_producer) {
    for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
      if (!request.mm_features[i].computed_by(num_computed_tokens)) prepare_push(request, i);
    }
  }
  if (!options_.is_consumer) return true;
  // One timestamp for the whole decision, so the deadlines it hands out agree.
  const TimePoint now = clock_->now();
  drain(now);
  const EcTransferParams* params = request.ec_transfer_params ? &*request.ec_transfer_params : nullptr;
  bool all_ready = true;
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    const MmFeature& feature = request.mm_features[i];
    if (feature.computed_by(num_computed_tokens)) continue;
    const std::string& mm_hash = feature.identifier;
    const auto transfer_id = resolve_transfer_id(params, i, mm_hash);
    if (transfer_id) table_.touch_available(*transfer_id, now);
    // A local hit keeps the transfer: the hit is a snapshot, and the entry may be
    // evicted before the request runs.
    if (local_cache_.contains(mm_hash)) continue;
    if (const TransferRecord* ready = table_.oldest_in_state(mm_hash, TransferState::ready)) {
      // Another request's load serves this one too; its own transfer is owed to that request.
      if (transfer_id) note_borrow(*ready, *transfer_id, now);
      count_on_copy(request.request_id, mm_hash);
      continue;
    }
    if (table_.has_state(mm_hash, {TransferState::loading})) {
      count_on_copy(request.request_id, mm_hash);
      // Synchronous loads: dispatched in a step already planned, so the copy is in
      // the workers' caches before any later step runs.
      if (options_.asynchronous_loads) all_ready = false;
      continue;
    }
    if (!options_.asynchronous_loads &&
        table_.has_state(mm_hash, {TransferState::available, TransferState::resident})) {
      continue;  // landed: loaded in the step that allocates it (update_state_after_alloc)
    }
    if (const TransferRecord* used =
            table_.begin_load(mm_hash, transfer_id, request.request_id, now, now + options_.push_wait_timeout)) {
      if (transfer_id) note_borrow(*used, *transfer_id, now);
      gate_loads_.insert(mm_hash);
      count_on_copy(request.request_id, mm_hash);
      all_ready = false;
      continue;
    }
    if (!transfer_id && !params) continue;  // no transfer was ever announced for it: the engine encodes it
    if (!transfer_id) warn_unresolved(request, i, "load gate");
    std::string waiting_id = transfer_id ? std::string(*transfer_id) : fallback_id(request, i);
    // Another request used this one's delivery: wait for that request's own push instead.
    if (auto substitute = substitute_for_lender_.find(waiting_id); substitute != substitute_for_lender_.end()) {
      waiting_id = substitute->second.transfer_id;
    }
    note_awaiting_push(mm_hash, waiting_id, !transfer_id, request.request_id, now);
    if (!options_.unavailable_reaches_engine && release_unreachable(request, i, waiting_id)) continue;
    all_ready = false;
  }
  return all_ready;
}

bool SchedulerCoordinator::release_malformed(const RequestView& request) {
  // Malformed ec_transfer_params name no transfer ECX can use; without an engine that
  // fails the request, the engine encodes its items itself (or, without media, the
  // request is reported).
  const bool has_media = std::all_of(request.mm_features.begin(), request.mm_features.end(),
                                     [](const MmFeature& f) { return f.has_media; });
  if (!fallen_back_.insert(request.request_id + "\nmalformed", options_.max_notified_remembered)) return has_media;
  if (has_media) {
    stats_.local_fallbacks += request.mm_features.size();
    unreachable_items("encoded_locally").inc(request.mm_features.size());
    logger()->warn(
        "EC request {} with malformed ec_transfer_params is encoded locally: this vLLM never fails requests "
        "through take_unavailable_requests",
        shorten(request.request_id));
    return true;
  }
  stats_.stranded_items += request.mm_features.size();
  unreachable_items("stranded").inc(request.mm_features.size());
  logger()->error(
      "EC request {} with malformed ec_transfer_params carries no media to encode locally; this vLLM never "
      "fails requests through take_unavailable_requests, so it stays waiting: abort it",
      shorten(request.request_id));
  return false;
}

bool SchedulerCoordinator::release_unreachable(const RequestView& request, std::size_t index,
                                               std::string_view waiting_id) {
  const TransferRecord* r = table_.find(waiting_id);
  if (r == nullptr || !is_terminal(r->state())) return false;
  // The push can no longer arrive and the engine never asks which requests to fail:
  // holding the request would hold it for good.
  const MmFeature& feature = request.mm_features[index];
  const bool first =
      fallen_back_.insert(fmt::format("{}\n{}", request.request_id, index), options_.max_notified_remembered);
  if (feature.has_media) {
    if (first) {
      ++stats_.local_fallbacks;
      unreachable_items("encoded_locally").inc();
      logger()->warn(
          "EC transfer_id={} for mm_hash={} of request {} cannot arrive ({}); this vLLM never fails requests through "
          "take_unavailable_requests, so the item is encoded locally",
          shorten(waiting_id), shorten(feature.identifier), shorten(request.request_id),
          transfer_state_name(r->state()));
    }
    return true;
  }
  if (first) {
    ++stats_.stranded_items;
    unreachable_items("stranded").inc();
    logger()->error(
        "EC transfer_id={} for mm_hash={} of request {} cannot arrive ({}) and the request carries no media to encode "
        "locally; this vLLM never fails requests through take_unavailable_requests, so it stays waiting: abort it",
        shorten(waiting_id), shorten(feature.identifier), shorten(request.request_id), transfer_state_name(r->state()));
  }
  return false;
}

void SchedulerCoordinator::update_state_after_alloc(const RequestView& request, std::size_t index) {
  if (index >= request.mm_features.size()) {
    logger()->error("EC update_state_after_alloc: index {} out of range for request {} ({} items)", index,
                    shorten(request.request_id), request.mm_features.size());
    return;
  }
  const MmFeature& feature = request.mm_features[index];
  local_cache_.insert(feature.identifier);
  if (options_.is_consumer) {
    allocated_this_step_.insert_or_assign(feature.identifier, request.request_id);
    // Asynchronous loads reach this too: a gate that passed on the engine's own copy
    // (a snapshot) finds the entry evicted by the time the engine allocates it.
    if (claimed_this_step_.contains(feature.identifier) &&
        !table_.has_state(feature.identifier, {TransferState::loading, TransferState::ready})) {
      load_at_alloc(request, index);
    }
  }
  if (auto it = copies_counted_on_.find(request.request_id); it != copies_counted_on_.end()) {
    if (std::erase(it->second, feature.identifier) != 0) stop_counting_on_copy(feature.identifier);
    if (it->second.empty()) copies_counted_on_.erase(it);
  }
  if (!options_.is_producer || request.has_malformed_params()) return;
  prepare_push(request, index);
  if (options_.cross_encoder_cache && feature.modality == "image") {
    if (auto spec = output_spec(feature)) {
      store_candidates_.emplace_back(request.request_id, StoreCandidate{feature.identifier, *spec});
    }
  }
}

void SchedulerCoordinator::load_at_alloc(const RequestView& request, std::size_t index) {
  // The engine allocated a landed item as an external load and runs it in this step:
  // its copy is dispatched with this step's plan.
  const TimePoint now = clock_->now();
  const EcTransferParams* params = request.ec_transfer_params ? &*request.ec_transfer_params : nullptr;
  const MmFeature& feature = request.mm_features[index];
  const auto transfer_id = resolve_transfer_id(params, index, feature.identifier);
  if (const TransferRecord* used = table_.begin_load(feature.identifier, transfer_id, request.request_id, now,
                                                     now + options_.push_wait_timeout)) {
    if (transfer_id) note_borrow(*used, *transfer_id, now);
    ++stats_.alloc_loads;
    return;
  }
  ++stats_.alloc_load_misses;
  logger()->error(
      "EC mm_hash={} of request {} was allocated as an external load but nothing is left to load; failing "
      "the request",
      shorten(feature.identifier), shorten(request.request_id));
  mark_request_unavailable(request.request_id);
}

void SchedulerCoordinator::update_state_after_free(const RequestView& request, std::size_t index) {
  if (!options_.is_consumer || index >= request.mm_features.size() || request.has_malformed_params()) return;
  const EcTransferParams* params = request.ec_transfer_params ? &*request.ec_transfer_params : nullptr;
  const MmFeature& feature = request.mm_features[index];
  auto transfer_id = resolve_transfer_id(params, index, feature.identifier);
  if (!transfer_id) {
    if (params) warn_unresolved(request, index, "encoder-cache free");
    return;
  }
  // Release now rather than at request end: a buffer held for the whole
  // generation pins a pool slot long after the embedding was used.
  const TimePoint now = clock_->now();
  release_own_transfer(std::string(*transfer_id), now, feature.identifier, request.request_id);
}

void SchedulerCoordinator::release_own_transfer(const std::string& transfer_id, TimePoint now, std::string_view mm_hash,
                                                std::string_view request_id) {
  released_own_.insert(transfer_id, options_.max_notified_remembered);
  // A transfer can be both: owed to the request whose delivery this one used (kept
  // until both are done), and the lender of its own substitute (owed to this request).
  if (auto lender = lender_of_substitute_.find(transfer_id); lender != lender_of_substitute_.end()) {
    const std::string lender_id = lender->second;
    finish_substitute_side(lender_id, /*lender=*/false, now, mm_hash);
  } else {
    queue_cancel(transfer_id, now, mm_hash, request_id);
  }
  finish_substitute_side(transfer_id, /*lender=*/true, now, mm_hash);
}

ConnectorMeta SchedulerCoordinator::build_connector_meta(const StepView& step) {
  const TimePoint now = clock_->now();
  ConnectorMeta meta;
  // ECX's copy in the workers' caches stays (the workers put back what they loaded;
  // the record stays READY) when the engine frees an entry that is still counted on:
  // - evicted and allocated again in this step: the engine drops evicted entries at
  //   the start of the step, before the connector loads;
  // - loaded for requests that have not run yet, freed because another request that
  //   used the same copy finished: it may be a waiting request's only copy (its own
  //   transfer may be the one that was loaded, and the pool's resident copy can be
  //   reclaimed before it runs).
  // (An entry the engine encoded itself is encoded again and needs nothing.)
  for (const auto& h : step.free_encoder_mm_hashes) {
    const bool allocated = allocated_this_step_.contains(h);
    if (!allocated) local_cache_.erase(h);
    if ((allocated || copy_counts_.contains(h)) && table_.has_state(h, {TransferState::ready})) {
      if (std::find(meta.retained.begin(), meta.retained.end(), h) == meta.retained.end()) meta.retained.push_back(h);
      continue;
    }
    table_.release_ready(h, now);
    meta.freed.push_back(h);
  }
  allocated_this_step_.clear();
  claimed_this_step_.clear();
  std::erase_if(gate_loads_, [&](const std::string& h) { return !table_.has_state(h, {TransferState::loading}); });
  for (auto& h : extra_freed_) {
    if (local_cache_.contains(h) || copy_counts_.contains(h)) continue;
    table_.release_ready(h, now);
    meta.freed.push_back(std::move(h));
  }
  extra_freed_.clear();
  for (auto& id : table_.drain_orphaned()) {
    queue_cancel(id, now);
    meta.orphan_cancels.push_back(std::move(id));
  }
  expire_substitutes(now);
  if (!store_candidates_.empty()) {
    const StringSet preempted(step.preempted_request_ids.begin(), step.preempted_request_ids.end());
    StringMap<std::size_t> position;
    for (auto& [request_id, candidate] : store_candidates_) {
      if (preempted.contains(request_id)) continue;
      if (auto it = position.find(candidate.mm_hash); it != position.end()) {
        meta.store_candidates[it->second] = std::move(candidate);
      } else {
        position.emplace(candidate.mm_hash, meta.store_candidates.size());
        meta.store_candidates.push_back(std::move(candidate));
      }
    }
    store_candidates_.clear();
  }
  meta.pushes = std::exchange(pushes_, {});
  meta.loads = table_.take_loads_to_dispatch();
  // Every load still LOADING has now been dispatched; an unowned one whose record
  // ended before it was (expired) will never be reported.
  std::erase_if(unowned_loads_, [&](const std::string& h) { return !table_.has_state(h, {TransferState::loading}); });
  poll_pending_cancels();
  drain_pending_ = true;
  return meta;
}

void SchedulerCoordinator::update_connector_output(const WorkerOutput& output) {
  const TimePoint now = clock_->now();
  for (const auto& h : output.loaded) {
    // A load nobody is left to use (its request finished, or its record expired
    // while the workers loaded) is freed from the workers' caches at the next step,
    // unless the engine or a waiting request holds the hash.
    const bool kept = table_.complete_load(h);
    if ((unowned_loads_.erase(h) != 0 || !kept) && !local_cache_.contains(h)) extra_freed_.push_back(h);
  }
  for (const auto& h : output.failed_loads) {
    table_.fail_load(h, now);
    unowned_loads_.erase(h);
  }
  for (const auto& h : output.reclaimed) table_.reclaim(h, now);
  pending_saves_ = output.pending_saves;
  failed_saves_.insert(output.failed_saves.begin(), output.failed_saves.end());
}

FinishedResult SchedulerCoordinator::request_finished(const RequestView& request) {
  const TimePoint now = clock_->now();
  FinishedResult result;
  const EcTransferParams* params = request.ec_transfer_params ? &*request.ec_transfer_params : nullptr;
  if (options_.is_consumer) {
    std::vector<std::string_view> handled;
    for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
      const MmFeature& feature = request.mm_features[i];
      auto transfer_id = resolve_transfer_id(params, i, feature.identifier);
      if (!transfer_id) {
        table_.withdraw(fallback_id(request, i), request.request_id);
        if (params) warn_unresolved(request, i, "request finish");
        continue;
      }
      handled.push_back(*transfer_id);
      release_own_transfer(std::string(*transfer_id), now, feature.identifier, request.request_id);
    }
    // Bindings that match no feature still name a reservation some shard may hold.
    if (params) {
      for (const auto& item : params->items) {
        if (!item.transfer_id || std::find(handled.begin(), handled.end(), *item.transfer_id) != handled.end())
          continue;
        handled.push_back(*item.transfer_id);
        queue_cancel(*item.transfer_id, now, item.mm_hash.value_or(std::string()), request.request_id);
      }
    }
    // Copies this request counted on but never allocated would otherwise stay in the
    // workers' encoder caches for good, unless the engine or another waiting request
    // holds on to them.
    if (auto it = copies_counted_on_.find(request.request_id); it != copies_counted_on_.end()) {
      for (auto& h : it->second) {
        stop_counting_on_copy(h);
        if (local_cache_.contains(h) || copy_counts_.contains(h)) continue;
        if (table_.has_state(h, {TransferState::ready})) {
          extra_freed_.push_back(h);
        } else if (table_.has_state(h, {TransferState::loading})) {
          unowned_loads_.insert(h);
        }
      }
      copies_counted_on_.erase(it);
    }
    table_.forget_pending_request(request.request_id);
  }
  malformed_pending_.erase(request.request_id);
  if (!options_.is_producer || request.mm_features.empty()) {
    bindings_by_request_.erase(request.request_id);
    return result;
  }
  nlohmann::json params_out = nlohmann::json::object();
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    const MmFeature& feature = request.mm_features[i];
    auto& entry = params_out[feature.identifier];
    entry["item_indices"].push_back(i);
    if (auto transfer_id = resolve_transfer_id(params, i, feature.identifier)) entry["transfer_id"] = *transfer_id;
  }
  if (auto it = bindings_by_request_.find(request.request_id); it != bindings_by_request_.end()) {
    nlohmann::json items = nlohmann::json::array();
    for (const auto& transfer_id : it->second) {
      auto binding = push_bindings_.find(transfer_id);
      if (binding == push_bindings_.end()) continue;
      items.push_back({{"mm_hash", binding->second.mm_hash}, {"transfer_id", transfer_id}});
      if (--binding->second.requests == 0) push_bindings_.erase(binding);
    }
    bindings_by_request_.erase(it);
    if (!items.empty()) params_out["ec_items"] = std::move(items);
  }
  result.params = std::move(params_out);
  return result;
}

std::vector<std::string> SchedulerCoordinator::take_unavailable_requests() {
  std::vector<std::string> candidates = table_.take_unavailable_requests();
  candidates.insert(candidates.end(), failed_saves_.begin(), failed_saves_.end());
  candidates.insert(candidates.end(), malformed_pending_.begin(), malformed_pending_.end());
  failed_saves_.clear();
  malformed_pending_.clear();
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  std::vector<std::string> out;
  for (auto& id : candidates) {
    if (!notified_.insert(id, options_.max_notified_remembered)) continue;  // each request is failed once
    out.push_back(std::move(id));
  }
  return out;
}

}  // namespace ecx::scheduler
