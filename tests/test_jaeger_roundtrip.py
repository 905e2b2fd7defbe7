"""The test Jaeger itself: a span sent with the OpenTelemetry SDK over OTLP gRPC and over OTLP
HTTP comes back through the query API with the same trace id, parent, name and tags.

If this fails, every end-to-end test would fail for a reason that is not tracejoin's.
"""

from __future__ import annotations

import secrets
import time

import psutil
import pytest
from jaeger import Jaeger, parent_span_id, span_service, span_tags, trace_ids_equal
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpExporter,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import Attributes

pytestmark = pytest.mark.e2e

OPERATION = "GET /roundtrip"
ROUTE = "/roundtrip"


def _exporter(jaeger: Jaeger, transport: str) -> SpanExporter:
    if transport == "grpc":
        return GrpcExporter(endpoint=jaeger.otlp_grpc_endpoint, insecure=True, timeout=10)
    return HttpExporter(endpoint=jaeger.otlp_http_traces_url, timeout=10)


def _make_span(service: str, trace_id: int, parent_id: int) -> ReadableSpan:
    """One finished server span whose parent is a remote span (as from a traceparent)."""
    captured = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(captured))
    parent = SpanContext(
        trace_id=trace_id,
        span_id=parent_id,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    ctx = trace.set_span_in_context(NonRecordingSpan(parent))
    tracer = provider.get_tracer("tracejoin.tests")
    attrs: Attributes = {"http.route": ROUTE, "http.response.status_code": 200}
    with tracer.start_as_current_span(
        OPERATION, context=ctx, kind=SpanKind.SERVER, attributes=attrs
    ):
        time.sleep(0.002)
    provider.shutdown()
    (span,) = captured.get_finished_spans()
    return span


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_span_roundtrip(jaeger: Jaeger, transport: str) -> None:
    trace_id = int.from_bytes(secrets.token_bytes(16), "big") | (1 << 127)  # high half non-zero
    parent_id = int.from_bytes(secrets.token_bytes(8), "big") | 1
    service = f"tracejoin-e2e-{transport}-{secrets.token_hex(3)}"
    span = _make_span(service, trace_id, parent_id)
    assert span.context is not None

    exporter = _exporter(jaeger, transport)
    try:
        assert exporter.export([span]) is SpanExportResult.SUCCESS, f"OTLP {transport} export"
    finally:
        exporter.shutdown()

    got = jaeger.get_trace(f"{trace_id:032x}", timeout_s=10)
    assert trace_ids_equal(got["traceID"], f"{trace_id:032x}")
    (js,) = got["spans"]
    assert trace_ids_equal(js["traceID"], f"{trace_id:032x}")
    assert int(js["spanID"], 16) == span.context.span_id
    assert parent_span_id(js) == f"{parent_id:016x}"
    assert js["operationName"] == OPERATION
    assert span_service(got, js) == service
    tags = span_tags(js)
    assert tags["http.route"] == ROUTE
    assert tags["http.response.status_code"] == 200
    assert tags["span.kind"] == "server"
    # Times are µs since the epoch; the span was made a moment ago and slept 2 ms.
    assert span.start_time is not None
    assert js["startTime"] == span.start_time // 1000
    assert 2_000 <= js["duration"] < 5_000_000

    # The search endpoint finds it too, by service, operation and tag.
    matches = jaeger.find_spans(service, operation=OPERATION, tags={"http.route": ROUTE})
    assert [s["spanID"] for _, s in matches] == [js["spanID"]]


def test_jaeger_listens_only_on_its_own_ports(jaeger: Jaeger) -> None:
    """Every socket Jaeger binds is one of the picked loopback ports: nothing on its defaults
    (4317, 4318, 16686, 8888, 13133, ...), so parallel runs and local services never collide."""
    assert jaeger.ports is not None and jaeger.pid is not None
    picked = {jaeger.ports.otlp_grpc, jaeger.ports.otlp_http}
    picked |= {jaeger.ports.query_http, jaeger.ports.query_grpc}
    bound = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(jaeger.pid).net_connections(kind="inet")
        if c.laddr and not c.raddr  # listeners and unconnected UDP, not client sockets
    }
    assert bound == {("127.0.0.1", p) for p in picked}
