// libecx.so is assembled from the component libraries; this unit carries its version.
#include "ecx/core/version.h"

namespace ecx {
const char* library_version() noexcept { return kVersion; }
}  // namespace ecx
