"""Requests no span is made of stay in the kernel (bpf/http_conn.h unspanned()): with
--unsampled follow a valid unsampled traceparent, with --no-parent skip a request without one, is
counted and aggregated per endpoint instead of crossing the ring buffer. Real BPF, the Go test
server, real clients; the kernel's validator is checked against traceparent.parse request by
request, and everything it is not sure of must still reach user space."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from harness import Agent, free_ports, server, wait_decided
from hostile import Conn
from tracejoin.core.model import KIND_SERVER
from tracejoin.enrich import traceparent
from tracejoin.kernel.probes import ProbeConfig

_rng = random.Random(1313)


@dataclass
class Agg:
    agent: Agent
    port: int
    pid: int

    def policy(self, *, unsampled: str = "follow", no_parent: str = "root") -> None:
        """The same policy on both sides, as build_agent sets it from the settings."""
        self.agent.source.set_policy(unsampled=unsampled, no_parent=no_parent)
        self.agent.pipeline.enricher.unsampled = unsampled
        self.agent.pipeline.enricher.no_parent = no_parent

    def kernel(self) -> dict[str, int]:
        return self.agent.pipeline.kernel_counters()

    def aggregate(self, why: str) -> tuple[int, int, list[int]]:
        got = self.agent.source.aggregates().get(why, {})
        return got.get((self.pid, self.port), (0, 0, [0] * 24))

    def send(self, path: str, *headers: bytes) -> None:
        """One request on its own connection; returns once the kernel has decided it (counters
        read at once would miss it, and count it for the next)."""
        before = self.kernel()
        conn = Conn(self.port)
        head = b"".join(h + b"\r\n" for h in headers)
        assert conn.request(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n" + head + b"\r\n")
        conn.close()
        wait_decided(self.kernel, before, 1, 2.0)


@pytest.fixture(scope="module")
def agg(privileged: None) -> Iterator[Agg]:
    """An agent of this module's own on one Go server, filtered by its port and pid: the
    counters are exact."""
    (port,) = free_ports(1)
    with server("go", port) as go:
        a = Agent([port], None, probe_config=ProbeConfig(ports=(port,), pids=(go.pid,)))
        a.start()
        try:
            yield Agg(a, port, go.pid)
        finally:
            a.shutdown()


def tp(sampled: bool = False) -> tuple[str, int]:
    trace_id = _rng.getrandbits(128) | 1
    return (
        f"00-{trace_id:032x}-{_rng.getrandbits(64) | 1:016x}-{'01' if sampled else '00'}",
        trace_id,
    )


def settle(agent: Agent, path: str, n: int, timeout_s: float = 10.0) -> list[int]:
    """Trace ids of the server spans for `path`, once n arrived (and a moment for more)."""

    def mine() -> list[int]:
        return [
            s.trace_id
            for s in agent.spans()
            if s.kind == KIND_SERVER and s.attributes.get("url.path") == path
        ]

    agent.wait_for(lambda _s: len(mine()) >= n, timeout_s)
    time.sleep(0.3)
    return mine()


def test_unsampled_follow_never_crosses_and_is_aggregated(agg):
    agg.policy(unsampled="follow")
    n = 40
    k0, recv0 = agg.kernel(), agg.agent.metrics.total("records_received")
    unsampled0 = agg.agent.metrics.get("requests_unsampled")
    a0 = agg.aggregate("unsampled")
    for _ in range(n):
        agg.send("/agg/unsampled", f"traceparent: {tp()[0]}".encode())
    k1 = agg.kernel()
    assert k1["unsampled_aggregated"] - k0["unsampled_aggregated"] == n
    assert k1["records_submitted"] == k0["records_submitted"], "none of them crossed"
    count, sum_ns, hist = agg.aggregate("unsampled")
    assert count - a0[0] == n and sum(hist) - sum(a0[2]) == n, "under the server's pid and port"
    assert sum_ns > a0[1]
    # a 50 ms request lands in a bucket whose range reaches 50 ms: i >= 15, [32.8, 65.5) ms
    agg.send("/sleep?ms=50", f"traceparent: {tp()[0]}".encode())
    _, _, after = agg.aggregate("unsampled")
    moved = [i for i, (a, b) in enumerate(zip(hist, after, strict=True)) if a != b]
    assert len(moved) == 1 and moved[0] >= 15 and after[moved[0]] - hist[moved[0]] == 1
    time.sleep(0.5)  # the reader consumes on a timer: anything sent would be in by now
    assert agg.agent.metrics.total("records_received") == recv0
    assert settle(agg.agent, "/agg/unsampled", 0) == []
    # exported per endpoint: count, seconds, and the cumulative latency buckets
    agg.agent.app.refresh_metrics()
    m, labels = agg.agent.metrics, {"port": str(agg.port), "why": "unsampled"}
    assert m.get("requests_aggregated", **labels) == count + 1
    assert m.get("requests_unsampled") == unsampled0 + n + 1, "still counted as unsampled"
    assert m.get("requests_aggregated_seconds", **labels) >= 0.05
    assert m.get("requests_aggregated_latency_bucket", le="0.032767", **labels) == sum(after[:15])
    assert m.get("requests_aggregated_latency_bucket", le="+Inf", **labels) == count + 1


def test_unsampled_record_makes_every_span(agg):
    agg.policy(unsampled="record")
    try:
        k0 = agg.kernel()
        ids = []
        for _ in range(10):
            value, trace_id = tp()
            ids.append(trace_id)
            agg.send("/agg/record", f"traceparent: {value}".encode())
        k1 = agg.kernel()
        assert k1["unsampled_aggregated"] == k0["unsampled_aggregated"]
        assert k1["records_submitted"] - k0["records_submitted"] == 10
        assert sorted(settle(agg.agent, "/agg/record", 10)) == sorted(ids)
    finally:
        agg.policy()


def _near_misses() -> list[tuple[str, list[bytes], str | None]]:
    """(name, header lines, the rejection reason user space counts; None: a sampled span)."""
    t = f"{_rng.getrandbits(128) | 1:032x}"
    p = f"{_rng.getrandbits(64) | 1:016x}"
    return [
        ("uppercase", [f"traceparent: 00-{t.upper()}-{p}-00".encode()], traceparent.UPPERCASE),
        ("zero trace", [f"traceparent: 00-{'0' * 32}-{p}-00".encode()], traceparent.ZERO_TRACE_ID),
        ("zero parent", [f"traceparent: 00-{t}-{'0' * 16}-00".encode()], "zero_parent_id"),
        ("56 chars", [f"traceparent: 00-{t}-{p}-00-".encode()], traceparent.TOO_LONG),
        ("ff version", [f"traceparent: ff-{t}-{p}-00".encode()], traceparent.BAD_VERSION),
        (
            "two headers",
            [f"traceparent: 00-{t}-{p}-00".encode(), f"traceparent: 00-{t}-{p}-00".encode()],
            traceparent.DUPLICATE,
        ),
        ("sampled 01", [f"traceparent: 00-{t}-{p}-01".encode()], None),
    ]


def test_hostile_near_misses_reach_user_space(agg):
    agg.policy(unsampled="follow")
    for name, headers, reason in _near_misses():
        path = "/agg/miss/" + name.replace(" ", "-")
        k0 = agg.kernel()
        rej0 = agg.agent.metrics.total("traceparent_rejected", reason=reason) if reason else 0
        agg.send(path, *headers)
        k1 = agg.kernel()
        assert k1["unsampled_aggregated"] == k0["unsampled_aggregated"], name
        assert k1["records_submitted"] - k0["records_submitted"] == 1, name
        spans = settle(agg.agent, path, 1)
        assert len(spans) == 1, name  # a new root (rejected) or the caller's trace (sampled)
        if reason is None:
            assert spans[0] == int(headers[0].split(b"-")[1], 16), name
        else:
            assert agg.agent.metrics.total("traceparent_rejected", reason=reason) == rej0 + 1


def test_no_parent_skip_keeps_only_requests_without_a_header(agg):
    agg.policy(no_parent="skip")
    try:
        k0, a0 = agg.kernel(), agg.aggregate("no_parent")[0]
        rej0 = agg.agent.metrics.total("traceparent_rejected", reason=traceparent.UPPERCASE)
        agg.send("/agg/none")
        agg.send(
            "/agg/none", b"trace-parent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        )
        k1 = agg.kernel()
        assert k1["no_parent_aggregated"] - k0["no_parent_aggregated"] == 2
        assert k1["records_submitted"] == k0["records_submitted"]
        assert agg.aggregate("no_parent")[0] - a0 == 2
        # an invalid value crosses, so its rejection is counted by reason (and no span is made)
        agg.send(
            "/agg/invalid", b"traceparent: 00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01"
        )
        k2 = agg.kernel()
        assert k2["no_parent_aggregated"] == k1["no_parent_aggregated"]
        assert k2["records_submitted"] - k1["records_submitted"] == 1
        agg.agent.wait_for(
            lambda _s: agg.agent.metrics.total("traceparent_rejected", reason="uppercase") > rej0,
            5,
        )
        assert agg.agent.metrics.total("traceparent_rejected", reason="uppercase") == rej0 + 1
        # a valid sampled one is still a span
        value, trace_id = tp(sampled=True)
        agg.send("/agg/sampled", f"traceparent: {value}".encode())
        assert settle(agg.agent, "/agg/sampled", 1) == [trace_id]
    finally:
        agg.policy()


T = "4bf92f3577b34da6a3ce929d0e0e4736"
P = "00f067aa0ba902b7"
# W3C trace-context test suite cases (test/test.py) and the rules of shared/TRACEPARENT.md, each
# unsampled unless the case is about the flags; run as one header value.
VECTORS = [
    f"00-{T}-{P}-00",
    f"00-{T}-{P}-01",
    f"00-{T}-{P}-02",
    f"00-{T}-{P}-09",
    f"00-{T}-{P}-0a",
    f"00-{T}-{P}-0b",
    f"00-{T}-{P}-fe",
    f"00-{T}-{P}-ff",
    f"00-{T}-{P}-0A",
    f"00-{T}-{P}-0g",
    f"00-{T}-{P}-.0",
    f"00-{T}-{P}-00-",
    f"00-{T}-{P}-00.",
    f"00-{T}-{P}-00-what-the-future-will-be-like",
    f"00-{T}-{P}-0",
    f"01-{T}-{P}-00",
    f"01-{T}-{P}-00-",
    f"01-{T}-{P}-00x",
    f"01-{T}-{P}-00-what-the-future-will-be-like",
    f"cc-{T}-{P}-00-what-the-future-will-be-like",
    f"ff-{T}-{P}-00",
    f"fe-{T}-{P}-00",
    f"0A-{T}-{P}-00",
    f"0x-{T}-{P}-00",
    f"00-{T.upper()}-{P}-00",
    f"00-{T}-{P.upper()}-00",
    f"00-{'0' * 32}-{P}-00",
    f"00-{T}-{'0' * 16}-00",
    f"00-{'0' * 31}1-{P}-00",
    f"00-{T}-{'0' * 15}1-00",
    f"00-{T[:-1]}g-{P}-00",
    f"00-{T[:-1]}`-{P}-00",
    f"00-{T[:-1]}:-{P}-00",
    f"00-{T[:-1]}/-{P}-00",
    f"00-{T}-{P[:-1]}G-00",
    f"00-{T}-{P[:-1]}\xe9-00",
    f"00_{T}-{P}-00",
    f"00-{T}_{P}-00",
    f"00-{T}-{P}_00",
    f"00-{T[:-1]}-{P}-00",
    f"00-{T}-{P[:-1]}-00",
    f"00-{T}0-{P}-00",
    f"  00-{T}-{P}-00",
    f"00-{T}-{P}-00\t ",
    f"00- {T}-{P}-00",
    "",
]


def test_the_kernel_validator_agrees_with_parse(agg):
    """Each vector through the kernel as a real request: aggregated exactly when user space
    would parse it valid and unsampled (traceparent.parse_header_values), sent otherwise."""
    agg.policy(unsampled="follow")
    disagree = []
    for i, value in enumerate(VECTORS):
        raw = value.encode("latin-1")
        got = traceparent.parse_header_values([raw])
        want = isinstance(got, traceparent.TraceParent) and not got.sampled
        k0 = agg.kernel()
        agg.send(f"/agg/vector/{i}", b"traceparent: " + raw)
        k1 = agg.kernel()
        kept = k1["unsampled_aggregated"] - k0["unsampled_aggregated"]
        sent = k1["records_submitted"] - k0["records_submitted"]
        if (kept, sent) != ((1, 0) if want else (0, 1)):
            disagree.append((value, got, kept, sent))
    assert not disagree
    # the vectors exercise both sides
    assert (
        5
        < sum(
            isinstance(
                g := traceparent.parse_header_values([v.encode("latin-1")]), traceparent.TraceParent
            )
            and not g.sampled
            for v in VECTORS
        )
        < len(VECTORS) - 5
    )
