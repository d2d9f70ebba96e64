#pragma once
// The EC connector's worker-side logic, one per engine worker process (TP/PP rank).
// Consumer (first PP stage only): owns this rank's ConsumerShard and executes the
// scheduler's load specs — each landed slot is copied into a tensor the engine
// allocates, then given back to the pool. Producer: owns the PushEngine and executes
// the scheduler's push specs, staging each encoder output once.
// Per step it reports WorkerMeta, folded across ranks with aggregate().
//
// Called from the engine's worker thread; nothing here blocks on the network.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ecx/connector/scheduler/types.h"
#include "ecx/consumer/consumer_shard.h"
#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/metrics.h"
#include "ecx/core/status.h"
#include "ecx/producer/push_engine.h"

namespace ecx::worker {

// One rank's per-step report (vLLM's ECConnectorWorkerMetadata).
struct WorkerMeta {
  std::set<std::string> loaded;        // mm_hashes now in this rank's encoder cache
  std::set<std::string> failed_loads;  // mm_hashes this rank could not load
  std::set<std::string> reclaimed;     // mm_hashes whose resident copy this rank dropped
  bool pending_saves = false;          // producer I/O still in flight
  std::set<std::string> failed_saves;  // request ids whose push failed
  // Cross-encoder cache (producer): prefetched store entries now held, prefetches that
  // failed (absent, corrupt, another model's, store down or slow), held copies dropped.
  std::set<std::string> store_ready;
  std::set<std::string> store_failed;
  std::set<std::string> store_dropped;

  // Across TP ranks: loaded is the intersection (every rank gathers from its own
  // cache, so one missing rank fails the load); failures and reclaims are unions (the
  // weakest rank decides); pending_saves is an or.
  WorkerMeta aggregate(const WorkerMeta& other) const;
  scheduler::WorkerOutput to_output() const;
};

// Where a loaded tensor goes: memory the engine allocated for it.
struct LoadDestination {
  void* data = nullptr;
  bool cuda = false;  // device memory (copied with the CUDA staging path)
  int device = 0;
};

// Producer, cross-encoder cache: what this worker did with the shared store.
struct StoreWorkerCounters {
  std::uint64_t prefetched = 0;           // entries read and verified ahead of their allocation
  std::uint64_t prefetch_failures = 0;    // of those asked, not given by the store (then encoded)
  std::uint64_t prefetch_dropped = 0;     // held copies nobody allocated in time
  std::uint64_t prefetch_held_bytes = 0;  // gauge
  std::uint64_t loads = 0;                // items loaded from the store instead of encoded
  std::uint64_t load_failures = 0;        // store loads that failed (absent, corrupt, store down or slow)
  std::uint64_t bytes_loaded = 0;
  std::uint64_t offered = 0;    // computed outputs offered for publishing
  std::uint64_t published = 0;  // of those, written
  std::uint64_t bytes_published = 0;
  std::uint64_t publish_dropped = 0;  // not published: the pending bounds were full, or at shutdown
  std::uint64_t publish_failed = 0;   // the store refused or was unreachable
  std::uint64_t store_errors = 0;     // calls that failed on the store itself
  std::uint64_t rejected = 0;         // entries refused by their checks (checksum, model, size)
};

struct LoadReport {
  std::vector<std::string> loaded;
  std::vector<std::string> failed;  // the engine should drop what it allocated for these
};

class WorkerCoordinator {
 public:
  // Starts the consumer shard (consumer role, first PP stage) and/or the push engine
  // (producer role) for config.layout's rank.
  static Result<std::unique_ptr<WorkerCoordinator>> start(const Config& config,
                                                          std::shared_ptr<const Clock> clock = SteadyClock::shared());
  ~WorkerCoordinator();
  WorkerCoordinator(const WorkerCoordinator&) = delete;
  WorkerCoordinator& operator=(const WorkerCoordinator&) = delete;

