#include "ecx/consumer/consumer_shard.h"

#include <atomic>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/core/sanitizers.h"
#include "ecx/core/stages.h"
#include "ecx/pool/slab.h"
#include "ecx/transport/factory.h"
#include "ecx/wire/payload_header.h"

namespace ecx::consumer {
namespace {

Result<pool::Slab> allocate_receive_pool(const Config& config) {
  pool::SlabOptions options;
  options.huge_pages = config.huge_pages;
  options.lock = config.mlock;
  options.prefault = config.prefault;
  if (config.buffer_device == "cpu") {
    options.register_with_cuda = false;
    return pool::Slab::allocate(pool::MemoryKind::host, config.buffer_size, options);
  }
  // A CUDA consumer lands payloads in pinned host memory (Debian's UCX cannot write
  // device memory); the worker's load copies them to the device.
  options.cuda_device = config.buffer_device.size() > 5 ? std::stoi(config.buffer_device.substr(5)) : 0;
  return pool::Slab::allocate(pool::MemoryKind::cuda_pinned, config.buffer_size, options);
}

wire::Event to_wire(const ReservationEvent& event) {
  wire::Event out;
  std::visit(
      [&out](const auto& e) {
        using T = std::decay_t<decltype(e)>;
        out.transfer_id = e.transfer_id;
        out.mm_hash = e.mm_hash;
        if constexpr (std::is_same_v<T, ReadyEvent>) {
          out.kind = wire::EventKind::ready;
          out.reservation_id = e.reservation_id;
          out.spec = e.spec;
          out.sent_ns = stages::monotonic_ns();
        } else if constexpr (std::is_same_v<T, AbandonedEvent>) {
          out.kind = wire::EventKind::abandoned;
        } else {
          out.kind = wire::EventKind::failed;
          out.error = unavailable(e.reason);
        }
      },
      event);
  return out;
}

wire::ReserveResult to_wire(const ReserveOutcome& result, bool one_sided) {
  return std::visit(
      [one_sided](const auto& r) -> wire::ReserveResult {
        using T = std::decay_t<decltype(r)>;
        if constexpr (std::is_same_v<T, outcome::Reserved>) {
          return wire::ReserveResult::reserved(r.reservation_id, r.generation, r.slot_length, r.write,
                                               one_sided ? std::optional<std::uint64_t>(r.slot_offset) : std::nullopt);
        } else if constexpr (std::is_same_v<T, outcome::Ready>) {
          return wire::ReserveResult::ready(r.reservation_id, r.cached);
        } else if constexpr (std::is_same_v<T, outcome::Cancelled>) {
          return wire::ReserveResult::cancelled();
        } else if constexpr (std::is_same_v<T, outcome::RetryAfter>) {
          const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(r.delay).count();
          return wire::ReserveResult::retry(static_cast<std::uint32_t>(std::max<long long>(1, ms)));
        } else {
          return wire::ReserveResult::failed(r.status);
        }
      },
      result);
}

}  // namespace

struct ConsumerShard::State : std::enable_shared_from_this<ConsumerShard::State> {
  Config config;
  std::shared_ptr<const Clock> clock;
  std::shared_ptr<spdlog::logger> log = ecx::log::get("consumer");
  std::optional<pool::Slab> slab;
  std::shared_ptr<ReservationManager> reservations;
  transport::OwnedTransport transport;  // its counters are read by the metrics collector too
  transport::RegionHandle region;
  std::string data_address;
  bool one_sided = false;  // producers write the pool themselves and `complete` (feature "one_sided")
  // Headers of the payloads landing now, by landing token. Only the data plane's
  // progress thread touches them (resolve, then landed, once per landing).
  std::unordered_map<std::uint64_t, wire::PayloadHeader> landing_headers;
  std::uint64_t last_landing_token = 0;
  std::unique_ptr<control::ControlServer> server;
  std::atomic<control::ControlServer*> publisher{nullptr};
  // The server whose held reserves a freed slot wakes; null when not serving.
  std::shared_ptr<std::atomic<control::ControlServer*>> space_listener =
      std::make_shared<std::atomic<control::ControlServer*>>(nullptr);
  std::atomic<std::uint64_t> headers_rejected{0};
  std::mutex shutdown_mutex;
  std::optional<DrainReport> drained;

