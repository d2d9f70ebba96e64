#pragma once
// A redis-server of one's own on a free loopback port (Debian's redis-server), for
// the demo's cross-encoder cache, `ecx bench store` and the store tests: no
// persistence, keyspace notifications on, killed and reaped with the object.

#include <hiredis/hiredis.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ecx/core/status.h"
#include "sim/process.h"

namespace ecx::sim {

inline constexpr const char* kRedisServerPath = "/usr/bin/redis-server";

struct RedisServerOptions {
  std::string maxmemory = "4gb";  // with allkeys-lru: Redis evicts under its own limit
  bool keyspace_events = true;    // notify-keyspace-events K$gxe (what the presence feed needs)
  std::vector<std::string> extra_args;
};

class RedisServer {
 public:
  // Starts it and waits (bounded, 10 s) until it answers PING.
  static Result<RedisServer> start(const RedisServerOptions& options = {});
  RedisServer(RedisServer&&) noexcept = default;
  RedisServer& operator=(RedisServer&&) noexcept = default;

  int port() const { return port_; }
  std::string url() const;  // redis://127.0.0.1:<port>/0
  ChildProcess& process() { return process_; }

  using Reply = std::unique_ptr<redisReply, void (*)(void*)>;
  // A raw command on a connection of its own; the reply, or nullptr.
  Reply raw(const std::vector<std::string>& args) const;
  bool ping() const;

 private:
  RedisServer(int port, ChildProcess process) : port_(port), process_(std::move(process)) {}
  int port_;
  ChildProcess process_;
};

}  // namespace ecx::sim
