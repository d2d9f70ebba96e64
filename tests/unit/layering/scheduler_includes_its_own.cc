// Compiled with the scheduler's view of the tree: its own headers and core's.
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/core/status.h"

int layering_probe_own() { return ecx::Status::ok().is_ok() ? 0 : 1; }
