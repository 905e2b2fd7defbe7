"""Exporters: encoders checked against an independent reference, senders against a real
in-process gRPC TraceService and a real HTTP server on loopback, and the batching queue's
retries, loss accounting and shutdown deadline. No mocks of gRPC or HTTP.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import gzip
import io
import json
import os
import random
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import tracejoin
from google.protobuf import json_format, text_format
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import (
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_OK,
    AttrValue,
    EncodedSpan,
    Event,
    Resource,
    Span,
)
from tracejoin.core.otlp_wire import encode_span, resource_field
from tracejoin.exporters import otlp_proto
from tracejoin.exporters import queue as queue_module
from tracejoin.exporters.base import ExportResult, ExportStatus, InMemoryExporter, SpanExporter
from tracejoin.exporters.config import exporter_from_env
from tracejoin.exporters.file_sender import ConsoleExporter, JsonLinesFileExporter
from tracejoin.exporters.grpc_sender import OtlpGrpcExporter
from tracejoin.exporters.http_sender import OtlpHttpExporter
from tracejoin.exporters.otlp_json import (
    decode_request_json,
    encode_request_dict,
    encode_request_json,
)
from tracejoin.exporters.otlp_proto import encode_request, encode_request_bytes
from tracejoin.exporters.perfetto import trace_document
from tracejoin.exporters.queue import BatchExportQueue, FanoutQueue, fanout

# ----------------------------------------------------------------------------- span factory

RES_A = Resource((("service.name", "api"), ("process.pid", 4242), ("host.name", "node-1")))
RES_B = Resource((("service.name", "worker"), ("process.pid", 77), ("k8s.pod.uid", "u-1")))


def make_span(i: int, resource: Resource = RES_A, parent: int | None = None) -> Span:
    """A server span like the agent builds: HTTP semconv plus kernel attributes, 2 events."""
    start = 1_700_000_000_000_000_000 + i * 1_000_000
    attrs: dict[str, AttrValue] = {
        "http.request.method": "GET",
        "url.path": f"/items/{i % 7}",
        "http.response.status_code": 200 if i % 5 else 503,
        "server.port": 8080,
        "tracejoin.kernel.recv_wait_ns": 51_234 + i,
        "tracejoin.kernel.cpu_time_ns": 1_234_567_890 + i,
        "tracejoin.kernel.bytes_sent": 0,
        "tracejoin.gpu.kernel_time_fraction": 0.25 + i / 1000,
        "tracejoin.tlb_flushes.approximate": i % 2 == 0,
        "tracejoin.delta": -17 - i,
    }
    return Span(
        trace_id=(0x4BF92F3577B34DA6A3CE929D0E0E4736 + i) & ((1 << 128) - 1),
        span_id=0x00F067AA0BA902B7 + i,
        parent_span_id=(0x1111_2222_3333_4444 + i) if parent is None else parent,
        name=f"GET /items/{i % 7}",
        kind=KIND_SERVER,
        start_ns=start,
        end_ns=start + 2_500_000 + i,
        resource=resource,
        attributes=attrs,
        events=[
            Event("request.received", start + 10, {"tracejoin.bytes": 512}),
            Event("response.sent", start + 2_400_000, {}),
        ],
        status_code=STATUS_ERROR if i % 5 == 0 else STATUS_OK,
        status_message="upstream unavailable" if i % 5 == 0 else "",
        trace_flags=1,
    )


def make_spans(n: int) -> list[Span]:
    return [
        make_span(i, RES_A if i % 3 else RES_B, parent=0 if i % 4 == 0 else None) for i in range(n)
    ]


# --------------------------------------------------------------- reference protobuf encoder
# Deliberately naive (message constructors, field by field): the fast encoder must match it.


def _ref_value(v: object) -> common_pb2.AnyValue:
    if isinstance(v, bool):
        return common_pb2.AnyValue(bool_value=v)
    if isinstance(v, int):
        if -(2**63) <= v < 2**63:
            return common_pb2.AnyValue(int_value=v)
        return common_pb2.AnyValue(string_value=str(v))
    if isinstance(v, float):
        return common_pb2.AnyValue(double_value=v)
    return common_pb2.AnyValue(string_value=str(v))


def _ref_attrs(attrs: Any) -> list[common_pb2.KeyValue]:
    return [common_pb2.KeyValue(key=k, value=_ref_value(v)) for k, v in attrs]


def reference_request(spans: list[Span]) -> ExportTraceServiceRequest:
    groups: dict[Resource, list[trace_pb2.Span]] = {}
    for s in spans:
        pb = trace_pb2.Span(
            trace_id=s.trace_id.to_bytes(16, "big"),
            span_id=s.span_id.to_bytes(8, "big"),
            parent_span_id=s.parent_span_id.to_bytes(8, "big") if s.parent_span_id else b"",
            name=s.name,
            kind=s.kind,  # type: ignore[arg-type]
            start_time_unix_nano=s.start_ns,
            end_time_unix_nano=s.end_ns,
            attributes=_ref_attrs(s.attributes.items()),
            events=[
                trace_pb2.Span.Event(
                    time_unix_nano=e.time_ns,
                    name=e.name,
                    attributes=_ref_attrs(e.attributes.items()),
                )
                for e in s.events
            ],
            flags=s.trace_flags,
        )
        if s.status_code or s.status_message:
            pb.status.CopyFrom(trace_pb2.Status(code=s.status_code, message=s.status_message))  # type: ignore[arg-type]
        groups.setdefault(s.resource, []).append(pb)
    req = ExportTraceServiceRequest()
    for res, pbs in groups.items():
        rs = req.resource_spans.add()
        if res.attributes:
            rs.resource.CopyFrom(resource_pb2.Resource(attributes=_ref_attrs(res.attributes)))
        ss = rs.scope_spans.add()
        ss.scope.name = "tracejoin"
        ss.scope.version = tracejoin.__version__
        ss.spans.extend(pbs)
    return req


def assert_same_request(got: ExportTraceServiceRequest, want: ExportTraceServiceRequest) -> None:
    if got != want:  # show a readable diff rather than two opaque objects
        assert text_format.MessageToString(got) == text_format.MessageToString(want)
    assert got == want


# ------------------------------------------------------------------------------ encoders


def test_proto_encoder_matches_reference() -> None:
    spans = make_spans(40)
    assert_same_request(encode_request(spans), reference_request(spans))


def test_proto_encoder_fields() -> None:
    root = make_span(0, parent=0)
    child = make_span(1)
    req = encode_request([root, child])
    (rs,) = req.resource_spans
    assert [(kv.key, kv.value.WhichOneof("value")) for kv in rs.resource.attributes] == [
        ("service.name", "string_value"),
        ("process.pid", "int_value"),
        ("host.name", "string_value"),
    ]
    (ss,) = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("tracejoin", tracejoin.__version__)
    a, b = ss.spans
    assert a.trace_id == bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
    assert a.span_id == bytes.fromhex("00f067aa0ba902b7")
    assert a.parent_span_id == b""  # root: empty, not eight zero bytes
    assert b.parent_span_id == bytes.fromhex("1111222233334445")
    assert a.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert a.start_time_unix_nano == root.start_ns and a.end_time_unix_nano == root.end_ns
    kinds = {kv.key: kv.value.WhichOneof("value") for kv in a.attributes}
    assert kinds["tracejoin.tlb_flushes.approximate"] == "bool_value"  # not int_value
    assert kinds["http.response.status_code"] == "int_value"
    assert kinds["tracejoin.gpu.kernel_time_fraction"] == "double_value"
    values = {kv.key: kv.value for kv in a.attributes}
    assert values["tracejoin.delta"].int_value == -17
    assert values["tracejoin.tlb_flushes.approximate"].bool_value is True
    assert [e.name for e in a.events] == ["request.received", "response.sent"]
    assert a.events[0].attributes[0].value.int_value == 512
    assert a.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert a.status.message == "upstream unavailable"
    assert not b.HasField("status") or b.status.code == trace_pb2.Status.STATUS_CODE_OK
    assert a.flags & 0xFF == 1


def test_proto_encoder_edge_values_match_reference() -> None:
    """Long keys/values (multi-byte lengths), big spans, odd ints, unicode, no events."""
    rng = random.Random(7)
    spans = []
    for i in range(30):
        attrs: dict[str, AttrValue] = {
            "k" * (90 + i): i,  # around the single-byte-length fast path limit
            "long.value": "é" * (rng.randrange(1, 400)),
            "u64.big": 2**63 + i,  # beyond int64: sent as text
            "i64.min": -(2**63),
            "i64.max": 2**63 - 1,
            "zero": 0,
            "false": False,
            "huge.float": 1e308,
            "empty": "",
            "surrogate": "bad\udcffbyte",
        }
        for j in range(rng.randrange(0, 600)):  # some spans > 16 KiB: 3-byte lengths
            choices: list[AttrValue] = [j, f"v{j}", j / 3, j % 2 == 0]
            attrs[f"extra.{j}"] = rng.choice(choices)
        if i % 10 == 0:
            attrs["huge"] = "x" * 20_000  # 3-byte length varints for KeyValue and Span
        spans.append(
            Span(rng.getrandbits(128), rng.getrandbits(64), 0, "ñame", KIND_INTERNAL, 0, 1,
                 Resource(()), attrs, [], 0, "", 0)
        )  # fmt: skip
    got = encode_request(spans)
    for s in spans:  # the reference cannot encode a lone surrogate; the encoder replaces it
        s.attributes["surrogate"] = "bad?byte"
    assert_same_request(got, reference_request(spans))
    assert not got.resource_spans[0].HasField("resource")  # attribute-less: left out


def test_proto_groups_equal_resources_from_distinct_objects() -> None:
    twin = Resource(tuple(RES_A.attributes))  # equal, not identical
    spans = [make_span(0, RES_A), make_span(1, RES_B), make_span(2, twin), make_span(3, RES_A)]
    req = encode_request(spans)
    assert len(req.resource_spans) == 2
    names = [
        [s.span_id for s in rs.scope_spans[0].spans] for rs in req.resource_spans
    ]  # order of arrival kept within each group
    assert names == [
        [(0x00F067AA0BA902B7 + i).to_bytes(8, "big") for i in (0, 2, 3)],
        [(0x00F067AA0BA902B7 + 1).to_bytes(8, "big")],
    ]
    assert encode_request_bytes([]) == b""


def test_compiled_request_framing_writes_the_reference_bytes() -> None:
    """_request_bytes.c frames EncodedSpans exactly as encode_request_bytes_py does: equal
    resources from distinct objects share a group, in order of first appearance; bodies at
    each varint length boundary; a model.Span among them (a child span the stages made) encoded
    in place. More resources than it groups leave the batch to Python (None), and the request
    is still the same."""
    assert otlp_proto.COMPILED, "_request_bytes.c was not built (scripts/setup.sh builds it)"

    def framed(spans: list[EncodedSpan | Span]) -> bytes | None:
        heads = otlp_proto._HEADS
        return otlp_proto._request_c(spans, EncodedSpan, resource_field, heads, encode_span)

    twin = Resource(tuple(RES_A.attributes))  # equal, not identical
    resources = [RES_A, RES_B, twin, RES_A, RES_B, twin]
    bodies = [b"", b"a" * 127, b"b" * 128, b"c" * 16383, b"d" * 16384, b"e" * 70_000]
    raw = [EncodedSpan(r, b) for r, b in zip(resources, bodies, strict=True)]
    assert framed(raw) == otlp_proto.encode_request_bytes_py(raw)
    assert framed([]) == b""

    objects = [make_span(i, r) for i, r in enumerate(resources)]
    real = [EncodedSpan(s.resource, encode_span(s)) for s in objects]
    want = otlp_proto.encode_request_bytes_py(objects)
    assert framed(real) == want == framed(objects)  # bytes, Span objects, or both mixed
    assert framed([*real[:3], *objects[3:]]) == want
    assert encode_request_bytes(real) == want
    assert len(encode_request(real).resource_spans) == 2

    many = [EncodedSpan(Resource((("service.name", f"s{i}"),)), b"x") for i in range(65)]
    assert framed(many[:64]) is not None and framed(many) is None
    assert encode_request_bytes(many) == otlp_proto.encode_request_bytes_py(many)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_batch_is_taken_the_same_either_way(compiled: bool) -> None:
    """BatchExportQueue._take, compiled (_request_bytes.c) or not: up to max_batch spans, stopping
    before the one that would pass max_batch_bytes (an EncodedSpan counts its body, a
    model.Span SPAN_BYTES_GUESS), at least one; the rest stays queued, in order."""
    q = BatchExportQueue(InMemoryExporter(), Metrics(), name="t", max_batch=5, max_batch_bytes=2500)
    big, small = EncodedSpan(RES_A, b"a" * 3000), [EncodedSpan(RES_A, b"s") for _ in range(6)]
    first, second = EncodedSpan(RES_A, b"f" * 1000), EncodedSpan(RES_B, b"g" * 600)
    obj = make_span(1)
    spans: list[EncodedSpan | Span] = [first, obj, second, big, *small]
    backlog = collections.deque(spans)
    queue_module.use_compiled(compiled)
    try:
        batches = []
        while backlog:
            batches.append(q._take(backlog))
    finally:
        queue_module.use_compiled(True)
    # 1000 + 1024 (guessed), then 600 (+3000 would pass), 3000 alone, then the count's cap
    assert batches == [[first, obj], [second], [big], small[:5], small[5:]]


def _json_to_proto(obj: dict[str, Any]) -> ExportTraceServiceRequest:
    """Independent of decode_request_json: convert hex ids to base64, then ParseDict."""

    def fix(o: Any) -> Any:
        if isinstance(o, dict):
            return {
                k: base64.b64encode(bytes.fromhex(v)).decode()
                if k in ("traceId", "spanId", "parentSpanId")
                else fix(v)
                for k, v in o.items()
            }
        if isinstance(o, list):
            return [fix(v) for v in o]
        return o

    msg = ExportTraceServiceRequest()
    json_format.ParseDict(fix(obj), msg)
    return msg


def test_json_round_trips_to_the_protobuf_encoding() -> None:
    spans = make_spans(25)
    text = encode_request_json(spans)
    assert "\n" not in text
    assert_same_request(_json_to_proto(json.loads(text)), encode_request(spans))
    assert_same_request(decode_request_json(text), encode_request(spans))


def test_json_uses_otlp_conventions() -> None:
    root, child = make_span(0, parent=0), make_span(1)
    obj = json.loads(encode_request_json([root, child]))
    rs = obj["resourceSpans"][0]
    assert rs["resource"]["attributes"][1] == {"key": "process.pid", "value": {"intValue": "4242"}}
    assert rs["scopeSpans"][0]["scope"] == {"name": "tracejoin", "version": tracejoin.__version__}
    a, b = rs["scopeSpans"][0]["spans"]
    assert a["traceId"] == "4bf92f3577b34da6a3ce929d0e0e4736"  # hex, not base64
    assert a["spanId"] == "00f067aa0ba902b7"
    assert "parentSpanId" not in a  # empty: omitted
    assert b["parentSpanId"] == "1111222233334445"
    assert a["kind"] == 2  # enum as integer
    assert a["startTimeUnixNano"] == str(root.start_ns)  # 64-bit as decimal string
    assert a["status"] == {"message": "upstream unavailable", "code": 2}
    attrs = {kv["key"]: kv["value"] for kv in a["attributes"]}
    assert attrs["tracejoin.tlb_flushes.approximate"] == {"boolValue": True}
    assert attrs["tracejoin.delta"] == {"intValue": "-17"}
    assert attrs["tracejoin.gpu.kernel_time_fraction"] == {"doubleValue": 0.25}
    assert a["events"][1] == {
        "timeUnixNano": str(root.start_ns + 2_400_000),
        "name": "response.sent",
    }
    low = make_span(0)
    low.trace_id, low.span_id, low.parent_span_id = 0xAB, 0xCD, 0xEF  # leading zeros kept
    (ls,) = encode_request_dict([low])["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert (ls["traceId"], ls["spanId"], ls["parentSpanId"]) == (
        "000000000000000000000000000000ab",
        "00000000000000cd",
        "00000000000000ef",
    )
    unset = make_span(1)
    unset.status_code, unset.status_message = 0, ""
    (only,) = encode_request_dict([unset])["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert "status" not in only


def test_json_non_finite_doubles() -> None:
    span = make_span(0)
    span.attributes = {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf")}
    text = encode_request_json([span])
    assert '"doubleValue":"NaN"' in text and '"doubleValue":"-Infinity"' in text
    values = decode_request_json(text).resource_spans[0].scope_spans[0].spans[0].attributes
    got = [kv.value.double_value for kv in values]
    assert got[0] != got[0] and got[1:] == [float("inf"), float("-inf")]


# --------------------------------------------------------------------- real gRPC collector


class GrpcCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real TraceService: records requests; can answer the next calls with error codes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.calls = 0
        self.fail: list[tuple[grpc.StatusCode, bytes | None]] = []
        self.rejected = 0
        self.peers: list[list[bytes]] = []  # TLS: the client certificate's common name per call
        self.endpoint = ""

    def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:
        with self.lock:
            self.calls += 1
            self.metadata.append(dict(context.invocation_metadata()))
            self.peers.append(context.auth_context().get("x509_common_name", []))
            failure = self.fail.pop(0) if self.fail else None
            if failure is None:
                self.requests.append(request)
        if failure is not None:
            code, details_bin = failure
            if details_bin is not None:
                context.set_trailing_metadata((("grpc-status-details-bin", details_bin),))
            context.abort(code, f"test says {code.name}")
        resp = ExportTraceServiceResponse()
        if self.rejected:
            resp.partial_success.CopyFrom(
                ExportTracePartialSuccess(rejected_spans=self.rejected, error_message="too old")
            )
        return resp

    def received(self) -> ExportTraceServiceRequest:
        """Everything received, merged into one request."""
        merged = ExportTraceServiceRequest()
        with self.lock:
            for r in self.requests:
                merged.resource_spans.extend(r.resource_spans)
        return merged


def serve_grpc(collector: GrpcCollector, tls: grpc.ServerCredentials | None = None) -> grpc.Server:
    """A real TraceService on loopback (TLS with `tls`), recording into `collector`."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
        collector.endpoint = f"http://127.0.0.1:{port}"
    else:
        port = server.add_secure_port("127.0.0.1:0", tls)
        collector.endpoint = f"https://127.0.0.1:{port}"
    server.start()
    return server


