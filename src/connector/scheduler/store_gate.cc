#include "connector/scheduler/store_gate.h"

#include <optional>

#include "connector/scheduler/push_planner.h"
#include "ecx/connector/scheduler/transfer_params.h"

namespace ecx::scheduler {

bool StoreGate::candidate(const RequestView& request, std::size_t index, bool& marked) const {
  const EcTransferParams* params = request.params();
  const MmFeature& feature = request.mm_features[index];
  marked = options_.is_consumer && is_store_item(params, index, feature.identifier);
  if (feature.modality != "image") return false;
  // A consumer waits for the pushes its ec_transfer_params announce; the rest it encodes.
  return options_.is_producer || marked || params == nullptr;
}

void StoreGate::strand_if_mediafree(const RequestView& request, const MmFeature& feature, bool marked) {
  if (!marked || feature.has_media) return;
  failures_.mark(request.request_id);
  if (!stranded_.insert(request.request_id + "\n" + feature.identifier, options_.max_notified_remembered)) return;
  ++stats_.stranded;
  detail::coordinator_logger()->error(
      "EC request {}: mm_hash={} was sent to come from the store, which cannot give it, and carries no media to "
      "encode; failing the request",
      detail::shorten(request.request_id), detail::shorten(feature.identifier));
}

bool StoreGate::admit(const RequestView& request, std::int64_t num_computed_tokens) {
  // Read once, and only for an item the store serves: without a store (most
  // deployments) this runs for every waiting request every step, and the clock read
  // was most of its cost.
  std::optional<TimePoint> read_at;
  const auto now = [&] { return read_at ? *read_at : *(read_at = clock_->now()); };
  bool waiting = false;
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    const MmFeature& feature = request.mm_features[i];
    if (feature.computed_by(num_computed_tokens)) continue;
    bool marked = false;
    if (!candidate(request, i, marked)) {
      strand_if_mediafree(request, feature, marked);  // marked, but not an image
      continue;
    }
    if (!enabled() || !asynchronous()) {
      strand_if_mediafree(request, feature, marked);
      continue;
    }
    const std::string& h = feature.identifier;
    if (auto it = entries_.find(h); it != entries_.end()) {
      if (it->second.state == State::ready) continue;
      if (now() - it->second.since < options_.store_prefetch_timeout) {
        waiting = true;
        continue;
      }
      // The workers did not answer in time: encode it (their late answer is ignored).
      ++stats_.prefetch_timeouts;
      erase(it);
      refuse(h, now());
      strand_if_mediafree(request, feature, marked);
      continue;
    }
    if (auto r = refused_until_.find(h); r != refused_until_.end()) {
      if (now() < r->second) {
        strand_if_mediafree(request, feature, marked);
        continue;
      }
      refused_until_.erase(r);
    }
    // Enough in hand: encode the rest.
    if (entries_.size() >= kMaxEntries || !(marked || store_->present(h))) {
      strand_if_mediafree(request, feature, marked);
      continue;
    }
    auto spec = expected_output_spec(options_, feature);
    if (!spec) continue;
    entries_.emplace(h, Entry{State::prefetching, now()});
    ++prefetching_;
    prefetches_.push_back(StoreLoad{h, *spec});
    ++stats_.prefetches;
    waiting = true;
  }
  return !waiting;
}

bool StoreGate::has_cache_item(std::string_view identifier) {
  if (!enabled()) return false;
  ++stats_.lookups;
  if (asynchronous()) {
    auto it = entries_.find(identifier);
    if (it == entries_.end() || it->second.state != State::ready) return false;
  } else if (!claims_unverified() || !store_->present(identifier)) {
    return false;
  }
  ++stats_.hits;
  detail::insert_once(claimed_this_step_, identifier);
  return true;
}

bool StoreGate::after_alloc(const RequestView& request, std::size_t index) {
  const MmFeature& feature = request.mm_features[index];
  if (!claimed_this_step_.contains(feature.identifier)) return false;
  if (loads_planned_.insert(feature.identifier).second) {
    if (auto spec = expected_output_spec(options_, feature)) {
      loads_.push_back(StoreLoad{feature.identifier, *spec});
      ++stats_.loads;
    }
    // The workers' prefetched copy is consumed by this load.
    if (auto it = entries_.find(feature.identifier); it != entries_.end()) erase(it);
  }
  // The workers report this load (where reports reach the scheduler at all: bounded).
  if (loads_awaited_.size() >= kMaxLoadsAwaited) loads_awaited_.clear();
  loads_awaited_[feature.identifier].push_back(request.request_id);
  return true;
}

void StoreGate::take_step(ConnectorMeta& meta) {
  meta.store_prefetches = std::exchange(prefetches_, {});
  meta.store_loads = std::exchange(loads_, {});
  claimed_this_step_.clear();
  loads_planned_.clear();
}

void StoreGate::take_output(const WorkerOutput& output) {
  if (!store_) return;
  const TimePoint now = clock_->now();
  for (const auto& h : output.store_ready) {
    auto it = entries_.find(h);
    if (it == entries_.end() || it->second.state != State::prefetching) continue;  // late, or given up
    it->second.state = State::ready;
    it->second.since = now;
    --prefetching_;
  }
  for (const auto& h : output.store_failed) {
    ++stats_.prefetch_failures;
    store_->forget(h);
    if (auto it = entries_.find(h); it != entries_.end()) erase(it);
    refuse(h, now);
  }
  for (const auto& h : output.store_dropped) {
    if (auto it = entries_.find(h); it != entries_.end() && it->second.state == State::ready) erase(it);
  }
  for (const auto& h : output.loaded) loads_awaited_.erase(h);
  for (const auto& h : output.failed_loads) {
    // A store load at allocation failed (its prefetched copy was dropped, and the
    // store could not give it again).
    auto it = loads_awaited_.find(h);
    if (it == loads_awaited_.end()) continue;  // a transfer's load, not the store's
    store_->forget(h);
    ++stats_.load_failures;
    if (options_.is_consumer) {
      // The engine ran those requests without the item: they cannot be answered right.
      for (const auto& request_id : it->second) {
        detail::coordinator_logger()->error("EC request {}: loading mm_hash={} from the store failed; failing it",
                                            detail::shorten(request_id), detail::shorten(h));
        failures_.mark(request_id);
      }
    }
    loads_awaited_.erase(it);
  }
}

void StoreGate::refuse(const std::string& mm_hash, TimePoint now) {
  if (refused_until_.size() >= kMaxRefused) refused_until_.clear();
  refused_until_.insert_or_assign(mm_hash, now + kRefusedFor);
}

void StoreGate::erase(detail::StringMap<Entry>::iterator it) {
  if (it->second.state == State::prefetching) --prefetching_;
  entries_.erase(it);
}

}  // namespace ecx::scheduler
