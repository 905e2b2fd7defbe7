"""A real Jaeger v2 process for end-to-end tests, and helpers to read traces back.

Jaeger v2 is an OpenTelemetry Collector distribution. `Jaeger` writes a minimal config (OTLP
receiver -> batch -> in-memory storage, plus the query extension), binds every listener to a
free loopback port so parallel runs and other services on 4317/4318/16686 never collide, and
waits until the OTLP ports accept connections and the query API answers.

Query API shape relied on (GET /api/traces/{id}, the HTTP API the Jaeger UI uses):

    {"data": [{
        "traceID": "<16 or 32 hex>",      # 16 when the high 64 bits are zero
        "spans": [{
            "traceID": "...", "spanID": "<16 hex>",
            "operationName": "GET /x",
            "references": [{"refType": "CHILD_OF", "traceID": "...", "spanID": "<parent>"}],
            "startTime": <µs since epoch>, "duration": <µs>,
            "tags": [{"key": "...", "type": "string|int64|float64|bool", "value": ...}],
            "processID": "p1",
        }],
        "processes": {"p1": {"serviceName": "...", "tags": [...]}},
    }], "errors": null}

An unknown id answers 404 with {"data": null, "errors": [{"code": 404, ...}]}. Ingestion is
asynchronous (batch processor), so readers poll: see `get_trace` and `find_spans`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_DIR = Path(os.environ.get("TRACEJOIN_CACHE", "/var/cache/tracejoin"))
REPO_ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_PORT_ATTEMPTS = 3  # a port picked as free can be taken before Jaeger binds it; retry then


class JaegerError(RuntimeError):
    """Jaeger could not be found, started or queried."""


class TraceNotFound(AssertionError):
    """A trace or span did not show up in Jaeger in time (a test failure, not an error)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned_version() -> str | None:
    """The Jaeger version tools/jaeger/go.mod pins (what scripts/setup.sh builds)."""
    try:
        text = (REPO_ROOT / "tools" / "jaeger" / "go.mod").read_text()
    except OSError:
        return None
    m = re.search(r"^\s*github\.com/jaegertracing/jaeger (v[0-9.]+)", text, re.MULTILINE)
    return m.group(1) if m else None


def candidate_binaries() -> list[Path]:
    """Where the binary is looked for, in order: $TRACEJOIN_JAEGER, the cache symlink, the
    pinned versioned file."""
    env = os.environ.get("TRACEJOIN_JAEGER")
    if env:
        return [Path(env)]
    out = [CACHE_DIR / "jaeger"]
    version = pinned_version()
    if version:
        out.append(CACHE_DIR / f"jaeger-{version}")
    return out


def find_binary() -> Path | None:
    for path in candidate_binaries():
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


@dataclass(frozen=True)
class JaegerPorts:
    otlp_grpc: int
    otlp_http: int
    query_http: int
    query_grpc: int

    @classmethod
    def pick(cls) -> JaegerPorts:
        ports: set[int] = set()
        while len(ports) < 4:
            ports.add(free_port())
        a, b, c, d = sorted(ports)
        return cls(otlp_grpc=a, otlp_http=b, query_http=c, query_grpc=d)


def render_config(ports: JaegerPorts, host: str = "127.0.0.1") -> str:
    """Jaeger v2 (v1.76.0) config: only the components the tests need, every listener explicit.

    Schema from cmd/jaeger/internal/all-in-one.yaml of the module. Left out on purpose, because
    their defaults listen on fixed ports: the jaeger/zipkin receivers, remote_sampling,
    healthcheckv2, expvar, zpages, pprof, and the collector's own Prometheus metrics (8888),
    which `level: none` turns off. jaeger_query's self-tracing is off so it never exports to
    whatever listens on the default localhost:4317.
    """
    return f"""\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: info

extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
  jaeger_query:
    enable_tracing: false
    storage:
      traces: memstore
    http:
      endpoint: "{host}:{ports.query_http}"
    grpc:
      endpoint: "{host}:{ports.query_grpc}"

receivers:
  otlp:
    protocols:
      grpc:
        endpoint: "{host}:{ports.otlp_grpc}"
      http:
        endpoint: "{host}:{ports.otlp_http}"

processors:
  batch:
    timeout: 100ms

exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"""


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL Jaeger if the test process dies without stopping it."""
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def trace_ids_equal(a: str, b: str) -> bool:
    """Jaeger prints a trace id with zero high 64 bits as 16 hex digits: compare numerically."""
    return int(a, 16) == int(b, 16)


def span_tags(span: Mapping[str, Any]) -> dict[str, Any]:
    """A span's tags as {key: value}."""
    return {t["key"]: t["value"] for t in span.get("tags") or []}


