"""OTLP/gRPC sender: one unary TraceService/Export call per batch.

The request goes out as the bytes otlp_proto already wrote (a unary_unary call on the
TraceService/Export method with no request serializer), so no protobuf message is built.
Retryable status codes follow the OTLP spec (opentelemetry.io/docs/specs/otlp/#failures).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import grpc
import tracejoin
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from tracejoin.core.model import Span
from tracejoin.exporters.base import ExportResult, ExportStatus
from tracejoin.exporters.otlp_proto import encode_request_bytes

log = logging.getLogger(__name__)

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
DEFAULT_ENDPOINT = "http://localhost:4317"

_RETRYABLE = frozenset(
    {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)

_CHANNEL_OPTIONS = [
    # The queue does the retrying, with backoff it can bound by a shutdown deadline.
    ("grpc.enable_retries", 0),
    # gRPC's default reconnect backoff grows to 120 s: a collector restart would then fail every
    # retry for minutes after it is back. (min_reconnect_backoff is left alone: gRPC also uses it
    # as the connect timeout, 20 s by default.)
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.primary_user_agent", f"tracejoin/{tracejoin.__version__}"),
]


def grpc_target(endpoint: str, insecure: bool | None = None) -> tuple[str, bool]:
    """(host:port target, use TLS) from an OTLP endpoint.

    http:// means plaintext and https:// TLS; a bare host:port is TLS unless `insecure`
    (OTEL_EXPORTER_OTLP_INSECURE). Raises ValueError for an endpoint without a host.
    """
    if "://" not in endpoint:
        parts = urlsplit("//" + endpoint)
        tls = not insecure
    else:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"unsupported scheme {parts.scheme!r} (use http:// or https://)")
        tls = parts.scheme == "https"
    host = parts.hostname
    if not host:
        raise ValueError(f"no host in endpoint {endpoint!r}")
    port = parts.port or (443 if tls else 4317)  # .port raises ValueError when out of range
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}", tls


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


class OtlpGrpcExporter:
    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        compression: str | None = None,
        insecure: bool | None = None,
        certificate_file: str | None = None,
    ) -> None:
        target, tls = grpc_target(endpoint, insecure)
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        # gRPC metadata keys must be lowercase.
        self._metadata = tuple((k.lower(), v) for k, v in (headers or {}).items())
        if compression not in (None, "none", "gzip"):
            raise ValueError(f"unsupported compression {compression!r} (use gzip or none)")
        self._compression = grpc.Compression.Gzip if compression == "gzip" else None
        if tls:
            roots = None
            if certificate_file:
                with open(certificate_file, "rb") as f:
                    roots = f.read()
            creds = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(target, creds, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._call = self._channel.unary_unary(
            EXPORT_METHOD, response_deserializer=ExportTraceServiceResponse.FromString
        )
        self._closed = False

    def export(self, spans: Sequence[Span], timeout_s: float | None = None) -> ExportResult:
        if self._closed:
            return ExportResult.fail("exporter is shut down")
        if not spans:
            return ExportResult.SUCCESS
        timeout = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            response = self._call(
                encode_request_bytes(spans),
                timeout=max(timeout, 0.001),
                metadata=self._metadata,
                compression=self._compression,
            )
        except grpc.RpcError as err:
            return self._failure(err)
        except ValueError as err:  # "Cannot invoke RPC on closed channel!" during shutdown
            return ExportResult.fail(str(err))
        rejected = 0
        if response.HasField("partial_success"):
            rejected = response.partial_success.rejected_spans
        if rejected:
            msg = response.partial_success.error_message
            return ExportResult(ExportStatus.SUCCESS, rejected_spans=rejected, detail=msg)
        return ExportResult.SUCCESS

    def _failure(self, err: grpc.RpcError) -> ExportResult:
        if self._closed:  # our own shutdown cancelled the call: nothing to retry
            return ExportResult.fail("exporter is shut down")
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else ""
        detail = f"gRPC {code.name}: {details}" if code is not None else str(err)
        delay = _retry_delay_s(err)
        # RESOURCE_EXHAUSTED is only worth retrying when the server says when (RetryInfo).
        if code in _RETRYABLE or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None):
            return ExportResult.retry(detail, retry_after_s=delay)
        return ExportResult.fail(detail)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._channel.close()  # also cancels an export in flight

    def __repr__(self) -> str:
        return f"OtlpGrpcExporter({self.endpoint!r})"
