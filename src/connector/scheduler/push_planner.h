#pragma once
// PushPlanner: the producer half of the SchedulerCoordinator. It decides what an
// encoder instance pushes (one push per transfer id, shared by every request that
// names the same encoding for the same consumer), which outputs it offers to the
// shared store, and what request_finished reports of the transfers it planned.
// Nothing here touches the transfer table: that is the consumer's record.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "connector/scheduler/coordinator_common.h"
#include "connector/scheduler/request_failures.h"
#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/node_stash.h"

namespace ecx::scheduler {

// The encoder output an item will have: its own output spec, else
// [num_encoder_embeds, encoder_output_width] in encoder_dtype.
Result<TensorSpec> expected_output_spec(const CoordinatorOptions& options, const MmFeature& feature);

class PushPlanner {
 public:
  struct Stats {
    std::uint64_t pushes_planned = 0;
    std::uint64_t push_conflicts = 0;  // a transfer id already planned for other content
  };

  // `options` and `failures` must outlive the planner; a pure consumer's planner
  // plans nothing (is_producer is false).
  PushPlanner(const CoordinatorOptions& options, RequestFailures& failures) : options_(options), failures_(failures) {}

  // The gate saw the request: plans the push of every item not computed yet.
  void plan_uncomputed(const RequestView& request, std::int64_t num_computed_tokens);
  // The engine allocated item `index`: plans its push and, with the cross-encoder
  // cache, offers the output to the store unless it came from there.
  void after_alloc(const RequestView& request, std::size_t index, bool from_store = false);
  // Hands this step's planned pushes and store candidates (without those of
  // preempted requests; one per hash, the latest) to `meta`.
  void take_step(const StepView& step, ConnectorMeta& meta);
  // The workers' report: whether producer I/O is still in flight.
  void note_pending_saves(bool pending) noexcept { pending_saves_ = pending; }
  bool pushes_in_flight() const noexcept { return pending_saves_; }
  // request_finished's params for `request`, as JSON text: per identifier its item
  // indices and transfer id, and the bindings it planned ("ec_items"); forgets those
  // bindings. Empty for a pure consumer or a request without items.
  std::optional<std::string> finish(const RequestView& request);

  std::size_t bindings() const noexcept { return push_bindings_.size(); }
  const Stats& stats() const noexcept { return stats_; }

 private:
  struct PushBinding {
    std::string mm_hash;
    std::string consumer_zmq;
    std::size_t requests = 0;
  };

  void plan_push(const RequestView& request, std::size_t index);
  Result<TensorSpec> output_spec(const MmFeature& feature) const;

  const CoordinatorOptions& options_;
  RequestFailures& failures_;
  Stats stats_;
  // Planned pushes of this step, bindings planned so far, and which request
  // planned which binding.
  std::vector<PushSpec> pushes_;
  detail::StringMap<PushBinding> push_bindings_;
  detail::StringMap<std::vector<std::string>> bindings_by_request_;
  // Both maps gain an entry for every push and lose it when its request finishes, on
  // the engine's thread: their nodes and key strings are reused.
  NodeStash<detail::StringMap<PushBinding>> binding_nodes_;
  NodeStash<detail::StringMap<std::vector<std::string>>> request_nodes_;
  std::vector<std::pair<std::string, StoreCandidate>> store_candidates_;  // (request id, candidate)
  bool pending_saves_ = false;
};

}  // namespace ecx::scheduler
