"""OTLP/HTTP sender: POST application/x-protobuf, stdlib http.client, one kept-alive connection.

Retryable per the OTLP spec: 429, 502, 503, 504 and connection-level errors, honouring
Retry-After. Every other non-2xx response is permanent.
"""

from __future__ import annotations

import contextlib
import email.utils
import gzip
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import tracejoin
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from tracejoin.core.model import Span
from tracejoin.exporters.base import ExportResult, ExportStatus
from tracejoin.exporters.otlp_proto import encode_request_bytes

DEFAULT_ENDPOINT = "http://localhost:4318"
TRACES_PATH = "v1/traces"
_RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
# A kept-alive connection the server has since closed fails like this before any response; the
# request is then resent once on a fresh connection rather than waiting out a backoff.
_STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


def traces_url(base_endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT is a base URL: the traces path is appended to its path."""
    return base_endpoint.rstrip("/") + "/" + TRACES_PATH


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP-date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class OtlpHttpExporter:
    def __init__(
        self,
        url: str = DEFAULT_ENDPOINT + "/" + TRACES_PATH,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        compression: str | None = None,
        certificate_file: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported scheme in {url!r} (use http:// or https://)")
        if not parts.hostname:
            raise ValueError(f"no host in {url!r}")
        if compression not in (None, "none", "gzip"):
            raise ValueError(f"unsupported compression {compression!r} (use gzip or none)")
        self.url = url
        self.timeout_s = timeout_s
        self._host = parts.hostname
        self._port = parts.port  # raises ValueError when out of range
        self._tls = parts.scheme == "https"
        self._path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._gzip = compression == "gzip"
        self._ssl = ssl.create_default_context(cafile=certificate_file) if self._tls else None
        self._headers = {
            "Content-Type": "application/x-protobuf",
            "User-Agent": f"tracejoin/{tracejoin.__version__}",
            **(headers or {}),
        }
        if self._gzip:
            self._headers["Content-Encoding"] = "gzip"
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # guards _conn between export and shutdown
        self._closed = False

    def _connection(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """The kept-alive connection (and True), or a new one (and False)."""
        with self._lock:
            conn = self._conn
            reused = conn is not None and conn.sock is not None
            if conn is None:
                if self._tls:
                    conn = http.client.HTTPSConnection(
                        self._host, self._port, timeout=timeout, context=self._ssl
                    )
                else:
                    conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
                self._conn = conn
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        return conn, reused

    def _drop_connection(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def export(self, spans: Sequence[Span], timeout_s: float | None = None) -> ExportResult:
        if self._closed:
            return ExportResult.fail("exporter is shut down")
        if not spans:
            return ExportResult.SUCCESS
        timeout = max(
            self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s), 0.001
        )
        body = encode_request_bytes(spans)
        if self._gzip:
            body = gzip.compress(body, compresslevel=5)
        deadline = time.monotonic() + timeout
        for _ in range(2):
            conn, reused = self._connection(max(deadline - time.monotonic(), 0.001))
            try:
                conn.request("POST", self._path, body, self._headers)
                resp = conn.getresponse()
                data = resp.read()
            except _STALE_CONNECTION as err:
                self._drop_connection()
                if reused and not self._closed and time.monotonic() < deadline:
                    continue
                return ExportResult.retry(f"POST {self.url}: {err!r}")
            except (OSError, http.client.HTTPException) as err:  # refused, timed out, reset
                self._drop_connection()
                if self._closed:
                    return ExportResult.fail("exporter is shut down")
                return ExportResult.retry(f"POST {self.url}: {err!r}")
            return self._result(resp, data)
        return ExportResult.retry(f"POST {self.url}: connection closed")  # not reached

    def _result(self, resp: http.client.HTTPResponse, data: bytes) -> ExportResult:
        if 200 <= resp.status < 300:
            rejected, message = 0, ""
            if data and "protobuf" in (resp.getheader("Content-Type") or ""):
                with contextlib.suppress(Exception):  # a body we cannot read is still a success
                    partial = ExportTraceServiceResponse.FromString(data).partial_success
                    rejected, message = partial.rejected_spans, partial.error_message
            if rejected:
                return ExportResult(ExportStatus.SUCCESS, rejected_spans=rejected, detail=message)
            return ExportResult.SUCCESS
        detail = f"POST {self.url}: HTTP {resp.status} {resp.reason}"
        if resp.status in _RETRYABLE_STATUS:
            return ExportResult.retry(detail, parse_retry_after(resp.getheader("Retry-After")))
        return ExportResult.fail(detail)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None and conn.sock is not None:
            # shutdown() wakes a recv blocked in the export thread; close() alone would not.
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if conn is not None:
            conn.close()

    def __repr__(self) -> str:
        return f"OtlpHttpExporter({self.url!r})"
