#pragma once
// Something else a thread that waits for ECX's events also wakes for, in the form
// zmq_poll takes: a ZeroMQ socket's handle, or a file descriptor that polls readable
// when there is work. An engine loop that waits for transfers and for new requests
// at once passes its request socket, so that neither waits out the other's timeout.
// A source with neither is ignored; one that cannot be polled (a closed fd, a handle
// that is no socket) is dropped from that wait, which then waits for events alone.

namespace ecx {

struct WakeSource {
  void* zmq_socket = nullptr;  // a libzmq socket handle (zmq::socket_t::handle()), or
  int fd = -1;                 // when zmq_socket is null: a pollable file descriptor
};

}  // namespace ecx
