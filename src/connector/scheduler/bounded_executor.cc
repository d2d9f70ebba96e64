#include "connector/scheduler/bounded_executor.h"

#include <chrono>
#include <exception>
#include <utility>

#include "core/logging.h"
#include "ecx/core/thread_name.h"

namespace ecx::scheduler {

BoundedExecutor::BoundedExecutor(std::string name, std::size_t threads, std::size_t max_queued)
    : name_(std::move(name)),
      thread_count_(threads == 0 ? 1 : threads),
      max_queued_(max_queued == 0 ? 1 : max_queued) {}

BoundedExecutor::~BoundedExecutor() { close(); }

bool BoundedExecutor::try_submit(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    if (closed_ || queue_.size() >= max_queued_) return false;
    queue_.push_back(std::move(task));
    // Threads start lazily, one per submit until the pool is full.
    if (threads_.size() < thread_count_)
      threads_.emplace_back([this] {
        name_this_thread("ecx-executor");
        run();
      });
  }
  wake_.notify_one();
  return true;
}

std::size_t BoundedExecutor::close(const std::function<void()>& before_join) {
  std::vector<std::thread> threads;
  std::size_t dropped = 0;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    dropped = queue_.size();
    queue_.clear();
    threads.swap(threads_);
  }
  wake_.notify_all();
  if (before_join) before_join();
  for (auto& t : threads) t.join();
  return dropped;
}

std::size_t BoundedExecutor::queued() const {
  std::lock_guard lock(mutex_);
  return queue_.size();
}

void BoundedExecutor::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      // close() notifies; the periodic wake only bounds the wait.
      while (!closed_ && queue_.empty()) wake_.wait_for(lock, std::chrono::seconds(1));
      if (queue_.empty()) return;  // closed
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      task();
    } catch (const std::exception& e) {
      ecx::log::get("scheduler")->error("{}: a task threw: {}", name_, e.what());
    } catch (...) {
      ecx::log::get("scheduler")->error("{}: a task threw a non-standard exception", name_);
    }
  }
}

}  // namespace ecx::scheduler