@pytest.fixture
def grpc_collector() -> Iterator[GrpcCollector]:
    collector = GrpcCollector()
    server = serve_grpc(collector)
    yield collector
    server.stop(0)


# --------------------------------------------------------------------- real HTTP collector


class HttpCollector:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[ExportTraceServiceRequest] = []
        self.seen: list[tuple[float, str, dict[str, str]]] = []  # (time, path, lower-case headers)
        self.responses: list[tuple[int, dict[str, str]]] = []  # answers for the next calls
        self.rejected = 0  # partial success: spans reported as not kept
        self.peers: list[Any] = []  # HTTPS: the client certificate of each request
        self.url = ""

    def received(self) -> ExportTraceServiceRequest:
        merged = ExportTraceServiceRequest()
        with self.lock:
            for r in self.requests:
                merged.resource_spans.extend(r.resource_spans)
        return merged


def serve_http(collector: HttpCollector, tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    """A real OTLP/HTTP collector on loopback (HTTPS with `tls`), recording into `collector`."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as a real collector

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            with collector.lock:
                headers = {k.lower(): v for k, v in self.headers.items()}
                collector.seen.append((time.monotonic(), self.path, headers))
                if tls is not None:
                    collector.peers.append(self.connection.getpeercert())  # type: ignore[attr-defined]
                status, answer = collector.responses.pop(0) if collector.responses else (200, {})
                if status == 200:
                    collector.requests.append(ExportTraceServiceRequest.FromString(body))
            resp = ExportTraceServiceResponse()
            if collector.rejected:
                resp.partial_success.CopyFrom(
                    ExportTracePartialSuccess(
                        rejected_spans=collector.rejected, error_message="old"
                    )
                )
            payload = resp.SerializeToString() if status == 200 else b"no"
            self.send_response(status)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(payload)))
            for k, v in answer.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    scheme = "http"
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    collector.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/v1/traces"
    return server


@pytest.fixture
def http_collector() -> Iterator[HttpCollector]:
    collector = HttpCollector()
    server = serve_http(collector)
    yield collector
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (CN tracejoin-client),
    made by the openssl command."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: it makes the test certificates")
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    key = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=tracejoin-test-ca")  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=tracejoin-{name}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")  # fmt: skip
    return {n: d / n for n in ("ca.pem", "server.key", "server.pem", "client.key", "client.pem")}


@pytest.fixture
def mtls_collector(pki: dict[str, Path], request: pytest.FixtureRequest) -> Iterator[Any]:
    """An OTLP collector (protocol: the test's parameter) that requires a client certificate
    signed by the test CA."""
    if request.param == "grpc":
        grpc_side = GrpcCollector()
        creds = grpc.ssl_server_credentials(
            [(pki["server.key"].read_bytes(), pki["server.pem"].read_bytes())],
            root_certificates=pki["ca.pem"].read_bytes(),
            require_client_auth=True,
        )
        server = serve_grpc(grpc_side, creds)
        yield grpc_side
        server.stop(0)
        return
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki["ca.pem"]))
    ctx.load_cert_chain(pki["server.pem"], pki["server.key"])
    ctx.verify_mode = ssl.CERT_REQUIRED
    http_side = HttpCollector()
    http_server = serve_http(http_side, ctx)
    yield http_side
    http_server.shutdown()
    http_server.server_close()


@pytest.fixture
def blackhole_port() -> Iterator[int]:
    """A port whose connections complete (the kernel's backlog) but are never answered."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port that refuses connections: bound, never listening (so no one else can take it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A collector that accepts every connection and reads what it is sent, and never answers
    (HTTP: no status line; gRPC: not even the HTTP/2 SETTINGS frame)."""
    server = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def drain(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while conn.recv(65536):
                pass

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at teardown
                return
            conns.append(conn)
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in conns:
        conn.close()


def fast_queue(exporter: SpanExporter, metrics: Metrics, **kw: Any) -> BatchExportQueue:
    opts: dict[str, Any] = dict(
        max_batch=100, flush_interval_s=0.05, initial_backoff_s=0.01, max_backoff_s=0.05,
        rng=random.Random(1), name="q",
    )  # fmt: skip
    opts.update(kw)
    return BatchExportQueue(exporter, metrics, **opts)


# ------------------------------------------------------------------------------- senders


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_grpc_exporter_delivers_exact_content(
    grpc_collector: GrpcCollector, compression: str | None
) -> None:
    spans = make_spans(30)
    exp = OtlpGrpcExporter(
        grpc_collector.endpoint,
        headers={"Authorization": "Bearer t0k", "x-tenant": "a b"},
        timeout_s=5,
        compression=compression,
    )
    try:
        result = exp.export(spans)
    finally:
        exp.shutdown()
        exp.shutdown()  # idempotent
    assert result.status is ExportStatus.SUCCESS, result.detail
    assert_same_request(grpc_collector.received(), reference_request(spans))
    md = grpc_collector.metadata[0]
    assert md["authorization"] == "Bearer t0k" and md["x-tenant"] == "a b"
    assert md["user-agent"].startswith(f"tracejoin/{tracejoin.__version__}")
    assert exp.export(spans).status is ExportStatus.PERMANENT_FAILURE  # after shutdown


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_http_exporter_delivers_exact_content(
    http_collector: HttpCollector, compression: str | None
) -> None:
    spans = make_spans(30)
    exp = OtlpHttpExporter(
        http_collector.url, headers={"Authorization": "Bearer t0k"}, compression=compression
    )
    try:
        assert exp.export(spans[:10]).ok
        assert exp.export(spans[10:]).ok  # the same kept-alive connection
    finally:
        exp.shutdown()
    want = _concat(reference_request(spans[:10]), reference_request(spans[10:]))
    assert_same_request(http_collector.received(), want)
    _, path, headers = http_collector.seen[0]
    assert path == "/v1/traces"
    assert headers["content-type"] == "application/x-protobuf"
    assert headers["authorization"] == "Bearer t0k"
    assert headers["user-agent"] == f"tracejoin/{tracejoin.__version__}"
    assert headers.get("content-encoding") == compression


def _concat(*reqs: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    out = ExportTraceServiceRequest()
    for r in reqs:
        out.resource_spans.extend(r.resource_spans)
    return out


def test_grpc_retry_info_and_status_mapping(grpc_collector: GrpcCollector) -> None:
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromMilliseconds(1500)
    status = status_pb2.Status(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message="slow")
    status.details.add().Pack(info)
    grpc_collector.fail = [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, status.SerializeToString()),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, None),  # no RetryInfo: not retryable
        (grpc.StatusCode.INVALID_ARGUMENT, None),
        (grpc.StatusCode.UNAVAILABLE, None),
        (grpc.StatusCode.DATA_LOSS, None),
    ]
    exp = OtlpGrpcExporter(grpc_collector.endpoint, timeout_s=5)
    try:
        results = [exp.export(make_spans(2)) for _ in range(5)]
    finally:
        exp.shutdown()
    assert [r.status for r in results] == [
        ExportStatus.RETRYABLE_FAILURE,
        ExportStatus.PERMANENT_FAILURE,
        ExportStatus.PERMANENT_FAILURE,
        ExportStatus.RETRYABLE_FAILURE,
        ExportStatus.RETRYABLE_FAILURE,
    ]
    assert results[0].retry_after_s == pytest.approx(1.5)
    assert "INVALID_ARGUMENT" in results[2].detail
    assert grpc_collector.calls == 5  # one call per export: the queue does the retrying


def test_http_status_mapping_and_retry_after(http_collector: HttpCollector) -> None:
    http_collector.responses = [(503, {"Retry-After": "7"}), (429, {}), (400, {}), (504, {})]
    exp = OtlpHttpExporter(http_collector.url)
    try:
        results = [exp.export(make_spans(1)) for _ in range(4)]
    finally:
        exp.shutdown()
    assert [r.status for r in results] == [
        ExportStatus.RETRYABLE_FAILURE,
        ExportStatus.RETRYABLE_FAILURE,
        ExportStatus.PERMANENT_FAILURE,
        ExportStatus.RETRYABLE_FAILURE,
    ]
    assert results[0].retry_after_s == 7.0
    assert results[1].retry_after_s is None
    assert len(http_collector.seen) == 4  # one request per export: the queue does the retrying


@pytest.mark.parametrize("mtls_collector", ["grpc", "http/protobuf"], indirect=True)
def test_tls_and_mtls_from_the_standard_variables(
    mtls_collector: Any, pki: dict[str, Path]
) -> None:
    """CA, client key and client certificate from OTEL_EXPORTER_OTLP_* (generic and
    traces-specific mixed) reach the package's transport: the collector sees our client
    certificate; without it, or without the CA, nothing is delivered."""
    protocol = "grpc" if isinstance(mtls_collector, GrpcCollector) else "http/protobuf"
    url = mtls_collector.endpoint if protocol == "grpc" else mtls_collector.url
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url,
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(pki["ca.pem"]),
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(pki["client.key"]),
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(pki["client.pem"]),
    }
    spans = make_spans(7)
    no_client_cert = {k: v for k, v in env.items() if "CLIENT" not in k}
    no_ca = {k: v for k, v in env.items() if k != "OTEL_EXPORTER_OTLP_CERTIFICATE"}
    results = []
    for variables in (env, no_client_cert, no_ca):
        exp = exporter_from_env(variables)
        try:
            results.append(exp.export(spans, timeout_s=5))
        finally:
            exp.shutdown()
    assert [r.ok for r in results] == [True, False, False], [r.detail for r in results]
    assert_same_request(mtls_collector.received(), reference_request(spans))
    if protocol == "grpc":
        assert mtls_collector.peers == [[b"tracejoin-client"]]
    else:
        (peer,) = mtls_collector.peers
        assert dict(x[0] for x in peer["subject"])["commonName"] == "tracejoin-client"


@pytest.mark.parametrize(
    ("endpoint_form", "insecure", "delivered"),
    [
        ("bare", "true", True),  # host:port + INSECURE=true: plaintext
        ("bare", None, False),  # host:port alone: TLS, which a plaintext collector refuses
        ("http", "false", True),  # a scheme wins over INSECURE (the spec)
    ],
)
def test_grpc_insecure_follows_the_spec(
    grpc_collector: GrpcCollector, endpoint_form: str, insecure: str | None, delivered: bool
) -> None:
    endpoint = grpc_collector.endpoint
    if endpoint_form == "bare":
        endpoint = endpoint.removeprefix("http://")
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    if insecure is not None:
        env["OTEL_EXPORTER_OTLP_TRACES_INSECURE"] = insecure
    exp = exporter_from_env(env)
    try:
        result = exp.export(make_spans(2), timeout_s=5)
    finally:
        exp.shutdown()
    assert result.ok is delivered, result.detail
    assert grpc_collector.calls == (1 if delivered else 0)


def test_http_partial_success_and_one_attempt_per_call(http_collector: HttpCollector) -> None:
    http_collector.rejected = 2
    exp = OtlpHttpExporter(http_collector.url)
    try:
        result = exp.export(make_spans(5))
        http_collector.responses = [(503, {}), (503, {})]
        failed = exp.export(make_spans(1))
    finally:
        exp.shutdown()
    assert (result.ok, result.rejected_spans, result.detail) == (True, 2, "old")
    assert failed.status is ExportStatus.RETRYABLE_FAILURE
    assert len(http_collector.seen) == 2  # the package's own retry loop is not used


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_per_call_timeout_against_blackhole(blackhole_port: int, transport: str) -> None:
    url = f"http://127.0.0.1:{blackhole_port}"
    exp: SpanExporter = (
        OtlpGrpcExporter(url, timeout_s=30) if transport == "grpc"
        else OtlpHttpExporter(url + "/v1/traces", timeout_s=30)
    )  # fmt: skip
    t0 = time.monotonic()
    try:
        result = exp.export(make_spans(3), timeout_s=0.3)  # the caller's cap wins
    finally:
        exp.shutdown()
    assert time.monotonic() - t0 < 2.0
    assert result.status is ExportStatus.RETRYABLE_FAILURE


def test_json_lines_file_exporter(tmp_path: Path) -> None:
    path = tmp_path / "spans.otlp.jsonl"
    exp = JsonLinesFileExporter(path)
    spans = make_spans(12)
    assert exp.export(spans[:5]).ok and exp.export(spans[5:]).ok
    # Flushed per batch: readable before shutdown.
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    assert_same_request(decode_request_json(lines[0]), reference_request(spans[:5]))
    assert_same_request(decode_request_json(lines[1]), reference_request(spans[5:]))
    exp.shutdown()
    exp.shutdown()
    assert exp.export(spans).status is ExportStatus.PERMANENT_FAILURE
    JsonLinesFileExporter(tmp_path / "never-used").shutdown()  # safe without use
    assert not (tmp_path / "never-used").exists()
    bad = JsonLinesFileExporter(tmp_path / "missing-dir" / "x.jsonl")
    assert bad.export(spans).status is ExportStatus.RETRYABLE_FAILURE


def test_console_exporter_lines() -> None:
    out = io.StringIO()
    exp = ConsoleExporter(out)
    assert exp.export([make_span(0), make_span(1)]).ok
    exp.shutdown()
    assert out.getvalue().splitlines() == [
        "4bf92f3577b34da6a3ce929d0e0e4736 00f067aa0ba902b7 GET /items/0 2.500 ms "
        "ERROR (upstream unavailable)",
        "4bf92f3577b34da6a3ce929d0e0e4737 00f067aa0ba902b8 GET /items/1 2.500 ms OK",
    ]


def test_console_exporter_escapes_terminal_controls() -> None:
    """A path like `/ESC]52;c;...BEL ESC[2J` would write the operator's clipboard and clear
    the screen: C0, DEL and C1 controls are printed escaped, one line per span."""
    span = make_span(0)
    span.name = "GET /\x1b]52;c;aGk=\x07\x1b[2J\r\n\x7f\x9b31m"
    span.status_message = "bad\x1bc"
    out = io.StringIO()
    assert ConsoleExporter(out).export([span]).ok
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in text[:-1])
    assert "GET /\\x1b]52;c;aGk=\\x07\\x1b[2J\\x0d\\x0a\\x7f\\u009b31m" in text
    assert text.rstrip("\n").endswith("ERROR (bad\\x1bc)")


# --------------------------------------------------------------------------------- queue


def test_queue_grpc_retries_unavailable_then_succeeds(grpc_collector: GrpcCollector) -> None:
    grpc_collector.fail = [(grpc.StatusCode.UNAVAILABLE, None)] * 2
    metrics = Metrics()
    q = fast_queue(OtlpGrpcExporter(grpc_collector.endpoint, timeout_s=5), metrics)
    spans = make_spans(40)
    assert all(q.submit(s) for s in spans)  # before start: buffered, one batch
    q.start()
    assert q.force_flush(10)
    q.shutdown(5)
    assert grpc_collector.calls == 3
    assert_same_request(grpc_collector.received(), reference_request(spans))
    assert metrics.get("spans_exported", exporter="q") == 40
    assert metrics.get("export_retries", exporter="q") == 2
    assert metrics.get("export_failures", exporter="q") == 0
    assert metrics.total("spans_dropped") == 0


def test_queue_http_retries_503_honouring_retry_after(http_collector: HttpCollector) -> None:
    http_collector.responses = [(503, {"Retry-After": "1"}), (503, {})]
    metrics = Metrics()
    q = fast_queue(OtlpHttpExporter(http_collector.url, timeout_s=5), metrics)
    spans = make_spans(20)
    for s in spans:
        q.submit(s)
    q.start()
    assert q.force_flush(10)
    q.shutdown(5)
    times = [t for t, _, _ in http_collector.seen]
    assert len(times) == 3
    assert times[1] - times[0] >= 0.95  # waited as told, not the 10 ms backoff
    assert times[2] - times[1] < 0.5
    assert_same_request(http_collector.received(), reference_request(spans))
    assert metrics.get("spans_exported", exporter="q") == 20
    assert metrics.get("export_retries", exporter="q") == 2
    assert metrics.get("export_failures", exporter="q") == 0


def test_queue_counts_partial_success_rejections(grpc_collector: GrpcCollector) -> None:
    grpc_collector.rejected = 3
    metrics = Metrics()
    q = fast_queue(OtlpGrpcExporter(grpc_collector.endpoint, timeout_s=5), metrics)
    for s in make_spans(10):
        q.submit(s)
    q.start()
    q.shutdown(5)
    assert metrics.get("spans_exported", exporter="q") == 7
    assert metrics.get("spans_dropped", reason="rejected", exporter="q") == 3
    assert grpc_collector.calls == 1  # partial success is not retried


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_queue_dead_endpoint_counts_failures_never_raises(dead_port: int, transport: str) -> None:
    url = f"http://127.0.0.1:{dead_port}"
    exp: SpanExporter = (
        OtlpGrpcExporter(url, timeout_s=2) if transport == "grpc"
        else OtlpHttpExporter(url + "/v1/traces", timeout_s=2)
    )  # fmt: skip
    metrics = Metrics()
    q = fast_queue(exp, metrics, max_batch=10, max_retries=2)
    for s in make_spans(25):
        assert q.submit(s)
    q.start()
    assert q.force_flush(10)
    q.shutdown(2)
    assert metrics.get("spans_exported", exporter="q") == 0
    assert metrics.get("export_failures", exporter="q") == 3  # batches of 10, 10, 5
    assert metrics.get("export_retries", exporter="q") == 6  # 2 per batch
    assert metrics.get("spans_dropped", reason="export_failed", exporter="q") == 25
    assert metrics.total("spans_dropped") == 25


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_queue_shutdown_returns_within_deadline_on_blackhole(
    blackhole_port: int, transport: str
) -> None:
    url = f"http://127.0.0.1:{blackhole_port}"
    exp: SpanExporter = (
        OtlpGrpcExporter(url, timeout_s=60) if transport == "grpc"
        else OtlpHttpExporter(url + "/v1/traces", timeout_s=60)
    )  # fmt: skip
    metrics = Metrics()
    q = fast_queue(exp, metrics, max_batch=10)
    for s in make_spans(35):
        q.submit(s)
    q.start()
    time.sleep(0.3)  # the first batch is now stuck in an export with a 60 s timeout
    t0 = time.monotonic()
    q.shutdown(1.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.3, elapsed
    assert metrics.get("spans_dropped", reason="shutdown", exporter="q") == 35  # in flight + queued
    assert metrics.get("spans_exported", exporter="q") == 0
    t1 = time.monotonic()
    q.shutdown(1.0)  # idempotent: returns at once
    assert time.monotonic() - t1 < 0.1


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("collector", ["refusing", "silent"])
def test_shutdown_during_an_outage_accounts_for_every_span(
    dead_port: int, silent_port: int, protocol: str, collector: str
) -> None:
    """Issue 18 section 5: SIGTERM (the queue's shutdown) arrives while a batch is being
    retried against a collector that is down, with more batches queued behind it. Every span
    submitted is exported or counted as dropped: exported + dropped == submitted, exactly."""
    port = dead_port if collector == "refusing" else silent_port
    exporter = exporter_from_env(
        {}, {"endpoint": f"http://127.0.0.1:{port}", "protocol": protocol, "timeout_s": 0.1}
    )
    metrics = Metrics()
    # Every backoff (0.2-0.4 s) is longer than the shutdown deadline (0.15 s): the batch being
    # retried cannot be retried again in time, and the batches behind it get one attempt each.
    q = BatchExportQueue(
        exporter, metrics, max_batch=10, flush_interval_s=0.01, max_retries=1000,
        initial_backoff_s=0.4, max_backoff_s=0.4, max_elapsed_s=600, rng=random.Random(1),
        name="q",
    )  # fmt: skip
    spans = make_spans(95)
    assert all(q.submit(s) for s in spans)
    q.start()
    give_up = time.monotonic() + 10
    while metrics.get("export_retries", exporter="q") < 1:  # the first batch is retrying
        assert time.monotonic() < give_up, "the first batch was never retried"
        time.sleep(0.005)
    assert len(q) == 85  # nine batches queued behind it
    q.shutdown(0.15)
    exported = metrics.get("spans_exported", exporter="q")
    dropped = {
        r: metrics.get("spans_dropped", reason=r, exporter="q")
        for r in ("shutdown", "export_failed")
    }
    assert exported == 0
    assert metrics.total("spans_dropped") == sum(dropped.values())
    assert exported + sum(dropped.values()) == len(spans), dropped
    assert dropped["shutdown"] == len(spans)  # given up for want of time, not as failures


def test_queue_identity_holds_whenever_shutdown_comes() -> None:
    """exported + dropped == submitted after shutdown, for shutdowns at many moments of an
    outage that clears at a random point (some batches fail, some go through)."""
    rng = random.Random(18)
    for round_ in range(40):
        exp = InMemoryExporter()
        exp.fail_next(rng.randrange(0, 12))
        metrics = Metrics()
        q = fast_queue(
            exp, metrics, max_batch=7, max_retries=3, initial_backoff_s=rng.choice([0.001, 0.03]),
            max_backoff_s=0.03, rng=random.Random(round_),
        )  # fmt: skip
        for s in make_spans(50):
            q.submit(s)
        q.start()
        time.sleep(rng.uniform(0, 0.05))
        q.shutdown(rng.uniform(0, 0.05))
        assert q.submit(make_span(99)) is False  # after shutdown: counted as dropped
        exported = metrics.get("spans_exported", exporter="q")
        assert exported <= len(exp.spans)  # a delivery racing the deadline counts as dropped
        assert exported + metrics.total("spans_dropped") == 51, (round_, metrics.snapshot())


def test_queue_shutdown_survives_a_hung_exporter() -> None:
    """An exporter that ignores its timeout entirely: shutdown still keeps its deadline, and
    the batch counted as dropped is not counted again when the exporter finally returns."""
    exp = InMemoryExporter()
    exp.block()
    metrics = Metrics()
    q = fast_queue(exp, metrics, max_batch=4)
    spans = make_spans(10)
    for s in spans:
        q.submit(s)
    q.start()
    assert exp.entered.wait(2)
    t0 = time.monotonic()
    q.shutdown(0.5)
    assert time.monotonic() - t0 < 0.8
    assert metrics.get("spans_dropped", reason="shutdown", exporter="q") == 10
    exp.unblock()
    time.sleep(0.1)
    assert metrics.get("spans_exported", exporter="q") == 0
    assert metrics.total("spans_dropped") == 10
    assert exp.shut_down


def test_queue_worker_stops_at_deadline_instead_of_sleeping_out_a_retry_after() -> None:
    exp = InMemoryExporter()
    exp.fail_next(100, ExportResult.retry("busy", retry_after_s=30))
    metrics = Metrics()
    q = fast_queue(exp, metrics)
    q.submit(make_span(0))
    q.start()
    assert q.force_flush(0.2) is False  # waiting out the 30 s Retry-After
    t0 = time.monotonic()
    q.shutdown(0.5)
    assert time.monotonic() - t0 < 0.8
    assert q._thread is not None
    q._thread.join(0.5)
    assert not q._thread.is_alive()  # gave up the retry: it could not finish in time
    assert metrics.get("spans_dropped", reason="shutdown", exporter="q") == 1
    assert exp.calls == 1


def test_queue_full_drops_are_counted_exactly() -> None:
    metrics = Metrics()
    exp = InMemoryExporter()
    q = fast_queue(exp, metrics, max_queue_spans=10)
    accepted = [q.submit(s) for s in make_spans(25)]
    assert accepted == [True] * 10 + [False] * 15
    assert metrics.get("spans_dropped", reason="queue_full", exporter="q") == 15
    assert len(q) == 10
    q.start()
    q.shutdown(5)
    assert metrics.get("spans_exported", exporter="q") == 10
    assert len(exp.spans) == 10


def test_queue_full_while_exporter_is_stuck() -> None:
    """Memory is bounded by max_queue_spans plus the batch in flight."""
    metrics = Metrics()
    exp = InMemoryExporter()
    exp.block()
    q = fast_queue(exp, metrics, max_queue_spans=8, max_batch=4)
    spans = make_spans(20)
    for s in spans[:4]:
        q.submit(s)
    q.start()
    assert exp.entered.wait(2)  # the first 4 are in flight
    accepted = [q.submit(s) for s in spans[4:]]
    assert accepted == [True] * 8 + [False] * 8
    assert metrics.get("spans_dropped", reason="queue_full", exporter="q") == 8
    exp.unblock()
    assert q.force_flush(5)
    q.shutdown(5)
    assert [s.span_id for s in exp.spans] == [s.span_id for s in spans[:12]]
    assert metrics.get("spans_exported", exporter="q") == 12


def test_queue_retries_then_gives_up_and_backs_off() -> None:
    metrics = Metrics()
    exp = InMemoryExporter()
    exp.fail_next(3)
    q = fast_queue(exp, metrics, max_retries=2)
    for s in make_spans(5):
        q.submit(s)
    q.start()
    assert q.force_flush(5)
    assert metrics.get("export_retries", exporter="q") == 2
    assert metrics.get("export_failures", exporter="q") == 1
    assert metrics.get("spans_dropped", reason="export_failed", exporter="q") == 5
    # Three calls (1 + 2 retries) used the three failures up: the next batch goes through.
    for s in make_spans(3):
        q.submit(s)
    assert q.force_flush(5)
    q.shutdown(5)
    assert metrics.get("spans_exported", exporter="q") == 3
    assert exp.calls == 4


def test_queue_permanent_failure_is_not_retried() -> None:
    metrics = Metrics()
    exp = InMemoryExporter()
    exp.fail_next(1, ExportResult.fail("bad request"))
    q = fast_queue(exp, metrics)
    for s in make_spans(6):
        q.submit(s)
    q.start()
    q.shutdown(5)
    assert exp.calls == 1
    assert metrics.get("export_retries", exporter="q") == 0
    assert metrics.get("spans_dropped", reason="export_failed", exporter="q") == 6


def test_queue_max_elapsed_caps_retrying() -> None:
    metrics = Metrics()
    exp = InMemoryExporter()
    exp.fail_next(1000)
    q = fast_queue(exp, metrics, max_retries=1000, max_elapsed_s=0.2)
    q.submit(make_span(0))
    q.start()
    t0 = time.monotonic()
    assert q.force_flush(5)
    assert time.monotonic() - t0 < 1.0
    assert metrics.get("export_failures", exporter="q") == 1
    q.shutdown(1)


def test_queue_backoff_is_exponential_jittered_and_capped() -> None:
    q = BatchExportQueue(
        InMemoryExporter(), Metrics(), initial_backoff_s=0.5, max_backoff_s=4.0,
        rng=random.Random(3), name="q",
    )  # fmt: skip
    for attempt, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (10, 4.0)]:
        delays = [q._backoff(attempt, None) for _ in range(200)]
        assert all(cap / 2 <= d <= cap for d in delays)
        assert max(delays) - min(delays) > cap / 4  # jittered, not constant
    assert q._backoff(5, 12.0) == 12.0  # the server's Retry-After wins


def test_queue_exports_during_shutdown_with_a_bounded_timeout() -> None:
    metrics = Metrics()
    exp = InMemoryExporter()
    q = fast_queue(exp, metrics, flush_interval_s=30, max_batch=1000)
    for s in make_spans(3):
        q.submit(s)
    q.start()
    q.shutdown(2.0)  # the flush interval is far off: shutdown itself flushes
    assert metrics.get("spans_exported", exporter="q") == 3
    assert exp.timeouts and exp.timeouts[-1] is not None and 0 < exp.timeouts[-1] <= 2.0


def test_queue_lifecycle_is_safe() -> None:
    metrics = Metrics()
    exp = InMemoryExporter()
    q = fast_queue(exp, metrics)
    q.shutdown(1)  # without start
    q.shutdown(1)
    assert exp.shut_down
    q.start()  # after shutdown: no-op
    assert not q.submit(make_span(0))
    assert metrics.get("spans_dropped", reason="shutdown", exporter="q") == 1

    q2 = fast_queue(InMemoryExporter(), metrics, name="x")
    q2.submit(make_span(1))
    q2.shutdown(1)  # never started: what was queued is counted, not silently lost
    assert metrics.get("spans_dropped", reason="shutdown", exporter="x") == 1


def test_queue_batches_by_size_and_interval() -> None:
    metrics = Metrics()
    exp = InMemoryExporter()
    q = fast_queue(exp, metrics, max_batch=8, flush_interval_s=0.1)
    q.start()
    for s in make_spans(20):
        q.submit(s)
    deadline = time.monotonic() + 3
    while len(exp.spans) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    q.shutdown(1)
    assert sum(exp.batch_sizes) == 20
    assert max(exp.batch_sizes) <= 8
    assert metrics.get("spans_exported", exporter="q") == 20


def test_queue_batches_by_encoded_bytes_too() -> None:
    """A batch is one request: it stops before the span that would take its encoded bodies past
    max_batch_bytes (a gRPC receiver takes 4 MiB by default), a span larger than that goes
    alone, and the span count still caps it. Nothing is lost or reordered."""
    from tracejoin.core.model import EncodedSpan, Resource

    res = Resource((("service.name", "big"),))
    sizes = [300, 300, 300, 1500, 50, 50, 50, 50, 50, 50]  # bytes of each span's body
    metrics = Metrics()
    exp = InMemoryExporter()
    q = fast_queue(exp, metrics, max_batch=4, max_batch_bytes=1000, flush_interval_s=0.05)
    spans = [EncodedSpan(res, bytes([i]) * n) for i, n in enumerate(sizes)]
    assert q.submit_many(spans) == len(spans)  # queued before the worker starts: one backlog
    q.start()
    deadline = time.monotonic() + 3
    while len(exp.spans) < len(spans) and time.monotonic() < deadline:
        time.sleep(0.01)
    q.shutdown(1)
    assert exp.batch_sizes == [3, 1, 4, 2]  # 900 B; 1500 B alone; 4 x 50 B by count; the rest
    assert [s.body for s in exp.spans] == [s.body for s in spans]
    assert metrics.get("spans_exported", exporter="q") == len(spans)


def test_fanout_file_and_grpc_side_by_side(tmp_path: Path, grpc_collector: GrpcCollector) -> None:
    metrics = Metrics()
    path = tmp_path / "out.jsonl"
    fo = fanout(
        {"file": JsonLinesFileExporter(path), "otlp": OtlpGrpcExporter(grpc_collector.endpoint)},
        metrics,
        flush_interval_s=0.05,
    )
    assert isinstance(fo, FanoutQueue)
    spans = make_spans(15)
    fo.start()
    assert all(fo.submit(s) for s in spans)
    assert fo.force_flush(5)
    fo.shutdown(2)
    fo.shutdown(2)
    assert_same_request(grpc_collector.received(), reference_request(spans))
    from_file = _concat(*(decode_request_json(line) for line in path.read_text().splitlines()))
    assert sum(len(rs.scope_spans[0].spans) for rs in from_file.resource_spans) == 15
    assert metrics.get("spans_exported", exporter="file") == 15
    assert metrics.get("spans_exported", exporter="otlp") == 15


def test_fanout_shutdown_shares_one_deadline() -> None:
    """Two hung destinations stop together within one deadline, not one after the other."""
    metrics = Metrics()
    a, b = InMemoryExporter(), InMemoryExporter()
    a.block()
    b.block()
    fo = fanout([("a", a), ("b", b)], metrics, flush_interval_s=0.01)
    fo.start()
    fo.submit(make_span(0))
    assert a.entered.wait(2) and b.entered.wait(2)
    t0 = time.monotonic()
    fo.shutdown(0.5)
    assert time.monotonic() - t0 < 0.8
    assert metrics.get("spans_dropped", reason="shutdown", exporter="a") == 1
    assert metrics.get("spans_dropped", reason="shutdown", exporter="b") == 1
    a.unblock()
    b.unblock()


def test_inmemory_exporter_satisfies_protocol() -> None:
    for exp in (
        InMemoryExporter(),
        ConsoleExporter(io.StringIO()),
        JsonLinesFileExporter("/nonexistent/never-opened"),
    ):
        assert isinstance(exp, SpanExporter)
    assert ExportResult.SUCCESS.ok and ExportResult.retry("x").retryable
    assert trace_service_pb2.DESCRIPTOR.package == "opentelemetry.proto.collector.trace.v1"


# ------------------------------------------------------------------------------ perfetto


def test_perfetto_names_tracks_from_the_spans_only() -> None:
    """Process and thread names come from the span (resource, `thread.name`), never from
    /proc: this process's own pid and tid, without `thread.name`, stay `thread <tid>`."""
    pid, tid = os.getpid(), threading.get_native_id()
    own = Resource((("service.name", "api"), ("process.executable.name", "gunicorn"),
                    ("process.pid", pid)))  # fmt: skip
    named, unnamed = make_span(0, own), make_span(1, own)
    named.attributes = {"thread.id": tid + 1, "thread.name": "worker-3"}
    unnamed.attributes = {"thread.id": tid}
    unnamed.start_ns = named.start_ns = 10**18
    doc = trace_document([named, unnamed])
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    threads = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {tid + 1: f"worker-3 {tid + 1}", tid: f"thread {tid}"}
    (process,) = [e["args"]["name"] for e in meta if e["name"] == "process_name"]
    assert process == "api (gunicorn)"
