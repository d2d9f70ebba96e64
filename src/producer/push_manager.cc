#include "ecx/producer/push_manager.h"

#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <unordered_map>

#include <fmt/format.h>
#include <xxhash.h>

#include "core/id_map.h"
#include "core/logging.h"
#include "ecx/core/node_stash.h"
#include "ecx/core/recent_table.h"

namespace ecx::producer {

using P = PushState;
using Sh = ShardState;

namespace detail {

namespace {

using TimeIndex = std::multimap<TimePoint, std::string>;

struct Shard {
  Sh state = Sh::reserving;
  bool io = false;     // a reserve, payload or cancel for this shard awaits its result
  bool holds = false;  // the consumer holds a reservation of ours on this shard
  bool consumer_cancelled = false;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::uint64_t slot_offset = 0;
  TimePoint reserved_at{};
  int cancel_attempts = 0;
  int retry_afters = 0;      // consecutive retry_afters of this shard's reserve (backoff)
  bool keep_slot = false;    // the consumer refused to take this slot back (others follow its landing)
  bool direct = false;       // its payload goes without a reservation (PushOptions::direct_max_bytes)
  bool turned_away = false;  // its direct payload was not taken: reserve once the push's sends settle
  std::optional<TimeIndex::iterator> retry;
};

struct Push {
  explicit Push(PushSpec push_spec) : spec(std::move(push_spec)) {}

  PushSpec spec;
  std::set<std::string> requests;
  P state = P::waiting_inputs;
  std::vector<Shard> shards;
  std::optional<SourceId> source;
  std::optional<TimeIndex::iterator> deadline;
  TimePoint deadline_at{};  // the push deadline, kept for a return to waiting_inputs
  bool failing = false;     // failed while payloads were in flight; ends when they report
  std::string error;
  TimePoint ended_at{};        // when it became terminal (its record's TTL counts from here)
  bool settle_queued = false;  // in PushCore::ended_
};

// A finished push's destination as one number: a repeat of its transfer id must name
// the same one. Two different destinations share a fingerprint with probability 2^-64;
// such a conflicting repeat would count as a duplicate.
std::uint64_t destination_fingerprint(const PushSpec& spec) {
  // Each part seeds the next, so moving bytes between parts changes the result.
  std::uint64_t h = XXH3_64bits(spec.mm_hash.data(), spec.mm_hash.size());
  h = XXH3_64bits_withSeed(spec.consumer_address.data(), spec.consumer_address.size(), h);
  h = XXH3_64bits_withSeed(spec.spec.shape().data(), spec.spec.shape().size_bytes(), h);
  return h ^ static_cast<std::uint64_t>(spec.spec.dtype());
}

// What a push leaves once it ended and its I/O settled: enough to answer a repeat of
// its transfer id (idempotency) and a query of its states. Kept as a full Push, each
// record was about 1 KB of heap, and 65,536 of them (terminal_limit) kept the live
// pushes' table large and its lookups cold (bench_push).
struct Settled {
  P state = P::done;
  std::uint64_t destination = 0;  // destination_fingerprint
  TimePoint ended_at{};
  // Shard states: the first kInlineShards in place, the rest (a wide TP) beside them.
  static constexpr std::size_t kInlineShards = 8;
  std::array<Sh, kInlineShards> first_shards{};
  std::vector<Sh> more_shards;
  std::size_t shard_count = 0;

  Sh shard(std::size_t i) const { return i < kInlineShards ? first_shards[i] : more_shards[i - kInlineShards]; }
  void add_shard(Sh shard_state) {
    if (shard_count < kInlineShards) {
      first_shards[shard_count] = shard_state;
    } else {
      more_shards.push_back(shard_state);
    }
    ++shard_count;
  }
};

bool same_destination(const PushSpec& a, const PushSpec& b) {
  return a.mm_hash == b.mm_hash && a.consumer_address == b.consumer_address && a.spec == b.spec;
}

std::string retry_key(std::string_view tid, int shard) { return fmt::format("{}\x1f{}", tid, shard); }

}  // namespace

class PushCore {
 public:
  PushCore(PushOptions options, std::shared_ptr<const Clock> clock)
      : options_(options), clock_(std::move(clock)), log_(log::get("producer")) {}

  Result<Actions> start(PushSpec&& spec, int shard_count);
  Actions on_reserve_reply(std::string_view tid, int shard, const ReserveReply& reply);
  Actions bind_source(std::string_view mm_hash, SourceId source, std::uint64_t nbytes);
  Actions on_payload_result(std::string_view tid, int shard, const Status& result);
  Actions on_cancel_result(std::string_view tid, int shard, const Status& result);
  Actions cancel_requests(std::span<const std::string> request_ids, bool all);
  Actions tick();
  std::optional<TimePoint> next_wakeup() const;
  std::vector<FailedSave> drain_failures();
  std::optional<P> state_of(std::string_view tid) const;
  std::optional<Sh> shard_state_of(std::string_view tid, int shard) const;
  bool pending() const;
  PushCounters counters() const;
  Status check_invariants() const;

