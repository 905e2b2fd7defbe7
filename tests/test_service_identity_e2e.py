"""In Jaeger beside an instrumented service (real BPF, real servers, a real Jaeger v2): one SERVER
span per hop, and tracejoin's span under the app's own service name.

The app (tests/servers/otelserver.py) makes its own SERVER span with the OpenTelemetry SDK and
exports it over OTLP/HTTP to the same Jaeger; its caller makes a CLIENT span and injects
`traceparent`. tracejoin (--read-environ, the Jaeger OTLP/HTTP port as an OTLP port) must then
emit `GET /work (kernel)` as INTERNAL, child of the caller's span, under the app's service.name:
named by the environment (detected by its OTLP connection), or by the process context it
publishes (OTEP 4719, which also says it is instrumented). An uninstrumented server keeps
tracejoin's SERVER span, as before.
"""

from __future__ import annotations

import http.client
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from harness import Agent, free_ports, new_traceparent, server
from jaeger import Jaeger, parent_span_id, span_service, span_tags
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from tracejoin.config import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

OTELSERVER = Path(__file__).parent / "servers" / "otelserver.py"
REQUESTS = 3


@pytest.fixture(scope="module")
def id_agent(jaeger: Jaeger, privileged: None) -> Iterator[Agent]:
    assert jaeger.ports is not None
    settings = Settings(gpu=False, read_environ=True, otlp_ports=(jaeger.ports.otlp_http,))
    a = Agent(free_ports(8), "http://" + jaeger.otlp_grpc_endpoint, settings=settings)
    a.start()
    yield a
    a.shutdown()


@contextmanager
def otel_server(
    port: int, jaeger: Jaeger, args: list[str], env: dict[str, str]
) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, str(OTELSERVER), str(port), jaeger.otlp_http_endpoint, *args],
        stdout=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def inspected(agent: Agent, pid: int, timeout_s: float = 30.0) -> None:
    """Wait until the agent's inspector has read the server once. Its first lookup waits at
    most 100 ms for that, and on a loaded host reading the network namespace's TCP tables can
    take longer (docs/attributes.md): the claim tested is the steady state, every request."""
    resources = agent.app.resources
    assert resources is not None and resources.inspector is not None
    key = (pid, psutil.Process(pid).create_time())
    deadline = time.monotonic() + timeout_s
    while resources.inspector.get(key) is None:
        assert time.monotonic() < deadline, "the server was never inspected"
        time.sleep(0.1)


