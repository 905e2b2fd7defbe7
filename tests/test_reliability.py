"""Issue 8, reliability: every loss counted exactly, bounded memory when the backend is down or
black-holed, nothing left in the kernel after SIGKILL, churn within the LRU bounds, hostile
traffic never crashes the agent or produces a wrong trace id. docs/reliability.md lists each
promise with the test here that holds it.

Each test runs a shortened form by default (CI); TRACEJOIN_FULL_RELIABILITY=1 runs the full
forms the issue asks for (a 2-minute Jaeger outage, 50+50 kill cycles, 100k connections, 60 s of
hostile traffic). Figures (CPU, RSS, timings) are printed: run with -s to see them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness import Agent, free_ports, server, wait_decided
from hostile import (
    OWN,
    POISON,
    VALID,
    AgentProcess,
    Blackhole,
    Conn,
    HostileMix,
    IdleConnections,
    Scrape,
    Sent,
    agent_process,
    bpf_object_ids,
    get_bytes,
    keepalive_load,
    loaded_bpf_ids,
    new_sent,
    parse_prometheus,
    short_connections,
    sigterm_bound_s,
    tracejoin_command,
    wait_bpf_released,
)
from jaeger import Jaeger, JaegerPorts, find_binary, missing_binary_message
from jaeger import trace_ids_equal as _same_trace
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased
from tracejoin.core.model import KIND_SERVER, Span
from tracejoin.core.record import (
    LRU_ENTRIES,
    REC_HTTP_FIXED_SIZE,
    RINGBUF_PAGES,
    WS_ENTRIES,
    WS_SLOTS,
    HttpRecord,
)
from tracejoin.exporters.queue import MAX_BATCH  # at most one batch in flight beside the queue
from tracejoin.kernel.probes import OPTIONAL_SIGNALS, ProbeConfig

pytestmark = pytest.mark.privileged

FULL = os.environ.get("TRACEJOIN_FULL_RELIABILITY") == "1"

RINGBUF_BYTES = RINGBUF_PAGES * 4096
RECORD_BYTES = ctypes.sizeof(HttpRecord)
# each record has an 8-byte header; a record ends after the work-set helpers it reports (none:
# REC_HTTP_FIXED_SIZE, four: RECORD_BYTES), so between these many fit
RINGBUF_RECORDS = RINGBUF_BYTES // (REC_HTTP_FIXED_SIZE + 8)
RINGBUF_RECORDS_MIN = RINGBUF_BYTES // (RECORD_BYTES + 8)
# spans of one request (server + receive-queue child + 4 run-queue children + 4 work-set
# helpers): spans_built counts a request's spans before they are submitted, so a scrape may see
# them built but not queued
SPANS_PER_REQUEST_MAX = 6 + WS_SLOTS


def scaled(default: float, full: float) -> float:
    return full if FULL else default


def report(text: str) -> None:
    print(f"[reliability] {text}", flush=True)


@dataclass
class RelAgent:
    agent: Agent
    go_port: int  # a Go net/http server, in the filter
    threaded_port: int  # a thread-per-connection Python server, in the filter
    outsider_port: int  # a Python server outside --port (its pid is in --pid)
    outsider: Conn  # a keep-alive connection to it, opened before the agent started
    go_pid: int = 0


@pytest.fixture(scope="module")
def rel(privileged: None) -> Iterator[RelAgent]:
    """An in-process pipeline (real BPF) of this module's own, memory destination only, on
    servers of its own, filtered by port and by their pids: traffic of other processes on this
    host (other tests, benchmarks) can never reach it, so counters can be compared exactly.

    The servers start first (the pid filter needs their pids). Before the agent starts, a
    keep-alive connection is opened to a server outside the port filter: see
    test_port_filter_covers_connections_from_before."""
    go_port, threaded_port, outsider_port = free_ports(3)
    with (
        server("go", go_port) as go,
        server("threaded", threaded_port) as threaded,
        server("threaded", outsider_port) as outsider_server,
    ):
        outsider = Conn(outsider_port)
        assert outsider.request(get_bytes(new_sent("/outsider/before"))) == 200
        cfg = ProbeConfig(
            ports=(go_port, threaded_port),
            pids=(go.pid, threaded.pid, outsider_server.pid),
        )
        a = Agent([go_port, threaded_port], None, probe_config=cfg)
        a.start()
        try:
            yield RelAgent(a, go_port, threaded_port, outsider_port, outsider, go.pid)
        finally:
            outsider.close()
            a.shutdown()


def _server_spans(agent: Agent, prefix: str) -> list[Span]:
    return [
        s
        for s in agent.spans()
        if s.kind == KIND_SERVER and str(s.attributes.get("url.path", "")).startswith(prefix)
    ]


def _assert_one_span_per_record(
    agent: Agent, dropped_user: float, received: float, sent: list[Sent], prefix: str
) -> None:
    """User side: each received record became one server span (with the ids it was sent
    with) or a counted drop, none duplicated."""
    agent.wait_for(lambda _s: len(_server_spans(agent, prefix)) >= received - dropped_user, 10)
    servers = _server_spans(agent, prefix)
    assert len(servers) + dropped_user == received
    seen, problems = _check_attribution(servers, sent)
    assert not problems, problems[:5]
    assert len(seen) == len(servers), "one span per request, none duplicated"


def _check_attribution(spans: list[Span], sent: list[Sent]) -> tuple[set[int], list[str]]:
    """(trace ids seen, problems): every span carrying a sent trace id must carry exactly that
    request's parent id and path, and never a POISON id."""
    by_trace = {s.trace_id: s for s in sent}
    seen: set[int] = set()
    problems: list[str] = []
    for sp in spans:
        s = by_trace.get(sp.trace_id)
        if s is None:
            continue
        seen.add(sp.trace_id)
        path = sp.attributes.get("url.path")
        if s.kind == POISON:
            problems.append(f"span {sp.name} {path} carries the id of {s.what or s.path} (poison)")
        elif sp.parent_span_id != s.parent_id:
            problems.append(f"{path}: parent {sp.parent_span_id:x}, sent {s.parent_id:x}")
        elif s.kind == VALID and path != s.path:
            problems.append(f"span path {path} carries the ids sent with {s.path}")
    return seen, problems


