"""Record -> spans, on synthetic records (no BPF): naming, parents, policies, child spans."""

from __future__ import annotations

import ctypes

import pytest
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import KIND_INTERNAL, KIND_SERVER, STATUS_ERROR
from tracejoin.kernel.decode import REQF_NO_RESPONSE, REQF_TUPLE, HttpRecord
from tracejoin.pipeline.spans import SpanBuilder, route_of

TID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PID = 0x00F067AA0BA902B7


def record(
    tp: str | None = None,
    *,
    status: int = 200,
    path: bytes = b"/x",
    flags: int = 0,
    arrival: int = 1_000_000,
    read: int = 3_000_000,
    end: int = 9_000_000,
) -> HttpRecord:
    r = HttpRecord()
    r.type, r.pid, r.tid, r.status, r.flags = 1, 1, 1, status, flags | REQF_TUPLE
    r.family, r.lport, r.rport = 2, 8080, 40000
    r.laddr[:4], r.raddr[:4] = [127, 0, 0, 1], [10, 0, 0, 9]
    r.method = b"GET"
    r.method_len = 3
    ctypes.memmove(ctypes.addressof(r) + HttpRecord.path.offset, path, len(path))
    r.path_len = len(path)
    if tp is not None:
        raw = tp.encode()
        ctypes.memmove(ctypes.addressof(r) + HttpRecord.tp.offset, raw, min(len(raw), 56))
        r.tp_len, r.tp_count = len(raw), 1
    r.arrival_ns, r.read_ns, r.resp_start_ns, r.end_ns = arrival, read, read + 1000, end
    return r


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/", "/"),
        ("/users/123/orders", "/users/{id}/orders"),
        ("/o/9f1c2a7e5b3d4c6a", "/o/{id}"),
        ("/o/123e4567-e89b-12d3-a456-426614174000", "/o/{id}"),
        ("/a/b/c/d/e/f", "/a/b/c/d/{...}"),
        ("/static/app.js", "/static/app.js"),
    ],
)
def test_route_has_bounded_cardinality(path, route):
    assert route_of(path) == route


def test_child_of_the_callers_span():
    m = Metrics()
    spans = SpanBuilder(m).build(record(f"00-{TID:032x}-{PID:016x}-01"))
    server, child = spans
    assert (server.trace_id, server.parent_span_id, server.kind) == (TID, PID, KIND_SERVER)
    assert server.name == "GET /x"
    assert server.attributes["client.address"] == "10.0.0.9"
    assert server.attributes["tracejoin.tcp.receive_queue_wait_ns"] == 2_000_000
    assert server.duration_ns == 8_000_000  # from arrival to the last response byte
    assert (child.name, child.kind, child.parent_span_id) == (
        "tcp.receive_queue_wait",
        KIND_INTERNAL,
        server.span_id,
    )
    assert child.duration_ns == 2_000_000


def test_no_parent_policy_root_or_skip():
    m = Metrics()
    root = SpanBuilder(m, no_parent="root").build(record(None))
    assert root[0].parent_span_id == 0 and root[0].trace_id != 0
    assert SpanBuilder(m, no_parent="skip").build(record(None)) == []
    bad = SpanBuilder(m, no_parent="skip").build(record(f"00-{TID:032X}-{PID:016x}-01"))
    assert bad == []
    assert m.get("traceparent_rejected", reason="uppercase") == 1


def test_unsampled_follows_the_caller_unless_told_to_record():
    m = Metrics()
    tp = f"00-{TID:032x}-{PID:016x}-00"
    assert SpanBuilder(m).build(record(tp)) == []
    assert m.get("requests_unsampled") == 1
    (server, _) = SpanBuilder(m, unsampled="record").build(record(tp))
    assert server.trace_id == TID and server.trace_flags == 0


def test_error_status():
    m = Metrics()
    assert SpanBuilder(m).build(record(None, status=503))[0].status_code == STATUS_ERROR
    lost = SpanBuilder(m).build(record(None, status=0, flags=REQF_NO_RESPONSE))[0]
    assert lost.status_code == STATUS_ERROR and "http.response.status_code" not in lost.attributes


def test_service_name_override_and_resource():
    m = Metrics()
    span = SpanBuilder(m, service_name="checkout").build(record(None))[0]
    assert span.resource.get("service.name") == "checkout"
    assert span.resource.get("process.pid") == 1
