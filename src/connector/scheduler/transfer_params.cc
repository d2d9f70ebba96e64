#include "ecx/connector/scheduler/transfer_params.h"

#include <algorithm>

#include <fmt/format.h>

#include "connector/scheduler/json_events.h"
#include "connector/scheduler/transfer_params_json.h"
#include "ecx/connector/scheduler/types.h"
#include "ecx/core/ids.h"

namespace ecx::scheduler {
namespace {

// What the rules read of a params document, however it was read: the kind of each value
// they look at, and the text or flag of the scalars among them. A key given twice keeps
// its last value, as in a parsed JSON object.
enum class Kind : unsigned char { null, boolean, number, string, object, array, binary, discarded };

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::null:
      return "null";
    case Kind::boolean:
      return "boolean";
    case Kind::number:
      return "number";
    case Kind::string:
      return "string";
    case Kind::object:
      return "object";
    case Kind::array:
      return "array";
    case Kind::binary:
      return "binary";
    case Kind::discarded:
      break;
  }
  return "discarded";
}

struct Field {
  bool present = false;
  Kind kind = Kind::null;
  std::string text;   // Kind::string
  bool flag = false;  // Kind::boolean
};

struct ItemDoc {
  Kind kind = Kind::null;
  Field mm_hash;
  Field transfer_id;
  Field store;
};

struct ParamsDoc {
  Kind kind = Kind::null;  // the document itself
  Field consumer_zmq;
  Field ec_items;
  std::size_t entries = 0;     // elements of ec_items (an array)
  std::vector<ItemDoc> items;  // the first kMaxEcItems of them
};

// A present, non-null value must be a valid id string.
Result<std::optional<std::string>> optional_id(Field& field, const char* key, std::size_t index) {
  if (!field.present || field.kind == Kind::null) return std::optional<std::string>{};
  if (field.kind != Kind::string) {
    return invalid_argument(fmt::format("ec_items[{}].{} must be a string, got {}", index, key, kind_name(field.kind)));
  }
  if (Status s = validate_id(field.text, key); !s) {
    return invalid_argument(fmt::format("ec_items[{}].{}: {}", index, key, s.message()));
  }
  return std::optional<std::string>{std::move(field.text)};
}

// The rules, in the order they are checked (the first broken one is reported).
Result<EcTransferParams> check(ParamsDoc& doc) {
  if (doc.kind != Kind::object) {
    return invalid_argument(fmt::format("ec_transfer_params must be an object, got {}", kind_name(doc.kind)));
  }
  EcTransferParams params;
  if (Field& zmq = doc.consumer_zmq; zmq.present && zmq.kind != Kind::null) {
    if (zmq.kind != Kind::string) {
      return invalid_argument(
          fmt::format("ec_transfer_params.consumer_zmq must be a string, got {}", kind_name(zmq.kind)));
    }
    params.consumer_zmq = std::move(zmq.text);
    if (params.consumer_zmq.size() > kMaxAddressLength ||
        (!params.consumer_zmq.empty() && params.consumer_zmq.find("://") == std::string::npos)) {
      return invalid_argument(
          fmt::format("ec_transfer_params.consumer_zmq must be an address like tcp://host:port, got '{}'",
                      params.consumer_zmq.substr(0, 64)));
    }
  }
  if (const Field& list = doc.ec_items; list.present && list.kind != Kind::null) {
    if (list.kind != Kind::array) {
      return invalid_argument(
          fmt::format("ec_transfer_params.ec_items must be an array, got {}", kind_name(list.kind)));
    }
    if (doc.entries > kMaxEcItems) {
      return invalid_argument(
          fmt::format("ec_transfer_params.ec_items has {} entries; at most {}", doc.entries, kMaxEcItems));
    }
    params.items.reserve(doc.items.size());
    for (std::size_t i = 0; i < doc.items.size(); ++i) {
      ItemDoc& item = doc.items[i];
      if (item.kind != Kind::object) {
        return invalid_argument(fmt::format("ec_items[{}] must be an object, got {}", i, kind_name(item.kind)));
      }
      auto mm_hash = optional_id(item.mm_hash, "mm_hash", i);
      if (!mm_hash) return mm_hash.status();
      auto transfer_id = optional_id(item.transfer_id, "transfer_id", i);
      if (!transfer_id) return transfer_id.status();
      bool from_store = false;
      if (item.store.present && item.store.kind != Kind::null) {
        if (item.store.kind != Kind::boolean) {
          return invalid_argument(
              fmt::format("ec_items[{}].store must be a boolean, got {}", i, kind_name(item.store.kind)));
        }
        from_store = item.store.flag;
      }
      if (from_store && *transfer_id) {
        return invalid_argument(fmt::format(
            "ec_items[{}] names a transfer_id and \"store\": true; an item comes from a push or from the store", i));
      }
      params.items.push_back(EcItem{std::move(*mm_hash), std::move(*transfer_id), from_store});
    }
  }
  return params;
}

