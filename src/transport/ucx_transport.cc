#include "ecx/transport/ucx_transport.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "ecx/core/logging.h"
#include "ecx/core/sanitizers.h"
#include "transport/address.h"

namespace ecx::transport {
namespace {

using detail::format_host_port;

// Active message ids. `am` mode uses kDataAm only; `put` mode the other three.
constexpr unsigned kDataAm = 17;
constexpr unsigned kPutRequestAm = 18;
constexpr unsigned kPutGrantAm = 19;
constexpr unsigned kPutDoneAm = 20;

// Put-mode control headers (both ends run the same build and byte order).
struct PutRequest {
  std::uint64_t op_id;
  std::uint64_t length;
};
struct PutGrant {
  std::uint64_t op_id;
  std::uint64_t grant_id;
  std::uint64_t remote_address;
  std::int32_t status;  // 0 = granted; otherwise the StatusCode of the refusal
  std::uint32_t reserved;
};
struct PutDone {
  std::uint64_t grant_id;
};

std::shared_ptr<spdlog::logger> logger() {
  static const auto instance = log::get("transport");
  return instance;
}

// Worker addresses are hundreds of hex digits; logs show their start.
std::string printable(std::string_view peer) {
  return peer.size() <= 40 ? std::string(peer) : fmt::format("{}...({} chars)", peer.substr(0, 24), peer.size());
}

Status ucx_error(std::string_view what, ucs_status_t status) {
  const std::string message = fmt::format("{}: {}", what, ucs_status_string(status));
  switch (status) {
    case UCS_ERR_CANCELED:
      return cancelled(message);
    case UCS_ERR_TIMED_OUT:
      return timeout_error(message);
    case UCS_ERR_REJECTED:
      return resource_exhausted(message);
    case UCS_ERR_MESSAGE_TRUNCATED:
    case UCS_ERR_INVALID_PARAM:
      return invalid_argument(message);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return resource_exhausted(message);
    default:
      return unavailable(message);
  }
}

// What a receiver answers a refused rendezvous with, so the sender's on_sent sees it.
ucs_status_t refusal_status(const Status& status) {
  return status.code() == StatusCode::invalid_argument ? UCS_ERR_MESSAGE_TRUNCATED : UCS_ERR_REJECTED;
}

class UcxTransport;

struct Region {
  std::uint64_t id = 0;
  std::byte* base = nullptr;
  std::uint64_t size = 0;
  MemoryKind kind = MemoryKind::host;
  ucp_mem_h memh = nullptr;
  std::vector<std::byte> packed_rkey;  // put mode only
  std::uint64_t in_flight = 0;
};

struct Endpoint {
  UcxTransport* owner = nullptr;
  std::uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  std::string peer;
  bool outgoing = false;
  bool failed = false;
  bool described = false;
  std::set<std::uint64_t> sends;  // op ids using this endpoint
  // Receiving side: landings this peer is writing (put mode: granted; am mode: a
  // rendezvous payload being fetched from it).
  std::set<std::uint64_t> landings;
  Status failure;  // why it failed; reported to its landings once its close completed
};

struct SendOp {
  UcxTransport* owner = nullptr;
  std::uint64_t id = 0;
  std::uint64_t endpoint = 0;
  std::uint64_t region = 0;
  std::uint64_t offset = 0;
  const std::byte* source = nullptr;  // region base + offset, set on the progress thread
  std::uint64_t length = 0;
  TimePoint deadline{};
  std::vector<std::byte> header;
  SendCallback on_sent;
  void* request = nullptr;     // the UCX request whose callback will finish this op
  ucp_rkey_h rkey = nullptr;   // put mode
  std::uint64_t grant_id = 0;  // put mode
  bool expired = false;
  // Reported to its owner (deadline) while UCX still holds the request; see abandon_send().
  bool abandoned = false;
};

struct PendingLanding {
  UcxTransport* owner = nullptr;
  std::uint64_t id = 0;
  std::vector<std::byte> header;
  Landing landing;
  std::uint64_t endpoint = 0;  // the writing peer (0: unknown, a worker-address peer)
  void* request = nullptr;     // am mode: the UCX receive still fetching into the landing
  std::optional<TimePoint> deadline;
};

// A small put-mode control message; UCX may still read its bytes after
// ucp_am_send_nbx returns (e.g. while the endpoint is wiring up), so it lives until
// its completion callback.
struct ControlMessage {
  UcxTransport* owner = nullptr;
  std::vector<std::byte> header;
  std::vector<std::byte> payload;
};

template <typename T>
std::vector<std::byte> bytes_of(const T& value) {
  std::vector<std::byte> bytes(sizeof value);
  std::memcpy(bytes.data(), &value, sizeof value);
  return bytes;
}

struct AtomicStats {
  std::atomic<std::uint64_t> sends_started{0}, sends_ok{0}, sends_failed{0}, bytes_sent{0};
  std::atomic<std::uint64_t> landings_ok{0}, landings_failed{0}, landings_rejected{0}, bytes_landed{0};
  std::atomic<std::uint64_t> peer_failures{0}, deadline_expiries{0};
};

// A command for the progress thread; called with false when the transport shuts
// down before running it (it must then report cancellation to whoever waits).
using Command = std::function<void(bool run)>;

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(UcxOptions options) : options_(std::move(options)) {
    if (!options_.clock) options_.clock = SteadyClock::shared();
  }