# ------------------------------------------------------------------------------ 1. losses


def _wait_stable(
    read: Callable[[], object], timeout_s: float = 15.0, quiet_s: float = 0.5
) -> float:
    """Poll until the value stops changing for quiet_s; return it."""
    deadline = time.monotonic() + timeout_s
    last = read()
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def test_ring_buffer_losses_add_up_exactly(rel):
    """Stall the reader so the ring buffer fills, then resume: every record the kernel
    submitted was either received or counted as ringbuf_full, exactly; every record received
    became a span or a counted user-side drop; every span was exported or counted as dropped."""
    agent, m = rel.agent, rel.agent.metrics
    pipe = agent.pipeline
    port = rel.go_port
    n = int(RINGBUF_RECORDS * 1.6)
    k0 = pipe.kernel_counters()
    recv0 = m.get("records_received")
    drop0 = m.total("records_dropped_userspace")
    pipe.pause_reading(True)  # returns once no poll is under way: none takes the traffic
    try:
        sent = keepalive_load(port, n, conns=4, prefix="/loss")
        k1 = pipe.kernel_counters()
    finally:
        pipe.pause_reading(False)
    submitted = k1["records_submitted"] - k0["records_submitted"]
    full = k1["ringbuf_full"] - k0["ringbuf_full"]
    received = _wait_stable(lambda: m.get("records_received")) - recv0
    k2 = pipe.kernel_counters()
    report(
        f"ring buffer: {n} requests, kernel submitted {submitted}, received {received:.0f}, "
        f"ringbuf_full {full} (capacity ~{RINGBUF_RECORDS} records)"
    )
    assert submitted == n, "one record per request, each counted as submitted"
    assert full > 0, "the stalled reader should have let the ring buffer fill"
    assert k2["ringbuf_full"] == k1["ringbuf_full"], "no loss after resuming"
    assert submitted == received + full, "submitted == received + ringbuf_full, exactly"
    # the reader was paused with the ring buffer empty: what fits in it survived (how many
    # depends on how many work-set helpers each record reports)
    assert RINGBUF_RECORDS_MIN <= received <= RINGBUF_RECORDS, (received, RINGBUF_RECORDS)
    # cumulatively too, over everything this agent has seen
    assert k2["records_submitted"] == m.get("records_received") + k2["ringbuf_full"]

    # user side: each received record became one server span or a counted drop
    _assert_one_span_per_record(
        agent, m.total("records_dropped_userspace") - drop0, received, sent, "/loss/"
    )
    # every span built was exported to the memory destination or counted as dropped
    built = _wait_stable(
        lambda: (
            m.get("spans_built"),
            m.get("spans_exported", exporter="memory"),
            m.total("spans_dropped"),
        )
    )
    assert built[0] == built[1] + built[2], built
    # and the self-metrics say so, under the documented names
    text = m.prometheus_text()
    served = parse_prometheus(text)
    assert served[("kernel_ringbuf_full", frozenset())] == k2["ringbuf_full"], text
    assert "tracejoin_kernel_ringbuf_full_total " in text


def test_batched_reading_keeps_the_loss_identity_exact(rel):
    """The reader takes the ring on a timer and the kernel wakes it only every WAKE_EVERY
    records per CPU: a burst of three rings' worth, read while it arrives, still adds up exactly
    (submitted == received + ringbuf_full), arrives in batches, and makes one span each."""
    assert rel.agent.source._ring is not None, "the compiled ring reader reads (setup.sh builds it)"
    _burst_adds_up(rel.agent, rel.go_port, "/batch")


def test_bccs_reader_keeps_the_loss_identity_exact(privileged):
    """The fallback reader (BCC's, one Python callback per record: an install without a C
    compiler) under the same burst: the same exact identity, one span per record."""
    (port,) = free_ports(1)
    with server("go", port) as go:
        cfg = ProbeConfig(ports=(port,), pids=(go.pid,), compiled_ring=False)
        a = Agent([port], None, probe_config=cfg)
        a.start()
        try:
            assert a.source._ring is None, "BCC's reader reads"
            _burst_adds_up(a, port, "/bcc")
        finally:
            a.shutdown()


def _burst_adds_up(agent: Agent, port: int, prefix: str) -> None:
    m, pipe = agent.metrics, agent.pipeline
    n = RINGBUF_RECORDS * 3
    k0 = pipe.kernel_counters()
    recv0, batches0 = m.get("records_received"), m.get("record_batches")
    drop0 = m.total("records_dropped_userspace")
    sent = keepalive_load(port, n, conns=8, prefix=prefix)
    k1 = pipe.kernel_counters()
    submitted = k1["records_submitted"] - k0["records_submitted"]
    full = k1["ringbuf_full"] - k0["ringbuf_full"]
    received = _wait_stable(lambda: m.get("records_received")) - recv0
    batches = m.get("record_batches") - batches0
    report(
        f"batched: {n} requests, submitted {submitted}, received {received:.0f} in "
        f"{batches:.0f} batches, ringbuf_full {full}"
    )
    assert submitted == n
    assert submitted == received + full, "submitted == received + ringbuf_full, exactly"
    assert k1["sampled_out_budget"] == k0["sampled_out_budget"], "nothing shed at ratio 1"
    assert 0 < batches < received / 4, "records arrive many per wake-up"
    _assert_one_span_per_record(
        agent, m.total("records_dropped_userspace") - drop0, received, sent, prefix + "/"
    )


