#pragma once
// Our own declarations of the part of Mooncake Store's C interface (store_c.h of
// libmooncake_store.so) that ECX calls, resolved at run time. Only plain C types
// cross this boundary.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ecx/core/status.h"

namespace ecx::store::mooncake {

using ClientHandle = void*;

// Error codes of Mooncake Store that ECX tells apart (all others are failures).
inline constexpr int kObjectNotFound = -704;
inline constexpr int kObjectAlreadyExists = -705;
inline constexpr int kRpcFail = -900;
inline constexpr int kRpcTimeout = -901;

// The functions, resolved from one loaded library. Never unloaded: a Mooncake client
// starts threads whose code must stay mapped for the life of the process.
struct StoreApi {
  std::string path;
  ClientHandle (*create)() = nullptr;
  void (*destroy)(ClientHandle) = nullptr;
  int (*setup)(ClientHandle, const char* local_hostname, const char* metadata_server, std::uint64_t global_segment_size,
               std::uint64_t local_buffer_size, const char* protocol, const char* device_name,
               const char* master_server_addr) = nullptr;
  // The replicate config argument is always null (Mooncake's defaults).
  int (*put)(ClientHandle, const char* key, const void* value, std::size_t size, const void* config) = nullptr;
  int (*put_from)(ClientHandle, const char* key, void* buffer, std::size_t size, const void* config) = nullptr;
  std::int64_t (*get_into)(ClientHandle, const char* key, void* buffer, std::size_t size) = nullptr;
  int (*batch_is_exist)(ClientHandle, const char** keys, std::size_t count, int* results) = nullptr;
  std::int64_t (*get_size)(ClientHandle, const char* key) = nullptr;
  int (*remove)(ClientHandle, const char* key, int force) = nullptr;
  int (*register_buffer)(ClientHandle, void* buffer, std::size_t size) = nullptr;
  int (*unregister_buffer)(ClientHandle, void* buffer) = nullptr;
};

// The library at `path` (a bare file name goes through the loader's search path),
// loaded and resolved once per process; an error names the path or the missing symbol.
Result<std::shared_ptr<const StoreApi>> load_store_api(const std::string& path);

// The library open_mooncake_store loads for `configured`: itself when non-empty, else
// $ECX_MOONCAKE_STORE_LIB, else "libmooncake_store.so".
std::string store_library_path(const std::string& configured);

// "error -704 (object not found)" for logs and messages.
std::string describe_error(std::int64_t code);

}  // namespace ecx::store::mooncake
