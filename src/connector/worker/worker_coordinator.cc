#include "ecx/connector/worker/worker_coordinator.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <unordered_map>

#include <fmt/format.h>

#include "connector/worker/store_prefetcher.h"
#include "core/logging.h"
#include "ecx/core/stages.h"
#include "ecx/pool/cuda_staging.h"
#include "ecx/store/store_config.h"

namespace ecx::worker {

namespace {

using Hashes = std::set<std::string>;
Hashes united(const Hashes& a, const Hashes& b) {
  Hashes out = a;
  out.insert(b.begin(), b.end());
  return out;
}
// What both ranks hold, less what either failed.
Hashes held_by_both(const Hashes& a, const Hashes& b, const Hashes& failed) {
  Hashes out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::inserter(out, out.end()));
  for (const auto& h : failed) out.erase(h);
  return out;
}

}  // namespace

WorkerMeta WorkerMeta::aggregate(const WorkerMeta& other) const {
  WorkerMeta out;
  out.failed_loads = united(failed_loads, other.failed_loads);
  out.loaded = held_by_both(loaded, other.loaded, out.failed_loads);
  out.reclaimed = united(reclaimed, other.reclaimed);
  out.failed_saves = united(failed_saves, other.failed_saves);
  out.pending_saves = pending_saves || other.pending_saves;
  out.store_failed = united(store_failed, other.store_failed);
  out.store_ready = held_by_both(store_ready, other.store_ready, out.store_failed);
  out.store_dropped = united(store_dropped, other.store_dropped);
  return out;
}

scheduler::WorkerOutput WorkerMeta::to_output() const {
  scheduler::WorkerOutput out;
  out.loaded.assign(loaded.begin(), loaded.end());
  out.failed_loads.assign(failed_loads.begin(), failed_loads.end());
  out.reclaimed.assign(reclaimed.begin(), reclaimed.end());
  out.pending_saves = pending_saves;
  out.failed_saves.assign(failed_saves.begin(), failed_saves.end());
  out.store_ready.assign(store_ready.begin(), store_ready.end());
  out.store_failed.assign(store_failed.begin(), store_failed.end());
  out.store_dropped.assign(store_dropped.begin(), store_dropped.end());
  return out;
}

// Host -> device copies of landed slots, on one stream owned by the worker thread.
struct WorkerCoordinator::CudaCopier {
  std::unique_ptr<pool::CudaStager> stager;
  int device = -1;
};

// The cross-encoder cache: a store connection for loads and its prefetcher; on a
// producer also a publisher (its own connection) for computed outputs, and the
// candidates the scheduler named.
struct WorkerCoordinator::StoreSide {
  static constexpr std::size_t kMaxWanted = 4'096;  // candidates remembered until their save_cache
  std::shared_ptr<store::EmbeddingStore> loads;
  std::shared_ptr<store::EmbeddingStore> publishing;
  std::unique_ptr<store::Publisher> publisher;
  std::unordered_map<std::string, TensorSpec> wanted;
  std::deque<std::string> wanted_order;
  // Written on the worker thread, read by the metrics collector.
  std::atomic<std::uint64_t> loaded{0};
  std::atomic<std::uint64_t> load_failures{0};
  std::atomic<std::uint64_t> publish_skipped{0};  // no room: not even copied
  std::vector<std::byte> bounce;                  // device loads land here first
  store::PublisherCounters publisher_at_stop;     // once the publisher is gone
  std::unique_ptr<StorePrefetcher> prefetcher;    // last: its thread reads `loads`

  store::PublisherCounters publisher_counters() const { return publisher ? publisher->counters() : publisher_at_stop; }

