#include "control/local_events.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

namespace ecx::control::detail {

LocalEventQueue::LocalEventQueue(std::size_t max_events) : max_events_(max_events == 0 ? 1 : max_events) {
  if (!wakeup_.valid()) throw std::system_error(errno, std::generic_category(), "eventfd for in-process events");
}

std::optional<std::string> LocalEventQueue::push(wire::Event event) {
  std::optional<std::string> dropped;
  bool wake = false;
  {
    std::lock_guard lock(mutex_);
    if (events_.size() >= max_events_) {
      dropped = std::move(events_.front().transfer_id);
      events_.pop_front();
    }
    events_.push_back(std::move(event));
    wake = armed_;
  }
  if (wake) wakeup_.notify();
  return dropped;
}

std::size_t LocalEventQueue::take(std::vector<wire::Event>& out, std::size_t max) {
  std::lock_guard lock(mutex_);
  const std::size_t n = std::min(max, events_.size());
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back(std::move(events_.front()));
    events_.pop_front();
  }
  return n;
}

bool LocalEventQueue::ready() {
  std::lock_guard lock(mutex_);
  return ready_locked();
}

int LocalEventQueue::arm() {
  std::lock_guard lock(mutex_);
  if (ready_locked()) return -1;
  armed_ = true;  // a push from now on writes the eventfd
  return wakeup_.fd();
}

void LocalEventQueue::disarm() noexcept {
  {
    std::lock_guard lock(mutex_);
    armed_ = false;
  }
  // A notify that raced this stays readable until the next disarm: one early wake.
  wakeup_.clear();
}

void LocalEventQueue::wait_until(std::chrono::steady_clock::time_point deadline) {
  const int fd = arm();
  if (fd < 0) return;
  pollfd item{fd, POLLIN, 0};
  for (;;) {
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::steady_clock::duration::zero()) break;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    const timespec timeout{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    if (::ppoll(&item, 1, &timeout, nullptr) >= 0 || errno != EINTR) break;
  }
  disarm();
}

void LocalEventQueue::publisher_left() noexcept {
  bool wake = false;
  {
    std::lock_guard lock(mutex_);  // so that a waiter cannot miss the flag
    publisher_left_.store(true, std::memory_order_release);
    wake = armed_;
  }
  if (wake) wakeup_.notify();
}

LocalEventRegistry& LocalEventRegistry::instance() {
  static LocalEventRegistry registry;
  return registry;
}

LocalEventRegistry::Publishers::iterator LocalEventRegistry::find_locked(const std::string& instance) {
  return std::find_if(publishers_.begin(), publishers_.end(), [&](const auto& p) { return p.first == instance; });
}

void LocalEventRegistry::add_publisher(const std::string& instance, const std::string& secret,
                                       std::function<void()> wake) {
  std::lock_guard lock(mutex_);
  publishers_.emplace_back(instance, Entry{secret, std::move(wake), {}});
}

void LocalEventRegistry::remove_publisher(const std::string& instance) {
  std::shared_ptr<LocalEventQueue> subscriber;
  {
    std::lock_guard lock(mutex_);
    const auto it = find_locked(instance);
    if (it == publishers_.end()) return;
    subscriber = it->second.subscriber.lock();
    publishers_.erase(it);
  }
  if (subscriber) subscriber->publisher_left();
}

bool LocalEventRegistry::subscribe(const std::string& instance, const std::string& secret,
                                   const std::shared_ptr<LocalEventQueue>& queue) {
  std::lock_guard lock(mutex_);
  const auto it = find_locked(instance);
  if (it == publishers_.end() || it->second.secret != secret) return false;
  it->second.subscriber = queue;
  // Under the lock: once remove_publisher() returned, no wake reaches a server that
  // is going away. Events it queued before this subscription come now.
  if (it->second.wake) it->second.wake();
  return true;
}

void LocalEventRegistry::unsubscribe(const std::string& instance, const LocalEventQueue* queue) {
  std::lock_guard lock(mutex_);
  if (const auto it = find_locked(instance); it != publishers_.end() && it->second.subscriber.lock().get() == queue) {
    it->second.subscriber.reset();
  }
}

std::shared_ptr<LocalEventQueue> LocalEventRegistry::subscriber(const std::string& instance) {
  std::lock_guard lock(mutex_);
  const auto it = find_locked(instance);
  return it == publishers_.end() ? nullptr : it->second.subscriber.lock();
}

}  // namespace ecx::control::detail
