#pragma once
// The embedding store on a Mooncake Store cluster (a mooncake_master and the memory
// its clients mount), reached through Mooncake Store's C interface in
// libmooncake_store.so, which is loaded at run time: ECX builds without Mooncake.

#include <cstdint>
#include <memory>
#include <string>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/store/embedding_store.h"

namespace ecx::store {

struct MooncakeStoreOptions {
  // The shared library; empty: $ECX_MOONCAKE_STORE_LIB, else libmooncake_store.so
  // through the loader's search path.
  std::string library_path;
  // This client's address as other clients reach it (a port is picked when none is given).
  std::string local_hostname = "127.0.0.1";
  // Mooncake's metadata service: "http://host:port/metadata" (the master's HTTP
  // metadata server), "P2PHANDSHAKE", or another connection string Mooncake accepts.
  std::string metadata_server = "P2PHANDSHAKE";
  std::string master_server = "127.0.0.1:50051";  // host:port of mooncake_master's RPC
  std::string protocol = "tcp";
  std::string device_name;  // RDMA device list; empty for tcp
  // Memory this client mounts into the cluster, and Mooncake's own staging buffer.
  std::uint64_t global_segment_size = std::uint64_t{512} << 20;
  std::uint64_t local_buffer_size = std::uint64_t{64} << 20;
  KeySpace keys;
  // The largest payload stored or read. One buffer of max_entry_bytes + 64 KiB is
  // mapped (lazily backed) and registered with Mooncake once.
  std::uint64_t max_entry_bytes = std::uint64_t{1} << 30;
  // After a failure to reach the master, calls fail fast until this passed.
  double reconnect_interval_s = 1.0;
  std::shared_ptr<const Clock> clock;  // SteadyClock when null
};

// Loads the library (an error names it, or the missing symbol) and validates the
// options; the client is set up with the master on the first call, and again after a
// failure once reconnect_interval_s passed, so a master that is down is not an error
// here. Thread-safe: calls are serialised. Entries have no TTL: Mooncake evicts them.
Result<std::unique_ptr<EmbeddingStore>> open_mooncake_store(MooncakeStoreOptions options);

}  // namespace ecx::store
