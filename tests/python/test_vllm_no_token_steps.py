"""has_pending_push_work against what vLLM runs on steps that schedule no tokens.

Found with the real-vLLM suite (tests/vllm_real): vLLM 6adad087's model runner V2
runs no EC hook on such a step, so an encoder whose last report said "pushes in
flight" never hears otherwise; has_pending_push_work stayed true and the engine never
went idle. The scheduler side now learns from the workers' reports whether those
steps reach them (worker metadata, or finished_recving where there is none)."""

from __future__ import annotations

from types import SimpleNamespace

import epd_cluster


def _scheduler_side(role: str = "ec_producer"):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = epd_cluster.vllm_config(role, epd_cluster.free_port_range(1), 1)
    return ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)


def _step(connector, tokens: int, finished_recving=None, worker_meta=None) -> None:
    connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=tokens))
    if finished_recving is not None or worker_meta is not None:
        connector.update_connector_output(
            SimpleNamespace(finished_sending=None, finished_recving=finished_recving,
                            ec_connector_worker_meta=worker_meta)
        )


def test_pushes_in_flight_stop_keeping_the_engine_busy_where_no_token_steps_reach_no_worker():
    c = _scheduler_side()
    try:
        _step(c, 10, finished_recving={"ecx.pending_saves:1"})
        assert c.has_pending_push_work()  # nothing known yet: one more step may report
        _step(c, 0)  # no EC hook ran: no report
        _step(c, 0)
        _step(c, 0)
        assert not c.has_pending_push_work()
    finally:
        c.shutdown()


def test_pushes_in_flight_keep_the_engine_busy_where_workers_run_on_no_token_steps():
    from ecx.vllm import ECXWorkerMetadata

    for report in (
        {"finished_recving": {"ecx.ran_without_tokens", "ecx.pending_saves:1"}},
        {"worker_meta": ECXWorkerMetadata(pending_saves=True, ran_without_tokens=True)},
    ):
        c = _scheduler_side()
        try:
            _step(c, 10, finished_recving={"ecx.pending_saves:1"})
            for _ in range(4):
                _step(c, 0, **report)
            assert c.has_pending_push_work()
            done = ({"finished_recving": {"ecx.ran_without_tokens", "ecx.pending_saves:0"}} if "finished_recving" in report
                    else {"worker_meta": ECXWorkerMetadata(pending_saves=False, ran_without_tokens=True)})
            _step(c, 0, **done)
            assert not c.has_pending_push_work()
        finally:
            c.shutdown()


def test_a_worker_on_a_no_token_step_says_so_in_finished_recving():
    from ecx.vllm import ECXConnectorMetadata, report_from_finished_recving

    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    config = epd_cluster.vllm_config("ec_producer", epd_cluster.free_port_range(1), 1)
    w = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    try:
        w.bind_connector_metadata(ECXConnectorMetadata(no_tokens=True))
        _, recving = w.get_finished(set())
        w.clear_connector_metadata()
        meta, _ = report_from_finished_recving(recving)
        assert meta is not None and meta.ran_without_tokens
        w.bind_connector_metadata(ECXConnectorMetadata(no_tokens=False))
        _, recving = w.get_finished(set())
        meta, _ = report_from_finished_recving(recving)
        assert meta is None or not meta.ran_without_tokens
    finally:
        w.shutdown()
