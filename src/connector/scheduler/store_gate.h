#pragma once
// StoreGate: the cross-encoder cache on a scheduler. It decides which items come from
// the shared store instead of the encoder, so that an entry is verified before vLLM
// skips encoding it. On a producer every item is a candidate. On a consumer, the items
// no push is coming for: those the proxy sent with "store": true in ec_items (it saw
// them in the store and skipped their encoder), and the items of requests that came
// without ec_transfer_params.
// - With asynchronous loads (the engine reports the workers every step), the gate
//   (ensure_cache_available) asks the workers to prefetch an item the store holds into
//   host memory, checks and checksum first, and defers the request until they answer,
//   at most store_prefetch_timeout. has_cache_item claims only prefetched items; one the
//   store could not give (absent, corrupt, another model's, slow) is encoded, and the
//   presence index forgets it. The load at allocation is then a local copy. On a
//   consumer, a load the workers then report failed fails its request (the engine ran
//   without the item).
// - With synchronous loads a producer claims what the presence index knows and the
//   workers read the store at allocation; an entry that fails then costs that item's
//   push. A consumer claims nothing from the store then (a failed load could not be
//   reported): it encodes.
// A store item the consumer cannot get and has no media to encode fails its request.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "connector/scheduler/coordinator_common.h"
#include "connector/scheduler/request_failures.h"
#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/clock.h"

namespace ecx::scheduler {

class StoreGate {
 public:
  struct Stats {
    std::uint64_t lookups = 0;            // has_cache_item questions (items the engine would encode)
    std::uint64_t hits = 0;               // has_cache_item answered from the store
    std::uint64_t prefetches = 0;         // prefetches asked of the workers
    std::uint64_t prefetch_failures = 0;  // the workers could not prefetch (encoded instead)
    std::uint64_t prefetch_timeouts = 0;  // no answer within store_prefetch_timeout (encoded instead)
    std::uint64_t loads = 0;              // items loaded from the store instead of encoded
    std::uint64_t load_failures = 0;      // of those, reported failed by a worker
    std::uint64_t stranded = 0;           // store items without media the store could not give (request failed)
  };

  // `options` and `failures` must outlive the gate.
  StoreGate(const CoordinatorOptions& options, std::shared_ptr<const Clock> clock, RequestFailures& failures)
      : options_(options), clock_(std::move(clock)), failures_(failures) {}

  void set_store(std::shared_ptr<StorePresence> store) { store_ = std::move(store); }
  bool enabled() const noexcept { return options_.cross_encoder_cache && store_ != nullptr; }

  // ensure_cache_available: false while an item of the request is being prefetched.
  bool admit(const RequestView& request, std::int64_t num_computed_tokens);
  bool has_cache_item(std::string_view identifier);
  // update_state_after_alloc: true when the item is loaded from the store, not encoded.
  bool after_alloc(const RequestView& request, std::size_t index);
  void take_step(ConnectorMeta& meta);
  void take_output(const WorkerOutput& output);
  // Prefetches the workers have not answered yet (the engine must keep stepping).
  bool work_in_flight() const noexcept { return prefetching_ > 0; }
  std::size_t entries() const noexcept { return entries_.size(); }
  const Stats& stats() const noexcept { return stats_; }

 private:
  enum class State : unsigned char { prefetching, ready };
  struct Entry {
    State state = State::prefetching;
    TimePoint since;
  };
  static constexpr std::size_t kMaxEntries = 1'024;   // prefetches in flight or held, all requests
  static constexpr std::size_t kMaxRefused = 16'384;  // remembered refusals (then forgotten at once)
  static constexpr Duration kRefusedFor = std::chrono::seconds(5);

  static constexpr std::size_t kMaxLoadsAwaited = 4 * kMaxEntries;

  bool asynchronous() const noexcept { return options_.asynchronous_loads; }
  // Whether has_cache_item may claim an item the index knows without a verified copy.
  bool claims_unverified() const noexcept { return !asynchronous() && options_.is_producer; }
  // Whether feature `index` may come from the store; `marked` tells whether the proxy
  // sent it as a store item (then the index is not asked: the prefetch verifies).
  bool candidate(const RequestView& request, std::size_t index, bool& marked) const;
  // A store item that will not come from the store: without media it cannot be encoded.
  void strand_if_mediafree(const RequestView& request, const MmFeature& feature, bool marked);
  void refuse(const std::string& mm_hash, TimePoint now);
  void erase(detail::StringMap<Entry>::iterator it);

  const CoordinatorOptions& options_;
  std::shared_ptr<const Clock> clock_;
  RequestFailures& failures_;
  std::shared_ptr<StorePresence> store_;
  Stats stats_;
  detail::StringMap<Entry> entries_;
  std::size_t prefetching_ = 0;
  detail::StringMap<TimePoint> refused_until_;
  detail::StringSet claimed_this_step_;
  detail::StringSet loads_planned_;
  std::vector<StoreLoad> prefetches_;
  std::vector<StoreLoad> loads_;
  // Store loads dispatched and not yet reported: mm_hash -> the
  // requests that allocated it, so a failed load fails them on a consumer.
  detail::StringMap<std::vector<std::string>> loads_awaited_;
  // "<request id>\n<mm_hash>" of stranded store items, so each is counted and logged once.
  detail::RecentIds stranded_;
};

}  // namespace ecx::scheduler
