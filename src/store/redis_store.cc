// The Redis backend of the embedding store: one hiredis connection, serialised by a
// mutex. hiredis connects (bounded by connect_timeout_s) and parses replies; the
// socket is non-blocking and ECX does its own I/O on it, so that a whole round trip
// is bounded by one deadline (io_timeout_s on the injected clock, each wait a poll
// with what is left) and a server that went away is an error value, never a SIGPIPE.
// A failed connection is dropped and not retried before reconnect_interval_s, so a
// store that is down costs callers a fast error, not a timeout each.

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <mutex>

#include <fmt/format.h>

#include "core/logging.h"
#include "ecx/store/embedding_store.h"
#include "ecx/store/presence_index.h"
#include "store/entry_format.h"

namespace ecx::store {
namespace {

struct ContextFree {
  void operator()(redisContext* c) const noexcept { redisFree(c); }
};
struct ReplyFree {
  void operator()(redisReply* r) const noexcept { freeReplyObject(r); }
};
using ContextPtr = std::unique_ptr<redisContext, ContextFree>;
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

timeval to_timeval(double seconds) {
  const auto micros = static_cast<long long>(std::llround(seconds * 1e6));
  return timeval{static_cast<time_t>(micros / 1000000), static_cast<suseconds_t>(micros % 1000000)};
}

// One command. An argument may be several byte pieces sent back to back (a stored
// value is its header, then the caller's payload, without copying the payload).
struct Command {
  struct Arg {
    std::string_view head;
    std::string_view tail;
  };
  std::vector<Arg> args;
  Command& arg(std::string_view a, std::string_view tail = {}) {
    args.push_back(Arg{a, tail});
    return *this;
  }
};

// The RESP bytes of `commands` as iovecs; `framing` owns the "*N" / "$len" lines.
std::vector<iovec> frame(std::span<const Command> commands, std::deque<std::string>& framing) {
  std::vector<iovec> out;
  auto add = [&out](std::string_view bytes) {
    if (!bytes.empty()) out.push_back(iovec{const_cast<char*>(bytes.data()), bytes.size()});
  };
  for (const Command& c : commands) {
    add(framing.emplace_back(fmt::format("*{}\r\n", c.args.size())));
    for (const Command::Arg& a : c.args) {
      add(framing.emplace_back(fmt::format("${}\r\n", a.head.size() + a.tail.size())));
      add(a.head);
      add(a.tail);
      add("\r\n");
    }
  }
  return out;
}

constexpr std::size_t kMaxIovPerSend = 512;  // below Linux's IOV_MAX (1024)
constexpr std::size_t kRecvChunk = std::size_t{1} << 18;
// Bounds on what one round trip may read: a GET brings one entry (header, model and
// shape are far below 64 KiB); anything else brings short replies.
constexpr std::uint64_t kEntryOverheadBytes = std::uint64_t{64} << 10;
constexpr std::uint64_t kSmallReplyBytes = std::uint64_t{1} << 20;

// Waits until `fd` is ready for `events` or the deadline passes (timeout). With a
// manual clock the deadline never moves, so each wait then lasts until the deadline
// measured when it started, at most.
Status wait_ready(int fd, short events, const Clock& clock, TimePoint deadline) {
  for (;;) {
    const auto left = deadline - clock.now();
    if (left <= Duration::zero()) return timeout_error("deadline passed");
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(ms, 1'000'000)));
    if (rc > 0) return Status::ok();  // ready, or an error the next send/recv reports
    if (rc == 0) return timeout_error("deadline passed");
    if (errno != EINTR) return unavailable(fmt::format("poll: {}", errno_text(errno)));
  }
}

