#pragma once
// Plain values exchanged between the engine's scheduler hooks and the
// SchedulerCoordinator. No Python here: the vLLM connector maps its objects onto
// these structs (and back) in the pybind11 layer.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ecx/connector/scheduler/transfer_params.h"
#include "ecx/core/tensor_spec.h"

namespace ecx::scheduler {

// One multimodal item of a request (vLLM's MultiModalFeatureSpec).
struct MmFeature {
  std::string identifier;   // the engine's encoder-cache key (mm_hash)
  std::string modality;     // "image", "audio", ...
  std::int64_t offset = 0;  // placeholder position in the prompt
  std::int64_t length = 0;
  std::int64_t num_encoder_embeds = 0;  // rows of the encoder output (request.get_num_encoder_embeds(i))
  // Exact output spec when the caller knows it; otherwise a producer derives
  // [num_encoder_embeds, encoder width] in the model dtype.
  std::optional<TensorSpec> output_spec;
  // The request still carries the item's media (the engine can encode it itself).
  bool has_media = true;

  // True when the prompt tokens already computed cover this item completely.
  bool computed_by(std::int64_t num_computed_tokens) const noexcept { return offset + length <= num_computed_tokens; }
};

// What the coordinator needs to know about one engine request.
struct RequestView {
  std::string request_id;
  std::vector<MmFeature> mm_features;
  // Empty when the request carried no ec_transfer_params, or when they were
  // malformed (then `ec_transfer_params_error` says why and the coordinator
  // fails the request as unavailable instead of throwing).
  std::optional<EcTransferParams> ec_transfer_params;
  std::string ec_transfer_params_error;

  // Parses and stores the request's ec_transfer_params from JSON text ("null" =
  // none). Never throws; a malformed value is recorded in ec_transfer_params_error.
  // (From a parsed JSON value: scheduler/transfer_params_json.h.)
  void set_ec_transfer_params_text(std::string_view json_text);
  bool has_malformed_params() const noexcept { return !ec_transfer_params_error.empty(); }
  // The parsed params, or nullptr (absent or malformed).
  const EcTransferParams* params() const noexcept { return ec_transfer_params ? &*ec_transfer_params : nullptr; }
};

// Scheduler → producer worker: push one encoder output to a consumer.
struct PushSpec {
  std::string mm_hash;
  TensorSpec spec;
  std::string consumer_zmq;  // base control address of the destination consumer
  std::string transfer_id;
  std::string request_id;
};

// Scheduler → consumer worker: take one landed (or resident) output into the
// encoder cache. The readiness event's reservation id is not carried: every TP
// shard minted its own, and the worker takes by transfer id.
struct LoadSpec {
  std::string mm_hash;
  std::string transfer_id;
  TensorSpec spec;
  bool local = false;  // true = reload from the resident pool, no transfer involved
};

// An item of the shared store (cross-encoder cache), in its two uses:
// - a candidate: an output the engine computed, offered to the store;
// - a load: an item the store holds, which the workers load into the encoder cache
//   instead of encoding it (then push it as usual), or prefetch ahead of that.
struct StoreItem {
  std::string mm_hash;
  TensorSpec spec;
};
using StoreCandidate = StoreItem;
using StoreLoad = StoreItem;

// The part of vLLM's SchedulerOutput the coordinator reads.
struct StepView {
  std::vector<std::string> free_encoder_mm_hashes;
  std::vector<std::string> preempted_request_ids;
};

// Per-step plan handed to the workers (vLLM's ECConnectorMetadata).
struct ConnectorMeta {
  // Hashes the workers drop from their encoder cache this step (the engine's own
  // frees plus connector-owned loads whose request finished without using them).
  std::vector<std::string> freed;
  // Hashes the engine evicted and allocated again in this step while they held a
  // connector-loaded copy: the engine drops them at the start of the step like any
  // free, and the workers put back the tensor they loaded (nothing is reloaded).
  std::vector<std::string> retained;
  // Transfers whose consumer reservation is being cancelled remotely because
  // their record expired out of READY/RESIDENT. Informational for the worker:
  // the scheduler already queued the remote cancel.
  std::vector<std::string> orphan_cancels;
  std::vector<StoreCandidate> store_candidates;
  // Producer, cross-encoder cache: items the workers load from the store into host
  // memory (verified) and report in WorkerOutput::store_ready or store_failed ...
  std::vector<StoreLoad> store_prefetches;
  // ... and items the engine allocated without encoding them: the workers copy them
  // into its encoder cache (from the prefetched copy, else straight from the store).
  std::vector<StoreLoad> store_loads;
  std::vector<PushSpec> pushes;
  std::vector<LoadSpec> loads;
};

// Aggregated report of the workers (vLLM's ECConnectorWorkerMetadata after
// aggregation across ranks: loaded intersected, the rest united).
struct WorkerOutput {
  std::vector<std::string> loaded{};        // mm_hashes now in every rank's encoder cache
  std::vector<std::string> failed_loads{};  // mm_hashes a rank could not take
  std::vector<std::string> reclaimed{};     // mm_hashes whose resident copy a rank dropped
  bool pending_saves = false;               // producer I/O still in flight
  std::vector<std::string> failed_saves{};  // request ids whose push failed
  // Cross-encoder cache: prefetches now held by every rank, prefetches a rank could
  // not make, and prefetched copies a rank dropped unused.
  std::vector<std::string> store_ready{};
  std::vector<std::string> store_failed{};
  std::vector<std::string> store_dropped{};
};

// request_finished's answer: vLLM's (delay_free, ec_transfer_params).
struct FinishedResult {
  bool delay_free = false;  // always false: nothing releases delayed EC frees later
  // Producer only, as JSON text: {"<identifier>": {"transfer_id"?: ...,
  // "item_indices": [...]}, "ec_items": [{"mm_hash", "transfer_id"}, ...]}. The
  // Python layer adds each identifier's placeholder "metadata". Empty when there is
  // nothing to report.
  std::optional<std::string> params;
};

}  // namespace ecx::scheduler
