#include "connector/scheduler/consumer_gate.h"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "ecx/core/metrics.h"

namespace ecx::scheduler {
namespace {

using detail::fallback_id;
using detail::shorten;
std::shared_ptr<spdlog::logger> logger() { return detail::coordinator_logger(); }

// Process-wide (ecx.metrics_snapshot(), Prometheus text): items whose push can no
// longer arrive on an engine that never fails requests through take_unavailable_requests.
metrics::Counter& unreachable_items(std::string_view outcome) {
  return metrics::Registry::global().counter(
      "scheduler_unreachable_items_total",
      "EC items whose push cannot arrive, on a vLLM that never polls take_unavailable_requests, by outcome",
      {{"outcome", std::string(outcome)}});
}

}  // namespace

ConsumerGate::ConsumerGate(const CoordinatorOptions& options, std::shared_ptr<const Clock> clock,
                           std::shared_ptr<EventSource> events, std::shared_ptr<ConsumerControl> control,
                           RequestFailures& failures)
    : options_(options),
      clock_(clock ? std::move(clock) : SteadyClock::shared()),
      failures_(failures),
      table_(options_.table),
      channel_(options_, table_, std::move(events), std::move(control)) {}

bool ConsumerGate::loads_in_flight() const noexcept {
  if (!options_.asynchronous_loads) return false;
  return std::any_of(gate_loads_.begin(), gate_loads_.end(),
                     [this](const std::string& h) { return table_.has_state(h, {TransferState::loading}); });
}

SchedulerCoordinator::Bookkeeping ConsumerGate::bookkeeping() const noexcept {
  SchedulerCoordinator::Bookkeeping b;
  b.requests_counting_on_copies = copies_counted_on_.size();
  b.counted_on_copies = copy_counts_.size();
  b.unowned_loads = unowned_loads_.size();
  b.substitutes = substitute_for_lender_.size();
  b.engine_cache_entries = local_cache_.size();
  b.remembered_waits = waiting_.size();
  return b;
}

// ---------------------------------------------------------------- the gate

bool ConsumerGate::has_cache_item(std::string_view identifier) {
  if (!options_.is_consumer) return false;
  channel_.drain(clock_->now());
  const bool have =
      table_.has_state(identifier, {TransferState::ready, TransferState::resident, TransferState::available});
  if (have) detail::insert_once(claimed_this_step_, identifier);
  return have;
}

const TransferRecord* ConsumerGate::note_awaiting_push(std::string_view mm_hash, std::string_view waiting_id,
                                                       bool invented, std::string_view request_id, TimePoint now) {
  const TransferRecord* r =
      table_.wait_for_event(waiting_id, request_id, mm_hash, now, now + options_.push_wait_timeout, invented);
  if (r == nullptr || r->state() != TransferState::waiting_event || !r->deadline() || now < *r->deadline()) return r;
  const double waited = duration_to_seconds(now - *r->deadline() + options_.push_wait_timeout);
  table_.mark_unavailable(waiting_id, now);
  logger()->warn(
      "EC waited {:.1f}s for a push of mm_hash={} (transfer_id={}) that never arrived; requests needing it fail with "
      "a retryable error.",
      waited, shorten(mm_hash), shorten(waiting_id));
  return r;
}

bool ConsumerGate::admit(const RequestView& request, std::int64_t num_computed_tokens) {
  // One timestamp for the whole decision, so the deadlines it hands out agree.
  const TimePoint now = clock_->now();
  channel_.drain(now);
  if (still_waiting(request, num_computed_tokens, now)) {
    ++stats_.rechecks_remembered;
    return false;
  }
  const EcTransferParams* params = request.params();
  bool all_ready = true;
  // A "waiting" answer may be remembered only from a check whose changes the same check
  // would find already made (records created, waiters added, loads started): it would
  // then change nothing and answer the same while what it read stays the same. Every
  // wait must be a plain wait for a push under a deadline. A check that withdrew a
  // waiter (a borrow) or changed the substitutes is not such a check: the next one
  // could undo it. (remember_waiting adds one more condition.)
  bool rememberable = options_.remember_waiting;
  const std::uint64_t undoings_before = table_.undoings();
  const std::uint64_t substitutes_before = substitutes_changed_;
  TimePoint valid_until = TimePoint::max();
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
      if (transfer_id) note_borrow(*ready, *transfer_id, request.request_id, now);
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
      if (transfer_id) note_borrow(*used, *transfer_id, request.request_id, now);
      gate_loads_.insert(mm_hash);
      count_on_copy(request.request_id, mm_hash);
      all_ready = false;
      continue;
    }
    // No transfer was ever announced for it, or the proxy sent it to come from the
    // shared store: the engine encodes it unless the store gate claims it.
    if (!transfer_id && (!params || is_store_item(params, i, mm_hash))) continue;
    if (!transfer_id) failures_.warn_unresolved(request, i, "load gate");
    std::string waiting_id = transfer_id ? std::string(*transfer_id) : fallback_id(request, i);
    // Another request used this one's delivery: wait for that request's own push instead.
    if (auto substitute = substitute_for_lender_.find(waiting_id); substitute != substitute_for_lender_.end()) {
      waiting_id = substitute->second.transfer_id;
    }
    const TransferRecord* waited = note_awaiting_push(mm_hash, waiting_id, !transfer_id, request.request_id, now);
    if (waited != nullptr && waited->state() == TransferState::waiting_event && waited->deadline() &&
        waited->mm_hash() == mm_hash) {
      valid_until = std::min(valid_until, *waited->deadline());
    } else {
      rememberable = false;  // refused, ended, or under another hash's record: decided afresh each time
    }
    if (!options_.unavailable_reaches_engine && release_unreachable(request, i, waiting_id)) continue;
    all_ready = false;
  }
  rememberable = rememberable && table_.undoings() == undoings_before && substitutes_changed_ == substitutes_before;
  const bool remembered = !all_ready && rememberable && remember_waiting(request, num_computed_tokens, valid_until);
  if (!remembered && !waiting_.empty()) {
    if (auto it = waiting_.find(request.request_id); it != waiting_.end()) waiting_.erase(it);
  }
  return all_ready;
}

