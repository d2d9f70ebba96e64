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

// The name a new thread reads back after naming itself `name`.
std::string named_in_a_new_thread(const std::string& name) {
  std::string seen;
  std::thread([&] {
    name_this_thread(name);
    seen = name_of_this_thread();
  }).join();
  return seen;
}

TEST(ThreadName, NamesTheCallingThreadOnly) {
  const std::string before = name_of_this_thread();
  EXPECT_EQ(named_in_a_new_thread("ecx-ucx"), "ecx-ucx");
  EXPECT_EQ(name_of_this_thread(), before);
}

TEST(ThreadName, ALongNameKeepsItsFirstFifteenCharacters) {
  EXPECT_EQ(named_in_a_new_thread("ecx-a-name-longer-than-the-kernel-keeps"), "ecx-a-name-long");
}

}  // namespace
}  // namespace ecx
