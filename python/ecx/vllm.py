"""ECX as vLLM's encoder-cache (EC) connector.

Load it with::

    --ec-transfer-config '{"ec_connector": "ECXConnector",
                           "ec_connector_module_path": "ecx.vllm",
                           "ec_role": "ec_consumer", ...}'

vLLM builds one ``ECXConnector`` per role: a SCHEDULER instance in the EngineCore
process and a WORKER instance in every GPU worker. Both are thin: the scheduler
hooks call the C++ SchedulerCoordinator, the worker hooks the C++ WorkerCoordinator.
Plans (``ECXConnectorMetadata``) and reports (``ECXWorkerMetadata``) cross process
boundaries by pickle and are plain dataclasses. Tensors reach C++ only as
``data_ptr()``, byte size and device; nothing here links libtorch.

Every optional hook tolerates never being called, so the connector works with vLLM
releases that call fewer hooks (see docs/vllm.md for what each release calls).
"""

from __future__ import annotations

try:
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorBase,
        ECConnectorMetadata,
        ECConnectorRole,
    )
except ImportError as _missing:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        "ecx.vllm is ECX's vLLM EC connector and requires vLLM with EC transfer support "
        "(vllm.distributed.ec_transfer, v0.11.1 or later), which is not importable here: "
        f"{_missing}. Install vLLM in this environment; the rest of the ecx package works without it."
    ) from _missing

try:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorWorkerMetadata
except ImportError:  # vLLM before per-worker EC metadata (#49585)

    class ECConnectorWorkerMetadata:  # type: ignore[no-redef]
        def aggregate(self, other):
            raise NotImplementedError


import json
import logging
from dataclasses import dataclass, field
from typing import Any

from ecx import _core
from ecx._vllm_support import (
    PlaceholderMetadataResolver,
    RequestViews,
    ecx_config_json,
    model_dtype_name,
    model_hidden_width,
    parallel_layout,
    tensor_source,
)

logger = logging.getLogger("ecx.vllm")

__all__ = [
    "ECXConnector",
    "ECXConnectorMetadata",
    "ECXLoadItem",
    "ECXPushItem",
    "ECXStoreCandidate",
    "ECXStoreLoad",
    "ECXWorkerMetadata",
]


# ------------------------------------------------------------------ metadata


@dataclass
class ECXLoadItem:
    """Take one landed (or resident) encoder output into the encoder cache."""

    mm_hash: str
    transfer_id: str
    shape: list[int]
    dtype: str
    local: bool = False  # reload from the resident pool, no transfer involved

    def to_core(self) -> tuple:
        return (self.mm_hash, self.transfer_id, list(self.shape), self.dtype, self.local)


@dataclass
class ECXPushItem:
    """Push one encoder output to a consumer."""

    mm_hash: str
    transfer_id: str
    shape: list[int]
    dtype: str
    consumer_zmq: str
    request_id: str

    def to_core(self) -> tuple:
        return (self.mm_hash, self.transfer_id, list(self.shape), self.dtype, self.consumer_zmq, self.request_id)


@dataclass
class ECXStoreItem:
    """An item of the shared store: an output this step computes and offers to it (a
    store candidate), or one it holds that the producer loads or prefetches instead of
    encoding it."""

    mm_hash: str
    shape: list[int]
    dtype: str

    def to_core(self) -> tuple:
        return (self.mm_hash, list(self.shape), self.dtype)


# The names of its two uses.
ECXStoreCandidate = ECXStoreItem
ECXStoreLoad = ECXStoreItem


@dataclass
class ECXConnectorMetadata(ECConnectorMetadata):
    """One step's plan, scheduler -> workers. Built every step, possibly empty."""

    loads: list[ECXLoadItem] = field(default_factory=list)
    pushes: list[ECXPushItem] = field(default_factory=list)
    # Hashes the workers drop from their encoder cache (connector-owned loads whose
    # request went away without using them, plus the engine's own frees).
    freed: list[str] = field(default_factory=list)
    orphan_cancels: list[str] = field(default_factory=list)  # informational
    # Hashes vLLM evicted and allocated again in this step while they held a tensor
    # this connector loaded: each worker puts its tensor back.
    retained: list[str] = field(default_factory=list)
    store_candidates: list[ECXStoreCandidate] = field(default_factory=list)
    store_loads: list[ECXStoreLoad] = field(default_factory=list)
    # Store entries the workers read and verify ahead of their allocation (reported
    # back as store_ready / store_failed).
    store_prefetches: list[ECXStoreLoad] = field(default_factory=list)
    # The step schedules no tokens: a worker that runs the connector anyway says so
    # in its report (how the scheduler side learns that asynchronous loads work).
    no_tokens: bool = False

    @classmethod
    def from_core(cls, planned: tuple, no_tokens: bool = False) -> "ECXConnectorMetadata":
        freed, orphans, candidates, pushes, loads, retained = planned[:6]
        store_loads = planned[6] if len(planned) > 6 else ()
        store_prefetches = planned[7] if len(planned) > 7 else ()
        return cls(
            no_tokens=no_tokens,
            loads=[ECXLoadItem(h, t, list(s), d, bool(local)) for h, t, s, d, local in loads],
            pushes=[ECXPushItem(h, t, list(s), d, z, r) for h, t, s, d, z, r in pushes],
            freed=list(freed),
            orphan_cancels=list(orphans),
            retained=list(retained),
            store_candidates=[ECXStoreCandidate(h, list(s), d) for h, s, d in candidates],
            store_loads=[ECXStoreLoad(h, list(s), d) for h, s, d in store_loads],
            store_prefetches=[ECXStoreLoad(h, list(s), d) for h, s, d in store_prefetches],
        )


