#include "transport/mooncake/mooncake_api.h"

#include <fmt/format.h>

#include "core/shared_library.h"

namespace ecx::transport::mooncake {
namespace {

template <typename Fn>
Status resolve(void* library, const std::string& path, const char* symbol, Fn*& out) {
  if (shared_library::resolve(library, symbol, out)) return Status::ok();
  return not_found(fmt::format(
      "the Mooncake library '{}' lacks the symbol {} (ECX needs libtransfer_engine.so of Mooncake's transfer "
      "engine, built with its C interface; point mooncake_lib or ECX_MOONCAKE_LIB at it)",
      path, symbol));
}

Result<std::shared_ptr<const Api>> load_uncached(const std::string& path) {
  // Mooncake's own dependencies (glog, gflags, asio) stay out of the global namespace.
  auto opened = shared_library::open(path);
  if (!opened) {
    return not_found(
        fmt::format("cannot load the Mooncake transfer engine library '{}': {} (set the config key mooncake_lib or the "
                    "environment variable ECX_MOONCAKE_LIB to the path of libtransfer_engine.so)",
                    path, opened.status().message()));
  }
  void* library = *opened;
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
  return shared_library::load_once<Api>(path, load_uncached);
}

}  // namespace ecx::transport::mooncake
