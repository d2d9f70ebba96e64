#include "ecx/store/publisher.h"

#include "core/logging.h"

namespace ecx::store {

Publisher::Publisher(std::shared_ptr<EmbeddingStore> store, PublisherOptions options)
    : store_(std::move(store)), options_(options), thread_([this] { run(); }) {}

Publisher::~Publisher() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    for (const Item& item : pending_) {
      ++counters_.dropped_at_stop;
      counters_.pending_items -= 1;
      counters_.pending_bytes -= item.payload.size();
    }
    pending_.clear();
  }
  changed_.notify_all();
  thread_.join();
}

bool Publisher::offer(std::string mm_hash, TensorSpec spec, std::vector<std::byte> payload) {
  {
    std::lock_guard lock(mutex_);
    ++counters_.offered;
    if (stopping_ || counters_.pending_items + 1 > options_.max_pending_items ||
        counters_.pending_bytes + payload.size() > options_.max_pending_bytes) {
      ++counters_.dropped_full;
      return false;
    }
    counters_.pending_items += 1;
    counters_.pending_bytes += payload.size();
    pending_.push_back(Item{std::move(mm_hash), spec, std::move(payload)});
  }
  changed_.notify_all();
  return true;
}

bool Publisher::has_room(std::uint64_t nbytes) const {
  std::lock_guard lock(mutex_);
  return !stopping_ && counters_.pending_items + 1 <= options_.max_pending_items &&
         counters_.pending_bytes + nbytes <= options_.max_pending_bytes;
}

bool Publisher::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  return changed_.wait_for(lock, timeout, [&] { return pending_.empty() && !writing_; });
}

PublisherCounters Publisher::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

void Publisher::run() noexcept {
  auto log = ecx::log::get("store");
  std::unique_lock lock(mutex_);
  for (;;) {
    // Bounded wait: re-checks the state at least once a second whatever happens.
    changed_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_ || !pending_.empty(); });
    if (stopping_) return;
    if (pending_.empty()) continue;
    Item item = std::move(pending_.front());
    pending_.pop_front();
    writing_ = true;
    lock.unlock();
    Status s = store_->put(item.mm_hash, item.spec, item.payload);
    if (!s) log->debug("publishing {} to {} failed: {}", item.mm_hash, store_->describe(), s.message());
    lock.lock();
    writing_ = false;
    counters_.pending_items -= 1;
    counters_.pending_bytes -= item.payload.size();
    ++(s ? counters_.published : counters_.failed);
    changed_.notify_all();
  }
}

}  // namespace ecx::store
