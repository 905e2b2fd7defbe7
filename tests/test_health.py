"""The /healthz /readyz /metrics server (tracejoin.commands.health) against hostile clients.

A slow-loris client (many connections, each sending a partial request a byte at a time and
reconnecting as soon as it is closed) must not starve a normal scrape, nor the reader that
drains the ring buffer. First against the server with a fake pipeline whose reader thread
consumes a queue, then as root against a real `tracejoin run` reading a real server's traffic.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from harness import free_ports, server
from hostile import agent_process, keepalive_load, parse_prometheus
from tracejoin.commands.health import DROPPED, HEAD_BYTES, HealthServer
from tracejoin.core.metrics import Metrics

# ---------------------------------------------------------------------------- helpers


class SlowLoris:
    """`n` connections to host:port that send the start of a request, then one byte per
    `interval_s` each, forever; a connection the server closes is opened again at once. From
    its own address (127.0.0.3), as an attacker is another host than the Prometheus that
    scrapes (the tests scrape from 127.0.0.1)."""

    SOURCE = "127.0.0.3"

    def __init__(self, host: str, port: int, n: int, interval_s: float = 0.05) -> None:
        self.addr = (host, port)
        self.n = n
        self.interval_s = interval_s
        self.connects = 0
        self.closed_by_server = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="slowloris")

    def _connect(self) -> socket.socket | None:
        try:
            s = socket.create_connection(self.addr, timeout=1.0, source_address=(self.SOURCE, 0))
        except OSError:
            return None
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        self.connects += 1
        return s

    def _run(self) -> None:
        socks: list[socket.socket | None] = [None] * self.n
        while not self._stop.is_set():
            for i, s in enumerate(socks):
                if s is None:
                    socks[i] = self._connect()
                    continue
                try:
                    if s.recv(1, socket.MSG_PEEK) == b"":  # the server closed it
                        raise ConnectionResetError
                except BlockingIOError:
                    pass  # nothing from the server: still stalled, as intended
                except OSError:
                    s.close()
                    self.closed_by_server += 1
                    socks[i] = self._connect()
                    continue
                with contextlib.suppress(OSError):
                    s.send(b"a")
            self._stop.wait(self.interval_s)
        for s in socks:
            if s is not None:
                s.close()

    def __enter__(self) -> SlowLoris:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


class FakePipeline:
    """What HealthServer reads from the agent (`alive()`, `refresh_metrics()`), with a reader
    thread that drains a queue as the real one drains the ring buffer."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.records: queue.Queue[int | None] = queue.Queue()
        self.consumed = 0
        self._reader = threading.Thread(target=self._read, daemon=True, name="reader")
        self._reader.start()

    def _read(self) -> None:
        while self.records.get() is not None:
            self.consumed += 1

    def alive(self) -> bool:
        return self._reader.is_alive()

    def refresh_metrics(self) -> None:
        # the way the real pipeline copies the kernel's counters in at each scrape
        self.metrics.set("kernel_records_submitted", self.consumed)
        return None

    def stop(self) -> None:
        self.records.put(None)
        self._reader.join(10)


def get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def raw(port: int, data: bytes, host: str = "127.0.0.1") -> bytes:
    """Send `data`, return everything the server sends until it closes."""
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@contextlib.contextmanager
def health_server(**kw: float) -> object:
    m = Metrics()
    h = HealthServer("127.0.0.1", 0, m, **kw)  # type: ignore[arg-type]
    h.loaded = True
    h.start()
    try:
        yield h
    finally:
        h.shutdown()


# ---------------------------------------------------------------------------- unit


