#pragma once
// A ZeroMQ ROUTER on loopback driven by the test: it hands over each request it gets
// and sends the replies it is told to (a peer that answers late, out of order, or as an
// older release would).

#include <chrono>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "ecx/wire/codec.h"
#include "ecx/wire/messages.h"

namespace ecx::control::testing {

struct HandDrivenRouter {
  HandDrivenRouter() : HandDrivenRouter("*") {}
  // On a given port: a test takes over the port of a shard it stopped, so that no
  // listener of another test can take it and answer in the shard's place.
  explicit HandDrivenRouter(int port) : HandDrivenRouter(std::to_string(port)) {}
  explicit HandDrivenRouter(const std::string& port) : router(ctx, zmq::socket_type::router) {
    router.set(zmq::sockopt::linger, 0);
    router.bind("tcp://127.0.0.1:" + port);
    address = router.get(zmq::sockopt::last_endpoint);
  }
  // The next request's routing id and decoded request; nullopt when none came within 5 s.
  std::optional<std::pair<std::string, wire::Request>> next_request() {
    zmq::pollitem_t item{router.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(5000)) != 1) return std::nullopt;
    std::vector<zmq::message_t> parts;
    if (!zmq::recv_multipart(router, std::back_inserter(parts)) || parts.size() != 2) return std::nullopt;
    auto decoded = wire::decode_request(parts[1].to_string_view(), wire::Limits{});
    if (!decoded) return std::nullopt;
    return std::make_pair(parts[0].to_string(), decoded->request);
  }
  void answer(const std::string& routing_id, const wire::Reply& reply) {
    std::string frame;
    wire::encode_reply(reply, nullptr, frame);
    router.send(zmq::buffer(routing_id), zmq::send_flags::sndmore);
    router.send(zmq::buffer(frame), zmq::send_flags::none);
  }
  void answer_status(const std::string& routing_id, std::uint64_t request_id, const std::string& state) {
    wire::Reply reply;
    reply.id = request_id;
    reply.op = wire::Op::status;
    reply.body = wire::StatusReply{true, state, "h", {}, 0, std::nullopt};
    answer(routing_id, reply);
  }
  void answer_cancel(const std::string& routing_id, std::uint64_t request_id, bool cancelled) {
    wire::Reply reply;
    reply.id = request_id;
    reply.op = wire::Op::cancel;
    reply.body = wire::CancelReply{cancelled};
    answer(routing_id, reply);
  }
  // The port the router listens on (its address is tcp://127.0.0.1:PORT).
  int port() const { return std::stoi(address.substr(address.rfind(':') + 1)); }
  zmq::context_t ctx;
  zmq::socket_t router;
  std::string address;
};

}  // namespace ecx::control::testing
