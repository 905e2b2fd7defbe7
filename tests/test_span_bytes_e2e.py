"""The object-free span path end to end: real BPF, the Go test server, curl, OTLP/HTTP to the
real Jaeger, read back through its query API. The agent here has one destination, OTLP (as
`tracejoin run` with an endpoint), so its server spans leave the span builder as bytes
(pipeline/span_bytes.py) and the sender places them in the request without re-encoding."""

from __future__ import annotations

import subprocess

import pytest
from harness import free_ports, new_traceparent, server
from jaeger import span_service, span_tags, the_server_span
from tracejoin.app import build_agent
from tracejoin.config import Settings
from tracejoin.core.metrics import Metrics
from tracejoin.exporters.http_sender import OtlpHttpExporter
from tracejoin.exporters.queue import BatchExportQueue
from tracejoin.kernel.probes import HttpProbes, ProbeConfig

pytestmark = [pytest.mark.privileged, pytest.mark.e2e]


@pytest.fixture(scope="module")
def otlp_only(jaeger, privileged):
    (port,) = free_ports(1)
    metrics = Metrics()
    dest = BatchExportQueue(
        OtlpHttpExporter(jaeger.otlp_http_traces_url), metrics, flush_interval_s=0.1, name="otlp"
    )
    app = build_agent(
        Settings(gpu=False, service_name="tj-span-bytes-e2e"),
        metrics,
        [dest],
        source=HttpProbes(ProbeConfig(ports=(port,)), metrics),
    )
    app.start()
    try:
        yield app, port, metrics
    finally:
        app.shutdown(5.0)


def test_a_span_over_the_object_free_path_reaches_jaeger_whole(otlp_only, jaeger):
    app, port, metrics = otlp_only
    assert app.pipeline is not None and app.pipeline.encode  # the path under test
    tp, trace_id, parent = new_traceparent()
    with server("go", port):
        subprocess.run(
            ["curl", "-sf", "-o", "/dev/null", "-H", f"traceparent: {tp}",
             f"http://127.0.0.1:{port}/items/42?secret=1"],
            check=True, timeout=10,
        )  # fmt: skip
        trace = jaeger.get_trace(f"{trace_id:032x}", timeout_s=20)
    span = the_server_span(trace, trace_id, parent)
    assert span["operationName"] == "GET /items/{id}"
    assert span_service(trace, span) == "tj-span-bytes-e2e"
    tags = span_tags(span)
    assert tags["http.request.method"] == "GET"
    assert tags["url.path"] == "/items/42"  # the query string never leaves the kernel
    assert tags["http.response.status_code"] == 200
    assert (tags["server.address"], tags["server.port"]) == ("127.0.0.1", port)
    assert tags["client.address"] == "127.0.0.1"
    assert (tags["network.protocol.name"], tags["network.transport"]) == ("http", "tcp")
    assert tags["http.request.size"] > 0 and tags["http.response.size"] > 0
    assert tags["tracejoin.connection.request_seq"] == 0  # first request on its connection
    assert "tracejoin.tcp.receive_queue_wait_ns" in tags
    assert span["duration"] > 0
    assert metrics.total("spans_exported") >= 1