  ~UcxTransport() override {
    if (thread_.joinable()) {
      stop_requested_.store(true);
      wake();
      thread_.join();
    }
    destroy_ucx();
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  Status start() {
    ucp_config_t* config = nullptr;
    if (auto st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) return ucx_error("ucp_config_read", st);
    if (!options_.tls.empty()) {
      if (auto st = ucp_config_modify(config, "TLS", options_.tls.c_str()); st != UCS_OK) {
        ucp_config_release(config);
        return ucx_error(fmt::format("UCX_TLS={}", options_.tls), st);
      }
    }
    // Only where tcp may be selected: a transport list without it (e.g. sm,self) has no
    // tcp table, and UCX would warn on stdout about a setting nothing used.
    // NOLINTNEXTLINE(concurrency-mt-unsafe): read-only lookup of the operator's setting
    const char* env_tls = std::getenv("UCX_TLS");
    const std::string tls = !options_.tls.empty() ? options_.tls : (env_tls != nullptr ? env_tls : "");
    const bool may_use_tcp =
        tls.empty() || tls.find("tcp") != std::string::npos || tls.find("all") != std::string::npos;
    if (options_.tcp_seg_size_bytes != 0 && may_use_tcp) {
      const std::string value = std::to_string(options_.tcp_seg_size_bytes);
      // UCX 1.13 passes these on to its transports by their names within the tcp
      // transport's table (RX_SEG_SIZE, not TCP_RX_SEG_SIZE, which it reports invalid).
      for (const char* key : {"RX_SEG_SIZE", "TX_SEG_SIZE"}) {
        // NOLINTNEXTLINE(concurrency-mt-unsafe): read-only lookup of the operator's override
        if (std::getenv(fmt::format("UCX_TCP_{}", key).c_str()) != nullptr) continue;
        if (auto st = ucp_config_modify(config, key, value.c_str()); st != UCS_OK) {
          ucp_config_release(config);
          return ucx_error(fmt::format("UCX_TCP_{}={}", key, value), st);
        }
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (options_.mode == UcxMode::put ? UCP_FEATURE_RMA : 0);
    params.mt_workers_shared = 0;
    params.name = "ecx";
    const ucs_status_t init_status = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (init_status != UCS_OK) return ucx_error("ucp_init", init_status);

    ucp_worker_params_t worker_params{};
    worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread touches it
    if (auto st = ucp_worker_create(context_, &worker_params, &worker_); st != UCS_OK) {
      return ucx_error("ucp_worker_create", st);
    }
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    if (auto st = ucp_worker_query(worker_, &attr); st != UCS_OK) return ucx_error("ucp_worker_query", st);
    if (attr.max_am_header < kMaxHeaderBytes + sizeof(PutRequest)) {
      return unavailable(fmt::format("UCX allows active message headers of {} bytes; ECX needs {}", attr.max_am_header,
                                     kMaxHeaderBytes + sizeof(PutRequest)));
    }
    if (options_.mode == UcxMode::am) {
      ECX_RETURN_IF_ERROR(set_handler(kDataAm, &UcxTransport::on_data_am));
    } else {
      ECX_RETURN_IF_ERROR(set_handler(kPutRequestAm, &UcxTransport::on_put_request_am));
      ECX_RETURN_IF_ERROR(set_handler(kPutGrantAm, &UcxTransport::on_put_grant_am));
      ECX_RETURN_IF_ERROR(set_handler(kPutDoneAm, &UcxTransport::on_put_done_am));
    }

    if (auto st = ucp_worker_get_efd(worker_, &ucx_fd_); st != UCS_OK) return ucx_error("ucp_worker_get_efd", st);
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (wake_fd_ < 0 || epoll_fd_ < 0) return internal_error(fmt::format("eventfd/epoll: {}", errno_text(errno)));
    for (const int fd : {ucx_fd_, wake_fd_}) {
      epoll_event event{};
      event.events = EPOLLIN;
      event.data.fd = fd;
      if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) {
        return internal_error(fmt::format("epoll_ctl: {}", errno_text(errno)));
      }
    }
    thread_ = std::thread([this] { run(); });
    return Status::ok();
  }

  // --- Transport -----------------------------------------------------------------

  Result<RegionHandle> register_region(void* base, std::uint64_t size, MemoryKind kind) override {
    if (base == nullptr || size == 0) return invalid_argument("register_region: empty region");
    return call<RegionHandle>(
        [this, base, size, kind]() -> Result<RegionHandle> { return do_register(base, size, kind); });
  }

  Status deregister_region(RegionHandle region) override {
    return call<bool>([this, region]() -> Result<bool> {
             ECX_RETURN_IF_ERROR(do_deregister(region));
             return true;
           })
        .status();
  }

  Result<std::string> listen(std::string_view host, int port) override {
    return call<std::string>([this, host = std::string(host), port]() { return do_listen(host, port); });
  }

  Result<EndpointHandle> connect(std::string_view address) override {
    return call<EndpointHandle>([this, address = std::string(address)]() { return do_connect(address); });
  }

  Status send(EndpointHandle endpoint, std::span<const std::byte> header, RegionHandle region, std::uint64_t offset,
              std::uint64_t length, TimePoint deadline, SendCallback on_sent) override {
    if (header.size() > kMaxHeaderBytes) {
      return invalid_argument(fmt::format("header of {} bytes exceeds {} bytes", header.size(), kMaxHeaderBytes));
    }
    if (!on_sent) return invalid_argument("send needs a completion callback");
    auto op = std::make_unique<SendOp>();
    op->owner = this;
    op->endpoint = endpoint.id;
    op->region = region.id;
    op->length = length;
    op->deadline = deadline;
    op->header.assign(header.begin(), header.end());
    op->on_sent = std::move(on_sent);
    op->offset = offset;
    // std::function needs a copyable target; the op itself moves exactly once.
    auto holder = std::make_shared<std::unique_ptr<SendOp>>(std::move(op));
    return enqueue([this, holder](bool run) {
      if (!run) {
        finish_unstarted(**holder, cancelled("transport shut down before the send started"));
        return;
      }
      start_send(std::move(*holder));
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
    return s;
  }

  std::string_view name() const noexcept override { return options_.mode == UcxMode::am ? "ucx-am" : "ucx-put"; }

 private:
  template <typename T>
  struct CallState {
    std::mutex mutex;
    std::condition_variable done;
    std::optional<Result<T>> result;
  };

  // Runs `fn` on the progress thread and waits (bounded) for its result.
  template <typename T>
  Result<T> call(std::function<Result<T>()> fn) {
    if (std::this_thread::get_id() == progress_thread_id_.load()) return fn();
    auto state = std::make_shared<CallState<T>>();
    ECX_RETURN_IF_ERROR(enqueue([state, fn = std::move(fn)](bool run) {
      Result<T> result = run ? fn() : Result<T>(cancelled("transport is shutting down"));
      std::lock_guard lock(state->mutex);
      state->result.emplace(std::move(result));
      state->done.notify_all();
    }));
    std::unique_lock lock(state->mutex);
    if (!state->done.wait_for(lock, options_.call_timeout, [&] { return state->result.has_value(); })) {
      return timeout_error("the transport's progress thread did not answer in time");
    }
    return std::move(*state->result);
  }

  Status enqueue(Command command) {
    {
      std::lock_guard lock(queue_mutex_);
      if (closed_) return unavailable("transport is shutting down");
      if (queue_.size() >= options_.command_queue_capacity) {
        return resource_exhausted(fmt::format("transport command queue full ({} entries)", queue_.size()));
      }
      queue_.push_back(std::move(command));
    }
    if (sleeping_.load()) wake();
    return Status::ok();
  }

  void wake() {
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto written = ::write(wake_fd_, &one, sizeof one);
  }

  // --- progress thread -----------------------------------------------------------

  void run() {
    progress_thread_id_.store(std::this_thread::get_id());
    auto last_work = std::chrono::steady_clock::now();
    while (!stop_requested_.load()) {
      bool worked = run_commands();
      unsigned progressed = 0;
      for (unsigned n = ucp_worker_progress(worker_); n != 0 && progressed < 100000; n = ucp_worker_progress(worker_)) {
        progressed += n;
      }
      worked = handle_deferred() || worked;
      expire_deadlines();
      const auto now = std::chrono::steady_clock::now();
      if (worked || progressed != 0) {
        last_work = now;
        continue;
      }
      if (busy() && now - last_work < options_.spin_before_sleep) continue;
      sleep_until_event();
    }
    shut_down_on_thread();
  }

  bool busy() const { return !sends_.empty() || !landings_.empty() || !closing_.empty(); }

  bool run_commands() {
    std::deque<Command> batch;
    {
      std::lock_guard lock(queue_mutex_);
      batch.swap(queue_);
    }
    for (auto& command : batch) command(true);
    return !batch.empty();
  }

  void sleep_until_event() {
    sleeping_.store(true);
    {
      std::lock_guard lock(queue_mutex_);
      if (!queue_.empty()) {
        sleeping_.store(false);
        return;
      }
    }
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) {  // events arrived meanwhile
      sleeping_.store(false);
      return;
    }
    auto timeout = options_.max_idle_sleep;
    if (!deadlines_.empty()) {
      timeout = std::clamp<Duration>(deadlines_.begin()->first - options_.clock->now(), Duration::zero(), timeout);
    }
    const int timeout_ms = static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(timeout).count());
    epoll_event events[2];
    [[maybe_unused]] const int ready = ::epoll_wait(epoll_fd_, events, 2, timeout_ms);
    sleeping_.store(false);
    std::uint64_t drained = 0;
    [[maybe_unused]] const auto read_bytes = ::read(wake_fd_, &drained, sizeof drained);
  }

  // Work queued by UCX callbacks that must not run inside them.
  bool handle_deferred() {
    bool worked = false;
    while (!conn_requests_.empty()) {
      auto request = conn_requests_.front();
      conn_requests_.pop_front();
      accept(request);
      worked = true;
    }
    while (!failed_endpoints_.empty()) {
      auto [id, status] = std::move(failed_endpoints_.front());
      failed_endpoints_.pop_front();
      fail_endpoint(id, status);
      worked = true;
    }
    for (auto it = closing_.begin(); it != closing_.end();) {
      if (ucp_request_check_status(it->second) != UCS_INPROGRESS) {
        ucp_request_free(it->second);
        const auto id = it->first;
        it = closing_.erase(it);
        closed(id);
        worked = true;
      } else {
        ++it;
      }
    }
    return worked;
  }

  // An endpoint's close completed: UCX will deliver nothing more from that peer, so
  // the landings it was still writing fail now (their UCX receives may never finish:
  // UCX 1.13 does not always complete a rendezvous receive cut off by a peer failure).
  void closed(std::uint64_t endpoint_id) {
    auto found = endpoints_.find(endpoint_id);
    if (found == endpoints_.end()) return;
    const std::set<std::uint64_t> cut_off = std::move(found->second->landings);
    const Status status = found->second->failure.is_ok() ? unavailable("the connection to the sender was closed")
                                                         : found->second->failure;
    endpoints_.erase(found);
    for (const auto landing_id : cut_off) abandon_landing(landing_id, status);
  }

  // Reports a landing failed while UCX may still hold its receive request: the
  // bookkeeping stays until UCX lets go of the request (or the worker is destroyed).
  void abandon_landing(std::uint64_t id, const Status& status) {
    auto found = landings_.find(id);
    if (found == landings_.end()) return;
    std::unique_ptr<PendingLanding> pending = std::move(found->second);
    landings_.erase(found);
    if (pending->deadline) landing_deadlines_.erase({*pending->deadline, id});
    report_landing(*pending, status);
    if (pending->request != nullptr) abandoned_landings_.emplace(id, std::move(pending));
  }

  void expire_deadlines() {
    const auto now = options_.clock->now();
    std::vector<std::uint64_t> expired_endpoints;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const auto op_id = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      auto found = sends_.find(op_id);
      if (found == sends_.end()) continue;
      found->second->expired = true;
      stats_.deadline_expiries.fetch_add(1);
      if (options_.peer_error_handling) {
        expired_endpoints.push_back(found->second->endpoint);
      } else {
        abandon_send(*found->second);
      }
    }
    // UCX 1.13 cannot cancel one send: closing the endpoint fails every send on it,
    // each callback then reporting `timeout` for the expired ones.
    for (const auto id : expired_endpoints) {
      fail_endpoint(id, timeout_error("a send on this endpoint passed its deadline"));
    }
    // Landing watchdog: a payload still arriving at its deadline (its sender stopped
    // or vanished without UCX noticing) can only be cut off by closing the
    // connection it arrives on; the landing fails once that close has completed.
    std::vector<std::uint64_t> stalled_peers;
    while (!landing_deadlines_.empty() && landing_deadlines_.begin()->first <= now) {
      const auto landing_id = landing_deadlines_.begin()->second;
      landing_deadlines_.erase(landing_deadlines_.begin());
      auto found = landings_.find(landing_id);
      if (found == landings_.end()) continue;
      found->second->deadline.reset();
      stats_.deadline_expiries.fetch_add(1);
      if (found->second->endpoint != 0) {
        stalled_peers.push_back(found->second->endpoint);
      } else {
        logger()->warn(
            "a payload of {} bytes is still landing past its deadline; its sender's connection is not "
            "ours to close (worker-address peer), so the landing stays open",
            found->second->landing.length);
      }
    }
    for (const auto id : stalled_peers) {
      fail_endpoint(id, timeout_error("a payload from this peer did not finish landing before its deadline"));
    }
  }

  // Without peer error handling UCX can neither cancel the request nor force-close
  // its endpoint (the close would wait for it), so the owner hears `timeout` now and
  // the op lingers until UCX lets go of it. Its region stays in use meanwhile (a stuck
  // peer may still read the source once it resumes).
  void abandon_send(SendOp& op, const Status& status = timeout_error(
                                    "send did not complete before its deadline (the peer is not answering)")) {
    if (op.request == nullptr) {
      finish_send(op.id, status);
      return;
    }
    if (op.abandoned) return;
    op.abandoned = true;
    ++abandoned_sends_;
    if (auto endpoint = endpoints_.find(op.endpoint); endpoint != endpoints_.end())
      endpoint->second->sends.erase(op.id);
    stats_.sends_failed.fetch_add(1);
    invoke_sent(op.on_sent, status);
  }

  // --- regions -------------------------------------------------------------------

  Result<RegionHandle> do_register(void* base, std::uint64_t size, MemoryKind kind) {
    auto region = std::make_unique<Region>();
    region->id = next_id_++;
    region->base = static_cast<std::byte*>(base);
    region->size = size;
    region->kind = kind;
    ucp_mem_map_params_t params{};
    params.field_mask =
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.address = base;
    params.length = size;
    params.memory_type = kind == MemoryKind::cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    if (kind == MemoryKind::cuda) {
      ucp_context_attr_t attr{};
      attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
      if (ucp_context_query(context_, &attr) != UCS_OK || (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) == 0) {
        return unavailable(
            "this UCX library has no CUDA memory support; stage device tensors through pinned host memory");
      }
    }
    if (auto st = ucp_mem_map(context_, &params, &region->memh); st != UCS_OK) {
      return ucx_error(fmt::format("ucp_mem_map of {} bytes", size), st);
    }
    if (options_.mode == UcxMode::put) {
      void* packed = nullptr;
      std::size_t packed_size = 0;
      if (auto st = ucp_rkey_pack(context_, region->memh, &packed, &packed_size); st != UCS_OK) {
        ucp_mem_unmap(context_, region->memh);
        return ucx_error("ucp_rkey_pack", st);
      }
      const auto* bytes = static_cast<const std::byte*>(packed);
      region->packed_rkey.assign(bytes, bytes + packed_size);
      ucp_rkey_buffer_release(packed);
    }
    const RegionHandle handle{region->id};
    regions_by_base_.emplace(reinterpret_cast<std::uintptr_t>(base), region->id);
    regions_.emplace(region->id, std::move(region));
    return handle;
  }

  Status do_deregister(RegionHandle handle) {
    auto found = regions_.find(handle.id);
    if (found == regions_.end()) return not_found(fmt::format("no registered region {}", handle.id));
    if (found->second->in_flight != 0) {
      return conflict(fmt::format("region {} still has {} sends in flight", handle.id, found->second->in_flight));
    }
    ucp_mem_unmap(context_, found->second->memh);
    regions_by_base_.erase(reinterpret_cast<std::uintptr_t>(found->second->base));
    regions_.erase(found);
    return Status::ok();
  }

  // The registered region holding [pointer, pointer + length), if any.
  Region* region_holding(const std::byte* pointer, std::uint64_t length) {
    auto after = regions_by_base_.upper_bound(reinterpret_cast<std::uintptr_t>(pointer));
    if (after == regions_by_base_.begin()) return nullptr;
    Region* region = regions_.at(std::prev(after)->second).get();
    const auto end = reinterpret_cast<std::uintptr_t>(region->base) + region->size;
    return reinterpret_cast<std::uintptr_t>(pointer) + length <= end ? region : nullptr;
  }

  // --- connections ---------------------------------------------------------------

  static void on_endpoint_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    auto* endpoint = static_cast<Endpoint*>(arg);
    endpoint->owner->failed_endpoints_.emplace_back(
        endpoint->id, ucx_error(fmt::format("peer {} failed", printable(endpoint->peer)), status));
  }

