"""HTTP/2 (h2c): one SERVER span per stream, in the caller's trace (bpf/http2_*.h).

Real BPF as root: a grpcio server and client (traceparent as metadata, unary, server-streaming,
a non-OK status), and hand-built frame sequences against a scripted server (tests/servers/
h2raw.py) for the edge cases: a HEADERS frame split across reads, CONTINUATION, padding and
priority, a traceparent indexed by one stream and reused by index on the next, RST_STREAM,
GOAWAY, a malformed frame. Each gives the right span or is counted by reason, never a wrong
trace id. The pure parts (Huffman coding, the kernel's name constants) are unit tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import re
import shutil
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from harness import Agent, free_ports, new_traceparent, server
from jaeger import Jaeger, parent_span_id, span_tags, trace_ids_equal
from tracejoin.core.hpack import huffman_decode, huffman_encode
from tracejoin.core.model import KIND_SERVER, STATUS_ERROR, Span
from tracejoin.core.record import (
    H2F_PATH_HUFF,
    H2F_STREAM,
    HTTP_PATH_MAX,
    KERNEL_COUNTERS,
    REC_HTTP,
    REQF_PATH_TRUNC,
    HttpRecord,
)

HERE = Path(__file__).parent
GRPCSERVER = HERE / "servers" / "grpcserver.py"
H2RAW = HERE / "servers" / "h2raw.py"
GOH2C = HERE / "servers" / "goh2c"
CACHE = Path(os.environ.get("TRACEJOIN_CACHE", "/var/cache/tracejoin"))
BPF = HERE.parent / "bpf"

SECRET = "Bearer tj-h2-SECRET-authorization"
COOKIE = "session=tj-h2-SECRET-cookie"
BODY = b"tj-h2-SECRET-body"


# --------------------------------------------------------------------------- unit: HPACK


def test_huffman_round_trip_and_rfc_vector() -> None:
    # RFC 7541 C.4.1
    assert huffman_encode(b"www.example.com").hex() == "f1e3c2e5f23a6ba0ab90f4ff"
    assert huffman_decode(bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")) == b"www.example.com"
    for s in (b"", b"/tj.Echo/Say", bytes(range(256)), b"00-" + b"ab" * 30):
        assert huffman_decode(huffman_encode(s)) == s


def test_huffman_rejects_bad_padding_and_cuts_partial_prefixes() -> None:
    assert huffman_decode(b"\x00") is None  # padding of zeros, not EOS ones
    coded = huffman_encode(b"/a/long/path")
    assert huffman_decode(coded[:-3]) is None
    got = huffman_decode(coded[:-3], partial=True)
    assert got is not None and b"/a/long/path".startswith(got)


def test_kernel_name_constants_are_the_huffman_codes() -> None:
    """bpf/http2_scan.h compares Huffman-coded names as little-endian words."""
    src = (BPF / "http2_scan.h").read_text()
    for macro, name in (
        ("HUFF_TRACEPARENT", b"traceparent"),
        ("HUFF_GRPC_STATUS", b"grpc-status"),
        ("HUFF_PATH", b":path"),
        ("HUFF_METHOD", b":method"),
        ("HUFF_STATUS", b":status"),
    ):
        m = re.search(rf"#define {macro} (0x[0-9a-f]+)ULL", src)
        assert m, macro
        assert int(m.group(1), 16) == int.from_bytes(huffman_encode(name), "little"), macro


# --------------------------------------------------------------------------- unit: the query cut


def kernel_path_copy(coded: bytes) -> int:
    """How many bytes of a Huffman-coded :path the kernel copies: a mirror of h2_str_byte in
    bpf/http2_scan.h (test_huffman_path_query_never_leaves_the_kernel checks the kernel itself).
    It stops at the first byte in which a run of eight 1-bits completes (the start of the codes
    of '?' and '#'), unless that byte is the last and all ones (the EOS padding)."""
    qmin = 0xFF  # the smallest byte completing eight 1-bits with the ones carried in
    for i, b in enumerate(coded):
        if b >= qmin and (b != 0xFF or i + 1 < len(coded)):
            return i
        nb = ~b & 0xFF
        qmin = (0xFF * (nb & -nb)) & 0xFF
    return len(coded)


PATHS = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/helloworld.Greeter/SayHello",
    "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/ServerLive",
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
    "/tensorflow.serving.PredictionService/Predict",
    "/text_generation.v2.TextGenerationService/Prefill",
    "/tj.Echo/Say",
    "/generate",
    "/generate_stream",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v2/models/resnet50/versions/1/infer",
    "/v2/health/ready",
    "/api/users/12345/orders",
    "/api/v1/items/9",
    "/api/v1/namespaces/default/pods",
    "/openai/deployments/gpt-4o/chat/completions",
    "/static/js/app.3f9a1c.js",
    "/files/report%20final.pdf",
    "/snake_case/path-with-dash/v1.2.3",
    "/favicon.ico",
    "/healthz",
    "/echo/199",
    "/models/llama-3.1-70b/v9x",
)


def test_huffman_path_cut_keeps_common_paths_whole() -> None:
    """The trade-off docs/attributes.md states: among these gRPC and REST paths only one with a
    '9' before 'x' is cut early; among pairs of the common path characters ('/', lowercase,
    digits, '.', '-', '_', '%') only '9' followed by j, k, q, v, w, x, y or z trips the cut."""
    cut = [p for p in PATHS if kernel_path_copy(c := huffman_encode(p.encode())) < len(c)]
    assert cut == ["/models/llama-3.1-70b/v9x"]
    common = "/" + string.ascii_lowercase + string.digits + ".-_%"
    tripping = {
        a + b
        for a in common
        for b in common
        if kernel_path_copy(c := huffman_encode(f"/{a}{b}/".encode())) < len(c)
    }
    assert tripping == {"9" + b for b in "jkqvwxyz"}
    kept = huffman_encode(b"/models/llama-3.1-70b/v9x")
    prefix = huffman_decode(kept[: kernel_path_copy(kept)], partial=True)
    assert prefix is not None and "/models/llama-3.1-70b/v9x".startswith(prefix.decode())


def test_huffman_path_cut_never_keeps_a_query_byte() -> None:
    """Whatever the path, what the kernel keeps decodes to a prefix of the part before the
    first '?' or '#': realistic paths with queries, and random bytes (every character)."""
    rng = random.Random(15)
    cases = [p.encode() + q for p in PATHS for q in (b"?secret=tj", b"?", b"#frag", b"?a=9&b=Z")]
    for _ in range(20_000):
        s = bytearray(rng.randbytes(rng.randrange(0, 40)))
        s.insert(rng.randrange(0, len(s) + 1), rng.choice(b"?#"))
        cases.append(bytes(s))
    for s in cases:
        coded = huffman_encode(s)
        got = huffman_decode(coded[: kernel_path_copy(coded)], partial=True)
        before = s[: min(i for i in (s.find(b"?"), s.find(b"#")) if i >= 0)]
        assert got is not None and before.startswith(got), s


def test_capture_summary_groups_grpc_by_method_with_status() -> None:
    from tracejoin.commands.summary import Summary

    s = Summary()
    for code in (0, 0, 13):
        attrs = {
            "rpc.system": "grpc",
            "rpc.grpc.status_code": code,
            "http.response.status_code": 200,
        }
        s.add("tj.Echo/Say", "ab" * 16, 1_000_000, code == 13, 200, attrs)
    text = s.format()
    assert "tj.Echo/Say" in text and "grpc status: OK 2, INTERNAL 1" in text


# --------------------------------------------------------------------------- frames


def frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + sid.to_bytes(4, "big") + payload
    )


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = frame(4, 0, 0, b"")
DATA, HEADERS, RST, GOAWAY, PING, CONT = 0, 1, 3, 7, 6, 9
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20


def hint(v: int, prefix: int, first: int = 0) -> bytes:
    """An HPACK integer with a `prefix`-bit prefix; `first` holds the pattern bits."""
    top = (1 << prefix) - 1
    if v < top:
        return bytes([first | v])
    out, v = [first | top], v - top
    while v >= 128:
        out.append(v % 128 | 128)
        v //= 128
    return bytes([*out, v])


def hstr(s: bytes, huff: bool = False) -> bytes:
    data = huffman_encode(s) if huff else s
    return hint(len(data), 7, 0x80 if huff else 0) + data


def indexed(i: int) -> bytes:
    return hint(i, 7, 0x80)


def lit(name: bytes | int, value: bytes, inc: bool = False, huff: bool = False) -> bytes:
    """A literal field: with incremental indexing (inc) or without; name by index or literal."""
    prefix, first = (6, 0x40) if inc else (4, 0x00)
    if isinstance(name, int):
        return hint(name, prefix, first) + hstr(value, huff)
    return bytes([first]) + hstr(name, huff) + hstr(value, huff)


def request_block(path: bytes, tp: bytes | None, inc_tp: bool = False, huff: bool = False) -> bytes:
    block = indexed(3) + lit(4, path, huff=huff) + indexed(7)  # POST, :path, :scheme http
    block += lit(b"authorization", SECRET.encode()) + lit(b"cookie", COOKIE.encode())
    if tp is not None:
        block += lit(b"traceparent", tp, inc=inc_tp, huff=huff)
    return block


def response(sid: int, grpc_status: int = 0, huff: bool = False) -> bytes:
    status = lit(b"grpc-status", b"%d" % grpc_status, huff=huff)
    return (
        frame(HEADERS, END_HEADERS, sid, indexed(8) + lit(b"content-type", b"application/grpc"))
        + frame(DATA, 0, sid, b"\0\0\0\0\x05" + BODY[:5])
        + frame(HEADERS, END_HEADERS | END_STREAM, sid, status)
    )


class Scripted:
    """tests/servers/h2raw.py and a client socket: send, then have the server read or write."""

    def __init__(self, port: int) -> None:
        import socket

        self.proc = subprocess.Popen(
            [sys.executable, str(H2RAW), str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and "ready" in self.proc.stdout.readline()
        self.sock = socket.create_connection(("127.0.0.1", port))

    def _cmd(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def client(self, data: bytes) -> None:
        """The client sends `data` and the server reads it in one read."""
        self.sock.sendall(data)
        time.sleep(0.02)
        self._cmd(f"read {len(data)}")

    def server(self, data: bytes) -> None:
        self._cmd(f"write {data.hex()}")
        time.sleep(0.02)

    def close(self) -> None:
        self._cmd("close")
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


# --------------------------------------------------------------------------- privileged


@pytest.fixture(scope="module")
def h2agent(privileged: None) -> Iterator[Agent]:
    a = Agent(free_ports(16), None)
    a.start()
    try:
        yield a
    finally:
        a.shutdown()


def kernel_counter(agent: Agent, name: str) -> int:
    idx = next(i for i, n in KERNEL_COUNTERS.items() if n == name)
    bpf = agent.source._bpf
    assert bpf is not None
    return int(sum(bpf[b"counters"][idx]))


def _server_spans(agent: Agent, port: int, n: int) -> list[Span]:
    def mine(spans: list[Span]) -> list[Span]:
        return [
            s for s in spans if s.kind == KIND_SERVER and s.attributes.get("server.port") == port
        ]

    return mine(agent.wait_for(lambda sp: len(mine(sp)) >= n, 15.0))


@contextmanager
def grpc_server(port: int) -> Iterator[None]:
    proc = subprocess.Popen(
        [sys.executable, str(GRPCSERVER), str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        yield
    finally:
        proc.kill()
        proc.wait()


def _no_secret_anywhere(spans: list[Span]) -> None:
    text = repr([(s.name, s.attributes, s.status_message) for s in spans])
    for secret in ("SECRET", "session=", "Bearer"):
        assert secret not in text


def test_grpcio_unary_streaming_and_error_status(h2agent: Agent) -> None:
    grpc = pytest.importorskip("grpc")
    port = h2agent.take_port()
    with grpc_server(port):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        calls = {}
        for method, kind in (
            ("Say", "unary"),
            ("Stream", "stream"),
            ("Fail", "unary"),
            ("Say", "unary"),
        ):
            tp, tid, parent = new_traceparent()
            md = (("traceparent", tp), ("authorization", SECRET), ("cookie", COOKIE))
            if kind == "stream":
                assert list(ch.unary_stream(f"/tj.Echo/{method}")(BODY, metadata=md)) == [BODY] * 3
            else:
                try:
                    assert ch.unary_unary(f"/tj.Echo/{method}")(BODY, metadata=md) == BODY
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.INTERNAL and method == "Fail"
            calls[tid] = (method, parent)
        ch.close()
        spans = _server_spans(h2agent, port, len(calls))
    losses = {n: kernel_counter(h2agent, n) for n in KERNEL_COUNTERS.values() if n.startswith("h2")}
    seen = [
        (s.attributes.get("tracejoin.http2.stream_id"), s.name, s.trace_id in calls) for s in spans
    ]
    assert {s.trace_id for s in spans} == set(calls), (losses, seen)
    for s in spans:
        method, parent = calls[s.trace_id]
        a = s.attributes
        assert s.parent_span_id == parent
        assert s.name == f"tj.Echo/{method}"
        assert a["rpc.system"] == "grpc" and a["rpc.service"] == "tj.Echo"
        assert a["rpc.method"] == method and a["url.path"] == f"/tj.Echo/{method}"
        assert a["network.protocol.version"] == "2" and a["http.request.method"] == "POST"
        assert a["http.response.status_code"] == 200
        if method == "Fail":
            assert a["rpc.grpc.status_code"] == 13 and s.status_code == STATUS_ERROR
        else:
            assert a["rpc.grpc.status_code"] == 0 and s.status_code != STATUS_ERROR
    _no_secret_anywhere(spans)


def test_grpcio_concurrent_calls_beyond_the_stream_slots_are_spans_or_counted(
    h2agent: Agent,
) -> None:
    """gRPC core multiplexes concurrent calls on one connection and reads many header blocks at
    once (a plain-text traceparent, every other field indexed after the first call). 300
    client-streaming calls held open at once pass the H2_STREAMS (256) streams tracked per
    connection: the first 256 are spans with the trace id and parent they carried, the other 44
    are counted once each as streams not tracked, and nothing else is lost or counted."""
    import threading

    grpc = pytest.importorskip("grpc")
    port = h2agent.take_port()
    before = {n: kernel_counter(h2agent, n) for n in ("h2_streams_full", "h2_state_lost")}
    go = threading.Event()

    def requests():  # type: ignore[no-untyped-def]
        go.wait(30)
        yield BODY

    calls = {}
    with grpc_server(port):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        collect = ch.stream_unary("/tj.Echo/Collect")
        assert collect(iter([BODY])) == BODY  # the connection is up before the burst
        futures = []
        for _ in range(300):
            tp, tid, parent = new_traceparent()
            calls[tid] = parent
            futures.append(collect.future(requests(), metadata=(("traceparent", tp),)))
        time.sleep(1.0)  # every call's HEADERS is out: 300 streams open
        go.set()
        assert [f.result(timeout=60) for f in futures] == [BODY] * 300
        ch.close()
        spans = _server_spans(h2agent, port, 257)
    spans = [s for s in spans if s.trace_id in calls]
    full = kernel_counter(h2agent, "h2_streams_full") - before["h2_streams_full"]
    assert (len(spans), full) == (256, 44)
    assert kernel_counter(h2agent, "h2_state_lost") == before["h2_state_lost"]
    for s in spans:
        assert s.parent_span_id == calls[s.trace_id] and s.name == "tj.Echo/Collect"


def test_grpcio_call_round_trips_through_jaeger(agent: Agent, jaeger: Jaeger) -> None:
    """The session agent exports over OTLP to a real Jaeger: a gRPC call's span comes back
    from Jaeger's query API under the caller's trace and parent, with its rpc.* tags, and a
    non-OK status as an error."""
    grpc = pytest.importorskip("grpc")
    port = agent.take_port()
    calls = {method: new_traceparent() for method in ("Say", "Fail")}
    with grpc_server(port):
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        for method, (tp, _, _) in calls.items():
            try:
                ch.unary_unary(f"/tj.Echo/{method}")(BODY, metadata=(("traceparent", tp),))
            except grpc.RpcError as exc:
                assert method == "Fail" and exc.code() == grpc.StatusCode.INTERNAL
        ch.close()
        for method, (_, tid, parent) in calls.items():
            trace = jaeger.get_trace(f"{tid:032x}", timeout_s=15)
            (span,) = [s for s in trace["spans"] if span_tags(s).get("span.kind") == "server"]
            tags = span_tags(span)
            assert trace_ids_equal(span["traceID"], f"{tid:032x}")
            assert parent_span_id(span) == f"{parent:016x}"
            assert span["operationName"] == f"tj.Echo/{method}", tags
            assert tags["rpc.system"] == "grpc" and tags["rpc.service"] == "tj.Echo"
            assert tags["rpc.method"] == method and tags["server.port"] == port
            assert tags["rpc.grpc.status_code"] == (13 if method == "Fail" else 0)
            assert (tags.get("otel.status_code") == "ERROR") == (method == "Fail"), tags


def test_streams_no_http2_server_answered_or_without_method_are_not_spans(h2agent: Agent) -> None:
    """A client's claim is not a request: an HTTP/2 preface and a HEADERS frame carrying a
    traceparent, sent to a server that answers in HTTP/1.x, give no span (the trace id is the
    sender's word only), and neither does a HEADERS block without :method and :path on a real
    HTTP/2 connection (malformed, RFC 9113 8.3.1). Both are counted; the connection that did
    speak HTTP/2 goes on to trace its next, well-formed stream."""
    port = h2agent.take_port()
    poison, poison_id, _ = new_traceparent()
    unanswered = kernel_counter(h2agent, "h2_unanswered")
    malformed = kernel_counter(h2agent, "h2_malformed")
    c = Scripted(port)
    try:
        c.client(
            PREFACE
            + SETTINGS
            + frame(HEADERS, END_HEADERS, 1, lit(b"traceparent", poison.encode()))
        )
        c.server(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    finally:
        c.close()
    port2 = h2agent.take_port()
    good, good_id, good_parent = new_traceparent()
    bare, bare_id, _ = new_traceparent()
    c = Scripted(port2)
    try:
        c.client(PREFACE + SETTINGS)
        c.server(SETTINGS)
        c.client(frame(HEADERS, END_HEADERS | END_STREAM, 1, lit(b"traceparent", bare.encode())))
        c.server(frame(RST, 0, 1, b"\0\0\0\x01"))
        c.client(
            frame(HEADERS, END_HEADERS | END_STREAM, 3, request_block(b"/a.B/Ok", good.encode()))
        )
        c.server(response(3))
        (span,) = _server_spans(h2agent, port2, 1)
    finally:
        c.close()
    assert span.trace_id == good_id and span.parent_span_id == good_parent
    assert span.attributes["tracejoin.http2.stream_id"] == 3
    assert kernel_counter(h2agent, "h2_unanswered") == unanswered + 1
    assert kernel_counter(h2agent, "h2_malformed") == malformed + 1
    time.sleep(0.3)  # a late span would be a defect: give the reader a few batches
    assert not [s for s in h2agent.spans() if s.trace_id in (poison_id, bare_id)]


def test_a_header_block_ending_on_a_programs_last_step_still_ends(h2agent: Agent) -> None:
    """The decoder runs a bounded number of steps per program. A header block whose last byte
    is taken by a program's last step still has its end to run (the request's headers are
    complete; a response's trailers end its stream), though no byte is left: blocks of 1 to 72
    one-byte fields put that boundary at every position, on both sides."""
    port = h2agent.take_port()
    sent = []
    c = Scripted(port)
    try:
        c.client(PREFACE + SETTINGS)
        c.server(SETTINGS)
        for k in range(1, 73):
            sid = 2 * k - 1
            tp, tid, parent = new_traceparent()
            sent.append((sid, tid, parent))
            extra = indexed(16) * k  # accept-encoding: gzip, deflate
            c.client(
                frame(
                    HEADERS,
                    END_HEADERS | END_STREAM,
                    sid,
                    request_block(b"/a.B/M", tp.encode()) + extra,
                )
            )
            c.server(frame(HEADERS, END_HEADERS | END_STREAM, sid, indexed(8) + extra))
        spans = _server_spans(h2agent, port, len(sent))
    finally:
        c.close()
    got = {s.attributes["tracejoin.http2.stream_id"]: s for s in spans}
    assert sorted(got) == [sid for sid, _, _ in sent]
    for sid, tid, parent in sent:
        assert got[sid].trace_id == tid and got[sid].parent_span_id == parent
        assert "tracejoin.http2.ended_by" not in got[sid].attributes, got[sid].attributes


def test_hand_built_frames(h2agent: Agent) -> None:
    """Split HEADERS, CONTINUATION, padding and priority, a traceparent reused by index, a
    literal :path with a query, RST_STREAM, GOAWAY: the right span for each stream."""
    port = h2agent.take_port()
    c = Scripted(port)
    tps = {sid: new_traceparent() for sid in (1, 3, 5, 7, 9)}
    try:
        c.client(PREFACE + SETTINGS)
        c.server(SETTINGS)
        # stream 1: HEADERS split across two reads, the traceparent inserted into the table
        h1 = frame(
            HEADERS,
            END_HEADERS,
            1,
            request_block(b"/a.B/One?q=SECRET", tps[1][0].encode(), inc_tp=True),
        )
        c.client(h1[:20])
        c.client(h1[20:] + frame(DATA, END_STREAM, 1, BODY))
        c.server(response(1))
        # stream 3: the same traceparent, by index (the newest dynamic entry: 62)
        c.client(
            frame(
                HEADERS, END_HEADERS | END_STREAM, 3, indexed(3) + lit(4, b"/a.B/Two") + indexed(62)
            )
        )
        c.server(response(3, grpc_status=5))
        # stream 5: PADDED + PRIORITY HEADERS continued by CONTINUATION, Huffman-coded values
        block = request_block(b"/a.B/Three", tps[5][0].encode(), huff=True)
        pad = 7
        first = bytes([pad]) + b"\0\0\0\0\x10" + block[:9] + b"\0" * pad
        c.client(
            frame(HEADERS, PADDED | PRIORITY, 5, first) + frame(CONT, END_HEADERS, 5, block[9:])
        )
        c.server(response(5, grpc_status=14, huff=True))  # "14": a 5-bit and a 6-bit code
        # stream 7: reset by the client before any response
        c.client(frame(HEADERS, END_HEADERS, 7, request_block(b"/a.B/Four", tps[7][0].encode())))
        c.client(frame(RST, 0, 7, b"\0\0\0\x08"))
        # stream 9: open when the server sends GOAWAY with last stream 7
        c.client(frame(HEADERS, END_HEADERS, 9, request_block(b"/a.B/Five", tps[9][0].encode())))
        c.server(frame(GOAWAY, 0, 0, (7).to_bytes(4, "big") + b"\0\0\0\0"))
        spans = _server_spans(h2agent, port, 5)
    finally:
        c.close()
    by_stream = {s.attributes["tracejoin.http2.stream_id"]: s for s in spans}
    assert set(by_stream) == {1, 3, 5, 7, 9}
    assert by_stream[1].trace_id == tps[1][1] and by_stream[1].attributes["url.path"] == "/a.B/One"
    assert by_stream[3].trace_id == tps[1][1]  # reused by index: the entry stream 1 inserted
    assert by_stream[3].attributes["rpc.grpc.status_code"] == 5
    assert (
        by_stream[5].trace_id == tps[5][1] and by_stream[5].attributes["url.path"] == "/a.B/Three"
    )
    assert by_stream[5].attributes["rpc.grpc.status_code"] == 14
    assert by_stream[7].trace_id == tps[7][1]
    assert by_stream[7].attributes["tracejoin.http2.ended_by"] == "rst_stream"
    assert by_stream[9].trace_id == tps[9][1]
    assert by_stream[9].attributes["tracejoin.http2.ended_by"] == "goaway"
    _no_secret_anywhere(spans)


def test_dynamic_table_references_resolved_or_counted_never_guessed(h2agent: Agent) -> None:
    """A traceparent by dynamic index is the value its entry was inserted with, also past the
    128 insertions whose kinds the kernel keeps. A reference to an entry whose value the kernel
    does not hold (a second traceparent in one block is never copied) is counted; a stream
    that then lacks a traceparent is not a span (the missing one may have been that entry: a
    span would start a new trace on a guess), and one that has its own is flagged."""
    port = h2agent.take_port()
    names = ("h2_dyn_unresolved", "h2_dyn_beyond", "h2_field_unresolved", "h2_malformed")
    before = {n: kernel_counter(h2agent, n) for n in names}
    tp1, tid1, parent1 = new_traceparent()
    tp2, tid2, _ = new_traceparent()
    tp4, tid4, parent4 = new_traceparent()
    tp5, tid5, parent5 = new_traceparent()
    fillers = b"".join(lit(b"x-n", b"%d" % i, inc=True) for i in range(130))

    def req(path: bytes, rest: bytes) -> bytes:
        return indexed(3) + lit(4, path) + rest

    c = Scripted(port)
    try:
        c.client(PREFACE + SETTINGS)
        # the server's decoder table: 64 KiB, so 132 entries stay in it (RFC 7541 4.2)
        c.server(frame(4, 0, 0, b"\0\x01" + (65536).to_bytes(4, "big")))
        streams = {
            # insertion 0: tp1 with its value; 1: tp2, a second traceparent, not copied
            1: req(b"/a.B/One", lit(b"traceparent", tp1.encode(), inc=True))
            + lit(b"traceparent", tp2.encode(), inc=True),
            3: req(b"/a.B/Two", indexed(62)),  # tp2's entry: no value held
            5: req(b"/a.B/Three", indexed(63)),  # tp1's entry
            7: req(b"/a.B/Four", fillers + lit(b"traceparent", tp4.encode())),  # 2..131
            9: req(b"/a.B/Five", indexed(62 + 131)),  # tp1's, beyond the kinds kept
            11: req(b"/a.B/Six", indexed(62 + 130)),  # tp2's, beyond: kind unknown
            13: req(b"/a.B/Seven", indexed(62 + 129) + lit(b"traceparent", tp5.encode())),
        }
        for sid, block in streams.items():
            c.client(frame(HEADERS, END_HEADERS | END_STREAM, sid, block))
            c.server(response(sid))
        spans = _server_spans(h2agent, port, 5)
        time.sleep(0.3)  # a late span for stream 3 or 11 would be a defect
        spans = _server_spans(h2agent, port, 5)
    finally:
        c.close()
    by_stream = {s.attributes["tracejoin.http2.stream_id"]: s for s in spans}
    assert sorted(by_stream) == [1, 5, 7, 9, 13]
    assert tid2 not in {s.trace_id for s in spans}
    for sid, tid, parent in ((5, tid1, parent1), (7, tid4, parent4), (9, tid1, parent1)):
        assert (by_stream[sid].trace_id, by_stream[sid].parent_span_id) == (tid, parent)
        assert "tracejoin.http2.field_unresolved" not in by_stream[sid].attributes
    assert (by_stream[13].trace_id, by_stream[13].parent_span_id) == (tid5, parent5)
    assert by_stream[13].attributes["tracejoin.http2.field_unresolved"] is True
    after = {n: kernel_counter(h2agent, n) - before[n] for n in names}
    assert after == {
        "h2_dyn_unresolved": 1,
        "h2_dyn_beyond": 2,
        "h2_field_unresolved": 2,
        "h2_malformed": 0,
    }


def test_a_header_block_larger_than_the_copy_window(h2agent: Agent) -> None:
    """A 12 KiB cookie before the traceparent, in one HEADERS frame and one read: the kernel
    walks it window by window (the value skipped by count, never copied) and finds the
    traceparent after it."""
    port = h2agent.take_port()
    tp, tid, parent = new_traceparent()
    cookie = COOKIE.encode() + b"x" * 12288
    block = (
        indexed(3) + lit(4, b"/a.B/Big") + lit(b"cookie", cookie) + lit(b"traceparent", tp.encode())
    )
    c = Scripted(port)
    try:
        c.client(PREFACE + SETTINGS + frame(HEADERS, END_HEADERS | END_STREAM, 1, block))
        c.server(SETTINGS + response(1))
        (span,) = _server_spans(h2agent, port, 1)
    finally:
        c.close()
    assert (span.trace_id, span.parent_span_id) == (tid, parent)
    assert span.attributes["url.path"] == "/a.B/Big"
    _no_secret_anywhere([span])


def test_huffman_path_query_never_leaves_the_kernel(
    h2agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Huffman-coded :path with a query: the record the kernel sends holds no query byte (its
    path bytes are kept as they arrive from the ring buffer, before user space decodes them),
    and the span's path is the part before '?'. A path whose code holds eight 1-bits without a
    '?' ('9' then 'w') is cut there too, and says so."""
    port = h2agent.take_port()
    raw: list[bytes] = []
    poll = h2agent.source.poll
    kept = threading.Event()

    def keep(timeout_ms: int = 100) -> list[bytes]:
        kept.set()
        batch = poll(timeout_ms)
        raw.extend(batch)
        return batch

    monkeypatch.setattr(h2agent.source, "poll", keep)
    # the reader's wait that began before the patch (up to IDLE_POLL_MS on an idle agent)
    # must end first, or it would take the records unseen
    assert kept.wait(5)
    tps = {sid: new_traceparent() for sid in (1, 3)}
    c = Scripted(port)
    try:
        c.client(PREFACE + SETTINGS)
        c.server(SETTINGS)
        for sid, path in ((1, b"/a.B/Query?secret=tj-h2-SECRET-query"), (3, b"/x/9w/y")):
            block = request_block(path, tps[sid][0].encode(), huff=True)
            c.client(frame(HEADERS, END_HEADERS | END_STREAM, sid, block))
            c.server(response(sid))
        spans = _server_spans(h2agent, port, 2)
    finally:
        c.close()
    by_stream = {s.attributes["tracejoin.http2.stream_id"]: s for s in spans}
    assert by_stream[1].trace_id == tps[1][1] and by_stream[3].trace_id == tps[3][1]
    assert by_stream[1].attributes["url.path"] == "/a.B/Query"
    cut = by_stream[3].attributes
    assert "/x/9w/y".startswith(cut["url.path"]) and cut["url.path"] != "/x/9w/y"
    assert cut["tracejoin.http.path_truncated"] is True
    _no_secret_anywhere(spans)
    records = [
        HttpRecord.from_buffer_copy(r.ljust(ctypes.sizeof(HttpRecord), b"\0"))
        for r in raw
        if r[0] == REC_HTTP
    ]
    mine = [r for r in records if r.h2_flags & H2F_STREAM and r.seq in (1, 3)]
    assert {r.seq for r in mine} >= {1, 3}
    for r in mine:
        assert r.h2_flags & H2F_PATH_HUFF and r.flags & REQF_PATH_TRUNC
        off = HttpRecord.path.offset
        coded = bytes(r)[off : off + min(r.path_len, HTTP_PATH_MAX)]
        got = huffman_decode(coded, partial=True)
        assert got is not None and b"?" not in got, got
        assert got in (b"/a.B/Query", *(b"/x/9w/y"[:n] for n in range(8)))


def test_upgrade_h2c_answered_by_101(h2agent: Agent) -> None:
    """HTTP/1.1 `Upgrade: h2c` answered by 101 (RFC 7540 3.2): the upgrade request is an
    HTTP/1.x span with status 101, and the streams after the switch are HTTP/2 spans in their
    callers' traces."""
    port = h2agent.take_port()
    tps = {sid: new_traceparent() for sid in (1, 3, 5)}
    c = Scripted(port)
    try:
        c.client(
            b"GET /up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"
            b"traceparent: " + tps[1][0].encode() + b"\r\n\r\n"
        )
        # the 101, the server's SETTINGS and its answer on stream 1 (the upgrade request's) in
        # one write: the HTTP/1.x scan ends at the 101 and the HTTP/2 one goes on from there
        c.server(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
            + SETTINGS
            + response(1)
        )
        c.client(PREFACE + SETTINGS)
        for sid in (3, 5):
            c.client(
                frame(
                    HEADERS,
                    END_HEADERS | END_STREAM,
                    sid,
                    request_block(b"/a.B/Up%d" % sid, tps[sid][0].encode(), huff=sid == 5),
                )
            )
            c.server(response(sid, grpc_status=14 if sid == 5 else 0))
        spans = _server_spans(h2agent, port, 3)
    finally:
        c.close()
    by_trace = {s.trace_id: s for s in spans}
    assert set(by_trace) == {tps[sid][1] for sid in (1, 3, 5)}
    up = by_trace[tps[1][1]].attributes
    assert up["http.response.status_code"] == 101 and "network.protocol.version" not in up
    for sid in (3, 5):
        s = by_trace[tps[sid][1]]
        assert s.parent_span_id == tps[sid][2] and s.name == f"a.B/Up{sid}"
        assert s.attributes["tracejoin.http2.stream_id"] == sid
        assert s.attributes["rpc.grpc.status_code"] == (14 if sid == 5 else 0)
    assert by_trace[tps[5][1]].status_code == STATUS_ERROR
    _no_secret_anywhere(spans)


def test_malformed_frame_is_counted_never_a_wrong_trace(h2agent: Agent) -> None:
    port = h2agent.take_port()
    before = kernel_counter(h2agent, "h2_frame_invalid")
    c = Scripted(port)
    tp, tid, _ = new_traceparent()
    try:
        c.client(PREFACE + SETTINGS)
        c.server(SETTINGS)
        c.client(frame(HEADERS, END_HEADERS, 1, request_block(b"/a.B/C", tp.encode())))
        c.client(frame(PING, 0, 0, b"\0" * 7))  # PING must be 8 bytes
        other, _, _ = new_traceparent()
        c.client(frame(HEADERS, END_HEADERS, 3, request_block(b"/a.B/D", other.encode())))
        spans = _server_spans(h2agent, port, 1)
    finally:
        c.close()
    assert kernel_counter(h2agent, "h2_frame_invalid") == before + 1
    assert [s.trace_id for s in spans] == [tid]  # stream 3 came after the loss: not opened
    assert spans[0].attributes["tracejoin.http2.ended_by"] == "framing_lost"


def test_http1_on_the_same_port_still_works(h2agent: Agent) -> None:
    port = h2agent.take_port()
    with server("threaded", port):
        import urllib.request

        tp, tid, parent = new_traceparent()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/plain", headers={"traceparent": tp})
        urllib.request.urlopen(req, timeout=5).read()
        spans = _server_spans(h2agent, port, 1)
    assert spans[0].trace_id == tid and spans[0].parent_span_id == parent
    assert "network.protocol.version" not in spans[0].attributes


def _call(c: Scripted, sid: int, path: bytes, opening: bool = False) -> tuple[int, int]:
    """One answered stream on c (after the client preface and both SETTINGS when `opening`);
    its trace id and parent span id."""
    if opening:
        c.client(PREFACE + SETTINGS)
        c.server(SETTINGS)
    tp, tid, parent = new_traceparent()
    c.client(frame(HEADERS, END_HEADERS | END_STREAM, sid, request_block(path, tp.encode())))
    c.server(response(sid))
    return tid, parent


def test_http2_programs_verified_after_ready(privileged: None, monkeypatch) -> None:
    """`tracejoin run` is ready before the HTTP/2 programs are verified: a connection that
    turns HTTP/2 meanwhile is counted and ignored for good (its bytes so far went unscanned, so
    its framing is unknown: never half-scanned, never a guessed stream), and one that opens
    once they are in is traced."""
    import threading

    from tracejoin.kernel.probes import HttpProbes, ProbeConfig

    gate = threading.Event()  # holds the loader until the early connection has spoken
    load = HttpProbes._load_http2

    def gated(self: HttpProbes, bpf: object) -> None:
        gate.wait(120)
        load(self, bpf)

    monkeypatch.setattr(HttpProbes, "_load_http2", gated)
    ports = free_ports(2)
    a = Agent(ports, None, probe_config=ProbeConfig(ports=tuple(ports), http2_after_ready=True))
    a.start()
    early_port, late_port = a.take_port(), a.take_port()
    early = late = None
    try:
        status = a.source.status
        assert status.signals["http2"] == "loading"
        assert a.metrics.get("probe_mode", signal="http2") == 0
        early = Scripted(early_port)
        tid1, _ = _call(early, 1, b"/e.A/One", opening=True)
        assert kernel_counter(a, "h2_not_loaded") == 1

        gate.set()
        deadline = time.monotonic() + 120
        while status.signals["http2"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status.signals["http2"] == "on" and status.http2_load_seconds > 0
        # no cache: this start compiled, HTTP/2's programs after ready too
        assert status.compile_later and status.http2_compile_seconds > 0
        assert a.metrics.get("probe_mode", signal="http2") == 1

        # the early connection goes on after the load: still ignored
        tid3, _ = _call(early, 3, b"/e.A/Two")
        late = Scripted(late_port)
        tid, parent = _call(late, 1, b"/l.A/One", opening=True)
        spans = _server_spans(a, late_port, 1)
        # the early connection's records, had there been any, were read before the late one's
        early_spans = [s for s in a.spans() if s.attributes.get("server.port") == early_port]
        assert kernel_counter(a, "h2_not_loaded") == 1
    finally:
        gate.set()
        for c in (early, late):
            if c is not None:
                c.close()
        loader = a.source._h2_loader
        if loader is not None:
            loader.join(120)
        a.shutdown()
    assert [(s.trace_id, s.parent_span_id) for s in spans] == [(tid, parent)]
    assert spans[0].attributes["url.path"] == "/l.A/One"
    assert early_spans == []
    assert {tid1, tid3}.isdisjoint(s.trace_id for s in a.spans())


def goh2c_binary() -> Path:
    """tests/servers/goh2c (golang.org/x/net/http2 via the Go module proxy), built once and
    cached by the hash of its sources."""
    h = hashlib.sha256()
    for name in ("main.go", "go.mod", "go.sum"):
        h.update((GOH2C / name).read_bytes())
    out = CACHE / f"tj-goh2c-{h.hexdigest()[:12]}"
    if not out.exists():
        if shutil.which("go") is None:
            pytest.skip("go is not installed (the h2c server and client are built from source)")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-o", str(out), "."], cwd=GOH2C, check=True)
    return out


def test_go_h2c_200_concurrent_streams_on_one_connection(h2agent: Agent) -> None:
    """Go's HPACK Huffman-codes the traceparent and the path and indexes every field. Every
    span has the trace id its request carried; streams not emitted are counted by reason."""
    binary = goh2c_binary()
    port = h2agent.take_port()
    lost_before = sum(kernel_counter(h2agent, n) for n in ("h2_unscanned", "h2_headers_cut"))
    srv = subprocess.Popen([str(binary), "server", str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and "ready" in srv.stdout.readline()
        out = subprocess.run(
            [str(binary), "client", str(port), "200"], capture_output=True, text=True, timeout=60
        ).stdout.split()
        sent = {int(tp.split("-")[1], 16): int(tp.split("-")[2], 16) for tp in out[::2]}
        assert len(sent) == 200 and set(out[1::2]) == {"200"}
        h2agent.wait_for(
            lambda sp: len([s for s in sp if s.attributes.get("server.port") == port]) >= 200, 10
        )
        spans = [
            s
            for s in h2agent.spans()
            if s.kind == KIND_SERVER and s.attributes.get("server.port") == port
        ]
    finally:
        srv.kill()
        srv.wait()
    assert spans
    for s in spans:
        assert s.trace_id in sent and s.parent_span_id == sent[s.trace_id]
        assert s.attributes["url.path"].startswith("/echo/")  # Huffman-decoded, query cut
    lost = sum(kernel_counter(h2agent, n) for n in ("h2_unscanned", "h2_headers_cut")) - lost_before
    print(f"h2c 200 streams: {len(spans)} spans, {lost} lost")
    assert len(spans) == 200 or lost > 0
    _no_secret_anywhere(spans)
