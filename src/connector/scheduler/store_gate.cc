#include "connector/scheduler/store_gate.h"

#include "connector/scheduler/push_planner.h"

namespace ecx::scheduler {

bool StoreGate::admit(const RequestView& request, std::int64_t num_computed_tokens) {
  if (!enabled() || !asynchronous()) return true;
  const TimePoint now = clock_->now();
  bool waiting = false;
  for (const MmFeature& feature : request.mm_features) {
    if (feature.modality != "image" || feature.computed_by(num_computed_tokens)) continue;
    const std::string& h = feature.identifier;
    if (auto it = entries_.find(h); it != entries_.end()) {
      if (it->second.state == State::ready) continue;
      if (now - it->second.since < options_.store_prefetch_timeout) {
        waiting = true;
        continue;
      }
      // The workers did not answer in time: encode it (their late answer is ignored).
      ++stats_.prefetch_timeouts;
      erase(it);
      refuse(h, now);
      continue;
    }
    if (auto r = refused_until_.find(h); r != refused_until_.end()) {
      if (now < r->second) continue;
      refused_until_.erase(r);
    }
    if (entries_.size() >= kMaxEntries) continue;  // enough in hand: encode the rest
    if (!store_->present(h)) continue;
    auto spec = expected_output_spec(options_, feature);
    if (!spec) continue;
    entries_.emplace(h, Entry{State::prefetching, now});
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
  } else if (!store_->present(identifier)) {
    return false;
  }
  ++stats_.hits;
  claimed_this_step_.emplace(identifier);
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
  for (const auto& h : output.failed_loads) {
    // A store load at allocation failed (synchronous loads, or a dropped copy).
    store_->forget(h);
    ++stats_.load_failures;
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
