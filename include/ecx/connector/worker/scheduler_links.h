#pragma once
// The SchedulerCoordinator's collaborators over the real control plane: readiness
// events from a ZeroMQ EventInbox, remote cancels through a ControlClient. The
// coordinator only sees the small interfaces of ecx/scheduler/collaborators.h.

#include <memory>

#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/control/client.h"
#include "ecx/core/config.h"
#include "ecx/core/dtype.h"

namespace ecx::worker {

// Builds a coordinator for `config`'s role wired to the consumer's shards at
// config.control_address(0) (consumer role) with a ZeroMQ client and event inbox.
// model_dtype / model_hidden_width come from the engine's model config.
Result<std::unique_ptr<scheduler::SchedulerCoordinator>> make_scheduler_coordinator(
    const Config& config, DType model_dtype, std::int64_t model_hidden_width,
    std::shared_ptr<const Clock> clock = SteadyClock::shared());

// The adapters on their own (tests, custom wiring). The client must outlive both.
std::shared_ptr<scheduler::EventSource> make_event_source(std::shared_ptr<control::ControlClient> client,
                                                          const Config& config, std::shared_ptr<const Clock> clock);
std::shared_ptr<scheduler::ConsumerControl> make_consumer_control(std::shared_ptr<control::ControlClient> client,
                                                                  Duration timeout);

// The cross-encoder cache's presence answers for a producer's scheduler: a store
// presence index (its own lookup connection and the store's change feed) whose
// counters the process-wide metrics registry exports. A store that is down is no
// error here: items are encoded until it is back. make_scheduler_coordinator wires
// one in when config.cross_encoder_cache is on.
Result<std::shared_ptr<scheduler::StorePresence>> make_store_presence(const Config& config,
                                                                      std::shared_ptr<const Clock> clock);

}  // namespace ecx::worker
