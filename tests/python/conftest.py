"""pytest setup for the Python suite: the vLLM test double goes on sys.path (it is
what `import vllm` finds here), and multi-process tests get loopback UCX over TCP."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_DOUBLE = HERE / "vllm_double"

if str(VLLM_DOUBLE) not in sys.path:
    sys.path.insert(0, str(VLLM_DOUBLE))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# Processes the tests spawn inherit these: TCP over loopback, no shared-memory or
# RDMA surprises on CI hosts.
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
