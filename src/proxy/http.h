#pragma once
// A small asynchronous HTTP/1.1 server and client for the proxy, on Boost.Asio C++20
// coroutines. Only http.cc includes Beast, so the rest of the proxy (and the bench)
// compiles against this Beast-free interface. Everything here runs on one I/O thread:
// none of these classes is thread-safe, all must be used from their io_context.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>  // asio's awaitable.hpp needs std::exchange
#include <vector>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "ecx/core/clock.h"
#include "ecx/core/status.h"
#include "ecx/proxy/options.h"

namespace ecx::proxy::http {

namespace net = boost::asio;
template <typename T>
using Task = net::awaitable<T>;

struct Field {
  std::string name;
  std::string value;
};
using Fields = std::vector<Field>;
// Case-insensitive lookup; empty when absent.
std::string_view find_field(const Fields& fields, std::string_view name);
// {{"Content-Type", value}}. (GCC 12 miscompiles braced lists of string literals
// inside co_await expressions, so coroutines build their arguments beforehand.)
Fields content_type(std::string value);

// ---------------------------------------------------------------- server

struct ServerRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query
  Fields headers;
  std::string body;
  std::string_view header(std::string_view name) const { return find_field(headers, name); }
  std::string_view path() const;   // target without the query
  std::string_view query() const;  // after '?', or empty
};

// How a handler answers: either send() once, or begin_stream(), write_chunk()...,
// end_stream() (chunked transfer encoding). A failed write means the client is gone.
class Responder {
 public:
  virtual ~Responder() = default;
  virtual Task<Status> send(int status, Fields headers, std::string body) = 0;
  virtual Task<Status> begin_stream(int status, Fields headers) = 0;
  virtual Task<Status> write_chunk(std::string_view data) = 0;
  virtual Task<Status> end_stream() = 0;
  // Whether any byte of the response has been handed to the socket.
  virtual bool started() const = 0;
};

using Handler = std::function<Task<void>(ServerRequest&, Responder&)>;

struct ServerLimits {
  std::size_t max_body_bytes = 64u << 20;
  Duration read_timeout = std::chrono::seconds(60);   // a request's head and body, and keep-alive idle
  Duration write_timeout = std::chrono::seconds(60);  // each write to the client
};

class Server {
 public:
  Server(net::io_context& io, Handler handler, ServerLimits limits);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  Status listen(const std::string& host, std::uint16_t port);
  std::uint16_t port() const;
  // Closes the listening socket and idle keep-alive connections; connections with
  // a request in flight close once it has been answered.
  void stop_accepting();
  // Closes every connection, busy or not.
  void close_all();
  std::size_t active_requests() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// ---------------------------------------------------------------- client

struct Connection;  // a pooled keep-alive connection (defined in http.cc)

// Cancels a set of outstanding upstream calls at once (fail-fast fan-outs).
class CancelGroup {
 public:
  void cancel();
  bool cancelled() const { return cancelled_; }
  void attach(const std::shared_ptr<Connection>& connection);

 private:
  bool cancelled_ = false;
  std::vector<std::weak_ptr<Connection>> connections_;
};

struct ClientResponse {
  int status = 0;
  Fields headers;
  std::string body;
};

// Why an upstream call failed before a response came back.
enum class TransportError : unsigned char { none, connect, timeout, io, cancelled, too_large };
std::string_view transport_error_name(TransportError error) noexcept;

struct UpstreamRequest {
  std::string method = "POST";
  std::string target;
  Fields headers;
  std::string body;
  Duration timeout = std::chrono::seconds(60);  // fetch: the whole exchange; open: up to the head
};

// A response whose head has arrived and whose body is read piece by piece.
class UpstreamStream {
 public:
  struct State;
  explicit UpstreamStream(std::unique_ptr<State> state);
  ~UpstreamStream();  // an unfinished stream closes its connection instead of pooling it
  UpstreamStream(const UpstreamStream&) = delete;
  UpstreamStream& operator=(const UpstreamStream&) = delete;

  int status() const;
  const Fields& headers() const;
  // The next body bytes as they arrive (raw, re-chunking aside); an empty string at
  // the end of the body. `idle_timeout` bounds the wait for them.
  Task<Result<std::string>> next(Duration idle_timeout);
  // The rest of the body, at most `limit` bytes.
  Task<Result<std::string>> read_all(Duration timeout, std::size_t limit);

 private:
  std::unique_ptr<State> state_;
};

struct ClientLimits {
  Duration connect_timeout = std::chrono::seconds(5);
  Duration keep_alive_idle = std::chrono::seconds(2);
  std::size_t max_idle_per_upstream = 128;
  std::size_t max_response_bytes = 256u << 20;
};

struct FetchError {
  TransportError kind = TransportError::io;
  std::string message;
};

class Client {
 public:
  Client(net::io_context& io, ClientLimits limits);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // One exchange: the whole response, or a transport error (status unavailable /
  // timeout / cancelled with the details in the message and `error`).
  Task<Result<ClientResponse>> fetch(const UpstreamUrl& url, UpstreamRequest request, CancelGroup* cancel = nullptr,
                                     FetchError* error = nullptr);
  // Sends the request and returns once the response head has arrived.
  Task<Result<std::unique_ptr<UpstreamStream>>> open(const UpstreamUrl& url, UpstreamRequest request,
                                                     CancelGroup* cancel = nullptr, FetchError* error = nullptr);
  void close_idle();
  std::size_t idle_connections() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// ---------------------------------------------------------------- helpers

// Waits for a set of coroutines spawned on the same io_context: done() when each
// finishes, fail() to wake the waiter early (fail fast).
class WaitGroup {
 public:
  explicit WaitGroup(net::io_context& io) : timer_(io) {}
  void add(std::size_t n = 1) { pending_ += n; }
  void done();
  void fail();
  bool failed() const { return failed_; }
  std::size_t pending() const { return pending_; }
  // Returns when every task is done or one failed.
  Task<void> wait();

 private:
  net::steady_timer timer_;
  std::size_t pending_ = 0;
  bool failed_ = false;
};

// Spawns a coroutine whose exceptions are logged, never thrown out of run().
void spawn(net::io_context& io, Task<void> task, std::string_view what);

}  // namespace ecx::proxy::http
