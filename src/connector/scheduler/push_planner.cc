#include "connector/scheduler/push_planner.h"

#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "connector/scheduler/transfer_params_json.h"
#include "ecx/core/ids.h"

namespace ecx::scheduler {

using detail::coordinator_logger;
using detail::shorten;

void PushPlanner::plan_uncomputed(const RequestView& request, std::int64_t num_computed_tokens) {
  if (!options_.is_producer) return;
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    if (!request.mm_features[i].computed_by(num_computed_tokens)) plan_push(request, i);
  }
}

void PushPlanner::after_alloc(const RequestView& request, std::size_t index, bool from_store) {
  if (!options_.is_producer || request.has_malformed_params()) return;
  plan_push(request, index);
  const MmFeature& feature = request.mm_features[index];
  if (!from_store && options_.cross_encoder_cache && feature.modality == "image") {
    if (auto spec = output_spec(feature)) {
      store_candidates_.emplace_back(request.request_id, StoreCandidate{feature.identifier, *spec});
    }
  }
}

void PushPlanner::take_step(const StepView& step, ConnectorMeta& meta) {
  if (!store_candidates_.empty()) {
    const detail::StringSet preempted(step.preempted_request_ids.begin(), step.preempted_request_ids.end());
    detail::StringMap<std::size_t> position;
    for (auto& [request_id, candidate] : store_candidates_) {
      if (preempted.contains(request_id)) continue;
      if (auto it = position.find(candidate.mm_hash); it != position.end()) {
        meta.store_candidates[it->second] = std::move(candidate);
      } else {
        position.emplace(candidate.mm_hash, meta.store_candidates.size());
        meta.store_candidates.push_back(std::move(candidate));
      }
    }
    store_candidates_.clear();
  }
  meta.pushes = std::move(pushes_);
  // Room for as many as this step's: growing from empty each step reallocated a few
  // times, and the larger reallocations made glibc consolidate its fast bins.
  pushes_ = {};
  pushes_.reserve(meta.pushes.size());
}

std::optional<std::string> PushPlanner::finish(const RequestView& request) {
  if (!options_.is_producer || request.mm_features.empty()) {
    if (auto it = bindings_by_request_.find(request.request_id); it != bindings_by_request_.end()) {
      request_nodes_.erase(bindings_by_request_, it);
    }
    return std::nullopt;
  }
  // Written directly rather than built as a JSON tree and dumped: this runs once per
  // finished request on the engine's thread, and the tree's allocations cost more than
  // the rest of request_finished (64 KiB items, `ecx bench e2e`). Keys in sorted order,
  // as the tree would have them; the same identifier twice lists both indices and keeps
  // the last transfer id.
  struct Entry {
    std::vector<std::size_t> indices;
    std::optional<std::string_view> transfer_id;
  };
  std::map<std::string_view, Entry> entries;
  const EcTransferParams* params = request.params();
  for (std::size_t i = 0; i < request.mm_features.size(); ++i) {
    const MmFeature& feature = request.mm_features[i];
    Entry& entry = entries[feature.identifier];
    entry.indices.push_back(i);
    if (auto transfer_id = resolve_transfer_id(params, i, feature.identifier)) entry.transfer_id = *transfer_id;
  }
  std::string items;  // the "ec_items" list's elements
  if (auto it = bindings_by_request_.find(request.request_id); it != bindings_by_request_.end()) {
    std::size_t room = 0;  // once, rather than growing by appends
    for (const auto& transfer_id : it->second) room += 2 * transfer_id.size() + 48;
    items.reserve(room);
    for (const auto& transfer_id : it->second) {
      auto binding = push_bindings_.find(transfer_id);
      if (binding == push_bindings_.end()) continue;
      if (!items.empty()) items += ',';
      items += "{\"mm_hash\":";
      append_json_string(items, binding->second.mm_hash);
      items += ",\"transfer_id\":";
      append_json_string(items, transfer_id);
      items += '}';
      if (--binding->second.requests == 0) binding_nodes_.erase(push_bindings_, binding);
    }
    request_nodes_.erase(bindings_by_request_, it);
  }
  constexpr std::string_view kItemsKey = "ec_items";
  std::string out;
  std::size_t room = items.size() + 16;
  for (const auto& [identifier, entry] : entries) {
    room += identifier.size() + 48 + 4 * entry.indices.size() + (entry.transfer_id ? entry.transfer_id->size() : 0);
  }
  out.reserve(room);
  out += '{';
  bool items_written = items.empty();
  auto write_items = [&] {
    if (out.size() > 1) out += ',';
    out += "\"ec_items\":[";
    out += items;
    out += ']';
    items_written = true;
  };
  for (const auto& [identifier, entry] : entries) {
    if (!items_written && identifier >= kItemsKey) write_items();
    if (identifier == kItemsKey && !items.empty()) continue;  // the list takes the key
    if (out.size() > 1) out += ',';
    append_json_string(out, identifier);
    out += ":{\"item_indices\":[";
    for (std::size_t k = 0; k < entry.indices.size(); ++k) {
      if (k != 0) out += ',';
      out += std::to_string(entry.indices[k]);
    }
    out += ']';
    if (entry.transfer_id) {
      out += ",\"transfer_id\":";
      append_json_string(out, *entry.transfer_id);
    }
    out += '}';
  }
  if (!items_written) write_items();
  out += '}';
  return out;
}

