// The Redis backend of the embedding store: one blocking hiredis connection with
// connect and I/O timeouts, serialised by a mutex. A failed connection is dropped and
// not retried before reconnect_interval_s, so a store that is down costs callers a
// fast error, not a timeout each.

#include <hiredis/hiredis.h>
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "ecx/core/logging.h"
#include "ecx/store/embedding_store.h"
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

// One command's arguments, each a byte string (binary-safe).
struct Command {
  std::vector<const char*> argv;
  std::vector<std::size_t> lengths;
  Command& arg(std::string_view a) {
    argv.push_back(a.data());
    lengths.push_back(a.size());
    return *this;
  }
};

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
    std::lock_guard lock(mutex_);
    counters_.lookups += keys.size();
    std::vector<Command> commands(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) commands[i].arg("EXISTS").arg(keys[i]);
    auto replies = pipeline(commands);
    if (!replies) return replies.status();
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
    Command get;
    get.arg("GET").arg(*key);
    auto replies = pipeline({&get, 1});
    if (!replies) return replies.status();
    const redisReply& r = *replies->front();
    if (r.type == REDIS_REPLY_NIL) return not_found(fmt::format("no entry for {} in {}", mm_hash, describe()));
    if (r.type != REDIS_REPLY_STRING) return fail(protocol_error(fmt::format("GET answered type {}", r.type)));
    const std::string_view value(r.str, r.len);
    auto header = detail::decode_entry_header(value, o_.keys.model, o_.max_entry_bytes);
    if (!header) return reject(*key, mm_hash, header.status());
    const std::string_view payload = value.substr(header->header_bytes);
    if (XXH64(payload.data(), payload.size(), 0) != header->checksum) {
      return reject(*key, mm_hash, protocol_error("entry payload does not match its checksum"));
    }
    auto out = land(header->spec);
    if (!out) return out.status();
    if (out->size() != payload.size()) {
      return invalid_argument(
          fmt::format("the landing for {} has {} bytes, the entry {}", mm_hash, out->size(), payload.size()));
    }
    std::memcpy(out->data(), payload.data(), payload.size());
    counters_.bytes_loaded += payload.size();
    return Entry{header->spec, header->checksum};
  }

  Status put(std::string_view mm_hash, const TensorSpec& spec, std::span<const std::byte> payload) override {
    auto key = o_.keys.key(mm_hash);
    if (!key) return key.status();
    if (payload.size() != spec.nbytes()) {
      return invalid_argument(fmt::format("payload of {} bytes for {}", payload.size(), spec.to_string()));
    }
    if (spec.nbytes() > o_.max_entry_bytes) {
      return invalid_argument(
          fmt::format("{} is larger than max_entry_bytes {}", spec.to_string(), o_.max_entry_bytes));
    }
    std::string value = detail::encode_entry_header(o_.keys.model, spec, XXH64(payload.data(), payload.size(), 0));
    value.append(reinterpret_cast<const char*>(payload.data()), payload.size());
    const std::string ttl_ms = std::to_string(std::max<long long>(1, std::llround(o_.ttl_s * 1000)));
    std::lock_guard lock(mutex_);
    Command set;
    set.arg("SET").arg(*key).arg(value).arg("PX").arg(ttl_ms);
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

  std::string describe() const override { return fmt::format("redis tcp://{}:{}/{}", o_.host, o_.port, o_.database); }

 private:
  // Sends every command in one write and reads every reply; on any failure the
  // connection is dropped (hiredis cannot resynchronise a half-read pipeline).
  Result<std::vector<ReplyPtr>> pipeline(std::span<const Command> commands) {
    if (Status s = connect(); !s) return s;
    for (const Command& c : commands) {
      if (redisAppendCommandArgv(context_.get(), static_cast<int>(c.argv.size()),
                                 const_cast<const char**>(c.argv.data()), c.lengths.data()) != REDIS_OK) {
        return drop("could not queue a command");
      }
    }
    std::vector<ReplyPtr> replies;
    replies.reserve(commands.size());
    for (std::size_t i = 0; i < commands.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(context_.get(), &raw) != REDIS_OK || raw == nullptr) return drop("no reply");
      replies.emplace_back(static_cast<redisReply*>(raw));
    }
    return replies;
  }

  Status connect() {
    if (context_) return Status::ok();
    const TimePoint now = clock_->now();
    if (now < retry_at_) {
      ++counters_.errors;
      return unavailable(fmt::format("{} is unreachable ({}); next attempt in {:.0f} ms", describe(), last_error_,
                                     std::chrono::duration<double, std::milli>(retry_at_ - now).count()));
    }
    ContextPtr c(redisConnectWithTimeout(o_.host.c_str(), o_.port, to_timeval(o_.connect_timeout_s)));
    if (!c || c->err != 0) {
      last_error_ = c ? c->errstr : "out of memory";
      return down(unavailable(fmt::format("cannot connect to {}: {}", describe(), last_error_)));
    }
    if (redisSetTimeout(c.get(), to_timeval(o_.io_timeout_s)) != REDIS_OK) {
      last_error_ = c->errstr;
      return down(unavailable(fmt::format("cannot set the I/O timeout on {}: {}", describe(), last_error_)));
    }
    auto expect_ok = [&](Command cmd, std::string_view what) -> Status {
      ReplyPtr r(static_cast<redisReply*>(
          redisCommandArgv(c.get(), static_cast<int>(cmd.argv.size()), cmd.argv.data(), cmd.lengths.data())));
      if (!r) return unavailable(fmt::format("{} failed on {}: {}", what, describe(), c->errstr));
      if (r->type == REDIS_REPLY_ERROR)
        return unavailable(fmt::format("{} refused by {}: {}", what, describe(), r->str));
      return Status::ok();
    };
    if (!o_.password.empty()) {
      if (Status s = expect_ok(Command{}.arg("AUTH").arg(o_.password), "AUTH"); !s) {
        last_error_ = s.message();
        return down(s);
      }
    }
    if (o_.database != 0) {
      const std::string db = std::to_string(o_.database);
      if (Status s = expect_ok(Command{}.arg("SELECT").arg(db), "SELECT"); !s) {
        last_error_ = s.message();
        return down(s);
      }
    }
    if (was_down_) log_->info("{} reachable again", describe());
    was_down_ = false;
    context_ = std::move(c);
    return Status::ok();
  }

  Status down(Status why) {
    ++counters_.errors;
    retry_at_ = clock_->now() + seconds_to_duration(o_.reconnect_interval_s);
    if (!was_down_) log_->warn("{}; calls fail fast for {} s between attempts", why.message(), o_.reconnect_interval_s);
    was_down_ = true;
    return why;
  }

  Status drop(std::string_view what) {
    const bool timed_out = context_->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK);
    last_error_ = fmt::format("{}: {}", what, context_->errstr);
    context_.reset();
    Status why = timed_out ? timeout_error(fmt::format("{} did not answer within {} s", describe(), o_.io_timeout_s))
                           : unavailable(fmt::format("{} failed: {}", describe(), last_error_));
    return down(std::move(why));
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
};

}  // namespace

Result<std::unique_ptr<EmbeddingStore>> open_redis_store(RedisOptions options) {
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
  return std::unique_ptr<EmbeddingStore>(std::make_unique<RedisStore>(std::move(options)));
}

}  // namespace ecx::store
