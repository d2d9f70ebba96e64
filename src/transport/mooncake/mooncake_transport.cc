#include "ecx/transport/mooncake_transport.h"

#include <condition_variable>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/core/config.h"
#include "ecx/core/thread_name.h"
#include "transport/mooncake/mooncake_api.h"

namespace ecx::transport {
namespace {

namespace mc = mooncake;

// Mooncake's metadata mode that needs no external service: peers exchange segment
// descriptions directly over the engine's handshake listener.
constexpr const char* kP2PHandshake = "P2PHANDSHAKE";
// Let Mooncake place each registered region (NUMA node, NIC affinity) itself.
constexpr const char* kAnyLocation = "*";

std::string_view mooncake_status_name(int status) {
  switch (status) {
    case mc::kStatusWaiting:
      return "waiting";
    case mc::kStatusPending:
      return "pending";
    case mc::kStatusInvalid:
      return "invalid";
    case mc::kStatusCanceled:
      return "canceled";
    case mc::kStatusCompleted:
      return "completed";
    case mc::kStatusTimeout:
      return "timeout";
    case mc::kStatusFailed:
      return "failed";
    default:
      return "unknown";
  }
}

class MooncakeTransportImpl final : public MooncakeTransport {
 public:
  MooncakeTransportImpl(std::shared_ptr<const mc::Api> api, mc::EngineHandle engine, std::string segment,
                        MooncakeOptions options)
      : api_(std::move(api)),
        engine_(engine),
        segment_(std::move(segment)),
        options_(std::move(options)),
        clock_(options_.clock ? options_.clock : SteadyClock::shared()) {
    progress_ = std::thread([this] {
      name_this_thread("ecx-mooncake");
      run();
    });
  }

  ~MooncakeTransportImpl() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      stop_requested_at_ = std::chrono::steady_clock::now();
    }
    cv_.notify_all();
    progress_.join();
    if (!writes_.empty()) {
      // A write Mooncake never settled may still touch local and remote memory:
      // keep the engine (its threads and registrations) alive rather than free it
      // under them.
      log_->error("mooncake: {} write(s) still unsettled at shutdown; keeping the engine alive", writes_.size());
      for (auto& w : writes_) {
        if (w.on_done) w.on_done(cancelled("the Mooncake transport shut down before the write settled"));
      }
      return;
    }
    for (const auto& [id, segment] : segments_) (void)api_->close_segment(engine_, segment);
    for (const auto& [id, region] : regions_) (void)api_->unregister_memory(engine_, region.base);
    api_->destroy_engine(engine_);
  }

  MooncakeTransportImpl(const MooncakeTransportImpl&) = delete;
  MooncakeTransportImpl& operator=(const MooncakeTransportImpl&) = delete;

  std::string segment_name() const override { return segment_; }

  Result<RegionHandle> register_region(void* base, std::uint64_t size, MemoryKind kind) override {
    if (base == nullptr || size == 0) return invalid_argument("mooncake: cannot register an empty region");
    if (kind != MemoryKind::host) {
      return invalid_argument("mooncake: ECX registers host memory only (device pools stage through pinned memory)");
    }
    std::lock_guard call(call_mu_);  // Mooncake republishes its segment description per registration
    const int rc = api_->register_memory(engine_, base, size, kAnyLocation, 1);
    if (rc != 0) {
      return unavailable(fmt::format("mooncake: registering {} at {} failed (error {})", format_bytes(size), base, rc));
    }
    std::lock_guard lock(mu_);
    const std::uint64_t id = next_region_++;
    regions_.emplace(id, Region{static_cast<std::byte*>(base), size, 0});
    return RegionHandle{id};
  }

  Status deregister_region(RegionHandle region) override {
    std::lock_guard call(call_mu_);
    void* base = nullptr;
    {
      std::lock_guard lock(mu_);
      auto it = regions_.find(region.id);
      if (it == regions_.end()) return not_found("mooncake: unknown region");
      if (it->second.writes_in_flight > 0) {
        return conflict(
            fmt::format("mooncake: {} write(s) from the region are in flight", it->second.writes_in_flight));
      }
      base = it->second.base;
      regions_.erase(it);
    }
    const int rc = api_->unregister_memory(engine_, base);
    if (rc != 0) return unavailable(fmt::format("mooncake: unregistering the region failed (error {})", rc));
    return Status::ok();
  }

  Result<std::string> listen(std::string_view /*host*/, int port) override {
    // The engine listens from its creation, on a port of its choosing.
    if (port != 0) return invalid_argument("mooncake: the engine picks its own port; listen on port 0");
    return segment_;
  }