bool ConsumerGate::still_waiting(const RequestView& request, std::int64_t num_computed_tokens, TimePoint now) const {
  if (waiting_.empty()) return false;
  const auto it = waiting_.find(request.request_id);
  if (it == waiting_.end()) return false;
  const Waiting& w = it->second;
  if (now >= w.valid_until || w.num_computed_tokens != num_computed_tokens ||
      w.features != request.mm_features.size() || w.substitutes_changed != substitutes_changed_ ||
      w.asynchronous_loads != options_.asynchronous_loads ||
      w.unavailable_reaches_engine != options_.unavailable_reaches_engine) {
    return false;
  }
  const EcTransferParams* params = request.params();
  std::size_t k = 0;
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    const MmFeature& feature = request.mm_features[i];
    if (feature.computed_by(num_computed_tokens)) continue;
    if (k == w.items.size()) return false;
    const Waiting::Item& item = w.items[k++];
    if (const auto transfer_id = resolve_transfer_id(params, i, feature.identifier);
        transfer_id && !table_.unchanged(item.named, *transfer_id)) {
      return false;
    }
    if (item.stamp.entry != detail::kNoId) {
      if (!table_.unchanged(item.stamp)) return false;
      continue;
    }
    // No live record then: still none, and the engine's cache still (not) holding it.
    if (table_.stamp(feature.identifier).entry != detail::kNoId ||
        local_cache_.contains(feature.identifier) != item.local_hit) {
      return false;
    }
  }
  return k == w.items.size();
}

