#pragma once
// The request planning of the EPD proxy, the parts free of JSON: the modalities, how a
// chat request's media items are named (content id per item, transfer id per
// occurrence) and grouped into encoder sub-requests. The JSON bodies built from them
// (what each hop is sent, how the encoders' answers are read) are private to the proxy
// (src/proxy/flow_json.h).

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace ecx::proxy {

enum class Modality : unsigned char { image, audio, video };
std::string_view modality_name(Modality modality) noexcept;

// One media item of a chat request (`image_url`, `audio_url`, `input_audio`,
// `video_url` content parts), in order of appearance.
struct MediaRef {
  std::size_t message = 0;  // index in "messages"
  std::size_t part = 0;     // index in that message's "content" array
  Modality modality = Modality::image;
  // The cache key: the item's own "uuid" when the client gave one, else SHA-256 hex
  // of its URL, else of its JSON with sorted keys. Derived from content, never from
  // the request, so a repeated image keeps its cross-request cache hits.
  std::string content_id;
};

std::string sha256_hex(std::string_view data);

// 32 random lowercase hex digits (a fresh transfer id / request id) and 6 (a suffix).
std::string random_hex(std::size_t digits);

// Groups item indices into encoder sub-requests: images up to `max_batch` per group
// (0 = no limit), every other modality alone; groups keep item order.
std::vector<std::vector<std::size_t>> group_items(const std::vector<MediaRef>& media, int max_batch);
// The same over only the items `indices` names (in their order).
std::vector<std::vector<std::size_t>> group_items(const std::vector<MediaRef>& media,
                                                  const std::vector<std::size_t>& indices, int max_batch);

// How many media items the consumer's body carries rewritten into embeddings, how
// many raw, and how many raw for the consumer to load from the shared store.
struct ConsumerBodyStats {
  std::size_t rewritten = 0;
  std::size_t raw = 0;
  std::size_t from_store = 0;
};

}  // namespace ecx::proxy