  static void on_connection_request(ucp_conn_request_h request, void* arg) {
    static_cast<UcxTransport*>(arg)->conn_requests_.push_back(request);
  }

  void set_error_handling(ucp_ep_params_t& params, Endpoint& endpoint) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.err_mode = options_.peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    if (options_.peer_error_handling) {
      params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      params.err_handler.cb = &UcxTransport::on_endpoint_error;
      params.err_handler.arg = &endpoint;
    }
  }

  Result<std::string> do_listen(const std::string& host, int port) {
    if (listener_ != nullptr) return conflict("this transport is already listening");
    auto address = detail::resolve(detail::HostPort{host, port});
    if (!address) return address.status();
    ucp_listener_params_t params{};
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr = address->get();
    params.sockaddr.addrlen = address->length;
    params.conn_handler.cb = &UcxTransport::on_connection_request;
    params.conn_handler.arg = this;
    if (auto st = ucp_listener_create(worker_, &params, &listener_); st != UCS_OK) {
      listener_ = nullptr;
      return ucx_error(fmt::format("listen on {}", format_host_port(host, port)), st);
    }
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (auto st = ucp_listener_query(listener_, &attr); st != UCS_OK) return ucx_error("ucp_listener_query", st);
    auto bound = detail::format_socket_address(reinterpret_cast<const sockaddr*>(&attr.sockaddr));
    if (!bound) return bound.status();
    // Advertise the host as given (a wildcard bind is the caller's choice) with the real port.
    auto bound_port = detail::split_host_port(*bound);
    if (!bound_port) return bound_port.status();
    listen_address_ = format_host_port(host, bound_port->port);
    if (options_.mode == UcxMode::am && options_.address_kind == UcxAddressKind::worker) {
      ucp_worker_attr_t worker_attr{};
      worker_attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS;
      if (auto st = ucp_worker_query(worker_, &worker_attr); st != UCS_OK) return ucx_error("worker address", st);
      listen_address_ = detail::encode_worker_address(worker_attr.address, worker_attr.address_length);
      ucp_worker_release_address(worker_, worker_attr.address);
    }
    logger()->info("{} listening on {} ({} bytes of address)", name(), format_host_port(host, bound_port->port),
                   listen_address_.size());
    return listen_address_;
  }

