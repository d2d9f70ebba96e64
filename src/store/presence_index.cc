#include "ecx/store/presence_index.h"

#include <algorithm>

#include "core/logging.h"
#include "ecx/core/thread_name.h"

namespace ecx::store {

PresenceIndex::PresenceIndex(std::shared_ptr<EmbeddingStore> lookups, std::unique_ptr<PresenceFeed> feed,
                             PresenceOptions options)
    : store_(std::move(lookups)),
      feed_(std::move(feed)),
      options_(std::move(options)),
      clock_(options_.clock ? options_.clock : SteadyClock::shared()),
      confirmer_([this] {
        name_this_thread("ecx-store-conf");
        run_confirmations();
      }) {
  if (feed_)
    feed_thread_ = std::thread([this] {
      name_this_thread("ecx-store-feed");
      run_feed();
    });
}

PresenceIndex::~PresenceIndex() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  confirmer_.join();
  if (feed_thread_.joinable()) feed_thread_.join();
}

bool PresenceIndex::present(std::string_view mm_hash) {
  const TimePoint now = clock_->now();
  std::string key(mm_hash);
  bool wake = false;
  {
    std::lock_guard lock(mutex_);
    ++counters_.lookups;
    if (auto it = known_.find(key); it != known_.end()) {
      if (it->second.expires > now) {
        ++counters_.hits;
        return true;
      }
      known_.erase(it);  // expired by the store's TTL by now
    }
    ++counters_.misses;
    if (auto a = absent_until_.find(key); a != absent_until_.end()) {
      if (a->second > now) return false;  // asked a moment ago: not there
      absent_until_.erase(a);
    }
    if (stopping_ || queued_.contains(key)) return false;
    if (queue_.size() >= options_.max_queued) {
      ++counters_.confirmations_dropped;
      return false;
    }
    queued_.insert(key);
    queue_.push_back(std::move(key));
    wake = true;
  }
  if (wake) changed_.notify_all();
  return false;
}

void PresenceIndex::learn(std::string_view mm_hash) {
  std::lock_guard lock(mutex_);
  insert_locked(std::string(mm_hash), clock_->now());
}

void PresenceIndex::forget(std::string_view mm_hash) {
  std::lock_guard lock(mutex_);
  if (known_.erase(std::string(mm_hash)) > 0) ++counters_.forgotten;
}

void PresenceIndex::insert_locked(const std::string& mm_hash, TimePoint now) {
  absent_until_.erase(mm_hash);
  const std::uint64_t sequence = next_sequence_++;
  known_.insert_or_assign(mm_hash, Known{now + options_.entry_lifetime, sequence});
  order_.emplace_back(mm_hash, sequence);
  // The bound: the oldest insertions go first (a refreshed entry's older place is stale).
  while (known_.size() > options_.max_entries && !order_.empty()) {
    auto& [hash, seq] = order_.front();
    if (auto it = known_.find(hash); it != known_.end() && it->second.sequence == seq) known_.erase(it);
    order_.pop_front();
  }
  if (order_.size() > 2 * options_.max_entries + 64) {
    std::erase_if(order_, [&](const auto& e) {
      auto it = known_.find(e.first);
      return it == known_.end() || it->second.sequence != e.second;
    });
  }
}

void PresenceIndex::clear_locked() {
  if (!known_.empty()) ++counters_.cleared;
  known_.clear();
  order_.clear();
}

void PresenceIndex::reconfirm_locked() {
  // Newest first: order_ holds stale places of refreshed entries, skipped by sequence.
  for (auto it = order_.rbegin(); it != order_.rend() && queue_.size() < options_.max_queued; ++it) {
    auto known = known_.find(it->first);
    if (known == known_.end() || known->second.sequence != it->second) continue;
    if (queued_.insert(it->first).second) queue_.push_back(it->first);
  }
  clear_locked();
}

PresenceCounters PresenceIndex::counters() const {
  std::lock_guard lock(mutex_);
  PresenceCounters c = counters_;
  c.entries = known_.size();
  c.queued = queue_.size();
  return c;
}

