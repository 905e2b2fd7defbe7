"""One source of truth for settings: every option is declared once here, with its flag, its
environment-variable twin, its config-file key and its help. Precedence is
flags > environment > config file > defaults (click's own order, with the file as default_map).
Errors name the flag, variable or key they came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import yaml
from click.core import ParameterSource


@dataclass(frozen=True)
class Opt:
    key: str  # config-file key and the Python name (dashes -> underscores)
    type: Any
    default: Any
    help: str
    envvar: str | None = None
    multiple: bool = False
    commands: tuple[str, ...] = ("capture", "run")

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


class HttpUrl(click.ParamType):
    """An http:// or https:// URL with a host (kept as the string given)."""

    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from urllib.parse import urlsplit

        text = str(value).strip()
        try:
            parts = urlsplit(text)
            _ = parts.port  # ValueError for a bad port
        except ValueError as exc:
            self.fail(f"{text!r} is not a URL: {exc}", param, ctx)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            self.fail(f"{text!r} is not an http:// or https:// URL with a host", param, ctx)
        return text


ENV = "TRACEJOIN_"
OPTIONS: tuple[Opt, ...] = (
    Opt(
        "pid",
        int,
        (),
        "Only requests served by this process id (repeatable).",
        ENV + "PIDS",
        multiple=True,
    ),
    Opt(
        "port",
        click.IntRange(1, 65535),
        (),
        "Only requests on this local TCP port (repeatable).",
        ENV + "PORTS",
        multiple=True,
    ),
    Opt(
        "comm",
        str,
        None,
        "Only requests served by processes with this name (comm, 15 chars).",
        ENV + "COMM",
    ),
    Opt(
        "service_name",
        str,
        None,
        "service.name for all spans (default: the process name).",
        "OTEL_SERVICE_NAME",
    ),
    Opt(
        "otlp_endpoint",
        str,
        None,
        "Also send spans to this OTLP endpoint (e.g. http://jaeger:4317).",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ),
    Opt(
        "otlp_protocol",
        click.Choice(["grpc", "http/protobuf"]),
        None,
        "OTLP transport (default http/protobuf, the OTLP spec's default: posts to "
        "<endpoint>/v1/traces; grpc for port 4317).",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ),
    Opt(
        "no_parent",
        click.Choice(["root", "skip"]),
        "root",
        "Requests without a valid traceparent: start a new trace (root) or emit nothing.",
        ENV + "NO_PARENT",
    ),
    Opt(
        "unsampled",
        click.Choice(["follow", "record"]),
        "follow",
        "Requests whose caller did not sample (flags & 1 == 0): follow it (no span) or record.",
        ENV + "UNSAMPLED",
    ),
    Opt(
        "runq_threshold_ms",
        click.FloatRange(0.01, 10_000),
        1.0,
        "Run-queue waits at least this long become child spans.",
        ENV + "RUNQ_THRESHOLD_MS",
    ),
    Opt(
        "tlb",
        click.Choice(["auto", "hardware", "flush"]),
        "auto",
        "TLB signal: hardware dTLB/iTLB misses when the PMU opens (auto), or force one.",
        ENV + "TLB",
    ),
    Opt(
        "disable_tracepoint",
        str,
        (),
        "Treat this optional tracepoint as absent, e.g. sched:sched_switch (repeatable).",
        ENV + "DISABLE_TRACEPOINTS",
        multiple=True,
    ),
    Opt("gpu", bool, True, "Join NVML GPU samples to spans when NVML is present.", ENV + "GPU"),
    Opt(
        "gpu_sample_hz", click.FloatRange(0.1, 50), 4.0, "GPU sampling rate.", ENV + "GPU_SAMPLE_HZ"
    ),
    Opt(
        "queue_size",
        click.IntRange(64, 10_000_000),
        20_000,
        "Spans held for export per destination; beyond it spans are dropped and counted.",
        ENV + "QUEUE_SIZE",
    ),
    Opt(
        "duration",
        click.FloatRange(0.1, None),
        None,
        "Seconds to capture (default: until Ctrl-C).",
        ENV + "DURATION",
        commands=("capture",),
    ),
    Opt(
        "output_dir",
        click.Path(file_okay=False, path_type=Path),
        Path("tracejoin-capture"),
        "Directory for the capture's files.",
        ENV + "OUTPUT_DIR",
        commands=("capture",),
    ),
    Opt(
        "metrics_port",
        click.IntRange(0, 65535),
        9464,
        "Port for /healthz, /readyz and /metrics (0: off).",
        ENV + "METRICS_PORT",
        commands=("run",),
    ),
    Opt(
        "metrics_address",
        str,
        "127.0.0.1",
        "Address(es) the metrics server binds, comma-separated (the DaemonSet: pod IP, loopback).",
        ENV + "METRICS_ADDRESS",
        commands=("run",),
    ),
    Opt(
        "shutdown_timeout",
        click.FloatRange(0.5, 60),
        5.0,
        "Seconds from SIGTERM to exit: probes detach first, spans flush in what is left; the "
        "process is gone at most 1 s after this, whatever a destination does.",
        ENV + "SHUTDOWN_TIMEOUT",
        commands=("run",),
    ),
    Opt(
        "node_name",
        str,
        None,
        "Kubernetes node name for k8s.node.name (the downward API's spec.nodeName).",
        "NODE_NAME",
        commands=("run",),
    ),
    Opt(
        "kubelet_url",
        HttpUrl(),
        None,
        "Read pod names, namespaces, container names and workloads from this kubelet pod "
        "list, e.g. https://${NODE_NAME}:10250/pods ($NODE_NAME is the node name). "
        "Unset: only what the cgroup path gives (container.id, k8s.pod.uid).",
        ENV + "KUBELET_URL",
        commands=("run",),
    ),
    Opt(
        "kubelet_token_file",
        click.Path(dir_okay=False, path_type=Path),
        Path("/var/run/secrets/kubernetes.io/serviceaccount/token"),
        "Bearer token for the kubelet (read at each request; sent over https only).",
        ENV + "KUBELET_TOKEN_FILE",
        commands=("run",),
    ),
    Opt(
        "kubelet_ca_file",
        click.Path(exists=True, dir_okay=False, path_type=Path),
        None,
        "CA bundle that signed the kubelet's serving certificate (default: the service "
        "account's ca.crt when present, else the system CAs).",
        ENV + "KUBELET_CA_FILE",
        commands=("run",),
    ),
    Opt(
        "kubelet_insecure_tls",
        bool,
        False,
        "Do not verify the kubelet's serving certificate (for self-signed kubelet certs).",
        ENV + "KUBELET_INSECURE_TLS",
        commands=("run",),
    ),
)
BY_KEY = {o.key: o for o in OPTIONS}