  void accept(ucp_conn_request_h request) {
    auto endpoint = std::make_unique<Endpoint>();
    endpoint->owner = this;
    endpoint->id = next_id_++;
    ucp_conn_request_attr_t attr{};
    attr.field_mask = UCP_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR;
    if (ucp_conn_request_query(request, &attr) == UCS_OK) {
      endpoint->peer = detail::format_socket_address(reinterpret_cast<const sockaddr*>(&attr.client_address))
                           .value_or(std::string("unknown"));
    }
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
    params.conn_request = request;
    set_error_handling(params, *endpoint);
    if (auto st = ucp_ep_create(worker_, &params, &endpoint->ep); st != UCS_OK) {
      logger()->warn("refused a connection from {}: {}", endpoint->peer, ucs_status_string(st));
      return;
    }
    logger()->debug("accepted a connection from {}", endpoint->peer);
    endpoint_by_ucp_.emplace(endpoint->ep, endpoint->id);
    endpoints_.emplace(endpoint->id, std::move(endpoint));
  }

  Result<EndpointHandle> do_connect(const std::string& address) {
    if (auto cached = endpoints_by_peer_.find(address); cached != endpoints_by_peer_.end()) {
      return EndpointHandle{cached->second};
    }
    auto endpoint = std::make_unique<Endpoint>();
    endpoint->owner = this;
    endpoint->id = next_id_++;
    endpoint->peer = address;
    endpoint->outgoing = true;
    ucp_ep_params_t params{};
    params.field_mask = 0;
    detail::SocketAddress socket_address;
    const auto worker_address = detail::decode_worker_address(address);
    if (worker_address) {
      if (options_.mode == UcxMode::put) return invalid_argument("put mode connects to host:port addresses only");
      params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
      params.address = reinterpret_cast<const ucp_address_t*>(worker_address->data());
    } else if (address.starts_with(detail::kWorkerAddressPrefix)) {
      return invalid_argument("malformed UCX worker address");
    } else {
      auto host_port = detail::split_host_port(address);
      if (!host_port) return host_port.status();
      auto resolved = detail::resolve(*host_port);
      if (!resolved) return resolved.status();
      socket_address = *resolved;
      params.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
      params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      params.sockaddr.addr = socket_address.get();
      params.sockaddr.addrlen = socket_address.length;
    }
    set_error_handling(params, *endpoint);
    if (auto st = ucp_ep_create(worker_, &params, &endpoint->ep); st != UCS_OK) {
      return ucx_error(fmt::format("connect to {}", printable(address)), st);
    }
    const EndpointHandle handle{endpoint->id};
    endpoints_by_peer_.emplace(address, endpoint->id);
    endpoint_by_ucp_.emplace(endpoint->ep, endpoint->id);
    endpoints_.emplace(endpoint->id, std::move(endpoint));
    return handle;
  }

