// The only translation unit of the proxy that includes Beast (compile time).
#include "http.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <deque>
#include <limits>
#include <unordered_set>

#include <fmt/format.h>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "core/logging.h"

namespace ecx::proxy::http {

namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

namespace {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

template <typename Message>
Fields fields_of(const Message& message) {
  Fields fields;
  for (const auto& field : message) {
    fields.push_back(Field{std::string(field.name_string()), std::string(field.value())});
  }
  return fields;
}

// Hop-by-hop headers belong to one connection; they are never copied across.
bool is_hop_by_hop(std::string_view name) {
  for (const auto hop : {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-connection", "content-length"}) {
    if (iequals(name, hop)) return true;
  }
  return false;
}

template <typename Message>
void set_fields(Message& message, const Fields& fields) {
  for (const auto& field : fields) {
    if (!is_hop_by_hop(field.name)) message.set(field.name, field.value);
  }
}

std::shared_ptr<spdlog::logger> logger() {
  static auto log = ecx::log::get("proxy");
  return log;
}

}  // namespace

std::string_view find_field(const Fields& fields, std::string_view name) {
  for (const auto& field : fields) {
    if (iequals(field.name, name)) return field.value;
  }
  return {};
}

Fields content_type(std::string value) {
  Fields fields;
  fields.push_back(Field{"Content-Type", std::move(value)});
  return fields;
}

std::string_view ServerRequest::path() const {
  const std::string_view t = target;
  return t.substr(0, t.find('?'));
}

std::string_view ServerRequest::query() const {
  const std::string_view t = target;
  const auto q = t.find('?');
  return q == std::string_view::npos ? std::string_view{} : t.substr(q + 1);
}

std::string_view transport_error_name(TransportError error) noexcept {
  switch (error) {
    case TransportError::none:
      return "none";
    case TransportError::connect:
      return "connect";
    case TransportError::timeout:
      return "timeout";
    case TransportError::io:
      return "io";
    case TransportError::cancelled:
      return "cancelled";
    case TransportError::too_large:
      return "too_large";
  }
  return "unknown";
}

// ================================================================ helpers

void WaitGroup::done() {
  if (pending_ > 0) --pending_;
  if (pending_ == 0) timer_.cancel();
}

void WaitGroup::fail() {
  failed_ = true;
  timer_.cancel();
}

Task<void> WaitGroup::wait() {
  // One thread: the condition cannot change between the check and the wait's start.
  while (pending_ > 0 && !failed_) {
    timer_.expires_at(net::steady_timer::time_point::max());
    error_code ec;
    co_await timer_.async_wait(net::redirect_error(net::use_awaitable, ec));
  }
}

void spawn(net::io_context& io, Task<void> task, std::string_view what) {
  net::co_spawn(io, std::move(task), [what = std::string(what)](const std::exception_ptr& error) {
    if (!error) return;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      logger()->error("{}: unexpected exception: {}", what, e.what());
    } catch (...) {
      logger()->error("{}: unexpected exception", what);
    }
  });
}

// ================================================================ server

namespace {

struct Session;

}  // namespace

struct Server::State {
  net::io_context& io;
  Handler handler;
  ServerLimits limits;
  tcp::acceptor acceptor;
  bool accepting = false;
  std::size_t active_requests = 0;
  std::unordered_set<Session*> sessions;

  State(net::io_context& context, Handler h, ServerLimits l)
      : io(context), handler(std::move(h)), limits(l), acceptor(context) {}
};

namespace {

struct Session : Responder {
  beast::tcp_stream stream;
  beast::flat_buffer buffer;
  std::shared_ptr<Server::State> server;
  bool busy = false;       // a request is being handled
  bool keep_alive = true;  // of the request being answered
  bool started_ = false;   // response bytes went out
  bool finished = false;   // the response is complete
  bool broken = false;     // a write failed or a stream was abandoned

  Session(tcp::socket socket, std::shared_ptr<Server::State> state)
      : stream(std::move(socket)), server(std::move(state)) {}

  bool started() const override { return started_; }

  bool reuse() const { return keep_alive && server->accepting && !broken; }

  template <typename Message>
  void prepare(Message& message, int status, const Fields& headers) {
    message.result(static_cast<unsigned>(status));
    message.version(11);
    set_fields(message, headers);
    message.keep_alive(reuse());
  }

  Status write_status(const error_code& ec, std::string_view what) {
    if (!ec) return Status::ok();
    broken = true;
    return unavailable(fmt::format("writing {} to the client failed: {}", what, ec.message()));
  }

