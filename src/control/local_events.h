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
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/wire/messages.h"

namespace ecx::control::detail {

// One inbox's in-process mailbox, shared by every local shard it listens to.
// Bounded: when full, the oldest event is dropped (as the server's own queue does).
class LocalEventQueue {
 public:
  explicit LocalEventQueue(std::size_t max_events) : max_events_(max_events == 0 ? 1 : max_events) {}

  // Any thread. Returns the transfer id of the event dropped to make room, if one was.
  std::optional<std::string> push(wire::Event event);
  // Moves up to `max` events into `out`; returns how many.
  std::size_t take(std::vector<wire::Event>& out, std::size_t max);
  // An event is queued or a publisher left (what wait_until waits for).
  bool ready();
  // Waits until an event is queued, a publisher left, or `deadline` passes.
  void wait_until(std::chrono::steady_clock::time_point deadline);

  // A server this queue listened to stopped: its successor is a new instance,
  // found only by discovering again.
  void publisher_left() noexcept;
  bool take_publisher_left() noexcept { return publisher_left_.exchange(false, std::memory_order_acq_rel); }

 private:
  const std::size_t max_events_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::deque<wire::Event> events_;  // guarded by mutex_
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
