"""An E+PD cluster for the connector tests, each instance in its own process.

encoder_main and pd_main run one vLLM test-double instance each (an encoder with
ec_producer, a PD instance with ec_consumer and TP = 2) with ECXConnector loaded
the way vLLM loads it; the test process plays vLLM's EPD proxy and talks to them
through multiprocessing queues. Between the instances everything is real ECX:
ZeroMQ control sockets, readiness events and UCX over loopback.
"""

from __future__ import annotations

import os
import queue
import random
import socket
import time
from typing import Any

WIDTH = 64
PD_CACHE_ROWS = 2048  # the PD instance's encoder cache, in rows of WIDTH


def _ephemeral_port_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(count: int) -> int:
    """A base port with `count` consecutive ports free on 127.0.0.1 (bind-probe).

    Below the ephemeral range when it leaves room: the instances' data planes listen
    on port 0 and could otherwise take a port of the block before it is bound."""
    low = 10000
    high = _ephemeral_port_low() - count
    if high <= low + 1000:
        low, high = 1024, 65535 - count
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(low, high)
        sockets = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free port range on 127.0.0.1")


def extra_config(**overrides: Any) -> dict[str, Any]:
    extra = {
        "control_timeout_s": 5,
        "push_wait_timeout_s": 20,
        "shutdown_drain_timeout_s": 5,
        "huge_pages": False,
    }
    extra.update(overrides)
    return {k: v for k, v in extra.items() if v is not None}  # None: ECX's default


def vllm_config(role: str, port: int, tp: int, **extra: Any):
    from vllm.config import ECTransferConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECXConnector",
            ec_connector_module_path="ecx.vllm",
            ec_role=role,
            ec_ip="127.0.0.1",
            ec_port=port,
            ec_buffer_device="cpu",
            ec_buffer_size=64 * 1024 * 1024,
            ec_connector_extra_config=extra_config(**extra),
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )


def _serve(engine, inbox, outbox, on_stop) -> None:
    """Steps the engine while it has work; admits the proxy's requests between steps.

    ("probe",) answers with the engine's counters. A ("batch", [(request_id,
    items, params), ...]) message is admitted as a whole,
    in its order, once the connector has every input of every request in it, so
    that one step schedules all of them (a test's way to build a particular step)."""
    from vllm._double_engine import make_request

    stopping = False
    staged: list = []

    def handle(message: tuple) -> None:
        nonlocal stopping
        if message[0] == "request":
            _, request_id, items, params = message
            engine.add_request(make_request(request_id, items, params))
        elif message[0] == "batch":
            staged.extend(make_request(*entry) for entry in message[1])
        elif message[0] == "probe":
            outbox.put(("probe", {"evicted_and_reallocated": engine.evicted_and_reallocated}))
        elif message[0] == "stop":
            stopping = True

    while True:
        try:
            while True:
                handle(inbox.get_nowait())
        except queue.Empty:
            pass
        if staged and all(engine.scheduler.ensure_cache_available(r, 0) for r in staged):
            for r in staged:
                engine.add_request(r)
            staged.clear()
        if engine.has_requests():
            engine.step()
            finished = engine.take_finished()
            for f in finished:
                outbox.put(("finished", f.request_id, f.status, f.ec_transfer_params, f.detail, f.provenance))
            if not finished:
                time.sleep(0.0005)  # waiting on the network: do not starve the other instance of CPU
        elif stopping and not staged:
            break
        else:
            try:  # idle: wait for the proxy's next message
                handle(inbox.get(timeout=0.05))
            except queue.Empty:
                pass
    outbox.put(("stopping", on_stop()))


def encoder_main(port: int, inbox, outbox, profile: str = "newer") -> None:
    """The encoder instance (ec_producer, TP = 1), driven as vLLM build `profile` does."""
    os.environ["UCX_TLS"] = "tcp"
    from vllm._double_engine import EngineDouble

    engine = EngineDouble(
        vllm_config("ec_producer", port, 1),
        encode_only=True,
        cache_rows=2048,
        profile=profile,
        call_start_save_caches=profile == "newer",
    )
    outbox.put(("ready", None))

    def on_stop() -> dict[str, Any]:
        # The engine may go idle while its last pushes still finish in the background
        # (where a step without tokens does no connector work, has_pending_push_work
        # answers no; seen with the 6adad087 profiles on a loaded machine): wait,
        # bounded, for them to give their staging back, so that what is left at the
        # deadline is a leak.
        deadline = time.monotonic() + 10.0
        counters = engine.workers[0].connector.worker_counters()
        while counters["staging_used_bytes"] != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
            counters = engine.workers[0].connector.worker_counters()
        stats = engine.scheduler.scheduler_stats()
        engine.shutdown()
        engine.shutdown()  # idempotent
        return {"counters": counters, "stats": stats, "local_encodes": engine.workers[0].local_encodes}

    _serve(engine, inbox, outbox, on_stop)


def pd_main(port: int, inbox, outbox, profile: str = "newer") -> None:
    """The PD instance (ec_consumer, TP = 2: two workers with their own caches),
    driven as vLLM build `profile` does."""
    os.environ["UCX_TLS"] = "tcp"
    from vllm._double_engine import EngineDouble

    # A small encoder cache, like the producer's: entries are evicted all the time,
    # and some are evicted and allocated again in one step (the connector restores
    # what the workers dropped).
    engine = EngineDouble(
        vllm_config("ec_consumer", port, 2), encode_only=False, cache_rows=PD_CACHE_ROWS, profile=profile
    )
    outbox.put(("ready", engine.workers[0].connector._config.control_address(0)))

    def on_stop() -> dict[str, Any]:
        # Let the last remote cancels and frees settle: a few idle steps, bounded.
        deadline = time.monotonic() + 5
        counters: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            engine.step()
            counters = [w.connector.worker_counters() for w in engine.workers]
            if all(c["pool_used_bytes"] == c["resident_bytes"] for c in counters):
                break
            time.sleep(0.01)
        stats = engine.scheduler.scheduler_stats()
        engine.shutdown()
        engine.shutdown()  # idempotent
        return {
            "counters": counters,
            "stats": stats,
            "local_encodes": [w.local_encodes for w in engine.workers],
            "reencoded_after_eviction": sorted(engine.reencoded_after_eviction),
        }

    _serve(engine, inbox, outbox, on_stop)


def run_until_done(engine, count: int, deadline_s: float) -> dict:
    """Steps a vLLM-double engine until `count` requests finished or `deadline_s`
    passed (a hung engine fails its test instead of hanging CI); finished by id."""
    done = {}
    deadline = time.monotonic() + deadline_s
    while len(done) < count and time.monotonic() < deadline:
        engine.step()
        for f in engine.take_finished():
            done[f.request_id] = f
    return done
