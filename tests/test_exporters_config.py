"""Exporter selection from OTEL_EXPORTER_OTLP_* variables and CLI overrides, and the errors that
name the variable at fault."""

from __future__ import annotations

from pathlib import Path

import pytest
from tracejoin.exporters.config import (
    ExporterConfigError,
    ExporterSettings,
    exporter_from_env,
    parse_headers,
    settings_from_env,
)
from tracejoin.exporters.file_sender import ConsoleExporter, JsonLinesFileExporter
from tracejoin.exporters.grpc_sender import OtlpGrpcExporter
from tracejoin.exporters.http_sender import OtlpHttpExporter


def test_nothing_configured_means_the_jsonl_file() -> None:
    s = settings_from_env({}, {"file_path": "/tmp/x.jsonl"})
    assert s == ExporterSettings(kind="file", file_path="/tmp/x.jsonl")
    exp = exporter_from_env({})
    assert isinstance(exp, JsonLinesFileExporter)
    exp.shutdown()


def test_base_endpoint_gets_v1_traces_and_http_protobuf_by_default() -> None:
    s = settings_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318/"})
    assert (s.kind, s.endpoint) == ("otlp_http", "http://jaeger:4318/v1/traces")
    s = settings_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://gw.example/otlp"})
    assert s.endpoint == "https://gw.example/otlp/v1/traces"
    assert s.timeout_s == 10.0 and s.compression is None and s.headers == {}


def test_traces_endpoint_is_used_exactly_and_wins() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://special:9999/custom/path",
    }
    assert settings_from_env(env).endpoint == "http://special:9999/custom/path"


def test_grpc_protocol_and_defaults() -> None:
    s = settings_from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert (s.kind, s.endpoint) == ("otlp_grpc", "http://localhost:4317")
    s = settings_from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert (s.kind, s.endpoint) == ("otlp_http", "http://localhost:4318/v1/traces")
    s = settings_from_env({"OTEL_TRACES_EXPORTER": "otlp"})
    assert s.kind == "otlp_http"
    # Signal-specific protocol wins; a gRPC base endpoint is used as is.
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
    }
    s = settings_from_env(env)
    assert (s.kind, s.endpoint) == ("otlp_grpc", "http://collector:4317")
    exp = exporter_from_env(env)
    assert isinstance(exp, OtlpGrpcExporter)
    exp.shutdown()


def test_headers_timeout_compression_insecure(tmp_path: Path) -> None:
    cert = tmp_path / "ca.pem"
    cert.write_text("not checked here")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_HEADERS": "a=1",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": " api-key = s%3Dcret%2C1 , x-scope=team%20a,, ",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "750",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP",
        "OTEL_EXPORTER_OTLP_INSECURE": "True",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert),
    }
    s = settings_from_env(env)
    # Traces-specific headers replace the generic ones; values are percent-decoded.
    assert s.headers == {"api-key": "s=cret,1", "x-scope": "team a"}
    assert s.timeout_s == 0.75
    assert s.compression == "gzip"
    assert s.insecure is True
    assert s.certificate == str(cert)
    exp = exporter_from_env({**env, "OTEL_EXPORTER_OTLP_CERTIFICATE": ""})
    assert isinstance(exp, OtlpHttpExporter) and exp.timeout_s == 0.75
    exp.shutdown()


def test_mtls_files_traces_specific_wins(tmp_path: Path) -> None:
    files = {n: tmp_path / n for n in ("ca", "key", "cert", "traces-key")}
    for f in files.values():
        f.write_text("not checked here")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://c:4318",
        "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(files["ca"]),
        "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(files["key"]),
        "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(files["traces-key"]),
        "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(files["cert"]),
    }
    s = settings_from_env(env)
    assert (s.certificate, s.client_key, s.client_certificate) == (
        str(files["ca"]), str(files["traces-key"]), str(files["cert"]),
    )  # fmt: skip
    over = settings_from_env(env, {"client_key": str(files["key"])})
    assert over.client_key == str(files["key"])
    with pytest.raises(ExporterConfigError) as info:
        settings_from_env({**env, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": ""})
    assert info.value.variable == "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"
    assert "both" in str(info.value)
    with pytest.raises(ExporterConfigError) as info:
        settings_from_env({**env, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/no/key"})
    assert str(info.value).startswith("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY: client_key file")


def test_empty_variables_count_as_unset() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TIMEOUT": " "}
    assert settings_from_env(env).kind == "file"


def test_overrides_win_over_the_environment() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "5000",
    }
    over = {"endpoint": "http://cli:4317", "protocol": "grpc", "timeout_s": 1.5, "headers": None}
    s = settings_from_env(env, over)
    assert (s.kind, s.endpoint, s.timeout_s) == ("otlp_grpc", "http://cli:4317", 1.5)
    s = settings_from_env({}, {"headers": {"X-Key": "v%41"}})  # a mapping is taken literally
    assert s.kind == "file"
    s = settings_from_env({}, {"endpoint": "http://h:1", "headers": {"X-Key": "v%41"}})
    assert s.headers == {"X-Key": "v%41"}
    assert isinstance(exporter_from_env({}, {"exporter": "console"}), ConsoleExporter)
    s = settings_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, {"exporter": "file"})
    assert s.kind == "file"


@pytest.mark.parametrize(
    ("env", "variable", "fragment"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"},
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "udp",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://x:1"}, "OTEL_EXPORTER_OTLP_ENDPOINT", "ftp"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT", "host"),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:99999/v1/traces"},
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "99999",
        ),
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "h:x"},
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "h:x",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_TIMEOUT": "10s"},
            "OTEL_EXPORTER_OTLP_TIMEOUT",
            "10s",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-1"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "positive",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_HEADERS": "a=1,b"},
            "OTEL_EXPORTER_OTLP_HEADERS",
            "'b'",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_HEADERS": "a b=1"},
            "OTEL_EXPORTER_OTLP_HEADERS",
            "header name",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_HEADERS": "a=x%0Ay"},
            "OTEL_EXPORTER_OTLP_HEADERS",
            "control",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"},
            "OTEL_EXPORTER_OTLP_COMPRESSION",
            "zstd",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_INSECURE": "yes"},
            "OTEL_EXPORTER_OTLP_INSECURE",
            "yes",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/no"},
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
            "/no",
        ),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER", "zipkin"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], variable: str, fragment: str) -> None:
    with pytest.raises(ExporterConfigError) as info:
        settings_from_env(env)
    assert isinstance(info.value, ValueError)
    assert info.value.variable == variable
    message = str(info.value)
    assert message.startswith(variable + ":"), message
    assert fragment in message, message


def test_bad_overrides_name_the_override() -> None:
    with pytest.raises(ExporterConfigError, match="override 'timeout_s'"):
        settings_from_env({}, {"endpoint": "http://h", "timeout_s": "soon"})
    with pytest.raises(ExporterConfigError, match="override 'endpoint'"):
        settings_from_env({}, {"endpoint": "nope://h"})
    with pytest.raises(ExporterConfigError, match="override 'colour'"):
        settings_from_env({}, {"colour": "blue"})


def test_parse_headers_direct() -> None:
    assert parse_headers("", "V") == {}
    assert parse_headers("k=a=b", "V") == {"k": "a=b"}  # only the first '=' splits
    assert parse_headers("X-Key=%E2%9C%93", "V") == {"X-Key": "\u2713"}
    with pytest.raises(ExporterConfigError, match=r"^V: invalid header name 'k x'"):
        parse_headers("k%20x=1", "V")
