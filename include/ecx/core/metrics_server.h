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

struct ServeOptions {
  // Also serve the process-wide registry (Registry::global()) while no other server in
  // this process does: a component with an endpoint of its own (the scheduler, whose
  // process holds no worker when TP > 1) then shows the process's stage histograms
  // without repeating what a worker's endpoint in the same process already serves.
  bool global_when_unserved = false;
};

class MetricsServer {
 public:
  // Binds host:port (port 0 picks one; see port()). The registry must outlive the server.
  static Result<std::unique_ptr<MetricsServer>> start(const Registry& registry, const std::string& host, int port,
                                                      ServeOptions options = {});
  // Servers of this process that serve Registry::global() and have not stopped.
  static int global_servers() noexcept;
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const noexcept { return port_; }
  // Stops accepting and joins the thread; idempotent.
  void stop();

 private:
  MetricsServer(const Registry& registry, int listen_fd, int port, ServeOptions options);
  void serve();
  void handle(int client_fd);

  const Registry& registry_;
  const ServeOptions options_;
  const bool serves_global_;  // registry_ is Registry::global(): counted in global_servers()
  int listen_fd_;
  int port_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace ecx::metrics
