"""Issue 3 end to end: real BPF, real servers and clients, real Jaeger."""

from __future__ import annotations

import http.client
import subprocess
import time

import pytest
from harness import new_traceparent, raw_request, server
from jaeger import parent_span_id, span_tags, the_server_span
from tracejoin.core.model import KIND_SERVER

pytestmark = [pytest.mark.privileged, pytest.mark.e2e]


def _curl(port: int, path: str, tp: str) -> None:
    subprocess.run(
        [
            "curl",
            "-sf",
            "-o",
            "/dev/null",
            "-H",
            f"traceparent: {tp}",
            f"http://127.0.0.1:{port}{path}",
        ],
        check=True,
        timeout=10,
    )


def _python_get(port: int, path: str, tp: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"traceparent": tp})
    resp = conn.getresponse()
    resp.read()
    conn.close()


def _assert_in_jaeger(
    jaeger, trace_id: int, parent: int, method: str, path: str, status: int, min_ms: float
) -> dict:
    trace = jaeger.get_trace(f"{trace_id:032x}", timeout_s=15)
    span = the_server_span(trace, trace_id, parent)
    tags = span_tags(span)
    assert tags["http.request.method"] == method
    assert tags["url.path"] == path
    assert tags["http.response.status_code"] == status
    assert span["duration"] >= min_ms * 1000, span["duration"]
    return span


def _jaeger_server_spans(jaeger, trace_id: int, expect: int, timeout_s: float = 30) -> list:
    # Jaeger ingests asynchronously and the trace also holds child spans: poll on server spans.
    deadline = time.monotonic() + timeout_s
    while True:
        trace = jaeger.get_trace(f"{trace_id:032x}", timeout_s=timeout_s)
        servers = [s for s in trace["spans"] if span_tags(s).get("span.kind") == "server"]
        if len(servers) >= expect or time.monotonic() > deadline:
            return servers
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("mode", "client"),
    [
        ("threaded", _curl),
        ("go", _python_get),
        ("aiohttp", _curl),
        ("go", _curl),
    ],
)
def test_span_in_callers_trace(agent, jaeger, mode, client):
    port = agent.take_port()
    with server(mode, port):
        tp, trace_id, parent = new_traceparent()
        client(port, "/sleep?ms=20&token=canary-query", tp)
        span = _assert_in_jaeger(jaeger, trace_id, parent, "GET", "/sleep", 200, 20)
        assert span["operationName"] == "GET /sleep"
        assert span_tags(span)["server.port"] == port


def test_sendfile_body(agent, jaeger):
    port = agent.take_port()
    with server("threaded", port):
        tp, trace_id, parent = new_traceparent()
        _curl(port, "/file?kb=512", tp)
        span = _assert_in_jaeger(jaeger, trace_id, parent, "GET", "/file", 200, 0)
        # the whole body went through sendfile: the request ends after it, not at the headers
        assert span_tags(span)["http.response.size"] >= 512 * 1024


def test_error_status_marks_span(agent):
    port = agent.take_port()
    with server("threaded", port):
        tp, trace_id, _ = new_traceparent()
        _curl_status = subprocess.run(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-H",
                f"traceparent: {tp}",
                f"http://127.0.0.1:{port}/error",
            ],
            timeout=10,
        )
        assert _curl_status.returncode == 0
        (span,) = agent.server_spans(trace_id)
        assert span.attributes["http.response.status_code"] == 503
        assert span.status_code == 2  # ERROR