  // Marks an endpoint failed, drops it from the cache, force-closes it (UCX then
  // completes its requests with errors) and fails what UCX does not know about.
  // `graceful`: close after UCX flushed the endpoint and told the peer (shutdown);
  // otherwise at once (a failed peer, a send past its deadline).
  void fail_endpoint(std::uint64_t id, const Status& status, bool peer_failed = true, bool graceful = false) {
    auto found = endpoints_.find(id);
    if (found == endpoints_.end() || found->second->failed) return;
    Endpoint& endpoint = *found->second;
    const std::string peer = endpoint.peer;  // the endpoint may be gone once closed
    endpoint.failed = true;
    if (peer_failed) {
      stats_.peer_failures.fetch_add(1);
      // A peer that goes away while nothing is in flight (a clean restart or shutdown
      // of the other side) costs nothing; only lost operations are worth a warning.
      if (endpoint.sends.empty() && endpoint.landings.empty()) {
        logger()->info("endpoint to {} closed while idle: {}", printable(endpoint.peer), status.to_string());
      } else {
        logger()->warn("endpoint to {} failed with {} sends and {} landings in flight: {}", printable(endpoint.peer),
                       endpoint.sends.size(), endpoint.landings.size(), status.to_string());
      }
    } else {
      logger()->debug("closing the endpoint to {}: {}", printable(endpoint.peer), status.message());
    }
    if (endpoint.outgoing) endpoints_by_peer_.erase(endpoint.peer);
    endpoint_by_ucp_.erase(endpoint.ep);

    // Sends with no UCX request outstanding (put mode, waiting for a grant).
    std::vector<std::uint64_t> unstarted;
    for (const auto op_id : endpoint.sends) {
      if (auto op = sends_.find(op_id); op != sends_.end() && op->second->request == nullptr)
        unstarted.push_back(op_id);
    }
    for (const auto op_id : unstarted) finish_send(op_id, status);
    // Landings granted to this peer (put mode) will never be written now.
    std::vector<std::uint64_t> granted;
    for (const auto landing_id : endpoint.landings) {
      if (auto pending = landings_.find(landing_id); pending != landings_.end() && pending->second->request == nullptr)
        granted.push_back(landing_id);
    }
    for (const auto landing_id : granted) finish_landing(landing_id, status);
    // Rendezvous payloads still being fetched from this peer fail once the close has
    // completed: from then on no fragment of theirs can reach the landing.
    endpoint.failure = status;

    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = graceful ? 0U : static_cast<std::uint32_t>(UCP_EP_CLOSE_FLAG_FORCE);
    void* request = ucp_ep_close_nbx(endpoint.ep, &params);
    if (UCS_PTR_IS_PTR(request)) {
      closing_.emplace_back(id, request);
    } else {
      closed(id);
    }
    if (peer_failed && options_.on_peer_failure) {
      try {
        options_.on_peer_failure(EndpointHandle{id}, peer, status);
      } catch (const std::exception& e) {
        logger()->error("on_peer_failure threw: {}", e.what());
      }
    }
  }

  // --- sending -------------------------------------------------------------------

  void start_send(std::unique_ptr<SendOp> op) {
    op->id = next_id_++;
    auto region = regions_.find(op->region);
    if (region == regions_.end()) {
      finish_unstarted(*op, not_found(fmt::format("send from unregistered region {}", op->region)));
      return;
    }
    if (op->offset > region->second->size || op->length > region->second->size - op->offset) {
      finish_unstarted(*op, invalid_argument(fmt::format("send of {} bytes at offset {} overruns region of {} bytes",
                                                         op->length, op->offset, region->second->size)));
      return;
    }
    op->source = region->second->base + op->offset;
    auto endpoint = endpoints_.find(op->endpoint);
    if (endpoint == endpoints_.end() || endpoint->second->failed) {
      finish_unstarted(*op, unavailable("send on a closed or failed endpoint; connect again"));
      return;
    }
    if (options_.clock->now() >= op->deadline) {
      finish_unstarted(*op, timeout_error("send deadline passed before it started"));
      return;
    }
    region->second->in_flight += 1;
    endpoint->second->sends.insert(op->id);
    deadlines_.emplace(op->deadline, op->id);
    stats_.sends_started.fetch_add(1);
    SendOp& ref = *op;
    sends_.emplace(op->id, std::move(op));
    if (options_.mode == UcxMode::am) {
      post_data_am(ref, *endpoint->second, *region->second);
    } else {
      post_put_request(ref, *endpoint->second);
    }
  }

  void post_data_am(SendOp& op, Endpoint& endpoint, Region& region) {
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS |
                          UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    params.cb.send = &UcxTransport::on_send_done;
    params.user_data = &op;
    params.memh = region.memh;
    params.memory_type = region.kind == MemoryKind::cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    // REPLY: the receiver learns which endpoint the payload arrives on, so a peer
    // failure (or its landing watchdog) can cut off exactly that peer's landings.
    params.flags = UCP_AM_SEND_FLAG_REPLY;
    if (options_.rndv_threshold_bytes != 0) {
      params.flags |= op.length >= options_.rndv_threshold_bytes ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
    }
    void* request =
        ucp_am_send_nbx(endpoint.ep, kDataAm, op.header.data(), op.header.size(), op.source, op.length, &params);
    complete_or_track(op, request, "ucp_am_send_nbx");
  }

  void complete_or_track(SendOp& op, void* request, std::string_view what) {
    if (request == nullptr) {
      finish_send(op.id, Status::ok());
    } else if (UCS_PTR_IS_ERR(request)) {
      finish_send(op.id, ucx_error(what, UCS_PTR_STATUS(request)));
    } else {
      op.request = request;
    }
  }

  static void on_send_done(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<SendOp*>(user_data);
    UcxTransport* self = op->owner;
    ucp_request_free(request);
    op->request = nullptr;
    if (status == UCS_OK) {
      self->send_step_done(*op);
    } else {
      self->finish_send(op->id, op->expired ? timeout_error("send did not complete before its deadline")
                                            : ucx_error("send failed", status));
    }
  }

  // A UCX request of `op` finished well: the whole send (am) or its flush (put).
  void send_step_done(SendOp& op) {
    if (options_.mode == UcxMode::put) {
      ucp_rkey_destroy(op.rkey);
      op.rkey = nullptr;
      auto endpoint = endpoints_.find(op.endpoint);
      if (endpoint != endpoints_.end() && !endpoint->second->failed) {
        // The flush finished: every byte is at the target. Tell the receiver.
        if (auto st = send_control(endpoint->second->ep, kPutDoneAm, bytes_of(PutDone{op.grant_id}), {}, 0); !st) {
          // The bytes are at the target, but the receiver will not hear so; its landing
          // fails when this endpoint does.
          logger()->warn("could not confirm a put: {}", st.to_string());
        }
      }
    }
    finish_send(op.id, Status::ok());
  }

  void finish_unstarted(SendOp& op, const Status& status) {
    stats_.sends_failed.fetch_add(1);
    invoke_sent(op.on_sent, status);
  }

  void finish_send(std::uint64_t op_id, const Status& status) {
    auto found = sends_.find(op_id);
    if (found == sends_.end()) return;
    std::unique_ptr<SendOp> op = std::move(found->second);
    sends_.erase(found);
    deadlines_.erase({op->deadline, op->id});
    if (auto region = regions_.find(op->region); region != regions_.end()) region->second->in_flight -= 1;
    if (auto endpoint = endpoints_.find(op->endpoint); endpoint != endpoints_.end()) {
      endpoint->second->sends.erase(op->id);
    }
    if (op->rkey != nullptr) ucp_rkey_destroy(op->rkey);
    if (op->abandoned) {  // its owner already heard
      --abandoned_sends_;
      return;
    }
    if (status.is_ok()) {
      stats_.sends_ok.fetch_add(1);
      stats_.bytes_sent.fetch_add(op->length);
      describe_endpoint_once(op->endpoint);
    } else {
      stats_.sends_failed.fetch_add(1);
    }
    invoke_sent(op->on_sent, status);
  }

