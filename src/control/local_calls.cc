#include "control/local_calls.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "core/logging.h"

namespace ecx::control::detail {

LocalCancelRegistry& LocalCancelRegistry::instance() {
  static LocalCancelRegistry registry;
  return registry;
}

std::vector<LocalCancelRegistry::Entry>::iterator LocalCancelRegistry::find_locked(const std::string& instance) {
  return std::find_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.instance == instance; });
}

void LocalCancelRegistry::add(const std::string& instance, const std::string& secret, Serve serve) {
  std::lock_guard lock(mutex_);
  if (find_locked(instance) != entries_.end()) return;  // instance ids are random: never reused
  entries_.push_back(Entry{instance, secret, std::make_shared<const Serve>(std::move(serve)), 0, false});
}

void LocalCancelRegistry::remove(const std::string& instance) {
  std::unique_lock lock(mutex_);
  auto it = find_locked(instance);
  if (it == entries_.end()) return;
  it->leaving = true;
  const bool settled = settled_.wait_for(lock, std::chrono::seconds(10), [&] {
    auto e = find_locked(instance);
    return e == entries_.end() || e->running == 0;
  });
  if (!settled) {
    ecx::log::get("control")->error("an in-process cancel on server {} did not return within 10 s", instance);
  }
  if (auto e = find_locked(instance); e != entries_.end()) entries_.erase(e);
}

std::optional<wire::CancelBatchReply> LocalCancelRegistry::cancel_batch(const std::string& instance,
                                                                        const std::string& secret,
                                                                        std::span<const wire::CancelRequest> items) {
  std::shared_ptr<const Serve> serve;
  {
    std::lock_guard lock(mutex_);
    auto it = find_locked(instance);
    if (it == entries_.end() || it->leaving || it->secret != secret) return std::nullopt;
    serve = it->serve;
    ++it->running;
  }
  // Counted down however the call ends, so remove() is never left waiting for it.
  struct Ended {
    LocalCancelRegistry& registry;
    const std::string& instance;
    ~Ended() {
      {
        std::lock_guard lock(registry.mutex_);
        if (auto it = registry.find_locked(instance); it != registry.entries_.end()) --it->running;
      }
      registry.settled_.notify_all();
    }
  } ended{*this, instance};
  return (*serve)(items);
}

}  // namespace ecx::control::detail
