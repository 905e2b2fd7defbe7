"""Choose and configure the exporter from the standard OTEL_* variables (and CLI overrides).

Spec: opentelemetry.io/docs/specs/otel/protocol/exporter/ and
opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/.
Rules applied here:
  - a signal-specific variable (OTEL_EXPORTER_OTLP_TRACES_*) wins over the generic one, and an
    override wins over both; an empty variable counts as unset;
  - OTEL_EXPORTER_OTLP_ENDPOINT is a base URL (HTTP appends v1/traces), while
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is used exactly as given;
  - protocol defaults to http/protobuf (the spec's default); endpoints default to
    http://localhost:4317 (grpc) and http://localhost:4318 (http/protobuf);
  - with no endpoint, protocol or exporter configured at all, spans go to an OTLP/JSON-lines file.
Every bad value raises ExporterConfigError (a ValueError) whose message starts with the variable.

The OTLP exporters are the opentelemetry-exporter-otlp package's (grpc_sender, http_sender), and
they could read these variables themselves. They are resolved here instead, and every value is
passed to the package explicitly (its explicit arguments win over its own environment reads),
because the package reads OTEL_EXPORTER_OTLP_*TIMEOUT as seconds where the spec says
milliseconds, skips or replaces a bad value with a logged warning where tracejoin must name the
variable and stop, reads only os.environ (not the mapping it is given), and does not know our
overrides (`--otlp-endpoint` is a base URL that must outrank OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).

Overrides (keys; a value of None means "not given", so a CLI can pass every option):
  exporter ("otlp" | "file" | "console"), endpoint (base URL), traces_endpoint (exact URL),
  protocol, headers (str "k=v,..." or a mapping), timeout_s (seconds), compression,
  insecure (bool), certificate, client_key, client_certificate (paths), file_path.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from tracejoin.exporters.base import SpanExporter
from tracejoin.exporters.file_sender import ConsoleExporter, JsonLinesFileExporter

GRPC = "grpc"
HTTP_PROTOBUF = "http/protobuf"
HTTP_JSON = "http/json"
DEFAULT_PROTOCOL = HTTP_PROTOBUF
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_FILE_PATH = "tracejoin-spans.otlp.jsonl"
TRACES_PATH = "v1/traces"

ENV_EXPORTER = "OTEL_TRACES_EXPORTER"
_P = "OTEL_EXPORTER_OTLP_"
_T = "OTEL_EXPORTER_OTLP_TRACES_"

KINDS = ("otlp", "file", "console")
# RFC 7230 token characters: what a header name may contain.
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


class ExporterConfigError(ValueError):
    """A bad exporter setting; `variable` is the environment variable or override key."""

    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


@dataclass(frozen=True)
class ExporterSettings:
    kind: str  # "otlp_grpc", "otlp_http", "file" or "console"
    endpoint: str = ""  # gRPC: endpoint; HTTP: the full traces URL
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S
    compression: str | None = None
    insecure: bool | None = None
    certificate: str | None = None  # CA bundle that verifies the collector
    client_key: str | None = None  # mTLS: the agent's key and certificate chain
    client_certificate: str | None = None
    file_path: str = DEFAULT_FILE_PATH


def parse_headers(text: str, variable: str) -> dict[str, str]:
    """W3C-baggage-style `k=v,k2=v2`, percent-decoded, whitespace around items ignored."""
    headers: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = unquote(key.strip()), unquote(value.strip())
        if not sep or not key:
            raise ExporterConfigError(variable, f"expected key=value, got {item.strip()!r}")
        _check_header(key, value, variable)
        headers[key] = value
    return headers


def _check_header(key: str, value: str, variable: str) -> None:
    if not _TOKEN.match(key):
        raise ExporterConfigError(variable, f"invalid header name {key!r}")
    if any(c in value for c in "\r\n\0"):
        raise ExporterConfigError(variable, f"header {key!r} has a control character")


def _parse_timeout_ms(text: str, variable: str) -> float:
    try:
        ms = float(text)
    except ValueError:
        raise ExporterConfigError(
            variable, f"expected a timeout in milliseconds, got {text!r}"
        ) from None
    if not math.isfinite(ms) or ms <= 0:
        raise ExporterConfigError(
            variable, f"timeout must be a positive number of ms, got {text!r}"
        )
    return ms / 1000.0


def _parse_bool(text: str, variable: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    raise ExporterConfigError(variable, f"expected true or false, got {text!r}")


def traces_url(base_endpoint: str) -> str:
    """OTEL_EXPORTER_OTLP_ENDPOINT is a base URL: the traces path is appended to its path."""
    return base_endpoint.rstrip("/") + "/" + TRACES_PATH


def _check_url(url: str, variable: str, *, allow_bare: bool) -> None:
    """An http(s) URL with a host and a valid port (or, for gRPC, a bare host:port)."""
    try:
        if allow_bare and "://" not in url:
            parts = urlsplit("//" + url)
            if not parts.hostname:
                raise ValueError("no host")
            _ = parts.port  # raises ValueError when not a valid port
            return
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError("expected an http:// or https:// URL")
        if not parts.hostname:
            raise ValueError("no host")
        _ = parts.port  # raises ValueError when not a valid port
    except ValueError as err:
        raise ExporterConfigError(variable, f"invalid endpoint {url!r}: {err}") from None


class _Source:
    """Looks a setting up in overrides, then the traces-specific, then the generic variable,
    remembering which name supplied it (for error messages)."""

    def __init__(self, environ: Mapping[str, str], overrides: Mapping[str, object]) -> None:
        self.environ = environ
        self.overrides = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(self.overrides) - _OVERRIDE_KEYS
        if unknown:
            raise ExporterConfigError(f"override {sorted(unknown)[0]!r}", "unknown override")

    def env(self, *names: str) -> tuple[str, str] | None:
        for name in names:
            value = self.environ.get(name, "")
            if value.strip():
                return name, value.strip()
        return None

    def get(self, override: str, *names: str) -> tuple[str, object] | None:
        if override in self.overrides:
            return f"override {override!r}", self.overrides[override]
        return self.env(*names)


_OVERRIDE_KEYS = {
    "exporter",
    "endpoint",
    "traces_endpoint",
    "protocol",
    "headers",
    "timeout_s",
    "compression",
    "insecure",
    "certificate",
    "client_key",
    "client_certificate",
    "file_path",
}


def settings_from_env(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None
) -> ExporterSettings:
    """Resolve every setting without creating any exporter (no sockets, no files)."""
    src = _Source(os.environ if environ is None else environ, overrides or {})

    file_path = str(src.overrides.get("file_path", DEFAULT_FILE_PATH))
    kind = None
    got = src.get("exporter", ENV_EXPORTER)
    if got:
        var, value = got
        kind = str(value).strip().lower()
        if kind not in KINDS:
            raise ExporterConfigError(
                var, f"unsupported exporter {value!r} (use {', '.join(KINDS)})"
            )
    if kind == "console":
        return ExporterSettings(kind="console")
    if kind == "file":
        return ExporterSettings(kind="file", file_path=file_path)

    protocol_got = src.get("protocol", _T + "PROTOCOL", _P + "PROTOCOL")
    exact = src.get("traces_endpoint", _T + "ENDPOINT")
    base = src.get("endpoint", _P + "ENDPOINT")
    if "traces_endpoint" not in src.overrides and "endpoint" in src.overrides:
        exact = None  # an override outranks the environment, whichever form it takes
    if kind is None and not (protocol_got or exact or base):
        return ExporterSettings(kind="file", file_path=file_path)

    protocol = DEFAULT_PROTOCOL
    if protocol_got:
        var, value = protocol_got
        protocol = str(value).strip().lower()
        if protocol == HTTP_JSON:
            raise ExporterConfigError(var, "http/json is not supported; use http/protobuf or grpc")
        if protocol not in (GRPC, HTTP_PROTOBUF):
            raise ExporterConfigError(
                var, f"unsupported protocol {value!r} (use grpc or http/protobuf)"
            )
    is_grpc = protocol == GRPC

    if exact:
        var, value = exact
        endpoint = str(value)
    elif base:
        var, value = base
        endpoint = str(value) if is_grpc else traces_url(str(value))
    else:
        var = _P + "ENDPOINT"
        endpoint = DEFAULT_GRPC_ENDPOINT if is_grpc else traces_url(DEFAULT_HTTP_ENDPOINT)
    _check_url(endpoint, var, allow_bare=is_grpc)

    headers: dict[str, str] = {}
    got = src.get("headers", _T + "HEADERS", _P + "HEADERS")
    if got:
        var, value = got
        if isinstance(value, Mapping):
            headers = {str(k): str(v) for k, v in value.items()}
            for k, v in headers.items():
                _check_header(k, v, var)
        else:
            headers = parse_headers(str(value), var)

    timeout_s = DEFAULT_TIMEOUT_S
    got = src.get("timeout_s", _T + "TIMEOUT", _P + "TIMEOUT")
    if got:
        var, value = got
        if var.startswith("override"):
            try:
                timeout_s = float(str(value))
            except ValueError:
                raise ExporterConfigError(var, f"expected seconds, got {value!r}") from None
            if not math.isfinite(timeout_s) or timeout_s <= 0:
                raise ExporterConfigError(var, f"timeout must be positive, got {value!r}")
        else:
            timeout_s = _parse_timeout_ms(str(value), var)

    compression = None
    got = src.get("compression", _T + "COMPRESSION", _P + "COMPRESSION")
    if got:
        var, value = got
        low = str(value).strip().lower()
        if low not in ("gzip", "none"):
            raise ExporterConfigError(var, f"unsupported compression {value!r} (use gzip or none)")
        compression = None if low == "none" else low

    insecure = None
    got = src.get("insecure", _T + "INSECURE", _P + "INSECURE")
    if got:
        var, value = got
        insecure = value if isinstance(value, bool) else _parse_bool(str(value), var)

    files: dict[str, str | None] = {}
    for key, suffix in (
        ("certificate", "CERTIFICATE"),
        ("client_key", "CLIENT_KEY"),
        ("client_certificate", "CLIENT_CERTIFICATE"),
    ):
        files[key] = None
        got = src.get(key, _T + suffix, _P + suffix)
        if got:
            var, value = got
            files[key] = str(value)
            if not os.path.isfile(str(value)):
                raise ExporterConfigError(var, f"{key} file {str(value)!r} does not exist")
    if bool(files["client_key"]) != bool(files["client_certificate"]):
        missing = "CLIENT_CERTIFICATE" if files["client_key"] else "CLIENT_KEY"
        raise ExporterConfigError(_P + missing, "mTLS needs both the client key and certificate")

    return ExporterSettings(
        kind="otlp_grpc" if is_grpc else "otlp_http",
        endpoint=endpoint,
        headers=headers,
        timeout_s=timeout_s,
        compression=compression,
        insecure=insecure,
        certificate=files["certificate"],
        client_key=files["client_key"],
        client_certificate=files["client_certificate"],
        file_path=file_path,
    )


def build_exporter(settings: ExporterSettings) -> SpanExporter:
    if settings.kind == "console":
        return ConsoleExporter()
    if settings.kind == "file":
        return JsonLinesFileExporter(settings.file_path)
    tls_files = {
        "certificate_file": settings.certificate,
        "client_key_file": settings.client_key,
        "client_certificate_file": settings.client_certificate,
    }
    # Imported here: each pulls in its half of the OTLP package (grpc alone takes ~0.5 s).
    if settings.kind == "otlp_grpc":
        from tracejoin.exporters.grpc_sender import OtlpGrpcExporter

        return OtlpGrpcExporter(
            settings.endpoint,
            headers=settings.headers,
            timeout_s=settings.timeout_s,
            compression=settings.compression,
            insecure=settings.insecure,
            **tls_files,
        )
    if settings.kind == "otlp_http":
        from tracejoin.exporters.http_sender import OtlpHttpExporter

        return OtlpHttpExporter(
            settings.endpoint,
            headers=settings.headers,
            timeout_s=settings.timeout_s,
            compression=settings.compression,
            **tls_files,
        )
    raise ValueError(f"unknown exporter kind {settings.kind!r}")


def exporter_from_env(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None
) -> SpanExporter:
    """The exporter the environment (os.environ by default) and overrides describe."""
    return build_exporter(settings_from_env(environ, overrides))