@dataclass
class ECXWorkerMetadata(ECConnectorWorkerMetadata):
    """One rank's step report, workers -> scheduler, folded across ranks."""

    loaded: set[str] = field(default_factory=set)  # now in this rank's encoder cache
    failed_loads: set[str] = field(default_factory=set)
    reclaimed: set[str] = field(default_factory=set)  # resident copies this rank dropped
    pending_saves: bool = False  # producer I/O still in flight
    failed_saves: set[str] = field(default_factory=set)  # request ids whose push failed
    ran_without_tokens: bool = False  # this worker ran the connector on a step without tokens
    # Cross-encoder cache: prefetched store entries held, prefetches that failed, held copies dropped.
    store_ready: set[str] = field(default_factory=set)
    store_failed: set[str] = field(default_factory=set)
    store_dropped: set[str] = field(default_factory=set)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> "ECXWorkerMetadata":
        """Every rank gathers from its own cache, so `loaded` is the intersection and a
        hash any rank failed is failed; the other sets are unions."""
        if not isinstance(other, ECXWorkerMetadata):
            return self
        failed_loads = self.failed_loads | other.failed_loads
        store_failed = self.store_failed | other.store_failed
        return ECXWorkerMetadata(
            loaded=(self.loaded & other.loaded) - failed_loads,
            failed_loads=failed_loads,
            reclaimed=self.reclaimed | other.reclaimed,
            pending_saves=self.pending_saves or other.pending_saves,
            failed_saves=self.failed_saves | other.failed_saves,
            ran_without_tokens=self.ran_without_tokens and other.ran_without_tokens,
            store_ready=(self.store_ready & other.store_ready) - store_failed,
            store_failed=store_failed,
            store_dropped=self.store_dropped | other.store_dropped,
        )

    @classmethod
    def from_core(cls, report: tuple, ran_without_tokens: bool = False) -> "ECXWorkerMetadata":
        loaded, failed_loads, reclaimed, pending_saves, failed_saves = report[:5]
        ready, store_failed, dropped = report[5:8] if len(report) >= 8 else ((), (), ())
        return cls(
            set(loaded),
            set(failed_loads),
            set(reclaimed),
            bool(pending_saves),
            set(failed_saves),
            ran_without_tokens,
            set(ready),
            set(store_failed),
            set(dropped),
        )


# vLLM without worker metadata (before #49585, or a model runner that does not ask
# for it) still hands the scheduler side get_finished's finished_recving set. Until
# the worker sees build_connector_worker_meta called, its report travels there, one
# string per fact. Across TP ranks the set is a union (or rank 0's alone): a hash
# counts as loaded when some rank loaded it and no rank failed it.
_RECV_LOADED = "ecx.loaded:"
_RECV_FAILED_LOAD = "ecx.failed_load:"
_RECV_RECLAIMED = "ecx.reclaimed:"
_RECV_FAILED_SAVE = "ecx.failed_save:"
_RECV_PENDING_SAVES = "ecx.pending_saves:"
_RECV_RAN_WITHOUT_TOKENS = "ecx.ran_without_tokens"
_RECV_STORE_READY = "ecx.store_ready:"
_RECV_STORE_FAILED = "ecx.store_failed:"
_RECV_STORE_DROPPED = "ecx.store_dropped:"


