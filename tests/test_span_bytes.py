"""The object-free span path (pipeline/span_bytes.py) against the reference (build_spans +
otlp_proto): for a varied set of records both are built with the same ids and must give the
same ExportTraceServiceRequest, byte for byte and as parsed messages, on each of its writers
(the compiled server_span, the Python encoder on the compiled join, all Python). And the
pipeline takes the object-free path only when every destination sends OTLP protobuf and
nothing observes."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import random
import struct
from collections.abc import Callable

import pytest
from opentelemetry.proto.trace.v1 import trace_pb2
from records import PID, TID, FakeGpu, record
from tracejoin.core import record as R
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import EncodedSpan, Resource, Span
from tracejoin.core.otlp_wire import INT64_MAX
from tracejoin.enrich import correlate
from tracejoin.enrich.correlate import Endpoints
from tracejoin.enrich.enricher import EnrichedRecord, Enricher
from tracejoin.enrich.resources import ServedProcess
from tracejoin.exporters.otlp_proto import encode_request, encode_request_bytes
from tracejoin.kernel.decode import (
    REC_HTTP_FIXED_SIZE,
    REQF_FIRST_ON_CONN,
    REQF_NO_RESPONSE,
    REQF_PATH_TRUNC,
    REQF_RESP_UNTERM,
    REQF_TLB_HW,
    REQF_TUPLE,
    HttpRecord,
    decode_http,
)
from tracejoin.pipeline import span_bytes
from tracejoin.pipeline.span_bytes import encode_spans
from tracejoin.pipeline.spans import SpanOptions, build_spans

TP = f"00-{TID:032x}-{PID:016x}-01"
SIGNAL_SETS = {
    "none": frozenset(),
    "basic": frozenset({"recvq", "tcp_stats", "sched", "page_faults"}),
    "workset": frozenset({"recvq", "tcp_stats", "sched", "page_faults", "workset"}),
    "cuda": frozenset({"recvq", "sched", "page_faults", "workset", "cuda", "cuda_launches"}),
}


def resource(pid: int) -> Resource:
    exe = {1: "server", 77: "engine"}.get(pid)
    attrs = (("service.name", "svc"), ("process.pid", pid))
    return Resource(attrs + ((("process.executable.name", exe),) if exe else ()))


def _workset(r: HttpRecord, shared: bool) -> None:
    r.ws_flags |= R.WSF_TRACKED
    r.ws_threads, r.ws_processes = 3, 2
    r.oncpu_ns, r.helper_oncpu_ns, r.unexplained_wait_ns = 3_000_000, 2_700_000, 20_000
    r.runq_ns, r.runq_max_ns, r.offcpu_ns, r.nr_switches = 50_000, 30_000, 900_000, 7
    r.minflt, r.majflt, r.tlb_a, r.tlb_b = 515, 1, 12, 3
    for i, (tid, pid, comm) in enumerate(((4242, 1, b"worker"), (99, 77, b"eng\xc3\xa9"))):
        m = r.members[i]
        m.tid, m.pid = tid, pid
        ctypes.memmove(ctypes.addressof(m) + R.WsMember.comm.offset, comm, len(comm))
        m.join_ns, m.leave_ns = r.read_ns + 1000, r.read_ns + 2_000_000
        m.oncpu_ns, m.minflt, m.runq_ns, m.tlb_a = 1_000_000, 40, 5, 2
        m.shared_oncpu_ns = 7 if shared else 0
    r.ws_nslots = 2
    if shared:
        r.ws_shared_with_max = 3
        r.shared[R.WSIG_ONCPU], r.shared[R.WSIG_MINFLT] = 123_456, 9
        r.shared_apportioned_ns = 41_000
    else:
        r.ws_flags |= R.WSF_CAP | R.WSF_NO_GAP
        r.ws_refused, r.ws_unslotted = 4, 1


def _cuda(r: HttpRecord, shared: bool) -> None:
    r.ws_flags |= R.WSF_CUDA
    r.cuda.own[R.CSIG_MEMCPY_H2D], r.cuda.own[R.CSIG_SYNC_NS] = 4096, 30_000_000
    r.cuda.own[R.CSIG_LAUNCHES] = 1 << 40
    if shared:
        r.cuda.shared[R.CSIG_SYNC_CALLS] = 2
    w = r.cuda.waits[0]
    w.start_ns, w.dur_ns, w.tid, w.api, w.shared = r.read_ns + 5, 2_000_000, 4242, 1, int(shared)


def records() -> list[tuple[str, HttpRecord]]:
    """Records that vary one or two things each around a plain GET."""
    out: list[tuple[str, HttpRecord]] = []
    for status in (0, 200, 302, 404, 499, 500, 503):
        out.append((f"status {status}", record(TP, status=status)))
    for name, flag in (
        ("path_trunc", REQF_PATH_TRUNC),
        ("no_response", REQF_NO_RESPONSE),
        ("unframed", REQF_RESP_UNTERM),
        ("tlb_hw", REQF_TLB_HW),
        ("all flags", REQF_PATH_TRUNC | REQF_NO_RESPONSE | REQF_RESP_UNTERM | REQF_TLB_HW),
    ):
        out.append((name, record(TP, flags=flag, status=500 if name == "all flags" else 200)))
    r = record(TP, flags=REQF_FIRST_ON_CONN)
    r.est_ns = 500_000
    out.append(("first on connection", r))
    out.append(("root (no traceparent)", record(None)))
    out.append(("rejected traceparent", record(TP.upper())))
    out.append(("unicode path", record(TP, path="/café/ü/123/%zz/\x01".encode())))
    out.append(("raw bytes path", record(TP, path=b"/\xff\xfe/a b")))
    out.append(("long path", record(TP, path=b"/" + b"a/" * 60)))
    r = record(TP)
    r.method, r.method_len = b"BREW", 4
    out.append(("unknown method", r))
    r = record(TP)
    r.conn_id, r.seq, r.retrans, r.srtt_us, r.unacked_max = (1 << 64) - 1, 1 << 63, 3, 250, 9000
    out.append(("big counters", r))
    r = record(TP)
    r.retrans, r.srtt_us, r.unacked_max = 2, 180, 64_000
    out.append(("tcp stats", r))
    r = record(TP, arrival=0)
    r.resp_start_ns = 0
    out.append(("no arrival, no response start", r))
    out.append(("long receive-queue wait (child)", record(TP, arrival=1, read=50_000_000)))
    r = record(TP)
    r.runq[0].start_ns, r.runq[0].dur_ns = 3_500_000, 5_000_000
    out.append(("long run-queue wait (child)", r))
    r = record(TP)
    r.ws_flags = 0
    out.append(("reader counters not taken", r))
    # HTTP/2 streams: gRPC status codes (a server error, a client's, OK), a REST path, each way a
    # stream ends early, an unresolved field
    for name, path, h2_flags, grpc_status, status in (
        ("grpc reset, UNAVAILABLE", b"/tj.Echo/Say", R.H2F_RST, 14, 200),
        ("grpc OK", b"/tj.Echo/Say", 0, 1, 200),
        ("grpc INTERNAL", b"/pkg.v1.Svc/Get", 0, 14, 200),
        ("grpc NOT_FOUND", b"/pkg.v1.Svc/Get", 0, 6, 200),
        ("grpc status, not a gRPC path", b"/a/b/c", 0, 1, 200),
        ("REST", b"/v1/items/42", 0, 0, 404),
        ("reset, no grpc-status", b"/tj.Echo/Say", R.H2F_RST, 0, 0),
        ("goaway", b"/v1/items", R.H2F_GOAWAY, 0, 0),
        ("framing lost, unresolved", b"/v1/items", R.H2F_LOST | R.H2F_UNRESOLVED, 0, 200),
        ("closed, 503", b"/v1/items", R.H2F_CLOSED, 0, 503),
    ):
        r = record(TP, path=path, status=status)
        r.h2_flags, r.grpc_status, r.seq = R.H2F_STREAM | h2_flags, grpc_status, 7
        out.append((f"http2 {name}", r))
    for code in (2, 4, 12, 14, 15, 16):  # each code a server reports as its own error, and one not
        r = record(TP, path=b"/tj.Echo/Say")
        r.h2_flags, r.grpc_status, r.seq = R.H2F_STREAM, code + 1, 9
        out.append((f"http2 grpc code {code}", r))
    r = record(TP, path=b"/tj.Echo/Say")
    r.grpc_status = 15  # never set for HTTP/1.x by the kernel: ignored there
    out.append(("http/1.x with a grpc_status", r))
    for shared in (False, True):
        r = record(TP)
        _workset(r, shared)
        out.append((f"work set shared={shared}", r))
        r = record(TP)
        _workset(r, shared)
        _cuda(r, shared)
        out.append((f"work set + CUDA shared={shared}", r))
    r = record(TP)
    _workset(r, False)
    r.ws_nslots = 1
    out.append(("work set, one helper", r))
    return out


# Enrichment variants: what the enricher adds beside the record.
VARIANTS: dict[str, Callable[[EnrichedRecord], None]] = {
    "plain": lambda e: None,
    "instrumented": lambda e: setattr(e, "instrumented", "otel-sdk"),
    "service source": lambda e: setattr(e, "service_name_source", "k8s"),
    "no endpoints": lambda e: setattr(e, "endpoints", None),
    "v6 endpoints": lambda e: setattr(e, "endpoints", Endpoints("::1", 443, "fe80::1", 65535)),
    "gpu": lambda e: setattr(
        e, "gpu", {"tracejoin.gpu.utilization_ratio": 0.25, "tracejoin.gpu.device": "GPU-0"}
    ),
    "unsampled flags": lambda e: setattr(e, "trace_flags", 0),
}


def _ids(seed: int) -> Callable[[int], int]:
    rng = random.Random(seed)
    return lambda bits: rng.getrandbits(bits) or 1


CASES = [
    pytest.param(rec, variant, signals, tlb, id=f"{name}|{variant}|{signals}|{tlb}")
    for (name, rec), variant, signals, tlb in itertools.product(
        records(), VARIANTS, SIGNAL_SETS, ("flush_fallback", "off")
    )
    # the other variants add nothing new off the basic signal set
    if variant == "plain" or signals == "basic"
]


JOINS = {"compiled": span_bytes._join_c, "python": span_bytes._join_py}
# encoder -> (server_span, join): the compiled server span (the Python encoder for what it leaves
# to it, on the compiled join), the Python encoder on the compiled join, and no compiler at all
ENCODERS = {
    "server_span": (span_bytes._server_span_c, span_bytes._join_c),
    "compiled join": (None, span_bytes._join_c),
    "python": (None, span_bytes._join_py),
}


@pytest.fixture(params=list(ENCODERS))
def encoder(request, monkeypatch):
    """Each case on each writer."""
    server_span, join = ENCODERS[request.param]
    assert span_bytes.COMPILED, "_span_bytes.c was not built (gcc, python3-dev: scripts/setup.sh)"
    monkeypatch.setattr(span_bytes, "_server_span", server_span)
    monkeypatch.setattr(span_bytes, "_join", join)
    return request.param


@pytest.mark.parametrize(("rec", "variant", "signals", "tlb"), CASES)
def test_encoded_spans_equal_the_object_path(rec, variant, signals, tlb, encoder):
    enricher = Enricher(Metrics(), resource)
    e = enricher.enrich(rec)
    assert e is not None
    VARIANTS[variant](e)
    opts = SpanOptions(SIGNAL_SETS[signals], tlb, recvq_child_threshold_ns=1_000_000)

    reference = build_spans(e, opts, _ids(13))
    fast = encode_spans(e, opts, _ids(13))

    # the server span as bytes (HTTP/2 streams too); children keep the object path
    assert isinstance(fast[0], EncodedSpan)
    assert all(isinstance(s, Span) for s in fast[1:])
    assert len(fast) == len(reference)
    assert encode_request_bytes(fast) == encode_request_bytes(reference)
    assert encode_request(fast) == encode_request(reference)


def test_the_variety_covers_children_and_every_attribute_family():
    """The cases above are only worth as much as what they reach: children of each kind and the
    attribute families the fast path writes with its own framing and with the shared encoder."""
    names: set[str] = set()
    keys: set[str] = set()
    for rec, variant, signals, tlb in (c.values for c in CASES):
        e = Enricher(Metrics(), resource).enrich(rec)
        assert e is not None
        VARIANTS[variant](e)
        spans = build_spans(
            e, SpanOptions(SIGNAL_SETS[signals], tlb, recvq_child_threshold_ns=1_000_000), _ids(1)
        )
        names.update(s.name for s in spans[1:])
        keys.update(spans[0].attributes)
    assert {"tcp.receive_queue_wait", "sched.runq_wait", "server/worker"} <= names
    assert any(n.startswith("engine/") for n in names)
    for key in (
        "http.request.method_original",
        "http.response.status_code",
        "tracejoin.tcp.handshake_to_first_read_ns",
        "tracejoin.tlb.dtlb_load_misses",
        "tracejoin.tlb.flushes",
        "tracejoin.work.threads_refused",
        "tracejoin.work.shared.on_cpu_ns",
        "tracejoin.cuda.launches",
        "tracejoin.work.shared.cuda.sync.count",
        "tracejoin.gpu.utilization_ratio",
        "tracejoin.traceparent.rejected",
        "tracejoin.instrumented.source",
        "tracejoin.http.response_unframed",
        "tracejoin.http.path_truncated",
        "rpc.service",
        "rpc.grpc.status_code",
        "tracejoin.http2.ended_by",
        "tracejoin.http2.field_unresolved",
    ):
        assert key in keys, key


def test_a_batch_mixing_encoded_and_object_spans_groups_by_resource():
    """The senders place encoded bodies under their resource beside encoded objects."""
    e = Enricher(Metrics(), resource).enrich(record(TP))
    assert e is not None
    other = Resource((("service.name", "other"),))
    opts = SpanOptions(SIGNAL_SETS["basic"], recvq_child_threshold_ns=10**12)  # no children
    mixed = [*encode_spans(e, opts, _ids(1)), *build_spans(e, opts, _ids(2))]
    mixed.append(Span(1, 2, 0, "x", 1, 0, 1, other))
    req = encode_request(mixed)
    assert [len(rs.scope_spans[0].spans) for rs in req.resource_spans] == [2, 1]
    first, second = req.resource_spans[0].scope_spans[0].spans
    assert first.trace_id == second.trace_id == TID.to_bytes(16, "big")
    assert first.parent_span_id == PID.to_bytes(8, "big")


class _Destination:
    """A destination as stages.Destination describes it, that keeps what it is given."""

    name = "test"

    def __init__(self, accepts_encoded: bool) -> None:
        self.accepts_encoded = accepts_encoded
        self.got: list[Span | EncodedSpan] = []

    def start(self) -> None:
        pass

    def submit(self, span: Span | EncodedSpan) -> bool:
        self.got.append(span)
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass


@pytest.mark.parametrize(
    ("accepts", "observed", "encoded"),
    [
        ((True,), False, True),  # tracejoin run with OTLP only
        ((True, True), False, True),
        ((True, False), False, False),  # OTLP and the spans file: one path for all
        ((False,), False, False),
        ((True,), True, False),  # an observer (the capture summary) needs the objects
    ],
)
def test_the_pipeline_takes_the_object_free_path_only_when_all_can_take_it(
    accepts, observed, encoded
):
    from tracejoin.pipeline.stages import Pipeline

    dests = [_Destination(a) for a in accepts]
    seen: list[list[Span]] = []
    p = Pipeline(
        source=None,  # type: ignore[arg-type]  # process() is driven directly
        enricher=Enricher(Metrics(), resource),
        span_options=SpanOptions(SIGNAL_SETS["basic"]),
        destinations=dests,  # type: ignore[arg-type]
        metrics=Metrics(),
        observers=[lambda spans, rec: seen.append(spans)] if observed else [],
    )
    assert p.encode is encoded
    p.process([bytes(record(TP))])
    for d in dests:
        assert len(d.got) == 2  # the server span and its receive-queue wait (threshold 0)
        assert isinstance(d.got[0], EncodedSpan if encoded else Span)
        assert isinstance(d.got[1], Span)
        (server,) = encode_request(d.got[:1]).resource_spans[0].scope_spans[0].spans
        assert server.trace_id == TID.to_bytes(16, "big")
        assert server.parent_span_id == PID.to_bytes(8, "big")
    assert len(seen) == (1 if observed else 0)


@pytest.mark.parametrize(
    "v", [0, 1, 0x7F, 0x80, 0x3FFF, 0x4000, 1 << 28, (1 << 35) + 5, (1 << 63) - 1]
)
def test_the_compiled_join_writes_what_the_python_one_does(v):
    """Every varint length, between verbatim parts (an empty one too); the bytes parse as an
    OTLP Span whose attribute holds the value."""
    parts = [b"\x2a\x01x", span_bytes._int_key("a.b"), v, b"", span_bytes._int_key("c"), 5]
    assert JOINS["compiled"] is not None
    out = JOINS["compiled"](parts)
    assert out == span_bytes._join_py(parts)
    span = trace_pb2.Span.FromString(out)
    assert span.name == "x"
    assert [(a.key, a.value.int_value) for a in span.attributes] == [("a.b", v), ("c", 5)]


def test_the_compiled_join_leaves_what_it_cannot_write_to_the_caller():
    """Values beyond int64 raise OverflowError (encode_spans then joins in Python: the
    'counters beyond int64' record above); malformed parts are a TypeError or ValueError."""
    c, key = JOINS["compiled"], span_bytes._int_key("a")
    assert c is not None
    for v in (-1, 1 << 63, (1 << 64) - 1, 1 << 70):
        with pytest.raises(OverflowError):
            c([b"x", key, v])
    with pytest.raises(TypeError):
        c([key, "1"])
    with pytest.raises(TypeError):
        c([b"x", 1])
    with pytest.raises(ValueError):
        c([b"x", key])
    with pytest.raises(TypeError):
        c((b"x",))


def _server_span_args(r: HttpRecord, opts: SpanOptions, **over) -> list:
    e = Enricher(Metrics(), resource).enrich(r)
    assert e is not None
    prefixes, make_prefix = span_bytes._PREFIXES[False]
    args = {
        "rec": r,
        "prefixes": prefixes,
        "make_prefix": make_prefix,
        "trace_id": e.trace_id,
        "span_id": 1,
        "parent_id": e.parent_id,
        "trace_flags": e.trace_flags,
        "offset": e.clock_offset_ns,
        "endpoints": e.endpoints,
        "server_addr": span_bytes._SERVER_ADDR,
        "client_addr": span_bytes._CLIENT_ADDR,
        "extra": b"",
        "gpu": b"",
        "plan": span_bytes._plan(opts),
    }
    args.update(over)
    return list(args.values())


@pytest.mark.parametrize("recvq_child_ns", [0, 10**12])  # with 10**12 the others decide
@pytest.mark.parametrize(("name", "rec"), records(), ids=[n for n, _ in records()])
def test_server_span_writes_every_record_but_those_it_leaves_to_python(name, rec, recvq_child_ns):
    """The comparison above passes whoever wrote the span: here, the compiled server span must
    write every record itself, HTTP/2 streams included, and leave exactly CUDA sums and values
    beyond int64 to _encode_py; and say whether child spans may follow as needs_children does."""
    assert span_bytes._server_span_c is not None
    opts = SpanOptions(
        SIGNAL_SETS["cuda"] | {"tcp_stats"},
        "flush_fallback",
        recvq_child_threshold_ns=recvq_child_ns,
    )
    got = span_bytes._server_span_c(*_server_span_args(rec, opts))
    left = "CUDA" in name or name == "big counters"
    assert (got is None) == left, got
    if got is not None:
        body, children = got
        assert trace_pb2.Span.FromString(body).span_id == (1).to_bytes(8, "big")
        assert children == span_bytes.needs_children(rec, opts)


def test_server_span_rejects_what_it_cannot_read_and_bounds_its_cache():
    c = span_bytes._server_span_c
    assert c is not None
    opts = SpanOptions(SIGNAL_SETS["basic"])
    rec = record(TP)
    with pytest.raises(TypeError):
        c(*_server_span_args(rec, opts)[:-1])
    with pytest.raises(ValueError):
        c(*_server_span_args(rec, opts, rec=bytes(rec)[:100]))
    with pytest.raises(TypeError):
        c(*_server_span_args(rec, opts, prefixes={}, make_prefix=lambda m, p, g: "not bytes"))
    with pytest.raises(TypeError):
        c(*_server_span_args(rec, opts, prefixes={}, make_prefix=lambda m, p, g: (b"", b"")))
    with pytest.raises(ZeroDivisionError):  # the maker's own error, as it is
        c(*_server_span_args(rec, opts, prefixes={}, make_prefix=lambda m, p, g: 1 / 0))
    with pytest.raises(TypeError):
        c(*_server_span_args(rec, opts, extra="text"))
    # a port beyond int64 (never from the kernel): left to Python, which writes it as it can
    far = Endpoints("10.0.0.1", 1 << 64, "10.0.0.2", 1)
    assert c(*_server_span_args(rec, opts, endpoints=far)) is None
    # a span larger than the writer's stack buffer (8 KiB) is written on the heap, whole
    big = span_bytes._SERVICE_SOURCE("x" * 20_000)
    body, _ = c(*_server_span_args(rec, opts, extra=big))
    attrs = {a.key: a.value.string_value for a in trace_pb2.Span.FromString(body).attributes}
    assert attrs["tracejoin.service_name.source"] == "x" * 20_000
    # one entry per request line, cleared when full: hostile paths cannot grow it
    prefixes: dict[bytes, tuple[bytes, bytes]] = {}
    for i in range(5000):
        c(*_server_span_args(record(TP, path=f"/p/{i}".encode()), opts, prefixes=prefixes))
    assert 0 < len(prefixes) <= 4096


# -- the batch writer: the common record from the ring's bytes, a batch in one C call ----------

SERVED = {
    "plain": ServedProcess(resource(1), ""),
    "instrumented": ServedProcess(resource(1), "k8s", "otel-sdk"),
    "service source": ServedProcess(resource(1), "k8s"),
}
SPAN_ID = 0x2A2A2A2A2A2A2A2A


def _batch_records() -> list[tuple[str, HttpRecord]]:
    """records() and the ways a record leaves the common case that those do not vary."""
    out = records()
    r = record(TP)
    r.family, r.laddr[:16], r.raddr[:16] = 10, [0] * 15 + [1], [0xFE, 0x80] + [0] * 13 + [7]
    out.append(("v6 tuple", r))
    r = record(TP)
    r.conn_id = 0  # the kernel could not number the connection: not kept
    out.append(("unnumbered connection", r))
    out.append(("unsampled traceparent", record(TP[:-2] + "00")))
    out.append(("other flags, sampled", record(TP[:-2] + "03")))
    r = record(TP)
    r.flags &= ~REQF_TUPLE
    out.append(("no tuple (resolved from /proc)", r))
    r = record(TP)
    r.tp_count = 2
    out.append(("two traceparents", r))
    r = record(TP, path=b"/tj.Echo/Say")
    r.h2_flags, r.seq = R.H2F_STREAM | R.H2F_PATH_HUFF, 3
    out.append(("http2 Huffman-coded path", r))
    return out


BATCH_CASES = [
    pytest.param(rec, served, signals, tlb, id=f"{name}|{served}|{signals}|{tlb}")
    for (name, rec), served, signals, tlb in itertools.product(
        _batch_records(), SERVED, SIGNAL_SETS, ("flush_fallback", "off")
    )
    if served == "plain" or signals == "basic"
]


def _common(rec: HttpRecord, opts: SpanOptions) -> bool:
    """What the batch writer must write itself (the rest is the stages'): child spans only of
    the work set's helpers."""
    others = dataclasses.replace(opts, signals=opts.signals - {"workset"})
    data = bytes(rec)
    plain = correlate._plain_traceparent(rec) if correlate._plain_traceparent else None
    return (
        plain is not None
        and bool(plain[2] & 1)
        and bool(rec.flags & REQF_TUPLE)
        and not rec.ws_flags & R.WSF_CUDA
        and not rec.h2_flags & (R.H2F_TP_HUFF | R.H2F_PATH_HUFF | R.H2F_METHOD_HUFF)
        and not span_bytes.needs_children(rec, others)
        and rec.conn_id <= INT64_MAX
        and rec.seq <= INT64_MAX
        and len(data) >= REC_HTTP_FIXED_SIZE
    )


def _sequential_ids(n: int) -> bytes:
    """os.urandom for the batch writer: SPAN_ID, SPAN_ID + 1, ... (native-endian u64s)."""
    return b"".join(struct.pack("=Q", SPAN_ID + k) for k in range(n // 8))


def _write_batch(writer: span_bytes.BatchWriter, data: list[bytes], monkeypatch) -> tuple:
    monkeypatch.setattr(span_bytes.os, "urandom", _sequential_ids)
    spans: list = []
    rest = writer.write(data, spans)
    return spans, rest


@pytest.mark.parametrize(("rec", "served", "signals", "tlb"), BATCH_CASES)
def test_the_batch_writer_writes_what_the_stages_write(rec, served, signals, tlb, monkeypatch):
    """Each record alone: the common ones are written in C with the bytes the stages write
    (decode, enrich, build_spans); every other one is left to the stages, untouched."""
    assert span_bytes._spans_batch_c is not None, "_span_bytes.c was not built"
    enricher = Enricher(Metrics(), lambda pid: SERVED[served])
    opts = SpanOptions(SIGNAL_SETS[signals], tlb, recvq_child_threshold_ns=10_000_000)
    data = bytes(rec)
    spans, rest = _write_batch(span_bytes.BatchWriter(enricher, opts), [data], monkeypatch)
    if not _common(rec, opts):
        assert (spans, rest) == ([], [data])
        return
    assert rest == []
    decoded = decode_http(data)
    assert decoded is not None
    e = enricher.enrich(decoded)
    assert e is not None
    ids = itertools.count(SPAN_ID)  # drawn in the same order: the server span, each helper
    reference = build_spans(e, opts, lambda bits: next(ids))
    assert len(spans) == len(reference)
    assert all(isinstance(s, EncodedSpan) for s in spans)
    assert all(s.resource is SERVED[served].resource for s in spans)
    assert encode_request_bytes(spans) == encode_request_bytes(reference)


def test_the_batch_writers_common_case_is_most_of_the_cases():
    """_common above must not be vacuous: plain records, HTTP/2 streams, work sets with their
    helpers and both tuples are written in C; roots, rejections, other children and CUDA sums
    are not."""
    opts = SpanOptions(SIGNAL_SETS["workset"], recvq_child_threshold_ns=10_000_000)
    common = {name for name, rec in _batch_records() if _common(rec, opts)}
    for name in ("status 200", "http2 grpc OK", "v6 tuple", "unnumbered connection"):
        assert name in common
    for name in ("work set shared=True", "work set shared=False", "work set, one helper"):
        assert name in common  # the helpers' spans are the writer's too
    for name in ("root (no traceparent)", "rejected traceparent", "unsampled traceparent"):
        assert name not in common
    assert "work set + CUDA shared=False" not in common
    assert "long receive-queue wait (child)" not in common


def test_a_batch_keeps_each_process_and_connection_apart(monkeypatch):
    """More processes in one batch than the writer remembers per batch, interleaved, and many
    connections: each span has its own process's resource and its own connection's tuple."""
    enricher = Enricher(Metrics(), lambda pid: ServedProcess(resource(pid), ""))
    opts = SpanOptions(SIGNAL_SETS["basic"], recvq_child_threshold_ns=10**12)
    writer = span_bytes.BatchWriter(enricher, opts)
    batch = []
    for i in range(40):
        r = record(TP)
        r.pid, r.conn_id, r.rport = 100 + i % 13, 1000 + i % 7, 40000 + i % 7
        batch.append(bytes(r))
    spans, rest = _write_batch(writer, batch, monkeypatch)
    assert rest == [] and len(spans) == 40
    for i, span in enumerate(spans):
        assert span.resource == resource(100 + i % 13)
        attrs = {a.key: a.value for a in trace_pb2.Span.FromString(span.body).attributes}
        assert attrs["client.port"].int_value == 40000 + i % 7
        assert attrs["tracejoin.connection.id"].int_value == 1000 + i % 7


def test_the_batch_writer_bounds_its_connection_cache(monkeypatch):
    writer = span_bytes.BatchWriter(Enricher(Metrics(), resource), SpanOptions(frozenset()))
    batch = []
    for i in range(70_000):
        r = record(TP)
        r.conn_id = i + 1
        batch.append(bytes(r))
    spans, rest = _write_batch(writer, batch, monkeypatch)
    assert len(spans) == 70_000 and rest == []
    assert 0 < len(writer._conns) <= 65536


def test_the_batch_writer_rejects_what_it_cannot_read():
    c = span_bytes._spans_batch_c
    assert c is not None
    per = span_bytes.IDS_PER_RECORD
    good = (
        [bytes(record(TP))],
        [],
        [],
        (span_bytes._PREFIXES[False][0], span_bytes._PREFIXES[True][0]),
        (span_bytes._PREFIXES[False][1], span_bytes._PREFIXES[True][1]),
        lambda pid: (resource(pid), b"", False),
        {},
        lambda family, laddr, raddr: (b"", b""),
        EncodedSpan,
        0,
        bytes(8 * per),
        span_bytes._plan(SpanOptions(frozenset())),
        lambda pid, comm: (b"", b""),
        None,
    )
    assert c(*good) == 0  # a zero span id: left to the stages
    bad = {
        0: ((bytes(record(TP)),), TypeError),
        3: (({}, {}, {}), TypeError),
        5: (lambda pid: "resource", TypeError),
        7: (lambda family, laddr, raddr: (b"", "text"), TypeError),
        8: (Span, TypeError),
        10: (b"", ValueError),
        11: ((0,), TypeError),
        13: ((), TypeError),
    }
    for at, (value, exc) in bad.items():
        args = list(good)
        args[at] = value
        args[10] = bytes([1]) * 8 * per if at != 10 else value
        with pytest.raises(exc):
            c(*args)
    args = list(good)
    args[5], args[10] = (lambda pid: 1 / 0), bytes([1]) * 8 * per
    with pytest.raises(ZeroDivisionError):  # the resolver's own error, as it is
        c(*args)
    helped = record(TP)
    _workset(helped, False)
    args = list(good)
    args[0], args[10] = [bytes(helped)], bytes([1]) * 8 * per
    args[11] = span_bytes._plan(
        SpanOptions(SIGNAL_SETS["workset"], recvq_child_threshold_ns=10**12)
    )
    for maker, exc in (
        (lambda pid, comm: (b"", "text"), TypeError),
        (lambda pid, comm: 1 / 0, ZeroDivisionError),
    ):
        args[12] = maker
        with pytest.raises(exc):
            c(*args)
    args[1], args[2], args[12] = [], [], lambda pid, comm: None
    assert c(*args) == 0 and args[2] == [bytes(helped)]  # a helper it cannot name: the stages'
    assert args[1] == []


def test_the_pipeline_writes_a_mixed_batch_whole_and_survives_a_failing_writer():
    """One batch of common and uncommon records: every span reaches the destination and the
    counters add up. A batch writer that raises costs nothing: the stages take the batch."""
    from tracejoin.pipeline.stages import Pipeline

    for broken in (False, True):
        dest = _Destination(True)
        metrics = Metrics()
        p = Pipeline(
            source=None,  # type: ignore[arg-type]  # process() is driven directly
            enricher=Enricher(metrics, resource),
            span_options=SpanOptions(SIGNAL_SETS["basic"], recvq_child_threshold_ns=10_000_000),
            destinations=[dest],  # type: ignore[arg-type]
            metrics=metrics,
        )
        assert p.batch_writer is not None
        if broken:
            p.batch_writer._resolve = lambda pid: 1 / 0  # type: ignore[method-assign]
        batch = [
            bytes(record(TP)),  # common
            bytes(record(None)),  # a root: the stages
            bytes(record(TP, arrival=1, read=50_000_000)),  # a child span: the stages
            bytes(record(TP, path=b"/y")),  # common
            b"\x01short",  # undecodable: counted by the stages
        ]
        p.process(batch)
        assert len(dest.got) == 5  # 2 common, the root, the queued one and its child
        assert metrics.total("spans_built") == 5
        assert metrics.total("records_received") == 5
        assert metrics.total("records_dropped_userspace") == 1
        assert metrics.total("reader_errors") == (1 if broken else 0)
        assert (p.batch_writer is None) == broken
        parsed = encode_request(dest.got).resource_spans[0].scope_spans[0].spans
        paths = sorted(
            a.value.string_value for s in parsed for a in s.attributes if a.key == "url.path"
        )
        assert paths == ["/x", "/x", "/x", "/y"]


def test_with_a_gpu_join_the_batch_writer_holds_its_spans_until_the_samples_cover_them(
    monkeypatch,
):
    """On a GPU node the common request is still the batch writer's: its spans wait in the GPU
    hold like the stages' records, and leave with the GPU window on the server span. They parse
    as the same Span messages build_spans makes (the GPU fields after the status: a parser reads
    the attributes in the same order), the helpers' spans untouched."""
    from tracejoin.pipeline.stages import GpuHold, Pipeline

    gpu, dest, metrics = FakeGpu(), _Destination(True), Metrics()
    enricher = Enricher(metrics, resource)
    opts = SpanOptions(SIGNAL_SETS["workset"], "flush_fallback", recvq_child_threshold_ns=10**12)
    p = Pipeline(
        source=None,  # type: ignore[arg-type]  # process() is driven directly
        enricher=enricher,
        span_options=opts,
        destinations=[dest],  # type: ignore[arg-type]
        metrics=metrics,
        gpu_hold=GpuHold(gpu, metrics, hold_s=60.0),
    )
    assert p.batch_writer is not None
    staged: list[object] = []
    enrich = enricher.enrich
    monkeypatch.setattr(enricher, "enrich", lambda rec: staged.append(rec) or enrich(rec))
    monkeypatch.setattr(span_bytes.os, "urandom", _sequential_ids)
    rec = record(TP)
    _workset(rec, False)  # a server span and two helpers' spans
    p.process([bytes(rec)])
    assert dest.got == [] and staged == []  # written, and held: the samples are behind
    e = enrich(decode_http(bytes(rec)))  # type: ignore[arg-type]
    assert e is not None
    gpu.covered = e.epoch_ns(e.end_mono_ns)
    p.process([])  # the next wake-up: the sampler has caught up
    assert gpu.joined == [(1, e.epoch_ns(e.start_mono_ns), e.epoch_ns(e.end_mono_ns))]
    e.gpu = gpu.join(1, 0, 0)
    ids = itertools.count(SPAN_ID)
    reference = build_spans(e, opts, lambda bits: next(ids))
    assert len(dest.got) == len(reference) == 3
    assert all(isinstance(s, EncodedSpan) for s in dest.got)
    assert encode_request(dest.got) == encode_request(reference)
    server = trace_pb2.Span.FromString(dest.got[0].body)
    assert server.attributes[-1].key == "tracejoin.gpu.kernel_active.ratio.avg"
    assert metrics.total("spans_built") == 3
