#include "sim/admit_message.h"

#include <fmt/format.h>
#include <msgpack.hpp>

#include "ecx/core/dtype.h"

namespace ecx::sim {
namespace {

// The first element of every message's array.
enum class Kind : std::uint8_t { request = 0, done = 1, answer = 2 };

struct Sink {
  std::string* out;
  void write(const char* data, std::size_t size) { out->append(data, size); }
};
using Packer = msgpack::packer<Sink>;

void put_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<std::uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<std::uint32_t>(s.size()));
}

// One message being written: an array of `fields` elements, its kind first.
class Message {
 public:
  Message(Kind kind, std::uint32_t fields) {
    packer_.pack_array(fields);
    packer_.pack(static_cast<std::uint8_t>(kind));
  }
  Packer& packer() { return packer_; }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
  Sink sink_{&out_};
  Packer packer_{sink_};
};

using Obj = msgpack::object;

Status bad(std::string_view what) { return invalid_argument(fmt::format("admit message: {}", what)); }

Result<std::string> str_of(const Obj& o, std::string_view what) {
  if (o.type != msgpack::type::STR) return bad(fmt::format("{} must be a string", what));
  return std::string(o.via.str.ptr, o.via.str.size);
}

Result<const msgpack::object_array*> array_of(const Obj& o, std::uint32_t min_size, std::string_view what) {
  if (o.type != msgpack::type::ARRAY || o.via.array.size < min_size) {
    return bad(fmt::format("{} must be an array of at least {} elements", what, min_size));
  }
  return &o.via.array;
}

Result<Item> item_of(const Obj& o) {
  auto fields = array_of(o, 4, "an item");
  if (!fields) return fields.status();
  const Obj* f = (*fields)->ptr;
  auto mm_hash = str_of(f[0], "an item's mm_hash");
  if (!mm_hash) return mm_hash.status();
  auto transfer_id = str_of(f[1], "an item's transfer_id");
  if (!transfer_id) return transfer_id.status();
  auto dtype_name = str_of(f[2], "an item's dtype");
  if (!dtype_name) return dtype_name.status();
  auto dtype = parse_dtype(*dtype_name);
  if (!dtype) return dtype.status();
  auto dims = array_of(f[3], 1, "an item's shape");
  if (!dims) return dims.status();
  std::vector<std::int64_t> shape;
  for (std::uint32_t i = 0; i < (*dims)->size; ++i) {
    if ((*dims)->ptr[i].type != msgpack::type::POSITIVE_INTEGER) return bad("a shape's dimensions must be positive");
    shape.push_back(static_cast<std::int64_t>((*dims)->ptr[i].via.u64));
  }
  auto spec = TensorSpec::make(shape, *dtype, ~0ULL);
  if (!spec) return spec.status();
  return Item{std::move(*mm_hash), std::move(*transfer_id), *spec};
}

// The zone a thread's messages are unpacked into, emptied for each (it keeps its first
// chunk). A zone per message cost an 8 KiB allocation each, and glibc sweeps its fast
// bins on every allocation that large: at 64 KiB items that was the consumer engine
// thread's most frequent sweep, its cost charged to the same CPUs that ECX runs on.
msgpack::zone& message_zone() {
  thread_local msgpack::zone zone;
  zone.clear();
  return zone;
}

// The message's array and its kind, in `zone` (valid until the thread's next message).
Result<std::pair<msgpack::object_array, Kind>> open(std::string_view message, msgpack::zone& zone) {
  Obj root;
  try {
    root = msgpack::unpack(zone, message.data(), message.size());
  } catch (const std::exception& e) {
    return bad(fmt::format("not msgpack ({})", e.what()));
  }
  auto fields = array_of(root, 2, "the message");
  if (!fields) return fields.status();
  const Obj& kind = (*fields)->ptr[0];
  if (kind.type != msgpack::type::POSITIVE_INTEGER || kind.via.u64 > static_cast<std::uint64_t>(Kind::answer)) {
    return bad("unknown kind");
  }
  return std::pair{**fields, static_cast<Kind>(kind.via.u64)};  // a copy: `root` is this call's
}

}  // namespace