void PushPlanner::plan_push(const RequestView& request, std::size_t index) {
  const EcTransferParams* params = request.params();
  const MmFeature& feature = request.mm_features[index];
  const bool has_consumer = params && !params->consumer_zmq.empty();
  if (!has_consumer) return;
  // Viewed, not copied: the engine re-checks a waiting request every step, and this
  // runs for each of its items every time.
  const std::optional<std::string_view> resolved = resolve_transfer_id(params, index, feature.identifier);
  // Still push an unresolved item: once the proxy rewrote the item into embeds the
  // consumer has no media to fall back on. But the consumer cannot cancel this
  // invented name.
  if (!resolved) failures_.warn_unresolved(request, index, "push prepare");
  const std::string invented = resolved ? std::string() : detail::fallback_id(request, index);
  const std::string_view transfer_id = resolved ? *resolved : std::string_view(invented);
  auto& mine = request_nodes_.find_or_insert(bindings_by_request_, request.request_id);
  if (std::find(mine.begin(), mine.end(), transfer_id) != mine.end()) return;  // planned once per transfer
  if (auto it = push_bindings_.find(transfer_id); it != push_bindings_.end()) {
    if (it->second.mm_hash != feature.identifier || it->second.consumer_zmq != params->consumer_zmq) {
      // Another payload or destination under the same name: drop the newcomer.
      ++stats_.push_conflicts;
      coordinator_logger()->warn(
          "EC transfer_id={} is already planned for mm_hash={} to {}; refusing mm_hash={} to {} for request {}",
          shorten(transfer_id), shorten(it->second.mm_hash), it->second.consumer_zmq, shorten(feature.identifier),
          params->consumer_zmq, shorten(request.request_id));
      failures_.mark(request.request_id);
      return;
    }
    ++it->second.requests;  // the same encoding named twice: one push serves both
    mine.emplace_back(transfer_id);
    return;
  }
  // Refused here, naming the field, rather than by the consumer's reserve after the
  // encoder ran and the output was staged.
  if (Status valid = validate_mm_hash(feature.identifier); !valid) {
    coordinator_logger()->warn("EC cannot push item {} of request {}: {}", index, shorten(request.request_id),
                               valid.message());
    failures_.mark(request.request_id);
    return;
  }
  auto spec = output_spec(feature);
  if (!spec) {
    coordinator_logger()->warn("EC cannot plan the push of mm_hash={} for request {}: {}", shorten(feature.identifier),
                               shorten(request.request_id), spec.status().message());
    failures_.mark(request.request_id);
    return;
  }
  pushes_.push_back(
      PushSpec{feature.identifier, *spec, params->consumer_zmq, std::string(transfer_id), request.request_id});
  binding_nodes_.insert(push_bindings_, transfer_id, PushBinding{feature.identifier, params->consumer_zmq, 1});
  mine.emplace_back(transfer_id);
  ++stats_.pushes_planned;
}

Result<TensorSpec> PushPlanner::output_spec(const MmFeature& feature) const {
  return expected_output_spec(options_, feature);
}

Result<TensorSpec> expected_output_spec(const CoordinatorOptions& options, const MmFeature& feature) {
  if (feature.output_spec) return *feature.output_spec;
  if (options.encoder_output_width <= 0) {
    return invalid_argument("the encoder output width is unknown (set encoder_output_width)");
  }
  const std::array<std::int64_t, 2> shape{feature.num_encoder_embeds, options.encoder_output_width};
  return TensorSpec::make(std::span<const std::int64_t>(shape), options.encoder_dtype, options.max_tensor_bytes);
}

}  // namespace ecx::scheduler
