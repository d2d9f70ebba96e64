#include "store/mooncake_store_api.h"

#include <cstdlib>

#include <fmt/format.h>

#include "core/shared_library.h"

namespace ecx::store::mooncake {
namespace {

constexpr const char* kDefaultLibrary = "libmooncake_store.so";
constexpr const char* kLibraryEnv = "ECX_MOONCAKE_STORE_LIB";

template <typename Fn>
Status resolve(void* library, const std::string& path, const char* symbol, Fn*& out) {
  if (shared_library::resolve(library, symbol, out)) return Status::ok();
  return not_found(
      fmt::format("the Mooncake Store library '{}' lacks the symbol {} (ECX needs libmooncake_store.so built with "
                  "Mooncake Store's C interface, e.g. -DWITH_STORE_C_SHARED=ON; point {} at it)",
                  path, symbol, kLibraryEnv));
}

Result<std::shared_ptr<const StoreApi>> load_uncached(const std::string& path) {
  auto opened = shared_library::open(path);
  if (!opened) {
    return not_found(
        fmt::format("cannot load the Mooncake Store library '{}': {} (set the environment variable {} to the path of "
                    "libmooncake_store.so)",
                    path, opened.status().message(), kLibraryEnv));
  }
  void* library = *opened;
  // Deliberately never dlclose()d: see StoreApi.
  auto api = std::make_shared<StoreApi>();
  api->path = path;
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_create", api->create));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_destroy", api->destroy));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_setup", api->setup));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_put", api->put));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_put_from", api->put_from));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_get_into", api->get_into));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_batch_is_exist", api->batch_is_exist));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_get_size", api->get_size));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_remove", api->remove));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_register_buffer", api->register_buffer));
  ECX_RETURN_IF_ERROR(resolve(library, path, "mooncake_store_unregister_buffer", api->unregister_buffer));
  return std::shared_ptr<const StoreApi>(std::move(api));
}

}  // namespace

std::string store_library_path(const std::string& configured) {
  if (!configured.empty()) return configured;
  const char* env = std::getenv(kLibraryEnv);  // NOLINT(concurrency-mt-unsafe): read once at open
  if (env != nullptr && *env != '\0') return env;
  return kDefaultLibrary;
}

Result<std::shared_ptr<const StoreApi>> load_store_api(const std::string& path) {
  return shared_library::load_once<StoreApi>(path, load_uncached);
}

std::string describe_error(std::int64_t code) {
  const char* what = nullptr;
  switch (code) {
    case -1:
      what = "internal error";
      break;
    case -10:
      what = "buffer overflow";
      break;
    case -101:
      what = "no segment available";
      break;
    case -600:
      what = "invalid parameters";
      break;
    case -703:
      what = "replica not ready";
      break;
    case kObjectNotFound:
      what = "object not found";
      break;
    case kObjectAlreadyExists:
      what = "object already exists";
      break;
    case -706:
      what = "object has a lease";
      break;
    case -800:
      what = "transfer failed";
      break;
    case -801:
      what = "checksum mismatch";
      break;
    case kRpcFail:
      what = "master RPC failed";
      break;
    case kRpcTimeout:
      what = "master RPC timed out";
      break;
    default:
      break;
  }
  return what != nullptr ? fmt::format("error {} ({})", code, what) : fmt::format("error {}", code);
}

}  // namespace ecx::store::mooncake
