#pragma once
// In-process cancels. Where a client and the server it calls share a process (a
// consumer scheduler and its shards: vLLM with one rank in its engine process, the
// simulator), a cancel whose handler allows it (ControlHandler::cancel_runs_anywhere)
// runs on the caller's thread: no encode, no ZeroMQ I/O threads, no loopback round
// trip, no server-thread wake. Anything else keeps the network.
//
// Keyed by the server's instance id (its hello), as LocalEventRegistry is: an address
// seen from the client may name the server differently, and a restarted server is a
// new instance the client must discover.

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ecx/wire/messages.h"

namespace ecx::control::detail {

class LocalCancelRegistry {
 public:
  // Answers every item, in order, as the server's cancel_batch would.
  using Serve = std::function<wire::CancelBatchReply(std::span<const wire::CancelRequest>)>;

  static LocalCancelRegistry& instance();

  // A server whose cancels may run here. `secret` is its auth secret ("" = off): a
  // caller with another one is refused here and meets the network path's check.
  void add(const std::string& instance, const std::string& secret, Serve serve);
  // Before the server's state goes away: no new call starts, and this returns once
  // the calls running have (a cancel is a short, bounded piece of work; a call still
  // running after 10 s is logged and not waited for).
  void remove(const std::string& instance);
  // The server's answer, or nullopt when `instance` is not served in this process
  // with `secret` (the caller then uses the network).
  std::optional<wire::CancelBatchReply> cancel_batch(const std::string& instance, const std::string& secret,
                                                     std::span<const wire::CancelRequest> items);

 private:
  struct Entry {
    std::string instance;
    std::string secret;
    std::shared_ptr<const Serve> serve;
    std::size_t running = 0;
    bool leaving = false;
  };
  std::vector<Entry>::iterator find_locked(const std::string& instance);
  std::mutex mutex_;
  std::condition_variable settled_;  // a call ended
  std::vector<Entry> entries_;       // few: one per shard in this process; guarded by mutex_
};

}  // namespace ecx::control::detail
