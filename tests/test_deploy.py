"""Deployment artefacts: the Helm chart and the plain manifests in deploy/.

Both are rendered (the chart by a real `helm template`, with default values and with
overrides), validated offline against the Kubernetes API types by tools/k8sschema (strict
decoding into k8s.io/api structs: unknown fields, unknown kinds and broken references are
errors), and then held to the documented security posture on the parsed objects: not
privileged, capabilities exactly the documented set (two required, two opt-in), the Localhost
seccomp profile and its installer, read-only root and host mounts, host PID namespace, GPU node
selection, probes on the metrics port bound to the pod IP, the NetworkPolicy, resources, and a
config.yaml that tracejoin.config itself accepts for `tracejoin run`.

The seccomp profile itself (deploy/seccomp/tracejoin.json) is checked for its shape, for being
what tools/seccomp generates, and, as root, by running the agent under it (tests/seccomp_exec.py
loads it with libseccomp): the probes load and capture spans, ptrace(2) and
open_by_handle_at(2) are refused even with the capabilities that would allow them.

helm and the validator are Go programs built from tools/helm and tools/k8sschema and cached in
/var/cache/tracejoin (TRACEJOIN_CACHE): the first run builds helm from source (a few minutes);
later runs reuse the binaries. Without Go (and without cached binaries) the tests skip, saying so.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hostile import Conn, get_bytes, new_sent, parse_prometheus
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from tracejoin.config import ConfigError, Settings, load_file

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "tracejoin"
MANIFESTS = REPO / "deploy" / "kubernetes"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
SECCOMP_PROFILE = REPO / "deploy" / "seccomp" / "tracejoin.json"
SECCOMP_COPIES = (
    CHART / "files" / "seccomp.json",  # a chart cannot read files outside itself
)
SECCOMP_CONFIGMAP = MANIFESTS / "25-seccomp-profile.yaml"
SECCOMP_EXEC = REPO / "tests" / "seccomp_exec.py"
OPERATIONS_DOC = REPO / "docs" / "operations.md"
NAMESPACE = "tracejoin"

# Building helm from source on a 2-core machine takes minutes the first time.
pytestmark = pytest.mark.timeout(1800)

# The documented posture (docs/operations.md, "Privileges"). A change here is a change to the
# agent's privileges: update the manifests, the chart, and the doc's reasons with it.
CAPABILITIES = frozenset({"BPF", "PERFMON"})  # always
OPTIONAL_CAPABILITIES = frozenset({"SYS_PTRACE", "DAC_READ_SEARCH"})  # opt-in, off by default
HOST_PATHS = frozenset({"/sys/kernel/tracing", "/lib/modules", "/usr/src"})  # read-only
# The one host directory the agent writes: its compiled probes, kept for the next start
# (--bpf-cache; agent/kernel/compiled.py). Everything else of the host it only reads.
BPF_CACHE_HOST_DIR = "/var/cache/tracejoin"
# The one host directory written, by the seccomp installer (init container) only.
SECCOMP_HOST_DIR = "/var/lib/kubelet/seccomp/tracejoin"
LOCALHOST_PROFILE = "tracejoin/tracejoin.json"  # relative to <kubelet root dir>/seccomp
# The seccomp profile: refused whatever the capabilities; allowed whatever the runtime.
SECCOMP_DENIED = frozenset(
    {
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        "open_by_handle_at",
        "kcmp",
        "pidfd_getfd",
        "process_madvise",
    }
)
SECCOMP_ADDED = frozenset({"bpf", "perf_event_open"})
METRICS_ADDRESS = "$(POD_IP),127.0.0.1"
WRITABLE_MOUNTS = frozenset({"/tmp"})  # an emptyDir: the root filesystem is read-only
CONFIG_DIR = "/etc/tracejoin"
CONFIG_FILE = CONFIG_DIR + "/config.yaml"
GPU_LABEL = ("nvidia.com/gpu.present", "true")
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
RBAC_KINDS = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}

# Chart values exercising every knob the tests care about; the expectations follow them.
OVERRIDES: dict[str, Any] = {
    "image": {"repository": "registry.internal/obs/tracejoin", "tag": "1.2.3"},
    "rbac": {"create": True},
    "capabilities": {"sysPtrace": True, "dacReadSearch": True},
    "extraCapabilities": ["CAP_SYS_RESOURCE"],  # kernels < 5.11; the CAP_ prefix is dropped
    "otlp": {"endpoint": "http://otel-collector.monitoring.svc:4317", "protocol": "grpc"},
    "metricsPort": 9500,
    "terminationGracePeriodSeconds": 15,
    "config": {
        "port": [8080, 8000],
        "comm": "python3",
        "queue_size": 50000,
        "runq_threshold_ms": 2.5,
        "tlb": "flush",
        "gpu": False,
        "shutdown_timeout": 8.0,
    },
    "resources": {
        "requests": {"cpu": "200m", "memory": "300Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"},
    },
}


# ---------------------------------------------------------------------------- tools


def _build_tool(name: str) -> Path:
    """Build (or reuse) a cached Go tool via tools/<name>/build.sh; skip only without Go."""
    script = REPO / "tools" / name / "build.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1700)
    if proc.returncode != 0:
        if shutil.which("go") is None:
            pytest.skip(
                f"Go is not on PATH: it builds {name} from tools/{name} (no cached binary in "
                f"{os.environ.get('TRACEJOIN_CACHE', '/var/cache/tracejoin')}); install Go "
                ">= 1.26 or run `make setup`"
            )
        pytest.fail(f"building {name} failed:\n{proc.stderr[-4000:]}", pytrace=False)
    path = Path(proc.stdout.strip().splitlines()[-1])
    assert path.is_file() and os.access(path, os.X_OK), f"{script} printed {path}"
    return path


@pytest.fixture(scope="session")
def helm() -> Path:
    return _build_tool("helm")


@pytest.fixture(scope="session")
def k8sschema() -> Path:
    return _build_tool("k8sschema")


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # A private HOME/cache so that helm never reads or writes a user's repositories/config.
    env = dict(os.environ)
    home = Path(os.environ.get("TRACEJOIN_CACHE", "/var/cache/tracejoin")) / "helm-home"
    for var, sub in (
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ):
        env[var] = str(home / sub)
    return subprocess.run([str(helm), *args], capture_output=True, text=True, env=env, timeout=120)


def validate(k8sschema: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(k8sschema), str(path)], capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------------- renderings


@dataclass
class Rendered:
    """One set of objects to check, and what its values promise."""

    name: str
    path: Path  # one multi-document YAML file
    objects: list[dict[str, Any]]
    extra_caps: frozenset[str] = frozenset()
    metrics_port: int = 9464
    rbac: bool = False
    expect_config: dict[str, Any] = field(default_factory=dict)  # must appear in config.yaml

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str) -> dict[str, Any]:
        found = self.all(kind)
        assert len(found) == 1, f"{self.name}: expected one {kind}, found {len(found)}"
        return found[0]

    @property
    def daemonset(self) -> dict[str, Any]:
        return self.one("DaemonSet")

    @property
    def pod(self) -> dict[str, Any]:
        return self.daemonset["spec"]["template"]["spec"]

    @property
    def container(self) -> dict[str, Any]:
        containers = self.pod["containers"]
        assert len(containers) == 1, f"{self.name}: one container expected"
        return containers[0]

    @property
    def init_containers(self) -> list[dict[str, Any]]:
        return list(self.pod.get("initContainers", []))

    def config_text(self) -> str:
        volume = next(v for v in self.pod["volumes"] if "configMap" in v)
        cm = next(
            c for c in self.all("ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"]
        )
        return cm["data"]["config.yaml"]


def _load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _render_manifests(out: Path) -> Rendered:
    files = sorted(MANIFESTS.glob("*.yaml"))
    assert files, f"no manifests in {MANIFESTS}"
    text = "".join(f"---\n# Source: {f.name}\n{f.read_text()}" for f in files)
    out.write_text(text)
    return Rendered("manifests", out, _load_docs(text))


def _render_chart(helm: Path, out: Path, name: str, values: dict[str, Any] | None) -> Rendered:
    args = ["template", "tracejoin", str(CHART), "--namespace", NAMESPACE]
    if values:
        values_file = out.with_suffix(".values.yaml")
        values_file.write_text(yaml.safe_dump(values))
        args += ["--values", str(values_file)]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, f"helm template ({name}) failed:\n{proc.stderr}"
    out.write_text(proc.stdout)
    return Rendered(name, out, _load_docs(proc.stdout))


@pytest.fixture(scope="session")
def renderings(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Rendered]:
    d = tmp_path_factory.mktemp("deploy")
    out = {
        "manifests": _render_manifests(d / "manifests.yaml"),
        "chart-defaults": _render_chart(helm, d / "chart-defaults.yaml", "chart-defaults", None),
        "chart-overrides": _render_chart(
            helm, d / "chart-overrides.yaml", "chart-overrides", OVERRIDES
        ),
    }
    o = out["chart-overrides"]
    o.extra_caps = OPTIONAL_CAPABILITIES | {"SYS_RESOURCE"}
    o.metrics_port = OVERRIDES["metricsPort"]
    o.rbac = True
    o.expect_config = {
        **OVERRIDES["config"],
        "port": tuple(OVERRIDES["config"]["port"]),
        "metrics_port": OVERRIDES["metricsPort"],
    }
    return out


SOURCES = ["manifests", "chart-defaults", "chart-overrides"]


@pytest.fixture(params=SOURCES)
def rendered(request: pytest.FixtureRequest, renderings: dict[str, Rendered]) -> Rendered:
    return renderings[request.param]


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(path, key, value) for every mapping entry, recursively."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{path}.{k}", k, v
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


# ---------------------------------------------------------------------------- schema


def test_helm_lint(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "overrides.yaml"
    values.write_text(yaml.safe_dump(OVERRIDES))
    for extra in ([], ["--values", str(values)]):
        proc = run_helm(helm, "lint", str(CHART), "--strict", "--namespace", NAMESPACE, *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_schema_valid(rendered: Rendered, k8sschema: Path) -> None:
    """Every object decodes strictly into its k8s.io/api type and passes the API checks."""
    proc = validate(k8sschema, rendered.path)
    assert proc.returncode == 0, f"{rendered.name}:\n{proc.stdout}\n{proc.stderr}"
    ok = [ln for ln in proc.stdout.splitlines() if ln.startswith("ok ")]
    assert len(ok) == len(rendered.objects), proc.stdout
    assert f"{len(rendered.objects)} objects, 0 errors" in proc.stdout


@pytest.mark.parametrize(
    ("mutation", "message"),
    [
        # a field name in the wrong case is an unknown field to the API server
        (("hostPID: true", "hostpid: true"), 'unknown field "spec.template.spec.hostpid"'),
        (
            (
                "readOnlyRootFilesystem: true",
                "readOnlyRootFilesystem: true\n            readOnlyRootFileSystem: true",
            ),
            "unknown field",
        ),
        (("apiVersion: apps/v1", "apiVersion: extensions/v1beta1"), "unknown kind"),
        (
            (
                "path: /healthz\n              port: metrics",
                "path: /healthz\n              port: metricz",
            ),
            'livenessProbe.httpGet.port: Not found: "metricz"',
        ),
        (("image: registry.example.com/tracejoin:0.1.0", 'image: ""'), "image: Required value"),
        (("periodSeconds: 10", "periodSeconds: ten"), "decode"),
        (
            (
                "          operator: Exists\n          effect: NoSchedule",
                "          operator: Exists\n          value: x\n          effect: NoSchedule",
            ),
            "must be empty when operator is Exists",
        ),
        (
            (
                "        app.kubernetes.io/component: agent\n        app.kubernetes.io/part-of",
                "        app.kubernetes.io/component: collector\n        app.kubernetes.io/part-of",
            ),
            "`selector` does not match template `labels`",
        ),
        (
            (
                "mountPath: /usr/src\n",
                "mountPath: /usr/src\n              mountPropagation: x\n"
                "              readOnly: true\n",
            ),
            "already set",
        ),
    ],
    ids=[
        "case",
        "unknown-field",
        "removed-api",
        "probe-port",
        "no-image",
        "wrong-type",
        "toleration",
        "selector",
        "duplicate-key",
    ],
)
def test_schema_rejects(
    mutation: tuple[str, str], message: str, k8sschema: Path, tmp_path: Path
) -> None:
    """The validator is not a rubber stamp: each broken DaemonSet is refused, saying why."""
    text = (MANIFESTS / "30-daemonset.yaml").read_text()
    old, new = mutation
    assert old in text, f"mutation target {old!r} not in the manifest"
    bad = tmp_path / "bad.yaml"
    others = "".join(
        "---\n" + f.read_text()
        for f in sorted(MANIFESTS.glob("*.yaml"))
        if f.name != "30-daemonset.yaml"
    )
    bad.write_text(others + "---\n" + text.replace(old, new, 1))
    proc = validate(k8sschema, bad)
    assert proc.returncode == 1, proc.stdout
    assert message in proc.stderr, proc.stderr


def test_chart_refuses_grace_period_below_shutdown_timeout(helm: Path) -> None:
    proc = run_helm(
        helm,
        "template",
        "tracejoin",
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--set",
        "terminationGracePeriodSeconds=5",
        "--set",
        "config.shutdown_timeout=5",
    )
    assert proc.returncode != 0
    assert "must exceed config.shutdown_timeout" in proc.stderr


# ---------------------------------------------------------------------------- posture


def test_nothing_privileged(rendered: Rendered) -> None:
    for obj in rendered.objects:
        for path, key, value in _walk(obj):
            assert not (key == "privileged" and value is True), f"{rendered.name}: {path}"
            assert not (key == "allowPrivilegeEscalation" and value is True), path
    for c in [rendered.container, *rendered.init_containers]:
        sc = c["securityContext"]
        assert sc["privileged"] is False
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["runAsUser"] == 0  # host uid 0 with the capability set below, nothing more
    assert (
        "securityContext" not in rendered.pod or "privileged" not in rendered.pod["securityContext"]
    )


def test_capabilities_exactly_documented(rendered: Rendered) -> None:
    """BPF and PERFMON always; SYS_PTRACE and DAC_READ_SEARCH only when asked for."""
    caps = rendered.container["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    added = caps["add"]
    assert len(added) == len(set(added)), f"repeated capability in {added}"
    assert set(added) == CAPABILITIES | rendered.extra_caps
    assert "SYS_ADMIN" not in added and "CAP_SYS_ADMIN" not in added
    for c in rendered.init_containers:  # the installer holds none
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_seccomp_localhost_profile_installed_before_the_agent(rendered: Rendered) -> None:
    """The agent runs under the Localhost profile; an init container (which finishes before
    the agent container is created, when the runtime reads the profile) copies the profile,
    byte for byte the one in deploy/seccomp/, to exactly where the kubelet resolves it."""
    profile = rendered.container["securityContext"]["seccompProfile"]
    assert profile == {"type": "Localhost", "localhostProfile": LOCALHOST_PROFILE}
    (init,) = rendered.init_containers
    assert init["image"] == rendered.container["image"]  # no second image to pin and pull
    assert init["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in rendered.pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in init["volumeMounts"]}
    (host_dir,) = [m for m in init["volumeMounts"] if "hostPath" in volumes[m["name"]]]
    host = volumes[host_dir["name"]]["hostPath"]
    assert host == {"path": SECCOMP_HOST_DIR, "type": "DirectoryOrCreate"}
    assert "/var/lib/kubelet/seccomp/" + LOCALHOST_PROFILE.rsplit("/", 1)[0] == SECCOMP_HOST_DIR
    # the script copies the ConfigMap's key to the file the profile names, via a rename
    script = " ".join(init["command"] + init["args"])
    target = f"{host_dir['mountPath']}/{LOCALHOST_PROFILE.rsplit('/', 1)[1]}"
    assert re.search(rf"mv -f \S+ {re.escape(target)}$", script), script
    source_mount = next(p for p, v in mounts.items() if "configMap" in v)
    assert f"cp {source_mount}/tracejoin.json " in script, script
    cm_name = mounts[source_mount]["configMap"]["name"]
    (cm,) = [c for c in rendered.all("ConfigMap") if c["metadata"]["name"] == cm_name]
    assert cm["data"]["tracejoin.json"].rstrip("\n") == SECCOMP_PROFILE.read_text().rstrip("\n")
    # the agent container never sees the host's seccomp directory
    agent_volumes = {m["name"] for m in rendered.container["volumeMounts"]}
    assert host_dir["name"] not in agent_volumes


def test_chart_seccomp_alternatives(helm: Path, tmp_path: Path) -> None:
    """RuntimeDefault / Unconfined / a profile installed by other means: no installer, no
    host write; a profile path that could reach outside its own directory is refused."""
    for values, want in (
        ({"seccomp": {"type": "RuntimeDefault"}}, {"type": "RuntimeDefault"}),
        ({"seccomp": {"type": "Unconfined"}}, {"type": "Unconfined"}),
        (
            {"seccomp": {"install": False, "localhostProfile": "operator/tracejoin.json"}},
            {"type": "Localhost", "localhostProfile": "operator/tracejoin.json"},
        ),
    ):
        r = _render_chart(helm, tmp_path / "alt.yaml", "alt", values)
        assert r.container["securityContext"]["seccompProfile"] == want
        assert not r.init_containers
        assert {
            v["hostPath"]["path"] for v in r.pod["volumes"] if "hostPath" in v
        } == HOST_PATHS | {BPF_CACHE_HOST_DIR}
        assert all(c["metadata"]["name"] != "tracejoin-seccomp" for c in r.all("ConfigMap"))
    r = _render_chart(
        helm,
        tmp_path / "k0s.yaml",
        "k0s",
        {"seccomp": {"kubeletRootDir": "/var/lib/k0s/kubelet/", "localhostProfile": "tj/p.json"}},
    )
    (init,) = r.init_containers
    assert "/host/p.json" in init["args"][0]
    paths = {v["hostPath"]["path"] for v in r.pod["volumes"] if "hostPath" in v}
    assert paths == HOST_PATHS | {BPF_CACHE_HOST_DIR, "/var/lib/k0s/kubelet/seccomp/tj"}
    for bad in ("tracejoin.json", "../tracejoin.json", "/etc/tracejoin.json", "a/../../b.json"):
        proc = run_helm(
            helm, "template", "tracejoin", str(CHART), "--set", f"seccomp.localhostProfile={bad}"
        )
        assert proc.returncode != 0, bad
        assert "in a directory of its own" in proc.stderr, proc.stderr


def test_host_namespaces(rendered: Rendered) -> None:
    pod = rendered.pod
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork"), "hostNetwork is not needed (see the manifest's comment)"
    assert not pod.get("hostIPC")
    assert not rendered.container.get("ports", [{}])[0].get("hostPort")


def test_gpu_nodes_and_toleration(rendered: Rendered) -> None:
    pod = rendered.pod
    key, value = GPU_LABEL
    by_selector = pod.get("nodeSelector", {}).get(key) == value
    terms = (
        pod.get("affinity", {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )
    by_affinity = any(
        e.get("key") == key and value in e.get("values", [])
        for t in terms
        for e in t.get("matchExpressions", [])
    )
    assert by_selector or by_affinity, f"{rendered.name}: no {key}={value} node selection"
    assert GPU_TOLERATION in pod["tolerations"]


def test_host_mounts_read_only_and_documented(rendered: Rendered) -> None:
    volumes = {v["name"]: v for v in rendered.pod["volumes"]}
    host = {name: v["hostPath"]["path"] for name, v in volumes.items() if "hostPath" in v}
    assert set(host.values()) == HOST_PATHS | {SECCOMP_HOST_DIR, BPF_CACHE_HOST_DIR}, (
        f"{rendered.name}: host paths {sorted(host.values())}"
    )
    for c in rendered.init_containers:  # the installer: the kubelet's seccomp directory only
        for m in c["volumeMounts"]:
            vol = volumes[m["name"]]
            assert "hostPath" not in vol or vol["hostPath"]["path"] == SECCOMP_HOST_DIR, m
            assert "hostPath" in vol or m.get("readOnly") is True, m
    for v in volumes.values():
        assert set(v) - {"name"} <= {"hostPath", "configMap", "emptyDir"}, v
    writable = []
    for m in rendered.container["volumeMounts"]:
        vol = volumes[m["name"]]
        if "hostPath" in vol:
            writable_host = vol["hostPath"]["path"] == BPF_CACHE_HOST_DIR
            assert writable_host or m.get("readOnly") is True, f"{m['mountPath']} read-only"
            # BCC and tracejoin look at these exact paths
            assert m["mountPath"] == vol["hostPath"]["path"]
            assert not m.get("mountPropagation") or m["mountPropagation"] == "None"
        elif not m.get("readOnly"):
            assert "emptyDir" in vol, f"writable mount {m['mountPath']} is not an emptyDir"
            writable.append(m["mountPath"])
    assert set(writable) <= WRITABLE_MOUNTS
    assert rendered.container.get("workingDir", "/") in WRITABLE_MOUNTS


def test_probes_on_metrics_port(rendered: Rendered) -> None:
    c = rendered.container
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports.get("metrics") == rendered.metrics_port
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path
        port = ports.get(get["port"], get["port"])
        assert port == rendered.metrics_port, f"{probe} on {get['port']}"


def test_resources_set(rendered: Rendered) -> None:
    res = rendered.container["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(res[kind]), f"{rendered.name}: {kind} {res.get(kind)}"
    if rendered.name == "chart-overrides":
        assert res == OVERRIDES["resources"]


def test_environment(rendered: Rendered) -> None:
    env = {e["name"]: e for e in rendered.container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # the metrics port listens on the pod IP and the pod's loopback, not on every address;
    # POD_IP is declared first, as $(VAR) expansion needs
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["TRACEJOIN_METRICS_ADDRESS"]["value"] == METRICS_ADDRESS
    names = [e["name"] for e in rendered.container["env"]]
    assert names.index("POD_IP") < names.index("TRACEJOIN_METRICS_ADDRESS")
    endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"]
    assert re.match(r"https?://[a-z0-9.-]+\.svc(\.cluster\.local)?:43(17|18)$", endpoint)
    if rendered.name == "chart-overrides":
        assert endpoint == OVERRIDES["otlp"]["endpoint"]
    # service.name must stay the served process's name
    assert "OTEL_SERVICE_NAME" not in env
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"


def test_config_accepted_by_agent(rendered: Rendered, tmp_path: Path) -> None:
    """The ConfigMap's config.yaml loads with tracejoin.config's own validation for `run`."""
    path = tmp_path / "config.yaml"
    path.write_text(rendered.config_text())
    try:
        settings = load_file(path, "run")
    except ConfigError as exc:  # names the bad key
        pytest.fail(f"{rendered.name}: {exc}", pytrace=False)
    assert settings.get("metrics_port", 9464) == rendered.metrics_port
    # the address comes from the environment (the pod IP), which outranks the file
    assert "metrics_address" not in settings
    for key, want in rendered.expect_config.items():
        assert settings[key] == want, f"{key}: {settings.get(key)!r} != {want!r}"
    # SIGKILL must not cut the flush short
    grace = rendered.pod["terminationGracePeriodSeconds"]
    assert grace > settings.get("shutdown_timeout", 5.0)
    # the agent reads the file the container is told to read, from the ConfigMap mount
    c = rendered.container
    assert c.get("args", []) in ([], ["run", "--config", CONFIG_FILE])
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts[CONFIG_DIR]["readOnly"] is True


def test_bpf_cache_is_kept_on_the_node_unless_switched_off(
    helm: Path, rendered: Rendered, tmp_path: Path
) -> None:
    """The compiled probes go to the one writable host directory, where `--bpf-cache`'s
    default (/var/cache/tracejoin/bpf) lies; the chart's `bpfCache.hostPath: ""` mounts
    nothing and tells the agent to keep nothing (it compiles at every start)."""
    mounts = {m["mountPath"]: m for m in rendered.container["volumeMounts"]}
    assert Settings().bpf_cache.startswith(BPF_CACHE_HOST_DIR + "/")
    assert BPF_CACHE_HOST_DIR in mounts and not mounts[BPF_CACHE_HOST_DIR].get("readOnly")
    if rendered.name != "chart-defaults":
        return
    off = _render_chart(helm, tmp_path / "off.yaml", "off", {"bpfCache": {"hostPath": ""}})
    paths = {v["hostPath"]["path"] for v in off.pod["volumes"] if "hostPath" in v}
    assert BPF_CACHE_HOST_DIR not in paths
    assert all(m["mountPath"] != BPF_CACHE_HOST_DIR for m in off.container["volumeMounts"])
    config = tmp_path / "config.yaml"
    config.write_text(off.config_text())
    assert load_file(config, "run")["bpf_cache"] == ""


def test_metrics_service(rendered: Rendered) -> None:
    svc = rendered.one("Service")
    labels = rendered.daemonset["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["targetPort"] in ("metrics", rendered.metrics_port)
    ann = svc["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == str(rendered.metrics_port)
    assert ann["prometheus.io/path"] == "/metrics"


def test_network_policy_admits_only_the_scraper(rendered: Rendered) -> None:
    """Ingress to the agent only on the metrics port, only from the configured scraper (the
    kubelet's probes come from the node, which NetworkPolicy always lets through)."""
    (policy,) = rendered.all("NetworkPolicy")
    spec = policy["spec"]
    labels = rendered.daemonset["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["podSelector"]["matchLabels"]  # not {}: the whole namespace
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert rule["from"] == [
        {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    assert not [p for p in rendered.container["ports"] if p["name"] != "metrics"]


def test_network_policy_can_be_turned_off(helm: Path, tmp_path: Path) -> None:
    r = _render_chart(helm, tmp_path / "nonp.yaml", "nonp", {"networkPolicy": {"enabled": False}})
    assert not r.all("NetworkPolicy")


def test_no_api_access_unless_asked(rendered: Rendered) -> None:
    kinds = {o["kind"] for o in rendered.objects}
    sa = rendered.one("ServiceAccount")
    assert rendered.pod["serviceAccountName"] == sa["metadata"]["name"]
    if not rendered.rbac:
        assert not kinds & RBAC_KINDS, f"{rendered.name}: RBAC objects without rbac.create"
        assert sa["automountServiceAccountToken"] is False
        assert rendered.pod["automountServiceAccountToken"] is False
        return
    for role in rendered.all("ClusterRole") + rendered.all("Role"):
        for rule in role["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
    (binding,) = rendered.all("ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_image_override(renderings: dict[str, Rendered]) -> None:
    image = renderings["chart-overrides"].container["image"]
    assert image == "registry.internal/obs/tracejoin:1.2.3"
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert renderings["chart-defaults"].container["image"].endswith(":" + chart["appVersion"])


def test_chart_defaults_match_plain_manifests(
    renderings: dict[str, Rendered], tmp_path: Path
) -> None:
    """The two ways to install give the same pod: one posture, not two drifting copies."""
    a, b = renderings["manifests"], renderings["chart-defaults"]
    assert a.init_containers == b.init_containers
    for key in (
        "securityContext",
        "resources",
        "livenessProbe",
        "readinessProbe",
        "ports",
        "args",
        "workingDir",
    ):
        assert a.container[key] == b.container[key], key
    for key in (
        "hostPID",
        "nodeSelector",
        "tolerations",
        "runtimeClassName",
        "terminationGracePeriodSeconds",
        "automountServiceAccountToken",
    ):
        assert a.pod.get(key) == b.pod.get(key), key
    env_a = {e["name"]: e for e in a.container["env"]}
    env_b = {e["name"]: e for e in b.container["env"]}
    assert env_a == env_b

    def mounts(r: Rendered) -> list[tuple[str, bool]]:
        return sorted(
            (m["mountPath"], m.get("readOnly", False)) for m in r.container["volumeMounts"]
        )

    assert mounts(a) == mounts(b)
    configs = []
    for r in (a, b):
        p = tmp_path / f"{r.name}.yaml"
        p.write_text(r.config_text())
        configs.append(load_file(p, "run"))
    assert configs[0] == configs[1]


# ---------------------------------------------------------------------------- seccomp profile


def _profile() -> dict[str, Any]:
    return dict(json.loads(SECCOMP_PROFILE.read_text()))


def _allowed(profile: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """syscall -> the ALLOW rules naming it (with their argument conditions)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rule in profile["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW":
            for name in rule["names"]:
                out.setdefault(name, []).append(rule)
    return out


def test_seccomp_profile_shape() -> None:
    """The OCI runtime-spec LinuxSeccomp form containerd reads for a Localhost profile (CRI-O
    and Docker read it too): deny by default, an allow-list by name, and the agent's calls."""
    profile = _profile()
    assert set(profile) <= {"defaultAction", "defaultErrnoRet", "architectures", "syscalls"}
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"  # EPERM, as the runtime default
    assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= set(profile["architectures"])
    ops = {"SCMP_CMP_EQ", "SCMP_CMP_NE", "SCMP_CMP_LT", "SCMP_CMP_GT", "SCMP_CMP_MASKED_EQ"}
    for rule in profile["syscalls"]:
        assert set(rule) <= {"names", "action", "errnoRet", "args"}, rule
        assert rule["names"] and all(re.fullmatch(r"[a-z_][a-z0-9_]*", n) for n in rule["names"])
        assert rule["action"] in {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO"}, rule
        for arg in rule.get("args") or []:
            assert set(arg) <= {"index", "value", "valueTwo", "op"} and arg["op"] in ops, arg
            assert 0 <= arg["index"] < 6
    allowed = _allowed(profile)
    for name in SECCOMP_ADDED:  # unconditional: whatever the runtime's capability gating
        assert any(not r.get("args") for r in allowed.get(name, [])), name
    assert not SECCOMP_DENIED & set(allowed), SECCOMP_DENIED & set(allowed)
    # the rest is the runtime default: what a Python process, libbcc and NVML need is there
    for name in ("read", "write", "mmap", "openat", "ioctl", "futex", "epoll_wait", "execve"):
        assert name in allowed, name
    for name in ("mount", "unshare", "setns", "init_module", "kexec_load", "reboot", "chroot"):
        assert name not in allowed, name  # CAP_SYS_ADMIN-class calls stay out
    # clone only without namespace flags; clone3 ENOSYS so that libc falls back to clone
    (clone,) = allowed["clone"]
    assert (
        clone["args"][0]["op"] == "SCMP_CMP_MASKED_EQ" and clone["args"][0].get("valueTwo", 0) == 0
    )
    clone3 = [r for r in profile["syscalls"] if "clone3" in r["names"]]
    assert clone3 == [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]


def test_seccomp_profile_copies_are_identical() -> None:
    text = SECCOMP_PROFILE.read_text()
    for copy in SECCOMP_COPIES:
        assert copy.read_text() == text, f"{copy} differs: run scripts/seccomp-profile.sh"
    cm = yaml.safe_load(SECCOMP_CONFIGMAP.read_text())
    assert cm["data"]["tracejoin.json"] == text, "run scripts/seccomp-profile.sh"


def test_seccomp_profile_is_what_the_generator_writes() -> None:
    """deploy/seccomp/tracejoin.json is containerd's RuntimeDefault transformed as
    tools/seccomp/main.go says, not an edited copy."""
    gen = _build_tool("seccomp")
    out = subprocess.run([str(gen)], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == SECCOMP_PROFILE.read_text(), "run scripts/seccomp-profile.sh"


# ---------------------------------------------------------------------------- image, docs


def _dockerfile_code() -> str:
    text = DOCKERFILE.read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    return code.replace("\\\n", " ")  # join continuation lines


def test_dockerfile() -> None:
    """The image cannot be built here (no container engine); hold it to its contract."""
    code = _dockerfile_code()
    # the base comes in by digest (BASE_IMAGE, no default), never by a moving tag; both stages
    assert re.search(r"^ARG BASE_IMAGE$", code, re.MULTILINE), "ARG BASE_IMAGE without default"
    froms = re.findall(r"^FROM (.*)$", code, re.MULTILINE)
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"], froms
    build, image = code.split("\nFROM ${BASE_IMAGE}\n")
    installs = [
        re.search(r"apt-get install (.*?)(&&|$)", part, re.MULTILINE) for part in (build, image)
    ]
    assert all(installs), "no apt-get install"
    tools, packages = (set(m.group(1).split()) for m in installs if m)
    # the build stage compiles span_bytes' join; the image has no compiler and gets the venv
    assert {"python3", "python3-venv", "python3-dev", "gcc", "libc6-dev"} <= tools
    assert {"python3", "python3-venv", "python3-bpfcc", "libbpfcc"} <= packages
    assert "bpftool" not in packages  # dropped from the production image (see the Dockerfile)
    assert not any(p.startswith(("linux-headers", "gcc", "build-essential")) for p in packages)
    assert "python3-dev" not in packages
    assert "COPY --from=build /opt/tracejoin /opt/tracejoin" in image
    # the build fails without any of the compiled modules; the image asserts all are used
    assert (
        "import tracejoin.pipeline._span_bytes, tracejoin.kernel._ring_read, "
        "tracejoin.enrich._trace_context, tracejoin.exporters._request_bytes" in build
    )
    assert (
        "span_bytes.COMPILED and ring.COMPILED and correlate.COMPILED and otlp_proto.COMPILED"
        in image
    )
    assert "DEBIAN_FRONTEND=noninteractive" in code
    assert "/usr/lib/python3/dist-packages/bcc" in build  # the venv sees Debian's binding
    # every Python distribution from the lock, hash-checked, wheels only; tracejoin itself
    # without build isolation (no unpinned setuptools download) and without dependencies
    pips = [m.group(1) for m in re.finditer(r'pip" install (.*?)(?:&&|$)', build, re.MULTILINE)]
    assert len(pips) == 2, pips
    assert {"--require-hashes", "--only-binary=:all:", "-r"} <= set(pips[0].split())
    assert pips[0].split()[-1] == "/src/deploy/requirements.lock"
    assert {"--no-deps", "--no-build-isolation"} <= set(pips[1].split())
    assert 'pip" install' not in image
    assert 'pip" check' in image
    assert 'ENTRYPOINT ["tracejoin"]' in image
    assert f'CMD ["run", "--config", "{CONFIG_FILE}"]' in image
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    allowed = ignore[ignore.index("*") + 1 :]
    assert allowed.count("!agent/") == 1  # allow-list, not deny-list
    assert "!deploy/requirements.lock" in allowed


def _lock() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256 hashes) from deploy/requirements.lock."""
    out: dict[str, tuple[str, list[str]]] = {}
    text = (REPO / "deploy" / "requirements.lock").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert not line.startswith("-"), f"an option in the lock: {line}"  # --find-links etc.
        req, *opts = line.split()
        name, _, version = req.partition("==")
        assert version, f"not pinned: {req}"
        hashes = [o.removeprefix("--hash=sha256:") for o in opts]
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), line
        out[canonicalize_name(name)] = (version, hashes)
    return out


def test_requirements_lock_covers_pyproject() -> None:
    """Every runtime dependency of pyproject.toml, and the build backend, is pinned to a version
    that satisfies it, with hashes; nothing is in the lock unhashed or unpinned."""
    lock = _lock()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    wanted = [Requirement(r) for r in project["project"]["dependencies"]]
    wanted += [Requirement(r) for r in project["build-system"]["requires"]]
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in lock, f"{req} is not in deploy/requirements.lock: make requirements-lock"
        version = lock[name][0]
        assert req.specifier.contains(version, prereleases=True), f"{req}: locked {version}"
    header = (REPO / "deploy" / "requirements.lock").read_text().split("\n\n", 1)[0]
    assert "--generate-hashes" in header and "pyproject.toml" in header, header


def test_requirements_lock_is_closed() -> None:
    """What each locked distribution requires is locked too (checked from the metadata of the
    ones installed here at the locked version; the image build's `pip check` is the rest)."""
    lock = _lock()
    env = {"python_version": "3.11", "python_full_version": "3.11.2", "extra": ""}
    checked = 0
    for name, (version, _) in lock.items():
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if dist.version != version:
            continue
        checked += 1
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonicalize_name(req.name)
            assert dep in lock, f"{name} {version} requires {req}, which is not locked"
            assert req.specifier.contains(lock[dep][0], prereleases=True), (name, req)
    assert checked >= 5, f"only {checked} locked distributions are installed here at their version"


@pytest.mark.xfail(
    strict=True,
    reason="no registry access where this was written: deploy/base-image.lock is unresolved "
    "until `make image-lock` runs (docs/operations.md, 'The image')",
)
def test_base_image_pinned_by_digest() -> None:
    pinned = (REPO / "deploy" / "base-image.lock").read_text().strip()
    assert re.fullmatch(r"debian:bookworm-slim@sha256:[0-9a-f]{64}", pinned), pinned


def test_operations_doc_explains_the_posture() -> None:
    doc = OPERATIONS_DOC.read_text()
    for cap in sorted(CAPABILITIES | {"SYS_RESOURCE"}):
        assert f"CAP_{cap}" in doc, f"docs/operations.md does not explain CAP_{cap}"
    for path in sorted(HOST_PATHS):
        assert path in doc, f"docs/operations.md does not explain the {path} mount"
    for word in (
        "hostPID",
        "seccomp",
        "localhostProfile",
        "/var/lib/kubelet/seccomp/tracejoin/tracejoin.json",
        "NetworkPolicy",
        "make image-lock",
        "deploy/requirements.lock",
        "--require-hashes",
        "proc_reads_failed",
        "metrics_server_connections_dropped",
        "readOnlyRootFilesystem",
        "tracejoin doctor",
        "helm install",
        "kubectl apply",
        "tracejoin_spans_dropped",
    ):
        assert word in doc, word
    # never "not privileged" without saying what the capabilities still allow
    assert not re.search(r"(?i)\bis (\*\*)?not privileged", doc), "unqualified 'not privileged'"
    assert "any kernel memory" in doc


# ------------------------------------------------------------------------- capabilities, for real


def _manifest_capabilities() -> list[str]:
    docs = _load_docs((MANIFESTS / "30-daemonset.yaml").read_text())
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return list(
        ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
    )


def _confined(caps: list[str] | frozenset[str], argv: list[str], profile: Path | None = None):
    """argv as uid 0 holding exactly `caps` (bounding set; root's exec gets all of it as
    permitted/effective) with no_new_privs, as the container runtime sets the pod up; under the
    seccomp `profile` when given (loaded last, as runc does, by tests/seccomp_exec.py)."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed: it confines the test process")
    bounding = ",".join(["-all"] + ["+" + c.lower() for c in sorted(caps)])
    if profile is not None:
        argv = [sys.executable, str(SECCOMP_EXEC), str(profile), "--", *argv]
    return ["setpriv", "--no-new-privs", "--bounding-set", bounding, "--", *argv]


_PROC_PROBE = """
import json, os, sys
pid, fd = int(sys.argv[1]), int(sys.argv[2])
out = {}
for what, path in (("fd", f"/proc/{pid}/fd/{fd}"), ("exe", f"/proc/{pid}/exe")):
    try:
        out[what] = os.readlink(path)
    except OSError as e:
        out[what] = "errno:" + str(e.errno)
print(json.dumps(out))
"""

# A keep-alive HTTP/1.1 server, to run as another user (as another pod's process would be).
_OTHER_USER_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print(srv.socket.fileno(), flush=True)
srv.serve_forever()
"""


@pytest.fixture
def other_user_server() -> Iterator[tuple[int, int, int]]:
    """(pid, fd of its listening socket, port) of an HTTP server owned by nobody."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "/usr/bin/python3",
            "-c",
            _OTHER_USER_SERVER,
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        fd = int(proc.stdout.readline())
        yield proc.pid, fd, port
    finally:
        proc.kill()
        proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_reads(caps: list[str] | frozenset[str], pid: int, fd: int) -> dict[str, str]:
    out = subprocess.run(
        _confined(caps, [sys.executable, "-c", _PROC_PROBE, str(pid), str(fd)]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return dict(json.loads(out.stdout))


def _doctor(
    caps: list[str] | frozenset[str], profile: Path | None = None
) -> tuple[int, dict[str, Any]]:
    argv = [
        sys.executable,
        "-c",
        "from tracejoin.commands.cli import main; main()",
        "doctor",
        "--json",
    ]
    out = subprocess.run(
        _confined(caps, argv, profile), capture_output=True, text=True, timeout=120, cwd=REPO
    )
    report = json.loads(out.stdout)
    return out.returncode, {c["name"]: c for c in report["checks"]}


@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_capability_set_is_sufficient_and_each_is_needed(
    other_user_server: tuple[int, int, int],
) -> None:
    """Run as the pod runs (uid 0, exactly the manifest's capabilities, no_new_privs): the
    probes compile, load and attach. Without BPF or PERFMON they do not. The opt-in ones are
    what makes another user's /proc/<pid>/fd and /exe readable."""
    caps = _manifest_capabilities()
    assert set(caps) == CAPABILITIES
    pid, fd, _ = other_user_server

    code, checks = _doctor(caps)
    assert code == 0, checks
    assert checks["privileges"]["status"] == "available", checks["privileges"]
    assert checks["bpf trial load"]["status"] == "available", checks["bpf trial load"]
    for missing in ("BPF", "PERFMON"):
        code, checks = _doctor([c for c in caps if c != missing])
        assert code == 1, f"doctor passed without CAP_{missing}"
        assert f"CAP_{missing}" in checks["privileges"]["detail"], checks["privileges"]

    eacces = "errno:13"
    assert _proc_reads(caps, pid, fd) == {"fd": eacces, "exe": eacces}
    reads = _proc_reads(CAPABILITIES | OPTIONAL_CAPABILITIES, pid, fd)
    assert reads["fd"].startswith("socket:["), reads
    assert reads["exe"].endswith("/python3") or "python3" in reads["exe"], reads
    reads = _proc_reads(CAPABILITIES | {"SYS_PTRACE"}, pid, fd)
    assert reads["fd"] == eacces and not reads["exe"].startswith("errno"), reads
    reads = _proc_reads(CAPABILITIES | {"DAC_READ_SEARCH"}, pid, fd)
    assert reads["fd"] == eacces and reads["exe"] == eacces, reads


def _wait_ready(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(base + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail(f"tracejoin run not ready:\n{log.read_text()[-3000:]}")


def _scrape(base: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        return parse_prometheus(r.read().decode())


def _span_attrs(path: Path) -> dict[int, dict[str, Any]]:
    """trace id -> attributes (span and resource) of its server span."""
    out: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    if sp.get("kind") == 2:
                        attrs = {a["key"]: a["value"] for a in sp.get("attributes", [])}
                        out[int(sp["traceId"], 16)] = {**res, **attrs}
    return out


def _run_confined_agent(
    tmp_path: Path, caps: frozenset[str], server_pid: int, server_port: int
) -> tuple[dict[int, dict[str, Any]], dict[Any, float], str, list[int], list[int]]:
    """`tracejoin run` confined to `caps` (and the seccomp profile) tracing the nobody-owned
    server. One keep-alive connection is opened before the agent starts, so its requests come
    without their addresses and the agent resolves them from the server's /proc/<pid>/fd; one
    connection opened after. Returns (spans by trace id, final metrics, log, old-connection
    trace ids, new-connection trace ids)."""
    tmp_path.mkdir()
    metrics_port = _free_port()
    base = f"http://127.0.0.1:{metrics_port}"
    spans = tmp_path / "spans.jsonl"
    log = tmp_path / "agent.log"
    old = Conn(server_port)
    assert old.request(b"GET /before HTTP/1.1\r\nHost: t\r\n\r\n") == 200
    argv = [
        sys.executable, "-c", "from tracejoin.commands.cli import main; main()", "run",
        "--metrics-address", "127.0.0.1", "--metrics-port", str(metrics_port),
        "--pid", str(server_pid), "--spans-file", str(spans), "--no-gpu",
        # addresses of connections older than the agent then come from /proc (the fallback
        # for kernels without this tracepoint), which is what the capabilities are about
        "--disable-tracepoint", "tcp:tcp_rcv_space_adjust",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEJOIN_"))}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            _confined(caps, argv, SECCOMP_PROFILE), stdout=fh, stderr=subprocess.STDOUT, env=env
        )
    try:
        _wait_ready(proc, base, log)
        # The server's thread was already blocked in read() when the probes attached: that
        # read's entry was never seen, so the request it returns is not traced. The next ones
        # are, without their addresses.
        assert old.request(b"GET /in-flight HTTP/1.1\r\nHost: t\r\n\r\n") == 200
        old_ids, new_ids = [], []
        for conn, ids in ((old, old_ids), (Conn(server_port), new_ids)):
            for i in range(3):
                sent = new_sent(f"/after/{len(ids)}/{i}")
                assert conn.request(get_bytes(sent)) == 200
                ids.append(sent.trace_id)
            conn.close()
        deadline = time.monotonic() + 30
        while not set(old_ids + new_ids) <= set(_span_attrs(spans)):
            got = _span_attrs(spans)
            assert time.monotonic() < deadline, (
                f"old {[t in got for t in old_ids]}, new {[t in got for t in new_ids]}, "
                f"{len(got)} spans\n{log.read_text()[-3000:]}"
            )
            time.sleep(0.2)
        final = _scrape(base)
        assert proc.poll() is None, log.read_text()  # degraded, never crashed
    finally:
        proc.terminate()
        proc.wait(30)
        old.close()
    return _span_attrs(spans), final, log.read_text(), old_ids, new_ids


@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_without_the_optional_capabilities_it_degrades_counted(
    other_user_server: tuple[int, int, int], tmp_path: Path
) -> None:
    """The pod's default (BPF, PERFMON) against another user's process: every request still
    gets its span with the right ids; what needs SYS_PTRACE / DAC_READ_SEARCH (the executable's
    name, the addresses of a connection older than the agent) is missing, counted in
    proc_reads_failed{what,reason="denied"}, and logged once naming the capability. With them
    (the opt-in), the same run has both and counts nothing."""
    pid, _, port = other_user_server
    spans, final, log, old_ids, new_ids = _run_confined_agent(
        tmp_path / "default", CAPABILITIES, pid, port
    )
    assert "Traceback" not in log, log
    denied = {
        what: final.get(("proc_reads_failed", frozenset({("what", what), ("reason", "denied")})))
        for what in ("fd", "exe")
    }
    assert denied["fd"] and denied["fd"] >= 1 and denied["exe"] and denied["exe"] >= 1, final
    assert "needs CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE" in log, log
    assert "needs CAP_SYS_PTRACE" in log, log
    for tid in old_ids:
        assert "client.address" not in spans[tid], spans[tid]
    for tid in new_ids:  # established while the agent ran: addresses from the kernel
        assert spans[tid]["client.address"] == {"stringValue": "127.0.0.1"}

    spans, final, log, old_ids, _ = _run_confined_agent(
        tmp_path / "opt-in", CAPABILITIES | OPTIONAL_CAPABILITIES, pid, port
    )
    assert not [k for k, v in final.items() if k[0] == "proc_reads_failed" and v], final
    for tid in old_ids:
        assert spans[tid]["client.address"] == {"stringValue": "127.0.0.1"}, spans[tid]
        assert spans[tid]["process.executable.name"] == {"stringValue": "python3.11"} or (
            "python3" in spans[tid]["process.executable.name"]["stringValue"]
        )


# ------------------------------------------------------------------------- seccomp, for real

_SYSCALLS = r"""
import ctypes, errno, json, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
out = {
    # x86_64 numbers: ptrace(PTRACE_ATTACH, child), process_vm_readv(child, NULL, 0, NULL, 0),
    # open_by_handle_at(AT_FDCWD, NULL, 0) and bpf(BPF_PROG_LOAD, NULL, 0)
    "ptrace": call(101, 16, child, 0, 0),
    "process_vm_readv": call(310, child, 0, 0, 0, 0, 0),
    "open_by_handle_at": call(304, -100, 0, 0),
    "bpf": call(321, 5, 0, 0),
}
os.kill(child, 9)
print(json.dumps(out))
"""


def _syscalls(caps: frozenset[str], profile: Path | None) -> dict[str, str]:
    out = subprocess.run(
        _confined(caps, [sys.executable, "-c", _SYSCALLS], profile),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_seccomp_profile_refuses_ptrace_even_with_the_capabilities() -> None:
    """Holding every capability the pod can be given, under the profile: ptrace,
    process_vm_readv and open_by_handle_at fail with EPERM, the seccomp answer. Without the
    profile the same calls reach the kernel (and succeed, or fail on their dummy arguments),
    so the EPERM is the filter's, not the kernel's."""
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    caps = CAPABILITIES | OPTIONAL_CAPABILITIES
    bare = _syscalls(caps, None)
    assert bare["ptrace"] == "ok", bare  # CAP_SYS_PTRACE: the kernel allows the attach
    assert bare["process_vm_readv"] == "ok", bare
    assert bare["open_by_handle_at"] != "EPERM", bare  # EFAULT/EBADF: past the checks
    assert bare["bpf"] not in ("EPERM", "ENOSYS"), bare  # EFAULT: CAP_BPF let it in
    confined = _syscalls(caps, SECCOMP_PROFILE)
    assert confined == {
        "ptrace": "EPERM",
        "process_vm_readv": "EPERM",
        "open_by_handle_at": "EPERM",
        "bpf": bare["bpf"],  # allowed through to the kernel, as before
    }, confined


@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_agent_loads_probes_and_captures_under_the_seccomp_profile(
    other_user_server: tuple[int, int, int], tmp_path: Path
) -> None:
    """The pod as it runs: uid 0, BPF + PERFMON, no_new_privs, the Localhost profile. doctor
    passes (trial BPF program compiled, loaded, attached); `tracejoin capture` loads every
    probe and writes the spans of real requests with their ids. Control: the same profile
    without bpf, as a runtime default that gates bpf on CAP_SYS_ADMIN behaves, fails the trial
    load, so the filter really was in force (and without sched_setattr, the CPU slice)."""
    code, checks = _doctor(CAPABILITIES, SECCOMP_PROFILE)
    assert code == 0, checks
    assert checks["bpf trial load"]["status"] == "available", checks["bpf trial load"]
    # --cpu-slice-ms: sched_setattr is allowed, and no capability is needed (Linux 6.12+)
    slices = tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 12)
    assert checks["cpu slice"]["status"] == ("available" if slices else "fallback")

    without_bpf = _profile()
    for rule in without_bpf["syscalls"]:
        rule["names"] = [n for n in rule["names"] if n not in ("bpf", "sched_setattr")]
    stripped = tmp_path / "no-bpf.json"
    stripped.write_text(json.dumps(without_bpf))
    code, checks = _doctor(CAPABILITIES, stripped)
    assert code == 1 and checks["bpf trial load"]["status"] == "unavailable", checks
    assert checks["cpu slice"]["status"] == "fallback", checks["cpu slice"]

    pid, _, port = other_user_server
    out = tmp_path / "capture"
    argv = [
        sys.executable, "-c", "from tracejoin.commands.cli import main; main()", "capture",
        "--pid", str(pid), "--duration", "12", "--no-gpu", "--output-dir", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        _confined(CAPABILITIES, argv, SECCOMP_PROFILE),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # "capturing ..." once the probes are attached
        lines.append(line)
        if line.startswith("capturing"):
            break
    conn = Conn(port)
    sent = [new_sent(f"/seccomp/{i}") for i in range(5)]
    for s in sent:
        assert conn.request(get_bytes(s)) == 200
    conn.close()
    rest, _ = proc.communicate(timeout=60)
    text = "".join(lines) + rest
    assert proc.returncode == 0, text
    assert "Traceback" not in text, text
    spans = _span_attrs(out / "spans.otlp.jsonl")
    assert {s.trace_id for s in sent} <= set(spans), text