 private:
  TimePoint now() const { return clock_->now(); }
  Push* find(std::string_view tid) {
    auto it = pushes_.find(tid);
    return it == pushes_.end() ? nullptr : &it->second;
  }
  Shard* shard_of(Push* p, int shard) {
    if (p == nullptr || shard < 0 || static_cast<std::size_t>(shard) >= p->shards.size()) return nullptr;
    return &p->shards[static_cast<std::size_t>(shard)];
  }
  bool transition(Push& p, P to);
  // Every change of a shard's state goes through here; an invalid one fails the push.
  bool move(Push& p, Shard& s, Sh to);
  void step(Push& p, Actions& out);
  void fail(Push& p, std::string reason, Actions& out);
  void finish(Push& p, P to, Actions& out);
  void abandon_held(Push& p, Actions& out);
  // A cancel of the shard's reservation: `to` abandoning (given up), refreshing (reserve
  // again at once) or yielding (reserve again with a sibling that waits for space).
  void send_cancel(Push& p, int shard, Sh to, Actions& out);
  void yield_reserved(Push& p, Actions& out);
  void rejoin(Push& p, int shard, Actions& out);
  void send_reserve(Push& p, int shard, Actions& out);
  void reserve_turned_away(Push& p, Actions& out);
  void clear_retry(Shard& s);
  Duration retry_delay(Duration asked, int previous);
  void settle_cancel(Push& p, Actions& out);
  void release_source(Push& p, Actions& out);
  void unindex_waiting(Push& p);
  void enforce_terminal_limit();
  // A terminal push goes to settled_ once none of its I/O is outstanding. Pushes are
  // queued as they end (or as a terminal one's last I/O reports) and moved at the
  // start of the next call that changes state: no caller holds a reference then.
  void queue_settle(Push& p);
  void settle_ended();
  // mu_, for a call that changes state: what ended since the last one settles first.
  [[nodiscard]] std::unique_lock<std::mutex> lock_settled() {
    std::unique_lock lock(mu_);
    settle_ended();
    return lock;
  }
  Status conflict_with_settled(const PushSpec& spec, int shard_count, const Settled& settled);
  // `ids` of `index` (made if absent) gains `id`; true if it was new there.
  bool index_id(IdMap<std::set<std::string>>& index, const std::string& key, const std::string& id);
  // `ids` of `index` loses `id`, and `index` the key once it has none.
  void unindex_id(IdMap<std::set<std::string>>& index, const std::string& key, const std::string& id);

  PushOptions options_;
  std::shared_ptr<const Clock> clock_;
  std::shared_ptr<spdlog::logger> log_;

