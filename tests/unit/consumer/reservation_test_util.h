#pragma once
// Shared fixture pieces for the reservation manager tests: a slab in host memory, a
// manual clock and helpers that unwrap outcomes.

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "ecx/consumer/reservation_manager.h"
#include "ecx/core/clock.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::consumer::testing {

using namespace std::chrono_literals;

inline TensorSpec bytes_spec(std::int64_t n) { return TensorSpec::make({n}, DType::uint8, 1ULL << 40).value(); }

inline ReserveRequest request(std::string tid, std::string hash, std::int64_t nbytes,
                              std::optional<std::uint64_t> checksum = std::nullopt) {
  return ReserveRequest{std::move(tid), std::move(hash), bytes_spec(nbytes), checksum};
}

template <typename T>
const T& as(const ReserveOutcome& o) {
  EXPECT_TRUE(std::holds_alternative<T>(o)) << describe(o);
  static const T fallback{};
  return std::holds_alternative<T>(o) ? std::get<T>(o) : fallback;
}

template <>
inline const outcome::Refused& as<outcome::Refused>(const ReserveOutcome& o) {
  EXPECT_TRUE(std::holds_alternative<outcome::Refused>(o)) << describe(o);
  static const outcome::Refused fallback{internal_error("not refused")};
  return std::holds_alternative<outcome::Refused>(o) ? std::get<outcome::Refused>(o) : fallback;
}

struct Harness {
  explicit Harness(std::uint64_t slab_size = 64 * 1024, LandingMode mode = LandingMode::receiver_chosen,
                   bool checksum = false, std::uint64_t tombstone_max = 65'536)
      : slab(slab_size), clock(std::make_shared<ManualClock>()) {
    options.slab_base = slab.data();
    options.slab_size = slab_size;
    options.alignment = 256;
    options.mode = mode;
    options.ttl = 300s;
    options.tombstone_max = tombstone_max;
    options.checksum = checksum;
    manager = std::make_unique<ReservationManager>(options, clock);
  }

  // Reserve as a writer and land `fill` bytes successfully.
  outcome::Reserved reserve_writer(const std::string& tid, const std::string& hash, std::int64_t nbytes) {
    return as<outcome::Reserved>(manager->reserve(request(tid, hash, nbytes)));
  }
  void land(const std::string& tid, const outcome::Reserved& r, std::byte fill = std::byte{0x5a}) {
    auto res = manager->resolve_landing(tid, r.reservation_id, r.slot_length);
    ASSERT_TRUE(res.accepted()) << landing_refusal_name(res.refusal);
    std::fill_n(res.target->data, res.target->length, fill);
    ASSERT_EQ(manager->complete_landing(tid, r.reservation_id, true), CompletionOutcome::became_ready);
  }
  std::size_t count_events() { return manager->drain_events().size(); }
  void expect_invariants() {
    const Status st = manager->check_invariants();
    EXPECT_TRUE(st.is_ok()) << st.to_string();
  }

  std::vector<std::byte> slab;
  std::shared_ptr<ManualClock> clock;
  ReservationOptions options;
  std::unique_ptr<ReservationManager> manager;
};

template <typename T>
std::vector<T> events_of(const std::vector<ReservationEvent>& events) {
  std::vector<T> out;
  for (const auto& e : events) {
    if (std::holds_alternative<T>(e)) out.push_back(std::get<T>(e));
  }
  return out;
}

}  // namespace ecx::consumer::testing
