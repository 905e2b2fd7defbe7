"""`tracejoin run` settings: flags > environment > config file > defaults, the standard OTEL_*
variables, and errors that name the key, variable or flag at fault.

The real `run` command is invoked (click's CliRunner) with `run_daemon` replaced by a stub that
records the Settings it would have run with: nothing is loaded into the kernel.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import tracejoin.commands.run
from click.testing import CliRunner, Result
from tracejoin import app
from tracejoin.commands import cli
from tracejoin.config import BY_KEY, OPTIONS, ConfigError, Settings
from tracejoin.core.metrics import Metrics

# Every variable that could leak in from the environment running the tests.
_ENV_NAMES = sorted(
    {o.envvar for o in OPTIONS if o.envvar}
    | {
        "TRACEJOIN_CONFIG",
        "TRACEJOIN_SPANS_FILE",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_EXPORTER",
    }
)


class Captured(Exception):
    def __init__(self, settings: Settings) -> None:
        super().__init__("captured")
        self.settings = settings


@pytest.fixture(autouse=True)
def stub_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run_daemon(s: Settings, _spans_file: Any) -> int:
        raise Captured(s)

    monkeypatch.setattr(tracejoin.commands.run, "run_daemon", fake_run_daemon)
    monkeypatch.setattr(cli, "_require_root", lambda: None)
    for name in _ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def invoke(args: list[str], env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli.main, ["run", *args], env=env)


def settings(args: list[str], env: dict[str, str] | None = None) -> Settings:
    result = invoke(args, env)
    assert isinstance(result.exception, Captured), (result.exit_code, result.output)
    return result.exception.settings


def failure(args: list[str], env: dict[str, str] | None = None) -> str:
    result = invoke(args, env)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    return result.output


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_declared_ones() -> None:
    s = settings([])
    assert s == Settings()
    for opt in OPTIONS:
        if "run" in opt.commands:
            assert getattr(s, opt.key) == opt.default, opt.key


def test_every_option_has_one_flag_one_variable_and_one_field() -> None:
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    flags = [o.flag for o in OPTIONS]
    variables = [o.envvar for o in OPTIONS]
    assert len(set(flags)) == len(flags) and len(set(variables)) == len(variables)
    for opt in OPTIONS:
        assert opt.envvar, f"{opt.key} has no environment variable"
        assert opt.key in fields, f"{opt.key} is not a Settings field"
        assert fields[opt.key].default == opt.default, opt.key


# (key, file value, env var, env value, flag args, Settings value from file, env, flag)
PRECEDENCE = [
    ("queue_size", "100", "TRACEJOIN_QUEUE_SIZE", "200", ["--queue-size", "300"], 100, 200, 300),
    ("no_parent", "skip", "TRACEJOIN_NO_PARENT", "root", ["--no-parent", "skip"],
     "skip", "root", "skip"),
    ("tlb", "hardware", "TRACEJOIN_TLB", "flush", ["--tlb", "hardware"],
     "hardware", "flush", "hardware"),
    ("port", "[8080, 8081]", "TRACEJOIN_PORTS", "9090 9091", ["--port", "7070"],
     (8080, 8081), (9090, 9091), (7070,)),
    ("gpu", "false", "TRACEJOIN_GPU", "true", ["--no-gpu"], False, True, False),
    ("shutdown_timeout", "2.5", "TRACEJOIN_SHUTDOWN_TIMEOUT", "7", ["--shutdown-timeout", "9"],
     2.5, 7.0, 9.0),
    ("service_name", "from-file", "OTEL_SERVICE_NAME", "from-env", ["--service-name", "from-flag"],
     "from-file", "from-env", "from-flag"),
    ("otlp_protocol", "grpc", "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf",
     ["--otlp-protocol", "grpc"], "grpc", "http/protobuf", "grpc"),
    ("node_name", "n-file", "NODE_NAME", "n-env", ["--node-name", "n-flag"],
     "n-file", "n-env", "n-flag"),
    ("kubelet_url", "https://file:10250/pods", "TRACEJOIN_KUBELET_URL", "https://env:10250/pods",
     ["--kubelet-url", "https://flag:10250/pods"],
     "https://file:10250/pods", "https://env:10250/pods", "https://flag:10250/pods"),
    ("metrics_port", "1111", "TRACEJOIN_METRICS_PORT", "2222", ["--metrics-port", "3333"],
     1111, 2222, 3333),
]  # fmt: skip


@pytest.mark.parametrize(
    ("key", "file_value", "var", "env_value", "flag", "want_file", "want_env", "want_flag"),
    PRECEDENCE,
    ids=[p[0] for p in PRECEDENCE],
)
def test_flags_beat_environment_beat_file_beat_defaults(
    tmp_path: Path,
    key: str,
    file_value: str,
    var: str,
    env_value: str,
    flag: list[str],
    want_file: Any,
    want_env: Any,
    want_flag: Any,
) -> None:
    cfg = write(tmp_path, f"{key}: {file_value}\n")
    default = BY_KEY[key].default
    # each layer differs from the one below it, so every step of the order is visible
    assert want_file != default and want_env != want_file and want_flag != want_env
    assert getattr(settings([]), key) == default
    assert getattr(settings(["--config", str(cfg)]), key) == want_file
    assert getattr(settings(["--config", str(cfg)], {var: env_value}), key) == want_env
    assert getattr(settings(["--config", str(cfg), *flag], {var: env_value}), key) == want_flag
    # the config file can come from the environment too
    assert getattr(settings([], {"TRACEJOIN_CONFIG": str(cfg)}), key) == want_file


def test_layers_combine_key_by_key(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        "queue_size: 100\ncomm: nginx\nmetrics-port: 1111\nport: 8080\n"
        "runq_threshold_ms: 3\ndisable_tracepoint: [sched:sched_switch]\n",
    )
    s = settings(
        ["--config", str(cfg), "--queue-size", "300"],
        {"TRACEJOIN_METRICS_PORT": "2222", "TRACEJOIN_QUEUE_SIZE": "200"},
    )
    assert (s.queue_size, s.metrics_port, s.comm, s.port) == (300, 2222, "nginx", (8080,))
    assert s.runq_threshold_ms == 3.0 and s.disable_tracepoint == ("sched:sched_switch",)
    assert s.shutdown_timeout == 5.0  # untouched: the default


def test_a_null_value_in_the_file_leaves_the_default(tmp_path: Path) -> None:
    cfg = write(tmp_path, "comm:\nqueue_size: null\nservice_name: ~\n")
    s = settings(["--config", str(cfg)])
    assert (s.comm, s.queue_size, s.service_name) == (None, 20_000, None)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("queue_sise: 5\n", ["unknown key 'queue_sise'", "queue_size"]),
        ("duration: 5\n", ["unknown key 'duration'"]),  # a capture-only setting
        ("queue_size: 5\n", ["key 'queue_size'", "64<=x<=10000000"]),
        ("queue_size: lots\n", ["key 'queue_size'", "'lots'"]),
        ("no_parent: maybe\n", ["key 'no_parent'", "'root'", "'skip'"]),
        ("port: [80, 70000]\n", ["key 'port'", "70000"]),
        ("gpu: perhaps\n", ["key 'gpu'", "perhaps"]),
        ("shutdown_timeout: 0.1\n", ["key 'shutdown_timeout'", "0.5<=x<=60"]),
        ("kubelet_url: ftp://node:10250/pods\n", ["key 'kubelet_url'", "http:// or https://"]),
        ("kubelet_url: https://node:99999/pods\n", ["key 'kubelet_url'", "not a URL"]),
        ("kubelet_ca_file: /nonexistent/ca.crt\n", ["key 'kubelet_ca_file'", "does not exist"]),
        ("otlp_protocol: http/json\n", ["key 'otlp_protocol'", "grpc"]),
        ("- a\n- list\n", ["expected a mapping"]),
        ("queue_size: [1\n", ["config file"]),
    ],
)
def test_bad_file_values_name_the_key(tmp_path: Path, text: str, fragments: list[str]) -> None:
    cfg = write(tmp_path, text)
    out = failure(["--config", str(cfg)])
    assert str(cfg) in out
    for fragment in fragments:
        assert fragment in out, out


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        ({"TRACEJOIN_QUEUE_SIZE": "abc"}, ["'--queue-size'", "TRACEJOIN_QUEUE_SIZE", "'abc'"]),
        ({"TRACEJOIN_PORTS": "80 http"}, ["'--port'", "TRACEJOIN_PORTS", "'http'"]),
        ({"TRACEJOIN_GPU": "maybe"}, ["'--gpu'", "TRACEJOIN_GPU"]),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"},
         ["'--otlp-protocol'", "OTEL_EXPORTER_OTLP_PROTOCOL"]),
        ({"TRACEJOIN_KUBELET_URL": "node:10250"}, ["'--kubelet-url'", "TRACEJOIN_KUBELET_URL"]),
        ({"TRACEJOIN_CONFIG": "/nonexistent.yaml"}, ["TRACEJOIN_CONFIG", "does not exist"]),
    ],
)  # fmt: skip
def test_bad_environment_values_name_the_variable(
    env: dict[str, str], fragments: list[str]
) -> None:
    out = failure([], env)
    for fragment in fragments:
        assert fragment in out, out


def test_bad_flags_name_the_flag_only(tmp_path: Path) -> None:
    out = failure(["--queue-size", "abc"])
    assert "'--queue-size'" in out and "environment" not in out and "config file" not in out
    out = failure(["--metrics-port", "-1"])
    assert "'--metrics-port'" in out


def test_traces_specific_otel_variables_beat_the_file(tmp_path: Path) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (environment) outranks otlp_endpoint in the file,
    while the --otlp-endpoint flag outranks both."""
    cfg = write(tmp_path, "otlp_endpoint: http://from-file:4318\n")
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://from-env:9999/custom"}

    def effective_url(s: Settings) -> str:
        dest = app.otlp_destination(s, Metrics())
        assert dest is not None
        try:
            return str(dest.exporter.url)
        finally:
            dest.shutdown(0.1)

    assert effective_url(settings(["--config", str(cfg)])) == "http://from-file:4318/v1/traces"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert effective_url(settings(["--config", str(cfg)], env)) == "http://from-env:9999/custom"
        flagged = settings(["--config", str(cfg), "--otlp-endpoint", "http://flag:4318"], env)
        assert effective_url(flagged) == "http://flag:4318/v1/traces"


