"""ECX: encoder-cache exchange for disaggregated multimodal LLM serving.

The heavy lifting is in the C++ core (``ecx._core``); this package is its thin
Python face and the vLLM EC connector (``ecx.vllm``, which needs vLLM).

Importing ``ecx`` routes the core's C++ log records to Python's ``logging``
(loggers ``ecx.<component>``, children of ``ecx``).
"""

import atexit as _atexit

from ecx._core import (
    Config,
    __version__,
    config_keys,
    detach_python_logging,
    dtype_item_size,
    flush_logs,
    load_config,
    metrics_snapshot,
    metrics_text,
    parse_config,
    set_log_level,
)
from ecx._core import attach_python_logging as _attach_python_logging

_attach_python_logging()
# Stop the delivery thread while the interpreter is still whole: a thread that
# reaches for the GIL of a finalizing interpreter hangs.
_atexit.register(detach_python_logging)

__all__ = [
    "Config",
    "__version__",
    "config_keys",
    "detach_python_logging",
    "dtype_item_size",
    "flush_logs",
    "load_config",
    "metrics_snapshot",
    "metrics_text",
    "parse_config",
    "set_log_level",
]