class ConfigError(click.UsageError):
    pass


def load_file(path: Path, command: str) -> dict[str, Any]:
    """Read a YAML config file into click's default_map, validating every key and value."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of settings")
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        opt = BY_KEY.get(key)
        if opt is None or command not in opt.commands:
            known = ", ".join(o.key for o in OPTIONS if command in o.commands)
            raise ConfigError(f"config file {path}: unknown key '{raw_key}' (known: {known})")
        if value is None:
            continue  # `key:` with no value (or a template's null) leaves the setting unset
        param_type = click.types.convert_type(opt.type)
        try:
            if opt.multiple:
                values = value if isinstance(value, list) else [value]
                out[key] = tuple(param_type.convert(v, None, None) for v in values)
            else:
                out[key] = param_type.convert(value, None, None)
        except click.BadParameter as exc:
            raise ConfigError(f"config file {path}: key '{raw_key}': {exc.message}") from exc
    return out


class SourcedOption(click.Option):
    """An option whose errors also say where a bad value came from: the environment variable
    or the config-file key (the flag alone would send the reader to the command line)."""

    def get_error_hint(self, ctx: click.Context | None) -> str:
        hint = super().get_error_hint(ctx)
        if ctx is None or self.name is None:
            return hint
        source = ctx.get_parameter_source(self.name)
        if source is ParameterSource.ENVIRONMENT and isinstance(self.envvar, str):
            return f"{hint} (from environment variable {self.envvar})"
        if source is ParameterSource.DEFAULT_MAP:
            return f"{hint} (from config file key '{self.name}')"
        return hint


def apply_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a click command with every option that applies to it."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for opt in reversed([o for o in OPTIONS if command in o.commands]):
            env = f" [env: {opt.envvar}]" if opt.envvar else ""
            if opt.type is bool:
                fn = click.option(
                    f"{opt.flag}/--no-{opt.flag[2:]}",
                    opt.key,
                    cls=SourcedOption,
                    default=opt.default,
                    envvar=opt.envvar,
                    show_default=True,
                    help=opt.help + env,
                )(fn)
            else:
                fn = click.option(
                    opt.flag,
                    opt.key,
                    cls=SourcedOption,
                    type=opt.type,
                    default=opt.default,
                    envvar=opt.envvar,
                    multiple=opt.multiple,
                    show_default=opt.default not in (None, ()),
                    help=opt.help + env,
                )(fn)
        return fn

    return deco


@dataclass(frozen=True)
class Settings:
    pid: tuple[int, ...] = ()
    port: tuple[int, ...] = ()
    comm: str | None = None
    service_name: str | None = None
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    no_parent: str = "root"
    unsampled: str = "follow"
    runq_threshold_ms: float = 1.0
    tlb: str = "auto"
    disable_tracepoint: tuple[str, ...] = ()
    gpu: bool = True
    gpu_sample_hz: float = 4.0
    queue_size: int = 20_000
    duration: float | None = None
    output_dir: Path = Path("tracejoin-capture")
    metrics_port: int = 9464
    metrics_address: str = "127.0.0.1"
    shutdown_timeout: float = 5.0
    node_name: str | None = None
    kubelet_url: str | None = None
    kubelet_token_file: Path | None = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    kubelet_ca_file: Path | None = None
    kubelet_insecure_tls: bool = False

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Settings:
        known = {k: v for k, v in params.items() if k in BY_KEY}
        return cls(**known)
