#pragma once

namespace ecx {
inline constexpr const char* kVersion = "0.1.0";
// Version of the library actually loaded (may differ from the headers compiled against).
const char* library_version() noexcept;
}  // namespace ecx
