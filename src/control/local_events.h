#pragma once
// In-process event delivery. Where a consumer scheduler and the shards it listens to
// share a process (vLLM with one rank in its engine process, `ecx bench e2e`, the
// simulator), a shard's events skip the encode, the server thread, two ZeroMQ I/O
// threads and the loopback socket: publish() appends to the inbox's queue and wakes
// a scheduler that waits. Anything else keeps the ZeroMQ channel.
//
// Keyed by the server's instance id (sent in its hello), not by address: an address
// seen from the scheduler's side may name the shard differently (a host name, a
// wildcard bind), and a restarted server is a new instance the inbox must discover.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "control/zmq_util.h"
#include "ecx/core/clock.h"
#include "ecx/wire/messages.h"

namespace ecx::control::detail {

// One inbox's in-process mailbox, shared by every local shard it listens to.
// Bounded: when full, the oldest event is dropped (as the server's own queue does).
// Its one waiter (the inbox's thread) polls an eventfd, so that it can wait for
// these events, a network socket and the caller's own sources in one poll; a push
// writes the eventfd only while that thread is waiting (no syscall per event).
class LocalEventQueue {
 public:
  // Throws std::system_error when no eventfd can be made.
  explicit LocalEventQueue(std::size_t max_events);

  // Any thread. Returns the transfer id of the event dropped to make room, if one was.
  std::optional<std::string> push(wire::Event event);
  // Moves up to `max` events into `out`; returns how many.
  std::size_t take(std::vector<wire::Event>& out, std::size_t max);
  // An event is queued or a publisher left (what a waiter waits for).
  bool ready();
  // The waiting thread, before it polls: -1 when ready() already holds (no need to
  // wait); else the fd to poll, readable once the queue becomes ready, until disarm().
  int arm();
  void disarm() noexcept;
  // arm(), poll until ready or `deadline`, disarm().
  void wait_until(std::chrono::steady_clock::time_point deadline);

  // A server this queue listened to stopped: its successor is a new instance,
  // found only by discovering again.
  void publisher_left() noexcept;
  bool take_publisher_left() noexcept { return publisher_left_.exchange(false, std::memory_order_acq_rel); }

 private:
  bool ready_locked() const noexcept { return !events_.empty() || publisher_left_.load(std::memory_order_acquire); }
  const std::size_t max_events_;
  Wakeup wakeup_;
  std::mutex mutex_;
  std::deque<wire::Event> events_;  // guarded by mutex_
  bool armed_ = false;              // guarded by mutex_: the waiter polls wakeup_
  std::atomic<bool> publisher_left_{false};
};

// The process's servers and the inboxes subscribed to them.
class LocalEventRegistry {
 public:
  static LocalEventRegistry& instance();

  // A server that can deliver in process. `wake` asks its thread to move what it
  // queued for the network to a subscriber that just arrived; it runs under the
  // registry's lock, so it must be quick and take no lock. Once per instance.
  // `secret` is the server's auth secret ("" = off): an inbox with another one is
  // refused here and meets the network path's check instead, as it would elsewhere.
  void add_publisher(const std::string& instance, const std::string& secret, std::function<void()> wake);
  // Before the server's state goes away; its subscriber learns it left.
  void remove_publisher(const std::string& instance);
  // True when the instance is served in this process and now delivers to `queue`.
  bool subscribe(const std::string& instance, const std::string& secret, const std::shared_ptr<LocalEventQueue>& queue);
  void unsubscribe(const std::string& instance, const LocalEventQueue* queue);
  // The queue subscribed to `instance`, if any.
  std::shared_ptr<LocalEventQueue> subscriber(const std::string& instance);

 private:
  struct Entry {
    std::string secret;
    std::function<void()> wake;
    std::weak_ptr<LocalEventQueue> subscriber;
  };
  using Publishers = std::vector<std::pair<std::string, Entry>>;
  // Under mutex_.
  Publishers::iterator find_locked(const std::string& instance);
  std::mutex mutex_;
  Publishers publishers_;  // few: one per shard in this process
};

}  // namespace ecx::control::detail
