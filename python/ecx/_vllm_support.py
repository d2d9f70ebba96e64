"""Translation between vLLM's objects and the ECX core, without importing vLLM.

``ecx.vllm`` (the connector) uses these; they read vLLM's objects only through
attributes, defensively, because those objects change between vLLM releases.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any, Iterable

from ecx import _core

logger = logging.getLogger("ecx.vllm")

# vLLM's ECTransferConfig fields that ECX reads (docs/configuration.md). Other
# fields (ec_connector, ec_connector_module_path, ec_rank, ec_parallel_size) are
# vLLM's own business and are not forwarded.
_FORWARDED_FIELDS = ("ec_role", "ec_ip", "ec_port", "ec_buffer_size", "ec_buffer_device", "engine_id")


def default_store_model(model_config: Any) -> str | None:
    """The cross-encoder cache's model identity for vLLM's model config: "<model>@<revision>"
    ("main" without a revision), or None when the config names no model. Store keys are
    ':'-separated, so ':' (and spaces, control bytes) become '_'."""
    model = getattr(model_config, "model", None)
    if not model:
        return None
    revision = getattr(model_config, "revision", None) or "main"
    return "".join("_" if ch == ":" or ord(ch) <= 0x20 or ord(ch) == 0x7F else ch for ch in f"{model}@{revision}")


def ecx_config_json(ec_transfer_config: Any, *, cuda_available: bool, model_config: Any = None) -> str:
    """The ECX configuration JSON for vLLM's ECTransferConfig (model_config: vLLM's, for
    the default of store_model)."""
    doc: dict[str, Any] = {}
    for name in _FORWARDED_FIELDS:
        value = getattr(ec_transfer_config, name, None)
        if value is None:
            continue
        if name == "ec_buffer_size":
            value = int(value)  # vLLM's field is a float (1e9)
        doc[name] = value
    device = str(doc.get("ec_buffer_device", "cpu")).lower()
    if device.startswith("cuda") and not cuda_available:
        # vLLM's default is "cuda"; on a host without CUDA the pools live in host memory.
        logger.warning(
            "ec_buffer_device=%s but CUDA is not available in this process; ECX uses host memory (cpu)",
            doc["ec_buffer_device"],
        )
        doc["ec_buffer_device"] = "cpu"
    extra = getattr(ec_transfer_config, "ec_connector_extra_config", None) or {}
    if not isinstance(extra, dict):
        raise ValueError(f"ec_connector_extra_config must be an object, got {type(extra).__name__}")
    extra = dict(extra)
    if extra.get("cross_encoder_cache") is True and not extra.get("store_model"):
        # Entries are filed under the model identity: encoders serving the same model
        # and revision share them without being told.
        store_model = default_store_model(model_config)
        if store_model is not None:
            extra["store_model"] = store_model
    if extra:
        doc["ec_connector_extra_config"] = extra
    return json.dumps(doc)


def _first_attr(obj: Any, names: Iterable[str], default: Any) -> Any:
    for name in names:
        value = getattr(obj, name, None)
        if value is not None:
            return value
    return default


def parallel_layout(vllm_config: Any, *, worker: bool) -> dict[str, int]:
    """tp/pp/dp sizes of the engine, and this process's ranks (0 for the scheduler)."""
    pc = getattr(vllm_config, "parallel_config", None)
    layout = {
        "tp_size": int(_first_attr(pc, ("tensor_parallel_size",), 1)),
        "tp_rank": 0,
        "pp_size": int(_first_attr(pc, ("pipeline_parallel_size",), 1)),
        "pp_rank": 0,
        "dp_size": int(_first_attr(pc, ("data_parallel_size",), 1)),
        "dp_index": int(_first_attr(pc, ("data_parallel_index", "data_parallel_rank"), 0)),
    }
    if worker:
        layout["tp_rank"], layout["pp_rank"] = worker_ranks()
    return layout


def worker_ranks() -> tuple[int, int]:
    """(tp_rank, pp_rank) of this worker process, from vLLM's parallel state."""
    from vllm.distributed import parallel_state

    tp_rank = int(parallel_state.get_tensor_model_parallel_rank())
    pp_group = parallel_state.get_pp_group()
    pp_rank = getattr(pp_group, "rank_in_group", None)
    if pp_rank is None:
        pp_rank = 0 if getattr(pp_group, "is_first_rank", True) else 1
    return tp_rank, int(pp_rank)


def model_dtype_name(vllm_config: Any) -> str:
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    if dtype is None:
        return "bfloat16"
    return str(dtype)


def model_hidden_width(vllm_config: Any) -> int:
    """Width of one encoder output row as the model config states it (0 = unknown).

    The extra-config key encoder_output_width overrides this in the core; it is
    needed for models whose rows are wider (DeepStack, EVS position channels).
    """
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return 0
    for getter in ("get_inputs_embeds_size", "get_hidden_size"):
        fn = getattr(mc, getter, None)
        if callable(fn):
            try:
                width = int(fn())
                if width > 0:
                    return width
            except Exception:  # noqa: BLE001 - a model config that cannot answer is not fatal
                logger.debug("model_config.%s() failed", getter, exc_info=True)
    hf = getattr(mc, "hf_config", None)
    vision = getattr(hf, "vision_config", None)
    for candidate in (getattr(vision, "out_hidden_size", None), getattr(getattr(mc, "hf_text_config", None), "hidden_size", None)):
        if isinstance(candidate, int) and candidate > 0:
            return candidate
    return 0