// --- from a parsed JSON value

Kind kind_of(const nlohmann::json& value) {
  using T = nlohmann::json::value_t;
  switch (value.type()) {
    case T::null:
      return Kind::null;
    case T::boolean:
      return Kind::boolean;
    case T::number_integer:
    case T::number_unsigned:
    case T::number_float:
      return Kind::number;
    case T::string:
      return Kind::string;
    case T::object:
      return Kind::object;
    case T::array:
      return Kind::array;
    case T::binary:
      return Kind::binary;
    case T::discarded:
      break;
  }
  return Kind::discarded;
}

Field field_of(const nlohmann::json& object, const char* key) {
  Field field;
  const auto it = object.find(key);
  if (it == object.end()) return field;
  field.present = true;
  field.kind = kind_of(*it);
  if (field.kind == Kind::string) field.text = it->get<std::string>();
  if (field.kind == Kind::boolean) field.flag = it->get<bool>();
  return field;
}

ParamsDoc doc_of(const nlohmann::json& value) {
  ParamsDoc doc;
  doc.kind = kind_of(value);
  if (doc.kind != Kind::object) return doc;
  doc.consumer_zmq = field_of(value, "consumer_zmq");
  doc.ec_items = field_of(value, "ec_items");
  if (doc.ec_items.kind != Kind::array) return doc;
  const nlohmann::json& list = *value.find("ec_items");
  doc.entries = list.size();
  for (std::size_t i = 0; i < list.size() && i < kMaxEcItems; ++i) {
    ItemDoc item;
    item.kind = kind_of(list[i]);
    if (item.kind == Kind::object) {
      item.mm_hash = field_of(list[i], "mm_hash");
      item.transfer_id = field_of(list[i], "transfer_id");
      item.store = field_of(list[i], "store");
    }
    doc.items.push_back(std::move(item));
  }
  return doc;
}

// --- from JSON text, without building the document: a proxy's params also carry a
// handle per item hash (metadata, indices) that nothing here reads, and a tree of all of
// it cost more than the rest of reading a request.

class DocReader final : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit DocReader(ParamsDoc& doc) : doc_(doc) {}

  bool null() override { return scalar(Kind::null, nullptr, false); }
  bool boolean(bool value) override { return scalar(Kind::boolean, nullptr, value); }
  bool number_integer(number_integer_t /*value*/) override { return scalar(Kind::number, nullptr, false); }
  bool number_unsigned(number_unsigned_t /*value*/) override { return scalar(Kind::number, nullptr, false); }
  bool number_float(number_float_t /*value*/, const string_t& /*text*/) override {
    return scalar(Kind::number, nullptr, false);
  }
  bool string(string_t& value) override { return scalar(Kind::string, &value, false); }
  bool binary(binary_t& /*value*/) override { return scalar(Kind::binary, nullptr, false); }
  bool start_object(std::size_t /*elements*/) override { return open(Kind::object); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t /*elements*/) override { return open(Kind::array); }
  bool end_array() override { return close(); }
  bool key(string_t& key) override {
    next_ = Role::ignored;
    if (frames_.empty()) return true;
    if (frames_.back().role == Role::document) {
      if (key == "consumer_zmq") next_ = Role::consumer_zmq;
      if (key == "ec_items") next_ = Role::ec_items;
    } else if (frames_.back().role == Role::item) {
      if (key == "mm_hash") next_ = Role::mm_hash;
      if (key == "transfer_id") next_ = Role::transfer_id;
      if (key == "store") next_ = Role::store;
    }
    return true;
  }
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/,
                   const nlohmann::detail::exception& /*error*/) override {
    return false;
  }

 private:
  // What a value is to the rules.
  enum class Role : unsigned char { document, consumer_zmq, ec_items, item, mm_hash, transfer_id, store, ignored };
  struct Frame {
    bool array = false;
    Role role = Role::ignored;  // document, ec_items and item: their contents are read
  };

  Role value_role() const {
    if (frames_.empty()) return Role::document;
    const Frame& frame = frames_.back();
    if (frame.array) return frame.role == Role::ec_items ? Role::item : Role::ignored;
    return next_;
  }

  Field* field(Role role) {
    switch (role) {
      case Role::consumer_zmq:
        return &doc_.consumer_zmq;
      case Role::mm_hash:
        return item_kept_ ? &doc_.items.back().mm_hash : nullptr;
      case Role::transfer_id:
        return item_kept_ ? &doc_.items.back().transfer_id : nullptr;
      case Role::store:
        return item_kept_ ? &doc_.items.back().store : nullptr;
      default:
        return nullptr;
    }
  }

  void record(Role role, Kind kind, const std::string* text, bool flag) {
    switch (role) {
      case Role::document:
        doc_.kind = kind;
        return;
      case Role::ec_items:  // a later "ec_items" replaces an earlier one
        doc_.ec_items = Field{true, kind, {}, false};
        doc_.entries = 0;
        doc_.items.clear();
        return;
      case Role::item:
        ++doc_.entries;
        item_kept_ = doc_.items.size() < kMaxEcItems;
        if (item_kept_) doc_.items.push_back(ItemDoc{kind, {}, {}, {}});
        return;
      default:
        if (Field* f = field(role)) *f = Field{true, kind, text != nullptr ? *text : std::string(), flag};
        return;
    }
  }

  bool scalar(Kind kind, const std::string* text, bool flag) {
    record(value_role(), kind, text, flag);
    return true;
  }

  bool open(Kind kind) {
    const Role role = value_role();
    record(role, kind, nullptr, false);
    const bool array = kind == Kind::array;
    const bool read =
        (role == Role::document && !array) || (role == Role::ec_items && array) || (role == Role::item && !array);
    frames_.push_back(Frame{array, read ? role : Role::ignored});
    next_ = Role::ignored;
    return true;
  }

  bool close() {
    frames_.pop_back();
    next_ = Role::ignored;
    return true;
  }

  ParamsDoc& doc_;
  std::vector<Frame> frames_;
  Role next_ = Role::ignored;  // the role of the value after the last key
  bool item_kept_ = false;     // the ec_items element being read is among doc_.items
};