def test_budget_sheds_the_same_trace_ids_as_the_otel_sampler(rel):
    """At a ratio below 1 the kernel keeps exactly the requests OpenTelemetry's
    TraceIdRatioBased sampler keeps (fixed trace ids), counts the rest as sampled out (never as
    lost) and aggregates their count and latency under their endpoint."""
    agent = rel.agent
    pipe, probes = agent.pipeline, agent.source
    ratio = 0.4
    rng = random.Random(1913)
    sent = [
        Sent(f"/shed/{i}", rng.getrandbits(128) | 1, rng.getrandbits(64) | 1) for i in range(300)
    ]
    sdk = TraceIdRatioBased(ratio)
    keep = {
        s.trace_id
        for s in sent
        if sdk.should_sample(None, s.trace_id, "x").decision == Decision.RECORD_AND_SAMPLE
    }
    assert 60 < len(keep) < 240  # the id set exercises both sides
    key = (rel.go_pid, rel.go_port)
    k0 = pipe.kernel_counters()
    shed0 = probes.shed().get(key, (0, 0, []))[0]
    probes.set_sampling(ratio)
    try:
        conn = Conn(rel.go_port)
        for s in sent:
            assert conn.request(get_bytes(s)) == 200
        conn.close()
    finally:
        probes.set_sampling(1.0)
    k1 = wait_decided(pipe.kernel_counters, k0, len(sent), 5.0)  # every one kept or shed
    shed_n = k1["sampled_out_budget"] - k0["sampled_out_budget"]
    report(f"budget at {ratio}: kept {len(keep)} of {len(sent)}, kernel shed {shed_n}")
    assert k1["records_submitted"] - k0["records_submitted"] == len(keep)
    assert shed_n == len(sent) - len(keep)
    assert k1["ringbuf_full"] == k0["ringbuf_full"], "shedding is not a loss"
    count, sum_ns, hist = probes.shed()[key]
    assert count - shed0 == shed_n, "aggregated under the server's pid and port"
    assert sum(hist) == count and sum_ns > 0
    spans = agent.wait_for(lambda _s: len(_server_spans(agent, "/shed/")) >= len(keep), 10)
    got = {sp.trace_id for sp in _server_spans(agent, "/shed/")}
    time.sleep(0.3)  # nothing else trickles in
    assert got == keep, (len(got), len(keep), len(spans))
    assert {sp.trace_id for sp in _server_spans(agent, "/shed/")} == keep