  // Sends every event the reservation manager queued. Any thread.
  void publish_events() {
    auto* server_ptr = publisher.load(std::memory_order_acquire);
    if (server_ptr == nullptr) return;  // not serving yet: events wait (bounded) in the manager
    for (auto& event : reservations->drain_events()) {
      if (auto s = server_ptr->publish(to_wire(event)); !s) {
        log->warn("shard {}: dropping an event for transfer_id={}: {}", config.layout.tp_rank,
                  std::visit([](const auto& e) { return e.transfer_id; }, event), s.to_string());
      }
    }
  }

  Result<transport::Landing> resolve(std::span<const std::byte> header_bytes, std::uint64_t payload_bytes) {
    auto header = wire::decode_payload_header(header_bytes);
    if (!header) {
      headers_rejected.fetch_add(1, std::memory_order_relaxed);
      log->warn("shard {}: rejected a payload with an unreadable header: {}", config.layout.tp_rank,
                header.status().message());
      return header.status();
    }
    if (header->nbytes != payload_bytes) {
      return invalid_argument(fmt::format("transfer_id={}: header says {} bytes, payload has {}", header->transfer_id,
                                          header->nbytes, payload_bytes));
    }
    if (header->direct) return resolve_direct(*std::move(header));
    const auto resolution =
        reservations->resolve_landing(header->transfer_id, header->reservation_id, payload_bytes, header->generation);
    if (!resolution.accepted()) {
      // The producer only learns "rejected": say here why, with what the record is now
      // (cancelled or expired records refuse a late payload; nothing else should).
      const auto state = reservations->state_of(header->transfer_id);
      auto refused = unavailable(fmt::format("transfer_id={}: payload refused ({}; record {})", header->transfer_id,
                                             landing_refusal_name(resolution.refusal),
                                             state ? reservation_state_name(*state) : "gone"));
      log->info("shard {}: {}", config.layout.tp_rank, refused.message());
      return refused;
    }
    return accept(*std::move(header), *resolution.target);
  }

  // A small payload sent without a reservation: it reserves now. One turned away is
  // expected under load (its producer reserves the usual way next), so it logs at debug.
  Result<transport::Landing> resolve_direct(wire::PayloadHeader header) {
    const wire::DirectItem& item = *header.direct;
    auto resolution = reservations->resolve_direct_landing(
        ReserveRequest{header.transfer_id, item.mm_hash, item.spec, header.checksum});
    if (!resolution.landing.accepted()) {
      auto refused = resource_exhausted(fmt::format("transfer_id={}: direct payload turned away (its reserve: {})",
                                                    header.transfer_id, resolution.reserve_outcome));
      log->debug("shard {}: {}", config.layout.tp_rank, refused.message());
      return refused;
    }
    header.reservation_id = resolution.reservation_id;
    header.generation = resolution.landing.target->generation;
    return accept(std::move(header), *resolution.landing.target);
  }

  // The landing's token names the decoded header, so landed() need not decode it again.
  transport::Landing accept(wire::PayloadHeader header, const LandingTarget& target) {
    const std::uint64_t token = ++last_landing_token;
    landing_headers.emplace(token, std::move(header));
    return transport::Landing{target.data, target.length, token};
  }

  void landed(const transport::Landing& landing, const Status& status) {
    auto it = landing_headers.find(landing.token);
    if (it == landing_headers.end()) return;  // only resolved landings come back, each once
    const wire::PayloadHeader header = std::move(it->second);
    landing_headers.erase(it);
    if (!status) {
      log->warn("shard {}: payload for transfer_id={} did not arrive: {}", config.layout.tp_rank, header.transfer_id,
                status.to_string());
    }
    const TimePoint verify_started = clock->now();
    reservations->complete_landing(header.transfer_id, header.reservation_id, status.is_ok(), header.checksum);
    if (status) stages::record(stages::Stage::landing, clock->now() - verify_started);
    publish_events();
  }
};

namespace {

// The control server's view of the shard; runs on the server's thread.
class ShardHandler final : public control::ControlHandler {
 public:
  // Not owning: the State owns the server that owns this handler, and destroys the
  // server (joining its thread) before anything the handler reads. An owning pointer
  // here made a cycle that kept every shard alive after shutdown.
  explicit ShardHandler(ConsumerShard::State* state) : state_(state) {}

  void describe(wire::HelloReply& reply) override {
    const auto& c = state_->config;
    reply.data.transport = std::string(state_->transport->name());
    reply.data.address = state_->data_address;
    if (state_->one_sided) {
      reply.data.segment = state_->data_address;
      reply.data.base = reinterpret_cast<std::uint64_t>(state_->slab->data());
    }
    // One-sided: the producer writes at the reserved offset, then `complete`s. UCX's
    // put mode still lands through a grant the shard picks from the payload's header.
    reply.features.emplace_back(state_->one_sided ? wire::kFeatureOneSided : wire::kFeatureReceiverLands);
    if (c.checksum) reply.features.emplace_back(wire::kFeatureChecksum);
    if (state_->transport->capabilities().confirmed_sends) reply.features.emplace_back(wire::kFeatureDirect);
    if (!c.auth_secret.empty()) reply.features.emplace_back(wire::kFeatureAuth);
    reply.pool_bytes = state_->slab->size();
    reply.max_tensor_bytes = c.effective_max_tensor_bytes();
  }