def report_to_finished_recving(report: tuple | None, pending_changed: bool, ran_without_tokens: bool = False) -> set[str]:
    """A core worker report as finished_recving entries (see above)."""
    out = {_RECV_RAN_WITHOUT_TOKENS} if ran_without_tokens else set()
    if report is None:
        return out
    loaded, failed_loads, reclaimed, pending_saves, failed_saves = report[:5]
    if len(report) >= 8:
        out |= {_RECV_STORE_READY + h for h in report[5]}
        out |= {_RECV_STORE_FAILED + h for h in report[6]}
        out |= {_RECV_STORE_DROPPED + h for h in report[7]}
    out |= {_RECV_LOADED + h for h in loaded}
    out |= {_RECV_FAILED_LOAD + h for h in failed_loads}
    out |= {_RECV_RECLAIMED + h for h in reclaimed}
    out |= {_RECV_FAILED_SAVE + r for r in failed_saves}
    if pending_changed:
        out.add(_RECV_PENDING_SAVES + ("1" if pending_saves else "0"))
    return out


def report_from_finished_recving(entries: Any) -> tuple[ECXWorkerMetadata | None, bool | None]:
    """(the report in a finished_recving set or None when it holds none of ECX's
    entries, pending_saves or None when no entry states it: the caller keeps the last
    stated value)."""
    meta = ECXWorkerMetadata()
    found = False
    pending: bool | None = None
    for entry in entries or ():
        if not isinstance(entry, str):
            continue
        for prefix, target in (
            (_RECV_LOADED, meta.loaded),
            (_RECV_FAILED_LOAD, meta.failed_loads),
            (_RECV_RECLAIMED, meta.reclaimed),
            (_RECV_FAILED_SAVE, meta.failed_saves),
            (_RECV_STORE_READY, meta.store_ready),
            (_RECV_STORE_FAILED, meta.store_failed),
            (_RECV_STORE_DROPPED, meta.store_dropped),
        ):
            if entry.startswith(prefix):
                target.add(entry[len(prefix) :])
                found = True
                break
        else:
            if entry.startswith(_RECV_PENDING_SAVES):
                pending = entry.endswith("1")
                found = True
            elif entry == _RECV_RAN_WITHOUT_TOKENS:
                meta.ran_without_tokens = True
                found = True
    if not found:
        return None, None
    meta.loaded -= meta.failed_loads
    meta.store_ready -= meta.store_failed
    return meta, pending


# ------------------------------------------------------------------ helpers


def _torch():
    import torch

    return torch


