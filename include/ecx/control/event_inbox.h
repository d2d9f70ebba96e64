#pragma once
// The consumer scheduler's view of its workers' events: one PULL socket connected to
// every shard's event endpoint, or, for a shard served in this same process, an
// in-memory queue its server delivers to directly (src/control/local_events.h).
// The endpoints come from a discovery that runs on the control client's thread, so
// drain() never blocks: until the discovery has finished it returns nothing, and a
// failed discovery is retried later.
//
// Owned by one thread (the scheduler's): drain() and wait_and_drain() must not be
// called concurrently. Malformed, unknown, unauthenticated or replayed events are
// counted and dropped; they cost that event only.

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ecx/control/client.h"
#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/core/wake_source.h"
#include "ecx/wire/messages.h"

namespace ecx::control {

struct InboxOptions {
  std::string base_address;                              // the consumer's first shard, tcp://host:port
  Duration discovery_timeout = std::chrono::seconds(5);  // per discovery request
  Duration retry_interval = std::chrono::seconds(1);     // after a failed discovery
  std::size_t max_events_per_drain = 4096;
  wire::Limits limits;
  std::string auth_secret;  // "" = authentication off
  // Shards served in this process (same instance, same secret) hand their events
  // over in memory: no encode, no server thread, no socket. Off: always the network.
  bool in_process = true;
  std::shared_ptr<const Clock> clock = SteadyClock::shared();
  wire::WallClock wall_clock = wire::system_wall_clock();
};

struct InboxCounters {
  std::array<std::uint64_t, wire::kEventKindCount> received{};
  std::uint64_t malformed = 0;  // undecodable, wrong types, wrong part count
  std::uint64_t unknown = 0;    // an event kind this side does not know
  std::uint64_t auth_failures = 0;
  std::uint64_t discoveries_started = 0;
  std::uint64_t discoveries_failed = 0;
  std::uint64_t received_in_process = 0;  // of `received`, handed over in memory
};

class EventInbox {
 public:
  // The client must outlive the inbox.
  static Result<std::unique_ptr<EventInbox>> create(ControlClient& client, InboxOptions options);
  ~EventInbox();
  EventInbox(const EventInbox&) = delete;
  EventInbox& operator=(const EventInbox&) = delete;

  // Appends every event already received (up to max_events_per_drain) to `out` and
  // returns how many. Never blocks.
  std::size_t drain(std::vector<wire::Event>& out);
  // Like drain(), but waits up to `max_wait` for the subscription and the first
  // event. For threads that may block (tools, tests); never the scheduler's step.
  std::size_t wait_and_drain(std::vector<wire::Event>& out, Duration max_wait);
  // Waits up to `max_wait` until drain() would return something (an event, or a
  // subscription change it must act on) without taking it, or one of `also` polls
  // readable; true when either may. One poll covers the shards in this process, the
  // network ones and `also`. Same thread and rules as wait_and_drain().
  bool wait(Duration max_wait, std::span<const WakeSource> also = {});

  bool subscribed() const noexcept;
  std::size_t shard_count() const noexcept;
  // Disconnects, forgets the cached topology and discovers again on the next drain
  // (after a consumer restart its event ports may have changed).
  void resubscribe();
  InboxCounters counters() const;

  struct State;

 private:
  explicit EventInbox(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace ecx::control
