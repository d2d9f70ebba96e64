#pragma once
// The cross-encoder cache's reads on a worker, ahead of their allocation: a
// thread of its own reads each entry the scheduler asked for from the store, checked
// (header, model identity, shape, xxHash64) before it is kept, into host memory
// bounded by max_bytes. The engine's thread only queues requests and takes copies: it
// never waits for the store. Copies nobody takes within hold_for are dropped.

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
#include <vector>

#include "ecx/connector/scheduler/types.h"
#include "ecx/core/clock.h"
#include "ecx/store/embedding_store.h"

namespace ecx::worker {

class StorePrefetcher {
 public:
  struct Copy {
    TensorSpec spec;
    std::vector<std::byte> bytes;
    TimePoint ready_at;
  };
  struct Report {
    std::vector<std::string> ready;  // every copy held at the drain (a level, not news)
    std::vector<std::string> failed;
    std::vector<std::string> dropped;
  };
  struct Counters {
    std::uint64_t prefetched = 0;
    std::uint64_t failed = 0;
    std::uint64_t dropped = 0;
    std::uint64_t held_bytes = 0;
  };

  StorePrefetcher(std::shared_ptr<store::EmbeddingStore> store, std::uint64_t max_bytes, Duration hold_for,
                  std::shared_ptr<const Clock> clock);
  // Stops and joins: bounded by the one store read in progress (store_io_timeout_s).
  ~StorePrefetcher();
  StorePrefetcher(const StorePrefetcher&) = delete;
  StorePrefetcher& operator=(const StorePrefetcher&) = delete;

  // Never blocks; what cannot be queued is reported failed.
  void request(const scheduler::StoreLoad& item);
  // The held copy of mm_hash, handed over (nullopt when not held).
  std::optional<Copy> take(std::string_view mm_hash);
  // Failures and drops since the last call, and every copy held now (not only the new
  // ones: see drain); copies held longer than hold_for are dropped first.
  Report drain();
  Counters counters() const;

 private:
  static constexpr std::size_t kMaxQueued = 1'024;
  void run() noexcept;

  const std::shared_ptr<store::EmbeddingStore> store_;
  const std::uint64_t max_bytes_;
  const Duration hold_for_;
  const std::shared_ptr<const Clock> clock_;

  mutable std::mutex mutex_;  // guards everything below
  std::condition_variable changed_;
  std::deque<scheduler::StoreLoad> queue_;
  std::unordered_map<std::string, Copy> held_;
  std::uint64_t reserved_bytes_ = 0;  // held plus the read in progress
  Report report_;
  Counters counters_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the state it reads
};

}  // namespace ecx::worker
