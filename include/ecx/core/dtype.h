#pragma once
// Element types of encoder outputs, named as torch names them.

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "ecx/core/status.h"

namespace ecx {

enum class DType : unsigned char {
  float16,
  bfloat16,
  float32,
  float64,
  float8_e4m3fn,
  float8_e4m3fnuz,
  float8_e5m2,
  float8_e5m2fnuz,
  int8,
  int16,
  int32,
  int64,
  uint8,
  bool_,
};

// Canonical name without "torch." (e.g. "bfloat16", "bool").
std::string_view dtype_name(DType dtype) noexcept;
std::size_t dtype_item_size(DType dtype) noexcept;
// All dtypes, in declaration order.
std::span<const DType> all_dtypes() noexcept;
// Accepts canonical names, the "torch." prefix and torch's aliases ("half", "float",
// "double", "long", "int", "short"). Unknown names fail with the accepted list.
Result<DType> parse_dtype(std::string_view name);
// Comma-separated canonical names, for error messages.
std::string accepted_dtype_names();

}  // namespace ecx
