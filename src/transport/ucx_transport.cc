#include "ecx/transport/ucx_transport.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "transport/ucx/am_protocol.h"
#include "transport/ucx/common.h"
#include "transport/ucx/endpoints.h"
#include "transport/ucx/put_protocol.h"
#include "transport/ucx/regions.h"
#include "transport/ucx/transfers.h"
#include "transport/ucx/worker.h"

namespace ecx::transport {
namespace {

// The facade: Transport's calls handed to the progress thread, and the wiring of the
// units of src/transport/ucx/ (see common.h for their order). It also owns the order
// of shutdown, which spans them all.
class UcxTransport final : public Transport, private ucx::ProgressHooks {
 public:
  explicit UcxTransport(UcxOptions options)
      : options_(with_clock(std::move(options))),
        worker_(options_),
        regions_(worker_, options_, ids_),
        endpoints_(worker_, options_, ids_, stats_),
        transfers_(options_, stats_, ids_, regions_, endpoints_) {
    endpoints_.set_observer(transfers_);
    if (options_.mode == UcxMode::am) {
      am_ = std::make_unique<ucx::AmProtocol>(worker_, options_, stats_, regions_, endpoints_, transfers_);
      transfers_.set_protocol(*am_);
    } else {
      put_ = std::make_unique<ucx::PutProtocol>(worker_, stats_, regions_, endpoints_, transfers_);
      transfers_.set_protocol(*put_);
    }
  }

