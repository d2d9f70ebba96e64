#pragma once
// The coordinator test harness: a coordinator wired to the fakes and a manual clock.

#include <gtest/gtest.h>

#include "fake_collaborators.h"

namespace ecx::scheduler::testing {

// The state of a transfer's record; failed once the table has none.
inline TransferState state_of(const SchedulerCoordinator& c, const std::string& id) {
  const auto* r = c.table().find(id);
  return r ? r->state() : TransferState::failed;
}

// A coordinator wired to fakes and a manual clock.
struct Harness {
  explicit Harness(CoordinatorOptions options = consumer_options(), int shards = 1,
                   std::vector<std::string> shard_addresses = {"tcp://127.0.0.1:14579"})
      : clock(std::make_shared<ManualClock>()),
        events(std::make_shared<FakeEventSource>(shards)),
        control(std::make_shared<FakeConsumerControl>(std::move(shard_addresses))),
        coordinator(std::move(options), clock, events, control) {}

  // One engine step boundary: build the metadata (re-arms draining).
  ConnectorMeta step(StepView view = {}) { return coordinator.build_connector_meta(view); }
  void advance(Duration d) { clock->advance(d); }
  // `transfer_id` lands, the request's gate starts its load, and the workers report
  // it loaded (the request has not run yet: the gate said no). Returns the step's
  // metadata, the one that carried the load.
  ConnectorMeta land_and_load(const RequestView& r, const std::string& transfer_id, const std::string& hash) {
    events->ready(transfer_id, hash);
    EXPECT_FALSE(coordinator.ensure_cache_available(r, 0));
    ConnectorMeta meta = step();
    coordinator.update_connector_output(WorkerOutput{{hash}, {}, {}, false, {}});
    return meta;
  }
  // Waits for the executor to finish `n` cancel RPCs, then polls their outcome.
  void settle_cancels(std::size_t n) {
    EXPECT_TRUE(control->wait_cancels(n));
    // The outcome is published after the RPC returns; poll until every ticket is
    // done (bounded by the fake's own deadline through wait_cancels above).
    for (int i = 0; i < 100000 && coordinator.pending_remote_cancels() > 0; ++i) {
      step();
      std::this_thread::yield();
    }
  }

  std::shared_ptr<ManualClock> clock;
  std::shared_ptr<FakeEventSource> events;
  std::shared_ptr<FakeConsumerControl> control;
  SchedulerCoordinator coordinator;
};

}  // namespace ecx::scheduler::testing
