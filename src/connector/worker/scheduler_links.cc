#include "ecx/connector/worker/scheduler_links.h"

#include <algorithm>
#include <iterator>
#include <mutex>
#include <unordered_map>

#include "core/logging.h"
#include "ecx/control/event_inbox.h"
#include "ecx/core/metrics.h"
#include "ecx/core/stages.h"
#include "ecx/store/store_config.h"

namespace ecx::worker {
namespace {

scheduler::TransferEvent to_scheduler(const wire::Event& e) {
  scheduler::TransferEvent out;
  switch (e.kind) {
    case wire::EventKind::ready:
      out.kind = scheduler::TransferEvent::Kind::ready;
      break;
    case wire::EventKind::abandoned:
      out.kind = scheduler::TransferEvent::Kind::abandoned;
      break;
    case wire::EventKind::failed:
      out.kind = scheduler::TransferEvent::Kind::failed;
      break;
  }
  out.transfer_id = e.transfer_id;
  out.mm_hash = e.mm_hash;
  out.shard = static_cast<int>(e.shard);
  out.spec = e.spec;
  out.reservation_id = e.reservation_id;
  out.reason = e.error.message();
  if (e.sent_ns != 0) {
    // Signed: a publisher on another host (its clock unrelated) gives nonsense, dropped.
    const auto elapsed = static_cast<std::int64_t>(stages::monotonic_ns() - e.sent_ns);
    if (elapsed < std::int64_t{3'600'000'000'000}) stages::record(stages::Stage::event_delivery, Duration{elapsed});
  }
  return out;
}

// Keeps the client alive as long as the inbox that borrows it.
class InboxEventSource final : public scheduler::EventSource {
 public:
  InboxEventSource(std::shared_ptr<control::ControlClient> client, std::unique_ptr<control::EventInbox> inbox)
      : client_(std::move(client)), inbox_(std::move(inbox)) {}

  // Hands on at most `max_events`; what the inbox delivered beyond that waits in
  // buffer_ for the next call (the inbox's own bound, max_events_per_drain, keeps
  // buffer_ bounded: it is refilled only once it is empty).
  std::size_t drain(std::vector<scheduler::TransferEvent>& out, std::size_t max_events) override {
    if (!inbox_) return 0;
    std::size_t appended = 0;
    while (appended < max_events) {
      if (next_ == buffer_.size()) {
        buffer_.clear();
        next_ = 0;
        if (inbox_->drain(buffer_) == 0) break;
      }
      for (; next_ < buffer_.size() && appended < max_events; ++next_, ++appended) {
        out.push_back(to_scheduler(buffer_[next_]));
      }
    }
    return appended;
  }
  bool wait(Duration max_wait, std::span<const WakeSource> also) override {
    if (next_ < buffer_.size()) return true;
    return inbox_ && inbox_->wait(max_wait, also);
  }
  int shard_count() const override { return inbox_ ? static_cast<int>(inbox_->shard_count()) : 0; }
  void close() override {
    if (inbox_) closed_counters_ = subscription_counters();
    inbox_.reset();
  }
  scheduler::SubscriptionCounters subscription_counters() const override {
    if (!inbox_) return closed_counters_;
    const control::InboxCounters c = inbox_->counters();
    return scheduler::SubscriptionCounters{c.malformed, c.unknown, c.auth_failures, c.discoveries_started,
                                           c.discoveries_failed};
  }

 private:
  std::shared_ptr<control::ControlClient> client_;
  std::unique_ptr<control::EventInbox> inbox_;
  scheduler::SubscriptionCounters closed_counters_;  // as of close()
  std::vector<wire::Event> buffer_;
  std::size_t next_ = 0;  // first event of buffer_ not handed on yet
};

class ClientConsumerControl final : public scheduler::ConsumerControl {
 public:
  ClientConsumerControl(std::shared_ptr<control::ControlClient> client, Duration timeout)
      : client_(std::move(client)), timeout_(timeout) {}

  Result<std::vector<std::string>> discover_shards(const std::string& base_address) override {
    auto topology = client_->discover(base_address, timeout_);
    if (!topology) return topology.status();
    {
      std::lock_guard lock(mutex_);
      for (const auto& shard : topology->shards) {
        batch_capable_[shard.control] = shard.hello.has_feature(wire::kFeatureCancelBatch);
      }
    }
    return topology->control_addresses();
  }
  Result<bool> cancel(const std::string& shard_address, const std::string& transfer_id) override {
    auto reply = client_->cancel(shard_address, wire::CancelRequest{transfer_id, {}, false, false}, timeout_);
    if (!reply) return reply.status();
    return reply->cancelled;
  }
  // One cancel_batch frame per kMaxPerFrame ids to a shard that announced it (a
  // shard of an older release is asked one id at a time).
  std::vector<Result<bool>> cancel_many(const std::string& shard_address,
                                        const std::vector<std::string>& transfer_ids) override {
    bool capable = false;
    {
      std::lock_guard lock(mutex_);
      const auto found = batch_capable_.find(shard_address);
      capable = found != batch_capable_.end() && found->second;
    }
    if (!capable) return ConsumerControl::cancel_many(shard_address, transfer_ids);
    std::vector<Result<bool>> answers;
    answers.reserve(transfer_ids.size());
    for (std::size_t first = 0; first < transfer_ids.size(); first += kMaxPerFrame) {
      const std::size_t end = std::min(transfer_ids.size(), first + kMaxPerFrame);
      std::vector<wire::CancelRequest> items;
      items.reserve(end - first);
      for (std::size_t i = first; i < end; ++i) items.push_back(wire::CancelRequest{transfer_ids[i], {}, false, false});
      auto reply = client_->cancel_batch(shard_address, std::move(items), timeout_);
      if (!reply && reply.status().code() == StatusCode::protocol) {
        // The shard refused the op (e.g. restarted as an older release that does not
        // know it): ask it one id at a time from now on.
        {
          std::lock_guard lock(mutex_);
          batch_capable_[shard_address] = false;
        }
        const std::vector<std::string> rest(transfer_ids.begin() + static_cast<std::ptrdiff_t>(first),
                                            transfer_ids.end());
        auto one_by_one = ConsumerControl::cancel_many(shard_address, rest);
        std::move(one_by_one.begin(), one_by_one.end(), std::back_inserter(answers));
        return answers;
      }
      for (std::size_t i = first; i < end; ++i) {
        if (!reply) {
          answers.emplace_back(reply.status());
        } else if (const auto& item = reply->items[i - first]; !item.error.is_ok()) {
          answers.emplace_back(item.error);
        } else {
          answers.emplace_back(item.cancelled);
        }
      }
    }
    return answers;
  }
  Result<ShardTransfer> transfer_status(const std::string& shard_address, const std::string& transfer_id) override {
    auto reply = client_->status(shard_address, transfer_id, timeout_);
    if (!reply) return reply.status();
    return ShardTransfer{reply->found, std::move(reply->state), std::move(reply->mm_hash), reply->spec,
                         reply->reservation_id};
  }
  // Shutdown: the calls in flight (a shard that is gone answers nothing) end now.
  void close() override { client_->close(); }

