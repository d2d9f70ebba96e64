#pragma once
// RequestFailures: the requests the engine must fail because their encoder inputs
// cannot be had (malformed ec_transfer_params, a push that cannot be planned, a
// failed save, nothing left to load), each returned once by take(); and the
// throttled warning for items whose transfer id does not resolve. Both halves of
// the SchedulerCoordinator report here.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "connector/scheduler/coordinator_common.h"
#include "ecx/connector/scheduler/types.h"

namespace ecx::scheduler {

class RequestFailures {
 public:
  struct Stats {
    std::uint64_t unresolved_transfer_ids = 0;
    std::uint64_t malformed_requests = 0;
  };

  // `remembered`: how many requests already returned by take() are remembered.
  explicit RequestFailures(std::size_t remembered) : remembered_(remembered) {}

  // `request_id` is failed at the next take().
  void mark(std::string_view request_id) { pending_.emplace(request_id); }
  // Requests whose push the producer's workers reported failed.
  void add_failed_saves(const std::vector<std::string>& request_ids) {
    failed_saves_.insert(request_ids.begin(), request_ids.end());
  }
  // Whether the request's ec_transfer_params are malformed; the first time it is
  // seen, warns and marks it.
  bool report_malformed(const RequestView& request);
  // Item `index` names no transfer id ECX can resolve, seen at `where`.
  void warn_unresolved(const RequestView& request, std::size_t index, std::string_view where);
  // The request finished: a mark not yet taken is moot.
  void forget(std::string_view request_id);
  // `candidates` (the transfer table's) plus the marked and failed-save requests,
  // sorted, without those returned before.
  std::vector<std::string> take(std::vector<std::string> candidates);

  std::size_t pending() const noexcept { return pending_.size(); }
  const Stats& stats() const noexcept { return stats_; }

 private:
  const std::size_t remembered_;
  detail::StringSet pending_;
  detail::StringSet failed_saves_;
  // Requests already returned by take() (bounded, oldest forgotten).
  detail::RecentIds notified_;
  Stats stats_;
};

}  // namespace ecx::scheduler