@pytest.mark.parametrize(
    ("key", "file_value", "variable", "flag"),
    [
        ("otlp_endpoint", "http://from-file:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
         ["--otlp-endpoint", "http://flag:4318"]),
        ("otlp_protocol", "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
         ["--otlp-protocol", "grpc"]),
    ],
)  # fmt: skip
def test_a_file_value_yields_to_the_traces_specific_variable_only(
    tmp_path: Path, key: str, file_value: str, variable: str, flag: list[str]
) -> None:
    """The exporter reads the OTEL_* variables itself, so the setting is left unset for it;
    a flag still wins, and a blank variable does not count."""
    cfg = write(tmp_path, f"{key}: {file_value}\n")
    assert getattr(settings(["--config", str(cfg)]), key) == file_value
    assert getattr(settings(["--config", str(cfg)], {variable: "grpc"}), key) is None
    assert getattr(settings(["--config", str(cfg)], {variable: " "}), key) == file_value
    assert getattr(settings(["--config", str(cfg), *flag], {variable: "grpc"}), key) == flag[1]
    assert BY_KEY[key].file_yields_to == variable


def test_standard_otel_variables() -> None:
    s = settings(
        [],
        {
            "OTEL_SERVICE_NAME": "checkout",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        },
    )
    assert (s.service_name, s.otlp_endpoint, s.otlp_protocol) == (
        "checkout",
        "http://collector:4317",
        "grpc",
    )


def test_resource_attributes_and_kubelet_url_are_checked_before_the_probes_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """build_agent refuses bad values naming their key; nothing has been compiled yet."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "oops")
    with pytest.raises(ConfigError, match="OTEL_RESOURCE_ATTRIBUTES: expected key=value"):
        app.build_agent(Settings(gpu=False), Metrics(), [])
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k8s.cluster.name=prod")
    with pytest.raises(ConfigError, match=r"kubelet_url \(--kubelet-url\).*NODE_NAME"):
        app.build_agent(
            Settings(gpu=False, kubelet_url="https://${NODE_NAME}:10250/pods"), Metrics(), []
        )
    with pytest.raises(ConfigError, match="--disable-tracepoint: sched:nope is not an optional"):
        app.build_agent(Settings(gpu=False, disable_tracepoint=("sched:nope",)), Metrics(), [])
