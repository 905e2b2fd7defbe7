"""OTLP/HTTP sender: the OpenTelemetry OTLP/HTTP span exporter, fed tracejoin's encoder.

The package (opentelemetry-exporter-otlp-proto-http) does the transport: the connection pool
(kept-alive connections, resent at once when a pooled connection turns out stale), TLS and mTLS
(CA certificate, client key and certificate), headers, compression, the request size limit,
which responses are retryable (429, 502, 503, 504, connection errors) and Retry-After.
Of its two transports we take the urllib3 one: requests (its default) lets REQUESTS_CA_BUNDLE
or CURL_CA_BUNDLE in the environment replace the configured CA certificate on every request
(psf/requests#3829; many images set them, this test machine does), and its timeout bounds each
socket operation where urllib3's bounds the whole request, which a shutdown deadline needs.

Two things are ours. The encoding: the spans are tracejoin's model.Span, written straight to
protobuf bytes by otlp_proto (docs/architecture.md, "Why the encoder is hand-written"). And one
attempt per call: the package's own export() retries with backoff for up to its timeout;
BatchExportQueue retries instead (queue.py says why), so export() here goes through the
package's single-attempt path (_OTLPHTTPClient._submit) and reports whether a retry is worth it.
These are the package's private names: pyproject.toml pins the minor version they were read in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import tracejoin
import urllib3
from opentelemetry.exporter.http.transport._base import BaseHTTPResult
from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
from opentelemetry.exporter.otlp.common import http as otlp_http
from opentelemetry.exporter.otlp.proto.http._common import _is_request_too_large
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from tracejoin.core.model import ExportSpan
from tracejoin.exporters.base import ExportResult, ExportStatus
from tracejoin.exporters.otlp_proto import encode_request_bytes

DEFAULT_URL = "http://localhost:4318/v1/traces"
USER_AGENT = f"tracejoin/{tracejoin.__version__}"


class OtlpHttpExporter(OTLPSpanExporter):
    """POST application/x-protobuf to `url` (the full traces URL), one attempt per export()."""

    accepts_encoded = True  # model.EncodedSpan bodies go into the request as they are

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        compression: str | None = None,
        certificate_file: str | None = None,
        client_key_file: str | None = None,
        client_certificate_file: str | None = None,
    ) -> None:
        cert: tuple[str, str] | None = None
        if client_certificate_file and client_key_file:
            cert = (client_certificate_file, client_key_file)
        super().__init__(
            endpoint=url,
            _transport=Urllib3HTTPTransport(verify=certificate_file or True, cert=cert),
            headers={"user-agent": USER_AGENT, **(headers or {})},
            timeout=timeout_s,
            compression=otlp_http.Compression.from_str(compression or "none"),
        )
        self.url = url
        self.timeout_s = timeout_s

    # The package's transport with our encoder: it takes model.Span or EncodedSpan, not the SDK's
    # ReadableSpan (tracejoin's SpanExporter protocol, base.py): deliberately not Liskov.
    def export(  # type: ignore[override]
        self, spans: Sequence[ExportSpan], timeout_s: float | None = None
    ) -> ExportResult:
        """Not the SDK's export(ReadableSpan): tracejoin's SpanExporter protocol (base.py)."""
        if self._shutdown:
            return ExportResult.fail("exporter is shut down")
        if not spans:
            return ExportResult.SUCCESS
        body = encode_request_bytes(spans)
        if _is_request_too_large(body, self._max_request_size):
            return ExportResult.fail(f"request of {len(body)} bytes is over max_request_size")
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        client = self._client
        result = client._submit(client._compress(body), max(timeout, 0.001))
        if result.status_code is None:  # no response: refused, reset, timed out, TLS
            if self._shutdown:
                return ExportResult.fail("exporter is shut down")
            detail = f"POST {self.url}: {result.error!r}"
            # The transport does not count a read timeout as a connection error; for OTLP it is
            # retryable all the same (gRPC's DEADLINE_EXCEEDED).
            if client._transport.is_connection_error(result.error) or isinstance(
                result.error, urllib3.exceptions.TimeoutError
            ):
                return ExportResult.retry(detail)
            return ExportResult.fail(detail)
        return self._outcome(result)

    def _outcome(self, result: BaseHTTPResult) -> ExportResult:
        status = result.status_code or 0
        if 200 <= status < 300:
            partial = None
            with contextlib.suppress(Exception):  # a body we cannot read is still a success
                if "protobuf" in result.headers().get("content-type", ""):
                    body = ExportTraceServiceResponse.FromString(result.content())
                    partial = body.partial_success
            if partial is not None and partial.rejected_spans:
                return ExportResult(
                    ExportStatus.SUCCESS, rejected_spans=partial.rejected_spans,
                    detail=partial.error_message,
                )  # fmt: skip
            return ExportResult.SUCCESS
        detail = f"POST {self.url}: HTTP {status} {result.reason or ''}".rstrip()
        if otlp_http._is_retryable(status):
            return ExportResult.retry(detail, otlp_http._extract_retry_after(result))
        return ExportResult.fail(detail)

    def shutdown(self) -> None:
        if not self._shutdown:  # the package logs a warning on a second call; ours is idempotent
            super().shutdown()

    def __repr__(self) -> str:
        return f"OtlpHttpExporter({self.url!r})"