  Task<Status> send(int status, Fields headers, std::string body) override {
    if (started_) co_return internal_error("a response was already started");
    bhttp::response<bhttp::string_body> response;
    prepare(response, status, headers);
    response.body() = std::move(body);
    response.prepare_payload();
    started_ = true;
    error_code ec;
    stream.expires_after(server->limits.write_timeout);
    co_await bhttp::async_write(stream, response, net::redirect_error(net::use_awaitable, ec));
    finished = !ec;
    co_return write_status(ec, "a response");
  }

  Task<Status> begin_stream(int status, Fields headers) override {
    if (started_) co_return internal_error("a response was already started");
    bhttp::response<bhttp::empty_body> response;
    prepare(response, status, headers);
    response.chunked(true);
    bhttp::response_serializer<bhttp::empty_body> serializer(response);
    started_ = true;
    error_code ec;
    stream.expires_after(server->limits.write_timeout);
    co_await bhttp::async_write_header(stream, serializer, net::redirect_error(net::use_awaitable, ec));
    co_return write_status(ec, "a response head");
  }

  Task<Status> write_chunk(std::string_view data) override {
    if (data.empty()) co_return Status::ok();  // an empty chunk would end the body
    error_code ec;
    stream.expires_after(server->limits.write_timeout);
    co_await net::async_write(stream, bhttp::make_chunk(net::const_buffer(data.data(), data.size())),
                              net::redirect_error(net::use_awaitable, ec));
    co_return write_status(ec, "a chunk");
  }

  Task<Status> end_stream() override {
    error_code ec;
    stream.expires_after(server->limits.write_timeout);
    co_await net::async_write(stream, bhttp::make_chunk_last(), net::redirect_error(net::use_awaitable, ec));
    finished = !ec;
    co_return write_status(ec, "the last chunk");
  }

  Task<void> answer_error(int status, std::string message) {
    keep_alive = false;
    const std::string body = nlohmann_error(status, message);
    (void)co_await send(status, content_type("application/json"), body);
  }

  static std::string nlohmann_error(int status, std::string_view message) {
    std::string escaped;
    for (const char c : message) {
      if (c == '"' || c == '\\') escaped += '\\';
      if (static_cast<unsigned char>(c) >= 0x20) escaped += c;
    }
    return fmt::format(R"({{"error":{{"message":"{}","type":"invalid_request_error","code":{},"stage":"request"}}}})",
                       escaped, status);
  }

  // After refusing a request whose body is still arriving: closing at once would
  // reset the connection and lose the answer, so stop sending, read and discard
  // what the client still sends (bounded in bytes and time), then close.
  Task<void> drain_then_close() {
    error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    std::array<char, 16384> sink{};
    std::size_t drained = 0;
    stream.expires_after(std::min<Duration>(server->limits.read_timeout, std::chrono::seconds(2)));
    while (!ec && drained < (8u << 20)) {
      drained += co_await stream.async_read_some(net::buffer(sink), net::redirect_error(net::use_awaitable, ec));
    }
    stream.close();
  }