def test_slow_loris_starves_neither_scrapes_nor_the_reader() -> None:
    before = set(threading.enumerate())  # not counted: whatever other tests left running
    metrics = Metrics()
    pipe = FakePipeline(metrics)
    health = HealthServer("127.0.0.1", 0, metrics, pipe, max_connections=32, timeout_s=1.0)
    health.loaded = True
    health.start()
    base = f"http://127.0.0.1:{health.port}"
    produced = 0
    stop_producing = threading.Event()

    def produce() -> None:  # the kernel's side: records keep coming
        nonlocal produced
        while not stop_producing.is_set():
            for _ in range(50):
                pipe.records.put(produced)
                produced += 1
            time.sleep(0.005)

    producer = threading.Thread(target=produce, daemon=True, name="producer")
    ours = {"reader", "producer", "slowloris"}
    try:
        producer.start()
        with SlowLoris("127.0.0.1", health.port, n=200) as loris:
            seen_consumed = []
            most_threads = 0
            for _ in range(15):
                code, text = get(base + "/metrics")
                assert code == 200, text
                fam = parse_prometheus(text)
                seen_consumed.append(fam[("kernel_records_submitted", frozenset())])
                assert get(base + "/healthz") == (200, "ok\n")
                serving = [
                    t.name for t in set(threading.enumerate()) - before if t.name not in ours
                ]
                most_threads = max(most_threads, len(serving))
                time.sleep(0.2)
            # the attack was real: stalled connections were closed and reopened
            assert loris.closed_by_server > 0 and loris.connects > 200
        stop_producing.set()
        producer.join()
        deadline = time.monotonic() + 30
        while pipe.consumed < produced and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pipe.consumed == produced  # the reader drained everything
        # ... and kept consuming all through the attack, scrape after scrape
        assert all(b > a for a, b in itertools.pairwise(seen_consumed)), seen_consumed
        # one thread serves every connection: 200 stalled ones add none
        assert most_threads == 1, serving
        final = parse_prometheus(get(base + "/metrics")[1])
        assert final[(DROPPED, frozenset({("reason", "over_limit")}))] > 0
    finally:
        stop_producing.set()
        health.shutdown()
        pipe.stop()


def test_trickling_connection_is_closed_at_the_deadline() -> None:
    """A per-read timeout alone never fires for a client sending a byte every 100 ms."""
    with health_server(timeout_s=0.5) as h:
        s = socket.create_connection(("127.0.0.1", h.port), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\nX: ")
        for _ in range(300):  # 30 s at most
            try:
                s.sendall(b"a")
            except OSError:
                break  # reset by the server
            s.settimeout(0.1)
            try:
                if s.recv(1) == b"":
                    break  # closed by the server
            except ConnectionResetError:
                break  # closed by the server with our last byte unread: a reset
            except TimeoutError:
                continue
        else:
            pytest.fail("the server kept a trickling connection open for 30 s")
        s.close()
        assert h.metrics.get(DROPPED, reason="timeout") == 1


def test_idle_connection_is_closed_and_counted() -> None:
    with health_server(timeout_s=0.3) as h:
        assert raw(h.port, b"") == b""  # nothing sent: closed without an answer
        assert h.metrics.get(DROPPED, reason="timeout") == 1


def test_over_the_limit_the_oldest_connection_goes() -> None:
    with health_server(max_connections=4, timeout_s=60) as h:
        stalled = [socket.create_connection(("127.0.0.1", h.port), timeout=10) for _ in range(4)]
        for s in stalled:
            s.sendall(b"GET /metrics HTTP/1.0\r\n")
        time.sleep(0.2)  # all four accepted and waiting for the rest of their request
        code, text = get(f"http://127.0.0.1:{h.port}/readyz")
        assert (code, text) == (200, "ready\n")
        assert stalled[0].recv(1) == b""  # the oldest was closed to make room
        assert h.metrics.get(DROPPED, reason="over_limit") == 1
        stalled[1].sendall(b"\r\n")  # the others are still served
        assert stalled[1].recv(100).startswith(b"HTTP/1.0 200 OK")
        for s in stalled:
            s.close()


def test_oversized_head_is_refused() -> None:
    with health_server() as h:
        answer = raw(
            h.port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (2 * HEAD_BYTES) + b"\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.0 431 "), answer[:100]
        many = b"".join(b"X-%d: y\r\n" % i for i in range(2000))
        answer = raw(h.port, b"GET /metrics HTTP/1.1\r\n" + many + b"\r\n")
        assert answer.startswith(b"HTTP/1.0 431 "), answer[:100]
        assert h.metrics.get(DROPPED, reason="head_too_large") == 2


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
        (b"GET /readyz?verbose HTTP/1.0\n\n", b"200"),  # bare LF, query ignored
        (b"GET /nope HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"400"),  # TLS
        (b"GET /metrics\r\n\r\n", b"400"),  # HTTP/0.9
    ],
)
def test_answers(request_bytes: bytes, status: bytes) -> None:
    with health_server() as h:
        answer = raw(h.port, request_bytes)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split()[1] == status, answer
        assert b"Connection: close" in head
        assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) == len(body)