bool PresenceIndex::wait_confirmed(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(mutex_);
  return changed_.wait_for(lock, timeout,
                           [&] { return queue_.empty() && !confirming_ && (!feed_ || feed_subscribed_); });
}

void PresenceIndex::run_confirmations() noexcept {
  auto log = ecx::log::get("store");
  std::unique_lock lock(mutex_);
  bool store_was_down = false;
  for (;;) {
    // Bounded wait: re-checks at least once a second whatever happens.
    changed_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    if (queue_.empty()) continue;
    std::vector<std::string> batch;
    while (!queue_.empty() && batch.size() < options_.batch) {
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    confirming_ = true;
    lock.unlock();
    auto found = store_->contains(batch);
    lock.lock();
    confirming_ = false;
    counters_.confirmations += batch.size();
    const TimePoint now = clock_->now();
    if (!found) {
      ++counters_.store_errors;
      // The store cannot be read: what the index holds may be gone with it.
      clear_locked();
      if (!store_was_down) log->warn("presence lookups in {} failed: {}", store_->describe(), found.status().message());
      store_was_down = true;
      for (auto& h : batch) {
        queued_.erase(h);
        absent_until_.insert_or_assign(std::move(h), now + options_.absent_lifetime);
      }
    } else {
      store_was_down = false;
      for (std::size_t i = 0; i < batch.size(); ++i) {
        queued_.erase(batch[i]);
        if ((*found)[i]) {
          ++counters_.confirmed_present;
          insert_locked(batch[i], now);
        } else {
          absent_until_.insert_or_assign(std::move(batch[i]), now + options_.absent_lifetime);
        }
      }
    }
    // The negative cache is a courtesy to the store, not state: bounded by clearing.
    if (absent_until_.size() > options_.max_queued * 16) absent_until_.clear();
    changed_.notify_all();
  }
}

void PresenceIndex::run_feed() noexcept {
  auto log = ecx::log::get("store");
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
    }
    auto event = feed_->next(options_.feed_wait);
    std::unique_lock lock(mutex_);
    if (!event) {
      ++counters_.feed_errors;
      feed_subscribed_ = false;
      clear_locked();  // changes are being missed
      changed_.wait_for(lock, options_.feed_retry, [&] { return stopping_; });
      continue;
    }
    if (!*event) continue;
    ++counters_.feed_events;
    const PresenceEvent& e = **event;
    switch (e.kind) {
      case PresenceEvent::Kind::present:
        insert_locked(e.mm_hash, clock_->now());
        break;
      case PresenceEvent::Kind::gone:
        known_.erase(e.mm_hash);
        break;
      case PresenceEvent::Kind::resync:
        // Changes before the subscription may have been missed: what was known is asked again.
        ++counters_.feed_resyncs;
        reconfirm_locked();
        feed_subscribed_ = true;
        changed_.notify_all();
        log->debug("presence feed {} (re)connected", feed_->describe());
        break;
    }
  }
}

std::uint64_t PresenceIndex::export_metrics(metrics::Registry& registry) const {
  return registry.add_collector([this](metrics::SampleSink& sink) {
    const PresenceCounters c = counters();
    sink.counter("store_presence_lookups_total", "has_cache_item questions answered from the presence index",
                 c.lookups);
    sink.counter("store_presence_hits_total", "has_cache_item answered present (the item is loaded, not encoded)",
                 c.hits);
    sink.counter("store_presence_misses_total", "has_cache_item answered absent (the item is encoded)", c.misses);
    sink.counter("store_presence_confirmations_total", "mm_hashes looked up in the store off the scheduler thread",
                 c.confirmations);
    sink.counter("store_presence_confirmations_dropped_total", "Lookups not queued: the queue was full",
                 c.confirmations_dropped);
    sink.counter("store_presence_feed_events_total", "Store change notifications received", c.feed_events);
    sink.counter("store_presence_feed_errors_total", "Times the store's change notifications were cut", c.feed_errors);
    sink.counter("store_presence_store_errors_total", "Presence lookups that failed on the store", c.store_errors);
    sink.counter("store_presence_forgotten_total", "Entries forgotten after a failed load", c.forgotten);
    sink.gauge("store_presence_entries", "mm_hashes known present", c.entries);
  });
}

}  // namespace ecx::store