  ~UcxTransport() override {
    worker_.stop();
    destroy_ucx();
  }

  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  Status start() {
    // The largest prefix a payload header gets: put mode's request, or a shared payload's
    // send id and place (am_protocol.cc).
    ECX_RETURN_IF_ERROR(worker_.open(
        kMaxHeaderBytes + std::max(sizeof(ucx::PutRequest), sizeof(std::uint64_t) + ucx::kSharedSourceRefBytes)));
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    device_memory_ = ucp_context_query(worker_.context(), &attr) == UCS_OK &&
                     (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    ECX_RETURN_IF_ERROR(am_ ? am_->register_handlers() : put_->register_handlers());
    if (am_) am_->enable_shared_sources();
    return worker_.start(*this);
  }

  // --- Transport -----------------------------------------------------------------

  Result<RegionHandle> register_region(void* base, std::uint64_t size, MemoryKind kind) override {
    if (base == nullptr || size == 0) return invalid_argument("register_region: empty region");
    return worker_.call<RegionHandle>(
        [this, base, size, kind]() -> Result<RegionHandle> { return regions_.add(base, size, kind); });
  }

  Result<RegionHandle> register_shared_region(void* base, std::uint64_t size, SharedBacking backing) override {
    if (base == nullptr || size == 0) return invalid_argument("register_region: empty region");
    return worker_.call<RegionHandle>(
        [this, base, size, backing]() -> Result<RegionHandle> { return regions_.add_shared(base, size, backing); });
  }

  Status deregister_region(RegionHandle region) override {
    return worker_
        .call<bool>([this, region]() -> Result<bool> {
          ECX_RETURN_IF_ERROR(remove_region(region));
          return true;
        })
        .status();
  }

  // Queued, not waited for: the progress thread maps the memory before any send
  // queued after it (one queue, in order). A per-payload registration through call()
  // cost the caller a round trip to this thread and the thread one more wake-up.
  Result<RegionHandle> register_region_deferred(void* base, std::uint64_t size, MemoryKind kind) override {
    if (base == nullptr || size == 0) return invalid_argument("register_region: empty region");
    const std::uint64_t id = deferred_ids_.next();
    ECX_RETURN_IF_ERROR(worker_.enqueue([this, id, base, size, kind](bool run) {
      if (run) regions_.add_deferred(id, base, size, kind);
    }));
    return RegionHandle{id};
  }

  void deregister_region_then(RegionHandle region, const std::function<void(Status)>& done) override {
    const Status queued = worker_.enqueue([this, region, done](bool run) {
      // Not run: the transport is stopping, and its teardown unmaps every region.
      done(run ? remove_region(region) : unavailable("the transport is shutting down"));
    });
    if (!queued) done(queued);  // the command, never queued, never runs
  }

  Result<std::string> listen(std::string_view host, int port) override {
    return worker_.call<std::string>(
        [this, host = std::string(host), port]() { return endpoints_.listen(host, port); });
  }

  Result<EndpointHandle> connect(std::string_view address) override {
    std::string peer(address);
    if (auto known = endpoints_.connected(peer)) return *known;
    return worker_.call<EndpointHandle>([this, peer = std::move(peer)]() { return endpoints_.connect(peer); });
  }

  Status send(EndpointHandle endpoint, std::span<const std::byte> header, RegionHandle region, std::uint64_t offset,
              std::uint64_t length, TimePoint deadline, SendCallback on_sent) override {
    return enqueue_send(endpoint, header, region, offset, length, deadline, std::move(on_sent), false);
  }

  Status send_confirmed(EndpointHandle endpoint, std::span<const std::byte> header, RegionHandle region,
                        std::uint64_t offset, std::uint64_t length, TimePoint deadline, SendCallback on_sent) override {
    if (!am_) return Transport::send_confirmed(endpoint, header, region, offset, length, deadline, std::move(on_sent));
    return enqueue_send(endpoint, header, region, offset, length, deadline, std::move(on_sent), true);
  }

  Status enqueue_send(EndpointHandle endpoint, std::span<const std::byte> header, RegionHandle region,
                      std::uint64_t offset, std::uint64_t length, TimePoint deadline, SendCallback on_sent,
                      bool confirmed) {
    if (header.size() > kMaxHeaderBytes) {
      return invalid_argument(fmt::format("header of {} bytes exceeds {} bytes", header.size(), kMaxHeaderBytes));
    }
    if (!on_sent) return invalid_argument("send needs a completion callback");
    auto op = std::make_unique<ucx::SendOp>();
    op->endpoint = endpoint.id;
    op->region = region.id;
    op->length = length;
    op->deadline = deadline;
    op->header.assign(header.begin(), header.end());
    op->on_sent = std::move(on_sent);
    op->offset = offset;
    op->confirmed = confirmed;
    // std::function needs a copyable target; the op itself moves exactly once.
    auto holder = std::make_shared<std::unique_ptr<ucx::SendOp>>(std::move(op));
    return worker_.enqueue([this, holder](bool run) {
      if (!run) {
        transfers_.finish_unstarted(**holder, cancelled("transport shut down before the send started"));
        return;
      }
      transfers_.start_send(std::move(*holder));
    });
  }

  TransportStats stats() const override {
    TransportStats s;
    s.sends_started = stats_.sends_started.load();
    s.sends_ok = stats_.sends_ok.load();
    s.sends_failed = stats_.sends_failed.load();
    s.bytes_sent = stats_.bytes_sent.load();
    s.landings_ok = stats_.landings_ok.load();
    s.landings_failed = stats_.landings_failed.load();
    s.landings_rejected = stats_.landings_rejected.load();
    s.bytes_landed = stats_.bytes_landed.load();
    s.peer_failures = stats_.peer_failures.load();
    s.deadline_expiries = stats_.deadline_expiries.load();
    s.shared_sends = stats_.shared_sends.load();
    s.shared_landings = stats_.shared_landings.load();
    s.shared_fallbacks = stats_.shared_fallbacks.load();
    s.shared_mapped_bytes = stats_.shared_mapped_bytes.load();
    return s;
  }

  std::string_view name() const noexcept override { return ucx::transport_name(options_.mode); }

  // Receiver-chosen in both modes: put mode still lands through a grant the receiver
  // picks from the payload's header. Device memory only where this UCX has CUDA.
  // Confirmed sends in am mode (a verdict message answers each).
  Capabilities capabilities() const noexcept override {
    Capabilities c;
    c.device_memory = device_memory_;
    c.confirmed_sends = am_ != nullptr;
    c.shared_sources = am_ != nullptr && am_->shared_sources();
    return c;
  }

 private:
  static UcxOptions with_clock(UcxOptions options) {
    if (!options.clock) options.clock = SteadyClock::shared();
    return options;
  }

  // Progress thread. A shared region's peers hear that it went, so they unmap it.
  Status remove_region(RegionHandle handle) {
    const ucx::Region* region = regions_.find(handle.id);
    std::optional<ucx::Region::Shared> shared = region != nullptr ? region->shared : std::nullopt;
    ECX_RETURN_IF_ERROR(regions_.remove(handle));
    if (shared && am_) am_->shared_region_gone(*shared);
    return Status::ok();
  }

  // --- ProgressHooks (progress thread) -------------------------------------------------

  bool handle_deferred() override {
    const bool answered = am_ && am_->send_held_verdicts();  // what the progress pass decided
    if (am_) am_->sweep_shared_mappings();
    return endpoints_.handle_deferred() || answered;
  }
  void expire_deadlines() override { transfers_.expire_deadlines(); }
  bool busy() const override { return transfers_.busy() || endpoints_.closing(); }
  std::optional<TimePoint> next_deadline() const override { return transfers_.next_send_deadline(); }

  void shut_down() override {
    endpoints_.refuse_connections();
    worker_.close_queue();
    // A send completes at the sender once UCX holds its bytes, not once the peer
    // has them; a forced close would drop what is still queued (and a reset
    // connection can discard what the peer has not read yet). Flush, then close
    // gracefully, boundedly, so a process that exits right after its sends
    // completed still delivers them.
    // A peer that did not answer the flush (stopped, gone) would not answer a graceful
    // close either, and UCX 1.13 aborts when a worker is destroyed under an endpoint
    // still closing with requests: then close by force.
    const bool flushed = worker_.flush(std::chrono::steady_clock::now() + std::chrono::seconds(2));
    endpoints_.close_all(cancelled("transport shut down"), /*graceful=*/flushed);
    // Let UCX complete what the closes cancelled, boundedly.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while ((endpoints_.closing() || transfers_.unfinished() || worker_.flush_pending()) &&
           std::chrono::steady_clock::now() < give_up) {
      worker_.progress();
      handle_deferred();
    }
    // UCX 1.13 aborts the process when a worker is destroyed while an endpoint still
    // holds requests (a peer that is stopped answers neither the flush nor the close).
    // Then the worker is left to the process's exit instead (destroy_ucx).
    if (worker_.flush_pending() || endpoints_.closing()) {
      worker_.leave_to_exit();
      ucx::logger()->error(
          "UCX did not release {} closing endpoint(s) within the shutdown bound (a peer that does not answer); "
          "the UCX worker is left to the process's exit rather than destroyed under them",
          endpoints_.closing_count());
    }
    transfers_.abandon_all(cancelled("transport shut down"));
  }