  std::vector<wire::ReserveResult> reserve_batch(const control::RequestContext& /*context*/,
                                                 std::span<const wire::ReserveItem> items) override {
    std::vector<wire::ReserveResult> results;
    results.reserve(items.size());
    const bool one_sided = state_->one_sided;
    for (const auto& item : items) {
      ReserveRequest request{item.transfer_id, item.mm_hash, item.spec, item.checksum};
      results.push_back(to_wire(state_->reservations->reserve(request), one_sided));
    }
    state_->publish_events();
    return results;
  }

  Result<wire::CancelReply> cancel(const control::RequestContext& /*context*/,
                                   const wire::CancelRequest& request) override {
    const auto result = state_->reservations->cancel(
        CancelRequest{request.transfer_id, request.reservation_id, request.abandon, request.refresh});
    state_->publish_events();
    return wire::CancelReply{cancel_accepted(result)};
  }
  // The reservation manager and the publisher are thread-safe (the transport's thread
  // lands and publishes too): the scheduler of this process releases without the network.
  bool cancel_runs_anywhere() const noexcept override { return true; }

  Result<wire::StatusReply> status(const control::RequestContext& /*context*/,
                                   const wire::StatusRequest& request) override {
    wire::StatusReply reply;
    if (auto record = state_->reservations->describe(request.transfer_id)) {
      reply.found = true;
      reply.state = std::string(reservation_state_name(record->state));
      reply.mm_hash = std::move(record->mm_hash);
      reply.reservation_id = record->reservation_id;
      reply.generation = record->generation;
      reply.spec = record->spec;
    }
    return reply;
  }

  Result<wire::CompleteReply> complete(const control::RequestContext& /*context*/,
                                       const wire::CompleteRequest& request) override {
    // As protocol.md §4.5 says: only a shard advertising `put` takes completions.
    if (!state_->one_sided) return protocol_error("this shard does not accept 'complete' (it lands payloads itself)");
    const auto result = state_->reservations->writer_completed(request.transfer_id, request.reservation_id,
                                                               request.checksum, request.generation);
    state_->publish_events();
    return wire::CompleteReply{result != CompletionOutcome::rejected, result == CompletionOutcome::became_ready};
  }

  void tick(TimePoint /*now*/) override {
    state_->reservations->expire();
    state_->publish_events();
  }

