"""ECX: encoder-cache exchange for disaggregated multimodal LLM serving.

The heavy lifting is in the C++ core (``ecx._core``); this package is its thin
Python face and the vLLM EC connector (``ecx.vllm``).
"""

from ecx._core import __version__, dtype_item_size, parse_config

__all__ = ["__version__", "dtype_item_size", "parse_config"]
