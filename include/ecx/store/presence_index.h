#pragma once
// What a producer's scheduler knows of the store's contents, so that has_cache_item
// answers without a network round trip on the engine's scheduling thread. Two
// sources keep it current, both off that thread:
// - the store's own change notifications (a PresenceFeed: Redis keyspace events),
//   which tell of every entry another encoder writes, deletes, or that expires;
// - confirmations: an mm_hash asked about and not known is looked up in a batch by
//   a background thread, so the next ask (a later step) knows.
// Bounded: at most max_entries remembered (the oldest forgotten first), at most
// max_queued confirmations waiting (the rest dropped, counted). A feed or store
// failure forgets every entry (events may have been missed): until the store is
// back, every item is encoded. When the feed (re)subscribes, what the index knew is
// looked up again (as many as the confirmation queue holds) rather than forgotten: the
// first subscription usually completes after the first confirmations.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/metrics.h"
#include "ecx/core/status.h"
#include "ecx/store/embedding_store.h"

namespace ecx::store {

struct PresenceEvent {
  enum class Kind : unsigned char {
    present,  // written (or rewritten)
    gone,     // deleted, expired or evicted
    resync,   // the feed (re)connected: what happened before may have been missed
  };
  Kind kind = Kind::present;
  std::string mm_hash;  // empty for resync
};

// The store's change notifications for one key space.
class PresenceFeed {
 public:
  virtual ~PresenceFeed() = default;
  // The next event, waiting at most `wait` (real time): nullopt when none came. An
  // error when the feed is down; a later call reconnects (no sooner than the store's
  // reconnect interval) and then yields `resync` first.
  virtual Result<std::optional<PresenceEvent>> next(std::chrono::milliseconds wait) = 0;
  virtual std::string describe() const = 0;
};

// Redis keyspace notifications (PSUBSCRIBE __keyspace@<db>__:<prefix>:<model>:*).
// They need the server's notify-keyspace-events to include K, $ (or A), g, x and e;
// when it does not, the feed logs once what to set and delivers nothing more.
Result<std::unique_ptr<PresenceFeed>> open_redis_feed(RedisOptions options);

struct PresenceOptions {
  std::size_t max_entries = 1'000'000;
  std::size_t max_queued = 4'096;                      // confirmations waiting
  std::size_t batch = 256;                             // mm_hashes per lookup round trip
  Duration entry_lifetime = std::chrono::hours(1);     // the store's TTL
  Duration absent_lifetime = std::chrono::seconds(1);  // a confirmed miss is not asked again sooner
  std::chrono::milliseconds feed_wait{100};            // how often the feed thread looks at stop
  std::chrono::milliseconds feed_retry{200};           // after a feed error
  std::shared_ptr<const Clock> clock;                  // SteadyClock when null
};

struct PresenceCounters {
  std::uint64_t lookups = 0;  // present() calls
  std::uint64_t hits = 0;     // answered present
  std::uint64_t misses = 0;
  std::uint64_t confirmations = 0;          // mm_hashes looked up off-thread
  std::uint64_t confirmations_dropped = 0;  // the queue was full
  std::uint64_t confirmed_present = 0;
  std::uint64_t feed_events = 0;
  std::uint64_t feed_resyncs = 0;
  std::uint64_t feed_errors = 0;
  std::uint64_t store_errors = 0;  // lookups that failed
  std::uint64_t forgotten = 0;     // entries dropped by forget() (a load failed)
  std::uint64_t cleared = 0;       // times every entry was forgotten (feed or store failure)
  std::size_t entries = 0;         // gauge
  std::size_t queued = 0;          // gauge
};

class PresenceIndex {
 public:
  // `lookups` is the index's own store connection (one object serialises its calls);
  // `feed` may be null (then only confirmations keep the index current).
  PresenceIndex(std::shared_ptr<EmbeddingStore> lookups, std::unique_ptr<PresenceFeed> feed, PresenceOptions options);
  // Stops and joins both threads (each wait is bounded by feed_wait or the store's I/O timeout).
  ~PresenceIndex();
  PresenceIndex(const PresenceIndex&) = delete;
  PresenceIndex& operator=(const PresenceIndex&) = delete;

  // Whether mm_hash is known to be in the store. Never touches the network: an
  // unknown mm_hash is queued for a confirmation and answered false.
  bool present(std::string_view mm_hash);
  // This process wrote it.
  void learn(std::string_view mm_hash);
  // A load of it failed: not present until the store says so again.
  void forget(std::string_view mm_hash);

  PresenceCounters counters() const;
  // Tests and warm-ups: until the feed (if any) is subscribed and no confirmation is
  // queued or running, or `timeout` (real time).
  bool wait_confirmed(std::chrono::milliseconds timeout) const;
  std::uint64_t export_metrics(metrics::Registry& registry) const;

 private:
  struct Known {
    TimePoint expires;
    std::uint64_t sequence = 0;
  };
  void insert_locked(const std::string& mm_hash, TimePoint now);
  void clear_locked();
  // Forgets every entry and queues the most recent (bounded) for a confirmation.
  void reconfirm_locked();
  void run_confirmations() noexcept;
  void run_feed() noexcept;

  const std::shared_ptr<EmbeddingStore> store_;
  const std::unique_ptr<PresenceFeed> feed_;
  const PresenceOptions options_;
  const std::shared_ptr<const Clock> clock_;

  mutable std::mutex mutex_;  // guards everything below
  mutable std::condition_variable changed_;
  std::unordered_map<std::string, Known> known_;
  std::deque<std::pair<std::string, std::uint64_t>> order_;  // insertion order, for the bound
  std::uint64_t next_sequence_ = 1;
  std::unordered_map<std::string, TimePoint> absent_until_;
  std::deque<std::string> queue_;
  std::unordered_set<std::string> queued_;  // in queue_ or being looked up
  bool confirming_ = false;
  bool feed_subscribed_ = false;  // a resync came, and no feed error since
  bool stopping_ = false;
  PresenceCounters counters_;

  // Last: they start after the state they read.
  std::thread confirmer_;
  std::thread feed_thread_;
};

}  // namespace ecx::store
