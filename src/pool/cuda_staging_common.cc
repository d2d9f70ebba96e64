#include <thread>

#include "ecx/pool/cuda_staging.h"

namespace ecx::pool {

Status CudaStager::wait(Copy copy, TimePoint deadline, const Clock& clock) {
  for (;;) {
    auto done = poll(copy);
    if (!done) return done.status();
    if (*done) return Status::ok();
    if (clock.now() >= deadline) return timeout_error("staging copy did not finish before its deadline");
    // Copies of a few MB take tens to hundreds of microseconds; yielding keeps the
    // wait cheap without a blocking event synchronise that would ignore the deadline.
    std::this_thread::yield();
  }
}

}  // namespace ecx::pool
