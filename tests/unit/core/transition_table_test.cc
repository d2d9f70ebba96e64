#include "ecx/core/transition_table.h"

#include <gtest/gtest.h>

namespace ecx {
namespace {

enum class Light : unsigned char { red, green, amber };

constexpr TransitionTable<Light, 3> kLights{
    {Light::red, {Light::green}},
    {Light::green, {Light::amber}},
    {Light::amber, {Light::red}},
};

// Evaluated by the compiler: a table is a constant, not start-up work.
static_assert(kLights.allows(Light::red, Light::green));
static_assert(!kLights.allows(Light::red, Light::amber));

TEST(TransitionTable, AllowsExactlyTheListedMoves) {
  EXPECT_TRUE(kLights.allows(Light::green, Light::amber));
  EXPECT_TRUE(kLights.allows(Light::amber, Light::red));
  EXPECT_FALSE(kLights.allows(Light::green, Light::red));
  EXPECT_FALSE(kLights.allows(Light::red, Light::red));  // staying put is not listed, so not allowed
  EXPECT_EQ(kLights.size(), 3u);
}

TEST(TransitionTable, RefusesValuesOutsideTheEnum) {
  const auto corrupt = static_cast<Light>(7);
  EXPECT_FALSE(kLights.allows(corrupt, Light::red));
  EXPECT_FALSE(kLights.allows(Light::red, corrupt));
}

}  // namespace
}  // namespace ecx
