"""Every rule of shared/TRACEPARENT.md that is about bytes on the wire, sent through the kernel.

Each case is one raw request to a real server; the span the agent builds must carry exactly the
sent ids, or be a new root with the rejection reason counted, never a span with the sent ids.
"""

from __future__ import annotations

import pytest
from harness import raw_request, server
from tracejoin.enrich import traceparent

pytestmark = pytest.mark.privileged

TID = "4bf92f3577b34da6a3ce929d0e0e4736"
PID = "00f067aa0ba902b7"
VALID = f"00-{TID}-{PID}-01"

# (header lines, expected): expected is "ok" or a rejection reason, or None (no traceparent).
CASES = [
    ([f"traceparent: {VALID}"], "ok"),
    ([f"Traceparent: {VALID}"], "ok"),
    ([f"TRACEPARENT: {VALID}"], "ok"),
    ([f"traceparent:{VALID}"], "ok"),
    ([f"traceparent: \t {VALID} \t "], "ok"),
    ([f"traceparent: 00-{TID}-{PID}-00"], "unsampled"),
    ([f"traceparent: 00-{TID}-{PID}-09"], "ok"),  # other flag bits do not invalidate
    ([f"trace-parent: {VALID}"], None),
    ([f"trace.parent: {VALID}"], None),
    ([f"traceparent: {VALID}", f"traceparent: {VALID}"], traceparent.DUPLICATE),
    ([f"traceparent: {VALID.upper()}"], traceparent.UPPERCASE),
    ([f"traceparent: 00-{TID.upper()}-{PID}-01"], traceparent.UPPERCASE),
    ([f"traceparent: 00-{'0' * 32}-{PID}-01"], traceparent.ZERO_TRACE_ID),
    ([f"traceparent: 00-{TID}-{'0' * 16}-01"], traceparent.ZERO_PARENT_ID),
    ([f"traceparent: ff-{TID}-{PID}-01"], traceparent.BAD_VERSION),
    ([f"traceparent: 00-{TID}-{PID}-01-"], traceparent.TOO_LONG),
    ([f"traceparent: 00-{TID}-{PID}-01."], traceparent.TOO_LONG),
    ([f"traceparent: 00-{TID}-{PID}-0"], traceparent.TRUNCATED),
    ([f"traceparent: 00-{TID[:-1]}-{PID}-01"], traceparent.TRUNCATED),
    ([f"traceparent: 00-{TID}x-{PID}-01"], traceparent.MALFORMED),
    ([f"traceparent: 00-{TID[:-1]}g-{PID}-01"], traceparent.MALFORMED),
    ([f"traceparent: 00_{TID}-{PID}-01"], traceparent.MALFORMED),
    ([f"traceparent: cc-{TID}-{PID}-01"], "ok"),  # a future version, exactly 55 chars
    ([f"traceparent: cc-{TID}-{PID}-01-what-the-future-holds"], "ok"),
    ([f"traceparent: cc-{TID}-{PID}-01.what"], traceparent.MALFORMED),
    (["x-filler: " + "a" * 5000, f"traceparent: {VALID}"], traceparent.BEYOND_SCAN_WINDOW),
]


@pytest.fixture(scope="module")
def port(agent):
    p = agent.take_port()
    with server("threaded", p):
        yield p


@pytest.mark.parametrize(
    ("headers", "expected"), CASES, ids=[f"{i}-{e}" for i, (_, e) in enumerate(CASES)]
)
def test_rule(agent, port, headers, expected):
    path = f"/rule/{CASES.index((headers, expected))}"
    head = "".join(h + "\r\n" for h in headers)
    rejected = expected not in (None, "ok", "unsampled")  # the others are reasons
    before = agent.metrics.get("traceparent_rejected", reason=expected) if rejected else 0
    unsampled_before = agent.metrics.get("requests_unsampled")
    raw_request(port, f"GET {path} HTTP/1.1\r\nHost: t\r\n{head}\r\n".encode())
    if expected == "unsampled":
        # kept in the kernel, or dropped in user space: counted either way (once the kernel's
        # counters are read, as /metrics and the capture do)
        agent.wait_for(
            lambda _: (
                agent.pipeline.kernel_counters() is not None
                and agent.metrics.get("requests_unsampled") > unsampled_before
            )
        )
        assert agent.metrics.get("requests_unsampled") == unsampled_before + 1
        assert [s for s in agent.port_spans(port, 0.5) if s.attributes["url.path"] == path] == []
        return
    spans = agent.wait_for(lambda sp: any(s.attributes.get("url.path") == path for s in sp))
    (span,) = [s for s in spans if s.attributes.get("url.path") == path]
    if expected == "ok":
        assert span.trace_id == int(TID, 16)
        assert span.parent_span_id == int(PID, 16)
        assert "tracejoin.traceparent.rejected" not in span.attributes
        return
    # invalid or absent: a new root trace, never the sent ids
    assert span.trace_id != int(TID, 16)
    assert span.parent_span_id == 0
    if expected is None:
        assert "tracejoin.traceparent.rejected" not in span.attributes
    else:
        assert span.attributes["tracejoin.traceparent.rejected"] == expected
        assert agent.metrics.get("traceparent_rejected", reason=expected) == before + 1


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_headers_split_across_reads(agent, chunk):
    """A server reading CHUNK bytes at a time splits the header name, the value and CRLFs
    across reads: the span carries the right id or none, never a garbled one."""
    p = agent.take_port()
    with server("rawchunks", p, env={"CHUNK": str(chunk)}):
        for i in range(5):
            tid = f"{i + 1:032x}"
            raw_request(
                p,
                f"GET /split/{chunk}/{i} HTTP/1.1\r\nHost: t\r\n"
                f"traceparent: 00-{tid}-{PID}-01\r\n\r\n".encode(),
            )
        spans = agent.wait_for(
            lambda sp: (
                sum(
                    1
                    for s in sp
                    if str(s.attributes.get("url.path", "")).startswith(f"/split/{chunk}/")
                )
                >= 5
            )
        )
    mine = [
        s for s in spans if str(s.attributes.get("url.path", "")).startswith(f"/split/{chunk}/")
    ]
    assert len(mine) == 5
    for s in mine:
        i = int(str(s.attributes["url.path"]).rsplit("/", 1)[1])
        if s.parent_span_id:
            assert s.trace_id == i + 1 and s.parent_span_id == int(PID, 16)
        else:
            assert s.trace_id != i + 1


def test_value_split_mid_value_is_exact(agent):
    """Headers arriving in two segments split inside the traceparent value still give the
    exact id: the kernel's value capture continues across reads."""
    import socket
    import time as _t

    p = agent.take_port()
    tid = "0123456789abcdef0123456789abcdef"
    req = f"GET /midsplit HTTP/1.1\r\nHost: t\r\ntraceparent: 00-{tid}-{PID}-01\r\n\r\n".encode()
    cut = req.index(b"0123456789abcdef0123") + 10
    with server("threaded", p), socket.create_connection(("127.0.0.1", p)) as s:
        s.sendall(req[:cut])
        _t.sleep(0.2)  # the server reads the first part alone
        s.sendall(req[cut:])
        s.recv(4096)
        spans = agent.wait_for(
            lambda sp: any(x.attributes.get("url.path") == "/midsplit" for x in sp)
        )
    (span,) = [x for x in spans if x.attributes.get("url.path") == "/midsplit"]
    assert span.trace_id == int(tid, 16)
    assert span.parent_span_id == int(PID, 16)