  mutable std::mutex mu_;
  IdMap<Push> pushes_;
  IdMap<std::set<std::string>> sourceless_by_hash_;  // waiting, no source yet
  IdMap<std::set<std::string>> by_request_;          // active pushes per request
  std::unordered_map<SourceId, std::uint64_t> source_refs_;
  TimeIndex deadlines_;  // waiting_inputs pushes
  TimeIndex retries_;    // shards in retry_wait, keyed by retry_key
  // Every push adds an entry to several of the indexes above and removes it when it
  // ends: their nodes, and the id strings in them, are reused.
  NodeStash<TimeIndex> time_nodes_;
  NodeStash<IdMap<std::set<std::string>>> index_nodes_;
  NodeStash<std::set<std::string>> id_nodes_;
  // Terminal pushes: those with I/O outstanding stay in pushes_ (closing_ counts them),
  // the others move here, in the order they settled (one that waited for its I/O
  // ended before some ahead of it: it expires a little late).
  RecentTable<Settled> settled_;
  std::uint64_t closing_ = 0;
  std::vector<Push*> ended_;  // queue_settle; nothing erases from pushes_ but settle_ended
  std::vector<Push*> ended_scratch_;
  std::deque<FailedSave> failures_;
  std::uint64_t io_in_flight_ = 0;
  std::minstd_rand jitter_{std::random_device{}()};
  PushCounters counters_;
};

bool PushCore::transition(Push& p, P to) {
  if (push_transition_allowed(p.state, to)) {
    p.state = to;
    return true;
  }
  ++counters_.invalid_transitions;
  log_->error("invalid push transition {} -> {} for transfer_id={} (mm_hash={})", push_state_name(p.state),
              push_state_name(to), p.spec.transfer_id, p.spec.mm_hash);
  return false;
}

bool PushCore::move(Push& p, Shard& s, Sh to) {
  if (shard_transition_allowed(s.state, to)) {
    s.state = to;
    return true;
  }
  ++counters_.invalid_transitions;
  const auto shard = static_cast<std::size_t>(&s - p.shards.data());
  log_->error("invalid shard transition {} -> {} for shard {} of transfer_id={} (mm_hash={}); failing that push",
              shard_state_name(s.state), shard_state_name(to), shard, p.spec.transfer_id, p.spec.mm_hash);
  if (p.error.empty()) p.error = "internal: invalid shard transition";
  p.failing = true;  // step() fails the push once no I/O of it is left to report
  return false;
}

void PushCore::send_reserve(Push& p, int shard, Actions& out) {
  Shard& s = p.shards[static_cast<std::size_t>(shard)];
  clear_retry(s);
  move(p, s, Sh::reserving);
  s.io = true;
  ++io_in_flight_;
  out.reserves.push_back(
      ReserveCommand{p.spec.transfer_id, shard, p.spec.consumer_address, p.spec.mm_hash, p.spec.spec});
}

void PushCore::send_cancel(Push& p, int shard, Sh to, Actions& out) {
  Shard& s = p.shards[static_cast<std::size_t>(shard)];
  move(p, s, to);
  s.io = true;
  ++s.cancel_attempts;
  ++io_in_flight_;
  ++counters_.abandons_sent;
  // A refresh ends the consumer's record as expired, so the reserve that follows is
  // not told the transfer was cancelled.
  out.cancels.push_back(
      CancelCommand{p.spec.transfer_id, shard, p.spec.consumer_address, s.reservation_id, to != Sh::abandoning});
}

// A push holds every shard's space or none: while one shard waits to reserve again
// (its rank's pool is full), the siblings holding a slot they cannot write yet give it
// back, so that space serves other pushes meanwhile, and reserve again with it.
void PushCore::yield_reserved(Push& p, Actions& out) {
  for (std::size_t i = 0; i < p.shards.size(); ++i) {
    Shard& s = p.shards[i];
    if (s.state != Sh::reserved || s.io || s.keep_slot || s.direct) continue;
    s.cancel_attempts = 0;
    send_cancel(p, static_cast<int>(i), Sh::yielding, out);
  }
}

// A yielded shard reserves again when the last waiting sibling does, or at once when
// none waits any more.
void PushCore::rejoin(Push& p, int shard, Actions& out) {
  std::optional<TimePoint> at;
  for (const Shard& sibling : p.shards) {
    if (sibling.state == Sh::retry_wait && sibling.retry && (!at || (*sibling.retry)->first > *at)) {
      at = (*sibling.retry)->first;
    }
  }
  if (!at) {
    send_reserve(p, shard, out);
    return;
  }
  Shard& s = p.shards[static_cast<std::size_t>(shard)];
  if (!move(p, s, Sh::retry_wait)) return;
  s.retry = retries_.emplace(*at, retry_key(p.spec.transfer_id, shard));
}

// The consumer's retry_after for the first refusal; after that exponential backoff
// (asked x 2^n, at most retry_backoff_max) with jitter (a uniform draw from the upper
// half), so producers refused together do not come back together.
Duration PushCore::retry_delay(Duration asked, int previous) {
  if (previous <= 0 || asked <= Duration::zero()) return asked;
  const Duration cap = std::max(asked, options_.retry_backoff_max);
  Duration d = asked;
  for (int i = 0; i < previous && d < cap; ++i) d *= 2;
  d = std::min(d, cap);
  std::uniform_int_distribution<Duration::rep> half(d.count() / 2, d.count());
  return std::max(asked, Duration(half(jitter_)));
}

void PushCore::clear_retry(Shard& s) {
  if (s.retry) {
    retries_.erase(*s.retry);
    s.retry.reset();
  }
}

// Give back whatever the consumer holds for us; shards with a reserve in flight are
// abandoned when their reply arrives.
void PushCore::abandon_held(Push& p, Actions& out) {
  for (std::size_t i = 0; i < p.shards.size(); ++i) {
    Shard& s = p.shards[i];
    if (s.io) continue;
    clear_retry(s);
    if (s.holds && s.state != Sh::sent) {
      s.cancel_attempts = 0;
      send_cancel(p, static_cast<int>(i), Sh::abandoning, out);
    } else if (s.state != Sh::sent) {
      move(p, s, Sh::released);
    }
  }
}

void PushCore::release_source(Push& p, Actions& out) {
  if (!p.source) return;
  for (const Shard& s : p.shards) {
    if (s.state == Sh::sending) return;  // a send may still read it
  }
  const SourceId id = *p.source;
  p.source.reset();
  auto it = source_refs_.find(id);
  if (it != source_refs_.end() && --it->second == 0) {
    source_refs_.erase(it);
    out.release_sources.push_back(id);
  }
}

bool PushCore::index_id(IdMap<std::set<std::string>>& index, const std::string& key, const std::string& id) {
  return id_nodes_.insert(index_nodes_.find_or_insert(index, key), id).second;
}

void PushCore::unindex_id(IdMap<std::set<std::string>>& index, const std::string& key, const std::string& id) {
  auto it = index.find(key);
  if (it == index.end()) return;
  id_nodes_.erase_key(it->second, id);
  if (it->second.empty()) index_nodes_.erase(index, it);
}

void PushCore::unindex_waiting(Push& p) {
  if (p.deadline) {
    time_nodes_.erase(deadlines_, *p.deadline);
    p.deadline.reset();
  }
  unindex_id(sourceless_by_hash_, p.spec.mm_hash, p.spec.transfer_id);
}

void PushCore::finish(Push& p, P to, Actions& out) {
  if (!transition(p, to)) {
    if (is_terminal(p.state)) return;
    p.state = P::failed;  // an unexpected path fails only this push
    if (p.error.empty()) p.error = "internal: invalid transition";
  }
  unindex_waiting(p);
  for (Shard& s : p.shards) clear_retry(s);
  for (const std::string& r : p.requests) unindex_id(by_request_, r, p.spec.transfer_id);
  release_source(p, out);
  switch (p.state) {
    case P::done:
      ++counters_.done;
      break;
    case P::cancelled:
      ++counters_.cancelled;
      break;
    default: {
      ++counters_.failed;
      if (failures_.size() >= options_.failure_queue_max) {
        failures_.pop_front();
        ++counters_.failures_dropped;
      }
      failures_.push_back(FailedSave{p.spec.transfer_id, p.spec.mm_hash,
                                     std::vector<std::string>(p.requests.begin(), p.requests.end()), p.error});
      log_->warn("push of mm_hash={} (transfer_id={}) failed: {}", p.spec.mm_hash, p.spec.transfer_id, p.error);
      break;
    }
  }
  p.ended_at = now();
  ++closing_;
  queue_settle(p);
  enforce_terminal_limit();
}

void PushCore::enforce_terminal_limit() {
  // Records with I/O outstanding stay until it reports (a late reply must still be
  // able to abandon what it reserved); the bounds hold once I/O settles.
  const TimePoint t = now();
  auto due = [&] {
    return settled_.size() + closing_ > options_.terminal_limit ||
           (options_.terminal_ttl > Duration::zero() && t - settled_.front().ended_at >= options_.terminal_ttl);
  };
  while (!settled_.empty() && due()) settled_.pop_front();
}

void PushCore::queue_settle(Push& p) {
  if (p.settle_queued) return;
  p.settle_queued = true;
  ended_.push_back(&p);
}

void PushCore::settle_ended() {
  if (ended_.empty()) return;
  ended_scratch_.swap(ended_);
  for (Push* p : ended_scratch_) {
    p->settle_queued = false;
    // Still doing I/O: its last result queues it again.
    if (std::any_of(p->shards.begin(), p->shards.end(), [](const Shard& s) { return s.io; })) continue;
    Settled settled;
    settled.state = p->state;
    settled.destination = destination_fingerprint(p->spec);
    settled.ended_at = p->ended_at;
    for (const Shard& s : p->shards) settled.add_shard(s.state);
    // A transfer id is never in both tables: start() looks in settled_ first.
    settled_.push_back(p->spec.transfer_id, std::move(settled));
    pushes_.erase(pushes_.find(p->spec.transfer_id));
    --closing_;
  }
  ended_scratch_.clear();
  enforce_terminal_limit();
}

Status PushCore::conflict_with_settled(const PushSpec& spec, int shard_count, const Settled& settled) {
  if (settled.destination == destination_fingerprint(spec) &&
      settled.shard_count == static_cast<std::size_t>(shard_count)) {
    return Status::ok();
  }
  ++counters_.conflicts;
  log_->warn(
      "rejected conflicting push: transfer_id={} already ended ({}) pushing elsewhere; refusing mm_hash={} to {}",
      spec.transfer_id, push_state_name(settled.state), spec.mm_hash, spec.consumer_address);
  return conflict(fmt::format("conflicting destination for transfer_id={}", spec.transfer_id));
}

void PushCore::fail(Push& p, std::string reason, Actions& out) {
  if (p.error.empty()) p.error = std::move(reason);
  if (p.state == P::writing) {
    p.failing = true;
    step(p, out);
    return;
  }
  if (is_terminal(p.state)) return;
  abandon_held(p, out);
  finish(p, P::failed, out);
}

// Re-evaluates a push after anything about it changed.
void PushCore::step(Push& p, Actions& out) {
  if (p.state == P::waiting_inputs) {
    if (p.failing) {  // an invalid shard transition
      fail(p, p.error, out);
      return;
    }
    bool resolved = true;
    bool any_write = false;
    bool all_cancelled = true;
    for (const Shard& s : p.shards) {
      if (s.state == Sh::refused) {
        fail(p, p.error.empty() ? "a shard refused the reservation" : p.error, out);
        return;
      }
      if (s.state != Sh::reserved && s.state != Sh::no_write && s.state != Sh::sent) resolved = false;
      if (s.state == Sh::reserved) any_write = true;
      if (!s.consumer_cancelled) all_cancelled = false;
    }
    if (!resolved) return;
    if (!any_write) {
      // Every shard already has the content (or does not want it): nothing to send.
      for (Shard& s : p.shards) s.holds = false;  // READY/follower records belong to the consumer now
      finish(p, all_cancelled ? P::cancelled : P::done, out);
      return;
    }
    if (!p.source) return;
    const TimePoint t = now();
    bool refreshing = false;
    for (std::size_t i = 0; i < p.shards.size(); ++i) {
      Shard& s = p.shards[i];
      if (s.state == Sh::reserved && !s.direct && t - s.reserved_at >= options_.refresh_after) {
        // An old destination may be close to its TTL on the consumer: give it up and
        // reserve again before writing.
        ++counters_.refreshes;
        s.cancel_attempts = 0;
        send_cancel(p, static_cast<int>(i), Sh::refreshing, out);
        refreshing = true;
      }
    }
    if (refreshing) return;
    if (!transition(p, P::writing)) return;
    unindex_waiting(p);
    for (std::size_t i = 0; i < p.shards.size(); ++i) {
      Shard& s = p.shards[i];
      if (s.state == Sh::no_write) {
        s.holds = false;
        continue;
      }
      if (s.state == Sh::sent || !move(p, s, Sh::sending)) continue;  // sent: before a shard's fallback reserve
      s.io = true;
      ++io_in_flight_;
      ++counters_.payloads_sent;
      counters_.direct_sent += s.direct ? 1 : 0;
      out.payloads.push_back(PayloadCommand{p.spec.transfer_id, static_cast<int>(i), p.spec.consumer_address, *p.source,
                                            s.reservation_id, s.generation, s.slot_offset, p.spec.spec.nbytes(),
                                            s.direct, s.direct ? p.spec.mm_hash : std::string(),
                                            s.direct ? std::optional(p.spec.spec) : std::nullopt});
    }
    return;
  }
  if (p.state == P::writing) {
    for (const Shard& s : p.shards) {
      if (s.state == Sh::sending) return;
    }
    if (!p.failing && std::any_of(p.shards.begin(), p.shards.end(), [](const Shard& x) { return x.turned_away; })) {
      reserve_turned_away(p, out);
      return;
    }
    if (p.failing) {
      abandon_held(p, out);  // shards whose payload failed still hold a reservation
      finish(p, P::failed, out);
    } else {
      finish(p, P::done, out);
    }
    return;
  }
  if (p.state == P::cancel_pending) settle_cancel(p, out);
}

// Direct payloads a shard did not take: the push waits again (no payload is in flight
// now) and those shards reserve the usual way; the reply says whether to write, follow
// or wait for space.
void PushCore::reserve_turned_away(Push& p, Actions& out) {
  if (!transition(p, P::waiting_inputs)) return;
  p.deadline = time_nodes_.insert(deadlines_, p.deadline_at, p.spec.transfer_id).first;
  for (std::size_t i = 0; i < p.shards.size(); ++i) {
    Shard& s = p.shards[i];
    if (!s.turned_away) continue;
    s.turned_away = false;
    s.direct = false;
    send_reserve(p, static_cast<int>(i), out);
  }
}

void PushCore::settle_cancel(Push& p, Actions& out) {
  for (const Shard& s : p.shards) {
    if (s.io) return;
  }
  finish(p, P::cancelled, out);
}

Result<Actions> PushCore::start(PushSpec&& spec, int shard_count) {
  ECX_RETURN_IF_ERROR(validate_transfer_id(spec.transfer_id));
  ECX_RETURN_IF_ERROR(validate_mm_hash(spec.mm_hash));
  if (shard_count < 1 || shard_count > options_.max_shards) {
    return invalid_argument(fmt::format("shard_count {} outside 1..{}", shard_count, options_.max_shards));
  }
  const auto lock = lock_settled();
  Actions out;
  if (const Settled* settled = settled_.find(spec.transfer_id)) {
    ECX_RETURN_IF_ERROR(conflict_with_settled(spec, shard_count, *settled));
    ++counters_.duplicates;  // the same encoding again, after its push ended
    return out;
  }
  if (Push* p = find(spec.transfer_id)) {
    if (!same_destination(p->spec, spec) || p->shards.size() != static_cast<std::size_t>(shard_count)) {
      ++counters_.conflicts;
      log_->warn("rejected conflicting push: transfer_id={} already pushes mm_hash={} to {}; refusing mm_hash={} to {}",
                 spec.transfer_id, p->spec.mm_hash, p->spec.consumer_address, spec.mm_hash, spec.consumer_address);
      return conflict(fmt::format("conflicting destination for transfer_id={}", spec.transfer_id));
    }
    // The same encoding requested again shares the push.
    ++counters_.duplicates;
    if (!is_terminal(p->state) && !spec.request_id.empty() && id_nodes_.insert(p->requests, spec.request_id).second) {
      index_id(by_request_, spec.request_id, spec.transfer_id);
    }
    return out;
  }
  std::string transfer_id = spec.transfer_id;  // the map's key; the push keeps the spec
  auto [it, inserted] = pushes_.emplace(std::move(transfer_id), Push(std::move(spec)));
  (void)inserted;
  Push& push = it->second;
  const PushSpec& kept = push.spec;
  if (!kept.request_id.empty()) id_nodes_.insert(push.requests, kept.request_id);
  push.shards.resize(static_cast<std::size_t>(shard_count));
  push.deadline_at = now() + options_.push_deadline;
  push.deadline = time_nodes_.insert(deadlines_, push.deadline_at, kept.transfer_id).first;
  index_id(sourceless_by_hash_, kept.mm_hash, kept.transfer_id);
  if (!kept.request_id.empty()) index_id(by_request_, kept.request_id, kept.transfer_id);
  ++counters_.started;
  // A push to several shards must hold every shard's slot or none: one landed
  // unreserved on one shard while its sibling has no room would pin that room, and
  // shards full of such halves wait on each other (the reserve path gives a slot
  // back instead). Only items far smaller than any pool go direct to several shards.
  const std::uint64_t direct_max =
      shard_count > 1 ? std::min(options_.direct_max_bytes, kDirectMaxBytesAcrossShards) : options_.direct_max_bytes;
  const bool direct = direct_max > 0 && kept.spec.nbytes() <= direct_max;
  for (int i = 0; i < shard_count; ++i) {
    if (!direct) {
      send_reserve(push, i, out);
      continue;
    }
    Shard& s = push.shards[static_cast<std::size_t>(i)];
    s.direct = true;
    move(push, s, Sh::reserved);  // to send once the source is there
  }
  return out;
}

Actions PushCore::on_reserve_reply(std::string_view tid, int shard, const ReserveReply& reply) {
  const auto lock = lock_settled();
  Actions out;
  Push* p = find(tid);
  Shard* s = shard_of(p, shard);
  if (s == nullptr || s->state != Sh::reserving || !s->io) {
    ++counters_.late_replies;
    return out;
  }
  s->io = false;
  --io_in_flight_;
  if (is_terminal(p->state)) queue_settle(*p);
  if (const auto* r = std::get_if<reply::Reserved>(&reply)) {
    s->holds = true;
    s->reservation_id = r->reservation_id;
    s->generation = r->generation;
    s->slot_offset = r->slot_offset;
    s->reserved_at = now();
    move(*p, *s, r->write ? Sh::reserved : Sh::no_write);
  } else if (const auto* ready = std::get_if<reply::Ready>(&reply)) {
    s->holds = true;
    s->reservation_id = ready->reservation_id;
    move(*p, *s, Sh::no_write);
  } else if (std::holds_alternative<reply::Cancelled>(reply)) {
    s->consumer_cancelled = true;
    move(*p, *s, Sh::no_write);
  } else if (const auto* retry = std::get_if<reply::RetryAfter>(&reply)) {
    ++counters_.retry_afters;
    const TimePoint at = now() + retry_delay(retry->delay, s->retry_afters++);
    if (p->state == P::waiting_inputs && p->deadline && at < (*p->deadline)->first) {
      move(*p, *s, Sh::retry_wait);
      s->retry = retries_.emplace(at, retry_key(tid, shard));
      yield_reserved(*p, out);
      return out;
    }
    move(*p, *s, Sh::refused);
    if (p->error.empty()) p->error = "the consumer's pool stayed full until the push deadline";
  } else {
    move(*p, *s, Sh::refused);
    if (p->error.empty()) {
      p->error = fmt::format("shard {} refused the reservation: {}", shard,
                             std::get<reply::Refused>(reply).status.to_string());
    }
  }
  if (p->state == P::waiting_inputs) {
    const bool sibling_waits =
        std::any_of(p->shards.begin(), p->shards.end(), [](const Shard& x) { return x.state == Sh::retry_wait; });
    if (sibling_waits) yield_reserved(*p, out);
    step(*p, out);
    return out;
  }
  // The push ended (failed or cancelled) while this reserve was in flight.
  if (s->holds && s->state != Sh::refused) {
    s->cancel_attempts = 0;
    send_cancel(*p, shard, Sh::abandoning, out);
  } else {
    move(*p, *s, Sh::released);
  }
  if (p->state == P::cancel_pending) settle_cancel(*p, out);
  return out;
}

Actions PushCore::bind_source(std::string_view mm_hash, SourceId source, std::uint64_t nbytes) {
  const auto lock = lock_settled();
  Actions out;
  std::vector<std::string> waiting;
  if (auto it = sourceless_by_hash_.find(mm_hash); it != sourceless_by_hash_.end()) {
    waiting.assign(it->second.begin(), it->second.end());
  }
  bool used = false;
  for (const std::string& tid : waiting) {
    Push* p = find(tid);
    if (p == nullptr || p->state != P::waiting_inputs || p->source) continue;
    if (p->spec.spec.nbytes() != nbytes) {
      fail(*p,
           fmt::format("source for mm_hash={} has {} bytes, the push expects {}", mm_hash, nbytes,
                       p->spec.spec.nbytes()),
           out);
      continue;
    }
    unindex_id(sourceless_by_hash_, p->spec.mm_hash, tid);
    p->source = source;
    ++source_refs_[source];
    used = true;
    step(*p, out);
  }
  if (!used && !source_refs_.contains(source)) out.release_sources.push_back(source);
  return out;
}

Actions PushCore::on_payload_result(std::string_view tid, int shard, const Status& result) {
  const auto lock = lock_settled();
  Actions out;
  Push* p = find(tid);
  Shard* s = shard_of(p, shard);
  if (s == nullptr || s->state != Sh::sending) {
    ++counters_.late_replies;
    return out;
  }
  s->io = false;
  --io_in_flight_;
  if (is_terminal(p->state)) queue_settle(*p);
  if (result.is_ok()) {
    move(*p, *s, Sh::sent);
    s->holds = false;  // the landed slot is the consumer's now
  } else if (s->direct) {
    ++counters_.direct_turned_away;
    move(*p, *s, Sh::reserved);
    s->turned_away = true;
    log_->debug("transfer_id={}: shard {} did not take the direct payload ({}); reserving", tid, shard,
                result.to_string());
  } else {
    ++counters_.payloads_failed;
    move(*p, *s, Sh::reserved);  // the reservation is still ours: abandon it
    if (p->error.empty()) p->error = fmt::format("payload to shard {} failed: {}", shard, result.to_string());
    p->failing = true;
  }
  step(*p, out);
  return out;
}

Actions PushCore::on_cancel_result(std::string_view tid, int shard, const Status& result) {
  const auto lock = lock_settled();
  Actions out;
  Push* p = find(tid);
  Shard* s = shard_of(p, shard);
  if (s == nullptr || !s->io ||
      (s->state != Sh::abandoning && s->state != Sh::refreshing && s->state != Sh::yielding)) {
    ++counters_.late_replies;
    return out;
  }
  s->io = false;
  --io_in_flight_;
  if (is_terminal(p->state)) queue_settle(*p);
  if (s->state == Sh::refreshing) {
    if (p->state == P::waiting_inputs) {
      s->holds = false;
      send_reserve(*p, shard, out);  // the fresh reservation replaces the old one
      return out;
    }
    move(*p, *s, Sh::abandoning);  // the push ended meanwhile: the refresh was the abandon
  }
  if (s->state == Sh::yielding) {
    if (p->state == P::waiting_inputs) {
      s->holds = false;
      if (result.is_ok()) {
        ++counters_.yields;
        rejoin(*p, shard, out);
      } else {
        // Refused (other transfers follow this slot's landing) or unanswered: ask again
        // now. The consumer answers with the reservation it still holds (or a fresh
        // one), and this shard keeps it.
        s->keep_slot = true;
        send_reserve(*p, shard, out);
      }
      return out;
    }
    move(*p, *s, Sh::abandoning);  // the push ended meanwhile: the yield was the abandon
  }
  if (!result.is_ok() && s->cancel_attempts < options_.cancel_attempts) {
    send_cancel(*p, shard, Sh::abandoning, out);
    return out;
  }
  if (!result.is_ok()) {
    ++counters_.abandons_failed;
    log_->warn("could not abandon shard {} of transfer_id={}: {}; the consumer's TTL releases it", shard, tid,
               result.to_string());
  }
  s->holds = false;
  move(*p, *s, Sh::released);
  if (p->state == P::cancel_pending) settle_cancel(*p, out);
  return out;
}

Actions PushCore::cancel_requests(std::span<const std::string> request_ids, bool all) {
  const auto lock = lock_settled();
  Actions out;
  std::vector<std::string> candidates;
  if (all) {
    for (const auto& [tid, p] : pushes_) {
      if (p.state == P::waiting_inputs && !p.source) candidates.push_back(tid);
    }
  } else {
    for (const std::string& r : request_ids) {
      auto it = by_request_.find(r);
      if (it == by_request_.end()) continue;
      for (const std::string& tid : it->second) {
        if (Push* p = find(tid)) {
          id_nodes_.erase_key(p->requests, r);
          if (p->requests.empty()) candidates.push_back(tid);
        }
      }
      index_nodes_.erase(by_request_, it);
    }
  }
  for (const std::string& tid : candidates) {
    Push* p = find(tid);
    if (p == nullptr || p->state != P::waiting_inputs || p->source) continue;
    if (!transition(*p, P::cancel_pending)) continue;
    unindex_waiting(*p);
    abandon_held(*p, out);
    settle_cancel(*p, out);
  }
  return out;
}

Actions PushCore::tick() {
  const auto lock = lock_settled();
  Actions out;
  const TimePoint t = now();
  while (!retries_.empty() && retries_.begin()->first <= t) {
    const std::string key = retries_.begin()->second;
    retries_.erase(retries_.begin());
    const auto sep = key.rfind('\x1f');
    const std::string tid = key.substr(0, sep);
    const int shard = std::stoi(key.substr(sep + 1));
    Push* p = find(tid);
    Shard* s = shard_of(p, shard);
    if (s == nullptr) continue;
    s->retry.reset();
    if (p->state == P::waiting_inputs && s->state == Sh::retry_wait) send_reserve(*p, shard, out);
  }
  while (!deadlines_.empty() && deadlines_.begin()->first <= t) {
    const std::string tid = deadlines_.begin()->second;
    Push* p = find(tid);
    if (p == nullptr) {
      deadlines_.erase(deadlines_.begin());
      continue;
    }
    bool retrying = false;
    for (const Shard& s : p->shards) retrying = retrying || s.state == Sh::retry_wait;
    std::string reason = retrying     ? "the consumer's pool stayed full until the push deadline"
                         : !p->source ? "the encoder output did not arrive before the push deadline"
                                      : "the reservation did not resolve on every shard before the push deadline";
    unindex_waiting(*p);
    fail(*p, std::move(reason), out);
  }
  return out;
}

std::optional<TimePoint> PushCore::next_wakeup() const {
  std::lock_guard lock(mu_);
  std::optional<TimePoint> next;
  if (!retries_.empty()) next = retries_.begin()->first;
  if (!deadlines_.empty() && (!next || deadlines_.begin()->first < *next)) next = deadlines_.begin()->first;
  return next;
}

std::vector<FailedSave> PushCore::drain_failures() {
  std::lock_guard lock(mu_);
  std::vector<FailedSave> out(std::make_move_iterator(failures_.begin()), std::make_move_iterator(failures_.end()));
  failures_.clear();
  return out;
}

std::optional<P> PushCore::state_of(std::string_view tid) const {
  std::lock_guard lock(mu_);
  if (auto it = pushes_.find(tid); it != pushes_.end()) return it->second.state;
  if (const Settled* settled = settled_.find(tid)) return settled->state;
  return std::nullopt;
}

std::optional<Sh> PushCore::shard_state_of(std::string_view tid, int shard) const {
  std::lock_guard lock(mu_);
  if (shard < 0) return std::nullopt;
  const auto index = static_cast<std::size_t>(shard);
  if (auto it = pushes_.find(tid); it != pushes_.end()) {
    return index < it->second.shards.size() ? std::optional(it->second.shards[index].state) : std::nullopt;
  }
  if (const Settled* settled = settled_.find(tid)) {
    return index < settled->shard_count ? std::optional(settled->shard(index)) : std::nullopt;
  }
  return std::nullopt;
}

bool PushCore::pending() const {
  std::lock_guard lock(mu_);
  return io_in_flight_ != 0 || pushes_.size() != closing_;
}

PushCounters PushCore::counters() const {
  std::lock_guard lock(mu_);
  PushCounters c = counters_;
  c.terminal_records = settled_.size() + closing_;
  c.active = pushes_.size() - closing_;
  c.sources_held = source_refs_.size();
  c.io_in_flight = io_in_flight_;
  return c;
}

Status PushCore::check_invariants() const {
  std::lock_guard lock(mu_);
  std::unordered_map<SourceId, std::uint64_t> refs;
  std::uint64_t io = 0;
  std::uint64_t terminal = 0;
  for (const auto& [tid, p] : pushes_) {
    if (p.source) ++refs[*p.source];
    bool sending = false;
    for (const Shard& s : p.shards) {
      io += s.io ? 1 : 0;
      sending = sending || s.state == Sh::sending;
      const bool io_state = s.state == Sh::reserving || s.state == Sh::sending || s.state == Sh::abandoning ||
                            s.state == Sh::refreshing || s.state == Sh::yielding;
      if (io_state != s.io)
        return internal_error(fmt::format("{}: shard {} io flag out of step", tid, shard_state_name(s.state)));
    }
    if (is_terminal(p.state)) {
      ++terminal;
      if (sending) return internal_error(fmt::format("{} is terminal with a payload in flight", tid));
      if (p.source) return internal_error(fmt::format("{} is terminal and still holds its source", tid));
    }
    if (p.state == P::writing && !p.source) return internal_error(fmt::format("{} writes without a source", tid));
    if ((p.state == P::waiting_inputs) != p.deadline.has_value()) {
      return internal_error(fmt::format("{} deadline index out of step", tid));
    }
    const bool sourceless = p.state == P::waiting_inputs && !p.source;
    const auto waiting = sourceless_by_hash_.find(p.spec.mm_hash);
    if (sourceless != (waiting != sourceless_by_hash_.end() && waiting->second.contains(tid))) {
      return internal_error(fmt::format("{} sourceless index out of step", tid));
    }
    for (const std::string& r : p.requests) {
      const auto named = by_request_.find(r);
      if (!is_terminal(p.state) && (named == by_request_.end() || !named->second.contains(tid))) {
        return internal_error(fmt::format("{} missing from request {}'s index", tid, r));
      }
    }
  }
  for (const auto& [hash, tids] : sourceless_by_hash_) {
    if (tids.empty()) return internal_error(fmt::format("an empty sourceless entry for {}", hash));
    for (const std::string& tid : tids) {
      const auto it = pushes_.find(tid);
      if (it == pushes_.end() || it->second.spec.mm_hash != hash) {
        return internal_error(fmt::format("sourceless index names {} under {}", tid, hash));
      }
    }
  }
  for (const auto& [request, tids] : by_request_) {
    if (tids.empty()) return internal_error(fmt::format("an empty request entry for {}", request));
    for (const std::string& tid : tids) {
      const auto it = pushes_.find(tid);
      if (it == pushes_.end() || is_terminal(it->second.state) || !it->second.requests.contains(request)) {
        return internal_error(fmt::format("request {}'s index names {}", request, tid));
      }
    }
  }
  if (refs != source_refs_) return internal_error("source reference counts out of step");
  if (io != io_in_flight_) return internal_error(fmt::format("io count {} but {} in flight", io_in_flight_, io));
  if (terminal != closing_) return internal_error("closing pushes out of step");
  for (const auto& [tid, p] : pushes_) {
    if (settled_.contains(tid)) return internal_error(fmt::format("{} is settled and live", tid));
  }
  return Status::ok();
}

}  // namespace detail

PushManager::PushManager(PushOptions options, std::shared_ptr<const Clock> clock)
    : core_(std::make_unique<detail::PushCore>(options, std::move(clock))) {}
PushManager::~PushManager() = default;

Result<Actions> PushManager::start(PushSpec&& spec, int shard_count) {
  return core_->start(std::move(spec), shard_count);
}
Actions PushManager::on_reserve_reply(std::string_view transfer_id, int shard, const ReserveReply& reply) {
  return core_->on_reserve_reply(transfer_id, shard, reply);
}
Actions PushManager::bind_source(std::string_view mm_hash, SourceId source, std::uint64_t nbytes) {
  return core_->bind_source(mm_hash, source, nbytes);
}
Actions PushManager::on_payload_result(std::string_view transfer_id, int shard, const Status& result) {
  return core_->on_payload_result(transfer_id, shard, result);
}
Actions PushManager::on_cancel_result(std::string_view transfer_id, int shard, const Status& result) {
  return core_->on_cancel_result(transfer_id, shard, result);
}
Actions PushManager::cancel_requests(std::span<const std::string> request_ids) {
  return core_->cancel_requests(request_ids, false);
}
Actions PushManager::cancel_sourceless() { return core_->cancel_requests({}, true); }
Actions PushManager::tick() { return core_->tick(); }
std::optional<TimePoint> PushManager::next_wakeup() const { return core_->next_wakeup(); }
std::vector<FailedSave> PushManager::drain_failures() { return core_->drain_failures(); }
std::optional<PushState> PushManager::state_of(std::string_view transfer_id) const {
  return core_->state_of(transfer_id);
}
std::optional<ShardState> PushManager::shard_state_of(std::string_view transfer_id, int shard) const {
  return core_->shard_state_of(transfer_id, shard);
}
bool PushManager::pending() const { return core_->pending(); }
PushCounters PushManager::counters() const { return core_->counters(); }
Status PushManager::check_invariants() const { return core_->check_invariants(); }

}  // namespace ecx::producer
