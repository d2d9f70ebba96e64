#include "transport/mooncake/mooncake_api.h"

#include <dlfcn.h>

#include <map>
#include <mutex>

#include <fmt/format.h>

namespace ecx::transport::mooncake {
namespace {

template <typename Fn>
Status resolve(void* library, const std::string& path, const char* symbol, Fn*& out) {
  ::dlerror();  // NOLINT(concurrency-mt-unsafe): glibc keeps dlerror's state per thread
  void* address = ::dlsym(library, symbol);
  if (address == nullptr) {
    return not_found(fmt::format(
        "the Mooncake library '{}' lacks the symbol {} (ECX needs libtransfer_engine.so of Mooncake's transfer "
        "engine, built with its C interface; point mooncake_lib or ECX_MOONCAKE_LIB at it)",
        path, symbol));
  }
  out = reinterpret_cast<Fn*>(address);  // NOLINT: dlsym returns object pointers for functions
  return Status::ok();
}

Result<std::shared_ptr<const Api>> load_uncached(const std::string& path) {
  ::dlerror();  // NOLINT(concurrency-mt-unsafe): glibc keeps dlerror's state per thread
  // RTLD_LOCAL: Mooncake's own dependencies (glog, gflags, asio) stay out of the
  // global namespace.
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();  // NOLINT(concurrency-mt-unsafe): per thread in glibc
    return not_found(
        fmt::format("cannot load the Mooncake transfer engine library '{}': {} (set the config key mooncake_lib or the "
                    "environment variable ECX_MOONCAKE_LIB to the path of libtransfer_engine.so)",
                    path, why != nullptr ? why : "unknown error"));
  }
  // Deliberately never dlclose()d: see Api.
  auto api = std::make_shared<Api>();
  api->path = path;
  ECX_RETURN_IF_ERROR(resolve(library, path, "createTransferEngine", api->create_engine));
  ECX_RETURN_IF_ERROR(resolve(library, path, "destroyTransferEngine", api->destroy_engine));
  ECX_RETURN_IF_ERROR(resolve(library, path, "discoverTopology", api->discover_topology));
  ECX_RETURN_IF_ERROR(resolve(library, path, "getLocalIpAndPort", api->local_ip_and_port));
  ECX_RETURN_IF_ERROR(resolve(library, path, "installTransport", api->install_transport));
  ECX_RETURN_IF_ERROR(resolve(library, path, "registerLocalMemory", api->register_memory));
  ECX_RETURN_IF_ERROR(resolve(library, path, "unregisterLocalMemory", api->unregister_memory));
  ECX_RETURN_IF_ERROR(resolve(library, path, "openSegment", api->open_segment));
  ECX_RETURN_IF_ERROR(resolve(library, path, "closeSegment", api->close_segment));
  ECX_RETURN_IF_ERROR(resolve(library, path, "allocateBatchID", api->allocate_batch));
  ECX_RETURN_IF_ERROR(resolve(library, path, "submitTransfer", api->submit_transfer));
  ECX_RETURN_IF_ERROR(resolve(library, path, "getTransferStatus", api->transfer_status));
  ECX_RETURN_IF_ERROR(resolve(library, path, "freeBatchID", api->free_batch));
  return std::shared_ptr<const Api>(std::move(api));
}

}  // namespace

Result<std::shared_ptr<const Api>> load_api(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const Api>> loaded;
  std::lock_guard lock(mutex);
  if (auto it = loaded.find(path); it != loaded.end()) return it->second;
  auto api = load_uncached(path);
  if (!api) return api.status();
  loaded.emplace(path, *api);
  return *api;
}

}  // namespace ecx::transport::mooncake