  // Which transports and lanes UCX picked, once per endpoint after wire-up (debug level).
  void describe_endpoint_once(std::uint64_t id) {
    if (!logger()->should_log(spdlog::level::debug)) return;
    auto found = endpoints_.find(id);
    if (found == endpoints_.end() || found->second->described) return;
    found->second->described = true;
    // UCX prints only to a FILE*: an in-memory stream, freed right after (C
    // resources, so no owner types).
    char* text = nullptr;
    std::size_t size = 0;
    if (FILE* stream = ::open_memstream(&text, &size)) {
      ucp_ep_print_info(found->second->ep, stream);
      std::fclose(stream);  // NOLINT(cppcoreguidelines-owning-memory): fills text and size
      logger()->debug("endpoint to {}:\n{}", printable(found->second->peer), std::string(text, size));
      std::free(text);  // NOLINT(cppcoreguidelines-owning-memory,cppcoreguidelines-no-malloc): open_memstream's buffer
    }
  }

  static void invoke_sent(SendCallback& on_sent, const Status& status) {
    try {
      on_sent(status);
    } catch (const std::exception& e) {
      logger()->error("on_sent threw: {}", e.what());
    }
  }

  // --- receiving (am mode) ---------------------------------------------------------

  Status set_handler(unsigned id, ucp_am_recv_callback_t callback) {
    ucp_am_handler_param_t params{};
    params.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                        UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    params.id = id;
    params.cb = callback;
    params.arg = this;
    params.flags = UCP_AM_FLAG_WHOLE_MSG;
    if (auto st = ucp_worker_set_am_recv_handler(worker_, &params); st != UCS_OK) {
      return ucx_error("ucp_worker_set_am_recv_handler", st);
    }
    return Status::ok();
  }

  // The resolver's verdict, with the length check; never throws.
  Result<Landing> resolve_landing(std::span<const std::byte> header, std::uint64_t length) {
    if (!options_.resolver) return unavailable("this transport does not receive (no landing resolver)");
    Result<Landing> landing = unavailable("landing resolver failed");
    try {
      landing = options_.resolver(header, length);
    } catch (const std::exception& e) {
      logger()->error("landing resolver threw: {}", e.what());
      return internal_error(fmt::format("landing resolver threw: {}", e.what()));
    }
    return landing;
  }

