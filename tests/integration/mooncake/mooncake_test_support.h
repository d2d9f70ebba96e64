#pragma once
// What every Mooncake test needs: the library (ECX_MOONCAKE_LIB) and a private
// network namespace. Mooncake's listeners bind every interface, so before anything
// loads the library this process moves into a network namespace of its own with
// only loopback up (unshare(CLONE_NEWNET) as root); child processes spawned later
// inherit it. Without the library, or without the right to create the namespace,
// the tests skip and say why.
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "ecx/transport/mooncake_transport.h"

namespace ecx::mooncake_test {

struct Readiness {
  std::optional<std::string> skip;   // the tests cannot run here, and that is fine
  std::optional<std::string> error;  // ECX_MOONCAKE_LIB is set but unusable: a failure
};

// Enters the namespace once per process.
inline const Readiness& readiness() {
  static const Readiness ready = []() -> Readiness {
    const std::string path = transport::mooncake_library_path({});
    if (path == transport::kMooncakeDefaultLibrary && std::getenv("ECX_MOONCAKE_LIB") == nullptr) {
      // Not configured: do not even try the loader's search path, so a stray system
      // copy cannot turn a plain `make test` into a Mooncake run by surprise.
      return {"set ECX_MOONCAKE_LIB to Mooncake's libtransfer_engine.so to run the Mooncake tests", std::nullopt};
    }
    if (::unshare(CLONE_NEWNET) != 0) {
      return {"cannot create a private network namespace for Mooncake (" + std::string(std::strerror(errno)) +
                  "; needs root or CAP_SYS_ADMIN)",
              std::nullopt};
    }
    const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
    ifreq request{};
    std::strncpy(request.ifr_name, "lo", IFNAMSIZ - 1);
    const bool up = fd >= 0 && ::ioctl(fd, SIOCGIFFLAGS, &request) == 0 &&
                    (request.ifr_flags |= IFF_UP, ::ioctl(fd, SIOCSIFFLAGS, &request) == 0);
    if (fd >= 0) ::close(fd);
    if (!up) return {std::nullopt, "cannot bring loopback up in the private network namespace"};
    if (auto s = transport::mooncake_library_available(); !s) {
      return {std::nullopt, "ECX_MOONCAKE_LIB=" + path + " is not usable: " + s.message()};
    }
    return {};
  }();
  return ready;
}

}  // namespace ecx::mooncake_test

#define ECX_REQUIRE_MOONCAKE()                                               \
  do {                                                                       \
    const auto& ecx_mooncake_ready = ::ecx::mooncake_test::readiness();      \
    if (ecx_mooncake_ready.error) GTEST_FAIL() << *ecx_mooncake_ready.error; \
    if (ecx_mooncake_ready.skip) GTEST_SKIP() << *ecx_mooncake_ready.skip;   \
  } while (0)