Status send_commands(redisContext& c, std::span<const Command> commands, const Clock& clock, TimePoint deadline) {
  std::deque<std::string> framing;
  std::vector<iovec> iov = frame(commands, framing);
  std::size_t next = 0;
  while (next < iov.size()) {
    msghdr msg{};
    msg.msg_iov = &iov[next];
    msg.msg_iovlen = std::min(iov.size() - next, kMaxIovPerSend);
    const ssize_t n = ::sendmsg(c.fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (Status s = wait_ready(c.fd, POLLOUT, clock, deadline); !s) return s;
        continue;
      }
      return unavailable(fmt::format("send: {}", errno_text(errno)));
    }
    auto sent = static_cast<std::size_t>(n);
    while (next < iov.size() && sent >= iov[next].iov_len) sent -= iov[next++].iov_len;
    if (sent > 0) {
      iov[next].iov_base = static_cast<char*>(iov[next].iov_base) + sent;
      iov[next].iov_len -= sent;
    }
  }
  return Status::ok();
}

// The next reply, read within the deadline; `received` counts the bytes read for it
// and the replies before it (at most max_reply_bytes in all). A timeout leaves the
// reader consistent: what arrived is kept for the next call.
Result<ReplyPtr> read_reply(redisContext& c, const Clock& clock, TimePoint deadline, std::uint64_t& received,
                            std::uint64_t max_reply_bytes, std::vector<char>& buffer) {
  for (;;) {
    void* raw = nullptr;
    if (redisReaderGetReply(c.reader, &raw) != REDIS_OK) {
      return protocol_error(fmt::format("unreadable reply: {}", c.reader->errstr));
    }
    if (raw != nullptr) return ReplyPtr(static_cast<redisReply*>(raw));
    const ssize_t n = ::recv(c.fd, buffer.data(), buffer.size(), 0);
    if (n > 0) {
      received += static_cast<std::uint64_t>(n);
      if (received > max_reply_bytes) {
        return protocol_error(fmt::format("reply is longer than the {} bytes expected", max_reply_bytes));
      }
      if (redisReaderFeed(c.reader, buffer.data(), static_cast<std::size_t>(n)) != REDIS_OK) {
        return protocol_error(fmt::format("unreadable reply: {}", c.reader->errstr));
      }
    } else if (n == 0) {
      return unavailable("the server closed the connection");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (Status s = wait_ready(c.fd, POLLIN, clock, deadline); !s) return s;
    } else if (errno != EINTR) {
      return unavailable(fmt::format("recv: {}", errno_text(errno)));
    }
  }
}

// Sends every command and reads every reply within the deadline.
Result<std::vector<ReplyPtr>> redis_exchange(redisContext& c, std::span<const Command> commands, const Clock& clock,
                                             TimePoint deadline, std::uint64_t max_reply_bytes,
                                             std::vector<char>& buffer) {
  if (Status s = send_commands(c, commands, clock, deadline); !s) return s;
  std::vector<ReplyPtr> replies;
  replies.reserve(commands.size());
  std::uint64_t received = 0;
  while (replies.size() < commands.size()) {
    auto r = read_reply(c, clock, deadline, received, max_reply_bytes, buffer);
    if (!r) return r.status();
    replies.push_back(std::move(*r));
  }
  return replies;
}