  Task<void> run() {
    for (;;) {
      started_ = finished = broken = false;  // per request
      bhttp::request_parser<bhttp::string_body> parser;
      parser.body_limit(server->limits.max_body_bytes);
      parser.header_limit(64 * 1024);
      error_code ec;
      stream.expires_after(server->limits.read_timeout);
      co_await bhttp::async_read_header(stream, buffer, parser, net::redirect_error(net::use_awaitable, ec));
      if (!ec && iequals(parser.get()[bhttp::field::expect], "100-continue")) {
        // Clients holding a large body back until told to send it (curl does).
        bhttp::response<bhttp::empty_body> go_on{bhttp::status::continue_, 11};
        co_await bhttp::async_write(stream, go_on, net::redirect_error(net::use_awaitable, ec));
      }
      if (!ec && !parser.is_done()) {
        co_await bhttp::async_read(stream, buffer, parser, net::redirect_error(net::use_awaitable, ec));
      }
      if (ec == bhttp::error::body_limit) {
        co_await answer_error(413, fmt::format("the request body exceeds {} bytes", server->limits.max_body_bytes));
        co_await drain_then_close();
        co_return;
      }
      if (ec == bhttp::error::header_limit) {
        co_await answer_error(431, "the request head is too large");
        break;
      }
      if (ec) break;  // closed, timed out, or malformed: nothing to answer
      auto message = parser.release();
      ServerRequest request;
      request.method = std::string(message.method_string());
      request.target = std::string(message.target());
      request.headers = fields_of(message);
      request.body = std::move(message.body());
      keep_alive = message.keep_alive();
      busy = true;
      ++server->active_requests;
      try {
        co_await server->handler(request, *this);
      } catch (const std::exception& e) {
        logger()->error("handler for {} {} threw: {}", request.method, request.target, e.what());
        broken = true;
      }
      --server->active_requests;
      busy = false;
      if (!started_) co_await answer_error(500, "the request was not answered");
      if (!finished || !reuse()) break;
    }
    error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.close();
  }
};

}  // namespace

namespace {

Task<void> serve_session(std::shared_ptr<Session> session) {
  co_await session->run();
  session->server->sessions.erase(session.get());
}

Task<void> accept_loop(std::shared_ptr<Server::State> state) {
  while (state->accepting) {
    error_code ec;
    tcp::socket socket = co_await state->acceptor.async_accept(net::redirect_error(net::use_awaitable, ec));
    if (ec) {
      if (!state->accepting) break;
      logger()->warn("accept failed: {}", ec.message());
      continue;
    }
    socket.set_option(tcp::no_delay(true), ec);
    auto session = std::make_shared<Session>(std::move(socket), state);
    state->sessions.insert(session.get());
    spawn(state->io, serve_session(std::move(session)), "http session");
  }
}

}  // namespace

Server::Server(net::io_context& io, Handler handler, ServerLimits limits)
    : state_(std::make_shared<State>(io, std::move(handler), limits)) {}

Server::~Server() { close_all(); }

Status Server::listen(const std::string& host, std::uint16_t port) {
  error_code ec;
  const auto address = net::ip::make_address(host, ec);
  if (ec) return invalid_argument(fmt::format("cannot listen on '{}': {}", host, ec.message()));
  const tcp::endpoint endpoint(address, port);
  auto& acceptor = state_->acceptor;
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return unavailable(fmt::format("cannot listen on {}:{}: {}", host, port, ec.message()));
  state_->accepting = true;
  spawn(state_->io, accept_loop(state_), "http acceptor");
  return Status::ok();
}

std::uint16_t Server::port() const {
  error_code ec;
  const auto endpoint = state_->acceptor.local_endpoint(ec);
  return ec ? 0 : endpoint.port();
}

void Server::stop_accepting() {
  state_->accepting = false;
  error_code ignored;
  state_->acceptor.close(ignored);
  for (auto* session : state_->sessions) {
    if (!static_cast<Session*>(session)->busy) static_cast<Session*>(session)->stream.close();
  }
}

void Server::close_all() {
  stop_accepting();
  for (auto* session : state_->sessions) static_cast<Session*>(session)->stream.close();
}

std::size_t Server::active_requests() const { return state_->active_requests; }

// ================================================================ client

struct Connection {
  beast::tcp_stream stream;
  beast::flat_buffer buffer;
  std::string key;
  TimePoint idle_since{};
  explicit Connection(net::io_context& io) : stream(io) {}
  void close() {
    error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream.close();
  }
};

void CancelGroup::cancel() {
  cancelled_ = true;
  for (auto& weak : connections_) {
    if (auto connection = weak.lock()) connection->close();
  }
  connections_.clear();
}

void CancelGroup::attach(const std::shared_ptr<Connection>& connection) {
  if (cancelled_) {
    connection->close();
    return;
  }
  std::erase_if(connections_, [](const auto& weak) { return weak.expired(); });
  connections_.push_back(connection);
}

struct Client::State {
  net::io_context& io;
  ClientLimits limits;
  std::unordered_map<std::string, std::deque<std::shared_ptr<Connection>>> idle;
  State(net::io_context& context, ClientLimits l) : io(context), limits(l) {}

  std::shared_ptr<Connection> take_idle(const std::string& key) {
    auto it = idle.find(key);
    if (it == idle.end()) return nullptr;
    const auto now = std::chrono::steady_clock::now();
    while (!it->second.empty()) {
      auto connection = std::move(it->second.back());  // most recently used first: least likely closed
      it->second.pop_back();
      if (now - connection->idle_since < limits.keep_alive_idle && connection->stream.socket().is_open()) {
        return connection;
      }
      connection->close();
    }
    return nullptr;
  }