def _cuda_available() -> bool:
    try:
        return bool(_torch().cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA runtime: host memory then
        return False


def _is_role(role: Any, name: str) -> bool:
    return role is getattr(ECConnectorRole, name, None) or getattr(role, "name", None) == name


# ------------------------------------------------------------------ connector


class ECXConnector(ECConnectorBase):
    """vLLM EC connector backed by the ECX engine (see the module docstring)."""

    # The scheduler side's clock: None = the steady clock; tests set an
    # ecx._core.ManualClock to move deadlines without waiting for them.
    scheduler_clock: Any = None

    def __init__(self, vllm_config: Any, role: Any):
        super().__init__(vllm_config=vllm_config, role=role)
        self._closed = False
        self._scheduler: Any = None
        self._worker: Any = None
        self._metrics_server: Any = None
        is_worker = _is_role(role, "WORKER")
        ec_transfer_config = vllm_config.ec_transfer_config
        layout = parallel_layout(vllm_config, worker=is_worker)
        # ValueError naming the offending key: a configuration mistake stops the engine at startup.
        self._config = _core.load_config(
            ecx_config_json(
                ec_transfer_config,
                cuda_available=_cuda_available(),
                model_config=getattr(vllm_config, "model_config", None),
            ),
            **layout,
        )
        if self._config.log_level != "info":
            _core.set_log_level(self._config.log_level)
        if is_worker:
            self._init_worker(vllm_config)
        else:
            self._init_scheduler(vllm_config)
        logger.info(
            "ECX %s connector ready: role=%s tp=%d/%d pp=%d/%d dp=%d/%d control=%s",
            "worker" if is_worker else "scheduler",
            self._config.role,
            self._config.tp_rank,
            self._config.tp_size,
            self._config.pp_rank,
            self._config.pp_size,
            self._config.dp_index,
            self._config.dp_size,
            self._config.control_address(self._config.tp_rank) if self._config.is_consumer else "-",
        )

    # ---------------------------------------------------------------- setup

    def _init_scheduler(self, vllm_config: Any) -> None:
        width = model_hidden_width(vllm_config)
        if self._config.is_producer and width <= 0 and self._config.encoder_output_width <= 0:
            logger.warning(
                "ECX cannot tell the encoder output width from the model config; pushes fail until "
                "ec_connector_extra_config.encoder_output_width is set"
            )
        self._scheduler = _core.SchedulerCoordinator(
            self._config, model_dtype_name(vllm_config), width, type(self).scheduler_clock
        )
        # The hook vLLM calls most (every item of every waiting request, each step) is
        # the scheduler's own C function, bound here instead of through a Python method:
        # it answers False once the scheduler is closed (shutdown), and the loads
        # confirmed on vLLM's behalf (below) live in the scheduler, which confirms them
        # before it answers.
        self.has_cache_item = self._scheduler.fast_has_cache_item
        if self._config.metrics_port:
            # After every worker rank's port (metrics_port + dp_index * tp_size + tp_rank):
            # one per DP replica, in the EngineCore process that runs the scheduler.
            c = self._config
            port = c.metrics_port + c.dp_size * c.tp_size + c.dp_index
            try:
                self._scheduler.serve_metrics(c.ec_ip, port)
            except (RuntimeError, ValueError) as e:
                logger.warning("ECX scheduler metrics endpoint on port %d not started: %s", port, e)
        self._views = RequestViews()
        self._metadata = PlaceholderMetadataResolver(getattr(vllm_config, "model_config", None))
        # What this vLLM does is learnt from what it calls, never from its version:
        # loads start synchronous (they work whatever the model runner does) and
        # become asynchronous once a worker report shows the connector runs on
        # steps without tokens; a request ECX cannot serve is failed through
        # take_unavailable_requests, unless a whole engine step passed without vLLM
        # polling it: then it is encoded locally instead.
        self._pending_saves = False
        # (A producer with the cross-encoder cache too: its store prefetches are answered
        # in worker reports, so until they are seen it trusts the store's presence index.)
        if self._config.is_consumer or self._config.cross_encoder_cache:
            self._scheduler.set_asynchronous_loads(False)
        self._unavailable_polled = False
        self._steps_planned = 0
        # Whether vLLM runs the workers' EC hooks on steps without tokens (None:
        # not seen yet). Where it does not (MRv2 before its no_forward EC path),
        # such a step does no connector work, so has_pending_push_work must not
        # keep the engine stepping: the pushes finish in the background, but no
        # worker would report it, and the engine would never go idle.
        self._no_token_steps_reach_workers: bool | None = None
        self._unanswered_no_token_steps = 0
        # Whether the workers' reports reach this side at all (None: not known yet).
        # MRv2 at 6adad087 returns a PD step's ECConnectorOutput only from its
        # encoder-only branch, so no load is ever confirmed there; loads that such a
        # vLLM ran (synchronously, in the step that planned them) are then confirmed
        # here, once a later step is being planned. Without that, an entry vLLM evicts
        # and allocates again in one step is neither kept nor loaded again, and vLLM
        # stops on "Encoder cache miss".
        self._reports_reach_scheduler: bool | None = None
        # (step planned, hashes loaded, requests scheduled in that step)
        self._loads_awaiting_report: list[tuple[int, list[str], set[str]]] = []
        try:  # steps vLLM keeps in flight (2 with async scheduling, PP + 1 with PP)
            self._steps_in_flight = max(1, int(getattr(vllm_config, "max_concurrent_batches", 2)))
        except Exception:  # noqa: BLE001 - a config that cannot say: assume async scheduling
            self._steps_in_flight = 2

    def _init_worker(self, vllm_config: Any) -> None:
        self._device_config = getattr(vllm_config, "device_config", None)
        self._load_device: Any = None
        # Producer state: the live encoder cache (vLLM hands it to save_caches), the
        # hashes submitted pushes still need a source for (by requesting request), and
        # the metadata whose pushes were submitted.
        self._encoder_cache: dict | None = None
        self._awaiting_source: dict[str, set[str]] = {}
        self._submitted_meta: Any = None
        self._store_loaded_meta: Any = None  # the metadata whose store loads ran
        # This step's store candidates not yet handed to save_cache (which publishes them).
        self._store_wanted: set[str] = set()
        # Consumer: the tensors this rank loaded into the encoder cache, until a step
        # frees them (see start_load_caches). Producer: those loaded from the store.
        self._loaded_tensors: dict[str, Any] = {}
        # Whether vLLM asks for worker metadata (else reports go in finished_recving),
        # whether it ran the connector on a step without tokens, and the last
        # pending-saves state reported through finished_recving.
        self._worker_meta_seen = False
        self._ran_without_tokens = False
        self._reported_pending = False  # the scheduler side starts at False too
        # Started here, not lazily: a consumer's shards must listen before the first
        # request reaches this instance, because its pushes arrive first.
        self._worker = _core.WorkerCoordinator(self._config)
        if self._config.metrics_port:
            port = self._config.metrics_port + self._config.dp_index * self._config.tp_size + self._config.tp_rank
            try:
                self._metrics_server = _core.MetricsServer(self._config.ec_ip, port)
            except (RuntimeError, ValueError) as e:
                logger.warning("ECX metrics endpoint on port %d not started: %s", port, e)

    # ---------------------------------------------------------------- scheduler side

    def has_cache_item(self, identifier: str) -> bool:
        """A scheduler-side connector replaces this with its scheduler's C function."""
        return False

    def has_caches(self, request: Any) -> list[bool]:
        """vLLM before Feb 2026 asked per request instead of per item."""
        return [self.has_cache_item(f.identifier) for f in (getattr(request, "mm_features", None) or ())]

    def ensure_cache_available(self, request: Any, num_computed_tokens: int = 0, *args: Any, **kwargs: Any) -> bool:
        if self._scheduler is None or self._closed or not getattr(request, "mm_features", None):
            return True
        return self._scheduler.ensure_cache_available(self._views.get(request), int(num_computed_tokens))

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        if self._scheduler is None or self._closed:
            return
        self._scheduler.update_state_after_alloc(self._views.get(request), int(index))

    def update_state_after_free(self, request: Any, index: int) -> None:
        if self._scheduler is None or self._closed:
            return
        self._scheduler.update_state_after_free(self._views.get(request), int(index))

    def build_connector_meta(self, scheduler_output: Any) -> ECXConnectorMetadata:
        if self._scheduler is None or self._closed:
            return ECXConnectorMetadata()
        freed = [str(h) for h in (getattr(scheduler_output, "free_encoder_mm_hashes", None) or ())]
        preempted = [str(r) for r in (getattr(scheduler_output, "preempted_req_ids", None) or ())]
        no_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
        if self._unanswered_no_token_steps >= 2 and self._no_token_steps_reach_workers is None:
            # Two earlier steps scheduled no tokens and no worker reported running the
            # connector in either; the first of them has completed even where vLLM
            # schedules a step ahead (async scheduling keeps two in flight).
            self._no_token_steps_reach_workers = False
            logger.info(
                "ECX: vLLM does not run the EC connector on steps without tokens; pushes in flight "
                "do not keep the engine stepping"
            )
        if no_tokens and self._no_token_steps_reach_workers is None:
            self._unanswered_no_token_steps += 1
        self._steps_planned += 1
        if self._steps_planned == 2 and not self._unavailable_polled:
            logger.info(
                "ECX: vLLM does not poll take_unavailable_requests; items ECX cannot deliver are encoded locally"
            )
            self._scheduler.set_unavailable_reaches_engine(False)
        finished_ids = {str(r) for r in (getattr(scheduler_output, "finished_req_ids", None) or ())}
        if self._reports_reach_scheduler is None and any(
            self._steps_planned - step >= self._steps_in_flight or (requests & finished_ids)
            for step, _, requests in self._loads_awaiting_report
        ):
            # A step that loaded has completed (vLLM keeps no more steps in flight, or a
            # request it scheduled has finished since) and no report came: none comes.
            self._reports_reach_scheduler = False
            logger.info(
                "ECX: vLLM does not hand the workers' EC output to the scheduler on steps that run the model; "
                "synchronous loads are confirmed when the next step is planned"
            )
            for _, hashes, _ in self._loads_awaiting_report:
                self._scheduler.confirm_loads_later(hashes)
            self._loads_awaiting_report.clear()
        meta = ECXConnectorMetadata.from_core(self._scheduler.build_connector_meta(freed, preempted), no_tokens)
        if self._config.is_consumer and not self._scheduler.asynchronous_loads:
            planned = [item.mm_hash for item in meta.loads if not item.local]
            if planned:
                if self._reports_reach_scheduler is False:
                    self._scheduler.confirm_loads_later(planned)
                elif self._reports_reach_scheduler is None:
                    scheduled = {str(r) for r in (getattr(scheduler_output, "num_scheduled_tokens", None) or {})}
                    self._loads_awaiting_report.append((self._steps_planned, planned, scheduled))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Worker reports arrive as worker metadata where vLLM has it, else in
        finished_recving (see report_to_finished_recving); a step may carry both."""
        if self._scheduler is None or self._closed:
            return
        reports = []
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        recving, pending = report_from_finished_recving(getattr(connector_output, "finished_recving", None))
        if any(r is not None and r.ran_without_tokens for r in (meta if isinstance(meta, ECXWorkerMetadata) else None, recving)):
            self._no_token_steps_reach_workers = True
        if isinstance(meta, ECXWorkerMetadata):
            reports.append(meta)
            self._pending_saves = meta.pending_saves
            if (
                meta.ran_without_tokens
                and (self._config.is_consumer or self._config.cross_encoder_cache)
                and not self._scheduler.asynchronous_loads
            ):
                logger.info(
                    "ECX: vLLM runs the EC connector on steps without tokens and reports worker metadata; "
                    "loads are asynchronous from now on"
                )
                self._scheduler.set_asynchronous_loads(True)
        if recving is not None:
            reports.append(recving)
            if pending is not None:
                self._pending_saves = pending
        if not reports:
            return
        if self._reports_reach_scheduler is None:
            self._reports_reach_scheduler = True
            self._loads_awaiting_report.clear()
        loaded: set[str] = set()
        failed: set[str] = set()
        reclaimed: set[str] = set()
        failed_saves: set[str] = set()
        store_ready: set[str] = set()
        store_failed: set[str] = set()
        store_dropped: set[str] = set()
        for report in reports:
            loaded |= report.loaded
            failed |= report.failed_loads
            reclaimed |= report.reclaimed
            failed_saves |= report.failed_saves
            store_ready |= report.store_ready
            store_failed |= report.store_failed
            store_dropped |= report.store_dropped
        self._scheduler.update_connector_output(
            sorted(loaded - failed),
            sorted(failed),
            sorted(reclaimed),
            self._pending_saves,
            sorted(failed_saves),
            sorted(store_ready - store_failed),
            sorted(store_failed),
            sorted(store_dropped),
        )

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """(False, ec_transfer_params). A producer reports, per item identifier,
        {"item_indices", "transfer_id"?, "metadata"} plus "ec_items" [{mm_hash,
        transfer_id}] for every push prepared for the request; the proxy forwards
        these to the consumer."""
        if self._scheduler is None or self._closed:
            return False, None
        view = self._views.get(request)
        try:
            delay_free, params_text = self._scheduler.request_finished(view)
        finally:
            self._views.pop(view.request_id)
        if params_text is None:
            return bool(delay_free), None
        params = json.loads(params_text)
        features = getattr(request, "mm_features", None) or ()
        for key, entry in params.items():
            if key == "ec_items" or not isinstance(entry, dict):
                continue
            indices = entry.get("item_indices") or ()
            metadata: dict[str, Any] = {}
            if indices and indices[0] < len(features):
                metadata = self._metadata.metadata_for(features[indices[0]])
            entry["metadata"] = metadata
        return bool(delay_free), params

    def take_unavailable_requests(self) -> set[str]:
        if self._scheduler is None or self._closed:
            return set()
        if not self._unavailable_polled:
            # vLLM fails what this returns: a request ECX cannot serve fails
            # (retryably) instead of being encoded locally.
            self._unavailable_polled = True
            self._scheduler.set_unavailable_reaches_engine(True)
        return set(self._scheduler.take_unavailable_requests())

    def has_pending_push_work(self) -> bool:
        if self._scheduler is None or self._closed:
            return False
        if self._no_token_steps_reach_workers is False:
            return False  # a step without tokens would do no connector work (see __init__)
        return self._scheduler.has_pending_push_work()

    # ---------------------------------------------------------------- worker side

    def start_worker_services(self) -> None:
        """Nothing left to do: the worker coordinator started with the connector."""

    def register_caches(self, ec_caches: Any = None, **kwargs: Any) -> None:
        """Placeholder hook in vLLM; ECX lands payloads in its own pool."""

    def _bound_metadata(self) -> ECXConnectorMetadata | None:
        meta = getattr(self, "_connector_metadata", None)
        return meta if isinstance(meta, ECXConnectorMetadata) else None

    def _device_for_loads(self) -> Any:
        if self._load_device is None:
            torch = _torch()
            device = getattr(self._device_config, "device", None)
            device_type = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
            if device_type == "cuda" and torch.cuda.is_available():
                # The current device, so TP ranks do not all land on cuda:0.
                self._load_device = torch.device("cuda", torch.cuda.current_device())
            else:
                self._load_device = torch.device("cpu")
        return self._load_device

    def _allocator(self, staged: dict[str, Any]):
        """allocate(mm_hash, shape, dtype) for the C++ loads: a fresh tensor on the load
        device, kept in `staged` (the caller keeps only those reported loaded)."""
        torch = _torch()
        device = self._device_for_loads()

        def allocate(mm_hash: str, shape: list[int], dtype: str) -> tuple[int, bool, int]:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            staged[mm_hash] = tensor
            data_ptr, _, is_cuda, index = tensor_source(tensor)
            return data_ptr, is_cuda, index

        return allocate

    def _adopter(self, staged: dict[str, Any], loads: list) -> Any:
        """adopt(mm_hash, view) for zero_copy_loads on a CPU engine: the encoder-cache
        tensor is a view of the landed slot (torch.frombuffer keeps the view, and with
        it the slot, alive until vLLM drops the tensor). None (copy) otherwise: a GPU
        engine needs its copy on the device anyway."""
        if not self._config.zero_copy_loads or self._device_for_loads().type != "cpu":
            return None
        torch = _torch()
        specs = {item.mm_hash: (item.shape, item.dtype) for item in loads}

        def adopt(mm_hash: str, view: Any) -> None:
            shape, dtype = specs[mm_hash]
            if view.nbytes == 0:  # frombuffer refuses an empty buffer; nothing to share
                staged[mm_hash] = torch.empty(shape, dtype=getattr(torch, dtype))
                return
            staged[mm_hash] = torch.frombuffer(view, dtype=getattr(torch, dtype)).view(shape)

        return adopt

    def _load_from_store(self, encoder_cache: dict | None) -> None:
        """Producer with the cross-encoder cache: reads the bound metadata's store loads
        into the encoder cache, once per step, and binds each to the pushes waiting for
        it (no save_caches call comes for an item that was not encoded). vLLM calls
        start_load_caches on consumers only, so every producer hook gets here, after
        _submit_pushes."""
        meta = self._bound_metadata()
        if meta is None or meta is self._store_loaded_meta:
            return
        self._store_loaded_meta = meta
        for mm_hash in meta.freed:
            self._loaded_tensors.pop(mm_hash, None)
        if not meta.store_loads and not meta.store_prefetches:
            return
        staged: dict[str, Any] = {}
        loaded, failed = self._worker.start_load_caches(
            [],
            [],
            self._allocator(staged),
            [item.to_core() for item in meta.store_loads],
            [item.to_core() for item in meta.store_prefetches],
        )
        for mm_hash in failed:
            # Reported in failed_loads: the scheduler forgets it and the next request encodes it.
            logger.warning(
                "ECX could not load mm_hash=%s from the cross-encoder cache; it is encoded next time", mm_hash
            )
        for mm_hash in loaded:
            tensor = staged.get(mm_hash)
            if tensor is None:
                continue
            if encoder_cache is not None:
                encoder_cache[mm_hash] = tensor
            # Kept (shared with the cache) for pushes of later steps, until a step frees it.
            self._loaded_tensors[mm_hash] = tensor
            self._save_tensor(mm_hash, tensor)

    def start_load_caches(self, encoder_cache: dict, **kwargs: Any) -> None:
        if self._worker is None or self._closed:
            return
        if self.is_producer and self._config.cross_encoder_cache:
            self._encoder_cache = encoder_cache
            self._submit_pushes()
            self._load_from_store(encoder_cache)
        if not self.is_consumer:
            return
        meta = self._bound_metadata()
        if meta is None:
            return
        if meta.no_tokens:
            self._ran_without_tokens = True
        # vLLM dropped this step's freed entries before calling us. Those it also
        # allocated again in this step (retained) get back the tensor this rank
        # loaded (kept below), so nothing is copied or transferred again.
        for mm_hash in meta.freed:
            encoder_cache.pop(mm_hash, None)
            self._loaded_tensors.pop(mm_hash, None)
        for mm_hash in meta.retained:
            kept = self._loaded_tensors.get(mm_hash)
            if kept is not None:
                encoder_cache[mm_hash] = kept
        # Items the proxy routed to the shared store (a producer loads its own above).
        store_loads = [] if self.is_producer else meta.store_loads
        store_prefetches = [] if self.is_producer else meta.store_prefetches
        if not meta.loads and not store_loads and not store_prefetches:
            return
        staged: dict[str, Any] = {}
        present = [item.mm_hash for item in meta.loads if item.mm_hash in encoder_cache]
        loaded, failed = self._worker.start_load_caches(
            [item.to_core() for item in meta.loads],
            present,
            self._allocator(staged),
            [item.to_core() for item in store_loads],
            [item.to_core() for item in store_prefetches],
            self._adopter(staged, meta.loads),
        )
        for mm_hash in failed:
            logger.warning("ECX could not load mm_hash=%s; its request is failed", mm_hash)
        # Only complete copies become visible; the C++ side waited for device copies.
        for mm_hash in loaded:
            tensor = staged.get(mm_hash)
            if tensor is not None:
                encoder_cache[mm_hash] = tensor
                # Shares the cache's tensor: no extra memory while vLLM holds it, and
                # released when a later step frees it.
                self._loaded_tensors[mm_hash] = tensor

    def start_save_caches(self, encoder_cache: dict | None = None, **kwargs: Any) -> None:
        if self._worker is None or self._closed or not self.is_producer:
            return
        if encoder_cache is not None:
            self._encoder_cache = encoder_cache
        self._submit_pushes()
        self._load_from_store(self._encoder_cache)

    def _submit_pushes(self) -> None:
        """Hands the bound metadata's pushes to the push engine, once per step, before
        any source is bound (vLLM releases that never call start_save_caches reach
        this from save_caches or get_finished). Outputs already in the encoder cache
        (encoded in an earlier step, shared by another request) are bound right away:
        no save_caches call will come for them."""
        meta = self._bound_metadata()
        if meta is None or meta is self._submitted_meta:
            return
        self._submitted_meta = meta
        self._store_wanted = {c.mm_hash for c in meta.store_candidates}
        if not meta.pushes and not meta.store_candidates:
            return
        self._worker.start_save_caches(
            [p.to_core() for p in meta.pushes], [c.to_core() for c in meta.store_candidates]
        )
        for push in meta.pushes:
            self._awaiting_source.setdefault(push.mm_hash, set()).add(push.request_id)
        cache = self._encoder_cache
        for mm_hash in {p.mm_hash for p in meta.pushes}:
            tensor = cache.get(mm_hash) if cache is not None else None
            if tensor is None:
                tensor = self._loaded_tensors.get(mm_hash)  # loaded from the store earlier
            if tensor is not None:
                self._save_tensor(mm_hash, tensor)

    def _save_tensor(self, mm_hash: str, tensor: Any) -> None:
        pushed = self._awaiting_source.pop(mm_hash, None) is not None
        publish = mm_hash in self._store_wanted
        self._store_wanted.discard(mm_hash)
        if not pushed and not publish:
            return  # no push wants it (or it was bound already), nor the shared store
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        data_ptr, nbytes, is_cuda, _ = tensor_source(tensor)
        if is_cuda:
            # The encoder wrote it on the current stream; the staging copy runs on
            # ECX's own stream and must not start before those kernels finish.
            _torch().cuda.current_stream(tensor.device).synchronize()
        if is_cuda or not self._config.zero_copy_saves:
            error = self._worker.save_cache(mm_hash, data_ptr, nbytes, is_cuda)
        else:
            # Sent from the tensor's own memory; ECX holds the tensor until then.
            error = self._worker.lend_cache(mm_hash, data_ptr, nbytes, tensor)
        if error is not None:
            logger.debug("ECX could not stage mm_hash=%s: %s", mm_hash, error)

    def save_caches(self, encoder_cache: dict, mm_hash: str, **kwargs: Any) -> None:
        if self._worker is None or self._closed or not self.is_producer:
            return  # vLLM's MRv1 calls this on every role
        self._encoder_cache = encoder_cache
        self._submit_pushes()
        self._load_from_store(encoder_cache)
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            logger.warning("ECX save_caches: mm_hash=%s is not in the encoder cache", mm_hash)
            return
        self._save_tensor(mm_hash, tensor)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None or self._closed:
            return None, None
        if self.is_producer:
            self._submit_pushes()
            self._load_from_store(self._encoder_cache)
            finished = {str(r) for r in (finished_req_ids or ())}
            if finished:
                for mm_hash in list(self._awaiting_source):
                    waiting = self._awaiting_source[mm_hash]
                    waiting -= finished
                    if not waiting:
                        del self._awaiting_source[mm_hash]
        if finished_req_ids:
            self._worker.get_finished(sorted(str(r) for r in finished_req_ids))
        meta = self._bound_metadata()
        ran_without_tokens = meta is not None and meta.no_tokens
        if ran_without_tokens:
            self._ran_without_tokens = True
        if self._worker_meta_seen:
            return None, None
        # No worker metadata seen (yet): this step's report goes in finished_recving.
        report = self._worker.build_worker_meta()
        pending_changed = False
        if report is not None:
            pending = bool(report[3])
            pending_changed = pending != self._reported_pending
            self._reported_pending = pending
        recving = report_to_finished_recving(report, pending_changed, ran_without_tokens)
        return None, (recving or None)

    def build_connector_worker_meta(self) -> ECXWorkerMetadata | None:
        if self._worker is None or self._closed:
            return None
        self._worker_meta_seen = True
        meta = self._bound_metadata()
        if meta is not None and meta.no_tokens:
            self._ran_without_tokens = True
        report = self._worker.build_worker_meta()
        return None if report is None else ECXWorkerMetadata.from_core(report, self._ran_without_tokens)

    # ---------------------------------------------------------------- both

    def shutdown(self) -> None:
        """Stops ECX's threads and sockets and frees its pools. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.shutdown()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        if self._worker is not None:
            self._encoder_cache = None  # the engine's cache is not ours to keep alive
            self._loaded_tensors.clear()

    def worker_counters(self) -> dict[str, Any]:
        """Pool and push counters of this worker (diagnostics)."""
        if self._worker is None or self._closed:
            return {}
        return self._worker.counters()

    def store_counters(self) -> dict[str, Any]:
        """Cross-encoder cache counters of this worker (diagnostics; zeros without it)."""
        if self._worker is None or self._closed:
            return {}
        return self._worker.store_counters()

    def scheduler_stats(self) -> dict[str, Any]:
        """Counters of the scheduler-side coordinator (diagnostics)."""
        if self._scheduler is None or self._closed:
            return {}
        return self._scheduler.stats()