bool ConsumerGate::remember_waiting(const RequestView& request, std::int64_t num_computed_tokens,
                                    TimePoint valid_until) {
  const EcTransferParams* params = request.params();
  std::vector<Waiting::Item> items;
  items.reserve(request.mm_features.size());
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    const MmFeature& feature = request.mm_features[i];
    if (feature.computed_by(num_computed_tokens)) continue;
    Waiting::Item item;
    item.stamp = table_.stamp(feature.identifier);  // after every change this check made
    item.local_hit = local_cache_.contains(feature.identifier);
    if (const auto transfer_id = resolve_transfer_id(params, i, feature.identifier)) {
      const TransferRecord* named = table_.find(*transfer_id);
      // Each check pushes out the lease of an available record the request names
      // (touch_available): such a request is checked every time.
      if (named != nullptr && named->state() == TransferState::available) return false;
      item.named = table_.record_stamp(named);
    }
    items.push_back(item);
  }
  // Bounded: when full, start over (a forgotten request is only decided afresh).
  if (waiting_.size() >= options_.max_notified_remembered && !waiting_.contains(request.request_id)) waiting_.clear();
  Waiting& w = waiting_[request.request_id];
  w.num_computed_tokens = num_computed_tokens;
  w.features = request.mm_features.size();
  w.substitutes_changed = substitutes_changed_;
  w.asynchronous_loads = options_.asynchronous_loads;
  w.unavailable_reaches_engine = options_.unavailable_reaches_engine;
  w.valid_until = valid_until;
  w.items = std::move(items);
  return true;
}