  void give_back(std::shared_ptr<Connection> connection) {
    if (limits.keep_alive_idle <= Duration::zero()) {
      connection->close();
      return;
    }
    auto& list = idle[connection->key];
    if (list.size() >= limits.max_idle_per_upstream) {
      list.front()->close();
      list.pop_front();
    }
    connection->idle_since = std::chrono::steady_clock::now();
    connection->stream.expires_never();
    list.push_back(std::move(connection));
  }
};

struct UpstreamStream::State {
  std::shared_ptr<Client::State> client;
  std::shared_ptr<Connection> connection;
  bhttp::response_parser<bhttp::buffer_body> parser;
  bool reusable = false;  // the server allows keep-alive
  int status = 0;
  Fields headers;
};

namespace {

FetchError classify(const error_code& ec, bool cancelled, std::string_view stage) {
  FetchError error;
  if (cancelled) {
    error.kind = TransportError::cancelled;
  } else if (ec == beast::error::timeout) {
    error.kind = TransportError::timeout;
  } else if (ec == bhttp::error::body_limit) {
    error.kind = TransportError::too_large;
  } else {
    error.kind = TransportError::io;
  }
  error.message = fmt::format("{}: {}", stage, ec.message());
  return error;
}

Status to_status(const FetchError& error) {
  switch (error.kind) {
    case TransportError::timeout:
      return timeout_error(error.message);
    case TransportError::cancelled:
      return cancelled(error.message);
    case TransportError::too_large:
      return resource_exhausted(error.message);
    default:
      return unavailable(error.message);
  }
}

struct Opened {
  std::shared_ptr<Connection> connection;
  bool reused = false;
};

// Connects (or reuses a pooled connection) and writes the request.
Task<Result<Opened>> connect_and_send(std::shared_ptr<Client::State> client, const UpstreamUrl& url,
                                      const UpstreamRequest& request, CancelGroup* cancel, bool allow_reuse,
                                      FetchError& failure) {
  const std::string key = url.text();
  Opened opened;
  if (allow_reuse) opened.connection = client->take_idle(key);
  opened.reused = opened.connection != nullptr;
  if (!opened.connection) {
    opened.connection = std::make_shared<Connection>(client->io);
    opened.connection->key = key;
    error_code ec;
    tcp::resolver resolver(client->io);
    auto endpoints = co_await resolver.async_resolve(url.host, std::to_string(url.port),
                                                     net::redirect_error(net::use_awaitable, ec));
    if (!ec) {
      if (cancel) cancel->attach(opened.connection);
      opened.connection->stream.expires_after(client->limits.connect_timeout);
      co_await opened.connection->stream.async_connect(endpoints, net::redirect_error(net::use_awaitable, ec));
    }
    if (ec) {
      failure = classify(ec, cancel && cancel->cancelled(), fmt::format("connecting to {}", key));
      if (failure.kind == TransportError::io) failure.kind = TransportError::connect;
      co_return to_status(failure);
    }
    opened.connection->stream.socket().set_option(tcp::no_delay(true), ec);
  } else if (cancel) {
    cancel->attach(opened.connection);
  }
  bhttp::request<bhttp::string_body> message;
  message.method_string(request.method);
  message.target(request.target);
  message.version(11);
  set_fields(message, request.headers);
  message.set(bhttp::field::host, fmt::format("{}:{}", url.host, url.port));
  message.keep_alive(true);
  message.body() = request.body;
  message.prepare_payload();
  error_code ec;
  opened.connection->stream.expires_after(request.timeout);
  co_await bhttp::async_write(opened.connection->stream, message, net::redirect_error(net::use_awaitable, ec));
  if (ec) {
    failure = classify(ec, cancel && cancel->cancelled(), fmt::format("sending to {}", key));
    opened.connection->close();
    co_return to_status(failure);
  }
  co_return opened;
}

// A pooled connection the server closed while idle fails on first use; such a
// failure before any response byte is retried once on a fresh connection.
bool stale_connection_error(const error_code& ec) {
  return ec == bhttp::error::end_of_stream || ec == net::error::connection_reset || ec == net::error::eof ||
         ec == net::error::broken_pipe;
}

}  // namespace

UpstreamStream::UpstreamStream(std::unique_ptr<State> state) : state_(std::move(state)) {}

UpstreamStream::~UpstreamStream() {
  if (!state_ || !state_->connection) return;
  if (state_->parser.is_done() && state_->reusable) {
    state_->client->give_back(std::move(state_->connection));
  } else {
    state_->connection->close();
  }
}

int UpstreamStream::status() const { return state_->status; }
const Fields& UpstreamStream::headers() const { return state_->headers; }

Task<Result<std::string>> UpstreamStream::next(Duration idle_timeout) {
  auto& parser = state_->parser;
  std::string out;
  if (!state_->connection) co_return unavailable("the upstream stream is closed");
  char chunk[16384];
  while (!parser.is_done()) {
    parser.get().body().data = chunk;
    parser.get().body().size = sizeof(chunk);
    error_code ec;
    state_->connection->stream.expires_after(idle_timeout);
    co_await bhttp::async_read_some(state_->connection->stream, state_->connection->buffer, parser,
                                    net::redirect_error(net::use_awaitable, ec));
    if (ec == bhttp::error::need_buffer) ec = {};
    const std::size_t got = sizeof(chunk) - parser.get().body().size;
    if (ec) {
      state_->connection->close();
      state_->connection.reset();
      co_return classify(ec, false, "reading the upstream body").kind == TransportError::timeout
          ? timeout_error("the upstream went quiet for longer than its timeout")
          : unavailable(fmt::format("reading the upstream body: {}", ec.message()));
    }
    if (got > 0) {
      out.assign(chunk, got);
      co_return out;
    }
  }
  co_return out;  // empty: the body is complete
}

Task<Result<std::string>> UpstreamStream::read_all(Duration timeout, std::size_t limit) {
  std::string body;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= Duration::zero()) co_return timeout_error("reading the upstream body timed out");
    auto piece = co_await next(std::chrono::duration_cast<Duration>(left));
    if (!piece) co_return piece.status();
    if (piece->empty()) break;
    if (body.size() + piece->size() > limit) {
      co_return resource_exhausted(fmt::format("the upstream body exceeds {} bytes", limit));
    }
    body += *piece;
  }
  co_return body;
}