  Result<EndpointHandle> connect(std::string_view address) override {
    std::lock_guard call(call_mu_);
    const std::string name(address);
    {
      std::lock_guard lock(mu_);
      if (auto it = endpoints_.find(name); it != endpoints_.end()) return it->second;
    }
    // Fetches the peer's segment description over the handshake (blocks for it).
    const mc::SegmentId segment = api_->open_segment(engine_, name.c_str());
    if (segment < 0) {
      return unavailable(fmt::format("mooncake: cannot open the segment {} (error {})", name, segment));
    }
    std::lock_guard lock(mu_);
    const EndpointHandle handle{next_endpoint_++};
    endpoints_.emplace(name, handle);
    segments_.emplace(handle.id, segment);
    return handle;
  }

  Status write(EndpointHandle endpoint, RegionHandle region, std::uint64_t offset, std::uint64_t length,
               std::uint64_t remote_address, TimePoint deadline, WriteCallback on_done,
               OverdueCallback on_overdue) override {
    if (length == 0) return invalid_argument("mooncake: a write of 0 bytes");
    std::unique_lock lock(mu_);
    if (stopping_) return cancelled("mooncake: the transport is shutting down");
    auto segment = segments_.find(endpoint.id);
    if (segment == segments_.end()) return not_found("mooncake: unknown endpoint");
    auto source = regions_.find(region.id);
    if (source == regions_.end()) return not_found("mooncake: unknown region");
    if (offset > source->second.size || length > source->second.size - offset) {
      return invalid_argument(fmt::format("mooncake: [{}, +{}) lies outside the {} region", offset, length,
                                          format_bytes(source->second.size)));
    }
    if (writes_.size() >= options_.max_writes_in_flight) {
      return resource_exhausted(fmt::format("mooncake: {} writes in flight", writes_.size()));
    }
    const mc::BatchId batch = api_->allocate_batch(engine_, 1);
    if (batch == mc::kInvalidBatch) return resource_exhausted("mooncake: no transfer batch available");
    mc::TransferRequest request{mc::kOpcodeWrite, source->second.base + offset, segment->second, remote_address,
                                length};
    const int rc = api_->submit_transfer(engine_, batch, &request, 1);
    if (rc != 0) {
      (void)api_->free_batch(engine_, batch);
      ++stats_.sends_failed;
      return unavailable(fmt::format("mooncake: submitting a write of {} failed (error {})", format_bytes(length), rc));
    }
    ++source->second.writes_in_flight;
    ++stats_.sends_started;
    writes_.push_back(Write{region.id, batch, deadline, length, false, std::move(on_done), std::move(on_overdue)});
    lock.unlock();
    cv_.notify_all();
    return Status::ok();
  }

  TransportStats stats() const override {
    std::lock_guard lock(mu_);
    return stats_;
  }

  std::string_view name() const noexcept override { return "mooncake"; }

 private:
  struct Region {
    std::byte* base = nullptr;
    std::uint64_t size = 0;
    std::uint64_t writes_in_flight = 0;
  };
  struct Write {
    std::uint64_t region = 0;
    mc::BatchId batch = mc::kInvalidBatch;
    TimePoint deadline;
    std::uint64_t length = 0;
    bool overdue = false;
    WriteCallback on_done;
    OverdueCallback on_overdue;
  };
  using Callback = std::function<void()>;

  // Polls every write in flight; settles the finished ones and reports the overdue.
  // Returns the callbacks to run (outside the lock). Called with mu_ held.
  std::vector<Callback> poll_locked() {
    std::vector<Callback> due;
    const TimePoint now = clock_->now();
    for (auto it = writes_.begin(); it != writes_.end();) {
      mc::TransferStatus status{mc::kStatusWaiting, 0};
      const int rc = api_->transfer_status(engine_, it->batch, 0, &status);
      const bool finished = rc == 0 && status.status != mc::kStatusWaiting && status.status != mc::kStatusPending;
      if (!finished) {
        if (!it->overdue && now >= it->deadline) {
          it->overdue = true;
          ++stats_.deadline_expiries;
          if (it->on_overdue) due.emplace_back(std::move(it->on_overdue));
        }
        ++it;
        continue;
      }
      Status result = Status::ok();
      if (status.status == mc::kStatusCompleted) {
        ++stats_.sends_ok;
        stats_.bytes_sent += it->length;
      } else {
        ++stats_.sends_failed;
        result = unavailable(fmt::format("mooncake: the write of {} ended {}", format_bytes(it->length),
                                         mooncake_status_name(status.status)));
      }
      (void)api_->free_batch(engine_, it->batch);
      if (auto region = regions_.find(it->region); region != regions_.end()) --region->second.writes_in_flight;
      if (it->on_done) {
        due.emplace_back([cb = std::move(it->on_done), result = std::move(result)] { cb(result); });
      }
      it = writes_.erase(it);
    }
    return due;
  }

