"""Test double of vLLM's engine step as an EC connector sees it. Not vLLM.

One EngineDouble is one vLLM instance: a scheduler (with the SCHEDULER connector)
and TP worker ranks (each with its own WORKER connector and encoder cache). The
scheduler's plan reaches the workers pickled, and the workers' reports come back
pickled and folded in rank order, as between vLLM's processes. The hook order per
step follows vllm-ec-api.md §3:

  scheduler: [waiting loop] ensure_cache_available -> has_cache_item ->
             update_state_after_alloc -> build_connector_meta
  worker:    pop free_encoder_mm_hashes -> bind_connector_metadata ->
             start_load_caches (consumer) / start_save_caches (producer, MRv2 only) ->
             encode + save_caches (MRv1 calls it on every role) -> gather ->
             get_finished -> build_connector_worker_meta -> clear_connector_metadata
  scheduler: update_connector_output -> update_state_after_free -> request_finished ->
             free; take_unavailable_requests; has_requests() or has_pending_push_work()

What differs between vLLM builds and model runners is a VllmProfile (see
PROFILES): whether the workers run the connector on steps that schedule no tokens,
whether they ask for worker metadata, whether only rank 0's output reaches the
scheduler, and whether the scheduler polls take_unavailable_requests.

"Encoding" is deterministic in the identifier (and the row count), so any process
can tell whether the bytes in an encoder cache are exactly what the encoder made.
A prompt is only its multimodal placeholders; a request finishes after the step
that gathers its embeddings (encode-only instances: after the step that encodes).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.distributed import parallel_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

# ------------------------------------------------------------------ vLLM profiles


@dataclass(frozen=True)
class VllmProfile:
    """How one vLLM build and model runner drive an EC connector (read from their source)."""

    name: str
    # The consumer's EC context runs on steps with no scheduled tokens (MRv2's
    # no_forward at 7cfb97e3; MRv1 returns before it, MRv2 at 6adad087 has none).
    ec_on_steps_without_tokens: bool = True
    # build_connector_worker_meta is called and its result reaches the scheduler (#49585).
    worker_meta: bool = True
    # Only the output rank's ECConnectorOutput reaches the scheduler (no
    # ECOutputAggregator before #49585); else outputs are folded across ranks.
    output_rank_only: bool = False
    # The scheduler polls take_unavailable_requests and fails what it returns.
    polls_unavailable: bool = True
    # An encoder-only step (a role that is not a consumer) returns an output without
    # the ECConnectorOutput it built (MRv1's make_empty_encoder_model_runner_output).
    encoder_output_dropped: bool = False
    # An encoder-only instance runs the EC context on steps with no scheduled tokens
    # (MRv1's encoder-only branch comes before its zero-token return; MRv2 at
    # 6adad087 returns before any EC hook, in every role).
    producer_ec_on_steps_without_tokens: bool = True
    # A step that runs the language model returns the ECConnectorOutput it built
    # (MRv2 at 6adad087 keeps it only on the encoder-only return).
    consumer_output_returned: bool = True


PROFILES = {
    p.name: p
    for p in (
        VllmProfile("6adad087-mrv1", False, False, True, False, True),
        VllmProfile("6adad087-mrv2", False, False, True, False,
                    producer_ec_on_steps_without_tokens=False, consumer_output_returned=False),
        VllmProfile("7cfb97e3-mrv1", False, False, False, False, True),
        VllmProfile("7cfb97e3-mrv2", True, True, False, False),
        VllmProfile("newer", True, True, False, True),
    )
}

# ------------------------------------------------------------------ requests


@dataclass
class PlaceholderRange:
    offset: int
    length: int

    def get_num_embeds(self) -> int:
        return self.length


@dataclass
class MultiModalKwargsItem:
    values: dict[str, Any]

    def get_data(self) -> dict[str, Any]:
        return self.values


@dataclass
class MultiModalFeatureSpec:
    identifier: str
    modality: str
    mm_position: PlaceholderRange
    data: MultiModalKwargsItem | None = None

    @property
    def mm_hash(self) -> str:
        return self.identifier


class Request:
    def __init__(self, request_id: str, mm_features: list[MultiModalFeatureSpec], ec_transfer_params: Any = None):
        self.request_id = request_id
        self.mm_features = mm_features
        self.ec_transfer_params = ec_transfer_params
        self.num_prompt_tokens = sum(f.mm_position.length for f in mm_features) + 1
        self.num_computed_tokens = 0

    def get_num_encoder_embeds(self, index: int) -> int:
        return self.mm_features[index].mm_position.get_num_embeds()


def make_request(request_id: str, items: list[dict[str, Any]], ec_transfer_params: Any = None) -> Request:
    """items: [{"identifier", "num_embeds", "grid": [t, h, w]}] in prompt order."""
    features, offset = [], 1
    for item in items:
        n = int(item["num_embeds"])
        data = MultiModalKwargsItem(
            {"image_grid_thw": torch.tensor(item["grid"]), "pixel_values": torch.zeros(2, 3)}
        )
        features.append(MultiModalFeatureSpec(item["identifier"], "image", PlaceholderRange(offset, n), data))
        offset += n + 1
    return Request(request_id, features, ec_transfer_params)


def encode(identifier: str, num_embeds: int, width: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The encoder double: the same bytes for the same item in every process."""
    seed = int.from_bytes(hashlib.sha256(identifier.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_embeds, width, generator=generator).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


# ------------------------------------------------------------------ step objects


@dataclass
class SchedulerOutput:
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    total_num_scheduled_tokens: int = 0
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    ec_connector_metadata: Any = None
    # The double's own: what each scheduled request gathers, (identifier, rows) per item.
    gathers: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    encodes: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class ECConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    ec_connector_worker_meta: Any = None

    def is_empty(self) -> bool:
        return not self.finished_sending and not self.finished_recving and self.ec_connector_worker_meta is None


@dataclass
class WorkerStepResult:
    ec_connector_output: ECConnectorOutput
    # request id -> None when every item was present with the encoder's exact bytes,
    # else why not.
    gathered: dict[str, str | None] = field(default_factory=dict)


# ------------------------------------------------------------------ encoder cache manager


class EncoderCacheManager:
    """Reference-counted entries in a row budget; unreferenced entries stay until
    their space is needed, then their hashes go to the workers as frees (vLLM's
    lazy eviction), so a later request can reuse an output without re-encoding."""

    def __init__(self, capacity_rows: int):
        self.capacity = capacity_rows
        self.rows: dict[str, int] = {}
        self.users: dict[str, set[str]] = {}
        self.freeable: OrderedDict[str, None] = OrderedDict()
        self.freed: list[str] = []

    def has(self, identifier: str) -> bool:
        return identifier in self.rows

    def reference(self, request: Request, identifier: str) -> None:
        self.users.setdefault(identifier, set()).add(request.request_id)
        self.freeable.pop(identifier, None)

    def allocate(self, request: Request, identifier: str, rows: int) -> None:
        used = sum(self.rows.values())
        while used + rows > self.capacity and self.freeable:
            victim, _ = self.freeable.popitem(last=False)
            used -= self.rows.pop(victim)
            self.users.pop(victim, None)
            self.freed.append(victim)
        self.rows[identifier] = rows
        self.reference(request, identifier)

    def free(self, request: Request) -> None:
        for f in request.mm_features:
            users = self.users.get(f.identifier)
            if users is None:
                continue
            users.discard(request.request_id)
            if not users and f.identifier in self.rows:
                self.freeable[f.identifier] = None

    def take_freed(self) -> list[str]:
        out, self.freed = self.freed, []
        return out


# ------------------------------------------------------------------ worker


class WorkerDouble:
    """One TP rank: a WORKER connector and its encoder cache."""

    def __init__(
        self, vllm_config: VllmConfig, tp_rank: int, *, call_start_save_caches: bool, profile: VllmProfile
    ):
        pc = vllm_config.parallel_config
        parallel_state.set_ranks(tp_rank, pc.tensor_parallel_size, 0, pc.pipeline_parallel_size)
        self.connector = ECConnectorFactory.create_connector(vllm_config, ECConnectorRole.WORKER)
        self.width = vllm_config.model_config.get_inputs_embeds_size()
        self.dtype = vllm_config.model_config.dtype
        self.call_start_save_caches = call_start_save_caches  # MRv2 calls it; MRv1 may not
        self.profile = profile
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.provenance: dict[str, str] = {}  # identifier -> "connector" | "local"
        self.local_encodes = 0

    def execute(self, scheduler_output_blob: bytes) -> bytes:
        so: SchedulerOutput = pickle.loads(scheduler_output_blob)
        c = self.connector
        for h in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(h, None)
        gathered: dict[str, str | None] = {}
        no_tokens = so.total_num_scheduled_tokens == 0
        if no_tokens and not (
            self.profile.ec_on_steps_without_tokens
            if c.is_consumer
            else self.profile.producer_ec_on_steps_without_tokens
        ):
            # MRv1 (and MRv2 before no_forward) returns before the EC context.
            return pickle.dumps(WorkerStepResult(ECConnectorOutput(), gathered))
        c.bind_connector_metadata(so.ec_connector_metadata)
        try:
            if c.is_consumer:
                before = set(self.encoder_cache)
                c.start_load_caches(encoder_cache=self.encoder_cache)
                for h in set(self.encoder_cache) - before:
                    self.provenance[h] = "connector"
            if c.is_producer and self.call_start_save_caches:
                c.start_save_caches(encoder_cache=self.encoder_cache)
            for identifier, rows in so.encodes:
                self.encoder_cache[identifier] = encode(identifier, rows, self.width, self.dtype)
                self.provenance[identifier] = "local"
                self.local_encodes += 1
                c.save_caches(encoder_cache=self.encoder_cache, mm_hash=identifier)
            for request_id, items in so.gathers.items():
                problem = None
                for identifier, rows in items:
                    tensor = self.encoder_cache.get(identifier)
                    if tensor is None:
                        problem = f"Encoder cache miss for {identifier}"
                        break
                    if not same_bits(tensor, encode(identifier, rows, self.width, self.dtype)):
                        problem = f"content of {identifier} differs from what the encoder produced"
                        break
                gathered[request_id] = problem
        finally:
            sending, recving = c.get_finished(so.finished_req_ids)
            worker_meta = c.build_connector_worker_meta() if self.profile.worker_meta else None
            c.clear_connector_metadata()
        output = ECConnectorOutput(sending, recving, worker_meta)
        if not c.is_consumer and self.profile.encoder_output_dropped:
            output = ECConnectorOutput()
        if c.is_consumer and not no_tokens and not self.profile.consumer_output_returned:
            output = ECConnectorOutput()
        return pickle.dumps(WorkerStepResult(output, gathered))


def aggregate_outputs(outputs: list[ECConnectorOutput]) -> ECConnectorOutput:
    """vLLM's ECOutputAggregator: finished sets unioned, worker metadata folded in rank order."""
    sending: set[str] = set()
    recving: set[str] = set()
    meta = None
    for out in outputs:
        sending |= out.finished_sending or set()
        recving |= out.finished_recving or set()
        if out.ec_connector_worker_meta is not None:
            meta = out.ec_connector_worker_meta if meta is None else meta.aggregate(out.ec_connector_worker_meta)
    return ECConnectorOutput(sending or None, recving or None, meta)


# ------------------------------------------------------------------ engine


@dataclass
class Finished:
    request_id: str
    status: str  # "ok" | "unavailable" | "error"
    ec_transfer_params: dict[str, Any] | None = None
    detail: str | None = None
    provenance: dict[str, str] = field(default_factory=dict)  # identifier -> how rank 0 got it


class EngineDouble:
    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        encode_only: bool,
        cache_rows: int = 4096,
        call_start_save_caches: bool = True,
        profile: VllmProfile | str = "newer",
    ):
        self.vllm_config = vllm_config
        self.encode_only = encode_only
        self.profile = PROFILES[profile] if isinstance(profile, str) else profile
        self.scheduler = ECConnectorFactory.create_connector(vllm_config, ECConnectorRole.SCHEDULER)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.workers = [
            WorkerDouble(vllm_config, r, call_start_save_caches=call_start_save_caches, profile=self.profile)
            for r in range(tp)
        ]
        for w in self.workers:
            w.connector.start_worker_services()
        self.cache = EncoderCacheManager(cache_rows)
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.finished: list[Finished] = []
        self._finished_ids: set[str] = set()
        self.steps = 0
        # Entries evicted and allocated again as external loads in one step: the
        # workers drop them, then the connector must bring them back.
        self.evicted_and_reallocated = 0
        # (request id, identifier): the item was in this engine's cache when the step
        # began, an allocation earlier in the same step evicted it, and so the engine
        # encoded it itself. vLLM's scheduler does the same: its cache evicts
        # unreferenced entries lazily while it schedules, and the connector learns of
        # an eviction only from the step's free_encoder_mm_hashes, so its gate may pass
        # a request on the entry the step has just evicted (and no hook is left to
        # defer the request once it finds the entry gone).
        self.reencoded_after_eviction: set[tuple[str, str]] = set()
        self.hook_errors: list[str] = []

    # -- API
    def add_request(self, request: Request) -> None:
        self.waiting[request.request_id] = request

    def has_requests(self) -> bool:
        return bool(self.waiting) or self.scheduler.has_pending_push_work()

    def take_finished(self) -> list[Finished]:
        out, self.finished = self.finished, []
        return out

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        for w in self.workers:
            w.connector.shutdown()

    # -- one engine step
    def step(self) -> None:
        self.steps += 1
        so = self._schedule()
        blob = pickle.dumps(so)
        results = [pickle.loads(w.execute(blob)) for w in self.workers]
        self._update_from_output(so, results)

    def _schedule(self) -> SchedulerOutput:
        c = self.scheduler
        so = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        allocated_this_step: set[str] = set()
        external_this_step: set[str] = set()
        for request in list(self.waiting.values()):
            if request.mm_features and not c.ensure_cache_available(request, request.num_computed_tokens):
                continue  # deferred to a later step
            local, external = [], []
            for i, f in enumerate(request.mm_features):
                if self.cache.has(f.identifier) or f.identifier in allocated_this_step:
                    self.cache.reference(request, f.identifier)
                    continue
                (external if c.has_cache_item(f.identifier) else local).append(i)
            for i in local + external:
                f = request.mm_features[i]
                self.cache.allocate(request, f.identifier, request.get_num_encoder_embeds(i))
                allocated_this_step.add(f.identifier)
                if i in external:
                    external_this_step.add(f.identifier)
                c.update_state_after_alloc(request, i)
            if local:
                self.reencoded_after_eviction.update(
                    (request.request_id, request.mm_features[i].identifier)
                    for i in local
                    if request.mm_features[i].identifier in self.cache.freed
                )
                so.scheduled_encoder_inputs[request.request_id] = local
                so.encodes += [(request.mm_features[i].identifier, request.get_num_encoder_embeds(i)) for i in local]
            if not self.encode_only:
                so.gathers[request.request_id] = [
                    (f.identifier, request.get_num_encoder_embeds(i)) for i, f in enumerate(request.mm_features)
                ]
            so.gathers.setdefault(request.request_id, [])
        # Entries evicted by this step's allocations: the workers drop them before they
        # load or encode anything this step.
        so.free_encoder_mm_hashes = self.cache.take_freed()
        so.num_scheduled_tokens = {r: self.waiting[r].num_prompt_tokens for r in so.gathers}
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        self.evicted_and_reallocated += len(external_this_step.intersection(so.free_encoder_mm_hashes))
        so.ec_connector_metadata = c.build_connector_meta(so)
        # Crosses to the workers by pickle, like vLLM's executor does.
        so.ec_connector_metadata = pickle.loads(pickle.dumps(so.ec_connector_metadata))
        return so

    def _update_from_output(self, so: SchedulerOutput, results: list[WorkerStepResult]) -> None:
        c = self.scheduler
        if self.profile.output_rank_only:
            output = results[0].ec_connector_output
        else:
            output = aggregate_outputs([r.ec_connector_output for r in results])
        if not output.is_empty():
            c.update_connector_output(pickle.loads(pickle.dumps(output)))
        for request_id in so.gathers:
            request = self.waiting.pop(request_id)
            request.num_computed_tokens = request.num_prompt_tokens
            problems = [r.gathered.get(request_id) for r in results if r.gathered.get(request_id)]
            for i in range(len(request.mm_features)):
                c.update_state_after_free(request, i)  # the item was consumed
            provenance = {f.identifier: self.workers[0].provenance.get(f.identifier, "?") for f in request.mm_features}
            self._free_request(request, "error" if problems else "ok", problems[0] if problems else None, provenance)
        unavailable = c.take_unavailable_requests() if self.profile.polls_unavailable else set()
        for request_id in sorted(unavailable):
            request = self.waiting.pop(request_id, None)
            if request is not None:
                self._free_request(request, "unavailable", "the connector cannot obtain its encoder inputs", {})

    def _free_request(self, request: Request, status: str, detail: str | None, provenance: dict[str, str]) -> None:
        _, params = self.scheduler.request_finished(request)
        self.cache.free(request)
        self._finished_ids.add(request.request_id)
        self.finished.append(Finished(request.request_id, status, params, detail, provenance))
