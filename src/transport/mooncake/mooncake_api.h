#pragma once
// Our own declarations of the part of Mooncake's transfer engine C interface that
// ECX calls (transfer_engine_c.h of libtransfer_engine.so), resolved at run time.
// Only plain C types cross this boundary; layouts follow the library's C ABI.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ecx/core/status.h"

namespace ecx::transport::mooncake {

using EngineHandle = void*;
using TransportHandle = void*;
using SegmentId = std::int32_t;
using BatchId = std::uint64_t;

inline constexpr BatchId kInvalidBatch = UINT64_MAX;
inline constexpr int kOpcodeWrite = 1;

// transfer_status.status values
inline constexpr int kStatusWaiting = 0;
inline constexpr int kStatusPending = 1;
inline constexpr int kStatusInvalid = 2;
inline constexpr int kStatusCanceled = 3;
inline constexpr int kStatusCompleted = 4;
inline constexpr int kStatusTimeout = 5;
inline constexpr int kStatusFailed = 6;

struct TransferRequest {
  int opcode;
  void* source;
  SegmentId target_id;
  std::uint64_t target_offset;  // the remote address
  std::uint64_t length;
};

struct TransferStatus {
  int status;
  std::uint64_t transferred_bytes;
};

// The functions, resolved from one loaded library. Never unloaded: Mooncake starts
// threads whose code must stay mapped for the life of the process.
struct Api {
  std::string path;
  EngineHandle (*create_engine)(const char* metadata, const char* local_server_name, const char* host,
                                std::uint64_t rpc_port, int auto_discover) = nullptr;
  void (*destroy_engine)(EngineHandle) = nullptr;
  int (*discover_topology)(EngineHandle) = nullptr;
  int (*local_ip_and_port)(EngineHandle, char* out, std::size_t out_len) = nullptr;
  TransportHandle (*install_transport)(EngineHandle, const char* proto, void** args) = nullptr;
  int (*register_memory)(EngineHandle, void* addr, std::size_t length, const char* location,
                         int remote_accessible) = nullptr;
  int (*unregister_memory)(EngineHandle, void* addr) = nullptr;
  SegmentId (*open_segment)(EngineHandle, const char* name) = nullptr;
  int (*close_segment)(EngineHandle, SegmentId) = nullptr;
  BatchId (*allocate_batch)(EngineHandle, std::size_t batch_size) = nullptr;
  int (*submit_transfer)(EngineHandle, BatchId, TransferRequest* entries, std::size_t count) = nullptr;
  int (*transfer_status)(EngineHandle, BatchId, std::size_t task_id, TransferStatus* status) = nullptr;
  int (*free_batch)(EngineHandle, BatchId) = nullptr;
};

// The library at `path`, loaded and resolved once per process; an error names the
// path or the missing symbol.
Result<std::shared_ptr<const Api>> load_api(const std::string& path);

}  // namespace ecx::transport::mooncake
