"""The agent and the servers, as the privileged tests drive them.

`Agent` runs the real pipeline in-process (real BPF, real ring buffer, real span builder) with
two destinations: an InMemoryExporter the tests query directly, and OTLP gRPC to the session's
real Jaeger. Servers run as separate processes on ports from the agent's port filter.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from tracejoin.app import build_agent
from tracejoin.app import probe_config as settings_probe_config
from tracejoin.config import Settings
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import KIND_SERVER, Span
from tracejoin.exporters.base import InMemoryExporter
from tracejoin.exporters.grpc_sender import OtlpGrpcExporter
from tracejoin.exporters.queue import BatchExportQueue
from tracejoin.kernel.probes import HttpProbes, ProbeConfig
from tracejoin.pipeline.stages import Pipeline

HERE = Path(__file__).parent
PYSERVER = HERE / "servers" / "pyserver.py"
NODESERVER = HERE / "servers" / "nodeserver.js"
GOSERVER_SRC = HERE / "servers" / "goserver"
CACHE = Path(os.environ.get("TRACEJOIN_CACHE", "/var/cache/tracejoin"))


def _listen_port_range() -> range:
    """Ports outside the kernel's ephemeral range (net.ipv4.ip_local_port_range): a port handed
    out here is bound by a test server later, sometimes minutes later, and a client connection
    made in the meantime must not have taken it as its local port (EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999
    return range(10000, lo) if lo > 12000 else range(hi + 1, 65536)


_handed_out: set[int] = set()  # never the same port twice in one test session


def free_ports(n: int) -> list[int]:
    """n ports nothing listens on now, outside the ephemeral range and not handed out before."""
    ports: list[int] = []
    candidates = [p for p in _listen_port_range() if p not in _handed_out]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        _handed_out.add(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports outside the ephemeral range")


def new_traceparent(sampled: bool = True) -> tuple[str, int, int]:
    trace_id = random.getrandbits(128) | 1
    parent = random.getrandbits(64) | 1
    return f"00-{trace_id:032x}-{parent:016x}-{'01' if sampled else '00'}", trace_id, parent


class Agent:
    def __init__(
        self,
        ports: list[int],
        otlp_endpoint: str | None,
        probe_config: ProbeConfig | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.metrics = Metrics()
        self.ports = list(ports)
        self._free = list(ports)
        self.memory = InMemoryExporter()
        dests = [
            BatchExportQueue(
                self.memory,
                self.metrics,
                flush_interval_s=0.05,
                name="memory",
                max_queue_spans=200_000,
            )
        ]
        if otlp_endpoint:
            dests.append(
                BatchExportQueue(
                    OtlpGrpcExporter(otlp_endpoint),
                    self.metrics,
                    flush_interval_s=0.1,
                    name="otlp",
                    max_queue_spans=200_000,
                )
            )
        settings = settings or Settings(gpu=False)
        # as tracejoin run configures its probes, on these ports
        cfg = probe_config or settings_probe_config(replace(settings, port=tuple(ports)))
        self.source = HttpProbes(cfg, self.metrics)
        self.app = build_agent(settings, self.metrics, dests, source=self.source)

    @property
    def pipeline(self) -> Pipeline:
        assert self.app.pipeline is not None, "the agent has not started"
        return self.app.pipeline

    def start(self) -> None:
        self.app.start()

    def shutdown(self) -> None:
        self.app.shutdown(5.0)

    def take_port(self) -> int:
        return self._free.pop()

    def spans(self) -> list[Span]:
        return self.memory.spans

    def wait_for(self, pred: Callable[[list[Span]], bool], timeout_s: float = 10.0) -> list[Span]:
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.memory.spans
            if pred(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def server_spans(self, trace_id: int, n: int = 1, timeout_s: float = 10.0) -> list[Span]:
        def mine(spans: list[Span]) -> list[Span]:
            return [s for s in spans if s.trace_id == trace_id and s.kind == KIND_SERVER]

        return mine(self.wait_for(lambda sp: len(mine(sp)) >= n, timeout_s))

    def port_spans(self, port: int, settle_s: float = 1.0) -> list[Span]:
        """Server spans seen on `port`, after giving the pipeline `settle_s` to deliver."""
        time.sleep(settle_s)
        return [
            s
            for s in self.memory.spans
            if s.kind == KIND_SERVER and s.attributes.get("server.port") == port
        ]


@contextmanager
def server(
    mode: str,
    port: int,
    env: dict[str, str] | None = None,
    cpu: int | None = None,
    comm: str | None = None,
) -> Iterator[subprocess.Popen[str]]:
    """Start a test server and wait for its "ready" line and its port to accept. `mode` is a
    tests/servers/pyserver.py mode, "go" (tests/servers/goserver) or "node"
    (tests/servers/nodeserver.js). `comm` runs the Go server under that process name (through a
    symlink of that name)."""
    if mode == "node":
        cmd = ["node", str(NODESERVER), str(port)]
    elif mode == "go":
        binary = go_server_binary()
        if comm:
            link = CACHE / comm
            link.unlink(missing_ok=True)
            link.symlink_to(binary)
            binary = link
        cmd = [str(binary), str(port)]
    else:
        cmd = [sys.executable, str(PYSERVER), mode, str(port)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "ready" in line, f"server {mode} did not start: {line!r}"
        if mode == "aiohttp":
            # aiohttp prints before it listens; the others print after listen(). A probe
            # connection would also be a request-less connection the serial raw servers
            # must wait out, skewing what the tests measure.
            _wait_port(port)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _wait_port(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"port {port} never accepted")


_go_lock = threading.Lock()


def go_server_binary() -> Path:
    """The Go net/http test server, built once and cached (stdlib only: no downloads)."""
    src = GOSERVER_SRC / "main.go"
    # named by its source: worktrees that share the cache must not run each other's server
    out = CACHE / f"tj-goserver-{hashlib.sha256(src.read_bytes()).hexdigest()[:12]}"
    with _go_lock:
        if not out.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            subprocess.run(["go", "build", "-o", str(out), "."], cwd=GOSERVER_SRC, check=True)
    return out


# Each request the kernel ends is counted in exactly one of these: a record, an aggregate, or
# shed by the overload budget.
DECIDED = (
    "records_submitted",
    "unsampled_aggregated",
    "no_parent_aggregated",
    "sampled_out_budget",
)


def wait_decided(
    counters: Callable[[], dict[str, int]], since: dict[str, int], n: int, timeout_s: float
) -> dict[str, int]:
    """The kernel counters once `n` requests since `since` have been decided (or `timeout_s`
    passed). The client can read a response before the server's syscall exit, where the kernel
    ends that request, has run: counters read at once can miss the last one."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters()
        if sum(now[c] - since[c] for c in DECIDED) >= n or time.monotonic() > deadline:
            return now
        time.sleep(0.01)


def raw_request(port: int, payload: bytes, read: bool = True, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection; return what came back until close or timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(payload)
        if not read:
            return b""
        chunks = []
        try:
            while True:
                part = s.recv(65536)
                if not part:
                    break
                chunks.append(part)
                if b"\r\n\r\n" in b"".join(chunks) and _complete(b"".join(chunks)):
                    break
        except TimeoutError:
            pass
        return b"".join(chunks)


def _complete(resp: bytes) -> bool:
    head, _, body = resp.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False