std::string encode_admit(const AdmitRequestView& request) {
  Message message(Kind::request, 6);
  Packer& pk = message.packer();
  put_str(pk, request.request_id);
  if (request.encoded_at_ns) {
    pk.pack(*request.encoded_at_ns);
  } else {
    pk.pack_nil();
  }
  pk.pack(request.wants_answer);
  pk.pack_array(static_cast<std::uint32_t>(request.items.size()));
  for (const auto& item : request.items) {
    pk.pack_array(4);
    put_str(pk, item.mm_hash);
    put_str(pk, item.transfer_id);
    put_str(pk, dtype_name(item.spec.dtype()));
    pk.pack_array(static_cast<std::uint32_t>(item.spec.shape().size()));
    for (const auto dim : item.spec.shape()) pk.pack(static_cast<std::uint64_t>(dim));
  }
  put_str(pk, request.ec_transfer_params);
  return message.take();
}

std::string encode_admit(const AdmitDone& done) {
  Message message(Kind::done, 2);
  message.packer().pack(done.requests);
  return message.take();
}

std::string encode_answer(const AdmitAnswer& answer) {
  Message message(Kind::answer, 3);
  put_str(message.packer(), answer.request_id);
  message.packer().pack(answer.ready);
  return message.take();
}

Result<std::variant<AdmitRequest, AdmitDone>> decode_admit(std::string_view message) {
  auto opened = open(message, message_zone());
  if (!opened) return opened.status();
  const auto& [fields, kind] = *opened;
  const Obj* f = fields.ptr;
  if (kind == Kind::done) {
    if (f[1].type != msgpack::type::POSITIVE_INTEGER) return bad("a done message's count must be a number");
    return std::variant<AdmitRequest, AdmitDone>(AdmitDone{f[1].via.u64});
  }
  if (kind != Kind::request || fields.size < 6) return bad("expected a request or a done message");
  AdmitRequest request;
  auto id = str_of(f[1], "the request_id");
  if (!id) return id.status();
  request.request_id = std::move(*id);
  if (f[2].type == msgpack::type::POSITIVE_INTEGER || f[2].type == msgpack::type::NEGATIVE_INTEGER) {
    request.encoded_at_ns = f[2].as<std::int64_t>();
  } else if (f[2].type != msgpack::type::NIL) {
    return bad("encoded_at_ns must be a number or nil");
  }
  if (f[3].type != msgpack::type::BOOLEAN) return bad("the answer flag must be a boolean");
  request.wants_answer = f[3].via.boolean;
  auto items = array_of(f[4], 0, "the items");
  if (!items) return items.status();
  for (std::uint32_t i = 0; i < (*items)->size; ++i) {
    auto item = item_of((*items)->ptr[i]);
    if (!item) return item.status();
    request.items.push_back(std::move(*item));
  }
  auto params = str_of(f[5], "ec_transfer_params");
  if (!params) return params.status();
  request.ec_transfer_params = std::move(*params);
  return std::variant<AdmitRequest, AdmitDone>(std::move(request));
}

Result<AdmitAnswer> decode_answer(std::string_view message) {
  auto opened = open(message, message_zone());
  if (!opened) return opened.status();
  const auto& [fields, kind] = *opened;
  if (kind != Kind::answer || fields.size < 3) return bad("expected an answer");
  auto id = str_of(fields.ptr[1], "the request_id");
  if (!id) return id.status();
  if (fields.ptr[2].type != msgpack::type::BOOLEAN) return bad("the ready flag must be a boolean");
  return AdmitAnswer{std::move(*id), fields.ptr[2].via.boolean};
}

}  // namespace ecx::sim
