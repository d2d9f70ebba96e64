#pragma once
// The producer's push state: one record per pushed transfer, from "reserve on every
// shard of the consumer" to "payload delivered" (or failed / cancelled). Pure logic:
// it performs no I/O. Every call returns the Actions the caller must perform (send
// reserves, send payloads, send abandon cancels, release sources) and later reports
// their results back. Thread-safe; time from an injected Clock.
//
// Rules it enforces:
//   - the reservation on all shards and the source tensor may arrive in either
//     order; the payload goes out when both are there (no waiting for a model step);
//   - a partial reserve failure abandons the shards that did reserve;
//   - retry_after is retried until the push deadline (back-pressure, not failure),
//     after the consumer's delay the first time, then with exponential backoff and
//     jitter up to retry_backoff_max;
//   - a source is released only when no payload send may still read it;
//   - failures are reported through drain_failures(), never thrown;
//   - pushes that never got a source are cancelled when their requests finish;
//   - an item of at most direct_max_bytes (kDirectMaxBytesAcrossShards when the push
//     goes to several shards) skips the reserve: its payload goes to each shard as soon
//     as the source is there, and a shard that turns it away (or that cannot be
//     reached) is reserved the usual way, once.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/ids.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::producer {

// Identifies one encoder output the caller holds (e.g. a staging region or a
// registered tensor); chosen by the caller, opaque here.
using SourceId = std::uint64_t;

struct PushSpec {
  std::string transfer_id;
  std::string mm_hash;
  std::string consumer_address;  // base control address of the consumer's first shard
  TensorSpec spec;
  std::string request_id;
};

enum class PushState : unsigned char { waiting_inputs, writing, done, cancel_pending, cancelled, failed };
inline constexpr std::size_t kPushStateCount = 6;
std::string_view push_state_name(PushState state) noexcept;
bool is_terminal(PushState state) noexcept;
bool push_transition_allowed(PushState from, PushState to) noexcept;

enum class ShardState : unsigned char {
  reserving,   // reserve sent, no reply yet
  retry_wait,  // the consumer's pool was full; reserve again later
  reserved,    // this producer must send the payload to this shard (a direct shard: unreserved)
  no_write,    // follower, already landed/cached, or cancelled by the consumer
  refreshing,  // re-reserving a destination that got old (abandon+refresh sent)
  yielding,    // giving its reservation back while a sibling shard waits for space (refresh sent)
  sending,     // payload in flight
  sent,        // payload delivered
  refused,     // the reserve failed
  abandoning,  // abandon cancel in flight
  released,    // nothing held on the consumer for this push
};
inline constexpr std::size_t kShardStateCount = 11;
std::string_view shard_state_name(ShardState state) noexcept;
bool shard_transition_allowed(ShardState from, ShardState to) noexcept;

// The consumer's answer to a reserve, as the control client reports it.
namespace reply {
struct Reserved {
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::uint64_t slot_offset = 0;
  bool write = true;
};
struct Ready {
  ReservationId reservation_id;
};
struct Cancelled {};
struct RetryAfter {
  Duration delay{};
};
struct Refused {
  Status status;  // includes transport failures (timeouts, unreachable shard)
};
}  // namespace reply
using ReserveReply = std::variant<reply::Reserved, reply::Ready, reply::Cancelled, reply::RetryAfter, reply::Refused>;

// --- actions for the caller
struct ReserveCommand {
  std::string transfer_id;
  int shard = 0;
  std::string consumer_address;
  std::string mm_hash;
  TensorSpec spec;
};
struct PayloadCommand {
  std::string transfer_id;
  int shard = 0;
  std::string consumer_address;
  SourceId source = 0;
  ReservationId reservation_id;
  std::uint64_t generation = 0;
  std::uint64_t slot_offset = 0;
  std::uint64_t nbytes = 0;
  // No reservation: the shard reserves on arrival (the header carries mm_hash and
  // spec) or turns the payload away, which on_payload_result() must then hear.
  bool direct = false;
  std::string mm_hash;
  std::optional<TensorSpec> spec;
};
struct CancelCommand {
  std::string transfer_id;
  int shard = 0;
  std::string consumer_address;
  ReservationId reservation_id;  // none: whatever the shard holds for the transfer
  bool refresh = false;          // always an abandon (the producer gives up the destination)
};
struct Actions {
  std::vector<ReserveCommand> reserves;
  std::vector<PayloadCommand> payloads;
  std::vector<CancelCommand> cancels;
  std::vector<SourceId> release_sources;

  bool empty() const noexcept {
    return reserves.empty() && payloads.empty() && cancels.empty() && release_sources.empty();
  }
  void append(Actions&& other);
};

struct FailedSave {
  std::string transfer_id;
  std::string mm_hash;
  std::vector<std::string> request_ids;
  std::string reason;
};

