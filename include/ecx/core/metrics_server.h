#pragma once
// A minimal HTTP endpoint serving GET /metrics (Prometheus text) from a Registry.
// One owned thread; requests are handled one at a time with short socket deadlines,
// which is plenty for a scraper and keeps the engine's dependencies small.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "ecx/core/metrics.h"
#include "ecx/core/status.h"

namespace ecx::metrics {

class MetricsServer {
 public:
  // Binds host:port (port 0 picks one; see port()). The registry must outlive the server.
  static Result<std::unique_ptr<MetricsServer>> start(const Registry& registry, const std::string& host, int port);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const noexcept { return port_; }
  // Stops accepting and joins the thread; idempotent.
  void stop();

 private:
  MetricsServer(const Registry& registry, int listen_fd, int port);
  void serve();
  void handle(int client_fd);

  const Registry& registry_;
  int listen_fd_;
  int port_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace ecx::metrics
