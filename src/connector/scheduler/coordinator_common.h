#pragma once
// What the parts of the SchedulerCoordinator share: the scheduler's logger, ids
// shortened for log lines, the name a transfer gets when no ec_items entry names
// it, and string-keyed containers that look up by string_view.

#include <cstddef>
#include <deque>
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
#include "ecx/core/node_stash.h"

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
  RecentIds() = default;
  // order_ views ids_'s nodes: a copy would view the original's.
  RecentIds(const RecentIds&) = delete;
  RecentIds& operator=(const RecentIds&) = delete;
  RecentIds(RecentIds&&) noexcept = default;
  RecentIds& operator=(RecentIds&&) noexcept = default;

  // False when `id` is remembered already.
  bool insert(const std::string& id, std::size_t bound) {
    const auto [at, added] = nodes_.insert(ids_, id);
    if (!added) return false;
    order_.push_back(*at);
    while (order_.size() > bound) {
      nodes_.erase(ids_, ids_.find(order_.front()));
      order_.pop_front();
    }
    return true;
  }
  bool contains(std::string_view id) const { return ids_.contains(id); }

 private:
  StringSet ids_;
  // Once at its bound every insert drops the oldest id: the node and its string serve
  // the next one.
  NodeStash<StringSet> nodes_;
  // Views of ids_'s keys (a set's elements stay put when it rehashes), oldest first:
  // each id is stored once.
  std::deque<std::string_view> order_;
};

}  // namespace ecx::scheduler::detail