  static ucs_status_t on_data_am(void* arg, const void* header, std::size_t header_length, void* data,
                                 std::size_t length, const ucp_am_recv_param_t* param) {
    return static_cast<UcxTransport*>(arg)->receive_data(
        std::span(static_cast<const std::byte*>(header), header_length), data, length,
        (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0,
        (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 ? param->reply_ep : nullptr);
  }

  ucs_status_t receive_data(std::span<const std::byte> header, void* data, std::uint64_t length, bool rendezvous,
                            ucp_ep_h sender) {
    // The endpoint the payload arrives on, when it is one of ours (socket-address
    // listeners accept every sender as an endpoint with peer-failure handling).
    std::uint64_t sender_endpoint = 0;
    if (auto found = sender != nullptr ? endpoint_by_ucp_.find(sender) : endpoint_by_ucp_.end();
        found != endpoint_by_ucp_.end()) {
      sender_endpoint = found->second;
    }
    if (rendezvous && sender_endpoint != 0 && endpoints_.at(sender_endpoint)->failed) {
      stats_.landings_rejected.fetch_add(1);
      return UCS_ERR_REJECTED;
    }
    auto landing = resolve_landing(header, length);
    if (!landing) {
      stats_.landings_rejected.fetch_add(1);
      logger()->debug("rejected a payload of {} bytes: {}", length, landing.status().to_string());
      return rendezvous ? refusal_status(landing.status()) : UCS_OK;  // eager bytes are simply dropped
    }
    auto pending = std::make_unique<PendingLanding>();
    pending->owner = this;
    pending->id = next_id_++;
    pending->header.assign(header.begin(), header.end());
    pending->landing = *landing;
    if (landing->length != length || landing->destination == nullptr) {
      stats_.landings_rejected.fetch_add(1);
      const auto refusal =
          invalid_argument(fmt::format("payload of {} bytes for a landing of {} bytes", length, landing->length));
      report_landing(*pending, refusal, /*counted=*/false);
      return rendezvous ? refusal_status(refusal) : UCS_OK;
    }
    if (!rendezvous) {
      std::memcpy(landing->destination, data, length);
      report_landing(*pending, Status::ok());
      return UCS_OK;
    }
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    params.cb.recv_am = &UcxTransport::on_receive_done;
    params.user_data = pending.get();
    params.memory_type = UCS_MEMORY_TYPE_HOST;
    if (Region* region = region_holding(landing->destination, length)) {
      params.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      params.memh = region->memh;
      params.memory_type = region->kind == MemoryKind::cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    }
    void* request = ucp_am_recv_data_nbx(worker_, data, landing->destination, length, &params);
    if (request == nullptr) {
      report_landing(*pending, Status::ok());
    } else if (UCS_PTR_IS_ERR(request)) {
      report_landing(*pending, ucx_error("ucp_am_recv_data_nbx", UCS_PTR_STATUS(request)));
    } else {
      pending->request = request;
      if (sender_endpoint != 0) {
        pending->endpoint = sender_endpoint;
        endpoints_.at(sender_endpoint)->landings.insert(pending->id);
      }
      if (options_.landing_timeout > Duration::zero()) {
        pending->deadline = options_.clock->now() + options_.landing_timeout;
        landing_deadlines_.emplace(*pending->deadline, pending->id);
      }
      landings_.emplace(pending->id, std::move(pending));
    }
    return UCS_INPROGRESS;
  }

  static void on_receive_done(void* request, ucs_status_t status, std::size_t /*length*/, void* user_data) {
    auto* pending = static_cast<PendingLanding*>(user_data);
    UcxTransport* self = pending->owner;
    const std::uint64_t id = pending->id;
    ucp_request_free(request);
    if (self->abandoned_landings_.erase(id) != 0) return;  // already reported failed
    pending->request = nullptr;
    self->finish_landing(id, status == UCS_OK ? Status::ok() : ucx_error("payload receive failed", status));
  }

  void finish_landing(std::uint64_t id, const Status& status) {
    auto found = landings_.find(id);
    if (found == landings_.end()) return;
    std::unique_ptr<PendingLanding> pending = std::move(found->second);
    landings_.erase(found);
    if (pending->deadline) landing_deadlines_.erase({*pending->deadline, id});
    if (pending->endpoint != 0) {
      if (auto endpoint = endpoints_.find(pending->endpoint); endpoint != endpoints_.end()) {
        endpoint->second->landings.erase(id);
      }
    }
    report_landing(*pending, status);
  }

  void report_landing(const PendingLanding& pending, const Status& status, bool counted = true) {
    if (counted) {
      if (status.is_ok()) {
        stats_.landings_ok.fetch_add(1);
        stats_.bytes_landed.fetch_add(pending.landing.length);
      } else {
        stats_.landings_failed.fetch_add(1);
      }
    }
    if (!options_.on_landing) return;
    try {
      options_.on_landing(pending.header, pending.landing, status);
    } catch (const std::exception& e) {
      logger()->error("on_landing threw: {}", e.what());
    }
  }

  // --- put mode ------------------------------------------------------------------

  Status send_control(ucp_ep_h ep, unsigned id, std::vector<std::byte> header, std::vector<std::byte> payload,
                      std::uint32_t flags) {
    auto message = std::make_unique<ControlMessage>();
    message->owner = this;
    message->header = std::move(header);
    message->payload = std::move(payload);
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = flags | UCP_AM_SEND_FLAG_EAGER;
    params.cb.send = &UcxTransport::on_control_sent;
    params.user_data = message.get();
    void* request =
        ucp_am_send_nbx(ep, id, message->header.data(), message->header.size(),
                        message->payload.empty() ? nullptr : message->payload.data(), message->payload.size(), &params);
    if (request == nullptr) return Status::ok();
    if (UCS_PTR_IS_ERR(request)) return ucx_error("control message", UCS_PTR_STATUS(request));
    ControlMessage* key = message.get();
    control_in_flight_.emplace(key, std::move(message));
    return Status::ok();
  }

  static void on_control_sent(void* request, ucs_status_t /*status*/, void* user_data) {
    auto* message = static_cast<ControlMessage*>(user_data);
    ucp_request_free(request);
    message->owner->control_in_flight_.erase(message);
  }

  void post_put_request(SendOp& op, Endpoint& endpoint) {
    std::vector<std::byte> wire = bytes_of(PutRequest{op.id, op.length});
    wire.insert(wire.end(), op.header.begin(), op.header.end());
    // The op now waits for the receiver's grant (or refusal).
    if (auto st = send_control(endpoint.ep, kPutRequestAm, std::move(wire), {}, UCP_AM_SEND_FLAG_REPLY); !st) {
      finish_send(op.id, st);
    }
  }

  static ucs_status_t on_put_request_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                        std::size_t /*length*/, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if (header_length < sizeof(PutRequest) || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
      logger()->warn("dropped a malformed put request");
      return UCS_OK;
    }
    PutRequest request;
    std::memcpy(&request, header, sizeof request);
    self->grant(request,
                std::span(static_cast<const std::byte*>(header) + sizeof request, header_length - sizeof request),
                param->reply_ep);
    return UCS_OK;
  }

  void grant(const PutRequest& request, std::span<const std::byte> header, ucp_ep_h reply_ep) {
    auto endpoint_id = endpoint_by_ucp_.find(reply_ep);
    PutGrant answer{request.op_id, 0, 0, 0, 0};
    const std::vector<std::byte>* rkey = nullptr;
    auto landing = resolve_landing(header, request.length);
    if (!landing) {
      stats_.landings_rejected.fetch_add(1);
      answer.status = static_cast<std::int32_t>(landing.status().code());
    } else {
      auto pending = std::make_unique<PendingLanding>();
      pending->owner = this;
      pending->id = next_id_++;
      pending->header.assign(header.begin(), header.end());
      pending->landing = *landing;
      Region* region =
          landing->destination == nullptr ? nullptr : region_holding(landing->destination, landing->length);
      if (landing->length != request.length || region == nullptr || endpoint_id == endpoint_by_ucp_.end()) {
        stats_.landings_rejected.fetch_add(1);
        const auto refusal =
            landing->length != request.length
                ? invalid_argument(
                      fmt::format("payload of {} bytes for a landing of {} bytes", request.length, landing->length))
                : invalid_argument("put mode needs landings inside a region registered with this transport");
        report_landing(*pending, refusal, /*counted=*/false);
        answer.status = static_cast<std::int32_t>(refusal.code());
      } else {
        answer.grant_id = pending->id;
        answer.remote_address = reinterpret_cast<std::uint64_t>(landing->destination);
        rkey = &region->packed_rkey;
        pending->endpoint = endpoint_id->second;
        endpoints_.at(endpoint_id->second)->landings.insert(pending->id);
        landings_.emplace(pending->id, std::move(pending));
      }
    }
    // The rkey travels as the payload; the header carries the rest.
    if (auto st = send_control(reply_ep, kPutGrantAm, bytes_of(answer), rkey ? *rkey : std::vector<std::byte>{}, 0);
        !st) {
      logger()->warn("could not answer a put request: {}", st.to_string());
      if (answer.grant_id != 0) finish_landing(answer.grant_id, st);
    }
  }

  static ucs_status_t on_put_grant_am(void* arg, const void* header, std::size_t header_length, void* data,
                                      std::size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if (header_length != sizeof(PutGrant) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
      logger()->warn("dropped a malformed put grant");
      return UCS_OK;
    }
    PutGrant grant;
    std::memcpy(&grant, header, sizeof grant);
    self->write_granted(grant, std::span(static_cast<const std::byte*>(data), length));
    return UCS_OK;
  }

  void write_granted(const PutGrant& grant, std::span<const std::byte> rkey_bytes) {
    auto found = sends_.find(grant.op_id);
    if (found == sends_.end()) return;  // expired meanwhile; its endpoint is being closed
    SendOp& op = *found->second;
    if (grant.status != 0) {
      const auto code = static_cast<StatusCode>(grant.status);
      finish_send(op.id, Status(code, "the receiver refused the payload"));
      return;
    }
    auto endpoint = endpoints_.find(op.endpoint);
    if (endpoint == endpoints_.end() || endpoint->second->failed) return;  // failed with the endpoint
    op.grant_id = grant.grant_id;
    if (auto st = ucp_ep_rkey_unpack(endpoint->second->ep, rkey_bytes.data(), &op.rkey); st != UCS_OK) {
      op.rkey = nullptr;
      finish_send(op.id, ucx_error("ucp_ep_rkey_unpack", st));
      return;
    }
    ucp_request_param_t put_params{};
    void* put = ucp_put_nbx(endpoint->second->ep, op.source, op.length, grant.remote_address, op.rkey, &put_params);
    if (UCS_PTR_IS_ERR(put)) {
      finish_send(op.id, ucx_error("ucp_put_nbx", UCS_PTR_STATUS(put)));
      return;
    }
    if (put != nullptr) ucp_request_free(put);  // the flush below covers its completion
    ucp_request_param_t flush_params{};
    flush_params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    flush_params.cb.send = &UcxTransport::on_send_done;
    flush_params.user_data = &op;
    void* flush = ucp_ep_flush_nbx(endpoint->second->ep, &flush_params);
    if (flush == nullptr) {
      send_step_done(op);
    } else if (UCS_PTR_IS_ERR(flush)) {
      finish_send(op.id, ucx_error("ucp_ep_flush_nbx", UCS_PTR_STATUS(flush)));
    } else {
      op.request = flush;
    }
  }

  static ucs_status_t on_put_done_am(void* arg, const void* header, std::size_t header_length, void* /*data*/,
                                     std::size_t /*length*/, const ucp_am_recv_param_t* /*param*/) {
    if (header_length != sizeof(PutDone)) return UCS_OK;
    PutDone done;
    std::memcpy(&done, header, sizeof done);
    static_cast<UcxTransport*>(arg)->finish_landing(done.grant_id, Status::ok());
    return UCS_OK;
  }

  // --- shutdown ------------------------------------------------------------------

  void shut_down_on_thread() {
    if (listener_ != nullptr) {
      for (auto request : conn_requests_) ucp_listener_reject(listener_, request);
      conn_requests_.clear();
      ucp_listener_destroy(listener_);
      listener_ = nullptr;
    }
    std::deque<Command> abandoned;
    {
      std::lock_guard lock(queue_mutex_);
      closed_ = true;
      abandoned.swap(queue_);
    }
    for (auto& command : abandoned) command(false);
    // A send completes at the sender once UCX holds its bytes, not once the peer
    // has them; a forced close would drop what is still queued (and a reset
    // connection can discard what the peer has not read yet). Flush, then close
    // gracefully, boundedly, so a process that exits right after its sends
    // completed still delivers them.
    // A peer that did not answer the flush (stopped, gone) would not answer a graceful
    // close either, and UCX 1.13 aborts when a worker is destroyed under an endpoint
    // still closing with requests: then close by force.
    const bool flushed = flush_worker(std::chrono::steady_clock::now() + std::chrono::seconds(2));
    std::vector<std::uint64_t> ids;
    for (const auto& [id, endpoint] : endpoints_) {
      if (!endpoint->failed) ids.push_back(id);
    }
    for (const auto id : ids)
      fail_endpoint(id, cancelled("transport shut down"), /*peer_failed=*/false, /*graceful=*/flushed);
    // Let UCX complete what the closes cancelled, boundedly.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while ((!closing_.empty() || sends_.size() > abandoned_sends_ || !landings_.empty() || flush_pending()) &&
           std::chrono::steady_clock::now() < give_up) {
      ucp_worker_progress(worker_);
      handle_deferred();
    }
    // UCX 1.13 aborts the process when a worker is destroyed while an endpoint still
    // holds requests (a peer that is stopped answers neither the flush nor the close).
    // Then the worker is left to the process's exit instead (destroy_ucx).
    if (flush_pending() || !closing_.empty()) {
      ucx_unreleased_ = true;
      logger()->error(
          "UCX did not release {} closing endpoint(s) within the shutdown bound (a peer that does not answer); "
          "the UCX worker is left to the process's exit rather than destroyed under them",
          closing_.size());
    }
    std::vector<std::uint64_t> leftover;
    for (const auto& [id, op] : sends_) leftover.push_back(id);
    // A send whose endpoint did not finish closing (a stopped peer never answers the
    // graceful close) may still be completed by UCX, even inside ucp_worker_destroy:
    // its owner hears now, the op stays until UCX lets go of it.
    for (const auto id : leftover) abandon_send(*sends_.at(id), cancelled("transport shut down"));
    leftover.clear();
    for (const auto& [id, landing] : landings_) leftover.push_back(id);
    for (const auto id : leftover) abandon_landing(id, cancelled("transport shut down"));
  }

