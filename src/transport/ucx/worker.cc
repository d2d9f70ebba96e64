#include "transport/ucx/worker.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "ecx/core/sanitizers.h"
#include "ecx/core/thread_name.h"

namespace ecx::transport::ucx {

namespace {

// The names of a UCX_TLS list ("a,b,c"; an exclusion list "^a,b" without its '^').
std::vector<std::string_view> tls_names(std::string_view tls) {
  if (!tls.empty() && tls.front() == '^') tls.remove_prefix(1);
  std::vector<std::string_view> names;
  while (!tls.empty()) {
    const auto comma = tls.find(',');
    names.push_back(tls.substr(0, comma));
    tls = comma == std::string_view::npos ? std::string_view{} : tls.substr(comma + 1);
  }
  return names;
}

template <std::size_t N>
bool listed(const std::array<std::string_view, N>& list, std::string_view name) {
  return std::find(list.begin(), list.end(), name) != list.end();
}

// Whether a UCX_TLS list names shared-memory transports only. A list that excludes
// ('^...') or is empty leaves UCX to choose among all it has.
bool only_shared_memory(std::string_view tls) {
  if (tls.empty() || tls.front() == '^') return false;
  static constexpr std::array<std::string_view, 9> kShared = {"sm",    "shm", "mm",   "posix", "sysv",
                                                              "xpmem", "cma", "knem", "self"};
  const auto names = tls_names(tls);
  return std::all_of(names.begin(), names.end(), [](std::string_view name) { return listed(kShared, name); });
}

// Whether a UCX_TLS list lets UCX use shared memory: empty (UCX chooses among all it
// has), "all", a list naming a shared-memory transport, or an exclusion list ('^...')
// that leaves them in.
bool allows_shared_memory(std::string_view tls) {
  if (tls.empty()) return true;
  static constexpr std::array<std::string_view, 6> kShared = {"sm", "shm", "mm", "posix", "sysv", "all"};
  const auto names = tls_names(tls);
  const bool named =
      std::any_of(names.begin(), names.end(), [](std::string_view name) { return listed(kShared, name); });
  return (tls.front() == '^') != named;
}

}  // namespace

UcxWorker::~UcxWorker() {
  stop();
  destroy();
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

Status UcxWorker::open(std::size_t required_am_header) {
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
  const bool names_tcp = tls.find("tcp") != std::string::npos;
  // "^a,b" lists what UCX must leave out.
  const bool may_use_tcp =
      tls.empty() || (tls.front() == '^' ? !names_tcp : names_tcp || tls.find("all") != std::string::npos);
  shared_memory_allowed_ = allows_shared_memory(tls);
  if (options_.peer_error_handling && only_shared_memory(tls)) {
    // Said here, at start: otherwise every connection fails later with UCX's
    // "Destination is unreachable" and nothing names the cause.
    ucp_config_release(config);
    return invalid_argument(fmt::format(
        "UCX_TLS={} names only shared-memory transports, which UCX 1.13 cannot run with peer error handling, so no "
        "peer could be reached: set ucx_peer_errors to false to move payloads over shared memory (a dead peer is "
        "then noticed at its send deadline), or add tcp to UCX_TLS",
        tls));
  }
  if (options_.mode == UcxMode::put && only_shared_memory(tls)) {
    // Put mode connects by socket address, which UCX 1.13 never carries over shared
    // memory: every connection would fail later ("device lo is not enabled") and the
    // sends stall until their deadlines.
    ucp_config_release(config);
    return invalid_argument(fmt::format(
        "UCX_TLS={} names only shared-memory transports, but ucx_mode put connects by socket address, which UCX "
        "1.13 never carries over shared memory, so no peer could be reached: set ucx_mode to am (its rendezvous is "
        "zero-copy over shared memory) or add tcp to UCX_TLS",
        tls));
  }
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
  if (attr.max_am_header < required_am_header) {
    return unavailable(fmt::format("UCX allows active message headers of {} bytes; ECX needs {}", attr.max_am_header,
                                   required_am_header));
  }
  return Status::ok();
}

Status UcxWorker::set_am_handler(unsigned id, ucp_am_recv_callback_t callback, void* arg) {
  ucp_am_handler_param_t params{};
  params.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                      UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  params.id = id;
  params.cb = callback;
  params.arg = arg;
  params.flags = UCP_AM_FLAG_WHOLE_MSG;
  if (auto st = ucp_worker_set_am_recv_handler(worker_, &params); st != UCS_OK) {
    return ucx_error("ucp_worker_set_am_recv_handler", st);
  }
  return Status::ok();
}

Status UcxWorker::start(ProgressHooks& hooks) {
  hooks_ = &hooks;
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
  thread_ = std::thread([this] {
    name_this_thread("ecx-ucx");
    run();
  });
  return Status::ok();
}

void UcxWorker::stop() {
  if (!thread_.joinable()) return;
  stop_requested_.store(true);
  wake();
  thread_.join();
}

Status UcxWorker::enqueue(Command command) {
  {
    std::lock_guard lock(queue_mutex_);
    if (closed_) return unavailable("transport is shutting down");
    if (queue_.size() >= options_.command_queue_capacity) {
      return resource_exhausted(fmt::format("transport command queue full ({} entries)", queue_.size()));
    }
    queue_.push_back(std::move(command));
    commands_waiting_.store(true);
  }
  // The first command to find the thread asleep wakes it; the rest find the flag
  // cleared. The thread drains the whole queue once up: while it waited for a CPU,
  // every send of a dispatcher pass used to write the event fd again (0.57 writes per
  // item at 64 KiB against 0.05 sleeps).
  if (sleeping_.exchange(false)) wake();
  return Status::ok();
}

void UcxWorker::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto written = ::write(wake_fd_, &one, sizeof one);
}

// --- progress thread -----------------------------------------------------------

void UcxWorker::run() {
  progress_thread_id_.store(std::this_thread::get_id());
  auto last_work = std::chrono::steady_clock::now();
  while (!stop_requested_.load()) {
    bool worked = run_commands();
    unsigned progressed = 0;
    for (unsigned n = ucp_worker_progress(worker_); n != 0 && progressed < 100000; n = ucp_worker_progress(worker_)) {
      progressed += n;
    }
    worked = hooks_->handle_deferred() || worked;
    hooks_->expire_deadlines();
    const auto now = std::chrono::steady_clock::now();
    if (worked || progressed != 0) {
      last_work = now;
      continue;
    }
    if (hooks_->busy() && now - last_work < options_.spin_before_sleep) continue;
    sleep_until_event();
  }
  hooks_->shut_down();
}

bool UcxWorker::run_commands() {
  if (!commands_waiting_.exchange(false)) return false;
  {
    std::lock_guard lock(queue_mutex_);
    batch_.swap(queue_);
  }
  for (auto& command : batch_) command(true);
  const bool ran = !batch_.empty();
  batch_.clear();
  return ran;
}

void UcxWorker::sleep_until_event() {
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
  if (const auto deadline = hooks_->next_deadline()) {
    timeout = std::clamp<Duration>(*deadline - options_.clock->now(), Duration::zero(), timeout);
  }
  const int timeout_ms = static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(timeout).count());
  epoll_event events[2];
  [[maybe_unused]] const int ready = ::epoll_wait(epoll_fd_, events, 2, timeout_ms);
  sleeping_.store(false);
  std::uint64_t drained = 0;
  [[maybe_unused]] const auto read_bytes = ::read(wake_fd_, &drained, sizeof drained);
}

