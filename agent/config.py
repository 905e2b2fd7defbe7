"""One source of truth for settings: every option is declared once, as a field of `Settings`
whose metadata carries its flag's type, its help and its environment-variable twin; the flag
(--key-with-dashes) and the config-file key (the field name) follow from the field's name.
OPTIONS, the click options and the config-file validation are all read from those fields.

Precedence, all of it here: flags > environment > config file > defaults. Click applies that
order itself (the file is its default_map); `Settings.from_click` adds the one rule click
cannot know (a config-file value yields to the OpenTelemetry signal-specific variable).
Errors name the flag, variable or key they came from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import click
import yaml
from click.core import ParameterSource
from tracejoin.host.scheduling import MAX_SLICE_MS
from tracejoin.kernel.compiled import DEFAULT_CACHE_DIR

T = TypeVar("T")
ENV = "TRACEJOIN_"
BOTH = ("capture", "run")


@dataclass(frozen=True)
class Opt:
    """One option as the command line, the environment and the config file see it."""

    key: str  # config-file key and the Settings field (dashes -> underscores)
    type: Any  # the click type values are converted with (bool: a --x/--no-x flag pair)
    default: Any
    help: str
    envvar: str
    multiple: bool = False
    commands: tuple[str, ...] = BOTH
    # A variable that, when set, outranks this option's config-file value (but not its flag).
    file_yields_to: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def option(
    default: T,
    type: Any,
    help: str,
    envvar: str,
    *,
    multiple: bool = False,
    commands: tuple[str, ...] = BOTH,
    file_yields_to: str | None = None,
) -> T:
    """A Settings field together with everything its flag, variable and config key need."""
    spec = {
        "type": type,
        "help": help,
        "envvar": envvar,
        "multiple": multiple,
        "commands": commands,
        "file_yields_to": file_yields_to,
    }
    return field(default=default, metadata={"option": spec})


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


@dataclass(frozen=True)
class Settings:
    """Every option of `capture` and `run`, with its default, flag type, help and variable."""

    pid: tuple[int, ...] = option(
        (),
        int,
        "Only requests served by this process id (repeatable).",
        ENV + "PIDS",
        multiple=True,
    )
    port: tuple[int, ...] = option(
        (),
        click.IntRange(1, 65535),
        "Only requests on this local TCP port (repeatable).",
        ENV + "PORTS",
        multiple=True,
    )
    comm: str | None = option(
        None,
        str,
        "Only requests served by processes with this name (comm, 15 chars).",
        ENV + "COMM",
    )
    service_name: str | None = option(
        None,
        str,
        "service.name for all spans (default: the process name).",
        "OTEL_SERVICE_NAME",
    )
    read_environ: bool = option(
        False,
        bool,
        "Read OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (only those) from each served "
        "process's /proc/<pid>/environ to name its spans (needs CAP_SYS_PTRACE for another "
        "user's process).",
        ENV + "READ_ENVIRON",
    )
    instrumented: str = option(
        "auto",
        click.Choice(["auto", "yes", "no"]),
        "Served processes that make their own SERVER spans get tracejoin's as an INTERNAL "
        "'<name> (kernel)' span: auto (a published process context, or a connection to an "
        "OTLP port), or yes/no for every process.",
        ENV + "INSTRUMENTED",
    )
    instrumented_services: tuple[str, ...] = option(
        (),
        str,
        "Per service.name, overrides --instrumented: name=yes or name=no (repeatable, or "
        "comma-separated).",
        ENV + "INSTRUMENTED_SERVICES",
        multiple=True,
    )
    otlp_ports: tuple[int, ...] = option(
        (4317, 4318),
        click.IntRange(1, 65535),
        "TCP ports of OTLP receivers: a served process connected to one is taken as "
        "instrumented (--instrumented auto) (repeatable).",
        ENV + "OTLP_PORTS",
        multiple=True,
    )
    # The file's value is passed to the exporter as an override, which would outrank every
    # OTEL_* variable: it yields to the traces-specific one so that environment > file holds.
    otlp_endpoint: str | None = option(
        None,
        str,
        "Also send spans to this OTLP endpoint (e.g. http://jaeger:4317).",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        file_yields_to="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    )
    otlp_protocol: str | None = option(
        None,
        click.Choice(["grpc", "http/protobuf"]),
        "OTLP transport (default http/protobuf, the OTLP spec's default: posts to "
        "<endpoint>/v1/traces; grpc for port 4317).",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        file_yields_to="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    )
    no_parent: str = option(
        "root",
        click.Choice(["root", "skip"]),
        "Requests without a valid traceparent: start a new trace (root) or emit nothing.",
        ENV + "NO_PARENT",
    )
    unsampled: str = option(
        "follow",
        click.Choice(["follow", "record"]),
        "Requests whose caller did not sample (flags & 1 == 0): follow it (no span) or record.",
        ENV + "UNSAMPLED",
    )
    runq_threshold_ms: float = option(
        1.0,
        click.FloatRange(0.01, 10_000),
        "Run-queue waits at least this long become child spans.",
        ENV + "RUNQ_THRESHOLD_MS",
    )
    recvq_threshold_ms: float = option(
        1.0,
        click.FloatRange(0.0, 10_000),
        "A TCP receive-queue wait at least this long also becomes a child span (the wait is "
        "always an attribute of the server span).",
        ENV + "RECVQ_THRESHOLD_MS",
    )
    cpu_budget: float = option(
        0.5,
        click.FloatRange(0.0, 64.0),
        "Share of one CPU the agent may use; above it, it samples requests out in the kernel "
        "by trace id (as TraceIdRatioBased: agents keep the same traces), counted apart from "
        "losses. 0: never.",
        ENV + "CPU_BUDGET",
    )
    cpu_slice_ms: float | None = option(
        None,
        click.FloatRange(0.0, MAX_SLICE_MS),
        "The CPU time slice, in ms, the agent's threads ask the scheduler for (Linux 6.12+; "
        "0.1-100). Longer than the kernel's default, a workload thread that wakes on the "
        "agent's CPU runs at once instead of after the agent's slice; the agent's share of a "
        "busy CPU is unchanged, in turns as long as the slice. Default: twice the kernel's "
        "default slice; 0: the kernel's default. Older kernels ignore it.",
        ENV + "CPU_SLICE_MS",
    )
    bpf_cache: str = option(
        str(DEFAULT_CACHE_DIR),
        str,
        "Directory (root's, not writable by others) where the compiled probes are kept: a "
        "later start on the same kernel loads them instead of compiling (seconds, and the "
        "compiler's memory). Empty: compile at every start.",
        ENV + "BPF_CACHE",
    )
    tlb: str = option(
        "auto",
        click.Choice(["auto", "hardware", "flush"]),
        "TLB signal: hardware dTLB/iTLB misses when the PMU opens (auto), or force one.",
        ENV + "TLB",
    )
    cuda: bool = option(
        False,
        bool,
        "Uprobes on the CUDA runtime and driver libraries processes map: copies, "
        "synchronisations, graph launches and allocations on each request's span (needs the "
        "work set).",
        ENV + "CUDA",
    )
    cuda_launches: bool = option(
        False,
        bool,
        "With --cuda, also count kernel launches (cudaLaunchKernel, cuLaunchKernel*): a uprobe "
        "pair on the launch path costs microseconds per launch.",
        ENV + "CUDA_LAUNCHES",
    )
    cuda_sync_threshold_ms: float = option(
        1.0,
        click.FloatRange(0.01, 60_000),
        "With --cuda, synchronisations at least this long become child spans.",
        ENV + "CUDA_SYNC_THRESHOLD_MS",
    )
    http2_before_ready: bool = option(
        False,
        bool,
        "Report ready only once the HTTP/2 programs are verified too (~0.1-0.25 s more). By "
        "default ready comes when HTTP/1.x is traced and HTTP/2 follows when its programs "
        "load (log 'http2 on', metric tracejoin_probe_mode{signal=\"http2\"}); a connection "
        "that turns HTTP/2 before then is counted (tracejoin_kernel_h2_not_loaded_total), not "
        "traced.",
        ENV + "HTTP2_BEFORE_READY",
        commands=("run",),
    )
    disable_tracepoint: tuple[str, ...] = option(
        (),
        str,
        "Treat this optional tracepoint as absent, e.g. sched:sched_switch (repeatable).",
        ENV + "DISABLE_TRACEPOINTS",
        multiple=True,
    )
    gpu: bool = option(
        True, bool, "Join NVML GPU samples to spans when NVML is present.", ENV + "GPU"
    )
    gpu_sample_hz: float = option(
        4.0, click.FloatRange(0.1, 50), "GPU sampling rate.", ENV + "GPU_SAMPLE_HZ"
    )
    queue_size: int = option(
        20_000,
        click.IntRange(64, 10_000_000),
        "Spans held for export per destination; beyond it spans are dropped and counted.",
        ENV + "QUEUE_SIZE",
    )
    export_interval: float = option(
        2.0,
        click.FloatRange(0.1, 60),
        "Seconds between OTLP sends: each send takes what is queued (a send goes sooner once "
        "2,048 spans wait). Longer: fewer, larger requests and less agent CPU per span; spans "
        "reach the backend up to this much later.",
        ENV + "EXPORT_INTERVAL",
    )
    duration: float | None = option(
        None,
        click.FloatRange(0.1, None),
        "Seconds to capture (default: until Ctrl-C).",
        ENV + "DURATION",
        commands=("capture",),
    )
    output_dir: Path = option(
        Path("tracejoin-capture"),
        click.Path(file_okay=False, path_type=Path),
        "Directory for the capture's files.",
        ENV + "OUTPUT_DIR",
        commands=("capture",),
    )
    metrics_port: int = option(
        9464,
        click.IntRange(0, 65535),
        "Port for /healthz, /readyz and /metrics (0: off).",
        ENV + "METRICS_PORT",
        commands=("run",),
    )
    metrics_address: str = option(
        "127.0.0.1",
        str,
        "Address(es) the metrics server binds, comma-separated (the DaemonSet: pod IP, loopback).",
        ENV + "METRICS_ADDRESS",
        commands=("run",),
    )
    shutdown_timeout: float = option(
        5.0,
        click.FloatRange(0.5, 60),
        "Seconds from SIGTERM to exit: probes detach first, spans flush in what is left; the "
        "process is gone at most 1 s after this, whatever a destination does.",
        ENV + "SHUTDOWN_TIMEOUT",
        commands=("run",),
    )
    node_name: str | None = option(
        None,
        str,
        "Kubernetes node name for k8s.node.name (the downward API's spec.nodeName).",
        "NODE_NAME",
        commands=("run",),
    )
    kubelet_url: str | None = option(
        None,
        HttpUrl(),
        "Read pod names, namespaces, container names and workloads from this kubelet pod "
        "list, e.g. https://${NODE_NAME}:10250/pods ($NODE_NAME is the node name). "
        "Unset: only what the cgroup path gives (container.id, k8s.pod.uid).",
        ENV + "KUBELET_URL",
        commands=("run",),
    )
    kubelet_token_file: Path | None = option(
        Path("/var/run/secrets/kubernetes.io/serviceaccount/token"),
        click.Path(dir_okay=False, path_type=Path),
        "Bearer token for the kubelet (read at each request; sent over https only).",
        ENV + "KUBELET_TOKEN_FILE",
        commands=("run",),
    )
    kubelet_ca_file: Path | None = option(
        None,
        click.Path(exists=True, dir_okay=False, path_type=Path),
        "CA bundle that signed the kubelet's serving certificate (default: the service "
        "account's ca.crt when present, else the system CAs).",
        ENV + "KUBELET_CA_FILE",
        commands=("run",),
    )
    kubelet_insecure_tls: bool = option(
        False,
        bool,
        "Do not verify the kubelet's serving certificate (for self-signed kubelet certs).",
        ENV + "KUBELET_INSECURE_TLS",
        commands=("run",),
    )

    @classmethod
    def from_click(
        cls,
        ctx: click.Context,
        params: Mapping[str, Any],
        environ: Mapping[str, str] = os.environ,
    ) -> Settings:
        """The settings a command was invoked with. Click has already applied flags >
        environment > config file > defaults; what remains is `file_yields_to`: a value that
        came from the config file is dropped when the variable that outranks it is set."""
        values = {k: v for k, v in params.items() if k in BY_KEY}
        for key in values:
            opt = BY_KEY[key]
            if (
                opt.file_yields_to
                and ctx.get_parameter_source(key) is ParameterSource.DEFAULT_MAP
                and environ.get(opt.file_yields_to, "").strip()
            ):
                values[key] = opt.default
        return cls(**values)


OPTIONS: tuple[Opt, ...] = tuple(
    Opt(key=f.name, default=f.default, **f.metadata["option"]) for f in fields(Settings)
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


def config_file_option(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--config / TRACEJOIN_CONFIG: a YAML file of `command`'s settings. It is read first
    (is_eager) into click's default_map, which click ranks below flags and the environment and
    above the defaults."""

    def load(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
        if value:
            ctx.default_map = load_file(Path(value), command)
        return value

    return click.option(
        "--config",
        "config_file",
        cls=SourcedOption,
        type=click.Path(exists=True, dir_okay=False),
        callback=load,
        is_eager=True,
        expose_value=False,
        envvar=ENV + "CONFIG",
        help="YAML file of settings (keys as the flags, with underscores). "
        f"Flags > environment > file > defaults. [env: {ENV}CONFIG]",
    )
