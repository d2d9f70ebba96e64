#pragma once
// Best-effort publishing of computed encoder outputs to the shared store, off the
// caller's thread: offer() copies nothing and never waits; what does not fit in the
// pending bounds is dropped and counted. A push to a consumer never waits for it.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/store/embedding_store.h"

namespace ecx::store {

struct PublisherOptions {
  std::size_t max_pending_items = 32;
  std::uint64_t max_pending_bytes = std::uint64_t{2} << 30;
};

struct PublisherCounters {
  std::uint64_t offered = 0;
  std::uint64_t published = 0;
  std::uint64_t dropped_full = 0;  // refused by the pending bounds
  std::uint64_t failed = 0;        // the store refused or was unreachable
  std::uint64_t dropped_at_stop = 0;
  std::size_t pending_items = 0;
  std::uint64_t pending_bytes = 0;
};

class Publisher {
 public:
  Publisher(std::shared_ptr<EmbeddingStore> store, PublisherOptions options);
  // Stops: what is still pending is dropped (counted), the entry being written finishes
  // (bounded by the store's I/O timeout), the thread is joined.
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Queues one entry; false (and counted) when the bounds are full. Takes the bytes.
  bool offer(std::string mm_hash, TensorSpec spec, std::vector<std::byte> payload);
  // Whether an entry of `nbytes` would be queued now (so a caller copies only then).
  bool has_room(std::uint64_t nbytes) const;
  // Until nothing is pending or being written, or `timeout` (real time) passed.
  bool wait_idle(std::chrono::milliseconds timeout);
  PublisherCounters counters() const;

 private:
  struct Item {
    std::string mm_hash;
    TensorSpec spec;
    std::vector<std::byte> payload;
  };
  void run() noexcept;

  const std::shared_ptr<EmbeddingStore> store_;
  const PublisherOptions options_;
  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable changed_;
  std::deque<Item> pending_;
  bool writing_ = false;
  bool stopping_ = false;
  PublisherCounters counters_;
  std::thread thread_;  // last: starts after the state it reads
};

}  // namespace ecx::store