 private:
  ConsumerShard::State* state_;
};

}  // namespace

Result<std::unique_ptr<ConsumerShard>> ConsumerShard::start(const Config& config, std::shared_ptr<const Clock> clock) {
  auto state = std::make_shared<State>();
  state->config = config;
  state->clock = clock ? std::move(clock) : SteadyClock::shared();
  const int rank = config.layout.tp_rank;

  auto slab = allocate_receive_pool(config);
  if (!slab)
    return Status(slab.status().code(), fmt::format("shard {}: receive pool: {}", rank, slab.status().message()));
  state->slab.emplace(std::move(*slab));
  std::weak_ptr<State> weak = state;
  transport::ReceiverHooks hooks;
  hooks.resolver = [weak](std::span<const std::byte> header, std::uint64_t bytes) -> Result<transport::Landing> {
    auto s = weak.lock();
    if (!s) return unavailable("shard is shutting down");
    return s->resolve(header, bytes);
  };
  hooks.on_landing = [weak](std::span<const std::byte>, const transport::Landing& landing, const Status& status) {
    if (auto s = weak.lock()) s->landed(landing, status);
  };
  auto created =
      transport::create_data_plane(config, state->clock, transport::DataPlaneRole::receiver, std::move(hooks));
  if (!created)
    return Status(created.status().code(), fmt::format("shard {}: data plane: {}", rank, created.status().message()));
  state->transport = std::move(*created);
  state->one_sided = state->transport->capabilities().landing == transport::LandingChoice::sender;
  auto reservation_options = ReservationOptions::from_config(config, state->slab->data(), state->slab->size());
  reservation_options.mode = state->one_sided ? LandingMode::one_sided : LandingMode::receiver_chosen;
  // A freed slot wakes the reserves the control server holds for space. The pointer is
  // shared, not the state: a lease may be released after the shard is gone.
  reservation_options.space_freed = [listener = state->space_listener] {
    if (auto* server = listener->load(std::memory_order_acquire)) server->capacity_changed();
  };
  state->reservations = std::make_shared<ReservationManager>(std::move(reservation_options), state->clock);
  auto region =
      state->transport->register_region(state->slab->data(), state->slab->size(), transport::MemoryKind::host);
  if (!region) return region.status();
  state->region = *region;
  auto address = state->transport->listen(config.effective_data_ip(), 0);
  if (!address)
    return Status(address.status().code(), fmt::format("shard {}: data plane: {}", rank, address.status().message()));
  state->data_address = *address;

  auto server_options = control::ServerOptions::from_config(config);
  server_options.clock = state->clock;
  auto server = control::ControlServer::start(server_options, std::make_shared<ShardHandler>(state.get()));
  if (!server) return Status(server.status().code(), fmt::format("shard {}: {}", rank, server.status().message()));
  state->server = std::move(*server);
  state->publisher.store(state->server.get(), std::memory_order_release);
  state->space_listener->store(state->server.get(), std::memory_order_release);
  state->log->info("consumer shard {} serving: control {}, events {}, data {} ({}), pool {}", rank,
                   state->server->control_endpoint(), state->server->event_endpoint(), state->data_address,
                   transport::describe_data_plane(config), format_bytes(state->slab->size()));
  return std::unique_ptr<ConsumerShard>(new ConsumerShard(std::move(state)));  // NOLINT: private constructor
}

ConsumerShard::ConsumerShard(std::shared_ptr<State> state) : state_(std::move(state)) {}

ConsumerShard::~ConsumerShard() { shutdown(); }

DrainReport ConsumerShard::shutdown() { return shutdown(seconds_to_duration(state_->config.shutdown_drain_timeout_s)); }

DrainReport ConsumerShard::shutdown(Duration drain) {
  auto& s = *state_;
  std::lock_guard lock(s.shutdown_mutex);
  if (s.drained) return *s.drained;
  s.reservations->begin_shutdown();
  s.publish_events();
  const auto report = s.reservations->wait_for_writers(drain);
  s.publisher.store(nullptr, std::memory_order_release);
  s.space_listener->store(nullptr, std::memory_order_release);
  if (s.server) s.server->stop();
  if (report.writers_finished) {
    if (s.transport && s.region.valid()) (void)s.transport->deregister_region(s.region);
    s.transport.release();
  } else {
    // A writer may still be writing into the pool: keep it registered and allocated
    // for the rest of the process rather than let a late write land in freed memory.
    s.log->warn("shard {}: {} writer(s) still active after the drain deadline; keeping the {} pool registered",
                s.config.layout.tp_rank, report.writers_remaining, format_bytes(s.slab->size()));
    static std::mutex graveyard_mutex;
    static std::vector<std::shared_ptr<State>> graveyard;
    std::lock_guard g(graveyard_mutex);
    graveyard.push_back(state_);
    keep_until_exit(state_.get());  // its callbacks hold it in a cycle: not a leak, a decision
  }
  s.drained = report;
  return report;
}

Result<SlotLease> ConsumerShard::take(std::string_view transfer_id, std::string_view mm_hash) {
  return state_->reservations->take(transfer_id, mm_hash);
}

Result<SlotLease> ConsumerShard::take_resident(std::string_view mm_hash, const TensorSpec& spec) {
  return state_->reservations->take_resident(mm_hash, spec);
}

std::vector<std::string> ConsumerShard::drain_reclaimed() { return state_->reservations->drain_reclaimed(); }

int ConsumerShard::tp_rank() const noexcept { return state_->config.layout.tp_rank; }
std::string ConsumerShard::control_endpoint() const { return state_->server->control_endpoint(); }
std::string ConsumerShard::event_endpoint() const { return state_->server->event_endpoint(); }
std::string ConsumerShard::data_address() const { return state_->data_address; }
std::uint64_t ConsumerShard::pool_capacity() const noexcept { return state_->slab->size(); }

ShardCounters ConsumerShard::counters() const {
  ShardCounters c;
  c.reservations = state_->reservations->counters();
  if (state_->server) c.control = state_->server->counters();
  if (auto t = state_->transport.stats()) c.transport = *t;
  c.headers_rejected = state_->headers_rejected.load(std::memory_order_relaxed);
  return c;
}

Status ConsumerShard::check_invariants() const { return state_->reservations->check_invariants(); }

std::uint64_t ConsumerShard::export_metrics(metrics::Registry& registry) const {
  std::weak_ptr<State> weak = state_;
  return registry.add_collector([weak](metrics::SampleSink& sink) {
    auto s = weak.lock();
    if (!s) return;
    const auto r = s->reservations->counters();
    const metrics::Labels shard{{"shard", std::to_string(s->config.layout.tp_rank)}};
    auto counter = [&](std::string_view name, std::string_view help, std::string_view outcome, std::uint64_t v) {
      metrics::Labels labels = shard;
      if (!outcome.empty()) labels.emplace_back("outcome", std::string(outcome));
      sink.counter(name, help, v, labels);
    };
    auto gauge = [&](std::string_view name, std::string_view help, std::uint64_t v) {
      sink.gauge(name, help, v, shard);
    };
    constexpr std::string_view kReserve = "Reserve requests by outcome";
    counter("consumer_reserves_total", kReserve, "writer", r.reserved_writer);
    counter("consumer_reserves_total", kReserve, "follower", r.reserved_follower);
    counter("consumer_reserves_total", kReserve, "resident_hit", r.resident_hits);
    counter("consumer_reserves_total", kReserve, "retry_after", r.retry_afters - r.retry_afters_for_older);
    counter("consumer_reserves_total", kReserve, "retry_after_for_older", r.retry_afters_for_older);
    counter("consumer_reserves_total", kReserve, "cancelled", r.reserve_cancelled);
    counter("consumer_reserves_total", kReserve, "refused", r.reserve_refused);
    constexpr std::string_view kLanding = "Payload landings by outcome";
    counter("consumer_landings_total", kLanding, "ready", r.landings_ready);
    counter("consumer_landings_total", kLanding, "failed", r.landings_failed);
    counter("consumer_landings_total", kLanding, "refused", r.landings_refused);
    constexpr std::string_view kDirect = "Direct payloads (sent without a reservation) by outcome";
    counter("consumer_direct_payloads_total", kDirect, "accepted", r.direct_accepted);
    counter("consumer_direct_payloads_total", kDirect, "turned_away", r.direct_turned_away);
    counter("consumer_checksum_mismatches_total", "Payloads whose checksum did not match", "", r.checksum_mismatches);
    counter("consumer_bytes_landed_total", "Payload bytes landed", "", r.bytes_landed);
    counter("consumer_expired_total", "Reservations expired", "", r.expired);
    counter("consumer_taken_total", "Landed payloads handed to the engine", "", r.taken);
    counter("consumer_invalid_transitions_total", "Refused state transitions", "", r.invalid_transitions);
    counter("consumer_events_dropped_total", "Events dropped from a full queue", "", r.events_dropped);
    gauge("consumer_pool_capacity_bytes", "Receive pool size", r.pool_capacity);
    gauge("consumer_pool_used_bytes", "Receive pool bytes held", r.pool_used_bytes);
    gauge("consumer_live_records", "Reservations not yet terminal", r.live_records);
    gauge("consumer_tombstones", "Terminal records kept for idempotency", r.tombstones);
    gauge("consumer_resident_bytes", "Bytes of landed payloads kept for reuse", r.resident_bytes);
    gauge("consumer_leases", "Slots handed to the engine and not yet released", r.leases);
    if (const auto t = s->transport.stats()) {
      counter("consumer_shared_landings_total", "Payloads copied out of a same-host producer's shared memory", "",
              t->shared_landings);
      gauge("consumer_shared_mapped_bytes", "Bytes of producers' shared memory mapped now", t->shared_mapped_bytes);
    }
    if (s->server) {
      const auto c = s->server->counters();
      counter("control_malformed_frames_total", "Undecodable control frames", "", c.malformed_frames);
      counter("control_auth_failures_total", "Control frames failing authentication", "", c.auth_failures);
      counter("control_events_sent_total", "Events sent", "", c.events_sent);
      counter("control_events_dropped_total", "Events dropped from a full queue", "", c.events_dropped);
      counter("control_reserves_held_total", "Reserves held until space freed (reserve_hold_ms)", "", c.reserves_held);
      counter("control_held_reserves_placed_total", "Held reserves answered once space freed", "",
              c.held_reserves_placed);
      counter("control_held_reserves_expired_total", "Held reserves answered retry_after at the end of their hold", "",
              c.held_reserves_expired);
      counter("control_in_process_cancels_total",
              "Cancels and releases a scheduler of this process ran here without the network", "",
              c.in_process_cancels);
    }
  });
}

}  // namespace ecx::consumer