  // After the progress thread ended: what UCX still holds goes before the worker.
  void destroy_ucx() {
    if (worker_.left_to_exit()) {  // see shut_down: destroying would abort
      endpoints_.leave_listener_to_exit();
    } else {
      endpoints_.free_closing();
      if (put_) put_->drop_control_messages();
      regions_.unmap_all();
      endpoints_.destroy_listener();  // last before the worker: see there
    }
    worker_.destroy();
  }

  UcxOptions options_;
  ucx::AtomicStats stats_;
  ucx::IdSource ids_;
  ucx::DeferredIds deferred_ids_;
  ucx::UcxWorker worker_;
  ucx::Regions regions_;
  ucx::Endpoints endpoints_;
  ucx::Transfers transfers_;
  std::unique_ptr<ucx::AmProtocol> am_;    // mode am
  std::unique_ptr<ucx::PutProtocol> put_;  // mode put
  bool device_memory_ = false;             // set by start(), before any other thread sees this transport
};

}  // namespace

std::string_view ucx_mode_name(UcxMode mode) noexcept { return mode == UcxMode::am ? "am" : "put"; }

Result<UcxOptions> ucx_options_from_config(const Config& config, std::shared_ptr<const Clock> clock) {
  UcxOptions ucx;
  auto mode = parse_ucx_mode(config.ucx_mode);
  if (!mode) return mode.status();
  ucx.mode = *mode;
  ucx.peer_error_handling = config.ucx_peer_errors;
  ucx.tcp_seg_size_bytes = config.ucx_tcp_seg_size;
  ucx.rndv_threshold_bytes = config.ucx_rndv_thresh;
  ucx.shared_sources = config.ucx_shared_sources;
  ucx.clock = std::move(clock);
  return ucx;
}

Result<std::unique_ptr<Transport>> create_ucx_transport(UcxOptions options) {
  auto transport = std::make_unique<UcxTransport>(std::move(options));
  ECX_RETURN_IF_ERROR(transport->start());
  return std::unique_ptr<Transport>(std::move(transport));
}

std::string ucx_library_version() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return fmt::format("{}.{}.{}", major, minor, release);
}

}  // namespace ecx::transport
