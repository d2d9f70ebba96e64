#include "sim/redis_server.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

namespace ecx::sim {

Result<RedisServer> RedisServer::start(const RedisServerOptions& options) {
  if (::access(kRedisServerPath, X_OK) != 0) {
    return unavailable(fmt::format("{} is missing (Debian package redis-server)", kRedisServerPath));
  }
  const int port = free_port_block(1);
  if (port == 0) return unavailable("no free port on 127.0.0.1 for redis-server");
  std::vector<std::string> argv = {kRedisServerPath,
                                   "--port",
                                   std::to_string(port),
                                   "--bind",
                                   "127.0.0.1",
                                   "--save",
                                   "",
                                   "--appendonly",
                                   "no",
                                   "--daemonize",
                                   "no",
                                   "--loglevel",
                                   "warning",
                                   "--maxmemory",
                                   options.maxmemory,
                                   "--maxmemory-policy",
                                   "allkeys-lru",
                                   "--dir",
                                   std::filesystem::temp_directory_path().string()};
  if (options.keyspace_events) argv.insert(argv.end(), {"--notify-keyspace-events", "K$gxe"});
  argv.insert(argv.end(), options.extra_args.begin(), options.extra_args.end());
  auto child = ChildProcess::spawn(argv);
  if (!child) return child.status();
  RedisServer server(port, std::move(*child));
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    if (server.ping()) return server;
    if (!server.process_.running()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling its start-up (bounded)
  }
  return unavailable(fmt::format("redis-server on 127.0.0.1:{} did not answer within 10 s", port));
}

std::string RedisServer::url() const { return fmt::format("redis://127.0.0.1:{}/0", port_); }

RedisServer::Reply RedisServer::raw(const std::vector<std::string>& args) const {
  std::unique_ptr<redisContext, void (*)(redisContext*)> c(redisConnectWithTimeout("127.0.0.1", port_, {2, 0}),
                                                           redisFree);
  Reply none(nullptr, freeReplyObject);
  if (!c || c->err) return none;
  std::vector<const char*> argv;
  std::vector<std::size_t> lengths;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lengths.push_back(a.size());
  }
  return {
      static_cast<redisReply*>(redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lengths.data())),
      freeReplyObject};
}

bool RedisServer::ping() const {
  auto r = raw({"PING"});
  return r && r->type == REDIS_REPLY_STATUS;
}

}  // namespace ecx::sim
