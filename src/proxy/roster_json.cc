#include "roster_json.h"

#include <string>
#include <utility>

#include "ecx/proxy/options.h"

namespace ecx::proxy {

using nlohmann::json;

Result<InstanceSpec> parse_instance_spec(const json& body) {
  if (!body.is_object()) return invalid_argument("the body must be a JSON object");
  InstanceSpec spec;
  const auto role = body.find("role");
  if (role == body.end() || !role->is_string()) return invalid_argument("'role' (string) is required");
  auto parsed_role = parse_instance_role(role->get_ref<const std::string&>());
  if (!parsed_role) return parsed_role.status();
  spec.role = *parsed_role;
  const auto url = body.find("url");
  if (url == body.end() || !url->is_string()) return invalid_argument("'url' (string) is required");
  auto parsed_url = parse_upstream_url(url->get_ref<const std::string&>());
  if (!parsed_url) return parsed_url.status();
  spec.url = parsed_url->text();
  if (const auto addrs = body.find("ec_zmq_addrs"); addrs != body.end() && !addrs->is_null()) {
    if (!addrs->is_array()) return invalid_argument("'ec_zmq_addrs' must be a list of strings");
    for (const auto& addr : *addrs) {
      if (!addr.is_string() || addr.get_ref<const std::string&>().empty()) {
        return invalid_argument("'ec_zmq_addrs' must be a list of non-empty strings");
      }
      spec.ec_zmq_addrs.push_back(addr.get<std::string>());
    }
  }
  if (const auto dp = body.find("dp_size"); dp != body.end() && !dp->is_null()) {
    if (!dp->is_number_integer() || dp->get<long long>() < 1 || dp->get<long long>() > 4096) {
      return invalid_argument("'dp_size' must be an integer in [1, 4096]");
    }
    spec.dp_size = dp->get<int>();
  }
  if (const auto rank = body.find("dp_rank"); rank != body.end() && !rank->is_null()) {
    if (!rank->is_number_integer() || rank->get<long long>() < 0 || rank->get<long long>() >= spec.dp_size) {
      return invalid_argument("'dp_rank' must be an integer in [0, dp_size)");
    }
    spec.dp_rank = rank->get<int>();
  }
  return spec;
}

json snapshot_json(const RosterSnapshot& snapshot) {
  json out = json::object();
  for (const auto role : {InstanceRole::encode, InstanceRole::prefill, InstanceRole::decode}) {
    json live = json::array();
    for (const auto& url : snapshot.of(role).live) live.push_back(url);
    json evicted = json::array();
    for (const auto& url : snapshot.of(role).evicted) evicted.push_back(url);
    out[std::string(instance_role_name(role))] = {{"live", std::move(live)}, {"evicted", std::move(evicted)}};
  }
  return out;
}

}  // namespace ecx::proxy