 private:
  // 256 ids of at most 256 bytes stay well inside the default max_frame_bytes (1 MiB).
  static constexpr std::size_t kMaxPerFrame = 256;
  std::shared_ptr<control::ControlClient> client_;
  Duration timeout_;
  std::mutex mutex_;                                     // executor threads discover and cancel concurrently
  std::unordered_map<std::string, bool> batch_capable_;  // by shard address, from its hello; guarded by mutex_
};

}  // namespace

std::shared_ptr<scheduler::EventSource> make_event_source(std::shared_ptr<control::ControlClient> client,
                                                          const Config& config, std::shared_ptr<const Clock> clock) {
  control::InboxOptions options;
  options.base_address = config.control_address(0);
  options.discovery_timeout = config.control_timeout();
  options.max_events_per_drain = static_cast<std::size_t>(config.event_queue_max);
  options.limits.max_frame_bytes = static_cast<std::size_t>(config.max_frame_bytes);
  options.auth_secret = config.auth_secret;
  options.clock = std::move(clock);
  auto inbox = control::EventInbox::create(*client, std::move(options));
  if (!inbox) {
    ecx::log::get("worker")->error("cannot create the event inbox: {}", inbox.status().to_string());
    return std::make_shared<InboxEventSource>(std::move(client), nullptr);
  }
  return std::make_shared<InboxEventSource>(std::move(client), std::move(*inbox));
}

std::shared_ptr<scheduler::ConsumerControl> make_consumer_control(std::shared_ptr<control::ControlClient> client,
                                                                  Duration timeout) {
  return std::make_shared<ClientConsumerControl>(std::move(client), timeout);
}

namespace {

class IndexPresence final : public scheduler::StorePresence {
 public:
  explicit IndexPresence(std::unique_ptr<store::PresenceIndex> index)
      : index_(std::move(index)), collector_(index_->export_metrics(metrics::Registry::global())) {}
  ~IndexPresence() override { metrics::Registry::global().remove_collector(collector_); }
  IndexPresence(const IndexPresence&) = delete;
  IndexPresence& operator=(const IndexPresence&) = delete;
  bool present(std::string_view mm_hash) override { return index_->present(mm_hash); }
  void forget(std::string_view mm_hash) override { index_->forget(mm_hash); }

 private:
  std::unique_ptr<store::PresenceIndex> index_;
  std::uint64_t collector_;
};

}  // namespace

Result<std::shared_ptr<scheduler::StorePresence>> make_store_presence(const Config& config,
                                                                      std::shared_ptr<const Clock> clock) {
  auto index = store::open_presence_index(config, std::move(clock));
  if (!index) return index.status();
  return std::shared_ptr<scheduler::StorePresence>(std::make_shared<IndexPresence>(std::move(*index)));
}

Result<std::unique_ptr<scheduler::SchedulerCoordinator>> make_scheduler_coordinator(
    const Config& config, DType model_dtype, std::int64_t model_hidden_width, std::shared_ptr<const Clock> clock) {
  auto options = scheduler::CoordinatorOptions::from_config(config, model_dtype, model_hidden_width);
  std::shared_ptr<scheduler::EventSource> events;
  std::shared_ptr<scheduler::ConsumerControl> control;
  if (config.is_consumer()) {
    auto client_options = control::ClientOptions::from_config(config);
    client_options.clock = clock;
    client_options.name = "ecx-scheduler";
    auto client = control::ControlClient::create(std::move(client_options));
    if (!client) return client.status();
    std::shared_ptr<control::ControlClient> shared_client = std::move(*client);
    events = make_event_source(shared_client, config, clock);
    control = make_consumer_control(shared_client, config.control_timeout());
  }
  std::shared_ptr<scheduler::StorePresence> presence;
  if (config.cross_encoder_cache) {
    auto made = make_store_presence(config, clock);
    if (!made) return made.status();
    presence = std::move(*made);
  }
  auto coordinator = std::make_unique<scheduler::SchedulerCoordinator>(std::move(options), std::move(clock),
                                                                       std::move(events), std::move(control));
  if (presence) coordinator->set_store_presence(std::move(presence));
  return coordinator;
}

}  // namespace ecx::worker
