#pragma once
// A loopback man-in-the-middle for one consumer shard's ZeroMQ traffic: control
// requests and replies (client DEALER -> relay ROUTER -> one DEALER per client ->
// shard ROUTER) and readiness events (shard PUSH -> relay PULL -> relay PUSH ->
// inbox PULL). Each frame may be dropped, duplicated, held back and sent after the
// next one (reordered) or have bytes flipped (corrupted), at seeded random rates.
// Hello replies are rewritten (never mangled) so discovery through the relay finds
// the relay's ports; the product is not changed in any way for this.
//
// One owned thread does all socket work; it stops and is joined in the destructor.

#include <atomic>
#include <chrono>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <zmq.hpp>

#include "ecx/wire/codec.h"

namespace ecx::fault {

struct FrameFaults {
  double drop = 0;
  double duplicate = 0;
  double reorder = 0;
  double corrupt = 0;
};

struct RelayCounters {
  std::atomic<std::uint64_t> forwarded{0}, dropped{0}, duplicated{0}, reordered{0}, corrupted{0};
};

class FrameRelay {
 public:
  // `control` and `events`: the shard's tcp:// endpoints.
  FrameRelay(std::string control, std::string events, FrameFaults faults, std::uint64_t seed)
      : control_(std::move(control)), events_(std::move(events)), faults_(faults), random_(seed) {
    for (auto* s : {&front_, &event_out_}) s->set(zmq::sockopt::linger, 0);
    event_in_.set(zmq::sockopt::linger, 0);
    front_.bind("tcp://127.0.0.1:*");
    event_out_.bind("tcp://127.0.0.1:*");
    event_in_.connect(events_);
    front_endpoint_ = front_.get(zmq::sockopt::last_endpoint);
    event_endpoint_ = event_out_.get(zmq::sockopt::last_endpoint);
    thread_ = std::thread([this] { run(); });
  }
  ~FrameRelay() {
    stop_.store(true);
    thread_.join();
  }
  FrameRelay(const FrameRelay&) = delete;
  FrameRelay& operator=(const FrameRelay&) = delete;

  // What clients connect to instead of the shard.
  const std::string& control_endpoint() const { return front_endpoint_; }
  const RelayCounters& counters() const { return counters_; }
  // Stops mangling (frames still pass), e.g. to let a test settle.
  void calm() { calm_.store(true); }

 private:
  using Message = std::vector<zmq::message_t>;
  enum class Leg { request, reply, event };
  struct Held {
    Leg leg;
    std::string identity;
    Message parts;
    std::chrono::steady_clock::time_point since;
  };

  static int port_of(const std::string& endpoint) { return std::stoi(endpoint.substr(endpoint.rfind(':') + 1)); }

  bool chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(random_) < p; }

  static Message copy(const Message& m) {
    Message out;
    for (const auto& part : m) out.emplace_back(part.data(), part.size());
    return out;
  }

  static bool receive(zmq::socket_t& socket, Message& parts) {
    parts.clear();
    while (true) {
      zmq::message_t part;
      if (!socket.recv(part, zmq::recv_flags::dontwait)) return !parts.empty();
      const bool more = part.more();
      parts.push_back(std::move(part));
      if (!more) return true;
    }
  }

  zmq::socket_t& back_for(const std::string& identity) {
    auto found = backs_.find(identity);
    if (found != backs_.end()) return found->second;
    zmq::socket_t socket(context_, zmq::socket_type::dealer);
    socket.set(zmq::sockopt::linger, 0);
    socket.connect(control_);
    return backs_.emplace(identity, std::move(socket)).first->second;
  }

