"""The object-free span path end to end: real BPF, the Go test server, curl, OTLP/HTTP to the
real Jaeger, read back through its query API. The agent here has one destination, OTLP (as
`tracejoin run` with an endpoint), so its server spans leave the span builder as bytes
(pipeline/span_bytes.py) and the sender places them in the request without re-encoding."""

from __future__ import annotations

import dataclasses
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
from tracejoin.pipeline.spans import SpanOptions, needs_children

pytestmark = [pytest.mark.privileged, pytest.mark.e2e]


def _without_helpers(opts: SpanOptions) -> SpanOptions:
    """The options as needs_children would judge a record without its work set's helpers."""
    return dataclasses.replace(opts, signals=opts.signals - {"workset"})


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
    # the common request's span is the batch writer's; the stages see only what it leaves
    assert app.pipeline.batch_writer is not None
    staged: list[object] = []
    enrich = app.pipeline.enricher.enrich
    app.pipeline.enricher.enrich = lambda rec: staged.append(rec) or enrich(rec)  # type: ignore[method-assign]
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
    # the stages saw it only if it is not the common request: a child span other than a work
    # set helper's (the Go runtime often wakes one here: the writer makes its span too)
    for rec in staged:
        assert needs_children(rec, _without_helpers(app.pipeline.span_options)), rec


def test_the_common_request_takes_the_batch_writer(otlp_only, jaeger):
    """A server that keeps a request on its reading thread (Go on one CPU, GOMAXPROCS=1): its
    plain requests never reach the stages, and their spans reach Jaeger in the caller's trace."""
    app, port, _metrics = otlp_only
    assert app.pipeline is not None
    staged: list[object] = []
    enrich = app.pipeline.enricher.enrich
    app.pipeline.enricher.enrich = lambda rec: staged.append(rec) or enrich(rec)  # type: ignore[method-assign]
    sent = [new_traceparent() for _ in range(5)]
    with server("go", port, env={"GOMAXPROCS": "1"}, cpu=0):
        for tp, _, _ in sent:
            subprocess.run(
                ["curl", "-sf", "-o", "/dev/null", "-H", f"traceparent: {tp}",
                 f"http://127.0.0.1:{port}/items/7"],
                check=True, timeout=10,
            )  # fmt: skip
        for _, trace_id, parent in sent:
            trace = jaeger.get_trace(f"{trace_id:032x}", timeout_s=20)
            assert the_server_span(trace, trace_id, parent)["operationName"] == "GET /items/{id}"
    assert len(staged) < len(sent), "every request went through the stages"
    for rec in staged:
        assert needs_children(rec, _without_helpers(app.pipeline.span_options)), rec
