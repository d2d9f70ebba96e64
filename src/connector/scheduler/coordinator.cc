#include "ecx/connector/scheduler/coordinator.h"

#include <mutex>
#include <utility>

#include "connector/scheduler/consumer_gate.h"
#include "connector/scheduler/coordinator_common.h"
#include "connector/scheduler/push_planner.h"
#include "connector/scheduler/request_failures.h"
#include "connector/scheduler/store_gate.h"

namespace ecx::scheduler {

CoordinatorOptions CoordinatorOptions::from_config(const Config& config, DType model_dtype,
                                                   std::int64_t model_hidden_width) {
  CoordinatorOptions o;
  o.is_producer = config.is_producer();
  o.is_consumer = config.is_consumer();
  o.control_address = config.control_address(0);
  o.push_wait_timeout = config.push_wait_timeout();
  o.readiness_recheck = seconds_to_duration(config.readiness_recheck_s);
  o.table.reservation_ttl = config.reservation_ttl();
  o.table.tombstone_max = config.tombstone_max;
  o.table.resident_capacity_bytes = config.effective_resident_capacity();
  o.cross_encoder_cache = config.cross_encoder_cache;
  // A prefetch is one store read (bounded by store_io_timeout_s) behind other prefetches.
  o.store_prefetch_timeout = seconds_to_duration(4 * config.store_io_timeout_s + 1.0);
  o.encoder_output_width = config.encoder_output_width > 0 ? config.encoder_output_width : model_hidden_width;
  o.encoder_dtype = model_dtype;
  o.max_tensor_bytes = config.effective_max_tensor_bytes();
  o.max_pending_shard_events = config.event_queue_max;
  o.max_notified_remembered = config.tombstone_max;
  return o;
}

namespace {

CoordinatorOptions normalized(CoordinatorOptions options) {
  if (options.cancel_attempts < 1) options.cancel_attempts = 1;
  return options;
}

}  // namespace

SchedulerCoordinator::SchedulerCoordinator(CoordinatorOptions options, std::shared_ptr<const Clock> clock,
                                           std::shared_ptr<EventSource> events,
                                           std::shared_ptr<ConsumerControl> control)
    : options_(normalized(std::move(options))),
      failures_(std::make_unique<RequestFailures>(options_.max_notified_remembered)),
      gate_(std::make_unique<ConsumerGate>(options_, clock, std::move(events), std::move(control), *failures_)),
      planner_(std::make_unique<PushPlanner>(options_, *failures_)),
      store_(std::make_unique<StoreGate>(options_, std::move(clock), *failures_)) {}

SchedulerCoordinator::~SchedulerCoordinator() { close(); }

void SchedulerCoordinator::close() {
  gate_->close();
  publish_stats();
}

struct SchedulerCoordinator::PublishedStats {
  std::mutex mutex;
  CoordinatorStats stats;  // guarded by mutex
};

void SchedulerCoordinator::publish_stats() {
  if (!published_) return;
  const CoordinatorStats now = stats();
  std::lock_guard lock(published_->mutex);
  published_->stats = now;
}

std::uint64_t SchedulerCoordinator::export_metrics(metrics::Registry& registry) {
  if (!published_) published_ = std::make_shared<PublishedStats>();
  publish_stats();
  return registry.add_collector([published = published_](metrics::SampleSink& sink) {
    CoordinatorStats s;
    {
      std::lock_guard lock(published->mutex);
      s = published->stats;
    }
    // One family, one series per label value.
    using Series = std::initializer_list<std::pair<std::string_view, std::uint64_t>>;
    auto family = [&sink](std::string_view name, std::string_view help, std::string_view label, Series series) {
      for (const auto& [value, count] : series) {
        sink.counter(name, help, count, {{std::string(label), std::string(value)}});
      }
    };
    family("scheduler_events_total",
           "Readiness, abandoned and failed events from the consumer shards, by what became of them", "outcome",
           {{"ready_accepted", s.ready_accepted},
            {"ready_ignored", s.ready_ignored},
            {"abandoned", s.abandoned_events},
            {"failed", s.failed_events},
            {"malformed", s.events_malformed}});
    family("scheduler_cancels_total",
           "Reservation cancels and releases sent to the consumer shards, by outcome (queued counts every one sent)",
           "outcome",
           {{"queued", s.cancels_queued},
            {"succeeded", s.cancels_succeeded},
            {"failed", s.cancels_failed},
            {"dropped", s.cancels_dropped},
            {"abandoned", s.cancels_abandoned},
            {"local_only", s.cancels_local_only}});
    sink.counter("scheduler_readiness_rechecks_total", "Waiting transfers asked about on every shard",
                 s.readiness_rechecks);
    sink.counter("scheduler_readiness_recovered_total",
                 "Readiness learnt by asking a shard before its event was drained (lost, or queued behind others)",
                 s.readiness_recovered);
    sink.counter("scheduler_rechecks_remembered_total",
                 "Re-checks of a waiting request answered from memory: nothing it waits on had changed",
                 s.rechecks_remembered);
    sink.counter("scheduler_pushes_planned_total", "Pushes the producer's scheduler planned", s.pushes_planned);
    sink.counter("scheduler_local_fallbacks_total", "Items whose push could no longer arrive, encoded locally instead",
                 s.local_fallbacks);
    sink.counter("scheduler_malformed_requests_total", "Requests whose ec_transfer_params did not parse",
                 s.malformed_requests);
    sink.counter("scheduler_store_hits_total", "has_cache_item answered from the shared embedding store", s.store_hits);
    sink.counter("scheduler_store_loads_total", "Items loaded from the shared store instead of encoded", s.store_loads);
    family("scheduler_subscription_rejected_total",
           "Messages on the scheduler's event subscription dropped before they became events, by why", "reason",
           {{"malformed", s.subscription_malformed},
            {"unknown_kind", s.subscription_unknown_kind},
            {"auth_failed", s.subscription_auth_failures}});
    family("scheduler_subscription_discoveries_total",
           "Topology discoveries of the consumer's shards for the event subscription (failed: retried after 1 s)",
           "outcome", {{"started", s.discoveries_started}, {"failed", s.discoveries_failed}});
  });
}

bool SchedulerCoordinator::wait_for_events(Duration max_wait, std::span<const WakeSource> also) const {
  return gate_->wait_for_events(max_wait, also);
}

bool SchedulerCoordinator::has_pending_push_work() const noexcept {
  if (gate_->closed()) return false;
  return planner_->pushes_in_flight() || gate_->loads_in_flight() || store_->work_in_flight();
}

bool SchedulerCoordinator::has_cache_item(std::string_view identifier) {
  // The consumer's own transfers first; the shared store after.
  return gate_->has_cache_item(identifier) || store_->has_cache_item(identifier);
}

void SchedulerCoordinator::set_store_presence(std::shared_ptr<StorePresence> store) {
  store_->set_store(std::move(store));
}

bool SchedulerCoordinator::ensure_cache_available(const RequestView& request, std::int64_t num_computed_tokens) {
  if (failures_->report_malformed(request)) {
    return !options_.unavailable_reaches_engine && gate_->release_malformed(request);
  }
  // The producer plans before the consumer drains: one instance can be both.
  planner_->plan_uncomputed(request, num_computed_tokens);
  const bool from_store = store_->admit(request, num_computed_tokens);
  if (!options_.is_consumer) return from_store;
  return gate_->admit(request, num_computed_tokens) && from_store;
}

void SchedulerCoordinator::update_state_after_alloc(const RequestView& request, std::size_t index) {
  if (index >= request.mm_features.size()) {
    detail::coordinator_logger()->error("EC update_state_after_alloc: index {} out of range for request {} ({} items)",
                                        index, detail::shorten(request.request_id), request.mm_features.size());
    return;
  }
  gate_->after_alloc(request, index);
  planner_->after_alloc(request, index, store_->after_alloc(request, index));
}

void SchedulerCoordinator::update_state_after_free(const RequestView& request, std::size_t index) {
  gate_->after_free(request, index);
}

ConnectorMeta SchedulerCoordinator::build_connector_meta(const StepView& step) {
  ConnectorMeta meta;
  // Disjoint parts of the plan: the planner's pushes and store candidates, the
  // gate's frees, orphan cancels and loads.
  planner_->take_step(step, meta);
  store_->take_step(meta);
  gate_->build_step(step, meta);
  publish_stats();
  return meta;
}

void SchedulerCoordinator::update_connector_output(const WorkerOutput& output) {
  gate_->take_output(output);
  planner_->note_pending_saves(output.pending_saves);
  store_->take_output(output);
  failures_->add_failed_saves(output.failed_saves);
}

FinishedResult SchedulerCoordinator::request_finished(const RequestView& request) {
  gate_->finish(request);
  failures_->forget(request.request_id);
  FinishedResult result;
  result.params = planner_->finish(request);
  return result;
}

std::vector<std::string> SchedulerCoordinator::take_unavailable_requests() {
  return failures_->take(gate_->take_unavailable_requests());
}

const TransferTable& SchedulerCoordinator::table() const noexcept { return gate_->table(); }

std::size_t SchedulerCoordinator::pending_remote_cancels() const noexcept { return gate_->channel().pending_cancels(); }

CoordinatorStats SchedulerCoordinator::stats() const noexcept {
  const ConsumerChannel::Stats& channel = gate_->channel().stats();
  const ConsumerGate::Stats& gate = gate_->stats();
  const PushPlanner::Stats& planner = planner_->stats();
  const RequestFailures::Stats& failures = failures_->stats();
  CoordinatorStats s;
  s.drains = channel.drains;
  s.events_received = channel.events_received;
  s.events_malformed = channel.events_malformed;
  s.ready_accepted = channel.ready_accepted;
  s.ready_ignored = channel.ready_ignored;
  s.awaiting_shards = channel.awaiting_shards;
  s.partial_dropped = channel.partial_dropped;
  s.abandoned_events = channel.abandoned_events;
  s.failed_events = channel.failed_events;
  s.pushes_planned = planner.pushes_planned;
  const SubscriptionCounters subscription = gate_->channel().subscription_counters();
  s.subscription_malformed = subscription.malformed;
  s.subscription_unknown_kind = subscription.unknown_kind;
  s.subscription_auth_failures = subscription.auth_failures;
  s.discoveries_started = subscription.discoveries_started;
  s.discoveries_failed = subscription.discoveries_failed;
  const auto& store = store_->stats();
  s.store_lookups = store.lookups;
  s.store_hits = store.hits;
  s.store_prefetches = store.prefetches;
  s.store_prefetch_failures = store.prefetch_failures;
  s.store_prefetch_timeouts = store.prefetch_timeouts;
  s.store_loads = store.loads;
  s.store_load_failures = store.load_failures;
  s.push_conflicts = planner.push_conflicts;
  s.unresolved_transfer_ids = failures.unresolved_transfer_ids;
  s.malformed_requests = failures.malformed_requests;
  s.cancels_queued = channel.cancels_queued;
  s.cancels_succeeded = channel.cancels_succeeded;
  s.cancels_failed = channel.cancels_failed;
  s.cancels_dropped = channel.cancels_dropped;
  s.cancels_local_only = channel.cancels_local_only;
  s.readiness_rechecks = channel.readiness_rechecks;
  s.rechecks_failed = channel.rechecks_failed;
  s.readiness_recovered = channel.readiness_recovered;
  s.cancels_abandoned = channel.cancels_abandoned;
  s.alloc_loads = gate.alloc_loads;
  s.alloc_load_misses = gate.alloc_load_misses;
  s.rechecks_remembered = gate.rechecks_remembered;
  s.local_fallbacks = gate.local_fallbacks;
  s.stranded_items = gate.stranded_items + store.stranded;
  return s;
}

SchedulerCoordinator::Bookkeeping SchedulerCoordinator::bookkeeping() const noexcept {
  Bookkeeping b = gate_->bookkeeping();
  b.malformed_pending = failures_->pending();
  b.push_bindings = planner_->bindings();
  return b;
}

}  // namespace ecx::scheduler
