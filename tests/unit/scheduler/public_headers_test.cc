// The scheduler's public headers expose only the standard library and ECX types:
// included first and alone, they bring in no JSON library (JSON crosses them as
// text; the JSON-value entry points live in scheduler/transfer_params_json.h).
#include "ecx/connector/scheduler/collaborators.h"
#include "ecx/connector/scheduler/coordinator.h"
#include "ecx/connector/scheduler/table_storage.h"
#include "ecx/connector/scheduler/transfer_params.h"
#include "ecx/connector/scheduler/transfer_table.h"
#include "ecx/connector/scheduler/types.h"

#if defined(INCLUDE_NLOHMANN_JSON_HPP_) || defined(NLOHMANN_JSON_VERSION_MAJOR)
#error "a public scheduler header includes nlohmann/json"
#endif

#include <optional>
#include <string>
#include <type_traits>

#include <gtest/gtest.h>

namespace ecx::scheduler {
namespace {

static_assert(std::is_same_v<decltype(FinishedResult::params), std::optional<std::string>>);

TEST(SchedulerPublicHeaders, EcTransferParamsAreTakenAsText) {
  RequestView r;
  r.set_ec_transfer_params_text(R"({"consumer_zmq": "tcp://c:1", "ec_items": [{"transfer_id": "t0"}]})");
  ASSERT_TRUE(r.ec_transfer_params);
  EXPECT_EQ(r.ec_transfer_params->consumer_zmq, "tcp://c:1");
  EXPECT_EQ(resolve_transfer_id(&*r.ec_transfer_params, 0, "h0"), std::optional<std::string_view>("t0"));
  r.set_ec_transfer_params_text("null");
  EXPECT_FALSE(r.ec_transfer_params);
  EXPECT_FALSE(r.has_malformed_params());
  r.set_ec_transfer_params_text("{");
  EXPECT_TRUE(r.has_malformed_params());
  EXPECT_FALSE(parse_ec_transfer_params_text("[]"));
}

}  // namespace
}  // namespace ecx::scheduler
