// State-machine fuzzer for the consumer scheduler's TransferTable: the input is a
// sequence of operations (on a few transfer ids, hashes and requests, with time
// moving forward) applied in any order, as a confused or hostile peer and engine
// might. After every operation the table's own invariant walk must pass, every
// record must be in a valid state, counts must add up and the bounds hold.

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/logging.h"
#include "ecx/connector/scheduler/transfer_table.h"

namespace {

using namespace ecx;
using namespace ecx::scheduler;

void check(bool condition) {
  if (!condition) std::abort();
}

constexpr int kIds = 8, kHashes = 4, kRequests = 4;

std::string id_name(int i) { return "t" + std::to_string(i); }
std::string hash_name(int i) { return "h" + std::to_string(i); }
std::string request_name(int i) { return "r" + std::to_string(i); }

LoadSpec load_spec(int id, int hash, std::uint64_t bytes) {
  return LoadSpec{hash_name(hash), id_name(id),
                  TensorSpec::make({static_cast<std::int64_t>(bytes)}, DType::uint8, ~0ULL).value(), false};
}

void check_table(const TransferTable& table) {
  const Status s = table.check_invariants();
  if (!s) std::abort();
  check(table.live_count() + table.tombstone_count() == table.size());
  check(table.tombstone_count() <= table.limits().tombstone_max);
  std::size_t tombstones = 0, resident = 0;
  table.for_each_record([&](const TransferRecord& r) {
    check(static_cast<std::size_t>(r.state()) < kTransferStateCount);
    if (is_terminal(r.state())) ++tombstones;
    if (r.state() == TransferState::resident) ++resident;
    if (r.state() != TransferState::waiting_event) check(r.waiters().empty());
    check(table.find(r.transfer_id()) == &r);
  });
  check(tombstones == table.tombstone_count());
  check(resident == table.resident_count());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  log::set_level(spdlog::level::off);  // invalid transitions are logged; keep the fuzzer quiet
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  TableLimits limits;
  limits.reservation_ttl = std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(1, 1000));
  limits.tombstone_max = in.ConsumeIntegralInRange<std::uint64_t>(1, 16);
  limits.resident_capacity_bytes = in.ConsumeIntegralInRange<std::uint64_t>(0, 4096);
  TransferTable table(limits);
  TimePoint now = TimePoint{} + std::chrono::hours(1);
  std::vector<std::string> cancels;

  for (int step = 0; step < 256 && in.remaining_bytes() > 0; ++step) {
    const int id = in.ConsumeIntegralInRange<int>(0, kIds - 1);
    const int hash = in.ConsumeIntegralInRange<int>(0, kHashes - 1);
    const int request = in.ConsumeIntegralInRange<int>(0, kRequests - 1);
    switch (in.ConsumeIntegralInRange<int>(0, 17)) {
      case 0:
        (void)table.wait_for_event(id_name(id), request_name(request), hash_name(hash), now,
                                   now + std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 1000)),
                                   in.ConsumeBool());
        break;
      case 1:
        (void)table.observe_ready(load_spec(id, hash, in.ConsumeIntegralInRange<std::uint64_t>(1, 2048)), now);
        break;
      case 2:
        (void)table.observe_abandoned(id_name(id), hash_name(hash), now);
        break;
      case 3:
        table.touch_available(id_name(id), now);
        break;
      case 4: {
        const std::string preferred = id_name(id);
        const auto* record = table.begin_load(
            hash_name(hash), in.ConsumeBool() ? std::optional<std::string_view>(preferred) : std::nullopt,
            request_name(request), now, now + std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 500)));
        if (record != nullptr) {
          check(record->state() == TransferState::loading);
          check(record->mm_hash() == hash_name(hash));
        }
        break;
      }
      case 5:
        for (const auto& spec : table.take_loads_to_dispatch()) check(!spec.mm_hash.empty());
        break;
      case 6:
        (void)table.complete_load(hash_name(hash));
        break;
      case 7:
        (void)table.fail_load(hash_name(hash), now);
        break;
      case 8:
        table.release_ready(hash_name(hash), now);
        check(table.resident_bytes() <= limits.resident_capacity_bytes);
        break;
      case 9:
        table.reclaim(hash_name(hash), now);
        break;
      case 10:
        (void)table.mark_unavailable(id_name(id), now);
        break;
      case 11:
        (void)table.cancel(id_name(id), now, in.ConsumeBool() ? hash_name(hash) : std::string(),
                           in.ConsumeBool() ? request_name(request) : std::string());
        break;
      case 12:
        table.withdraw(id_name(id), request_name(request));
        break;
      case 13:
        now += std::chrono::milliseconds(in.ConsumeIntegralInRange<int>(0, 2000));
        [[fallthrough]];
      case 14:
        cancels.clear();
        table.expire(now, cancels);
        break;
      case 15:
        for (const auto& r : table.take_unavailable_requests()) check(!r.empty());
        break;
      case 16:
        table.forget_pending_request(request_name(request));
        break;
      case 17:
        for (const auto& t : table.drain_orphaned()) check(!t.empty());
        break;
    }
    check_table(table);
  }
  return 0;
}