  void run() {
    std::unique_lock lock(mu_);
    while (true) {
      if (writes_.empty()) {
        if (stopping_) break;
        cv_.wait_for(lock, options_.max_idle_sleep, [this] { return stopping_ || !writes_.empty(); });
        continue;
      }
      auto due = poll_locked();
      if (!due.empty()) {
        lock.unlock();
        for (auto& callback : due) callback();
        lock.lock();
        continue;
      }
      if (stopping_ && std::chrono::steady_clock::now() - stop_requested_at_ >= options_.call_timeout) break;
      cv_.wait_for(lock, options_.poll_interval, [this] { return stopping_ && writes_.empty(); });
    }
  }

  std::shared_ptr<const mc::Api> api_;
  mc::EngineHandle engine_;
  const std::string segment_;
  const MooncakeOptions options_;
  const std::shared_ptr<const Clock> clock_;
  std::shared_ptr<spdlog::logger> log_ = ecx::log::get("transport");

  std::mutex call_mu_;  // serializes register / deregister / connect (each may block in Mooncake)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, Region> regions_;
  std::map<std::string, EndpointHandle> endpoints_;
  std::map<std::uint64_t, mc::SegmentId> segments_;
  std::list<Write> writes_;
  std::uint64_t next_region_ = 1;
  std::uint64_t next_endpoint_ = 1;
  TransportStats stats_;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point stop_requested_at_{};
  std::thread progress_;
};

}  // namespace

Capabilities MooncakeTransport::capabilities() const noexcept {
  return Capabilities{.landing = LandingChoice::sender, .one_sided = true, .device_memory = false};
}

Status MooncakeTransport::send(EndpointHandle, std::span<const std::byte>, RegionHandle, std::uint64_t, std::uint64_t,
                               TimePoint, SendCallback) {
  return invalid_argument(
      "mooncake writes one-sidedly: the sender names the destination with write(); receiver-chosen send() is not "
      "available");
}

std::string mooncake_library_path(std::string_view configured) {
  if (!configured.empty()) return std::string(configured);
  const std::string env_name(kMooncakeLibraryEnv);
  // NOLINTNEXTLINE(concurrency-mt-unsafe): ECX never modifies its environment.
  if (const char* env = std::getenv(env_name.c_str()); env != nullptr && *env != '\0') return env;
  return std::string(kMooncakeDefaultLibrary);
}

Status mooncake_library_available(std::string_view configured) {
  return mooncake::load_api(mooncake_library_path(configured)).status();
}

Result<std::unique_ptr<MooncakeTransport>> create_mooncake_transport(MooncakeOptions options) {
  auto protocol = parse_mooncake_protocol(options.protocol);
  if (!protocol) return protocol.status();
  if (options.host.empty()) return invalid_argument("mooncake: no host to advertise");
  auto api = mooncake::load_api(mooncake_library_path(options.library_path));
  if (!api) return api.status();
  const auto& fn = **api;
  mc::EngineHandle engine = fn.create_engine(kP2PHandshake, options.host.c_str(), options.host.c_str(), 0, 0);
  if (engine == nullptr) {
    return unavailable(
        fmt::format("mooncake: creating the transfer engine on {} failed (its log says why)", options.host));
  }
  auto fail = [&](Status status) {
    fn.destroy_engine(engine);
    return status;
  };
  if (protocol->discover_topology && fn.discover_topology(engine) != 0) {
    return fail(unavailable("mooncake: RDMA topology discovery failed (no usable RDMA device?)"));
  }
  if (fn.install_transport(engine, protocol->name.c_str(), nullptr) == nullptr) {
    return fail(
        unavailable(fmt::format("mooncake: installing the {} transport failed (its log says why)", protocol->name)));
  }
  char name[256] = {};
  if (fn.local_ip_and_port(engine, name, sizeof(name)) != 0 || name[0] == '\0') {
    return fail(internal_error("mooncake: the engine did not report its segment name"));
  }
  ecx::log::get("transport")->info("mooncake engine {} ({}) from {}", name, protocol->name, fn.path);
  return std::unique_ptr<MooncakeTransport>(
      std::make_unique<MooncakeTransportImpl>(*api, engine, std::string(name), std::move(options)));
}

}  // namespace ecx::transport
