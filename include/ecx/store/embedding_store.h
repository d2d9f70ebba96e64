#pragma once
// A shared store of encoder outputs, so that one encoder can reuse what another one
// computed (the cross-encoder cache). Entries are keyed by a prefix, the model's
// identity and the engine's mm_hash; every value carries its shape, dtype, byte size
// and checksum, and every get verifies them before the caller sees a byte.
//
// The store is best effort by design: a miss, a store that is down or slow, or an
// entry that fails its checks all mean "encode it again", never a failed request.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::store {

// The identity entries are filed under. Two deployments share entries only when
// both fields agree: an entry written under another model is never read.
struct KeySpace {
  std::string prefix = "ecx";  // e.g. one per cluster or tenant
  std::string model;           // e.g. "Qwen/Qwen2.5-VL-7B-Instruct@<revision>"

  // "<prefix>:<model>:<mm_hash>". Fails (naming the field) on an empty model or
  // mm_hash, or on characters that could make two identities collide.
  Result<std::string> key(std::string_view mm_hash) const;
  Status validate() const;
};

// What a get found, once its checks passed.
struct Entry {
  TensorSpec spec;
  std::uint64_t checksum = 0;  // xxHash64 of the payload, seed 0
};

struct StoreCounters {
  std::uint64_t lookups = 0;          // items asked about by contains()
  std::uint64_t hits = 0;             // of those, present
  std::uint64_t misses = 0;           // of those, absent
  std::uint64_t gets = 0;             // get_into() calls
  std::uint64_t bytes_loaded = 0;     // payload bytes verified into callers' buffers
  std::uint64_t puts = 0;             // entries written
  std::uint64_t bytes_published = 0;  // payload bytes written
  std::uint64_t rejected = 0;         // entries that failed their checks (corrupt, truncated, other model)
  std::uint64_t errors = 0;           // calls that failed on the store itself (down, slow, refused)
};

class EmbeddingStore {
 public:
  virtual ~EmbeddingStore() = default;

  // For each mm_hash, whether an entry is present now (it may expire before a get).
  // One round trip for the whole batch.
  virtual Result<std::vector<bool>> contains(std::span<const std::string> mm_hashes) = 0;

  // Where an entry lands: called once the entry's header and checksum are verified,
  // with its spec; returns a buffer of exactly spec.nbytes() (or an error to refuse it).
  using Landing = std::function<Result<std::span<std::byte>>(const TensorSpec&)>;

  // Reads the entry into the buffer `land` gives. not_found when absent; protocol when
  // the entry is corrupt, truncated or another model's (it is then deleted, so the next
  // encoder writes a good one; `land` is not called); unavailable or timeout when the
  // store cannot be reached in time.
  virtual Result<Entry> get_into(std::string_view mm_hash, const Landing& land) = 0;

  // Writes (or overwrites) one entry; it expires after the store's TTL.
  virtual Status put(std::string_view mm_hash, const TensorSpec& spec, std::span<const std::byte> payload) = 0;

  virtual StoreCounters counters() const = 0;
  // "redis tcp://127.0.0.1:6379", for logs.
  virtual std::string describe() const = 0;
};

// Where a Redis store lives and how long it waits for it.
struct RedisOptions {
  std::string host = "127.0.0.1";
  int port = 6379;
  std::string password;  // AUTH when non-empty
  int database = 0;      // SELECT when non-zero
  KeySpace keys;
  double ttl_s = 3600;  // EX of every entry: the store forgets by itself
  double connect_timeout_s = 0.2;
  double io_timeout_s = 0.5;          // a slow store costs a request this long at most
  double reconnect_interval_s = 1.0;  // after a failure, calls fail fast until then
  std::uint64_t max_entry_bytes = std::uint64_t{1} << 30;
  std::shared_ptr<const Clock> clock;  // SteadyClock when null
};

// Redis (or a Redis Cluster node through a proxy). Thread-safe: calls are serialised
// on one connection, re-established after a failure once reconnect_interval_s passed.
// Fails only on invalid options; an unreachable server is not an error here.
Result<std::unique_ptr<EmbeddingStore>> open_redis_store(RedisOptions options);

}  // namespace ecx::store
