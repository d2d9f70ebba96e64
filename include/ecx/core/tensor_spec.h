#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ecx/core/dtype.h"
#include "ecx/core/status.h"

namespace ecx {

inline constexpr std::size_t kMaxTensorRank = 8;

// Shape, dtype and byte size of one encoder output. Built only through make(), so
// every TensorSpec in the system is valid. The shape lives inline (rank <= 8): a spec
// is copied into several messages and records per transfer, and a heap-held shape made
// each copy an allocation.
class TensorSpec {
 public:
  // rank 1..8, every dim > 0, nbytes = prod(shape) * itemsize without overflow and
  // <= max_nbytes.
  static Result<TensorSpec> make(std::span<const std::int64_t> shape, DType dtype, std::uint64_t max_nbytes);
  static Result<TensorSpec> make(const std::vector<std::int64_t>& shape, DType dtype, std::uint64_t max_nbytes) {
    return make(std::span<const std::int64_t>(shape), dtype, max_nbytes);
  }

  std::span<const std::int64_t> shape() const noexcept { return {dims_.data(), rank_}; }
  std::vector<std::int64_t> shape_vector() const { return {dims_.begin(), dims_.begin() + rank_}; }
  DType dtype() const noexcept { return dtype_; }
  std::uint64_t nbytes() const noexcept { return nbytes_; }
  std::uint64_t num_elements() const noexcept { return nbytes_ / dtype_item_size(dtype_); }
  // "[1300, 3584] bfloat16 (9.3 MB)"
  std::string to_string() const;

  // Unused dims are always 0, so comparing the whole array compares the shapes.
  friend bool operator==(const TensorSpec&, const TensorSpec&) = default;

 private:
  TensorSpec(std::span<const std::int64_t> shape, DType dtype, std::uint64_t nbytes);

  std::array<std::int64_t, kMaxTensorRank> dims_{};
  std::size_t rank_ = 0;
  DType dtype_ = DType::uint8;
  std::uint64_t nbytes_ = 0;
};

}  // namespace ecx