// --- shutdown ------------------------------------------------------------------

void UcxWorker::close_queue() {
  std::deque<Command> abandoned;
  {
    std::lock_guard lock(queue_mutex_);
    closed_ = true;
    abandoned.swap(queue_);
  }
  for (auto& command : abandoned) command(false);
}

bool UcxWorker::flush(std::chrono::steady_clock::time_point give_up) {
  ucp_request_param_t params{};
  void* request = ucp_worker_flush_nbx(worker_, &params);
  if (!UCS_PTR_IS_PTR(request)) return true;  // nothing was outstanding (or the flush failed at once)
  while (ucp_request_check_status(request) == UCS_INPROGRESS && std::chrono::steady_clock::now() < give_up) {
    ucp_worker_progress(worker_);
    hooks_->handle_deferred();
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

bool UcxWorker::flush_pending() {
  if (shutdown_flush_ == nullptr) return false;
  if (ucp_request_check_status(shutdown_flush_) == UCS_INPROGRESS) return true;
  ucp_request_free(shutdown_flush_);
  shutdown_flush_ = nullptr;
  return false;
}

void UcxWorker::destroy() {
  if (unreleased_) {  // destroying would abort: see UcxTransport's shutdown
    keep_until_exit(worker_);
    keep_until_exit(context_);
  } else {
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }
  worker_ = nullptr;
  context_ = nullptr;
}

}  // namespace ecx::transport::ucx
