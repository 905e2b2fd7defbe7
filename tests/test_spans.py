"""Record -> enriched record -> spans, on synthetic records (no BPF): naming, parents, policies,
child spans, and attributes only for the signals that were on."""

from __future__ import annotations

import pytest
from records import PID, TID, record
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import KIND_INTERNAL, KIND_SERVER, STATUS_ERROR, Resource
from tracejoin.enrich.enricher import Enricher
from tracejoin.kernel.decode import REQF_NO_RESPONSE, HttpRecord
from tracejoin.pipeline.spans import SpanOptions, build_spans, route_of

ALL_SIGNALS = frozenset({"recvq", "tcp_stats", "sched", "page_faults", "tlb_flush"})
RESOURCE = Resource((("service.name", "svc"), ("process.pid", 1)))


def build(
    m: Metrics,
    rec: HttpRecord,
    *,
    no_parent: str = "root",
    unsampled: str = "follow",
    signals: frozenset[str] = ALL_SIGNALS,
    tlb_mode: str = "flush_fallback",
) -> list:
    enricher = Enricher(m, lambda _pid: RESOURCE, no_parent=no_parent, unsampled=unsampled)
    e = enricher.enrich(rec)
    if e is None:
        return []
    return build_spans(e, SpanOptions(signals, tlb_mode), enricher.new_id)


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
    spans = build(m, record(f"00-{TID:032x}-{PID:016x}-01"))
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


@pytest.mark.parametrize(("threshold_ns", "children"), [(0, 1), (2_000_000, 1), (2_000_001, 0)])
def test_receive_queue_child_only_from_the_threshold(threshold_ns, children):
    """The wait (2 ms here) is always an attribute; a child span only when it reaches the
    threshold (--recvq-threshold-ms)."""
    m = Metrics()
    enricher = Enricher(m, lambda _pid: RESOURCE)
    e = enricher.enrich(record(f"00-{TID:032x}-{PID:016x}-01"))
    assert e is not None
    opts = SpanOptions(ALL_SIGNALS, "flush_fallback", recvq_child_threshold_ns=threshold_ns)
    server, *rest = build_spans(e, opts, enricher.new_id)
    assert server.attributes["tracejoin.tcp.receive_queue_wait_ns"] == 2_000_000
    assert [s.name for s in rest] == ["tcp.receive_queue_wait"] * children


def test_no_parent_policy_root_or_skip():
    m = Metrics()
    root = build(m, record(None), no_parent="root")
    assert root[0].parent_span_id == 0 and root[0].trace_id != 0
    assert build(m, record(None), no_parent="skip") == []
    bad = build(m, record(f"00-{TID:032X}-{PID:016x}-01"), no_parent="skip")
    assert bad == []
    assert m.get("traceparent_rejected", reason="uppercase") == 1


def test_unsampled_follows_the_caller_unless_told_to_record():
    m = Metrics()
    tp = f"00-{TID:032x}-{PID:016x}-00"
    assert build(m, record(tp)) == []
    assert m.get("requests_unsampled") == 1
    (server, _) = build(m, record(tp), unsampled="record")
    assert server.trace_id == TID and server.trace_flags == 0


def test_error_status():
    m = Metrics()
    assert build(m, record(None, status=503))[0].status_code == STATUS_ERROR
    lost = build(m, record(None, status=0, flags=REQF_NO_RESPONSE))[0]
    assert lost.status_code == STATUS_ERROR and "http.response.status_code" not in lost.attributes


def test_service_name_override_and_resource():
    from tracejoin.enrich.resources import ResourceResolver

    m = Metrics()
    resources = ResourceResolver(
        m, service_name="checkout", static={}, kubelet=None, node_name=None
    )
    enricher = Enricher(m, resources.resource)
    e = enricher.enrich(record(None))
    assert e is not None
    span = build_spans(e, SpanOptions(ALL_SIGNALS), enricher.new_id)[0]
    assert span.resource.get("service.name") == "checkout"
    assert span.resource.get("process.pid") == 1


SIGNAL_ATTRIBUTES = {
    "recvq": ["tracejoin.tcp.receive_queue_wait_ns"],
    "tcp_stats": ["tracejoin.tcp.retransmits"],
    "sched": [
        "tracejoin.sched.runq_wait_ns",
        "tracejoin.sched.runq_wait_max_ns",
        "tracejoin.sched.offcpu_ns",
        "tracejoin.sched.context_switches",
    ],
    "page_faults": ["tracejoin.mm.minor_faults", "tracejoin.mm.major_faults"],
}


@pytest.mark.parametrize("off", sorted(SIGNAL_ATTRIBUTES))
def test_an_off_signal_is_omitted_not_reported_as_zero(off):
    """With a signal's probes not loaded, its attributes are absent (never a measured 0), and
    every other signal's attributes are still there."""
    m = Metrics()
    rec = record(f"00-{TID:032x}-{PID:016x}-01")
    on = build(m, rec)[0].attributes
    for names in SIGNAL_ATTRIBUTES.values():
        for name in names:
            assert name in on, name
    spans = build(m, rec, signals=ALL_SIGNALS - {off})
    attrs = spans[0].attributes
    for name in SIGNAL_ATTRIBUTES[off]:
        assert name not in attrs, name
    for sig, names in SIGNAL_ATTRIBUTES.items():
        if sig != off:
            assert all(n in attrs for n in names), sig
    if off == "recvq":  # and no child span claims a wait that was not measured
        assert [s.name for s in spans[1:]] == []


def test_tlb_mode_off_emits_no_tlb_attribute():
    m = Metrics()
    attrs = build(m, record(None), tlb_mode="off")[0].attributes
    assert not [k for k in attrs if k.startswith("tracejoin.tlb.")]
    flush = build(m, record(None), tlb_mode="flush_fallback")[0].attributes
    assert "tracejoin.tlb.flushes" in flush and "tracejoin.tlb.dtlb_load_misses" not in flush


def test_runq_children_need_the_sched_signal():
    m = Metrics()
    rec = record(None)
    rec.runq[0].start_ns, rec.runq[0].dur_ns = 4_000_000, 2_000_000
    names = [s.name for s in build(m, rec)]
    assert names.count("sched.runq_wait") == 1
    assert "sched.runq_wait" not in [s.name for s in build(m, rec, signals=ALL_SIGNALS - {"sched"})]
