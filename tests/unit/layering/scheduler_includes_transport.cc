// Compiled with the scheduler's view of the tree, this must not build: the
// scheduler does not depend on the data plane.
#include "ecx/transport/transport.h"

int layering_probe_transport() { return 0; }