def parent_span_id(span: Mapping[str, Any]) -> str | None:
    """The spanID of the span's CHILD_OF reference, if any."""
    for ref in span.get("references") or []:
        if ref.get("refType") == "CHILD_OF":
            return str(ref["spanID"])
    return None


def the_server_span(trace: Mapping[str, Any], trace_id: int, parent: int) -> dict[str, Any]:
    """The trace's only SERVER span, checked to sit under `parent` in trace `trace_id`."""
    servers = [s for s in trace["spans"] if span_tags(s).get("span.kind") == "server"]
    assert len(servers) == 1, trace["spans"]
    span = servers[0]
    assert trace_ids_equal(span["traceID"], f"{trace_id:032x}")
    assert parent_span_id(span) == f"{parent:016x}"
    return dict(span)


def span_service(trace: Mapping[str, Any], span: Mapping[str, Any]) -> str:
    return str(trace["processes"][span["processID"]]["serviceName"])


class Jaeger:
    """One Jaeger v2 process with in-memory storage on free loopback ports.

    Use as a context manager, or call start() and stop(); stop() is idempotent and safe before
    start(). The log stays readable (`log_tail()`) after stop for failure messages.
    """

    def __init__(
        self,
        binary: Path | str,
        start_timeout_s: float = START_TIMEOUT_S,
        host: str = "127.0.0.1",
    ) -> None:
        self.binary = Path(binary)
        self.start_timeout_s = start_timeout_s
        self.host = host
        self.ports: JaegerPorts | None = None
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._log_text = ""

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> Jaeger:
        if self._proc is not None:
            return self
        last: JaegerError | None = None
        for _ in range(_PORT_ATTEMPTS):
            try:
                self._start_once()
                return self
            except JaegerError as e:
                last = e
                self.stop()
                if "address already in use" not in str(e):
                    raise
        assert last is not None
        raise last

    def _start_once(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="tracejoin-jaeger-"))
        self.ports = JaegerPorts.pick()
        config = self._dir / "config.yaml"
        config.write_text(render_config(self.ports, self.host))
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [str(self.binary), "--config", f"file:{config}"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        self._wait_ready(t0)
        self.startup_s = time.monotonic() - t0

    def _wait_ready(self, t0: float) -> None:
        assert self._proc is not None and self.ports is not None
        deadline = t0 + self.start_timeout_s
        while time.monotonic() < deadline:
            rc = self._proc.poll()
            if rc is not None:
                raise JaegerError(f"Jaeger exited with status {rc} during start-up{self._ctx()}")
            if self._ready():
                return
            time.sleep(0.05)
        raise JaegerError(
            f"Jaeger did not come up within {self.start_timeout_s:.0f} s (OTLP gRPC "
            f"{self.ports.otlp_grpc}, OTLP HTTP {self.ports.otlp_http}, query "
            f"{self.ports.query_http}){self._ctx()}"
        )

    def _ready(self) -> bool:
        assert self.ports is not None
        if not (_port_open(self.ports.otlp_grpc) and _port_open(self.ports.otlp_http)):
            return False
        try:
            status, _ = self._get("/api/services")
        except (OSError, ValueError):
            return False
        return status == 200

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._dir is not None:
            self._log_text = self._read_log()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Jaeger:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # --- endpoints -------------------------------------------------------------------------

    def _need_ports(self) -> JaegerPorts:
        if self.ports is None:
            raise JaegerError("Jaeger is not started")
        return self.ports

    @property
    def otlp_grpc_endpoint(self) -> str:
        """host:port for OTLPSpanExporter(endpoint=..., insecure=True) over gRPC."""
        return f"{self.host}:{self._need_ports().otlp_grpc}"

    @property
    def otlp_http_endpoint(self) -> str:
        """Base URL as in OTEL_EXPORTER_OTLP_ENDPOINT; traces go to + '/v1/traces'."""
        return f"http://{self.host}:{self._need_ports().otlp_http}"

    @property
    def otlp_http_traces_url(self) -> str:
        return self.otlp_http_endpoint + "/v1/traces"

    @property
    def query_url(self) -> str:
        return f"http://{self.host}:{self._need_ports().query_http}"

    # --- logs ------------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        if self._dir is None:
            raise JaegerError("Jaeger has no log directory (not started)")
        return self._dir / "jaeger.log"

    def _read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, JaegerError):
            return self._log_text

    def log_tail(self, lines: int = 30) -> str:
        text = self._read_log() if self._dir is not None else self._log_text
        return "\n".join(text.splitlines()[-lines:])

    def _ctx(self) -> str:
        return f"\n--- last lines of Jaeger's log ({self.binary}) ---\n{self.log_tail()}"

    # --- query API -------------------------------------------------------------------------

    def _get(self, path: str, params: Mapping[str, str] | None = None) -> tuple[int, Any]:
        url = self.query_url + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return e.code, json.loads(body)
            except ValueError:
                return e.code, body.decode(errors="replace")

    def services(self) -> list[str]:
        status, body = self._get("/api/services")
        if status != 200:
            raise JaegerError(f"GET /api/services answered {status}: {body}{self._ctx()}")
        return sorted(body.get("data") or [])

    def get_trace(self, trace_id_hex: str, timeout_s: float = 10.0, min_spans: int = 1) -> dict:
        """Poll GET /api/traces/{id} until the trace has at least `min_spans` spans; return the
        trace object (the response's data[0]: traceID, spans, processes)."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while True:
            status, body = self._get(f"/api/traces/{trace_id_hex}")
            last = (status, body)
            if status == 200 and body.get("data"):
                trace: dict = body["data"][0]
                if len(trace.get("spans") or []) >= min_spans:
                    return trace
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        raise TraceNotFound(
            f"trace {trace_id_hex} with >= {min_spans} span(s) not in Jaeger after {timeout_s} s;"
            f" last answer {last[0]}: {json.dumps(last[1])[:500]}; services seen:"
            f" {self._services_or_error()}{self._ctx()}"
        )

    def find_spans(
        self,
        service: str,
        operation: str | None = None,
        tags: Mapping[str, str] | None = None,
        min_count: int = 1,
        timeout_s: float = 10.0,
        lookback: str = "1h",
        limit: int = 100,
    ) -> list[tuple[dict, dict]]:
        """Poll GET /api/traces?service=... until at least `min_count` spans of `service` match
        `operation` and every tag in `tags` (compared as strings). Returns (trace, span) pairs,
        so the caller can resolve a span's process via `span_service(trace, span)`."""
        params = {"service": service, "lookback": lookback, "limit": str(limit)}
        if operation:
            params["operation"] = operation
        if tags:
            params["tags"] = json.dumps(dict(tags))
        deadline = time.monotonic() + timeout_s
        found: list[tuple[dict, dict]] = []
        while True:
            status, body = self._get("/api/traces", params)
            if status == 200:
                found = _matching_spans(body.get("data") or [], service, operation, tags)
                if len(found) >= min_count:
                    return found
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        raise TraceNotFound(
            f"{len(found)} span(s) of service {service!r} operation {operation!r} tags {tags}"
            f" after {timeout_s} s, wanted >= {min_count}; services seen:"
            f" {self._services_or_error()}{self._ctx()}"
        )

    def _services_or_error(self) -> str:
        try:
            return str(self.services())
        except (OSError, JaegerError, ValueError) as e:
            return f"<{e}>"


