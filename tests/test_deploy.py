"""Deployment artefacts: the Helm chart and the plain manifests in deploy/.

Both are rendered (the chart by a real `helm template`, with default values and with
overrides), validated offline against the Kubernetes API types by tools/k8sschema (strict
decoding into k8s.io/api structs: unknown fields, unknown kinds and broken references are
errors), and then held to the documented security posture on the parsed objects: not
privileged, capabilities exactly the documented set, read-only root and host mounts, host PID
namespace, GPU node selection, probes on the metrics port, resources, and a config.yaml that
tracejoin.config itself accepts for `tracejoin run`.

helm and the validator are Go programs built from tools/helm and tools/k8sschema and cached in
/var/cache/tracejoin (TRACEJOIN_CACHE): the first run builds helm from source (a few minutes);
later runs reuse the binaries. Without Go (and without cached binaries) the tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from tracejoin.config import ConfigError, load_file

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "tracejoin"
MANIFESTS = REPO / "deploy" / "kubernetes"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
OPERATIONS_DOC = REPO / "docs" / "operations.md"
NAMESPACE = "tracejoin"

# Building helm from source on a 2-core machine takes minutes the first time.
pytestmark = pytest.mark.timeout(1800)

# The documented posture (docs/operations.md, "Privileges"). A change here is a change to the
# agent's privileges: update the manifests, the chart, and the doc's reasons with it.
CAPABILITIES = frozenset({"BPF", "PERFMON", "DAC_READ_SEARCH", "SYS_PTRACE"})
HOST_PATHS = frozenset({"/sys/kernel/tracing", "/lib/modules", "/usr/src"})
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
    o.extra_caps = frozenset({"SYS_RESOURCE"})
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
    sc = rendered.container["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsUser"] == 0  # host uid 0 with the capability set below, nothing more
    assert (
        "securityContext" not in rendered.pod or "privileged" not in rendered.pod["securityContext"]
    )


def test_capabilities_exactly_documented(rendered: Rendered) -> None:
    caps = rendered.container["securityContext"]["capabilities"]
    assert caps["drop"] == ["ALL"]
    added = caps["add"]
    assert len(added) == len(set(added)), f"repeated capability in {added}"
    assert set(added) == CAPABILITIES | rendered.extra_caps
    assert "SYS_ADMIN" not in added and "CAP_SYS_ADMIN" not in added


def test_seccomp_is_a_deliberate_choice(rendered: Rendered) -> None:
    # Unconfined (documented why) or a Localhost profile; RuntimeDefault refuses bpf(2)
    # without CAP_SYS_ADMIN, and an unset profile silently becomes whatever the node defaults to.
    profile = rendered.container["securityContext"]["seccompProfile"]
    assert profile["type"] in {"Unconfined", "Localhost"}, profile


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
    assert set(host.values()) == HOST_PATHS, f"{rendered.name}: host paths {sorted(host.values())}"
    for v in volumes.values():
        assert set(v) - {"name"} <= {"hostPath", "configMap", "emptyDir"}, v
    writable = []
    for m in rendered.container["volumeMounts"]:
        vol = volumes[m["name"]]
        if "hostPath" in vol:
            assert m.get("readOnly") is True, f"{m['mountPath']} must be read-only"
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


# ---------------------------------------------------------------------------- image, docs


def test_dockerfile() -> None:
    """The image cannot be built here (no container engine); hold it to its contract."""
    text = DOCKERFILE.read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    code = code.replace("\\\n", " ")  # join continuation lines
    assert re.search(r"^FROM debian:bookworm", code, re.MULTILINE)
    install = re.search(r"apt-get install (.*?)(&&|$)", code, re.MULTILINE)
    assert install, "no apt-get install"
    packages = set(install.group(1).split())
    assert {"python3", "python3-venv", "python3-bpfcc", "libbpfcc", "bpftool"} <= packages
    assert not any(p.startswith(("linux-headers", "gcc", "build-essential")) for p in packages)
    assert "DEBIAN_FRONTEND=noninteractive" in code
    assert "/usr/lib/python3/dist-packages/bcc" in code  # the venv sees Debian's binding
    assert 'ENTRYPOINT ["tracejoin"]' in code
    assert f'CMD ["run", "--config", "{CONFIG_FILE}"]' in code
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1 :].count("!agent/") == 1  # allow-list, not deny-list


def test_operations_doc_explains_the_posture() -> None:
    doc = OPERATIONS_DOC.read_text()
    for cap in sorted(CAPABILITIES | {"SYS_RESOURCE"}):
        assert f"CAP_{cap}" in doc, f"docs/operations.md does not explain CAP_{cap}"
    for path in sorted(HOST_PATHS):
        assert path in doc, f"docs/operations.md does not explain the {path} mount"
    for word in (
        "hostPID",
        "seccomp",
        "readOnlyRootFilesystem",
        "tracejoin doctor",
        "helm install",
        "kubectl apply",
        "tracejoin_spans_dropped",
    ):
        assert word in doc, word


# ------------------------------------------------------------------------- capabilities, for real


def _manifest_capabilities() -> list[str]:
    docs = _load_docs((MANIFESTS / "30-daemonset.yaml").read_text())
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return list(
        ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]
    )


def _confined(caps: list[str], argv: list[str]) -> list[str]:
    """argv as uid 0 holding exactly `caps` (bounding set; root's exec gets all of it as
    permitted/effective) with no_new_privs, as the container runtime sets the pod up."""
    bounding = ",".join(["-all"] + ["+" + c.lower() for c in caps])
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

_OTHER_USER_SERVER = """
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen()
print(s.fileno(), flush=True)
time.sleep(120)
"""


@pytest.fixture
def other_user_listener() -> Iterator[tuple[int, int]]:
    """(pid, fd of a listening socket) of a process owned by nobody, as another pod's would be."""
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
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        fd = int(proc.stdout.readline())
        yield proc.pid, fd
    finally:
        proc.kill()
        proc.wait()


