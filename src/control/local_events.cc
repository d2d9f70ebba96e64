#include "control/local_events.h"

#include <algorithm>

namespace ecx::control::detail {

std::optional<std::string> LocalEventQueue::push(wire::Event event) {
  std::optional<std::string> dropped;
  {
    std::lock_guard lock(mutex_);
    if (events_.size() >= max_events_) {
      dropped = std::move(events_.front().transfer_id);
      events_.pop_front();
    }
    events_.push_back(std::move(event));
  }
  arrived_.notify_one();
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
  return !events_.empty() || publisher_left_.load(std::memory_order_acquire);
}

void LocalEventQueue::wait_until(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  (void)arrived_.wait_until(lock, deadline,
                            [&] { return !events_.empty() || publisher_left_.load(std::memory_order_acquire); });
}

void LocalEventQueue::publisher_left() noexcept {
  {
    std::lock_guard lock(mutex_);  // so that a waiter cannot miss the flag
    publisher_left_.store(true, std::memory_order_release);
  }
  arrived_.notify_all();
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