// nullopt: not valid JSON.
std::optional<ParamsDoc> read_doc(std::string_view json_text) {
  ParamsDoc doc;
  DocReader reader(doc);
  if (!detail::read_json_events(json_text, reader)) return std::nullopt;
  return doc;
}

constexpr std::string_view kNotJson = "ec_transfer_params is not valid JSON";

}  // namespace

Result<EcTransferParams> parse_ec_transfer_params(const nlohmann::json& value) {
  ParamsDoc doc = doc_of(value);
  return check(doc);
}

Result<EcTransferParams> parse_ec_transfer_params_text(std::string_view json_text) {
  auto doc = read_doc(json_text);
  if (!doc) return invalid_argument(std::string(kNotJson));
  return check(*doc);
}

std::optional<std::string_view> resolve_transfer_id(const EcTransferParams* params, std::size_t index,
                                                    std::string_view identifier) {
  if (params == nullptr) return std::nullopt;
  const auto& items = params->items;
  if (index < items.size()) {
    const EcItem& item = items[index];
    if ((!item.mm_hash || *item.mm_hash == identifier) && item.transfer_id) return *item.transfer_id;
  }
  for (const EcItem& item : items) {
    if (item.mm_hash && *item.mm_hash == identifier && item.transfer_id) return *item.transfer_id;
  }
  return std::nullopt;
}

bool is_store_item(const EcTransferParams* params, std::size_t index, std::string_view identifier) {
  if (params == nullptr) return false;
  const auto& items = params->items;
  if (index < items.size() && (!items[index].mm_hash || *items[index].mm_hash == identifier)) {
    return items[index].from_store;
  }
  return std::any_of(items.begin(), items.end(), [&](const EcItem& item) {
    return item.from_store && item.mm_hash && *item.mm_hash == identifier;
  });
}

namespace {

// Stores a document's params, or why it has none usable, in `request` (nullopt: the
// text was not JSON; a JSON null: no params).
void store_params(RequestView& request, std::optional<ParamsDoc> doc) {
  request.ec_transfer_params.reset();
  request.ec_transfer_params_error.clear();
  if (!doc) {
    request.ec_transfer_params_error = std::string(kNotJson);
    return;
  }
  if (doc->kind == Kind::null) return;
  auto parsed = check(*doc);
  if (parsed)
    request.ec_transfer_params = std::move(*parsed);
  else
    request.ec_transfer_params_error = parsed.status().message();
}

}  // namespace

void set_ec_transfer_params(RequestView& request, const nlohmann::json& value) { store_params(request, doc_of(value)); }

void append_json_string(std::string& out, std::string_view text) {
  const bool plain = std::all_of(text.begin(), text.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u >= 0x20 && u < 0x7f && c != '"' && c != '\\';
  });
  if (plain) {
    out += '"';
    out += text;
    out += '"';
  } else {
    // Bytes that are not UTF-8 (an engine's identifier is not validated) become
    // U+FFFD rather than an exception out of the engine's request_finished: such a
    // name matches no valid id at the consumer, which then treats the item as missing.
    out += nlohmann::json(std::string(text)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
}

void RequestView::set_ec_transfer_params_text(std::string_view json_text) { store_params(*this, read_doc(json_text)); }

}  // namespace ecx::scheduler
