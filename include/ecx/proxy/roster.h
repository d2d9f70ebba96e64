#pragma once
// The proxy's view of its upstream instances: static ones from flags, dynamic ones
// registered through the admin API. Round-robin cursors are per role and never reset
// when the roster changes (a reset would hot-spot the first instance). Liveness is
// fed by the prober: `fail_threshold` consecutive failures evict an instance, any
// success re-admits it, and an instance evicted for longer than `evicted_ttl` is
// forgotten (static ones never are). Time comes from the injected clock. Thread-safe.

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"

namespace ecx::proxy {

enum class InstanceRole : unsigned char { encode, prefill, decode };
std::string_view instance_role_name(InstanceRole role) noexcept;
// "encode", "prefill", "decode"; "prefill_decode" and "pd" are decode (a PD instance).
Result<InstanceRole> parse_instance_role(std::string_view name);

struct InstanceSpec {
  InstanceRole role = InstanceRole::decode;
  std::string url;                        // "http://host:port"
  std::vector<std::string> ec_zmq_addrs;  // EC consumer control addresses, one per DP replica
  int dp_size = 1;
  std::optional<int> dp_rank;  // a per-replica registration pins this rank
  bool is_static = false;      // from flags: never forgotten
};

// Where an EC consumer's transfers go: its control address and the pinned DP rank.
struct ConsumerTarget {
  std::string zmq_addr;        // empty when the instance advertises none
  std::optional<int> dp_rank;  // sent as X-data-parallel-rank when set
};

// Which instances of each role are live and which evicted, each list in URL order.
// The admin API renders it as JSON (src/proxy/roster_json.h).
struct RosterSnapshot {
  struct Urls {
    std::vector<std::string> live;
    std::vector<std::string> evicted;
  };
  std::array<Urls, 3> by_role;  // indexed by InstanceRole
  const Urls& of(InstanceRole role) const { return by_role[static_cast<std::size_t>(role)]; }
  Urls& of(InstanceRole role) { return by_role[static_cast<std::size_t>(role)]; }
};

struct RosterSettings {
  int fail_threshold = 3;
  Duration evicted_ttl = std::chrono::minutes(15);  // 0: never forget
};

class Roster {
 public:
  Roster(std::shared_ptr<const Clock> clock, RosterSettings settings);

  // Registers or refreshes an instance. A refresh of the same role keeps its
  // liveness state; a URL already registered under another role is a conflict.
  Status add(InstanceSpec spec);
  // Returns whether the URL was registered.
  bool remove(std::string_view url);

  // The next live instance of a role (round robin), or nullopt when none is live.
  std::optional<std::string> pick(InstanceRole role);
  // `count` instances in one contiguous rotation, reusing instances when count
  // exceeds the live set; empty when none is live.
  std::vector<std::string> pick_many(InstanceRole role, std::size_t count);
  std::size_t live_count(InstanceRole role) const;

  // Names the consumer replica for one request on instance `url`: its next DP
  // replica (a per-instance cursor), or the registered pinned rank.
  std::optional<ConsumerTarget> consumer_target(std::string_view url);

  // Every URL the prober should check (live and evicted).
  std::vector<std::string> probe_targets() const;
  struct ProbeOutcome {
    bool evicted = false;     // this result evicted the instance
    bool readmitted = false;  // this result brought an evicted instance back
  };
  // Results for URLs no longer registered are ignored.
  ProbeOutcome record_probe(std::string_view url, bool healthy);
  // Forgets instances evicted for longer than evicted_ttl; returns their URLs.
  std::vector<std::string> forget_expired();

  // Every registered URL by role, live or evicted, as of now.
  RosterSnapshot snapshot() const;
  std::size_t evicted_count(InstanceRole role) const;

 private:
  struct Record {
    InstanceSpec spec;
    int consecutive_failures = 0;
    std::optional<TimePoint> evicted_since;
    std::uint64_t replica_cursor = 0;
  };
  std::vector<const Record*> live_of(InstanceRole role) const;

  std::shared_ptr<const Clock> clock_;
  RosterSettings settings_;
  mutable std::mutex mutex_;
  std::map<std::string, Record, std::less<>> records_;  // by URL; ordered so rotations are stable
  std::uint64_t cursors_[3] = {0, 0, 0};
};

}  // namespace ecx::proxy
