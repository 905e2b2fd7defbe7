"""OTLP/gRPC sender: the OpenTelemetry OTLP/gRPC span exporter, fed tracejoin's encoder.

The package (opentelemetry-exporter-otlp-proto-grpc) builds the channel: target from the
endpoint, plaintext or TLS, mTLS credentials or a credential provider, channel compression and
the metadata (headers) sent with each call; it also says which status codes are retryable
(OTEL_PYTHON_EXPORTER_OTLP_GRPC_RETRYABLE_ERROR_CODES can change that set).

Ours: the request goes out as the bytes otlp_proto already wrote, through a unary
TraceService/Export call with no request serializer on the package's channel, so no protobuf
message is built; and one attempt per call, because BatchExportQueue does the retrying
(queue.py). RetryInfo is read where the OTLP spec puts it (the grpc-status-details-bin
trailer; the package looks for a `google.rpc.retryinfo-bin` key instead), and
RESOURCE_EXHAUSTED is retried only when the server says when (the spec's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import grpc
import tracejoin
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.grpc.exporter import _load_credentials
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from tracejoin.core.model import ExportSpan
from tracejoin.exporters.base import ExportResult, ExportStatus
from tracejoin.exporters.otlp_proto import encode_request_bytes

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
DEFAULT_ENDPOINT = "http://localhost:4317"

_CHANNEL_OPTIONS = (
    ("grpc.primary_user_agent", f"tracejoin/{tracejoin.__version__}"),
    # The queue does the retrying, with backoff it can bound by a shutdown deadline.
    ("grpc.enable_retries", 0),
    # gRPC's default reconnect backoff grows to 120 s: a collector restart would then fail every
    # retry for minutes after it is back. (min_reconnect_backoff is left alone: gRPC also uses it
    # as the connect timeout, 20 s by default.)
    ("grpc.max_reconnect_backoff_ms", 5000),
)


_COMPRESSION = {"none": grpc.Compression.NoCompression, "gzip": grpc.Compression.Gzip}


def _retry_delay_s(err: grpc.RpcError) -> float | None:
    """The server's google.rpc.RetryInfo delay, from the status details trailer, if any."""
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key != "grpc-status-details-bin":
            continue
        try:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
        except Exception:  # a malformed trailer only loses the hint
            return None
    return None


class OtlpGrpcExporter(OTLPSpanExporter):
    """One unary TraceService/Export call per export(). `endpoint`: http://host:port
    (plaintext), https://host:port (TLS), or host:port (TLS unless `insecure`)."""

    accepts_encoded = True  # model.EncodedSpan bodies go into the request as they are

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        compression: str | None = None,
        insecure: bool | None = None,
        certificate_file: str | None = None,
        client_key_file: str | None = None,
        client_certificate_file: str | None = None,
    ) -> None:
        if "://" in endpoint:  # the spec: OTEL_EXPORTER_OTLP_INSECURE only applies without one
            insecure = endpoint.startswith("http://")
        credentials = None
        if certificate_file or client_key_file or client_certificate_file:
            credentials = _load_credentials(
                certificate_file, client_key_file, client_certificate_file
            )
        super().__init__(
            endpoint=endpoint,
            insecure=bool(insecure),
            credentials=credentials,
            # gRPC metadata keys must be lowercase.
            headers={k.lower(): v for k, v in (headers or {}).items()},
            timeout=timeout_s,
            compression=_COMPRESSION[compression or "none"],
            channel_options=cast(Any, _CHANNEL_OPTIONS),  # the package types values as str
        )
        self.endpoint = endpoint
        self.timeout_s = timeout_s

    _send: grpc.UnaryUnaryMultiCallable

    def _initialize_channel_and_stub(self) -> None:
        super()._initialize_channel_and_stub()
        assert self._channel is not None
        # request_serializer None: the request is the bytes otlp_proto wrote.
        self._send = self._channel.unary_unary(
            EXPORT_METHOD, response_deserializer=ExportTraceServiceResponse.FromString
        )

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
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            response = self._send(
                encode_request_bytes(spans), timeout=max(timeout, 0.001), metadata=self._headers
            )
        except grpc.RpcError as err:
            return self._failure(err)
        except ValueError as err:  # "Cannot invoke RPC on closed channel!" during shutdown
            return ExportResult.fail(str(err))
        if response.HasField("partial_success") and response.partial_success.rejected_spans:
            partial = response.partial_success
            return ExportResult(
                ExportStatus.SUCCESS, rejected_spans=partial.rejected_spans,
                detail=partial.error_message,
            )  # fmt: skip
        return ExportResult.SUCCESS

    def _failure(self, err: grpc.RpcError) -> ExportResult:
        if self._shutdown:  # our own shutdown cancelled the call: nothing to retry
            return ExportResult.fail("exporter is shut down")
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else ""
        detail = f"gRPC {code.name}: {details}" if code is not None else str(err)
        delay = _retry_delay_s(err)
        if code not in cast(frozenset[grpc.StatusCode], self._retryable_error_codes):
            return ExportResult.fail(detail)
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is None:
            return ExportResult.fail(detail)
        return ExportResult.retry(detail, retry_after_s=delay)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if not self._shutdown:  # the package logs a warning on a second call; ours is idempotent
            super().shutdown(timeout_millis, **kwargs)

    def __repr__(self) -> str:
        return f"OtlpGrpcExporter({self.endpoint!r})"
