"""--pid and --comm filters are applied in the kernel: other processes' requests never become
records (checked on the kernel's own submitted-record counter, not only on spans)."""

from __future__ import annotations

import pytest
from harness import Agent, free_ports, new_traceparent, raw_request, server
from tracejoin.core.model import KIND_SERVER
from tracejoin.kernel.probes import ProbeConfig

pytestmark = pytest.mark.privileged


def _hit(port: int) -> int:
    tp, trace_id, _ = new_traceparent()
    raw_request(
        port,
        f"GET /f HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\nConnection: close\r\n\r\n".encode(),
    )
    return trace_id


@pytest.mark.parametrize("by", ["pid", "comm"])
def test_only_the_selected_process_is_traced(require_root, by):
    go_port, py_port = free_ports(2)
    comm = f"tjf{go_port}"  # unique: other Go servers on this host must not match
    with server("go", go_port, comm=comm) as go, server("threaded", py_port):
        cfg = ProbeConfig(pids=(go.pid,)) if by == "pid" else ProbeConfig(comm=comm)
        agent = Agent([], None, probe_config=cfg)
        agent.start()
        try:
            wanted = [_hit(go_port) for _ in range(3)]
            unwanted = [_hit(py_port) for _ in range(3)]
            spans = agent.wait_for(
                lambda sp: len({s.trace_id for s in sp if s.kind == KIND_SERVER} & set(wanted)) == 3
            )
            submitted = agent.pipeline.kernel_counters()["records_submitted"]
        finally:
            agent.shutdown()
    seen = {s.trace_id for s in spans if s.kind == KIND_SERVER}
    assert set(wanted) <= seen
    assert not set(unwanted) & seen
    assert submitted == 3  # the kernel never emitted records for the other process