bool ConsumerGate::release_malformed(const RequestView& request) {
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

bool ConsumerGate::release_unreachable(const RequestView& request, std::size_t index, std::string_view waiting_id) {
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

// ---------------------------------------------------------------- allocation and frees

void ConsumerGate::after_alloc(const RequestView& request, std::size_t index) {
  const MmFeature& feature = request.mm_features[index];
  if (local_cache_nodes_.insert(local_cache_, feature.identifier).second) local_cache_changed(feature.identifier);
  if (options_.is_consumer) {
    allocated_nodes_.insert_or_assign(allocated_this_step_, feature.identifier, request.request_id);
    // Asynchronous loads reach this too: a gate that passed on the engine's own copy
    // (a snapshot) finds the entry evicted by the time the engine allocates it.
    if (claimed_this_step_.contains(feature.identifier) &&
        !table_.has_state(feature.identifier, {TransferState::loading, TransferState::ready})) {
      load_at_alloc(request, index);
    }
  }
  if (auto it = copies_counted_on_.find(request.request_id); it != copies_counted_on_.end()) {
    if (std::erase(it->second, feature.identifier) != 0) stop_counting_on_copy(feature.identifier);
    if (it->second.empty()) counted_on_nodes_.erase(copies_counted_on_, it);
  }
}

void ConsumerGate::load_at_alloc(const RequestView& request, std::size_t index) {
  // The engine allocated a landed item as an external load and runs it in this step:
  // its copy is dispatched with this step's plan.
  const TimePoint now = clock_->now();
  const EcTransferParams* params = request.params();
  const MmFeature& feature = request.mm_features[index];
  const auto transfer_id = resolve_transfer_id(params, index, feature.identifier);
  if (const TransferRecord* used = table_.begin_load(feature.identifier, transfer_id, request.request_id, now,
                                                     now + options_.push_wait_timeout)) {
    if (transfer_id) note_borrow(*used, *transfer_id, request.request_id, now);
    ++stats_.alloc_loads;
    return;
  }
  ++stats_.alloc_load_misses;
  logger()->error(
      "EC mm_hash={} of request {} was allocated as an external load but nothing is left to load; failing "
      "the request",
      shorten(feature.identifier), shorten(request.request_id));
  failures_.mark(request.request_id);
}

void ConsumerGate::after_free(const RequestView& request, std::size_t index) {
  if (!options_.is_consumer || index >= request.mm_features.size() || request.has_malformed_params()) return;
  const EcTransferParams* params = request.params();
  const MmFeature& feature = request.mm_features[index];
  auto transfer_id = resolve_transfer_id(params, index, feature.identifier);
  if (!transfer_id) {
    if (params && !is_store_item(params, index, feature.identifier)) {
      failures_.warn_unresolved(request, index, "encoder-cache free");
    }
    return;
  }
  // Release now rather than at request end: a buffer held for the whole
  // generation pins a pool slot long after the embedding was used.
  const TimePoint now = clock_->now();
  release_own_transfer(std::string(*transfer_id), now, feature.identifier, request.request_id);
}

void ConsumerGate::release_own_transfer(const std::string& transfer_id, TimePoint now, std::string_view mm_hash,
                                        std::string_view request_id) {
  stop_waiting(transfer_id, request_id);  // its entry was freed, or it finished: it waits for nothing
  released_own_.insert(transfer_id, options_.max_notified_remembered);
  // A transfer can be both: owed to the request whose delivery this one used (kept
  // until both are done), and the lender of its own substitute (owed to this request).
  if (auto lender = lender_of_substitute_.find(transfer_id); lender != lender_of_substitute_.end()) {
    const std::string lender_id = lender->second;
    finish_substitute_side(lender_id, /*lender=*/false, now, mm_hash);
  } else {
    channel_.queue_cancel(transfer_id, now, mm_hash, request_id);
  }
  finish_substitute_side(transfer_id, /*lender=*/true, now, mm_hash);
}

void ConsumerGate::build_step(const StepView& step, ConnectorMeta& meta) {
  const TimePoint now = clock_->now();
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
    if (!allocated && local_cache_nodes_.erase_key(local_cache_, h)) local_cache_changed(h);
    // A load still in flight for an entry the engine dropped, that no waiting request
    // counts on (its request allocated the entry, then the engine evicted it): nobody
    // would free the copy once it lands in the workers' caches.
    if (!allocated && !copy_counts_.contains(h) && table_.has_state(h, {TransferState::loading})) {
      unowned_loads_.insert(h);
    }
    if ((allocated || copy_counts_.contains(h)) && table_.has_state(h, {TransferState::ready})) {
      if (std::find(meta.retained.begin(), meta.retained.end(), h) == meta.retained.end()) meta.retained.push_back(h);
      continue;
    }
    table_.release_ready(h, now);
    meta.freed.push_back(h);
  }
  while (!allocated_this_step_.empty()) allocated_nodes_.erase(allocated_this_step_, allocated_this_step_.begin());
  claimed_this_step_.clear();
  std::erase_if(gate_loads_, [&](const std::string& h) { return !table_.has_state(h, {TransferState::loading}); });
  for (auto& h : extra_freed_) {
    if (local_cache_.contains(h) || copy_counts_.contains(h)) continue;
    table_.release_ready(h, now);
    meta.freed.push_back(std::move(h));
  }
  extra_freed_.clear();
  for (auto& id : table_.drain_orphaned()) {
    channel_.cancel_orphan(id, now);
    meta.orphan_cancels.push_back(std::move(id));
  }
  expire_substitutes(now);
  meta.loads = table_.take_loads_to_dispatch();
  // Every load still LOADING has now been dispatched; an unowned one whose record
  // ended before it was (expired) will never be reported.
  std::erase_if(unowned_loads_, [&](const std::string& h) { return !table_.has_state(h, {TransferState::loading}); });
  channel_.poll_pending_cancels();
  channel_.rearm_drain();
}

void ConsumerGate::take_output(const WorkerOutput& output) {
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
}

void ConsumerGate::finish(const RequestView& request) {
  if (!options_.is_consumer) return;
  const TimePoint now = clock_->now();
  const EcTransferParams* params = request.params();
  std::vector<std::string_view> handled;
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    const MmFeature& feature = request.mm_features[i];
    auto transfer_id = resolve_transfer_id(params, i, feature.identifier);
    if (!transfer_id) {
      if (is_store_item(params, i, feature.identifier)) continue;  // nothing was reserved for it
      table_.withdraw(fallback_id(request, i), request.request_id);
      if (params) failures_.warn_unresolved(request, i, "request finish");
      continue;
    }
    handled.push_back(*transfer_id);
    release_own_transfer(std::string(*transfer_id), now, feature.identifier, request.request_id);
  }
  // Bindings that match no feature still name a reservation some shard may hold.
  if (params) {
    for (const auto& item : params->items) {
      if (!item.transfer_id || std::find(handled.begin(), handled.end(), *item.transfer_id) != handled.end()) continue;
      handled.push_back(*item.transfer_id);
      channel_.queue_cancel(*item.transfer_id, now, item.mm_hash.value_or(std::string()), request.request_id);
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
    counted_on_nodes_.erase(copies_counted_on_, it);
  }
  table_.forget_pending_request(request.request_id);
  if (auto it = waiting_.find(request.request_id); it != waiting_.end()) waiting_.erase(it);
}

// ---------------------------------------------------------------- copies and substitutes

void ConsumerGate::stop_waiting(std::string_view own_transfer_id, std::string_view request_id) {
  table_.withdraw(own_transfer_id, request_id);
  if (auto substitute = substitute_for_lender_.find(own_transfer_id); substitute != substitute_for_lender_.end()) {
    table_.withdraw(substitute->second.transfer_id, request_id);
  }
}

void ConsumerGate::note_borrow(const TransferRecord& used, std::string_view own_transfer_id,
                               std::string_view request_id, TimePoint now) {
  // Served: whatever ends its own transfer (or the substitute it waited for) from now
  // on is no loss of this request's.
  if (used.transfer_id() != own_transfer_id) stop_waiting(own_transfer_id, request_id);
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
  ++substitutes_changed_;
  lender_of_substitute_.emplace(own_transfer_id, used.transfer_id());
  substitute_order_.emplace_back(now, used.transfer_id());
  while (substitute_order_.size() > options_.max_notified_remembered) forget_oldest_substitute();
}

void ConsumerGate::expire_substitutes(TimePoint now) {
  while (!substitute_order_.empty() && substitute_order_.front().first + options_.table.reservation_ttl <= now) {
    forget_oldest_substitute();
  }
}

void ConsumerGate::forget_oldest_substitute() {
  const auto& [since, lender_id] = substitute_order_.front();
  // (An entry of a substitute forgotten meanwhile, or of a newer one for the same lender, is skipped.)
  if (auto it = substitute_for_lender_.find(lender_id); it != substitute_for_lender_.end() && it->second.since == since)
    forget_substitute(lender_id);
  substitute_order_.pop_front();
}

void ConsumerGate::count_on_copy(const std::string& request_id, const std::string& mm_hash) {
  auto& hashes = counted_on_nodes_.find_or_insert(copies_counted_on_, request_id);
  if (std::find(hashes.begin(), hashes.end(), mm_hash) != hashes.end()) return;
  hashes.push_back(mm_hash);
  ++copy_count_nodes_.find_or_insert(copy_counts_, mm_hash);
}

void ConsumerGate::stop_counting_on_copy(const std::string& mm_hash) {
  auto it = copy_counts_.find(mm_hash);
  if (it != copy_counts_.end() && --it->second == 0) copy_count_nodes_.erase(copy_counts_, it);
}

void ConsumerGate::forget_substitute(std::string_view lender_id) {
  auto it = substitute_for_lender_.find(lender_id);
  if (it == substitute_for_lender_.end()) return;
  if (auto back = lender_of_substitute_.find(it->second.transfer_id); back != lender_of_substitute_.end()) {
    lender_of_substitute_.erase(back);
  }
  substitute_for_lender_.erase(it);
  ++substitutes_changed_;
}

void ConsumerGate::finish_substitute_side(std::string_view lender_id, bool lender, TimePoint now,
                                          std::string_view mm_hash) {
  auto it = substitute_for_lender_.find(lender_id);
  if (it == substitute_for_lender_.end()) return;
  (lender ? it->second.lender_done : it->second.borrower_done) = true;
  if (!it->second.lender_done || !it->second.borrower_done) return;
  const std::string substitute_id = it->second.transfer_id;
  forget_substitute(lender_id);
  channel_.queue_cancel(substitute_id, now, mm_hash);
}

}  // namespace ecx::scheduler
