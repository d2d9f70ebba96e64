#include "ecx/core/thread_name.h"

#include <algorithm>
#include <array>

#include <pthread.h>

namespace ecx {

void name_this_thread(std::string_view name) {
  std::array<char, 16> buffer{};  // the kernel's limit, terminator included
  const auto length = std::min(name.size(), buffer.size() - 1);
  std::copy_n(name.data(), length, buffer.data());
  // Best effort: a thread without a name works the same.
  (void)::pthread_setname_np(::pthread_self(), buffer.data());
}

}  // namespace ecx