def _read_lines(proc: subprocess.Popen[str], out: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        out.put(line)


def _counter(counters: dict[str, float], name: str, **labels: str) -> float:
    """A series from counters.json: `name` (summed) or `name{k=v,...}` with these labels."""
    if not labels:
        return float(counters.get(name, 0))
    want = {f"{k}={v}" for k, v in labels.items()}
    total = 0.0
    for key, value in counters.items():
        if key.startswith(name + "{") and want <= set(key[len(name) + 1 : -1].split(",")):
            total += value
    return total


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of `pid` is in the stopped state (SIGSTOP is delivered per thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = set()
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                states.add((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states == {"T"}:
            return
        assert time.monotonic() < deadline, f"threads of {pid} not all stopped: {states}"
        time.sleep(0.01)


def test_capture_summary_reports_ring_buffer_losses(privileged, tmp_path):
    """The same through `tracejoin capture`, stalled with SIGSTOP: counters.json adds up exactly
    and the printed summary shows the kernel-side loss."""
    (port,) = free_ports(1)
    outdir = tmp_path / "capture"
    n = int(RINGBUF_RECORDS * 1.6)
    lines: queue.Queue[str] = queue.Queue()
    with server("go", port) as srv:
        proc = subprocess.Popen(
            [
                *tracejoin_command(),
                "capture",
                *("--port", str(port), "--pid", str(srv.pid)),
                *("--output-dir", str(outdir)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        )
        try:
            threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
            deadline = time.monotonic() + 60
            seen: list[str] = []
            while not any(line.startswith("capturing") for line in seen):
                assert time.monotonic() < deadline, "".join(seen)
                assert proc.poll() is None, "".join(seen)
                with contextlib.suppress(queue.Empty):
                    seen.append(lines.get(timeout=0.5))
            proc.send_signal(signal.SIGSTOP)
            _wait_stopped(proc.pid)
            try:
                keepalive_load(port, n, conns=4, prefix="/cap")
            finally:
                proc.send_signal(signal.SIGCONT)
            time.sleep(2.0)  # let the reader drain what the ring buffer kept
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = "".join(seen) + "".join(lines.queue)
    assert rc == 0, output
    assert "Traceback" not in output, output
    counters = json.loads((outdir / "counters.json").read_text())
    submitted = counters["kernel_records_submitted"]
    received = counters["records_received"]
    full = counters["kernel_ringbuf_full"]
    report(f"capture: submitted {submitted}, received {received}, ringbuf_full {full}")
    assert submitted == n
    assert full > 0
    assert submitted == received + full
    assert RINGBUF_RECORDS_MIN <= received <= RINGBUF_RECORDS, "stopped with it empty: what fits"
    # spans: every one built was written to the file or counted as dropped for it
    written = 0
    for line in (outdir / "spans.otlp.jsonl").read_text().splitlines():
        req = json.loads(line)
        written += sum(
            len(ss.get("spans", []))
            for rs in req.get("resourceSpans", [])
            for ss in rs.get("scopeSpans", [])
        )
    built = _counter(counters, "spans_built")
    file_dropped = _counter(counters, "spans_dropped", exporter="file")
    assert built == written + file_dropped, (built, written, file_dropped)
    # the summary, printed and saved, shows the kernel-side loss with its count
    summary = (outdir / "summary.txt").read_text()
    loss_lines = [ln for ln in summary.splitlines() if "ring buffer" in ln]
    assert loss_lines and re.search(rf"(?<![\d,.]){int(full)}(?![\d,.])", loss_lines[0]), summary
    assert loss_lines[0].strip() in output


# ------------------------------------------------------------------------------ 2. outage


class RestartableJaeger(Jaeger):
    """A Jaeger that comes back on the ports it had, as a restarted collector would."""

    def restart_same_ports(self, monkeypatch: pytest.MonkeyPatch) -> None:
        ports = self.ports
        assert ports is not None
        with monkeypatch.context() as mp:
            mp.setattr(JaegerPorts, "pick", classmethod(lambda cls: ports))
            self.start()


def _queued(m: Scrape) -> float:
    return (
        m.get("spans_built")
        - m.total("spans_exported", exporter="otlp")
        - m.total("spans_dropped", exporter="otlp")
    )


@pytest.mark.slow
@pytest.mark.timeout(600 if FULL else 240)
def test_jaeger_outage_bounded_memory_and_exact_drops(privileged, tmp_path, monkeypatch):
    """Jaeger down for 15 s (full: 2 min) under load: the agent stays up, its RSS stays under a
    bound derived from --queue-size, spans built == exported + dropped + queued at every
    scrape (queued never above the queue size plus one batch), and after Jaeger is back new
    spans arrive and the books balance exactly."""
    binary = find_binary()
    if binary is None:
        pytest.fail(missing_binary_message(), pytrace=False)
    outage_s = scaled(15, 120)
    rate = 1500  # requests/s during the outage, two spans each: far more than the queue holds
    queue_size = 1000
    per_span_bound = 4096  # bytes; measured ~1.2 KiB per queued span (RSS)
    slack = 24 << 20
    port, mport = free_ports(2)
    jaeger = RestartableJaeger(binary)
    jaeger.start()
    try:
        with (
            server("go", port) as srv,
            agent_process(
                [
                    *("--port", str(port), "--pid", str(srv.pid)),
                    "--otlp-endpoint",
                    f"http://{jaeger.otlp_grpc_endpoint}",
                    "--otlp-protocol",
                    "grpc",
                    "--queue-size",
                    str(queue_size),
                ],
                tmp_path,
                mport,
            ) as a,
        ):
            a.wait_ready()
            warm = keepalive_load(port, 300, conns=2, prefix="/warm")
            a.wait_metric(lambda m: m.get("spans_built") > 0 and _queued(m) == 0, 30, "warm")
            jaeger.get_trace(f"{warm[-1].trace_id:032x}", timeout_s=20)
            rss0 = a.rss_bytes()
            bound = rss0 + (queue_size + MAX_BATCH) * per_span_bound + slack

            jaeger.stop()
            t0 = time.monotonic()
            load = threading.Thread(
                target=keepalive_load,
                args=(port, int(rate * outage_s)),
                kwargs={"conns": 2, "rate": rate, "prefix": "/outage"},
            )
            load.start()
            rss_max, queued_max, samples = rss0, 0.0, 0
            while load.is_alive() or time.monotonic() - t0 < outage_s:
                assert a.alive(), a.log_tail()
                rss_max = max(rss_max, a.rss_bytes())
                m = a.scrape()
                q = _queued(m)
                queued_max = max(queued_max, q)
                samples += 1
                assert 0 <= q <= queue_size + MAX_BATCH + SPANS_PER_REQUEST_MAX, (q, m.series)
                assert rss_max <= bound, (rss_max, bound)
                time.sleep(1.0)
            load.join()
            during = a.scrape()
            dropped = during.by_label("spans_dropped", "reason")
            report(
                f"outage {outage_s:.0f}s: RSS {rss0 >> 20} MiB before, max {rss_max >> 20} MiB "
                f"(bound {bound >> 20} MiB); queued max {queued_max:.0f} "
                f"(queue {queue_size} + batch {MAX_BATCH}); built {during.get('spans_built'):.0f},"
                f" dropped {dropped}"
            )
            assert sum(dropped.values()) > 0, "the outage outlasted the queue: drops expected"

            jaeger.restart_same_ports(monkeypatch)
            t1 = time.monotonic()
            # the backlog goes first (a full queue drops the newest spans, counted): once it has
            # drained, new requests reach Jaeger
            a.wait_metric(lambda m: _queued(m) == 0, 120, "backlog drained")
            drained_s = time.monotonic() - t1
            after = keepalive_load(port, 20, prefix="/after")
            for s in after:
                trace = jaeger.get_trace(f"{s.trace_id:032x}", timeout_s=30)
                assert any(
                    _same_trace(sp["traceID"], f"{s.trace_id:032x}") for sp in trace["spans"]
                )
            report(
                f"after the restart: backlog drained in {drained_s:.1f}s, new spans in Jaeger "
                f"{time.monotonic() - t1:.1f}s after the restart"
            )
            final = a.wait_metric(lambda m: _queued(m) == 0, 60, "queue drained")
            built = final.get("spans_built")
            exported = final.total("spans_exported", exporter="otlp")
            lost = final.total("spans_dropped", exporter="otlp")
            report(f"books: built {built:.0f} == exported {exported:.0f} + dropped {lost:.0f}")
            assert built == exported + lost
            assert final.get("kernel_ringbuf_full") == 0
            assert final.get("records_received") == final.get("kernel_records_submitted")
            assert a.alive()
            a.signal(signal.SIGTERM)
            assert a.wait(15) == 0, a.log_tail()
    finally:
        jaeger.stop()


# ------------------------------------------------------------------------------ 3. black hole


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_blackholed_otlp_does_not_slow_reading_and_sigterm_ends_it(privileged, tmp_path, protocol):
    """The OTLP endpoint accepts and never answers: records are read from the kernel as fast as
    requests come (no ring buffer loss), and SIGTERM still ends `tracejoin run` within its
    documented bound (sigterm_bound_s: --shutdown-timeout + 1 s, plus slack for this host)."""
    shutdown_timeout = 3.0
    port, mport = free_ports(2)
    args = ["--port", str(port), "--otlp-protocol", protocol]
    with (
        Blackhole() as bh,
        server("go", port) as srv,
        agent_process(
            [
                *args,
                *("--pid", str(srv.pid), "--shutdown-timeout", str(shutdown_timeout)),
                *("--otlp-endpoint", f"http://127.0.0.1:{bh.port}"),
            ],
            tmp_path,
            mport,
        ) as a,
    ):
        a.wait_ready()
        total = 0
        lags = []
        for _ in range(int(scaled(4, 30))):
            keepalive_load(port, 200, conns=2, prefix="/bh")
            total += 200
            t0 = time.monotonic()
            a.wait_metric(lambda m, t=total: m.get("records_received") >= t, 5, f"{total}")
            lags.append(time.monotonic() - t0)
            time.sleep(0.5)
        m = a.scrape()
        report(
            f"black hole ({protocol}): {total} requests, received "
            f"{m.get('records_received'):.0f}, worst lag {max(lags) * 1000:.0f} ms, "
            f"exporter connections {len(bh.accepted)}"
        )
        assert m.get("records_received") == total
        assert m.get("kernel_records_submitted") == total
        assert m.get("kernel_ringbuf_full") == 0
        assert m.total("spans_exported", exporter="otlp") == 0
        assert bh.accepted, "the exporter never even connected"
        t0 = time.monotonic()
        a.signal(signal.SIGTERM)
        rc = a.wait(30)
        took = time.monotonic() - t0
    bound = sigterm_bound_s(shutdown_timeout)
    report(f"black hole ({protocol}): SIGTERM to exit {took:.2f}s (bound {bound:.1f}s)")
    assert rc == 0, a.log_tail()  # 3 would mean the watchdog had to end it
    assert took <= bound, (took, a.log_tail())


# ------------------------------------------------------------------------------ 4. kill loop


def _traffic(port: int, stop: threading.Event, errors: list[str]) -> None:
    while not stop.is_set():
        try:
            c = Conn(port)
            for _ in range(50):
                if stop.is_set():
                    break
                assert c.request(get_bytes(new_sent("/kl"))) == 200
                time.sleep(0.01)
            c.close()
        except (OSError, AssertionError) as e:
            errors.append(repr(e))
            time.sleep(0.1)


KILL_LOOP_SHUTDOWN_S = 3.0


@pytest.mark.slow
@pytest.mark.timeout(1800 if FULL else 240)
def test_kill_loop_leaves_nothing_loaded(privileged, tmp_path):
    """SIGKILL and SIGTERM `tracejoin run` under traffic, alternately (2+2; full: 50+50): each
    start gets ready and sees traffic; after each exit no BPF program or map it held is still
    loaded (BPF objects are reference-counted by fds: SIGKILL closes them all), but for the
    kernel's prog_array race, excused only by name and with no holder (wait_bpf_released)."""
    cycles = int(scaled(4, 100))
    port = free_ports(1)[0]
    before_progs, before_maps = loaded_bpf_ids()
    owned_progs: set[int] = set()
    owned_maps: set[int] = set()
    per_agent: set[tuple[int, int]] = set()
    ready_s: list[float] = []
    sigterm_s: list[float] = []
    gone_s: list[float] = []
    excused: set[int] = set()
    stop, errors = threading.Event(), []
    with server("go", port) as srv:
        traffic = threading.Thread(target=_traffic, args=(port, stop, errors), daemon=True)
        traffic.start()
        try:
            for i in range(cycles):
                sig = signal.SIGKILL if i % 2 == 0 else signal.SIGTERM
                mport = free_ports(1)[0]
                a = AgentProcess(
                    [
                        "--port",
                        str(port),
                        "--pid",
                        str(srv.pid),
                        "--spans-file",
                        str(tmp_path / "s"),
                        "--shutdown-timeout",
                        str(KILL_LOOP_SHUTDOWN_S),
                    ],
                    tmp_path,
                    mport,
                ).start()
                try:
                    ready_s.append(a.wait_ready())
                    a.wait_metric(lambda m: m.get("records_received") > 0, 10, "traffic seen")
                    progs, maps = bpf_object_ids(a.pid)
                    assert progs and maps, "the running agent holds its programs and maps"
                    owned_progs |= progs
                    owned_maps |= maps
                    per_agent.add((len(progs), len(maps)))
                    t0 = time.monotonic()
                    a.signal(sig)
                    rc = a.wait(30)
                    exit_s = time.monotonic() - t0
                finally:
                    a.kill()
                assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL), a.log_tail()
                if sig == signal.SIGTERM:
                    sigterm_s.append(exit_s)
                    assert exit_s <= sigterm_bound_s(KILL_LOOP_SHUTDOWN_S), (exit_s, a.log_tail())
                took, left = wait_bpf_released(progs, maps, f"cycle {i} ({sig.name})")
                gone_s.append(took)
                excused |= left
        finally:
            stop.set()
            traffic.join(timeout=5)
    # compared with the set before the loop: every id the agents held was new, and none of
    # them is loaded now
    assert not owned_progs & before_progs.keys() and not owned_maps & before_maps.keys()
    wait_bpf_released(owned_progs, owned_maps - excused, "after the loop", settle_s=0)
    assert not errors, errors[:3]
    report(
        f"kill loop: {cycles} cycles, ready in {min(ready_s):.1f}-{max(ready_s):.1f}s, "
        f"SIGTERM to exit {min(sigterm_s):.2f}-{max(sigterm_s):.2f}s, "
        f"(programs, maps) per agent {sorted(per_agent)}, {len(owned_progs)} programs and "
        f"{len(owned_maps)} maps loaded and released, each agent's gone "
        f"{min(gone_s):.1f}-{max(gone_s):.1f}s after its exit (first look at 1.0s); "
        f"{len(excused)} prog_array(s) excused"
    )


# ------------------------------------------------------------------------------ 5. churn


@pytest.mark.slow
@pytest.mark.timeout(1200 if FULL else 240)
def test_churn_stays_within_lru_bounds_and_never_misattributes(rel):
    """10k short connections with 300 keep-alive connections sitting idle (full: 100k, plus
    30k to a thread-per-connection server so that more than 16384 threads read requests, and
    9000 idle: with both ends of each on this host that is over 16384 connection entries, so
    the LRU evicts; see also test_returning_evicted_connections_do_not_stall_the_reader).
    The per-connection maps never exceed their LRU size; every span carries exactly the ids
    sent on its own request (the idle connections' next requests included, evicted or not);
    a request without a span is a counted loss."""
    import resource

    agent = rel.agent
    pipe = agent.pipeline
    port, threaded_port = rel.go_port, rel.threaded_port
    n = int(scaled(10_000, 100_000))
    n_threaded = int(scaled(0, 30_000))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    n_idle = max(0, min(int(scaled(300, 9_000)), soft - 1_000))
    sizes: dict[str, int] = {}
    stop = threading.Event()

    def sample() -> None:
        # reading 3 x 16k keys through BCC takes the GIL for a while: not too often, or the
        # in-process reader falls behind and the ring buffer overflows (counted, but a loss)
        while not stop.wait(2.0):
            for k, v in pipe.source.map_sizes().items():
                sizes[k] = max(sizes.get(k, 0), v)

    k0 = pipe.kernel_counters()
    churned: list[Sent] = []
    t0 = time.monotonic()
    idle = IdleConnections(port, n_idle, prefix="/idle")
    idle_s = time.monotonic() - t0
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        churned += short_connections(port, n, workers=2, prefix="/churn")
        if n_threaded:
            churned += short_connections(
                threaded_port, n_threaded, workers=2, prefix="/churn-threaded"
            )
        took = time.monotonic() - t0
        second = idle.another_round(1)
        # once more while the idle connections are still open (a churn faster than the
        # sampler's first 2 s wait was sampled only after they closed: `conns` read 0)
        for k, v in pipe.source.map_sizes().items():
            sizes[k] = max(sizes.get(k, 0), v)
    finally:
        stop.set()
        sampler.join()
        idle.close()
    sent = churned + idle.sent
    # the reader has drained the ring buffer: every record submitted was received or lost
    deadline = time.monotonic() + 180
    while True:
        k1 = pipe.kernel_counters()
        if k1["records_submitted"] == agent.metrics.get("records_received") + k1["ringbuf_full"]:
            break
        assert time.monotonic() < deadline, (k1, agent.metrics.get("records_received"))
        time.sleep(0.2)
    lost = k1["ringbuf_full"] - k0["ringbuf_full"]
    agent.wait_for(
        lambda _s: (
            len(_server_spans(agent, "/churn")) + len(_server_spans(agent, "/idle/"))
            >= len(sent) - lost
        ),
        30,
    )
    losses = {
        k: k1[k] - k0[k] for k in ("ringbuf_full", "request_state_lost", "pipeline_slots_full")
    }
    spans = _server_spans(agent, "/churn") + _server_spans(agent, "/idle/")
    seen, problems = _check_attribution(spans, sent)
    missing = [s for s in sent if s.trace_id not in seen]
    report(
        f"churn: {n + n_threaded} connections in {took:.1f}s "
        f"({(n + n_threaded) / took:.0f}/s), {n_idle} idle opened in {idle_s:.1f}s; max map "
        f"entries {sizes}; kernel losses {losses}; missing spans {len(missing)}; idle "
        f"connections' second requests with their span: "
        f"{sum(s.trace_id in seen for s in second)}/{len(second)}"
    )
    assert not problems, problems[:5]
    assert len(spans) == len(seen), "a request produced two spans"
    assert sizes.keys() == {"conns", "reqs", "threads", "worksets"}, sizes  # each map sampled
    for name in ("conns", "reqs", "threads"):
        assert sizes[name] <= LRU_ENTRIES, sizes
    assert sizes["worksets"] <= WS_ENTRIES, sizes
    assert sizes["conns"] >= n_idle, "the idle connections are in `conns`"
    if n_idle >= 8_500 and FULL:
        # (an LRU hash map evicts a little before it is completely full)
        assert sizes["conns"] > LRU_ENTRIES * 0.98, "the idle connections should fill `conns`"
    # a request without a span must be a counted loss
    assert len(missing) <= sum(losses.values()), [s.path for s in missing[:5]]


@dataclass
class Eviction:
    n: int
    before: Scrape
    after: Scrape
    round_s: float

    def delta(self, name: str) -> float:
        return self.after.get(name) - self.before.get(name)


def _drained(m: Scrape) -> bool:
    return m.get("records_received") + m.get("kernel_ringbuf_full") == m.get(
        "kernel_records_submitted"
    )


def _accounted(m: Scrape) -> float:
    return m.get("kernel_records_submitted") + m.get("kernel_sampled_out_budget")


@pytest.fixture(scope="module")
def eviction(privileged: None, tmp_path_factory: pytest.TempPathFactory) -> Eviction:
    """`tracejoin run` while 9000 keep-alive connections (18000 sockets on this host, both ends)
    overflow the 16384-entry `conns` LRU; then every one of them sends one more request, on a
    connection whose kernel state was evicted. Measured once, asserted by the tests below."""
    import resource

    n = 9_000
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < n + 1_000:
        pytest.skip(f"needs RLIMIT_NOFILE >= {n + 1_000} for {n} idle connections")
    port, mport = free_ports(2)
    tmp = tmp_path_factory.mktemp("eviction")
    # --port only, as a DaemonSet is configured (with --pid the clients' sockets would never be
    # looked at, and neither would other processes' connections)
    with (
        server("go", port),
        agent_process(["--port", str(port), "--spans-file", str(tmp / "s.jsonl")], tmp, mport) as a,
    ):
        a.wait_ready()
        idle = IdleConnections(port, n, prefix="/evict")
        try:
            before = a.wait_metric(_drained, 60, "drained before the second round")
            t0 = time.monotonic()
            idle.another_round(1)
            round_s = time.monotonic() - t0
            # every request is a record read, or shed by the CPU budget (counted apart)
            want = _accounted(before) + n
            try:
                after = a.wait_metric(
                    lambda m: _drained(m) and _accounted(m) >= want,
                    8,
                    "the reader caught up",
                )
            except AssertionError:
                after = a.scrape()
        finally:
            idle.close()
    ev = Eviction(n, before, after, round_s)
    report(
        f"eviction: {n} idle connections sent again in {round_s:.1f}s: kernel submitted "
        f"+{ev.delta('kernel_records_submitted'):.0f}, received "
        f"+{ev.delta('records_received'):.0f}, ringbuf_full +{ev.delta('kernel_ringbuf_full'):.0f},"
        f" non_http_connections +{ev.delta('kernel_non_http_connections'):.0f},"
        f" shed by the CPU budget +{ev.delta('kernel_sampled_out_budget'):.0f}"
    )
    return ev


def test_returning_evicted_connections_do_not_stall_the_reader(eviction):
    """9000 requests in a couple of seconds, on connections the LRU evicted: the reader keeps
    up (no ring buffer loss) and has read every record within 8 s; a request the CPU budget
    shed in the kernel is counted as such, never lost."""
    assert eviction.delta("kernel_ringbuf_full") == 0
    assert _drained(eviction.after)
    received = eviction.delta("records_received")
    assert received + eviction.delta("kernel_sampled_out_budget") >= eviction.n
    assert received > 0


def test_evicted_client_sockets_are_not_counted_as_non_http(eviction):
    """The clients' own sockets read HTTP responses: that is not a non-HTTP connection served
    here, and nothing in this traffic is non-HTTP."""
    assert eviction.delta("kernel_non_http_connections") == 0


# ------------------------------------------------------------------------------ 6. hostile


@pytest.mark.slow
@pytest.mark.timeout(600 if FULL else 180)
def test_hostile_traffic(privileged, tmp_path):
    """Random bytes, truncated requests, 1 MiB header lines, NUL bytes, slowloris, the HTTP/2
    preface, TLS ClientHellos, fake requests in bodies, invalid traceparents and pipelined
    floods, interleaved with valid requests, for 10 s (full: 60 s): the agent survives with
    bounded CPU, valid requests' spans carry exactly their ids, no span ever carries an id
    from garbage, and the loss/rejection counters rise."""
    duration = scaled(10, 60)
    port, mport = free_ports(2)
    spans_file = tmp_path / "spans.jsonl"
    with (
        server("go", port) as srv,
        agent_process(
            ["--port", str(port), "--pid", str(srv.pid), "--spans-file", str(spans_file)],
            tmp_path,
            mport,
        ) as a,
    ):
        a.wait_ready()
        # ready comes before HTTP/2's programs are verified; they come on by themselves, and
        # the HTTP/2 preface in the mix is then scanned, not ignored
        a.wait_metric(lambda s: s.get("probe_mode", signal="http2") == 1, 120, "http2 on")
        assert "http2 on: its programs verified in" in a.log_tail(200)
        m0 = a.scrape()
        cpu0, t0 = a.cpu_seconds(), time.monotonic()
        result = HostileMix(port, duration).run()
        wall = time.monotonic() - t0
        cpu = a.cpu_seconds() - cpu0
        assert a.alive(), a.log_tail()
        m = a.wait_metric(
            lambda s: s.get("records_received") == s.get("kernel_records_submitted"), 15, "drain"
        )
        a.signal(signal.SIGTERM)
        rc = a.wait(15)
    assert rc == 0, a.log_tail()
    assert "Traceback" not in a.log_tail(200), a.log_tail(200)

    spans = _spans_from_file(spans_file)
    servers = [s for s in spans if s["kind"] == KIND_SERVER]
    sent = result.sent
    by_trace = {s.trace_id: s for s in sent}
    seen: dict[int, int] = {}
    problems = []
    for sp in servers:
        s = by_trace.get(sp["trace_id"])
        if s is None:
            continue
        seen[s.trace_id] = seen.get(s.trace_id, 0) + 1
        if s.kind == POISON:
            problems.append(f"{sp['path']!r} carries a poison id ({s.what or s.path})")
        elif sp["parent"] != s.parent_id:
            problems.append(f"{sp['path']!r}: parent {sp['parent']:x}, sent {s.parent_id:x}")
        elif s.kind == VALID and sp["path"] != s.path:
            problems.append(f"span {sp['path']!r} carries the ids sent with {s.path}")
    valid = [s for s in sent if s.kind == VALID]
    missing = [s.path for s in valid if s.trace_id not in seen]
    doubled = [t for t, k in seen.items() if k > 1]
    own = [s for s in sent if s.kind == OWN]
    rejected = {
        r: v - m0.get("traceparent_rejected", reason=r)
        for r, v in m.by_label("traceparent_rejected", "reason").items()
    }
    report(
        f"hostile {duration:.0f}s: {sum(result.counts.values())} connections/requests "
        f"{dict(sorted(result.counts.items()))}; agent CPU {cpu:.2f}s over {wall:.1f}s "
        f"({100 * cpu / wall:.0f}% of a core); {len(servers)} server spans; own-id spans "
        f"{sum(1 for s in own if s.trace_id in seen)}/{len(own)}; "
        f"non_http_connections {m.get('kernel_non_http_connections'):.0f}; rejected {rejected}; "
        f"pipeline_slots_full {m.get('kernel_pipeline_slots_full'):.0f}"
    )
    assert not [e for e in result.errors if "valid" in e], result.errors[:5]
    assert not problems, problems[:10]
    assert not missing, f"{len(missing)} valid requests without a span: {missing[:5]}"
    assert not doubled
    assert m.get("kernel_non_http_connections") > 0
    assert rejected.get("beyond_scan_window", 0) > 0
    assert sum(v for r, v in rejected.items() if r != "beyond_scan_window") > 0
    assert m.get("kernel_ringbuf_full") == 0
    assert m.total("decode_errors") == 0
    assert m.get("reader_errors") == 0
    assert m.total("records_dropped_userspace") == 0
    # generous: the agent's whole process (reader, span building, file export) under attack
    assert cpu < 0.5 * wall, f"agent used {cpu:.2f}s of CPU in {wall:.1f}s"


def _spans_from_file(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        req = json.loads(line)
        for rs in req.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    attrs = {a["key"]: a.get("value", {}) for a in sp.get("attributes", [])}
                    path = attrs.get("url.path", {}).get("stringValue", "")
                    out.append(
                        {
                            "trace_id": int(sp["traceId"], 16),
                            "parent": int(sp.get("parentSpanId") or "0", 16),
                            "kind": sp.get("kind"),
                            "path": path,
                            "attributes": attrs,
                        }
                    )
    return out


# ------------------------------------------------------------------------------ 8. no PMU


def test_no_pmu_flush_fallback_and_the_rest_works(rel):
    """Without a hardware PMU (this VM) the TLB signal falls back to tlb:tlb_flush counts,
    named as flushes, and says so (probe_mode, the resource's tracejoin.tlb.mode); every other
    signal and the spans themselves are unaffected."""
    from tracejoin.kernel.probes import HTTP2_SIGNAL, pmu_tlb_available

    agent = rel.agent
    status = agent.pipeline.source.status
    if pmu_tlb_available():
        assert status.tlb_mode == "hardware"
        pytest.skip("this host has a PMU: hardware TLB counters are in use, not the fallback")
    assert status.tlb_mode == "flush_fallback"
    every = {sig.name for sig in OPTIONAL_SIGNALS} | {"page_faults", HTTP2_SIGNAL}
    assert status.signals == dict.fromkeys(every, "on"), status.signals
    sent = keepalive_load(rel.go_port, 5, prefix="/nopmu")
    agent.wait_for(lambda _s: len(_server_spans(agent, "/nopmu/")) >= 5, 10)
    spans = _server_spans(agent, "/nopmu/")
    seen, problems = _check_attribution(spans, sent)
    assert not problems and len(seen) == 5, problems
    for sp in spans:
        assert "tracejoin.tlb.flushes" in sp.attributes
        assert "tracejoin.tlb.dtlb_load_misses" not in sp.attributes
        assert dict(sp.resource.attributes)["tracejoin.tlb.mode"] == "flush_fallback"
        assert "tracejoin.sched.runq_wait_ns" in sp.attributes
    served = parse_prometheus(agent.metrics.prometheus_text())
    assert served[("probe_mode", frozenset({("signal", "tlb_flush_fallback")}))] == 1


# ------------------------------------------------------------------------------ bugs found here


def test_port_filter_covers_connections_from_before(rel):
    """A keep-alive connection opened before the agent started, to a port outside --port: its
    later requests must not become records or spans."""
    agent = rel.agent
    s = new_sent("/outsider/after")
    submitted0 = agent.pipeline.kernel_counters()["records_submitted"]
    assert rel.outsider.request(get_bytes(s)) == 200
    time.sleep(1.0)
    leaked = [sp for sp in agent.spans() if sp.trace_id == s.trace_id]
    submitted = agent.pipeline.kernel_counters()["records_submitted"] - submitted0
    assert not leaked, (
        f"a request on port {rel.outsider_port} (not in the filter "
        f"{agent.pipeline.source.config.ports}) became a span"
    )
    assert submitted == 0


def test_pipelined_requests_beyond_the_limit_are_each_counted(rel):
    """20 pipelined requests in one write: every one becomes a span or is counted in
    pipeline_slots_full."""
    agent = rel.agent
    reqs = [new_sent(f"/pipe/{i}") for i in range(20)]
    k0 = agent.pipeline.kernel_counters()["pipeline_slots_full"]
    c = Conn(rel.go_port)
    c.sock.sendall(b"".join(get_bytes(s) for s in reqs))
    statuses = [c.response() for _ in reqs]
    c.close()
    assert statuses == [200] * 20
    time.sleep(1.0)
    counted = agent.pipeline.kernel_counters()["pipeline_slots_full"] - k0
    spans = _server_spans(agent, "/pipe/")
    seen, problems = _check_attribution(spans, reqs)
    assert not problems, problems
    report(f"pipelined 20: {len(seen)} spans, pipeline_slots_full +{counted}")
    assert len(seen) + counted == 20


def test_a_reader_falling_behind_sheds_by_trace_id_before_the_ring_overflows(privileged):
    """The overload budget's fill rule on the real ring: a starved reader (each batch slowed to
    at most ~2.5k records/s) under 8k req/s open loop (tj-loadgen, trace ids spread like an
    SDK's). With the rule off the ring overflows and nothing is shed; with it on, the kernel
    sheds by trace id within a fraction of a second (no once-a-second reading runs in this
    in-process agent) and the ring loses at most a third of that. Every request is accounted
    for: submitted + shed == sent."""
    from bench.measure import rate

    (port,) = free_ports(1)
    with server("go", port) as go:
        cfg = ProbeConfig(ports=(port,), pids=(go.pid,))
        a = Agent([port], None, probe_config=cfg)
        a.start()
        try:
            pipe, probes = a.pipeline, a.source
            plain, on_fill = pipe.process, pipe.on_fill  # the budget starts at ratio 1
            assert on_fill is not None and a.app.budget.budget > 0

            def starved(batch: list[bytes]) -> None:
                time.sleep(len(batch) * 400e-6)
                plain(batch)

            pipe.process = starved  # type: ignore[method-assign]
            phases: dict[str, dict[str, int]] = {}
            for name, fill in (("rule off", None), ("rule on", on_fill)):
                pipe.on_fill = fill
                k0 = pipe.kernel_counters()
                load = rate(port, "/", 8000, 1.5, 8, None, warmup_s=0)
                k1 = wait_decided(pipe.kernel_counters, k0, load["requests_total"], 10.0)
                phases[name] = {
                    "sent": load["requests_total"],
                    "records_submitted": k1["records_submitted"] - k0["records_submitted"],
                    "ringbuf_full": k1["ringbuf_full"] - k0["ringbuf_full"],
                    "shed": k1["sampled_out_budget"] - k0["sampled_out_budget"],
                }
                _wait_stable(probes.backlog, quiet_s=0.5)  # the ring drained before the next
        finally:
            a.shutdown()
    report(f"a starved reader at 8k req/s: {phases}")
    off, on = phases["rule off"], phases["rule on"]
    for p in (off, on):
        assert p["records_submitted"] + p["shed"] == p["sent"], p
    assert off["shed"] == 0 and off["ringbuf_full"] > 1000, "the reader must fall behind"
    assert on["shed"] > 0, "the fill rule lowers the kernel's ratio"
    # the rule's reaction time moves with the machine's load: with it on the ring lost 0-196
    # here and 612 in one CI run, against 5.2-5.4k with it off (2026-12-03); since the agent's
    # threads ask for a longer CPU slice (--cpu-slice-ms), a reader that wakes behind a running
    # workload thread waits for it: 0-576 here and 1,036 in one CI run (2026-12-05)
    assert on["ringbuf_full"] <= off["ringbuf_full"] / 3, phases
