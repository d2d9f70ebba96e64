#pragma once
// The UCX worker and the thread that drives it: the ucp context and worker (touched
// only by the progress thread), the progress loop with its epoll sleep, the bounded
// command queue through which every other thread hands it work, and the parts of
// shutdown that concern UCX itself (the bounded flush, destroying or keeping the
// worker). What the loop does besides progressing UCX (deferred work, deadlines, the
// order of shutdown) it asks its ProgressHooks, implemented above it.

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/transport/ucx_transport.h"
#include "transport/ucx/common.h"

namespace ecx::transport::ucx {

// A command for the progress thread; called with false when the transport shuts
// down before running it (it must then report cancellation to whoever waits).
using Command = std::function<void(bool run)>;

// What the progress loop runs besides UCX's own progress. Every call is on the
// progress thread.
class ProgressHooks {
 public:
  virtual ~ProgressHooks() = default;
  // Work queued by UCX callbacks that must not run inside them; true if there was any.
  virtual bool handle_deferred() = 0;
  // Fails what passed its deadline.
  virtual void expire_deadlines() = 0;
  // Operations are in flight: the loop polls a little longer before it sleeps.
  virtual bool busy() const = 0;
  // The earliest send deadline; an idle loop wakes for it.
  virtual std::optional<TimePoint> next_deadline() const = 0;
  // The loop has ended (stop()): close everything down, still on the progress thread.
  virtual void shut_down() = 0;
};

class UcxWorker {
 public:
  explicit UcxWorker(const UcxOptions& options) : options_(options) {}
  // The owner stops the worker first (its hooks run the shutdown); closes the event fds.
  ~UcxWorker();

  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  // Creates the context and the worker, which must allow active-message headers of
  // `required_am_header` bytes.
  Status open(std::size_t required_am_header);
  // Before start(): `arg` is handed to `callback` with every message of `id`.
  Status set_am_handler(unsigned id, ucp_am_recv_callback_t callback, void* arg);
  // Sets up the event fds and starts the progress thread.
  Status start(ProgressHooks& hooks);
  // Ends the loop (the hooks shut down on the progress thread) and joins it.
  void stop();

  ucp_context_h context() const noexcept { return context_; }
  ucp_worker_h worker() const noexcept { return worker_; }

  // Runs `fn` on the progress thread and waits (bounded) for its result.
  template <typename T>
  Result<T> call(std::function<Result<T>()> fn);
  // Queues `command` for the progress thread; resource_exhausted when the queue is full.
  Status enqueue(Command command);

  // --- shutdown, on the progress thread --------------------------------------------

  // Refuses new commands and cancels the queued ones.
  void close_queue();
  // Flushes the worker; whether the flush finished by `give_up`.
  bool flush(std::chrono::steady_clock::time_point give_up);
  // A flush that did not finish in time is still outstanding.
  bool flush_pending();
  void progress() { ucp_worker_progress(worker_); }
  // UCX still holds endpoint requests: destroy() must not destroy the worker.
  void leave_to_exit() noexcept { unreleased_ = true; }
  bool left_to_exit() const noexcept { return unreleased_; }
  // After open(): whether the transport list (tls, else UCX_TLS) lets this side use
  // shared memory at all; shared sources follow the operator's choice.
  bool shared_memory_allowed() const noexcept { return shared_memory_allowed_; }
  // Destroys the worker and the context, or keeps them until the process exits.
  void destroy();

 private:
  template <typename T>
  struct CallState {
    std::mutex mutex;
    std::condition_variable done;
    std::optional<Result<T>> result;
  };

  void run();
  bool run_commands();
  void sleep_until_event();
  void wake();

  const UcxOptions& options_;
  ProgressHooks* hooks_ = nullptr;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  void* shutdown_flush_ = nullptr;  // a shutdown flush UCX has not finished
  bool shared_memory_allowed_ = false;
  bool unreleased_ = false;  // UCX still holds endpoint requests: never destroy the worker
  int ucx_fd_ = -1;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  std::thread thread_;
  std::atomic<std::thread::id> progress_thread_id_{};
  std::atomic<bool> stop_requested_{false};
  std::atomic<bool> sleeping_{false};

  std::mutex queue_mutex_;
  std::deque<Command> queue_;  // bounded by options_.command_queue_capacity
  bool closed_ = false;        // under queue_mutex_
  // Set with every enqueue: the progress thread polls it instead of the mutex.
  std::atomic<bool> commands_waiting_{false};
  // The progress thread's batch, kept between rounds: a std::deque allocates when it
  // is built, and the loop runs every few microseconds while it polls.
  std::deque<Command> batch_;
};

template <typename T>
Result<T> UcxWorker::call(std::function<Result<T>()> fn) {
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

}  // namespace ecx::transport::ucx
