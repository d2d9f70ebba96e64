#pragma once
// `ecx bench proxy`: the proxy's added latency and throughput against calling a fake
// decode engine directly, all in one process over loopback. Every series runs the
// same streaming chat completion with `concurrency` clients in flight; latency is
// request start to the last byte of the stream.

#include <cstddef>
#include <string>
#include <vector>

#include "ecx/core/status.h"

namespace ecx::proxy {

struct ProxyBenchOptions {
  int concurrency = 64;
  int requests = 4000;  // per series, after warm-up
  int warmup = 256;
  int rounds = 4;  // the series alternate in this many rounds
  int chunks = 8;  // SSE events per streamed answer
  // The fake decode's pause between two events (an engine's token pace). 0 makes the
  // run CPU-bound, which measures throughput rather than per-request overhead.
  int token_interval_us = 5000;
};

struct ProxyBenchSeries {
  std::string series;  // "direct", "proxy", "proxy_image"
  std::size_t requests = 0;
  std::size_t errors = 0;
  double p50_us = 0;
  double p99_us = 0;
  double per_s = 0;
  double ratio_vs_direct = 1;  // p50 latency / direct p50 latency
  double added_p50_us = 0;     // p50 - direct p50
  double added_p99_us = 0;     // p99 - direct p99
  // CPU time of the whole process (clients, fakes and proxy) per request; the
  // difference to "direct" is the proxy's own cost, and unlike latency it does not
  // grow when other work competes for the cores.
  double cpu_us_per_request = 0;
};

Result<std::vector<ProxyBenchSeries>> run_proxy_bench(const ProxyBenchOptions& options);

}  // namespace ecx::proxy