// Connects (bounded by connect_timeout_s), makes the socket non-blocking, and
// authenticates and selects the database.
Result<ContextPtr> open_connection(const RedisOptions& o, const Clock& clock, std::vector<char>& buffer) {
  ContextPtr c(redisConnectWithTimeout(o.host.c_str(), o.port, to_timeval(o.connect_timeout_s)));
  if (!c || c->err != 0) return unavailable(c ? std::string(c->errstr) : std::string("out of memory"));
  const int flags = ::fcntl(c->fd, F_GETFL);
  if (flags < 0 || ::fcntl(c->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    return unavailable(fmt::format("cannot make the socket non-blocking: {}", errno_text(errno)));
  }
  std::vector<Command> hello;
  if (!o.password.empty()) hello.push_back(Command{}.arg("AUTH").arg(o.password));
  const std::string db = std::to_string(o.database);
  if (o.database != 0) hello.push_back(Command{}.arg("SELECT").arg(db));
  if (hello.empty()) return c;
  auto replies =
      redis_exchange(*c, hello, clock, clock.now() + seconds_to_duration(o.io_timeout_s), kSmallReplyBytes, buffer);
  if (!replies) return replies.status();
  for (std::size_t i = 0; i < replies->size(); ++i) {
    if ((*replies)[i]->type == REDIS_REPLY_ERROR) {
      return unavailable(fmt::format("{} refused: {}", hello[i].args[0].head, (*replies)[i]->str));
    }
  }
  return c;
}

std::string describe_redis(const RedisOptions& o) {
  return fmt::format("redis tcp://{}:{}/{}", o.host, o.port, o.database);
}

class RedisStore final : public EmbeddingStore {
 public:
  explicit RedisStore(RedisOptions options)
      : o_(std::move(options)), clock_(o_.clock ? o_.clock : std::make_shared<SteadyClock>()) {}

  Result<std::vector<bool>> contains(std::span<const std::string> mm_hashes) override {
    std::vector<std::string> keys;
    keys.reserve(mm_hashes.size());
    for (const auto& h : mm_hashes) {
      auto k = o_.keys.key(h);
      if (!k) return k.status();
      keys.push_back(std::move(*k));
    }
    if (keys.empty()) return std::vector<bool>{};
    std::lock_guard lock(mutex_);
    counters_.lookups += keys.size();
    std::vector<Command> commands(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) commands[i].arg("EXISTS").arg(keys[i]);
    auto replies = pipeline(commands, kSmallReplyBytes + 64 * std::uint64_t{keys.size()});
    if (!replies) return replies.status();
    for (const auto& r : *replies) {
      if (r->type == REDIS_REPLY_ERROR)
        return fail(unavailable(fmt::format("{} refused EXISTS: {}", describe(), r->str)));
    }
    std::vector<bool> out;
    out.reserve(keys.size());
    for (const auto& r : *replies) {
      const bool present = r->type == REDIS_REPLY_INTEGER && r->integer > 0;
      out.push_back(present);
      ++(present ? counters_.hits : counters_.misses);
    }
    return out;
  }

  Result<Entry> get_into(std::string_view mm_hash, const Landing& land) override {
    auto key = o_.keys.key(mm_hash);
    if (!key) return key.status();
    std::lock_guard lock(mutex_);
    ++counters_.gets;
    // STRLEN, then at most one entry's worth of the value: a value too large to be an
    // entry (another writer's, say) is refused without reading it whole.
    const std::uint64_t limit = o_.max_entry_bytes + kEntryOverheadBytes;
    const std::string last = std::to_string(limit);  // GETRANGE's end is inclusive: limit + 1 bytes
    Command get[2];
    get[0].arg("STRLEN").arg(*key);
    get[1].arg("GETRANGE").arg(*key).arg("0").arg(last);
    auto replies = pipeline(get, limit + kSmallReplyBytes);
    if (!replies) return replies.status();
    const redisReply& length = *(*replies)[0];
    const redisReply& r = *(*replies)[1];
    if (length.type != REDIS_REPLY_INTEGER || r.type != REDIS_REPLY_STRING) {
      const redisReply& bad = length.type != REDIS_REPLY_INTEGER ? length : r;
      return fail(unavailable(fmt::format(
          "{} answered a read of {} with {}", describe(), mm_hash,
          bad.type == REDIS_REPLY_ERROR ? std::string(bad.str, bad.len) : fmt::format("reply type {}", bad.type))));
    }
    // A missing key reads as length 0 (an empty value is no entry either).
    if (length.integer == 0) return not_found(fmt::format("no entry for {} in {}", mm_hash, describe()));
    if (static_cast<std::uint64_t>(length.integer) > limit) {
      return reject(*key, mm_hash,
                    protocol_error(fmt::format("entry of {} bytes is over max_entry_bytes {}", length.integer,
                                               o_.max_entry_bytes)));
    }
    const std::string_view value(r.str, r.len);
    bool refused = false;
    auto entry = detail::check_and_land(value, o_.keys.model, o_.max_entry_bytes, mm_hash, land, refused);
    if (!entry) return refused ? reject(*key, mm_hash, entry.status()) : entry.status();
    counters_.bytes_loaded += entry->spec.nbytes();
    return entry;
  }

  Status put(std::string_view mm_hash, const TensorSpec& spec, std::span<const std::byte> payload) override {
    auto key = o_.keys.key(mm_hash);
    if (!key) return key.status();
    auto encoded = detail::header_for(o_.keys.model, spec, payload, o_.max_entry_bytes);
    if (!encoded) return encoded.status();
    const std::string& header = *encoded;
    const std::string_view body(reinterpret_cast<const char*>(payload.data()), payload.size());
    const std::string ttl_ms = std::to_string(std::max<long long>(1, std::llround(o_.ttl_s * 1000)));
    std::lock_guard lock(mutex_);
    Command set;
    set.arg("SET").arg(*key).arg(header, body).arg("PX").arg(ttl_ms);
    auto replies = pipeline({&set, 1});
    if (!replies) return replies.status();
    const redisReply& r = *replies->front();
    if (r.type == REDIS_REPLY_ERROR) return fail(unavailable(fmt::format("{} refused SET: {}", describe(), r.str)));
    ++counters_.puts;
    counters_.bytes_published += payload.size();
    return Status::ok();
  }

  StoreCounters counters() const override {
    std::lock_guard lock(mutex_);
    return counters_;
  }

  std::string describe() const override { return describe_redis(o_); }

 private:
  // Sends every command and reads every reply within one io_timeout_s; on any failure
  // the connection is dropped (a half-read pipeline cannot be resynchronised).
  // Replies longer than `max_reply_bytes` in all are refused (a value that is not
  // ours may be any size; it is not buffered whole).
  Result<std::vector<ReplyPtr>> pipeline(std::span<const Command> commands,
                                         std::uint64_t max_reply_bytes = kSmallReplyBytes) {
    if (Status s = connect(); !s) return s;
    auto replies = exchange(*context_, commands, clock_->now() + seconds_to_duration(o_.io_timeout_s), max_reply_bytes);
    if (!replies) return drop(replies.status());
    return replies;
  }

  Result<std::vector<ReplyPtr>> exchange(redisContext& c, std::span<const Command> commands, TimePoint deadline,
                                         std::uint64_t max_reply_bytes) {
    return redis_exchange(c, commands, *clock_, deadline, max_reply_bytes, recv_buffer_);
  }

  Status connect() {
    if (context_) return Status::ok();
    const TimePoint now = clock_->now();
    if (now < retry_at_) {
      ++counters_.errors;
      return unavailable(fmt::format("{} is unreachable ({}); next attempt in {:.0f} ms", describe(), last_error_,
                                     std::chrono::duration<double, std::milli>(retry_at_ - now).count()));
    }
    auto c = open_connection(o_, *clock_, recv_buffer_);
    if (!c) {
      last_error_ = c.status().message();
      return down(unavailable(fmt::format("cannot connect to {}: {}", describe(), last_error_)));
    }
    if (was_down_) log_->info("{} reachable again", describe());
    was_down_ = false;
    context_ = std::move(*c);
    return Status::ok();
  }

  Status down(Status why) {
    ++counters_.errors;
    retry_at_ = clock_->now() + seconds_to_duration(o_.reconnect_interval_s);
    if (!was_down_) log_->warn("{}; calls fail fast for {} s between attempts", why.message(), o_.reconnect_interval_s);
    was_down_ = true;
    return why;
  }

  // A round trip failed: the connection is closed and the failure counted.
  Status drop(const Status& why) {
    last_error_ = why.message();
    context_.reset();
    if (why.code() == StatusCode::timeout) {
      return down(timeout_error(fmt::format("{} did not answer within {} s", describe(), o_.io_timeout_s)));
    }
    return down(Status(why.code(), fmt::format("{} failed: {}", describe(), why.message())));
  }

  Status fail(Status why) {
    ++counters_.errors;
    return why;
  }

  // A corrupt, truncated or foreign entry: count it, delete it (best effort) so an
  // encoder writes a good one, and tell the caller to encode.
  Status reject(const std::string& key, std::string_view mm_hash, const Status& why) {
    ++counters_.rejected;
    log_->warn("refused the stored entry for {} in {}: {}", mm_hash, describe(), why.message());
    Command del;
    del.arg("DEL").arg(key);
    (void)pipeline({&del, 1});
    return protocol_error(fmt::format("stored entry for {} refused: {}", mm_hash, why.message()));
  }

  const RedisOptions o_;
  const std::shared_ptr<const Clock> clock_;
  std::shared_ptr<spdlog::logger> log_ = ecx::log::get("store");

  mutable std::mutex mutex_;  // guards everything below
  ContextPtr context_;
  TimePoint retry_at_{};
  std::string last_error_;
  bool was_down_ = false;
  StoreCounters counters_;
  std::vector<char> recv_buffer_ = std::vector<char>(kRecvChunk);
};

// Redis keyspace notifications for one key space, on a connection of its own (a
// subscribed connection can do nothing else). Its waits are real time: it runs on a
// background thread that must notice stop requests whatever the injected clock does.
class RedisFeed final : public PresenceFeed {
 public:
  explicit RedisFeed(RedisOptions options)
      : o_(std::move(options)),
        channel_prefix_(fmt::format("__keyspace@{}__:{}:{}:", o_.database, o_.keys.prefix, o_.keys.model)) {}

  Result<std::optional<PresenceEvent>> next(std::chrono::milliseconds wait) override {
    if (!context_) {
      if (Status s = subscribe(); !s) return s;
      return std::optional<PresenceEvent>(PresenceEvent{PresenceEvent::Kind::resync, {}});
    }
    std::uint64_t received = 0;
    auto reply = read_reply(*context_, clock_, clock_.now() + wait, received, kSmallReplyBytes, buffer_);
    if (!reply) {
      if (reply.status().code() == StatusCode::timeout) return std::optional<PresenceEvent>();
      return drop(reply.status());
    }
    const redisReply& r = **reply;
    // ["pmessage", pattern, channel, event]
    if (r.type != REDIS_REPLY_ARRAY) return std::optional<PresenceEvent>();  // RESP2: messages are arrays
    if (r.elements != 4 || r.element[2]->type != REDIS_REPLY_STRING || r.element[3]->type != REDIS_REPLY_STRING) {
      return std::optional<PresenceEvent>();
    }
    const std::string_view channel(r.element[2]->str, r.element[2]->len);
    const std::string_view event(r.element[3]->str, r.element[3]->len);
    if (!channel.starts_with(channel_prefix_)) return std::optional<PresenceEvent>();
    PresenceEvent e;
    e.mm_hash = std::string(channel.substr(channel_prefix_.size()));
    if (event == "set") {
      e.kind = PresenceEvent::Kind::present;
    } else if (event == "del" || event == "expired" || event == "evicted" || event == "rename_from" ||
               event == "getdel" || event == "unlink") {
      e.kind = PresenceEvent::Kind::gone;
    } else {
      return std::optional<PresenceEvent>();  // setrange, expire, ...: presence unchanged
    }
    return std::optional<PresenceEvent>(std::move(e));
  }

  std::string describe() const override { return describe_redis(o_) + " keyspace notifications"; }

 private:
  Status subscribe() {
    const TimePoint now = clock_.now();
    if (now < retry_at_) return unavailable(fmt::format("{} is down: {}", describe(), last_error_));
    auto c = open_connection(o_, clock_, buffer_);
    if (!c) return down(c.status());
    const TimePoint deadline = clock_.now() + seconds_to_duration(o_.io_timeout_s);
    Command config;
    config.arg("CONFIG").arg("GET").arg("notify-keyspace-events");
    auto flags = redis_exchange(**c, {&config, 1}, clock_, deadline, kSmallReplyBytes, buffer_);
    if (!flags) return down(flags.status());
    warn_unless_notifying(*flags->front());
    // The key space's fields hold no ':' or spaces, but may hold glob characters.
    std::string pattern;
    for (char ch : channel_prefix_) {
      if (ch == '*' || ch == '?' || ch == '[' || ch == ']' || ch == '\\') pattern += '\\';
      pattern += ch;
    }
    pattern += '*';
    Command psubscribe;
    psubscribe.arg("PSUBSCRIBE").arg(pattern);
    auto confirmed = redis_exchange(**c, {&psubscribe, 1}, clock_, deadline, kSmallReplyBytes, buffer_);
    if (!confirmed) return down(confirmed.status());
    if (confirmed->front()->type == REDIS_REPLY_ERROR) {
      return down(unavailable(fmt::format("PSUBSCRIBE refused: {}", confirmed->front()->str)));
    }
    context_ = std::move(*c);
    if (was_down_) log_->info("{} connected again", describe());
    was_down_ = false;
    return Status::ok();
  }

  // Keyspace events must be on for sets, deletions, expiries and evictions.
  void warn_unless_notifying(const redisReply& r) {
    if (warned_ || r.type != REDIS_REPLY_ARRAY || r.elements != 2 || r.element[1]->type != REDIS_REPLY_STRING) return;
    const std::string_view flags(r.element[1]->str, r.element[1]->len);
    const bool all = flags.find('A') != std::string_view::npos;
    bool ok = flags.find('K') != std::string_view::npos;
    for (char needed : {'$', 'g', 'x', 'e'}) ok = ok && (all || flags.find(needed) != std::string_view::npos);
    if (ok) return;
    warned_ = true;
    log_->warn(
        "{} does not send keyspace notifications (notify-keyspace-events is '{}'; set it to 'K$gxe', e.g. "
        "redis-server --notify-keyspace-events K\\$gxe): encoders learn of each other's entries only by asking, one "
        "step late",
        describe_redis(o_), flags);
  }

  Status down(const Status& why) {
    context_.reset();
    last_error_ = why.message();
    retry_at_ = clock_.now() + seconds_to_duration(o_.reconnect_interval_s);
    if (!was_down_)
      log_->warn("{} failed: {}; retrying every {} s", describe(), why.message(), o_.reconnect_interval_s);
    was_down_ = true;
    return unavailable(fmt::format("{}: {}", describe(), why.message()));
  }
  Status drop(const Status& why) { return down(why); }

  const RedisOptions o_;
  const std::string channel_prefix_;
  SteadyClock clock_;
  std::shared_ptr<spdlog::logger> log_ = ecx::log::get("store");
  ContextPtr context_;
  TimePoint retry_at_{};
  std::string last_error_;
  bool was_down_ = false;
  bool warned_ = false;
  std::vector<char> buffer_ = std::vector<char>(std::size_t{1} << 16);
};

}  // namespace

