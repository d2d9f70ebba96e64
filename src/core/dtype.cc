#include "ecx/core/dtype.h"

#include <array>

namespace ecx {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  std::size_t item_size;
};

constexpr std::array<DTypeInfo, 14> kTable = {{
    {DType::float16, "float16", 2},
    {DType::bfloat16, "bfloat16", 2},
    {DType::float32, "float32", 4},
    {DType::float64, "float64", 8},
    {DType::float8_e4m3fn, "float8_e4m3fn", 1},
    {DType::float8_e4m3fnuz, "float8_e4m3fnuz", 1},
    {DType::float8_e5m2, "float8_e5m2", 1},
    {DType::float8_e5m2fnuz, "float8_e5m2fnuz", 1},
    {DType::int8, "int8", 1},
    {DType::int16, "int16", 2},
    {DType::int32, "int32", 4},
    {DType::int64, "int64", 8},
    {DType::uint8, "uint8", 1},
    {DType::bool_, "bool", 1},
}};

constexpr std::array<DType, kTable.size()> kAll = [] {
  std::array<DType, kTable.size()> all{};
  for (std::size_t i = 0; i < kTable.size(); ++i) all[i] = kTable[i].dtype;
  return all;
}();

// torch's other spellings of the same types.
struct Alias {
  std::string_view alias;
  DType dtype;
};
constexpr std::array<Alias, 6> kAliases = {{
    {"half", DType::float16},
    {"float", DType::float32},
    {"double", DType::float64},
    {"short", DType::int16},
    {"int", DType::int32},
    {"long", DType::int64},
}};

}  // namespace

std::string_view dtype_name(DType dtype) noexcept {
  const auto index = static_cast<std::size_t>(dtype);
  return index < kTable.size() ? kTable[index].name : std::string_view("unknown");
}

std::size_t dtype_item_size(DType dtype) noexcept {
  const auto index = static_cast<std::size_t>(dtype);
  return index < kTable.size() ? kTable[index].item_size : 0;
}

std::span<const DType> all_dtypes() noexcept { return kAll; }

std::string accepted_dtype_names() {
  std::string out;
  for (const auto& info : kTable) {
    if (!out.empty()) out += ", ";
    out += info.name;
  }
  return out;
}

Result<DType> parse_dtype(std::string_view name) {
  std::string_view bare = name;
  if (bare.starts_with("torch.")) bare.remove_prefix(6);
  for (const auto& info : kTable) {
    if (info.name == bare) return info.dtype;
  }
  for (const auto& alias : kAliases) {
    if (alias.alias == bare) return alias.dtype;
  }
  std::string shown(name.substr(0, 64));
  return invalid_argument("unknown dtype '" + shown + "'; accepted: " + accepted_dtype_names() +
                          " (optionally prefixed with 'torch.')");
}

}  // namespace ecx