  // Whether the flush finished within `give_up`.
  bool flush_worker(std::chrono::steady_clock::time_point give_up) {
    ucp_request_param_t params{};
    void* request = ucp_worker_flush_nbx(worker_, &params);
    if (!UCS_PTR_IS_PTR(request)) return true;  // nothing was outstanding (or the flush failed at once)
    while (ucp_request_check_status(request) == UCS_INPROGRESS && std::chrono::steady_clock::now() < give_up) {
      ucp_worker_progress(worker_);
      handle_deferred();
    }
    const bool finished = ucp_request_check_status(request) != UCS_INPROGRESS;
    if (finished) {
      ucp_request_free(request);
    } else {
      logger()->warn("UCX flush at shutdown did not finish within its bound; closing by force");
      shutdown_flush_ = request;  // the forced closes should end it; checked before the worker goes
    }
    return finished;
  }

  bool flush_pending() {
    if (shutdown_flush_ == nullptr) return false;
    if (ucp_request_check_status(shutdown_flush_) == UCS_INPROGRESS) return true;
    ucp_request_free(shutdown_flush_);
    shutdown_flush_ = nullptr;
    return false;
  }

  void destroy_ucx() {
    if (listener_ != nullptr) ucp_listener_destroy(listener_);
    if (ucx_unreleased_) {  // see shut_down_on_thread: destroying would abort
      keep_until_exit(worker_);
      keep_until_exit(context_);
      return;
    }
    for (auto& [id, request] : closing_) ucp_request_free(request);
    closing_.clear();
    control_in_flight_.clear();
    for (auto& [id, region] : regions_) ucp_mem_unmap(context_, region->memh);
    regions_.clear();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  UcxOptions options_;
  ucp_context_h context_ = nullptr;
  void* shutdown_flush_ = nullptr;  // a shutdown flush UCX has not finished
  bool ucx_unreleased_ = false;     // UCX still holds endpoint requests: never destroy the worker
  ucp_worker_h worker_ = nullptr;
  ucp_listener_h listener_ = nullptr;
  int ucx_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;
  std::atomic<std::thread::id> progress_thread_id_{};
  std::atomic<bool> stop_requested_{false};
  std::atomic<bool> sleeping_{false};
  AtomicStats stats_;

  std::mutex queue_mutex_;
  std::deque<Command> queue_;  // bounded by options_.command_queue_capacity
  bool closed_ = false;        // under queue_mutex_

  // Everything below belongs to the progress thread.
  std::uint64_t next_id_ = 1;
  std::string listen_address_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Region>> regions_;
  std::map<std::uintptr_t, std::uint64_t> regions_by_base_;
  std::unordered_map<std::uint64_t, std::unique_ptr<Endpoint>> endpoints_;
  std::unordered_map<std::string, std::uint64_t> endpoints_by_peer_;
  std::unordered_map<ucp_ep_h, std::uint64_t> endpoint_by_ucp_;
  std::unordered_map<std::uint64_t, std::unique_ptr<SendOp>> sends_;
  std::set<std::pair<TimePoint, std::uint64_t>> deadlines_;
  std::unordered_map<std::uint64_t, std::unique_ptr<PendingLanding>> landings_;
  std::set<std::pair<TimePoint, std::uint64_t>> landing_deadlines_;
  // Reported failed (their peer was cut off) while UCX still holds their receive.
  std::unordered_map<std::uint64_t, std::unique_ptr<PendingLanding>> abandoned_landings_;
  std::deque<ucp_conn_request_h> conn_requests_;
  std::deque<std::pair<std::uint64_t, Status>> failed_endpoints_;
  std::vector<std::pair<std::uint64_t, void*>> closing_;  // endpoint id, close request
  std::unordered_map<ControlMessage*, std::unique_ptr<ControlMessage>> control_in_flight_;
  std::uint64_t abandoned_sends_ = 0;
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
  ucx.clock = std::move(clock);
  return ucx;
}

Result<UcxMode> parse_ucx_mode(std::string_view name) {
  if (name == "am") return UcxMode::am;
  if (name == "put") return UcxMode::put;
  return invalid_argument(fmt::format("ucx mode '{}': expected am or put", name));
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
