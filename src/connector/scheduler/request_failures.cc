#include "connector/scheduler/request_failures.h"

#include <algorithm>
#include <utility>

#include <fmt/ranges.h>

namespace ecx::scheduler {
namespace {

constexpr std::uint64_t kMaxUnresolvedWarnings = 5;  // then every 1000th

}  // namespace

using detail::coordinator_logger;
using detail::shorten;

bool RequestFailures::report_malformed(const RequestView& request) {
  if (!request.has_malformed_params()) return false;
  if (!notified_.contains(request.request_id) && !pending_.contains(request.request_id)) {
    ++stats_.malformed_requests;
    coordinator_logger()->warn(
        "EC request {} carries malformed ec_transfer_params ({}); failing it with a retryable error where vLLM polls "
        "take_unavailable_requests, else its items are encoded locally",
        shorten(request.request_id), request.ec_transfer_params_error);
    mark(request.request_id);
  }
  return true;
}

void RequestFailures::warn_unresolved(const RequestView& request, std::size_t index, std::string_view where) {
  const std::uint64_t count = ++stats_.unresolved_transfer_ids;
  if (count > kMaxUnresolvedWarnings && count % 1000 != 0) return;
  // A caller that cannot resolve a transfer id falls back to a name the other
  // side does not know, so the two stop agreeing: reservations are never
  // released and surface minutes later as a full pool. Say it loudly.
  const auto* params = request.params();
  std::vector<std::string> hashes;
  if (params) {
    for (std::size_t i = 0; i < params->items.size() && i < 4; ++i) {
      hashes.push_back(params->items[i].mm_hash ? std::string(shorten(*params->items[i].mm_hash, 16)) : "None");
    }
  }
  coordinator_logger()->warn(
      "EC could not resolve a transfer id at {} for req={} index={}: feature identifier={} does not match any of the "
      "{} ec_items {} (ec_transfer_params present={}). Occurrence {}. ec_items[].mm_hash must echo an engine-reported "
      "identifier, or be omitted so the entry is matched by position.",
      where, shorten(request.request_id), index, shorten(request.mm_features[index].identifier, 16),
      params ? params->items.size() : 0, hashes, params != nullptr, count);
}

void RequestFailures::forget(std::string_view request_id) {
  if (auto it = pending_.find(request_id); it != pending_.end()) pending_.erase(it);
}

std::vector<std::string> RequestFailures::take(std::vector<std::string> candidates) {
  candidates.insert(candidates.end(), failed_saves_.begin(), failed_saves_.end());
  candidates.insert(candidates.end(), pending_.begin(), pending_.end());
  failed_saves_.clear();
  pending_.clear();
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  std::vector<std::string> out;
  for (auto& id : candidates) {
    if (!notified_.insert(id, remembered_)) continue;  // each request is failed once
    out.push_back(std::move(id));
  }
  return out;
}

}  // namespace ecx::scheduler
