"""Issue 4: what the kernel did to each request, against workloads the tests control."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from harness import new_traceparent, raw_request, server

pytestmark = pytest.mark.privileged


def _get(agent, port: int, path: str) -> dict:
    tp, trace_id, _ = new_traceparent()
    raw_request(
        port,
        f"GET {path} HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n"
        f"Connection: close\r\n\r\n".encode(),
    )
    (span,) = agent.server_spans(trace_id)
    return span.attributes


@pytest.mark.parametrize("sleep_ms", [50, 0])
def test_receive_queue_wait_matches_the_servers_delay(agent, sleep_ms):
    port = agent.take_port()
    with server("slowread", port, env={"SLEEP_MS": str(sleep_ms)}):
        waits = [
            _get(agent, port, f"/q{i}")["tracejoin.tcp.receive_queue_wait_ns"] for i in range(3)
        ]
    # the server reads after sleep_ms; on a loaded 2-core host its thread can wait for a CPU
    # some ms more (CI saw 22 ms once with no sleep), the same slack for every delay
    for w in waits:
        assert sleep_ms * 1e6 <= w < (sleep_ms + 25) * 1e6, waits


def test_receive_queue_wait_is_a_child_span(agent):
    port = agent.take_port()
    with server("slowread", port, env={"SLEEP_MS": "30"}):
        tp, trace_id, _ = new_traceparent()
        raw_request(port, f"GET /c HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n\r\n".encode())
        (parent,) = agent.server_spans(trace_id)
        spans = agent.wait_for(lambda sp: any(s.parent_span_id == parent.span_id for s in sp))
    (child,) = [
        s
        for s in spans
        if s.parent_span_id == parent.span_id and s.name == "tcp.receive_queue_wait"
    ]
    assert child.trace_id == trace_id
    assert child.duration_ns >= 30e6
    assert parent.start_ns <= child.start_ns and child.end_ns <= parent.end_ns


def test_minor_faults_follow_pages_touched(agent):
    port = agent.take_port()
    with server("threaded", port):
        _get(agent, port, "/pages?n=1")  # warm the handler's own code paths
        touched = _get(agent, port, "/pages?n=2048")["tracejoin.mm.minor_faults"]
        idle = _get(agent, port, "/pages?n=0")["tracejoin.mm.minor_faults"]
    assert touched >= 2048
    assert idle < 200


def test_run_queue_delay_rises_with_a_competitor_on_the_same_cpu(agent):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs to pin the server and its competitor apart from the agent")
    cpu = (os.cpu_count() or 2) - 1
    port = agent.take_port()
    with server("threaded", port, cpu=cpu):
        alone = [_get(agent, port, "/spin?ms=40")["tracejoin.sched.runq_wait_ns"] for _ in range(3)]
        hog = subprocess.Popen(["taskset", "-c", str(cpu), "python3", "-c", "while True: pass"])
        try:
            time.sleep(0.2)
            contended = [_get(agent, port, "/spin?ms=40") for _ in range(3)]
        finally:
            hog.kill()
            hog.wait()
    runq = [a["tracejoin.sched.runq_wait_ns"] for a in contended]
    assert max(runq) > 5e6, runq  # sharing one CPU with a spinner: milliseconds of waiting
    assert sorted(runq)[1] > sorted(alone)[1], (runq, alone)
    assert all(
        a["tracejoin.sched.runq_wait_max_ns"] <= a["tracejoin.sched.runq_wait_ns"]
        for a in contended
    )


def test_tlb_fallback_is_named_flushes_and_rises_with_shootdowns(agent):
    assert agent.pipeline.source.status.tlb_mode == "flush_fallback"  # no PMU in this VM
    port = agent.take_port()
    with server("threaded", port):
        _get(agent, port, "/tlb?n=1")
        busy = _get(agent, port, "/tlb?n=300")
        quiet = _get(agent, port, "/tlb?n=0")
    assert "tracejoin.tlb.dtlb_load_misses" not in busy  # never presented as misses
    assert busy["tracejoin.tlb.flushes"] > quiet["tracejoin.tlb.flushes"]
    assert busy["tracejoin.tlb.flushes"] >= 100


def test_resource_names_the_tlb_mode(agent):
    port = agent.take_port()
    with server("threaded", port):
        tp, trace_id, _ = new_traceparent()
        raw_request(port, f"GET / HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n\r\n".encode())
        (span,) = agent.server_spans(trace_id)
    assert span.resource.get("tracejoin.tlb.mode") == "flush_fallback"


def test_handshake_to_first_read_includes_the_accept_backlog(agent):
    port = agent.take_port()
    with server("slowaccept", port, env={"SLEEP_MS": "80"}):
        attrs = _get(agent, port, "/backlog")
    assert attrs["tracejoin.tcp.handshake_to_first_read_ns"] >= 80e6 * 0.9


@pytest.fixture
def lossy_link(request):
    """A veth pair into a network namespace; the client lives in the namespace."""
    ns, host_if, ns_if = "tjrx", "tjrx0", "tjrx1"

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", "10.199.0.1/24", "dev", host_if)
        # MSS-sized segments, not 64 KiB GSO ones: ~1,450 for the 2 MiB response instead of
        # ~32, so the dropper's 5 % always drops some (with ~32, one fetch in four lost none)
        sh("ethtool", "-K", host_if, "tso", "off", "gso", "off")
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", "10.199.0.2/24", "dev", ns_if)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot build a veth pair in a network namespace: {exc.stderr!r}")
    yield ns, ns_if
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _host_retrans_segs() -> int:
    """Tcp RetransSegs of the host's network namespace (the server's side of the veth)."""
    text = Path("/proc/net/snmp").read_text().splitlines()
    lines = [line.split() for line in text if line.startswith("Tcp:")]
    return int(lines[1][lines[0].index("RetransSegs")])


def _fetch_in_ns(ns: str, port: int, tp: str) -> None:
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns,
            "curl",
            "-sf",
            "-o",
            "/dev/null",
            "--max-time",
            "60",
            "-H",
            f"traceparent: {tp}",
            f"http://10.199.0.1:{port}/file?kb=2048",
        ],
        check=True,
        timeout=90,
    )


def test_retransmissions_appear_on_the_affected_span(agent, lossy_link):
    import sys

    from harness import HERE

    ns, ns_if = lossy_link
    port = agent.take_port()
    with server("threaded", port, env={"BIND": "10.199.0.1"}):
        tp, clean_id, _ = new_traceparent()
        before = _host_retrans_segs()
        _fetch_in_ns(ns, port, tp)
        (clean,) = agent.server_spans(clean_id)
        host_retrans_during_clean = _host_retrans_segs() - before
        dropper = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                str(HERE / "servers" / "xdp_drop.py"),
                ns_if,
                str(port),
                "5",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert dropper.stdout is not None and "ready" in dropper.stdout.readline()
            tp, lossy_id, _ = new_traceparent()
            _fetch_in_ns(ns, port, tp)
            (lossy,) = agent.server_spans(lossy_id, timeout_s=20)
        finally:
            dropper.terminate()
            dropper.wait(timeout=10)
    # A clean link can still retransmit: on a loaded 2-CPU runner a delayed ACK fires a tail
    # loss probe, a real retransmission (seen once in CI). The clean span may count no more than
    # the host's own counter saw while it ran, so 0 whenever the host sent none.
    assert clean.attributes["tracejoin.tcp.retransmits"] <= host_retrans_during_clean
    assert lossy.attributes["tracejoin.tcp.retransmits"] > 0
    assert lossy.attributes["http.response.size"] >= 2048 * 1024
    assert lossy.attributes.get("tracejoin.tcp.unacked_max_bytes", 0) > 0
