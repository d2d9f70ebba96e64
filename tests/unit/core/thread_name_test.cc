#include "ecx/core/thread_name.h"

#include <array>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <pthread.h>

namespace ecx {
namespace {

std::string name_of_this_thread() {
  std::array<char, 64> buffer{};
  if (::pthread_getname_np(::pthread_self(), buffer.data(), buffer.size()) != 0) return "?";
  return buffer.data();
}

TEST(ThreadName, NamesTheCallingThreadOnly) {
  const std::string before = name_of_this_thread();
  std::string seen;
  std::thread([&] {
    name_this_thread("ecx-ucx");
    seen = name_of_this_thread();
  }).join();
  EXPECT_EQ(seen, "ecx-ucx");
  EXPECT_EQ(name_of_this_thread(), before);
}

TEST(ThreadName, ALongNameKeepsItsFirstFifteenCharacters) {
  std::string seen;
  std::thread([&] {
    name_this_thread("ecx-a-name-longer-than-the-kernel-keeps");
    seen = name_of_this_thread();
  }).join();
  EXPECT_EQ(seen, "ecx-a-name-long");
}

}  // namespace
}  // namespace ecx
