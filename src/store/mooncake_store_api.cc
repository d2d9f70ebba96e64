#include "store/mooncake_store_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include <fmt/format.h>

namespace ecx::store::mooncake {
namespace {

constexpr const char* kDefaultLibrary = "libmooncake_store.so";
constexpr const char* kLibraryEnv = "ECX_MOONCAKE_STORE_LIB";

template <typename Fn>
Status resolve(void* library, const std::string& path, const char* symbol, Fn*& out) {
  ::dlerror();  // NOLINT(concurrency-mt-unsafe): glibc keeps dlerror's state per thread
  void* address = ::dlsym(library, symbol);
  if (address == nullptr) {
    return not_found(
        fmt::format("the Mooncake Store library '{}' lacks the symbol {} (ECX needs libmooncake_store.so built with "
                    "Mooncake Store's C interface, e.g. -DWITH_STORE_C_SHARED=ON; point {} at it)",
                    path, symbol, kLibraryEnv));
  }
  out = reinterpret_cast<Fn*>(address);  // NOLINT: dlsym returns object pointers for functions
  return Status::ok();
}

Result<std::shared_ptr<const StoreApi>> load_uncached(const std::string& path) {
  ::dlerror();  // NOLINT(concurrency-mt-unsafe): glibc keeps dlerror's state per thread
  // RTLD_LOCAL: Mooncake's own dependencies stay out of the global namespace.
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();  // NOLINT(concurrency-mt-unsafe): per thread in glibc
    return not_found(
        fmt::format("cannot load the Mooncake Store library '{}': {} (set the environment variable {} to the path of "
                    "libmooncake_store.so)",
                    path, why != nullptr ? why : "unknown error", kLibraryEnv));
  }
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
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const StoreApi>> loaded;
  std::lock_guard lock(mutex);
  if (auto it = loaded.find(path); it != loaded.end()) return it->second;
  auto api = load_uncached(path);
  if (!api) return api.status();
  loaded.emplace(path, *api);
  return *api;
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
