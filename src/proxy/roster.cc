#include "ecx/proxy/roster.h"

#include <algorithm>

#include <fmt/format.h>

namespace ecx::proxy {

std::string_view instance_role_name(InstanceRole role) noexcept {
  switch (role) {
    case InstanceRole::encode:
      return "encode";
    case InstanceRole::prefill:
      return "prefill";
    case InstanceRole::decode:
      return "decode";
  }
  return "unknown";
}

Result<InstanceRole> parse_instance_role(std::string_view name) {
  if (name == "encode" || name == "encoder") return InstanceRole::encode;
  if (name == "prefill") return InstanceRole::prefill;
  if (name == "decode" || name == "prefill_decode" || name == "pd") return InstanceRole::decode;
  return invalid_argument(fmt::format("unknown role '{}': expected encode, prefill, decode or prefill_decode", name));
}

Roster::Roster(std::shared_ptr<const Clock> clock, RosterSettings settings)
    : clock_(std::move(clock)), settings_(settings) {}

Status Roster::add(InstanceSpec spec) {
  std::lock_guard lock(mutex_);
  auto it = records_.find(spec.url);
  if (it == records_.end()) {
    std::string url = spec.url;
    Record record;
    record.spec = std::move(spec);
    records_.emplace(std::move(url), std::move(record));
    return Status::ok();
  }
  if (it->second.spec.role != spec.role) {
    return conflict(fmt::format("{} is already registered as {}", spec.url, instance_role_name(it->second.spec.role)));
  }
  // A refresh (instances re-announce periodically) keeps the liveness state.
  spec.is_static = spec.is_static || it->second.spec.is_static;
  it->second.spec = std::move(spec);
  return Status::ok();
}

bool Roster::remove(std::string_view url) {
  std::lock_guard lock(mutex_);
  const auto it = records_.find(url);
  if (it == records_.end()) return false;
  records_.erase(it);
  return true;
}

std::vector<const Roster::Record*> Roster::live_of(InstanceRole role) const {
  std::vector<const Record*> live;
  for (const auto& [url, record] : records_) {
    if (record.spec.role == role && !record.evicted_since) live.push_back(&record);
  }
  return live;
}

std::optional<std::string> Roster::pick(InstanceRole role) {
  auto picked = pick_many(role, 1);
  if (picked.empty()) return std::nullopt;
  return std::move(picked.front());
}

std::vector<std::string> Roster::pick_many(InstanceRole role, std::size_t count) {
  std::lock_guard lock(mutex_);
  const auto live = live_of(role);
  std::vector<std::string> picked;
  if (live.empty() || count == 0) return picked;
  auto& cursor = cursors_[static_cast<int>(role)];
  picked.reserve(count);
  for (std::size_t i = 0; i < count; ++i) picked.push_back(live[(cursor + i) % live.size()]->spec.url);
  cursor += count;
  return picked;
}

std::size_t Roster::live_count(InstanceRole role) const {
  std::lock_guard lock(mutex_);
  return live_of(role).size();
}

std::size_t Roster::evicted_count(InstanceRole role) const {
  std::lock_guard lock(mutex_);
  return static_cast<std::size_t>(std::count_if(records_.begin(), records_.end(), [role](const auto& entry) {
    return entry.second.spec.role == role && entry.second.evicted_since.has_value();
  }));
}

std::optional<ConsumerTarget> Roster::consumer_target(std::string_view url) {
  std::lock_guard lock(mutex_);
  const auto it = records_.find(url);
  if (it == records_.end()) return std::nullopt;
  auto& record = it->second;
  const auto& addrs = record.spec.ec_zmq_addrs;
  ConsumerTarget target;
  if (record.spec.dp_rank) {
    target.dp_rank = record.spec.dp_rank;
    if (!addrs.empty()) target.zmq_addr = addrs.front();
    return target;
  }
  const int dp_size = std::max(record.spec.dp_size, 1);
  const int rank = dp_size > 1 ? static_cast<int>(record.replica_cursor++ % static_cast<std::uint64_t>(dp_size)) : 0;
  if (!addrs.empty()) target.zmq_addr = addrs[static_cast<std::size_t>(rank) % addrs.size()];
  if (dp_size > 1) target.dp_rank = rank;
  return target;
}

std::vector<std::string> Roster::probe_targets() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> urls;
  urls.reserve(records_.size());
  for (const auto& [url, record] : records_) urls.push_back(url);
  return urls;
}

Roster::ProbeOutcome Roster::record_probe(std::string_view url, bool healthy) {
  std::lock_guard lock(mutex_);
  ProbeOutcome outcome;
  const auto it = records_.find(url);
  if (it == records_.end()) return outcome;  // unregistered while the probe ran
  auto& record = it->second;
  if (healthy) {
    record.consecutive_failures = 0;
    if (record.evicted_since) {
      record.evicted_since.reset();
      outcome.readmitted = true;
    }
    return outcome;
  }
  ++record.consecutive_failures;
  if (!record.evicted_since && record.consecutive_failures >= settings_.fail_threshold) {
    record.evicted_since = clock_->now();
    outcome.evicted = true;
  }
  return outcome;
}

std::vector<std::string> Roster::forget_expired() {
  std::vector<std::string> forgotten;
  if (settings_.evicted_ttl <= Duration::zero()) return forgotten;
  std::lock_guard lock(mutex_);
  const auto now = clock_->now();
  for (auto it = records_.begin(); it != records_.end();) {
    const auto& record = it->second;
    if (!record.spec.is_static && record.evicted_since && now - *record.evicted_since >= settings_.evicted_ttl) {
      forgotten.push_back(it->first);
      it = records_.erase(it);
    } else {
      ++it;
    }
  }
  return forgotten;
}

RosterSnapshot Roster::snapshot() const {
  std::lock_guard lock(mutex_);
  RosterSnapshot out;
  for (const auto& [url, record] : records_) {
    auto& urls = out.of(record.spec.role);
    (record.evicted_since ? urls.evicted : urls.live).push_back(url);
  }
  return out;
}

}  // namespace ecx::proxy