def _proc_reads(caps: list[str], pid: int, fd: int) -> dict[str, str]:
    out = subprocess.run(
        _confined(caps, [sys.executable, "-c", _PROC_PROBE, str(pid), str(fd)]),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return dict(json.loads(out.stdout))


def _doctor(caps: list[str]) -> tuple[int, dict[str, Any]]:
    argv = [
        sys.executable,
        "-c",
        "from tracejoin.commands.cli import main; main()",
        "doctor",
        "--json",
    ]
    out = subprocess.run(
        _confined(caps, argv), capture_output=True, text=True, timeout=120, cwd=REPO
    )
    report = json.loads(out.stdout)
    return out.returncode, {c["name"]: c for c in report["checks"]}


@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_capability_set_is_sufficient_and_each_is_needed(
    other_user_listener: tuple[int, int],
) -> None:
    """Run as the pod runs (uid 0, exactly the manifest's capabilities, no_new_privs): the
    probes compile, load and attach, and another user's /proc/<pid>/fd and /exe resolve.
    Without any one capability, what the docs say it is for breaks."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed: it confines the test process")
    caps = _manifest_capabilities()
    assert set(caps) == CAPABILITIES
    pid, fd = other_user_listener

    code, checks = _doctor(caps)
    assert code == 0, checks
    assert checks["privileges"]["status"] == "available", checks["privileges"]
    assert checks["bpf trial load"]["status"] == "available", checks["bpf trial load"]
    reads = _proc_reads(caps, pid, fd)
    assert reads["fd"].startswith("socket:["), reads
    assert reads["exe"].endswith("/python3") or "python3" in reads["exe"], reads

    for missing in ("BPF", "PERFMON"):
        code, checks = _doctor([c for c in caps if c != missing])
        assert code == 1, f"doctor passed without CAP_{missing}"
        assert f"CAP_{missing}" in checks["privileges"]["detail"], checks["privileges"]
    eacces = "errno:13"
    reads = _proc_reads([c for c in caps if c != "DAC_READ_SEARCH"], pid, fd)
    assert reads["fd"] == eacces and not reads["exe"].startswith("errno"), reads
    reads = _proc_reads([c for c in caps if c != "SYS_PTRACE"], pid, fd)
    assert reads["fd"] == eacces and reads["exe"] == eacces, reads
