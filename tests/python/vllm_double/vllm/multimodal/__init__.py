"""Test double of vllm.multimodal: only the registry path that tells which processed
fields describe an item's placeholder (image_grid_thw for images). Not vLLM."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

_PLACEHOLDER_FIELDS = {"image": {"image_grid_thw"}}


class _DataParser:
    def placeholder_metadata_fields(self, modality: str) -> set[str]:
        if modality not in _PLACEHOLDER_FIELDS:
            raise KeyError(f"the model has no processor for modality {modality!r}")
        return set(_PLACEHOLDER_FIELDS[modality])


class _Registry:
    def create_processor(self, model_config: Any) -> Any:
        return SimpleNamespace(info=SimpleNamespace(data_parser=_DataParser()))


MULTIMODAL_REGISTRY = _Registry()