def test_binds_each_address_given_and_refuses_a_taken_port() -> None:
    """As the DaemonSet binds it: the pod IP and the pod's loopback, one port (and IPv6)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    h = HealthServer("127.0.0.1, ::1", 0, Metrics())
    h.start()
    try:
        assert get(f"http://127.0.0.1:{h.port}/healthz") == (200, "ok\n")
        assert get(f"http://[::1]:{h.port}/healthz") == (200, "ok\n")
        with pytest.raises(ConnectionRefusedError):  # not on every address
            socket.create_connection(("127.0.0.2", h.port), timeout=5)
        with pytest.raises(OSError):
            HealthServer("::1", h.port, Metrics())
    finally:
        h.shutdown()
        h.shutdown()


# ---------------------------------------------------------------------------- real agent


@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_slow_loris_on_the_metrics_port_of_tracejoin_run(tmp_path: Path) -> None:
    """`tracejoin run` traces a real server while a slow-loris holds its metrics port: every
    scrape answers, and every request's record is read from the ring buffer (none lost)."""
    port, metrics_port = free_ports(2)
    spans_file = tmp_path / "spans.jsonl"
    n = 1200
    with server("go", port) as srv:
        # --cpu-budget 0: defending the port costs the agent CPU, and above its budget it would
        # rightly shed traces (counted, test_reliability.py); this test is about the reader
        # keeping up, so every request must come through
        args = ["--port", str(port), "--pid", str(srv.pid), "--no-gpu", "--cpu-budget", "0"]
        args += ["--spans-file", str(spans_file)]
        with agent_process(args, tmp_path, metrics_port) as agent:
            agent.wait_ready()
            before = agent.scrape()
            with SlowLoris("127.0.0.1", metrics_port, n=300) as loris:
                sent: list[object] = []
                load = threading.Thread(
                    target=lambda: sent.extend(keepalive_load(port, n, conns=4, rate=300))
                )
                load.start()
                scrapes = []
                while load.is_alive():
                    scrapes.append(agent.scrape())  # asserts 200, within 5 s
                    time.sleep(0.3)
                load.join()
                m = agent.wait_metric(
                    lambda s: s.total("records_received") - before.total("records_received") >= n,
                    timeout_s=30,
                    what=f"{n} records read",
                )
                assert loris.closed_by_server > 0
            assert len(sent) == n
            received = [s.total("records_received") for s in scrapes]
            assert received[-1] > received[0], received  # read all through the attack
            assert m.total("kernel_ringbuf_full") == before.total("kernel_ringbuf_full")
            assert m.total("records_received") - before.total("records_received") == n
            assert m.total(DROPPED, reason="over_limit") > 0
            trace_ids = set()
            deadline = time.monotonic() + 30
            while len(trace_ids) < n and time.monotonic() < deadline:
                time.sleep(0.2)
                if spans_file.exists():
                    for line in spans_file.read_text().splitlines():
                        for rs in json.loads(line)["resourceSpans"]:
                            for ss in rs["scopeSpans"]:
                                trace_ids.update(int(sp["traceId"], 16) for sp in ss["spans"])
            assert {s.trace_id for s in sent} <= trace_ids  # type: ignore[attr-defined]
            print(
                f"[health] slow-loris: {loris.connects} connections, "
                f"{loris.closed_by_server} closed by the agent; {len(scrapes)} scrapes answered; "
                f"{n} records read, ring buffer losses 0"
            )
