#pragma once
// What the parts of the SchedulerCoordinator share: the scheduler's logger, ids
// shortened for log lines, the name a transfer gets when no ec_items entry names
// it, and string-keyed containers that look up by string_view.

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "core/id_map.h"
#include "core/logging.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/ids.h"
#include "ecx/core/recent_table.h"

namespace ecx::scheduler::detail {

inline std::shared_ptr<spdlog::logger> coordinator_logger() {
  static auto instance = ecx::log::get("scheduler");
  return instance;
}

inline std::string_view shorten(std::string_view id, std::size_t n = 64) { return id.substr(0, n); }

// The invented name of item `index` when the request names no transfer for it, made
// the same way by the encoder's and the consumer's side; the other side does not know
// it, so nothing can cancel it remotely. The request id is made an id (id_from_text):
// as it was, a request id with a character outside the id alphabet named a push that
// failed validation, and the consumer waited for it until timeout.
inline std::string fallback_id(const RequestView& request, std::size_t index) {
  constexpr std::size_t kIndexRoom = 21;  // ':' and up to 20 digits
  return fmt::format("{}:{}", id_from_text(request.request_id, kMaxIdLength - kIndexRoom), index);
}

using StringSet = IdSet;
// emplace builds the node (a string allocation) before it finds the key is there;
// has_cache_item asks the same identifiers step after step.
inline void insert_once(StringSet& set, std::string_view key) {
  if (!set.contains(key)) set.emplace(key);
}
template <typename V>
using StringMap = IdMap<V>;

// Ids remembered up to a bound, the oldest forgotten first.
class RecentIds {
 public:
  // False when `id` is remembered already.
  bool insert(std::string_view id, std::size_t bound) {
    if (!ids_.try_push_back(id, {})) return false;
    while (ids_.size() > bound) ids_.pop_front();
    return true;
  }
  bool contains(std::string_view id) const { return ids_.contains(id); }

 private:
  struct Nothing {};
  RecentTable<Nothing> ids_;
};

}  // namespace ecx::scheduler::detail