// The largest item a push to several shards sends without reserving first: small
// against any pool, so halves landed on one shard while a sibling is full cannot fill it.
inline constexpr std::uint64_t kDirectMaxBytesAcrossShards = 128ULL * 1024;

struct PushOptions {
  Duration push_deadline = std::chrono::seconds(60);   // reserve retries and inputs must finish by then
  Duration refresh_after = std::chrono::seconds(150);  // re-reserve destinations older than this before sending
  std::uint64_t terminal_limit = 65'536;               // terminal records kept for idempotency,
  Duration terminal_ttl = std::chrono::seconds(300);   // each for at most this long (0 = until the limit)
  std::uint64_t failure_queue_max = 65'536;
  int cancel_attempts = 2;
  int max_shards = 64;
  Duration retry_backoff_max = std::chrono::milliseconds(200);  // longest wait between two reserves of a shard
  std::uint64_t direct_max_bytes = 0;  // items up to this size go without a reserve first (0 = never)
  // ... to one shard; a push to several shards (TP) goes direct only up to the
  // smaller of direct_max_bytes and kDirectMaxBytesAcrossShards.
  // push_wait_timeout_s as the deadline, reservation_ttl_s / 2 as refresh_after,
  // reservation_ttl_s as terminal_ttl (the consumer keeps its tombstones as long),
  // retry_backoff_max_ms as retry_backoff_max, direct_payload_max_bytes as
  // direct_max_bytes where the data plane can confirm sends (ucx in am mode).
  static PushOptions from_config(const Config& config);
};

struct PushCounters {
  std::uint64_t started = 0;
  std::uint64_t duplicates = 0;
  std::uint64_t conflicts = 0;
  std::uint64_t done = 0;
  std::uint64_t failed = 0;
  std::uint64_t cancelled = 0;
  std::uint64_t retry_afters = 0;
  std::uint64_t refreshes = 0;
  // Reservations given back because a sibling shard of the same push was told to retry:
  // a push holds every shard's space or none, so a full rank does not strand the others'.
  std::uint64_t yields = 0;
  std::uint64_t payloads_sent = 0;
  std::uint64_t payloads_failed = 0;
  std::uint64_t direct_sent = 0;         // of payloads_sent: direct (no reservation first)
  std::uint64_t direct_turned_away = 0;  // direct payloads a shard did not take: reserved the usual way
  std::uint64_t abandons_sent = 0;
  std::uint64_t abandons_failed = 0;
  std::uint64_t late_replies = 0;
  std::uint64_t invalid_transitions = 0;
  std::uint64_t failures_dropped = 0;
  // gauges
  std::uint64_t active = 0;
  std::uint64_t terminal_records = 0;
  std::uint64_t sources_held = 0;
  std::uint64_t io_in_flight = 0;  // reserves + payloads + cancels awaiting a result
};

namespace detail {
class PushCore;
}

class PushManager {
 public:
  PushManager(PushOptions options, std::shared_ptr<const Clock> clock);
  ~PushManager();
  PushManager(const PushManager&) = delete;
  PushManager& operator=(const PushManager&) = delete;

  // A new push to `shard_count` consumer shards: reserves go to every shard at once.
  // The same transfer with the same destination (another request sharing the
  // encoding) adds its request and returns no actions; a different destination is a
  // conflict that fails only the newcomer. The rvalue form moves `spec` into a push
  // it starts and leaves it whole otherwise (an error, or a push already there).
  Result<Actions> start(PushSpec&& spec, int shard_count);
  Result<Actions> start(const PushSpec& spec, int shard_count) { return start(PushSpec(spec), shard_count); }
  Actions on_reserve_reply(std::string_view transfer_id, int shard, const ReserveReply& reply);
  // The encoder output for mm_hash exists; every waiting push of that content takes
  // it (a size mismatch fails the push). Unused sources come straight back.
  Actions bind_source(std::string_view mm_hash, SourceId source, std::uint64_t nbytes);
  Actions on_payload_result(std::string_view transfer_id, int shard, const Status& result);
  Actions on_cancel_result(std::string_view transfer_id, int shard, const Status& result);
  // The requests finished: their pushes that never got a source are cancelled (a
  // push whose source is bound proceeds: the consumer may still want it).
  Actions cancel_requests(std::span<const std::string> request_ids);
  // Shutdown: cancel every push without a source.
  Actions cancel_sourceless();
  // Due reserve retries and push deadlines.
  Actions tick();
  // When tick() next has something to do (the dispatcher sleeps until then).
  std::optional<TimePoint> next_wakeup() const;

  std::vector<FailedSave> drain_failures();
  std::optional<PushState> state_of(std::string_view transfer_id) const;
  std::optional<ShardState> shard_state_of(std::string_view transfer_id, int shard) const;
  // Any push not terminal, or any I/O still outstanding.
  bool pending() const;
  PushCounters counters() const;
  Status check_invariants() const;

 private:
  std::unique_ptr<detail::PushCore> core_;
};

}  // namespace ecx::producer
