#pragma once
// A small owned thread pool with a bounded queue, for the scheduler's blocking
// control RPCs. Threads start on the first submit (a pure producer never starts
// any) and are joined by close() or the destructor. Tasks must not throw; a task
// that does is caught and logged so that nothing escapes a thread.

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ecx::scheduler {

class BoundedExecutor {
 public:
  BoundedExecutor(std::string name, std::size_t threads, std::size_t max_queued);
  ~BoundedExecutor();
  BoundedExecutor(const BoundedExecutor&) = delete;
  BoundedExecutor& operator=(const BoundedExecutor&) = delete;

  // False when the queue is full or the executor is closed; never blocks.
  bool try_submit(std::function<void()> task);
  // Stops accepting work, drops queued tasks (returns how many), runs
  // `before_join` (e.g. to make running tasks give up) and joins the threads once
  // their running tasks finish. Idempotent.
  std::size_t close(const std::function<void()>& before_join = nullptr);
  std::size_t queued() const;

 private:
  void run();

  const std::string name_;
  const std::size_t thread_count_;
  const std::size_t max_queued_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  bool closed_ = false;
};

}  // namespace ecx::scheduler