def _matching_spans(
    traces: list[dict],
    service: str,
    operation: str | None,
    tags: Mapping[str, str] | None,
) -> list[tuple[dict, dict]]:
    out = []
    for trace in traces:
        for span in trace.get("spans") or []:
            if span_service(trace, span) != service:
                continue
            if operation and span.get("operationName") != operation:
                continue
            have = {
                k: str(v).lower() if isinstance(v, bool) else str(v)
                for k, v in span_tags(span).items()
            }
            if tags and any(have.get(k) != str(v) for k, v in tags.items()):
                continue
            out.append((trace, span))
    return out


@contextlib.contextmanager
def running_jaeger(binary: Path | str | None = None) -> Iterator[Jaeger]:
    """`with running_jaeger() as j:` for scripts; raises JaegerError if the binary is missing."""
    path = Path(binary) if binary else find_binary()
    if path is None:
        raise JaegerError(missing_binary_message())
    with Jaeger(path) as j:
        yield j


def missing_binary_message() -> str:
    where = ", ".join(str(p) for p in candidate_binaries())
    return (
        f"Jaeger binary not found (looked at {where}). Run `make setup` (it builds Jaeger "
        "from tools/jaeger into /var/cache/tracejoin), or point TRACEJOIN_JAEGER at a Jaeger v2 "
        "binary."
    )