namespace {

Status validate(const RedisOptions& options) {
  if (Status s = options.keys.validate(); !s) return s;
  if (options.host.empty()) return invalid_argument("store host is empty");
  if (options.port <= 0 || options.port > 65535) {
    return invalid_argument(fmt::format("store port {} is outside 1..65535", options.port));
  }
  if (options.database < 0) return invalid_argument(fmt::format("store database {} is negative", options.database));
  for (auto [name, value] : {std::pair{"ttl_s", options.ttl_s},
                             {"connect_timeout_s", options.connect_timeout_s},
                             {"io_timeout_s", options.io_timeout_s}}) {
    if (!(value > 0) || !std::isfinite(value)) {
      return invalid_argument(fmt::format("store {} must be a positive number of seconds, got {}", name, value));
    }
  }
  if (!(options.reconnect_interval_s >= 0)) {
    return invalid_argument(
        fmt::format("store reconnect_interval_s must be >= 0, got {}", options.reconnect_interval_s));
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<EmbeddingStore>> open_redis_store(RedisOptions options) {
  if (Status s = validate(options); !s) return s;
  return std::unique_ptr<EmbeddingStore>(std::make_unique<RedisStore>(std::move(options)));
}

Result<std::unique_ptr<PresenceFeed>> open_redis_feed(RedisOptions options) {
  if (Status s = validate(options); !s) return s;
  return std::unique_ptr<PresenceFeed>(std::make_unique<RedisFeed>(std::move(options)));
}

}  // namespace ecx::store