  void want(const scheduler::StoreCandidate& c) {
    if (wanted.insert_or_assign(c.mm_hash, c.spec).second) wanted_order.push_back(c.mm_hash);
    while (wanted.size() > kMaxWanted && !wanted_order.empty()) {
      wanted.erase(wanted_order.front());
      wanted_order.pop_front();
    }
    if (wanted_order.size() > 2 * kMaxWanted) {
      std::erase_if(wanted_order, [&](const std::string& h) { return !wanted.contains(h); });
    }
  }
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
  // Producers load hits and publish; a consumer's first PP stage loads the items routed
  // to the store (no publishing: a consumer's own encodes are not store candidates).
  if (config.cross_encoder_cache && (w->pushes_ || w->shard_)) {
    auto loads = store::open_store(config, clock);
    if (!loads) return loads.status();
    w->store_ = std::make_unique<StoreSide>();
    w->store_->loads = std::move(*loads);
    if (w->pushes_) {
      // Two connections: a 9 MiB publish must not hold up a load the engine waits for.
      auto publishing = store::open_store(config, clock);
      if (!publishing) return publishing.status();
      w->store_->publishing = std::move(*publishing);
      w->store_->publisher =
          std::make_unique<store::Publisher>(w->store_->publishing, store::publisher_options(config));
    }
    // Held copies the engine does not allocate within a minute are given back.
    w->store_->prefetcher = std::make_unique<StorePrefetcher>(w->store_->loads, config.store_prefetch_max_bytes,
                                                              std::chrono::seconds(60), clock);
    ecx::log::get("worker")->info("cross-encoder cache on {} (prefix {}, model {}{})", w->store_->loads->describe(),
                                  config.store_prefix, config.store_model, w->store_->publisher ? "" : ", loads only");
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

Status WorkerCoordinator::copy_to_device(const void* host, const LoadDestination& destination, std::uint64_t nbytes) {
  if (!cuda_) cuda_ = std::make_unique<CudaCopier>();
  if (!cuda_->stager || cuda_->device != destination.device) {
    auto stager = pool::CudaStager::create(destination.device);
    if (!stager) return stager.status();
    cuda_->stager = std::move(*stager);
    cuda_->device = destination.device;
  }
  auto copy = cuda_->stager->copy_to_device(host, destination.data, nbytes);
  if (!copy) return copy.status();
  return cuda_->stager->wait(*copy, clock_->now() + config_.push_wait_timeout(), *clock_);
}

LoadReport WorkerCoordinator::start_load_caches(const scheduler::ConnectorMeta& meta, const Allocate& allocate,
                                                const IsPresent& present) {
  return start_load_caches(meta, allocate, nullptr, present);
}

LoadReport WorkerCoordinator::start_load_caches(const scheduler::ConnectorMeta& meta, const Allocate& allocate,
                                                const Adopt& adopt, const IsPresent& present) {
  LoadReport report;
  if (store_) load_from_store(meta, allocate, report);
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
    TimePoint copy_started = clock_->now();
    if (adopt) {
      // The hand-over is the whole load: recorded as load_copy so the stage table
      // shows what the engine's critical path paid (about nothing).
      if (Status adopted = adopt(load, std::move(*lease)); !adopted) {
        fail(adopted);
        continue;
      }
    } else {
      auto destination = allocate(load);
      if (!destination) {
        fail(destination.status());
        continue;
      }
      copy_started = clock_->now();  // the engine's allocation is not the load's copy
      if (!destination->cuda) {
        std::memcpy(destination->data, lease->data(), lease->nbytes());
      } else if (Status copied = copy_to_device(lease->data(), *destination, lease->nbytes()); !copied) {
        fail(copied);
        continue;
      }
      lease->release();
    }
    stages::record(stages::Stage::load_copy, clock_->now() - copy_started);
    step_.loaded.insert(load.mm_hash);
    report.loaded.push_back(load.mm_hash);
  }
  return report;
}

void WorkerCoordinator::load_from_store(const scheduler::ConnectorMeta& meta, const Allocate& allocate,
                                        LoadReport& report) {
  auto log = ecx::log::get("worker");
  for (const auto& item : meta.store_loads) {
    const scheduler::LoadSpec load{item.mm_hash, std::string(), item.spec, false};
    Status loaded = Status::ok();
    std::string_view from = "its prefetched copy";
    if (auto copy = store_->prefetcher->take(item.mm_hash); copy && copy->spec == item.spec) {
      // Verified when it was prefetched: a local copy into the engine's allocation.
      auto d = allocate(load);
      loaded = d.status();
      if (loaded && !d->cuda) std::memcpy(d->data, copy->bytes.data(), copy->bytes.size());
      if (loaded && d->cuda) loaded = copy_to_device(copy->bytes.data(), *d, copy->bytes.size());
    } else {
      from = "the store";
      std::optional<LoadDestination> destination;
      auto land = [&](const TensorSpec& spec) -> Result<std::span<std::byte>> {
        // An entry of another shape is not this item's output (another model revision
        // with the same identity, say): refused, and the item is encoded elsewhere.
        if (spec != item.spec) {
          return invalid_argument(
              fmt::format("the store holds {} but the engine expects {}", spec.to_string(), item.spec.to_string()));
        }
        auto d = allocate(load);
        if (!d) return d.status();
        destination = *d;
        if (!d->cuda) return std::span<std::byte>(static_cast<std::byte*>(d->data), spec.nbytes());
        store_->bounce.resize(spec.nbytes());
        return std::span<std::byte>(store_->bounce);
      };
      loaded = store_->loads->get_into(item.mm_hash, land).status();
      if (loaded && destination && destination->cuda) {
        loaded = copy_to_device(store_->bounce.data(), *destination, item.spec.nbytes());
      }
    }
    if (!loaded) {
      ++store_->load_failures;
      log->warn("load of mm_hash={} from {} failed: {}", item.mm_hash, from, loaded.to_string());
      step_.failed_loads.insert(item.mm_hash);
      report.failed.push_back(item.mm_hash);
      continue;
    }
    ++store_->loaded;
    step_.loaded.insert(item.mm_hash);
    report.loaded.push_back(item.mm_hash);
  }
  // After the loads: the scheduler asks again for an item whose copy one of this step's
  // loads takes (another request wants it too). Asked first, the prefetcher would find the
  // copy still held, answer it ready, and then lose it to the load: that request would
  // wait its whole store_prefetch_timeout for an answer that never comes.
  for (const auto& item : meta.store_prefetches) store_->prefetcher->request(item);
}

void WorkerCoordinator::start_save_caches(const scheduler::ConnectorMeta& meta) {
  if (!pushes_) return;
  if (store_) {
    for (const auto& c : meta.store_candidates) store_->want(c);
  }
  for (const auto& p : meta.pushes) {
    pushes_->submit(producer::PushSpec{p.transfer_id, p.mm_hash, p.consumer_zmq, p.spec, p.request_id});  // one copy
  }
}

Status WorkerCoordinator::save_cache(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                                     producer::SourceMemory memory) {
  if (!pushes_) return Status::ok();  // not a producer: vLLM calls save_caches on every role
  Status bound = pushes_->bind_source(mm_hash, data, nbytes, memory);
  if (store_) publish(mm_hash, data, nbytes, memory);
  return bound;
}

Status WorkerCoordinator::lend_cache(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                                     std::function<void()> release) {
  if (!pushes_ || !config_.zero_copy_saves || nbytes < config_.zero_copy_saves_min_bytes) {
    Status bound = save_cache(mm_hash, data, nbytes, producer::SourceMemory::host);
    if (release) release();
    return bound;
  }
  if (store_) publish(mm_hash, data, nbytes, producer::SourceMemory::host);  // copies what it keeps
  return pushes_->lend_source(mm_hash, data, nbytes, std::move(release));
}

void WorkerCoordinator::publish(std::string_view mm_hash, const void* data, std::uint64_t nbytes,
                                producer::SourceMemory memory) {
  auto it = store_->wanted.find(std::string(mm_hash));
  if (it == store_->wanted.end()) return;
  const TensorSpec spec = it->second;
  store_->wanted.erase(it);
  if (spec.nbytes() != nbytes || !store_->publisher || !store_->publisher->has_room(nbytes)) {
    ++store_->publish_skipped;
    return;
  }
  std::vector<std::byte> payload(nbytes);
  if (memory == producer::SourceMemory::host) {
    std::memcpy(payload.data(), data, nbytes);
  } else {
    // After the push's own staging copy: the output is read from the device twice
    // rather than making the push wait for the store.
    if (!cuda_) cuda_ = std::make_unique<CudaCopier>();
    Status copied = Status::ok();
    if (!cuda_->stager) {
      auto stager = pool::CudaStager::create(0);
      if (stager) {
        cuda_->stager = std::move(*stager);
        cuda_->device = 0;
      } else {
        copied = stager.status();
      }
    }
    if (copied) {
      auto copy = cuda_->stager->copy_to_host(data, payload.data(), nbytes);
      copied = copy ? cuda_->stager->wait(*copy, clock_->now() + config_.push_wait_timeout(), *clock_) : copy.status();
    }
    if (!copied) {
      ++store_->publish_skipped;
      ecx::log::get("worker")->debug("not publishing mm_hash={}: {}", mm_hash, copied.to_string());
      return;
    }
  }
  (void)store_->publisher->offer(std::string(mm_hash), spec, std::move(payload));
}

StoreWorkerCounters WorkerCoordinator::store_counters() const {
  StoreWorkerCounters c;
  if (!store_) return c;
  const auto loads = store_->loads->counters();
  const auto writes = store_->publishing ? store_->publishing->counters() : store::StoreCounters{};
  const auto p = store_->publisher_counters();
  const auto prefetch = store_->prefetcher->counters();
  c.prefetched = prefetch.prefetched;
  c.prefetch_failures = prefetch.failed;
  c.prefetch_dropped = prefetch.dropped;
  c.prefetch_held_bytes = prefetch.held_bytes;
  c.loads = store_->loaded;
  c.load_failures = store_->load_failures;
  c.bytes_loaded = loads.bytes_loaded;
  c.offered = p.offered + store_->publish_skipped;
  c.published = p.published;
  c.bytes_published = writes.bytes_published;
  c.publish_dropped = p.dropped_full + p.dropped_at_stop + store_->publish_skipped;
  c.publish_failed = p.failed;
  c.store_errors = loads.errors + writes.errors;
  c.rejected = loads.rejected;
  return c;
}

bool WorkerCoordinator::wait_published(std::chrono::milliseconds timeout) {
  return !store_ || !store_->publisher || store_->publisher->wait_idle(timeout);
}

void WorkerCoordinator::get_finished(const std::vector<std::string>& finished_request_ids) {
  if (pushes_) pushes_->requests_finished(finished_request_ids);
}

std::optional<WorkerMeta> WorkerCoordinator::build_worker_meta() {
  if (!reports_) return std::nullopt;
  if (shard_) {
    for (auto& h : shard_->drain_reclaimed()) step_.reclaimed.insert(std::move(h));
  }
  if (store_) {
    auto r = store_->prefetcher->drain();
    step_.store_ready.insert(r.ready.begin(), r.ready.end());
    step_.store_failed.insert(r.failed.begin(), r.failed.end());
    step_.store_dropped.insert(r.dropped.begin(), r.dropped.end());
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
  if (store_) {
    collectors_.push_back(registry.add_collector([this](metrics::SampleSink& sink) {
      const StoreWorkerCounters c = store_counters();
      sink.counter("store_prefetched_total", "Store entries read and verified ahead of their allocation", c.prefetched);
      sink.counter("store_prefetch_failures_total", "Prefetches the store could not give (the item is encoded)",
                   c.prefetch_failures);
      sink.counter("store_prefetch_dropped_total", "Prefetched copies nobody allocated in time", c.prefetch_dropped);
      sink.gauge("store_prefetch_held_bytes", "Host bytes of prefetched store entries held", c.prefetch_held_bytes);
      sink.counter("store_loads_total", "Items loaded from the shared store instead of encoded", c.loads);
      sink.counter("store_load_failures_total", "Store loads that failed (absent, corrupt, store down or slow)",
                   c.load_failures);
      sink.counter("store_loaded_bytes_total", "Payload bytes loaded from the store", c.bytes_loaded);
      sink.counter("store_publish_offered_total", "Computed outputs offered for publishing", c.offered);
      sink.counter("store_published_total", "Computed outputs written to the store", c.published);
      sink.counter("store_published_bytes_total", "Payload bytes written to the store", c.bytes_published);
      sink.counter("store_publish_dropped_total", "Outputs not published: pending bounds full, or at shutdown",
                   c.publish_dropped);
      sink.counter("store_publish_failed_total", "Publishes the store refused or could not take", c.publish_failed);
      sink.counter("store_errors_total", "Store calls that failed on the store itself", c.store_errors);
      sink.counter("store_rejected_total", "Store entries refused by their checks (checksum, model, size)", c.rejected);
    }));
  }
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
  if (store_ && store_->publisher) {
    // Best effort: what is written within a share of the budget is kept, the rest dropped (counted).
    (void)store_->publisher->wait_idle(std::chrono::duration_cast<std::chrono::milliseconds>(budget / 4));
    auto publisher = std::move(store_->publisher);
    store::PublisherCounters last = publisher->counters();
    // What is pending now is dropped by the publisher's stop (an entry it finishes
    // writing meanwhile is counted dropped, not published: the figures stay conservative).
    last.dropped_at_stop += last.pending_items;
    last.pending_items = 0;
    last.pending_bytes = 0;
    publisher.reset();
    store_->publisher_at_stop = last;
  }
  if (shard_) {
    (void)shard_->shutdown(std::max<Duration>(
        Duration::zero(), std::chrono::duration_cast<Duration>(deadline - std::chrono::steady_clock::now())));
  }
  cuda_.reset();
}

}  // namespace ecx::worker
