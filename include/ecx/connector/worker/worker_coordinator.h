#pragma once
// The EC connector's worker-side logic, one per engine worker process (TP/PP rank).
// Consumer (first PP stage only): owns this rank's ConsumerShard and executes the
// scheduler's load specs — each landed slot is copied into a tensor the engine
// allocates, then given back to the pool. Producer: owns the PushEngine and executes
// the scheduler's push specs, staging each encoder output once.
// Per step it reports WorkerMeta, folded across ranks with aggregate().
//
// Called from the engine's worker thread; nothing here blocks on the network.

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
  using Allocate = std::function<Result<LoadDestination>(const scheduler::LoadSpec& load)>;
  using IsPresent = std::function<bool(const std::string& mm_hash)>;
  LoadReport start_load_caches(const scheduler::ConnectorMeta& meta, const Allocate& allocate,
                               const IsPresent& present = nullptr);
  // For engines that keep a zero-copy view: the lease keeps the slot until released.
  Result<consumer::SlotLease> take(const scheduler::LoadSpec& load);

  // --- producer
  void start_save_caches(const scheduler::ConnectorMeta& meta);
  Status save_cache(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                    producer::SourceMemory memory = producer::SourceMemory::host);

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
};

}  // namespace ecx::worker