  // --- consumer
  // Loads meta.loads: for each, `allocate` returns the engine's destination for the
  // spec (e.g. a fresh tensor put into its encoder cache); the landed bytes are copied
  // there and the slot is given back. Items already present (`present` true) are
  // counted as loaded without a copy.
  // Producer with the cross-encoder cache: loads meta.store_loads from the shared
  // store the same way (the entry's checks pass before a byte lands); the engine
  // then binds the loaded tensor with save_cache like an encoded one, and a failed
  // load is reported in failed_loads (its push is abandoned when its request ends).
  using Allocate = std::function<Result<LoadDestination>(const scheduler::LoadSpec& load)>;
  using IsPresent = std::function<bool(const std::string& mm_hash)>;
  LoadReport start_load_caches(const scheduler::ConnectorMeta& meta, const Allocate& allocate,
                               const IsPresent& present = nullptr);
  // Zero-copy loads (zero_copy_loads, host engines that can keep a view): each landed
  // slot of meta.loads is handed to `adopt` as a lease the engine keeps as its
  // encoder-cache entry; the slot returns to the pool (or stays resident) when the
  // engine drops the lease. Nothing is copied. Store loads still go through `allocate`.
  using Adopt = std::function<Status(const scheduler::LoadSpec& load, consumer::SlotLease lease)>;
  LoadReport start_load_caches(const scheduler::ConnectorMeta& meta, const Allocate& allocate, const Adopt& adopt,
                               const IsPresent& present = nullptr);
  // For engines that keep a zero-copy view: the lease keeps the slot until released.
  Result<consumer::SlotLease> take(const scheduler::LoadSpec& load);

  // --- producer
  // Submits meta.pushes; remembers meta.store_candidates, published by save_cache.
  void start_save_caches(const scheduler::ConnectorMeta& meta);
  // Binds the output to its pushes (a staging copy); a store candidate is then also
  // offered for publishing, best effort: copied only when the pending bounds have
  // room, written off this thread, never delaying a push.
  Status save_cache(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                    producer::SourceMemory memory = producer::SourceMemory::host);
  // A host output the engine can keep unchanged until `release` runs (from ECX's
  // thread): with zero_copy_saves (from zero_copy_saves_min_bytes) it is sent from in
  // place (PushEngine::lend_source); otherwise it is copied like save_cache and
  // `release` runs before this returns.
  Status lend_cache(std::string_view mm_hash, const void* data, std::uint64_t nbytes, std::function<void()> release);
  StoreWorkerCounters store_counters() const;
  // Waits (real time) until every offered output is published or dropped.
  bool wait_published(std::chrono::milliseconds timeout);

  // --- both
  void get_finished(const std::vector<std::string>& finished_request_ids);
  // nullopt on ranks that must not report (later PP stages of a consumer).
  std::optional<WorkerMeta> build_worker_meta();
  // Idempotent.
  void shutdown();

  consumer::ConsumerShard* shard() noexcept { return shard_.get(); }
  producer::PushEngine* push_engine() noexcept { return pushes_.get(); }
  bool reports() const noexcept { return reports_; }
  void export_metrics(metrics::Registry& registry);

 private:
  WorkerCoordinator(Config config, std::shared_ptr<const Clock> clock);

  Config config_;
  std::shared_ptr<const Clock> clock_;
  std::unique_ptr<consumer::ConsumerShard> shard_;
  std::unique_ptr<producer::PushEngine> pushes_;
  bool reports_ = true;
  WorkerMeta step_;
  std::vector<std::uint64_t> collectors_;
  metrics::Registry* registry_ = nullptr;
  struct CudaCopier;
  std::unique_ptr<CudaCopier> cuda_;
  struct StoreSide;
  std::unique_ptr<StoreSide> store_;

  void publish(std::string_view mm_hash, const void* data, std::uint64_t nbytes, producer::SourceMemory memory);
  void load_from_store(const scheduler::ConnectorMeta& meta, const Allocate& allocate, LoadReport& report);
  Status copy_to_device(const void* host, const LoadDestination& destination, std::uint64_t nbytes);
};

}  // namespace ecx::worker
