#include "connector/worker/store_prefetcher.h"

#include <fmt/format.h>

#include "core/logging.h"

namespace ecx::worker {

StorePrefetcher::StorePrefetcher(std::shared_ptr<store::EmbeddingStore> store, std::uint64_t max_bytes,
                                 Duration hold_for, std::shared_ptr<const Clock> clock)
    : store_(std::move(store)),
      max_bytes_(max_bytes),
      hold_for_(hold_for),
      clock_(clock ? std::move(clock) : SteadyClock::shared()),
      thread_([this] { run(); }) {}

StorePrefetcher::~StorePrefetcher() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

void StorePrefetcher::request(const scheduler::StoreLoad& item) {
  {
    std::lock_guard lock(mutex_);
    if (held_.contains(item.mm_hash)) return;  // asked again: still held, reported by every drain
    if (stopping_ || queue_.size() >= kMaxQueued) {
      ++counters_.failed;
      report_.failed.push_back(item.mm_hash);
      return;
    }
    queue_.push_back(item);
  }
  changed_.notify_all();
}

std::optional<StorePrefetcher::Copy> StorePrefetcher::take(std::string_view mm_hash) {
  std::lock_guard lock(mutex_);
  auto it = held_.find(std::string(mm_hash));
  if (it == held_.end()) return std::nullopt;
  Copy copy = std::move(it->second);
  held_.erase(it);
  reserved_bytes_ -= copy.bytes.size();
  return copy;
}

StorePrefetcher::Report StorePrefetcher::drain() {
  std::lock_guard lock(mutex_);
  const TimePoint now = clock_->now();
  for (auto it = held_.begin(); it != held_.end();) {
    if (now - it->second.ready_at < hold_for_) {
      ++it;
      continue;
    }
    ++counters_.dropped;
    reserved_bytes_ -= it->second.bytes.size();
    report_.dropped.push_back(it->first);
    it = held_.erase(it);
  }
  Report out = std::exchange(report_, {});
  // Every copy held, each time: TP ranks finish their reads in different steps, and the
  // scheduler sees a copy as ready only in a step whose reports all name it.
  out.ready.reserve(held_.size());
  for (const auto& [h, copy] : held_) out.ready.push_back(h);
  return out;
}

StorePrefetcher::Counters StorePrefetcher::counters() const {
  std::lock_guard lock(mutex_);
  Counters c = counters_;
  c.held_bytes = 0;
  for (const auto& [h, copy] : held_) c.held_bytes += copy.bytes.size();
  return c;
}

void StorePrefetcher::run() noexcept {
  auto log = ecx::log::get("worker");
  std::unique_lock lock(mutex_);
  for (;;) {
    // Bounded wait: re-checks at least once a second whatever happens.
    changed_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    if (queue_.empty()) continue;
    scheduler::StoreLoad item = std::move(queue_.front());
    queue_.pop_front();
    const std::uint64_t nbytes = item.spec.nbytes();
    if (reserved_bytes_ + nbytes > max_bytes_) {
      // No room to hold it: the item is encoded (store_prefetch_max_bytes).
      ++counters_.failed;
      report_.failed.push_back(std::move(item.mm_hash));
      continue;
    }
    reserved_bytes_ += nbytes;
    lock.unlock();
    std::vector<std::byte> bytes;
    auto land = [&](const TensorSpec& spec) -> Result<std::span<std::byte>> {
      if (spec != item.spec) {
        return invalid_argument(
            fmt::format("the store holds {} but the engine expects {}", spec.to_string(), item.spec.to_string()));
      }
      bytes.resize(spec.nbytes());
      return std::span<std::byte>(bytes);
    };
    auto entry = store_->get_into(item.mm_hash, land);
    if (!entry && entry.status().code() != StatusCode::not_found) {
      log->debug("prefetch of mm_hash={} from {} failed: {}", item.mm_hash, store_->describe(),
                 entry.status().to_string());
    }
    lock.lock();
    if (!entry) {
      reserved_bytes_ -= nbytes;
      ++counters_.failed;
      report_.failed.push_back(std::move(item.mm_hash));
      continue;
    }
    ++counters_.prefetched;
    if (auto old = held_.find(item.mm_hash); old != held_.end()) {  // asked twice while queued
      reserved_bytes_ -= old->second.bytes.size();
      held_.erase(old);
    }
    held_.emplace(std::move(item.mm_hash), Copy{item.spec, std::move(bytes), clock_->now()});
  }
}

}  // namespace ecx::worker
