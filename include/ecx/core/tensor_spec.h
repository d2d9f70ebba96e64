#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ecx/core/dtype.h"
#include "ecx/core/status.h"

namespace ecx {

inline constexpr std::size_t kMaxTensorRank = 8;

// Shape, dtype and byte size of one encoder output. Built only through make(), so
// every TensorSpec in the system is valid.
class TensorSpec {
 public:
  // rank 1..8, every dim > 0, nbytes = prod(shape) * itemsize without overflow and
  // <= max_nbytes.
  static Result<TensorSpec> make(std::vector<std::int64_t> shape, DType dtype, std::uint64_t max_nbytes);

  const std::vector<std::int64_t>& shape() const noexcept { return shape_; }
  DType dtype() const noexcept { return dtype_; }
  std::uint64_t nbytes() const noexcept { return nbytes_; }
  std::uint64_t num_elements() const noexcept { return nbytes_ / dtype_item_size(dtype_); }
  // "[1300, 3584] bfloat16 (9.3 MB)"
  std::string to_string() const;

  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;

 private:
  TensorSpec(std::vector<std::int64_t> shape, DType dtype, std::uint64_t nbytes)
      : shape_(std::move(shape)), dtype_(dtype), nbytes_(nbytes) {}

  std::vector<std::int64_t> shape_;
  DType dtype_ = DType::uint8;
  std::uint64_t nbytes_ = 0;
};

}  // namespace ecx