def call_work(port: int, jaeger: Jaeger, n: int) -> list[tuple[str, str]]:
    """n GETs of /work from an instrumented client: [(trace id, client span id)]."""
    provider = TracerProvider(resource=Resource.create({"service.name": "app-client"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=jaeger.otlp_http_traces_url, timeout=10))
    )
    tracer = provider.get_tracer("tracejoin.tests.client")
    out = []
    for _ in range(n):
        with tracer.start_as_current_span("call work", kind=SpanKind.CLIENT) as span:
            headers: dict[str, str] = {}
            inject(headers)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/work", headers=headers)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == b"ok"
            conn.close()
            ctx = span.get_span_context()
            out.append((f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"))
    provider.shutdown()
    return out


def hop(jaeger: Jaeger, trace_id: str, timeout_s: float = 30.0) -> dict:
    """The trace once the client's, the app's and tracejoin's spans are all in."""
    deadline = time.monotonic() + timeout_s
    while True:
        trace = jaeger.get_trace(trace_id, timeout_s=timeout_s)
        names = {s["operationName"] for s in trace["spans"]}
        if {"call work", "GET /work", "GET /work (kernel)"} <= names:
            return trace
        assert time.monotonic() < deadline, f"spans so far: {sorted(names)}"
        time.sleep(0.2)


def check_one_server_span_per_hop(
    jaeger: Jaeger, calls: list[tuple[str, str]], service: str, name_source: str, detected: str
) -> None:
    for trace_id, client_span in calls:
        trace = hop(jaeger, trace_id)
        kinds = {s["spanID"]: span_tags(s).get("span.kind") for s in trace["spans"]}
        servers = [s for s in trace["spans"] if kinds[s["spanID"]] == "server"]
        assert len(servers) == 1, [(s["operationName"], span_service(trace, s)) for s in servers]
        (app,) = servers
        assert (app["operationName"], span_service(trace, app)) == ("GET /work", service)
        assert parent_span_id(app) == client_span
        (ours,) = [s for s in trace["spans"] if s["operationName"] == "GET /work (kernel)"]
        tags = span_tags(ours)
        assert tags.get("span.kind") == "internal", tags
        assert span_service(trace, ours) == service  # the app's name: one service in Jaeger
        assert parent_span_id(ours) == client_span  # the same parent as the app's SERVER span
        assert tags["tracejoin.service_name.source"] == name_source
        assert tags["tracejoin.instrumented.source"] == detected
        assert tags["url.path"] == "/work" and tags["http.response.status_code"] == 200
        # tracejoin's own children stay under its span
        for child in trace["spans"]:
            if child["operationName"] in ("tcp.receive_queue_wait", "sched.runq_wait"):
                assert parent_span_id(child) == ours["spanID"]


def test_instrumented_server_named_by_its_environment(id_agent: Agent, jaeger: Jaeger) -> None:
    service = f"app-server-{secrets.token_hex(3)}"
    port = id_agent.take_port()
    with otel_server(port, jaeger, [], {"OTEL_SERVICE_NAME": service, "DB_PASSWORD": "x"}) as p:
        inspected(id_agent, p.pid)
        calls = call_work(port, jaeger, REQUESTS)
        check_one_server_span_per_hop(jaeger, calls, service, "environ", "otlp_connection")


def test_instrumented_server_named_by_its_process_context(id_agent: Agent, jaeger: Jaeger) -> None:
    """No OTEL_* variable: the name is the SDK's, published in the OTEL_CTX mapping only."""
    service = f"ctx-server-{secrets.token_hex(3)}"
    port = id_agent.take_port()
    with otel_server(port, jaeger, ["--service-name", service, "--publish-context"], {}) as p:
        inspected(id_agent, p.pid)
        calls = call_work(port, jaeger, REQUESTS)
        check_one_server_span_per_hop(jaeger, calls, service, "process_context", "process_context")


def test_uninstrumented_server_keeps_the_server_span(id_agent: Agent, jaeger: Jaeger) -> None:
    port = id_agent.take_port()
    with server("threaded", port) as proc:
        comm = psutil.Process(proc.pid).name()
        sent = []
        for _ in range(REQUESTS):
            tp, trace_id, parent = new_traceparent()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/plain", headers={"traceparent": tp})
            assert conn.getresponse().status == 200
            conn.close()
            sent.append((trace_id, parent))
        for trace_id, parent in sent:
            trace = jaeger.get_trace(f"{trace_id:032x}", timeout_s=30)
            (ours,) = [s for s in trace["spans"] if s["operationName"] == "GET /plain"]
            tags = span_tags(ours)
            assert tags.get("span.kind") == "server"
            assert parent_span_id(ours) == f"{parent:016x}"
            assert span_service(trace, ours) == comm
            assert tags["tracejoin.service_name.source"] == "process_name"
            assert "tracejoin.instrumented.source" not in tags


def test_the_kernel_counts_connections_to_an_otlp_port(id_agent: Agent, jaeger: Jaeger) -> None:
    """The inspector's cue to read TCP tables again: a connection this host opens to an OTLP
    port counts once (the accepting side does not), one to another port not at all."""
    assert jaeger.ports is not None
    probes = id_agent.app.source
    count = getattr(probes, "kernel_counter")  # noqa: B009 - HttpProbes, not the protocol
    before = count("otlp_connects")
    with socket.create_connection(("127.0.0.1", jaeger.ports.otlp_http), timeout=5):
        pass
    with socket.create_connection(("127.0.0.1", jaeger.ports.query_http), timeout=5):
        pass
    assert count("otlp_connects") - before == 1