def num_encoder_embeds(request: Any, index: int) -> int:
    for getter in ("get_num_encoder_embeds", "get_num_encoder_tokens"):  # renamed in v0.13
        fn = getattr(request, getter, None)
        if callable(fn):
            return int(fn(index))
    position = request.mm_features[index].mm_position
    get_num_embeds = getattr(position, "get_num_embeds", None)
    return int(get_num_embeds() if callable(get_num_embeds) else position.length)


def request_ec_transfer_params(request: Any) -> Any:
    """The request's ec_transfer_params (None = absent)."""
    params = getattr(request, "ec_transfer_params", None)
    if params is None:
        extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
        if isinstance(extra, dict):
            params = extra.get("ec_transfer_params")
    return params


def build_request_view(request: Any) -> _core.RequestView:
    features = []
    for i, feature in enumerate(getattr(request, "mm_features", None) or ()):
        position = feature.mm_position
        features.append(
            (
                str(feature.identifier),
                str(getattr(feature, "modality", "") or ""),
                int(position.offset),
                int(position.length),
                num_encoder_embeds(request, i),
                # The engine can encode the item itself only while the request carries
                # its media (vLLM's feature data; EngineCore refills it from its
                # receiver cache, so it is None only where no copy is left).
                getattr(feature, "data", None) is not None,
            )
        )
    params = request_ec_transfer_params(request)
    params_json = None
    if params is not None:
        try:
            params_json = json.dumps(params)
        except (TypeError, ValueError):
            params_json = "<ec_transfer_params is not JSON-serialisable>"  # parsed as malformed
    return _core.RequestView(str(request.request_id), features, params_json)


class RequestViews:
    """RequestView per live request id, built on first sight.

    A request's items and ec_transfer_params do not change while it lives, so the
    view is built once and every hook crosses into C++ with it directly. Entries
    go at request_finished; the bound only guards against an engine that never
    reports a finish.
    """

    def __init__(self, max_entries: int = 262_144) -> None:
        self._views: OrderedDict[str, _core.RequestView] = OrderedDict()
        self._max_entries = max_entries

    def get(self, request: Any) -> _core.RequestView:
        request_id = str(request.request_id)
        view = self._views.get(request_id)
        if view is None or view.num_features != len(getattr(request, "mm_features", None) or ()):
            view = build_request_view(request)
            self._views[request_id] = view
            if len(self._views) > self._max_entries:
                self._views.popitem(last=False)
        return view

    def pop(self, request_id: str) -> None:
        self._views.pop(str(request_id), None)

    def __len__(self) -> int:
        return len(self._views)


def _jsonable(value: Any) -> Any:
    """Tensors and numpy arrays become nested lists; plain values pass; else None."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        lost = any(new is None and old is not None for new, old in zip(items, value))
        return None if lost else items
    inner = getattr(value, "data", None)  # field elements wrap their tensor
    if inner is not None and inner is not value:
        return _jsonable(inner)
    return None


class PlaceholderMetadataResolver:
    """Which processed fields a consumer needs to size an item's placeholder without
    re-processing the media (e.g. image_grid_thw), from the model's multimodal
    processor; per modality, cached. Best effort: when the processor cannot say,
    the item is reported without metadata and the consumer processes the media itself.
    """

    def __init__(self, model_config: Any) -> None:
        self._model_config = model_config
        self._fields: dict[str, frozenset[str]] = {}

    def fields_for(self, modality: str) -> frozenset[str]:
        cached = self._fields.get(modality)
        if cached is not None:
            return cached
        fields: frozenset[str] = frozenset()
        try:
            from vllm.multimodal import MULTIMODAL_REGISTRY

            info = MULTIMODAL_REGISTRY.create_processor(self._model_config).info
            fields = frozenset(info.data_parser.placeholder_metadata_fields(modality))
        except Exception as e:  # noqa: BLE001 - best effort by design
            logger.warning(
                "ECX could not determine the placeholder metadata fields of modality %r (%s: %s); "
                "its items are reported without metadata and the consumer processes the media itself",
                modality,
                type(e).__name__,
                e,
            )
        self._fields[modality] = fields
        return fields

    def metadata_for(self, feature: Any) -> dict[str, Any]:
        data = getattr(feature, "data", None)
        if data is None:  # served from the processor cache: nothing to report
            return {}
        get_data = getattr(data, "get_data", None)
        values = get_data() if callable(get_data) else data
        if not hasattr(values, "get"):
            return {}
        out: dict[str, Any] = {}
        for field in sorted(self.fields_for(str(getattr(feature, "modality", "")))):
            value = _jsonable(values.get(field))
            if value is not None:
                out[field] = value
        return out


def tensor_source(tensor: Any) -> tuple[int, int, bool, int]:
    """(data_ptr, nbytes, is_cuda, device_index) of a contiguous tensor."""
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    device = tensor.device
    is_cuda = device.type == "cuda"
    return int(tensor.data_ptr()), nbytes, is_cuda, int(device.index or 0) if is_cuda else 0
