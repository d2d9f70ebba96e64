#pragma once
// The one place that reads a configuration's data-plane keys (`transport`,
// `ucx_*`, `mooncake_*`) and builds the backend they name. Code above the transport
// asks the result's capabilities() (who chooses the landing, one-sided or not)
// instead of comparing backend names.

#include <memory>
#include <string>

#include "ecx/core/clock.h"
#include "ecx/core/config.h"
#include "ecx/core/status.h"
#include "ecx/transport/transport.h"

namespace ecx::transport {

enum class DataPlaneRole : std::uint8_t {
  sender,    // a producer: sends or writes payloads, never receives one
  receiver,  // a consumer shard: payloads land in its registered pool
};

// A receiver's answers for backends where the receiver chooses the landing
// (ignored by one-sided backends and by senders).
struct ReceiverHooks {
  LandingResolver resolver;
  LandingCallback on_landing;
};

Result<std::unique_ptr<Transport>> create_data_plane(const Config& config, std::shared_ptr<const Clock> clock,
                                                     DataPlaneRole role, ReceiverHooks hooks = {});

// For logs and summaries: the backend and its protocol, e.g. "ucx am", "mooncake tcp".
std::string describe_data_plane(const Config& config);

}  // namespace ecx::transport
