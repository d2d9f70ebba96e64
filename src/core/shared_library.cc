#include "core/shared_library.h"

#include <dlfcn.h>

namespace ecx::shared_library {

Result<void*> open(const std::string& path) {
  ::dlerror();  // NOLINT(concurrency-mt-unsafe): glibc keeps dlerror's state per thread
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();  // NOLINT(concurrency-mt-unsafe): per thread in glibc
    return not_found(why != nullptr ? why : "unknown error");
  }
  return library;
}

void* find(void* library, const char* symbol) {
  ::dlerror();  // NOLINT(concurrency-mt-unsafe): per thread in glibc
  return ::dlsym(library, symbol);
}

}  // namespace ecx::shared_library
