#pragma once
// The EPD proxy server: an OpenAI-compatible front door that has the encoders encode
// and push every media item of a chat request to the right consumer, then forwards the
// request to prefill/decode and relays the answer (SSE streams as they arrive).
//
// Routes: POST /v1/chat/completions, POST /v1/completions (passed through to a
// decode/PD instance), GET /v1/models, GET /health, GET /metrics, and the admin API
// GET|POST|DELETE /instances (X-API-Key). One I/O thread serves everything; every
// upstream hop is asynchronous with keep-alive connection pools and its own timeout.

#include <cstdint>
#include <memory>
#include <string>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/proxy/options.h"

namespace ecx::proxy {

class Roster;
class Metrics;

class ProxyServer {
 public:
  // Validates the options and seeds the roster from the static lists. `clock` drives
  // the roster's eviction times.
  static Result<std::unique_ptr<ProxyServer>> create(ProxyOptions options,
                                                     std::shared_ptr<const Clock> clock = SteadyClock::shared());
  ~ProxyServer();  // a graceful shutdown, then joins the I/O thread
  ProxyServer(const ProxyServer&) = delete;
  ProxyServer& operator=(const ProxyServer&) = delete;

  // Binds and starts serving on an owned I/O thread.
  Status start();
  std::uint16_t port() const;
  // Stops accepting, lets in-flight requests finish (bounded by shutdown_grace),
  // closes idle connections and joins the I/O thread. Idempotent.
  void shutdown();

  Roster& roster();
  const Metrics& metrics() const;

 private:
  struct Impl;
  explicit ProxyServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Runs a proxy until SIGTERM or SIGINT, then shuts it down gracefully. Prints the
// listening address on stdout. Returns 0 after a clean shutdown.
int run_proxy_until_signal(ProxyOptions options);

}  // namespace ecx::proxy