  void send(Leg leg, const std::string& identity, Message parts) {
    zmq::socket_t* out = nullptr;
    if (leg == Leg::request) {
      out = &back_for(identity);
    } else if (leg == Leg::reply) {
      out = &front_;
      zmq::message_t id(identity.data(), identity.size());
      (void)out->send(id, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    } else {
      out = &event_out_;
    }
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const auto flags = (i + 1 < parts.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
      (void)out->send(parts[i], flags | zmq::send_flags::dontwait);
    }
    counters_.forwarded.fetch_add(1);
  }

  // Hello replies carry the shard's ports: point them at the relay.
  bool rewrite_hello(Message& parts) {
    if (parts.empty()) return false;
    auto& last = parts.back();
    auto reply = wire::decode_reply(std::string_view(static_cast<const char*>(last.data()), last.size()),
                                    wire::Limits{.max_frame_bytes = 64 << 20});
    if (!reply || reply->op != wire::Op::hello || !reply->status.is_ok()) return false;
    auto* hello = std::get_if<wire::HelloReply>(&reply->body);
    if (hello == nullptr) return false;
    hello->control_ports = {static_cast<std::uint32_t>(port_of(front_endpoint_))};
    hello->event_port = static_cast<std::uint32_t>(port_of(event_endpoint_));
    std::string frame;
    wire::encode_reply(*reply, nullptr, frame);
    parts.back() = zmq::message_t(frame.data(), frame.size());
    return true;
  }

  void pass(Leg leg, const std::string& identity, Message parts) {
    if (leg == Leg::reply && rewrite_hello(parts)) return send(leg, identity, std::move(parts));
    if (calm_.load()) return send(leg, identity, std::move(parts));
    if (chance(faults_.drop)) {
      counters_.dropped.fetch_add(1);
      return;
    }
    if (chance(faults_.corrupt) && !parts.empty() && parts.back().size() > 0) {
      auto& last = parts.back();
      auto* bytes = static_cast<unsigned char*>(last.data());
      const int flips = 1 + static_cast<int>(random_() % 3);
      for (int i = 0; i < flips; ++i) bytes[random_() % last.size()] ^= static_cast<unsigned char>(1 + random_() % 255);
      counters_.corrupted.fetch_add(1);
    }
    if (chance(faults_.duplicate)) {
      counters_.duplicated.fetch_add(1);
      send(leg, identity, copy(parts));
    }
    if (chance(faults_.reorder)) {
      counters_.reordered.fetch_add(1);
      held_.push_back(Held{leg, identity, std::move(parts), std::chrono::steady_clock::now()});
      return;
    }
    send(leg, identity, std::move(parts));
    // Whatever was held back goes after this one (out of order), or after 50 ms.
    release_held(leg, false);
  }

  void release_held(std::optional<Leg> leg, bool only_stale) {
    const auto now = std::chrono::steady_clock::now();
    for (auto it = held_.begin(); it != held_.end();) {
      const bool due = only_stale ? now - it->since > std::chrono::milliseconds(50) : it->leg == *leg;
      if (due) {
        send(it->leg, it->identity, std::move(it->parts));
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void run() {
    Message parts;
    while (!stop_.load()) {
      std::vector<zmq::pollitem_t> items = {{static_cast<void*>(front_), 0, ZMQ_POLLIN, 0},
                                            {static_cast<void*>(event_in_), 0, ZMQ_POLLIN, 0}};
      std::vector<std::string> identities;
      for (auto& [identity, socket] : backs_) {
        items.push_back({static_cast<void*>(socket), 0, ZMQ_POLLIN, 0});
        identities.push_back(identity);
      }
      zmq::poll(items.data(), items.size(), std::chrono::milliseconds(10));
      if (items[0].revents & ZMQ_POLLIN) {
        while (receive(front_, parts)) {
          if (parts.size() < 2) continue;
          const std::string identity(static_cast<const char*>(parts[0].data()), parts[0].size());
          parts.erase(parts.begin());
          pass(Leg::request, identity, std::move(parts));
        }
      }
      if (items[1].revents & ZMQ_POLLIN) {
        while (receive(event_in_, parts)) {
          pass(Leg::event, "", std::move(parts));
        }
      }
      for (std::size_t i = 0; i < identities.size(); ++i) {
        if (!(items[i + 2].revents & ZMQ_POLLIN)) continue;
        while (receive(backs_.at(identities[i]), parts)) {
          pass(Leg::reply, identities[i], std::move(parts));
        }
      }
      release_held(std::nullopt, true);
    }
  }

  std::string control_;
  std::string events_;
  FrameFaults faults_;
  std::mt19937_64 random_;
  zmq::context_t context_{1};
  zmq::socket_t front_{context_, zmq::socket_type::router};
  zmq::socket_t event_in_{context_, zmq::socket_type::pull};
  zmq::socket_t event_out_{context_, zmq::socket_type::push};
  std::map<std::string, zmq::socket_t> backs_;
  std::vector<Held> held_;
  std::string front_endpoint_;
  std::string event_endpoint_;
  RelayCounters counters_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> calm_{false};
  std::thread thread_;
};

}  // namespace ecx::fault
