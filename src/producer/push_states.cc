// The push's and its shards' state machines (tables and names), and the small value
// types around them; the machine that drives them is push_manager.cc.
#include <algorithm>
#include <iterator>

#include "ecx/core/transition_table.h"
#include "ecx/producer/push_manager.h"

namespace ecx::producer {

using P = PushState;
using Sh = ShardState;

namespace {

// waiting_inputs -> done/cancelled when no shard needs a payload (all followers,
// cached or cancelled by the consumer): nothing to wait for.
constexpr TransitionTable<P, kPushStateCount> kTable{
    {P::waiting_inputs, {P::writing, P::done, P::cancel_pending, P::cancelled, P::failed}},
    // A direct payload turned away: its shard reserves the usual way before the push writes again.
    {P::writing, {P::done, P::failed, P::waiting_inputs}},
    {P::cancel_pending, {P::cancelled, P::failed}},
};

// A shard's reserve, payload and cancel, as its replies drive it. A move to the state
// a shard is already in is no transition (a reserve sent again, a second release).
constexpr TransitionTable<Sh, kShardStateCount> kShardTable{
    {Sh::reserving, {Sh::reserved, Sh::no_write, Sh::retry_wait, Sh::refused}},
    {Sh::retry_wait, {Sh::reserving, Sh::released}},
    // reserving: a direct payload the shard turned away; it reserves the usual way.
    // released: a direct shard (nothing held) whose push ended before it sent.
    {Sh::reserved, {Sh::refreshing, Sh::yielding, Sh::abandoning, Sh::sending, Sh::reserving, Sh::released}},
    {Sh::no_write, {Sh::abandoning, Sh::released}},
    {Sh::refreshing, {Sh::reserving, Sh::abandoning}},
    // Given back while a sibling waits: reserve again with it (or at once when it no
    // longer waits); the push ended meanwhile: the yield was its abandon.
    {Sh::yielding, {Sh::retry_wait, Sh::reserving, Sh::abandoning}},
    // A failed payload leaves the reservation ours (a direct one: nothing held).
    {Sh::sending, {Sh::sent, Sh::reserved}},
    {Sh::refused, {Sh::released}},
    {Sh::abandoning, {Sh::released}},
};

}  // namespace

std::string_view push_state_name(PushState state) noexcept {
  switch (state) {
    case P::waiting_inputs:
      return "waiting_inputs";
    case P::writing:
      return "writing";
    case P::done:
      return "done";
    case P::cancel_pending:
      return "cancel_pending";
    case P::cancelled:
      return "cancelled";
    case P::failed:
      return "failed";
  }
  return "unknown";
}

bool is_terminal(PushState state) noexcept { return state == P::done || state == P::cancelled || state == P::failed; }

bool push_transition_allowed(PushState from, PushState to) noexcept { return kTable.allows(from, to); }

bool shard_transition_allowed(ShardState from, ShardState to) noexcept {
  return from == to || kShardTable.allows(from, to);
}

std::string_view shard_state_name(ShardState state) noexcept {
  switch (state) {
    case Sh::reserving:
      return "reserving";
    case Sh::retry_wait:
      return "retry_wait";
    case Sh::reserved:
      return "reserved";
    case Sh::no_write:
      return "no_write";
    case Sh::refreshing:
      return "refreshing";
    case Sh::yielding:
      return "yielding";
    case Sh::sending:
      return "sending";
    case Sh::sent:
      return "sent";
    case Sh::refused:
      return "refused";
    case Sh::abandoning:
      return "abandoning";
    case Sh::released:
      return "released";
  }
  return "unknown";
}

void Actions::append(Actions&& other) {
  // Into an empty list (a pass's first result, usually its only one) the buffer
  // itself moves: no allocation, no element moved.
  auto move_all = [](auto& to, auto& from) {
    if (to.empty()) {
      to = std::move(from);
    } else {
      std::move(from.begin(), from.end(), std::back_inserter(to));
    }
  };
  move_all(reserves, other.reserves);
  move_all(payloads, other.payloads);
  move_all(cancels, other.cancels);
  move_all(release_sources, other.release_sources);
}

PushOptions PushOptions::from_config(const Config& config) {
  PushOptions o;
  o.push_deadline = config.push_wait_timeout();
  o.refresh_after = config.reservation_ttl() / 2;
  o.terminal_ttl = config.reservation_ttl();
  o.retry_backoff_max = std::chrono::milliseconds(config.retry_backoff_max_ms);
  if (config.transport == "ucx" && config.ucx_mode == "am") o.direct_max_bytes = config.direct_payload_max_bytes;
  return o;
}

}  // namespace ecx::producer