def test_keepalive_1000_requests_one_connection(agent, jaeger):
    """1000 sequential keep-alive requests on one connection, one trace id, distinct parents;
    every 10th unsampled: Jaeger holds exactly the 900 sampled ones."""
    port = agent.take_port()
    _tp0, trace_id, _ = new_traceparent()
    sampled_parents = set()
    with server("go", port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for i in range(1000):
            parent = (i + 1) * 7919
            sampled = i % 10 != 9
            if sampled:
                sampled_parents.add(f"{parent:016x}")
            conn.request(
                "GET",
                f"/k/{i}",
                headers={
                    "traceparent": f"00-{trace_id:032x}-{parent:016x}-{'01' if sampled else '00'}"
                },
            )
            conn.getresponse().read()
        conn.close()
        spans = agent.server_spans(trace_id, n=900, timeout_s=20)
        assert len(spans) == 900
        assert len({s.attributes["tracejoin.connection.id"] for s in spans}) == 1
        servers = _jaeger_server_spans(jaeger, trace_id, 900)
        assert len(servers) == 900
        assert {parent_span_id(s) for s in servers} == sampled_parents


def test_three_pipelined_requests_in_one_write(agent, jaeger):
    port = agent.take_port()
    tps = [new_traceparent() for _ in range(3)]
    payload = b"".join(
        f"GET /p/{i} HTTP/1.1\r\nHost: x\r\ntraceparent: {tp}\r\n\r\n".encode()
        for i, (tp, _, _) in enumerate(tps)
    )
    with server("threaded", port):
        with __import__("socket").create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
            got = b""
            while got.count(b"HTTP/1.1 200") < 3:
                part = s.recv(65536)
                assert part, got
                got += part
        for i, (_, trace_id, parent) in enumerate(tps):
            (span,) = agent.server_spans(trace_id)
            assert span.parent_span_id == parent
            assert span.attributes["url.path"] == f"/p/{i}"
            _assert_in_jaeger(jaeger, trace_id, parent, "GET", f"/p/{i}", 200, 0)


def test_secrets_never_leave_the_kernel(agent, caplog):
    port = agent.take_port()
    tp, trace_id, _ = new_traceparent()
    body = b"password=canary-body-3141"
    req = (
        f"POST /login?session=canary-query-2718 HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer canary-auth-1618\r\nCookie: sid=canary-cookie-1414\r\n"
        f"traceparent: {tp}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with server("threaded", port):
        raw_request(port, req)
        (span,) = agent.server_spans(trace_id)
    from tracejoin.exporters.otlp_json import encode_request_json
    from tracejoin.exporters.otlp_proto import encode_request_bytes

    dumps = [
        encode_request_json(agent.spans()),
        repr(agent.spans()),
        caplog.text,
    ]
    blob = encode_request_bytes(agent.spans())
    for canary in ("canary-body", "canary-query", "canary-auth", "canary-cookie"):
        assert all(canary not in d for d in dumps), canary
        assert canary.encode() not in blob
    assert span.attributes["url.path"] == "/login"
    assert span.attributes["http.request.method"] == "POST"


def test_non_http_bytes_make_no_spans(agent):
    port = agent.take_port()
    garbage = [
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(32)),  # TLS ClientHello
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 preface: h2c, but no stream opens
        bytes(range(256)) * 4,
        b"\x00" * 512,
        b"GET\x00/ HTTP/1.1\r\n\r\n",
    ]
    before = agent.pipeline.kernel_counters()["non_http_connections"]
    with server("threaded", port):
        for g in garbage:
            raw_request(port, g, timeout_s=1.0)
        assert agent.port_spans(port) == []
        time.sleep(0.2)
    after = agent.pipeline.kernel_counters()["non_http_connections"]
    assert after - before >= len(garbage) - 1  # the preface counts as HTTP/2 (test_http2.py)


def test_all_spans_are_server_or_children(agent):
    # every exported span belongs to a request: a server span or a kernel-interval child of
    # one (a request of this test's own makes one of each, so the check never runs on nothing)
    port = agent.take_port()
    with server("slowread", port, env={"SLEEP_MS": "30"}):
        tp, trace_id, _ = new_traceparent()
        raw_request(port, f"GET /kids HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n\r\n".encode())
        (parent,) = agent.server_spans(trace_id)
        spans = agent.wait_for(lambda sp: any(s.parent_span_id == parent.span_id for s in sp))
    servers = {(s.trace_id, s.span_id) for s in spans if s.kind == KIND_SERVER}
    children = [s for s in spans if s.kind != KIND_SERVER]
    assert any(c.parent_span_id == parent.span_id for c in children)
    orphans = [c for c in children if (c.trace_id, c.parent_span_id) not in servers]
    assert not orphans, orphans[:3]
