#pragma once
// Libraries ECX loads at run time (Mooncake's transfer engine and store): opened once
// per process and path, never closed (their threads' code must stay mapped), symbols
// resolved into typed function pointers. Callers word the errors (which library, which
// key or variable names it).

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "ecx/core/status.h"

namespace ecx::shared_library {

// dlopen(RTLD_NOW | RTLD_LOCAL): the library's own dependencies stay out of the global
// namespace. The error's message is the loader's reason.
Result<void*> open(const std::string& path);
// The address of `symbol` in `library`, or nullptr.
void* find(void* library, const char* symbol);

// Resolves `symbol` into `out`; false when the library lacks it.
template <typename Fn>
bool resolve(void* library, const char* symbol, Fn*& out) {
  void* address = find(library, symbol);
  out = reinterpret_cast<Fn*>(address);  // NOLINT: dlsym returns object pointers for functions
  return address != nullptr;
}

// load(path) once per process and path; later calls return the same table.
template <typename Api, typename Load>
Result<std::shared_ptr<const Api>> load_once(const std::string& path, Load load) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const Api>> loaded;
  std::lock_guard lock(mutex);
  if (auto it = loaded.find(path); it != loaded.end()) return it->second;
  Result<std::shared_ptr<const Api>> api = load(path);
  if (!api) return api.status();
  loaded.emplace(path, *api);
  return *api;
}

}  // namespace ecx::shared_library
