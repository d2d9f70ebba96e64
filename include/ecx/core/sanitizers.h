#pragma once
// Memory ECX keeps on purpose until the process exits (a receive pool a writer may
// still write into, a UCX worker that UCX would not release) is not a leak: tell
// LeakSanitizer, when it is built in, to treat it and all it reaches as live.

#if defined(__SANITIZE_ADDRESS__)
#define ECX_WITH_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(leak_sanitizer)
#define ECX_WITH_LSAN 1
#endif
#endif

#ifdef ECX_WITH_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace ecx {

inline void keep_until_exit([[maybe_unused]] const void* heap_object) noexcept {
#ifdef ECX_WITH_LSAN
  if (heap_object != nullptr) __lsan_ignore_object(heap_object);
#endif
}

}  // namespace ecx
