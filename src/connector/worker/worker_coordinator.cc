#include "ecx/connector/worker/worker_coordinator.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/core/stages.h"
#include "ecx/pool/cuda_staging.h"

namespace ecx::worker {

WorkerMeta WorkerMeta::aggregate(const WorkerMeta& other) const {
  WorkerMeta out;
  std::set_intersection(loaded.begin(), loaded.end(), other.loaded.begin(), other.loaded.end(),
                        std::inserter(out.loaded, out.loaded.end()));
  out.failed_loads = failed_loads;
  out.failed_loads.insert(other.failed_loads.begin(), other.failed_loads.end());
  out.reclaimed = reclaimed;
  out.reclaimed.insert(other.reclaimed.begin(), other.reclaimed.end());
  out.failed_saves = failed_saves;
  out.failed_saves.insert(other.failed_saves.begin(), other.failed_saves.end());
  out.pending_saves = pending_saves || other.pending_saves;
  // A hash one rank loaded and another failed is a failed load.
  for (const auto& h : out.failed_loads) out.loaded.erase(h);
  return out;
}

scheduler::WorkerOutput WorkerMeta::to_output() const {
  scheduler::WorkerOutput out;
  out.loaded.assign(loaded.begin(), loaded.end());
  out.failed_loads.assign(failed_loads.begin(), failed_loads.end());
  out.reclaimed.assign(reclaimed.begin(), reclaimed.end());
  out.pending_saves = pending_saves;
  out.failed_saves.assign(failed_saves.begin(), failed_saves.end());
  return out;
}

// Host -> device copies of landed slots, on one stream owned by the worker thread.
struct WorkerCoordinator::CudaCopier {
  std::unique_ptr<pool::CudaStager> stager;
  int device = -1;
};

WorkerCoordinator::WorkerCoordinator(Config config, std::shared_ptr<const Clock> clock)
    : config_(std::move(config)), clock_(std::move(clock)) {}

Result<std::unique_ptr<WorkerCoordinator>> WorkerCoordinator::start(const Config& config,
                                                                    std::shared_ptr<const Clock> clock) {
  if (!clock) clock = SteadyClock::shared();
  std::unique_ptr<WorkerCoordinator> w(new WorkerCoordinator(config, clock));  // NOLINT: private constructor
  if (config.is_consumer()) {
    // Only the first pipeline stage holds encoder outputs; later stages neither
    // receive nor report (their empty `loaded` would void the intersection).
    if (config.layout.pp_rank == 0) {
      auto shard = consumer::ConsumerShard::start(config, clock);
      if (!shard) return shard.status();
      w->shard_ = std::move(*shard);
    } else if (!config.is_producer()) {
      w->reports_ = false;
    }
  }
  if (config.is_producer()) {
    auto engine = producer::PushEngine::start(config, clock);
    if (!engine) return engine.status();
    w->pushes_ = std::move(*engine);
  }
  return w;
}

WorkerCoordinator::~WorkerCoordinator() { shutdown(); }

Result<consumer::SlotLease> WorkerCoordinator::take(const scheduler::LoadSpec& load) {
  if (!shard_) return unavailable("this worker receives no encoder outputs (not a consumer's first PP stage)");
  auto lease =
      load.local ? shard_->take_resident(load.mm_hash, load.spec) : shard_->take(load.transfer_id, load.mm_hash);
  if (!lease) return lease.status();
  if (lease->spec() != load.spec) {
    return invalid_argument(fmt::format("transfer_id={}: landed {} but the scheduler expected {}", load.transfer_id,
                                        lease->spec().to_string(), load.spec.to_string()));
  }
  return lease;
}

LoadReport WorkerCoordinator::start_load_caches(const scheduler::ConnectorMeta& meta, const Allocate& allocate,
                                                const IsPresent& present) {
  LoadReport report;
  if (!shard_) return report;
  auto log = ecx::log::get("worker");
  for (const auto& load : meta.loads) {
    if (present && present(load.mm_hash)) {
      // Nothing to copy, but the transfer is consumed like any load: its record would
      // otherwise stay READY on the shard (holding its slot) until its lease ran out.
      if (auto lease = take(load)) lease->release();
      step_.loaded.insert(load.mm_hash);
      report.loaded.push_back(load.mm_hash);
      continue;
    }
    auto fail = [&](const Status& why) {
      log->warn("rank {}: load of mm_hash={} (transfer_id={}) failed: {}", config_.layout.tp_rank, load.mm_hash,
                load.transfer_id, why.to_string());
      step_.failed_loads.insert(load.mm_hash);
      report.failed.push_back(load.mm_hash);
    };
    auto lease = take(load);
    if (!lease) {
      fail(lease.status());
      continue;
    }
    auto destination = allocate(load);
    if (!destination) {
      fail(destination.status());
      continue;
    }
    const TimePoint copy_started = clock_->now();
    if (!destination->cuda) {
      std::memcpy(destination->data, lease->data(), lease->nbytes());
    } else {
      if (!cuda_) cuda_ = std::make_unique<CudaCopier>();
      Status copied = Status::ok();
      if (!cuda_->stager || cuda_->device != destination->device) {
        auto stager = pool::CudaStager::create(destination->device);
        if (stager) {
          cuda_->stager = std::move(*stager);
          cuda_->device = destination->device;
        } else {
          copied = stager.status();
        }
      }
      if (copied) {
        auto copy = cuda_->stager->copy_to_device(lease->data(), destination->data, lease->nbytes());
        copied =
            copy ? cuda_->stager->wait(*copy, clock_->now() + config_.push_wait_timeout(), *clock_) : copy.status();
      }
      if (!copied) {
        fail(copied);
        continue;
      }
    }
    stages::record(stages::Stage::load_copy, clock_->now() - copy_started);
    lease->release();
    step_.loaded.insert(load.mm_hash);
    report.loaded.push_back(load.mm_hash);
  }
  return report;
}

void WorkerCoordinator::start_save_caches(const scheduler::ConnectorMeta& meta) {
  if (!pushes_) return;
  for (const auto& p : meta.pushes) {
    pushes_->submit(producer::PushSpec{p.transfer_id, p.mm_hash, p.consumer_zmq, p.spec, p.request_id});
  }
}

Status WorkerCoordinator::save_cache(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                                     producer::SourceMemory memory) {
  if (!pushes_) return Status::ok();  // not a producer: vLLM calls save_caches on every role
  return pushes_->bind_source(mm_hash, data, nbytes, memory);
}

void WorkerCoordinator::get_finished(const std::vector<std::string>& finished_request_ids) {
  if (pushes_) pushes_->requests_finished(finished_request_ids);
}

std::optional<WorkerMeta> WorkerCoordinator::build_worker_meta() {
  if (!reports_) return std::nullopt;
  if (shard_) {
    for (auto& h : shard_->drain_reclaimed()) step_.reclaimed.insert(std::move(h));
  }
  if (pushes_) {
    for (auto& failure : pushes_->drain_failures()) {
      for (auto& request : failure.request_ids) step_.failed_saves.insert(std::move(request));
    }
    step_.pending_saves = pushes_->pending();
  }
  WorkerMeta out = std::move(step_);
  step_ = WorkerMeta{};
  return out;
}

void WorkerCoordinator::export_metrics(metrics::Registry& registry) {
  registry_ = &registry;
  if (shard_) collectors_.push_back(shard_->export_metrics(registry));
  if (pushes_) collectors_.push_back(pushes_->export_metrics(registry));
}

void WorkerCoordinator::shutdown() {
  if (registry_ != nullptr) {
    for (auto id : collectors_) registry_->remove_collector(id);
    collectors_.clear();
  }
  // One drain budget for the worker, whatever roles it holds: shutdown must end
  // within it even when every peer is gone.
  const auto budget = seconds_to_duration(config_.shutdown_drain_timeout_s);
  const auto deadline = std::chrono::steady_clock::now() + budget;
  if (pushes_) pushes_->shutdown(budget);
  if (shard_) {
    (void)shard_->shutdown(std::max<Duration>(
        Duration::zero(), std::chrono::duration_cast<Duration>(deadline - std::chrono::steady_clock::now())));
  }
  cuda_.reset();
}

}  // namespace ecx::worker
