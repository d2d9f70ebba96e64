#include "ecx/core/tensor_spec.h"

#include <algorithm>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ecx/core/config.h"

namespace ecx {

TensorSpec::TensorSpec(std::span<const std::int64_t> shape, DType dtype, std::uint64_t nbytes)
    : rank_(shape.size()), dtype_(dtype), nbytes_(nbytes) {
  std::copy(shape.begin(), shape.end(), dims_.begin());
}

Result<TensorSpec> TensorSpec::make(std::span<const std::int64_t> shape, DType dtype, std::uint64_t max_nbytes) {
  if (shape.empty() || shape.size() > kMaxTensorRank) {
    return invalid_argument(fmt::format("shape must have rank 1..{}, got rank {}", kMaxTensorRank, shape.size()));
  }
  const std::uint64_t item = dtype_item_size(dtype);
  if (item == 0) return invalid_argument("invalid dtype");
  std::uint64_t nbytes = item;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    const std::int64_t dim = shape[i];
    if (dim <= 0) {
      return invalid_argument(fmt::format("shape[{}] must be > 0, got {}", i, dim));
    }
    const auto udim = static_cast<std::uint64_t>(dim);
    if (nbytes > std::numeric_limits<std::uint64_t>::max() / udim) {
      return invalid_argument(fmt::format("shape {} overflows 64-bit byte size", shape));
    }
    nbytes *= udim;
  }
  if (nbytes > max_nbytes) {
    return invalid_argument(fmt::format("tensor of {} bytes exceeds the maximum of {} bytes", nbytes, max_nbytes));
  }
  return TensorSpec(shape, dtype, nbytes);
}

std::string TensorSpec::to_string() const {
  return fmt::format("{} {} ({})", shape(), dtype_name(dtype_), format_bytes(nbytes_));
}

}  // namespace ecx
