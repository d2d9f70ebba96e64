#pragma once
// Relaxed atomic counters; a reader takes a snapshot, never a consistent cut.

#include <atomic>
#include <cstdint>

namespace ecx::control::detail {

struct Counter {
  std::atomic<std::uint64_t> value{0};
  void add(std::uint64_t n = 1) noexcept { value.fetch_add(n, std::memory_order_relaxed); }
  // Takes back a count made ahead of an action that then did not happen.
  void take_back(std::uint64_t n = 1) noexcept { value.fetch_sub(n, std::memory_order_relaxed); }
  std::uint64_t get() const noexcept { return value.load(std::memory_order_relaxed); }
};

}  // namespace ecx::control::detail
