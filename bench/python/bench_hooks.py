"""Per-call cost of the scheduler hook vLLM calls most, has_cache_item, from Python.

vLLM asks it for every item of every waiting request on every engine step. Measured
through the connector (what vLLM calls) and through ecx._core's general binding,
on a consumer and on a producer, next to two baselines timed in the same run: a
C function called with one str (dict.__contains__, the floor of any call into C)
and a Python method that returns False (the floor of a hook written in Python).
The engine is the vLLM test double of tests/python/vllm_double (vLLM itself is
not needed to time the hook).

  PYTHONPATH=build/python python3 bench/python/bench_hooks.py [--calls N] [--repeat R] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python" / "vllm_double"))
sys.path.insert(0, str(ROOT / "tests" / "python"))

import epd_cluster  # noqa: E402 - the suite's connector configuration and port probe


def make_connector(ec_role: str, port: int):
    """A scheduler-side connector, configured as the Python suite configures one."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = epd_cluster.vllm_config(ec_role, port, 1, encoder_output_width=16)
    return ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)


class _PythonHook:
    def has_cache_item(self, identifier: str) -> bool:
        return False


def per_call_us(fn, arg: str, calls: int, repeat: int) -> float:
    """Median over `repeat` runs of `calls` calls, in microseconds per call."""
    runs = timeit.repeat("fn(arg)", globals={"fn": fn, "arg": arg}, number=calls, repeat=repeat)
    return statistics.median(runs) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000, help="calls per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per series; the median is reported")
    parser.add_argument("--port", type=int, default=0, help="the consumers' first port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--json", help="write the series as a JSON list to FILE")
    args = parser.parse_args()
    if args.calls < 1 or args.repeat < 1:
        parser.error("--calls and --repeat must be at least 1")

    if args.port == 0:
        args.port = epd_cluster.free_port_range(16)
    identifier = "sha256:" + "0123456789abcdef" * 4  # a 64-hex mm_hash nobody holds
    rows: list[dict] = []
    floor_c = per_call_us({}.__contains__, identifier, args.calls, args.repeat)
    floor_py = per_call_us(_PythonHook().has_cache_item, identifier, args.calls, args.repeat)
    rows.append({"series": "baseline: C call (dict.__contains__)", "us_per_call": floor_c})
    rows.append({"series": "baseline: Python method", "us_per_call": floor_py})
    for role, port in (("ec_consumer", args.port), ("ec_producer", args.port + 8)):
        connector = make_connector(role, port)
        try:
            for path, fn in (
                ("connector", connector.has_cache_item),
                ("_core binding", connector._scheduler.has_cache_item),
            ):
                us = per_call_us(fn, identifier, args.calls, args.repeat)
                rows.append({"series": f"{role[3:]}: {path}", "us_per_call": us, "ratio_vs_c_call": us / floor_c})
        finally:
            connector.shutdown()

    print(f"has_cache_item from Python: median of {args.repeat} runs of {args.calls:,} calls (Python {sys.version.split()[0]})")
    print(f"{'series':40} {'us/call':>8} {'x C call':>8}")
    for row in rows:
        ratio = f"{row['ratio_vs_c_call']:.2f}" if "ratio_vs_c_call" in row else "-"
        print(f"{row['series']:40} {row['us_per_call']:8.3f} {ratio:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