Client::Client(net::io_context& io, ClientLimits limits) : state_(std::make_shared<State>(io, limits)) {}
Client::~Client() { close_idle(); }

void Client::close_idle() {
  for (auto& [key, list] : state_->idle) {
    for (auto& connection : list) connection->close();
  }
  state_->idle.clear();
}

std::size_t Client::idle_connections() const {
  std::size_t n = 0;
  for (const auto& [key, list] : state_->idle) n += list.size();
  return n;
}

Task<Result<std::unique_ptr<UpstreamStream>>> Client::open(const UpstreamUrl& url, UpstreamRequest request,
                                                           CancelGroup* cancel, FetchError* error) {
  FetchError failure;
  const auto fail = [&](Status status) -> Status {
    if (error) *error = failure;
    return status;
  };
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (cancel && cancel->cancelled()) {
      failure = {TransportError::cancelled, "cancelled"};
      co_return fail(cancelled("cancelled"));
    }
    auto opened = co_await connect_and_send(state_, url, request, cancel, attempt == 0, failure);
    if (!opened) {
      if (attempt == 0 && failure.kind == TransportError::io) continue;  // maybe a stale pooled connection
      co_return fail(opened.status());
    }
    auto state = std::make_unique<UpstreamStream::State>();
    state->client = state_;
    state->connection = opened->connection;
    state->parser.body_limit(std::numeric_limits<std::uint64_t>::max());
    error_code ec;
    co_await bhttp::async_read_header(state->connection->stream, state->connection->buffer, state->parser,
                                      net::redirect_error(net::use_awaitable, ec));
    if (ec) {
      state->connection->close();
      if (opened->reused && stale_connection_error(ec)) continue;
      failure = classify(ec, cancel && cancel->cancelled(), fmt::format("reading the response of {}", url.text()));
      co_return fail(to_status(failure));
    }
    const auto& head = state->parser.get();
    state->status = static_cast<int>(head.result_int());
    state->headers = fields_of(head);
    state->reusable = head.keep_alive();
    co_return std::make_unique<UpstreamStream>(std::move(state));
  }
  co_return fail(unavailable("unreachable"));
}

Task<Result<ClientResponse>> Client::fetch(const UpstreamUrl& url, UpstreamRequest request, CancelGroup* cancel,
                                           FetchError* error) {
  const auto deadline = std::chrono::steady_clock::now() + request.timeout;
  const auto timeout = request.timeout;
  auto stream = co_await open(url, std::move(request), cancel, error);
  if (!stream) co_return stream.status();
  ClientResponse response;
  response.status = (*stream)->status();
  response.headers = (*stream)->headers();
  const auto left = std::min<Duration>(timeout, deadline - std::chrono::steady_clock::now());
  auto body = co_await (*stream)->read_all(left, state_->limits.max_response_bytes);
  if (!body) {
    if (error) {
      error->kind = body.status().code() == StatusCode::timeout ? TransportError::timeout : TransportError::io;
      error->message = body.status().message();
    }
    co_return body.status();
  }
  response.body = std::move(*body);
  co_return response;
}

}  // namespace ecx::proxy::http
