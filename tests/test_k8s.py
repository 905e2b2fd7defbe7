"""Container and Kubernetes metadata (agent/k8s.py): cgroup paths of containerd, CRI-O and
Docker under cgroup v1 and v2; the kubelet's pod list served by a real local HTTP(S) server;
service.name derivation; the resource SpanBuilder puts on spans."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tracejoin.app import ProcessResources
from tracejoin.core.metrics import Metrics
from tracejoin.enrich import k8s
from tracejoin.enrich.k8s import (
    CgroupInfo,
    K8sResolver,
    KubeletClient,
    KubeletError,
    PodMeta,
    expand_node_name,
    parse_cgroup,
    parse_pod_list,
    parse_resource_attributes,
    resource_hook,
    workload_attributes,
)

CID = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899"
CID2 = "aa" * 32
UID = "7c1e6c5a-0b9e-4d8e-9a51-2f3c4d5e6f70"
UID_ = UID.replace("-", "_")
STATIC_UID = "5f0c1e2d3c4b5a69788796a5b4c3d2e1"

# ------------------------------------------------------------------------------- cgroup

V1_CONTROLLERS = ("cpuset", "cpu,cpuacct", "memory", "devices", "pids", "blkio", "freezer")


def v1(path: str, systemd_path: str | None = None) -> str:
    """A cgroup v1 /proc/<pid>/cgroup: every controller at `path`, name=systemd too."""
    lines = [f"{12 - i}:{c}:{path}" for i, c in enumerate(V1_CONTROLLERS)]
    lines.append(f"1:name=systemd:{systemd_path or path}")
    return "\n".join(lines) + "\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


CGROUP_CASES = [
    # --- containerd
    (
        "containerd v2 systemd driver",
        v2(
            "/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CgroupInfo(CID, "containerd", UID),
    ),
    (
        "containerd v2 guaranteed pod (no QoS slice)",
        v2(f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope"),
        CgroupInfo(CID, "containerd", UID),
    ),
    (
        "containerd v1 cgroupfs driver",
        v1(f"/kubepods/burstable/pod{UID}/{CID}"),
        CgroupInfo(CID, None, UID),
    ),
    (
        "containerd v1 cgroupfs guaranteed pod",
        v1(f"/kubepods/pod{UID}/{CID}"),
        CgroupInfo(CID, None, UID),
    ),
    (
        "containerd v1 systemd driver (slice:prefix:id)",
        v1(
            "/system.slice/containerd.service/"
            f"kubepods-besteffort-pod{UID_}.slice:cri-containerd:{CID}"
        ),
        CgroupInfo(CID, "containerd", UID),
    ),
    (
        "containerd v2 seen from the agent's own cgroup namespace",
        v2(
            f"/../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
            f"cri-containerd-{CID}.scope"
        ),
        CgroupInfo(CID, "containerd", UID),
    ),
    (
        "kind: containerd inside a Docker container",
        v2(
            f"/system.slice/docker-{CID2}.scope/kubelet.slice/kubelet-kubepods.slice/"
            f"kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/"
            f"cri-containerd-{CID}.scope"
        ),
        CgroupInfo(CID, "containerd", UID),
    ),
    (
        "static pod (UID is a manifest hash)",
        v1(f"/kubepods/burstable/pod{STATIC_UID}/{CID}"),
        CgroupInfo(CID, None, STATIC_UID),
    ),
    # --- CRI-O
    (
        "CRI-O v2 systemd driver",
        v2(
            "/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope"
        ),
        CgroupInfo(CID, "cri-o", UID),
    ),
    (
        "CRI-O v1 cgroupfs driver",
        v1(f"/kubepods/besteffort/pod{UID}/crio-{CID}"),
        CgroupInfo(CID, "cri-o", UID),
    ),
    (
        "CRI-O conmon is not the container",
        v2(
            "/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{UID_}.slice/crio-conmon-{CID}.scope"
        ),
        None,
    ),
    # --- Docker
    (
        "Docker v2 systemd driver",
        v2(f"/system.slice/docker-{CID}.scope"),
        CgroupInfo(CID, "docker", None),
    ),
    ("Docker v1 cgroupfs driver", v1(f"/docker/{CID}"), CgroupInfo(CID, "docker", None)),
    (
        "Docker (cri-dockerd) under kubepods, v2",
        v2(
            "/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope"
        ),
        CgroupInfo(CID, "docker", UID),
    ),
    # --- hybrid hosts: v2 line empty, v1 lines carry it
    (
        "hybrid v1+v2, only v1 names the container",
        v1(f"/kubepods/burstable/pod{UID}/{CID}", systemd_path="/") + "0::/\n",
        CgroupInfo(CID, None, UID),
    ),
    (
        "hybrid v1+v2, v2 preferred",
        "0::" + f"/system.slice/docker-{CID}.scope\n" + v1(f"/docker/{CID2}"),
        CgroupInfo(CID, "docker", None),
    ),
    # --- not containers
    ("host process v2", v2("/user.slice/user-0.slice/session-3.scope"), None),
    ("systemd service v2", v2("/system.slice/nginx.service"), None),
    ("root v2", v2("/"), None),
    ("host process v1", v1("/user.slice/user-1000.slice/session-2.scope"), None),
    ("32-hex id is not a container id", v1("/sandbox/1f368082eb9c7cef8d15aa8726c94384"), None),
    ("uppercase hex is not a runtime's id", v2(f"/system.slice/docker-{CID.upper()}.scope"), None),
    ("empty file", "", None),
    ("garbage", "no colons here\n:::\n", None),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in CGROUP_CASES], ids=[c[0] for c in CGROUP_CASES]
)
def test_parse_cgroup(text: str, expected: CgroupInfo | None) -> None:
    assert parse_cgroup(text) == expected


def test_read_cgroup_from_a_proc_tree(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "cgroup").write_text(v2(f"/system.slice/docker-{CID}.scope"))
    assert k8s.read_cgroup(42, tmp_path) == CgroupInfo(CID, "docker", None)
    assert k8s.read_cgroup(43, tmp_path) is None  # gone: nothing, no error


# ------------------------------------------------------------------------------- kubelet


def pod(
    name: str,
    uid: str,
    containers: dict[str, str],
    *,
    namespace: str = "shop",
    owner: tuple[str, str] | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    init: dict[str, str] | None = None,
) -> dict[str, Any]:
    md: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
    if owner:
        md["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Whatever", "name": "not-the-controller"},
            {"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "controller": True},
        ]
    if labels:
        md["labels"] = labels
    if annotations:
        md["annotations"] = annotations
    status: dict[str, Any] = {
        "containerStatuses": [
            {"name": n, "containerID": f"containerd://{cid}", "ready": True}
            for n, cid in containers.items()
        ]
    }
    if init:
        status["initContainerStatuses"] = [
            {"name": n, "containerID": f"cri-o://{cid}"} for n, cid in init.items()
        ]
    return {"metadata": md, "spec": {"nodeName": "node-a"}, "status": status}


CHECKOUT = pod(
    "checkout-7d9f8b6c5d-x2x9q",
    UID,
    {"app": CID, "istio-proxy": CID2},
    owner=("ReplicaSet", "checkout-7d9f8b6c5d"),
    labels={"pod-template-hash": "7d9f8b6c5d", "app": "checkout"},
    annotations={
        "resource.opentelemetry.io/service.version": "1.4.2",
        "resource.opentelemetry.io/k8s.pod.name": "must-not-win",
        "unrelated.example/annotation": "x",
    },
)
POD_LIST = {
    "kind": "PodList",
    "apiVersion": "v1",
    "items": [
        CHECKOUT,
        pod(
            "db-0",
            "11111111-2222-3333-4444-555555555555",
            {"postgres": "bb" * 32},
            owner=("StatefulSet", "db"),
        ),
        pod(
            "node-exporter-abcde",
            "21111111-2222-3333-4444-555555555555",
            {"exp": "cc" * 32},
            owner=("DaemonSet", "node-exporter"),
            namespace="monitoring",
            init={"setup": "dd" * 32},
        ),
        {"metadata": {"name": "broken"}},  # no uid/namespace: skipped
        "not an object",
    ],
}


class FakeKubelet:
    """A real HTTP(S) server answering GET /pods with `self.doc` (or a failure mode)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.doc: Any = POD_LIST
        self.mode = "ok"  # ok | 500 | garbage | slow
        self.requests: list[dict[str, str]] = []
        kube = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                kube.requests.append({"path": self.path, **dict(self.headers.items())})
                if kube.mode == "slow":
                    time.sleep(1.0)
                if kube.mode == "500":
                    body, code = b"boom", 500
                elif kube.mode == "garbage":
                    body, code = b"<html>not json</html>", 200
                else:
                    body, code = json.dumps(kube.doc).encode(), 200
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timeout tests)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}/pods"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    k = FakeKubelet()
    yield k
    k.close()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def proc_tree(root: Path, cgroups: dict[int, str]) -> Path:
    for pid, text in cgroups.items():
        (root / str(pid)).mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "cgroup").write_text(text)
    return root


def containerd(cid: str, uid: str) -> str:
    uid_ = uid.replace("-", "_")
    return v2(
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/"
        f"cri-containerd-{cid}.scope"
    )


def test_parse_pod_list_indexes_containers_and_pods() -> None:
    index = parse_pod_list(POD_LIST)
    assert set(index.by_uid) == {
        UID,
        "11111111-2222-3333-4444-555555555555",
        "21111111-2222-3333-4444-555555555555",
    }
    meta, cname = index.by_container[CID]
    assert (meta.name, meta.namespace, meta.uid, cname) == (
        "checkout-7d9f8b6c5d-x2x9q",
        "shop",
        UID,
        "app",
    )
    assert (meta.owner_kind, meta.owner_name, meta.template_hash) == (
        "ReplicaSet",
        "checkout-7d9f8b6c5d",
        "7d9f8b6c5d",
    )
    assert index.by_container[CID2][1] == "istio-proxy"
    assert index.by_container["dd" * 32][1] == "setup"  # init containers, other runtimes
    # only resource.opentelemetry.io/ annotations, never over what tracejoin detects
    assert meta.otel_annotations == (("service.version", "1.4.2"),)
    with pytest.raises(ValueError, match="PodList"):
        parse_pod_list({"kind": "Status"})


def test_resolver_reads_pod_metadata_from_the_kubelet(tmp_path: Path, kubelet: FakeKubelet) -> None:
    metrics = Metrics()
    procs = proc_tree(tmp_path, {100: containerd(CID, UID), 101: containerd(CID2, UID)})
    r = K8sResolver(
        metrics, node_name="node-a", kubelet=KubeletClient(kubelet.url), proc_root=procs
    )
    attrs = r(100)
    assert attrs == {
        "k8s.node.name": "node-a",
        "container.id": CID,
        "container.runtime.name": "containerd",
        "k8s.pod.uid": UID,
        "k8s.pod.name": "checkout-7d9f8b6c5d-x2x9q",
        "k8s.namespace.name": "shop",
        "k8s.container.name": "app",
        "k8s.replicaset.name": "checkout-7d9f8b6c5d",
        "k8s.deployment.name": "checkout",
        "service.name": "checkout",
        "service.namespace": "shop",
        "service.version": "1.4.2",
    }
    assert r(101)["k8s.container.name"] == "istio-proxy"
    assert len(kubelet.requests) == 1  # the second container came from the cached list
    assert kubelet.requests[0]["path"] == "/pods"
    assert "Authorization" not in kubelet.requests[0]  # never a token over plain http
    assert metrics.get("kubelet_refreshes") == 1
    assert metrics.get("kubelet_pods") == 3
    assert metrics.get("k8s_resolved", result="pod") == 2


def test_resolver_refreshes_on_a_miss_at_most_once_per_interval(
    tmp_path: Path, kubelet: FakeKubelet
) -> None:
    clock = Clock()
    new_uid, new_cid = "99999999-8888-7777-6666-555555555555", "ee" * 32
    procs = proc_tree(tmp_path, {100: containerd(CID, UID), 200: containerd(new_cid, new_uid)})
    r = K8sResolver(Metrics(), kubelet=KubeletClient(kubelet.url), proc_root=procs, clock=clock)
    assert r(100)["k8s.pod.name"] == "checkout-7d9f8b6c5d-x2x9q"
    assert len(kubelet.requests) == 1
    # a pod the list does not have yet: asked again only after the minimum interval
    assert "k8s.pod.name" not in r(200)
    assert len(kubelet.requests) == 1
    kubelet.doc = {"items": [*POD_LIST["items"], pod("new-abc", new_uid, {"web": new_cid})]}
    clock.t += k8s.MIN_REFRESH_S
    attrs = r(200)
    assert len(kubelet.requests) == 2
    assert (attrs["k8s.pod.name"], attrs["k8s.container.name"], attrs["service.name"]) == (
        "new-abc",
        "web",
        "new-abc",  # no owner: the pod name
    )


@pytest.mark.parametrize(
    ("mode", "reason"), [("500", "http_500"), ("garbage", "parse"), ("slow", "timeout")]
)
def test_kubelet_failures_are_counted_and_never_fatal(
    tmp_path: Path, kubelet: FakeKubelet, mode: str, reason: str
) -> None:
    metrics, clock = Metrics(), Clock()
    kubelet.mode = mode
    procs = proc_tree(tmp_path, {100: containerd(CID, UID)})
    client = KubeletClient(kubelet.url, timeout_s=0.3)
    r = K8sResolver(metrics, kubelet=client, proc_root=procs, clock=clock)
    # what the cgroup gives, and nothing invented
    assert r(100) == {
        "container.id": CID,
        "container.runtime.name": "containerd",
        "k8s.pod.uid": UID,
    }
    assert metrics.get("kubelet_errors", reason=reason) == 1
    assert metrics.get("k8s_resolved", result="container") == 1
    # backing off: the next miss does not ask again until the backoff has passed
    n = len(kubelet.requests)
    clock.t += k8s.MIN_REFRESH_S
    assert "k8s.pod.name" not in r(100)
    assert len(kubelet.requests) == n
    kubelet.mode = "ok"
    clock.t += k8s.MAX_BACKOFF_S
    assert r(100)["k8s.pod.name"] == "checkout-7d9f8b6c5d-x2x9q"
    assert metrics.get("kubelet_errors", reason=reason) == 1


def test_kubelet_unreachable_is_a_connect_error(tmp_path: Path) -> None:
    from jaeger import free_port

    client = KubeletClient(f"http://127.0.0.1:{free_port()}/pods", timeout_s=0.5)
    with pytest.raises(KubeletError) as err:
        client.fetch()
    assert err.value.reason == "connect"


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the kubelet TLS tests need the openssl command (apt-get install openssl)")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "kubelet.crt", d / "kubelet.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.fixture
def tls_kubelet(tls_cert: tuple[Path, Path]) -> Iterator[FakeKubelet]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*tls_cert)
    k = FakeKubelet(tls=ctx)
    yield k
    k.close()


def test_kubelet_over_https_sends_the_token_and_verifies_the_certificate(
    tmp_path: Path, tls_cert: tuple[Path, Path], tls_kubelet: FakeKubelet
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    index = KubeletClient(tls_kubelet.url, token_file=token, ca_file=tls_cert[0]).fetch()
    assert CID in index.by_container
    assert tls_kubelet.requests[-1]["Authorization"] == "Bearer s3cret-token"
    # a rotated token is picked up at the next request
    token.write_text("rotated")
    KubeletClient(tls_kubelet.url, token_file=token, ca_file=tls_cert[0]).fetch()
    assert tls_kubelet.requests[-1]["Authorization"] == "Bearer rotated"
    # an unknown CA is refused (and no request reaches the handler)
    n = len(tls_kubelet.requests)
    with pytest.raises(KubeletError) as err:
        KubeletClient(tls_kubelet.url, token_file=token).fetch()
    assert err.value.reason == "tls"
    assert len(tls_kubelet.requests) == n
    # unless verification is switched off explicitly
    insecure = KubeletClient(tls_kubelet.url, token_file=token, insecure_tls=True)
    assert CID in insecure.fetch().by_container


# ------------------------------------------------------------------------------- service.name


def meta(**kw: Any) -> PodMeta:
    base: dict[str, Any] = {"uid": UID, "name": "p-0", "namespace": "ns"}
    base.update(kw)
    return PodMeta(**base)


@pytest.mark.parametrize(
    ("m", "node", "expected"),
    [
        (
            meta(
                name="web-5c9f7b8d4-abcde",
                owner_kind="ReplicaSet",
                owner_name="web-5c9f7b8d4",
                template_hash="5c9f7b8d4",
            ),
            None,
            {
                "service.name": "web",
                "k8s.deployment.name": "web",
                "k8s.replicaset.name": "web-5c9f7b8d4",
            },
        ),
        (  # no pod-template-hash label: the hash's alphabet still gives the Deployment
            meta(owner_kind="ReplicaSet", owner_name="api-gw-6d4cf56db6"),
            None,
            {
                "service.name": "api-gw",
                "k8s.deployment.name": "api-gw",
                "k8s.replicaset.name": "api-gw-6d4cf56db6",
            },
        ),
        (  # a bare ReplicaSet (its name is no Deployment's): no k8s.deployment.name
            meta(owner_kind="ReplicaSet", owner_name="frontend"),
            None,
            {"service.name": "frontend", "k8s.replicaset.name": "frontend"},
        ),
        (  # the label names a hash the ReplicaSet's name does not end with: no guess
            meta(owner_kind="ReplicaSet", owner_name="cache-abc", template_hash="zzz"),
            None,
            {"service.name": "cache-abc", "k8s.replicaset.name": "cache-abc"},
        ),
        (
            meta(name="db-2", owner_kind="StatefulSet", owner_name="db"),
            None,
            {"service.name": "db", "k8s.statefulset.name": "db"},
        ),
        (
            meta(owner_kind="DaemonSet", owner_name="fluent-bit"),
            None,
            {"service.name": "fluent-bit", "k8s.daemonset.name": "fluent-bit"},
        ),
        (
            meta(owner_kind="Job", owner_name="migrate-42"),
            None,
            {"service.name": "migrate-42", "k8s.job.name": "migrate-42"},
        ),
        (  # a static (mirror) pod: "<name>-<node>"
            meta(name="kube-apiserver-node-a", owner_kind="Node", owner_name="node-a"),
            "node-a",
            {"service.name": "kube-apiserver"},
        ),
        (meta(name="debug-shell"), None, {"service.name": "debug-shell"}),
        (
            meta(
                owner_kind="StatefulSet",
                owner_name="db",
                otel_annotations=(("service.name", "orders-db"), ("service.namespace", "team-a")),
            ),
            None,
            {
                "service.name": "orders-db",
                "k8s.statefulset.name": "db",
                "service.namespace": "team-a",
            },
        ),
    ],
    ids=[
        "deployment",
        "deployment-without-hash-label",
        "bare-replicaset",
        "hash-label-mismatch",
        "statefulset",
        "daemonset",
        "job",
        "static-pod",
        "bare-pod",
        "annotation-wins",
    ],
)
def test_service_name_from_the_workload(
    m: PodMeta, node: str | None, expected: dict[str, str]
) -> None:
    expected = {"service.namespace": m.namespace, **expected}
    assert workload_attributes(m, node) == expected


def test_span_resource_carries_k8s_metadata_and_the_flag_wins(
    tmp_path: Path, kubelet: FakeKubelet
) -> None:
    pid = 99_999_999  # no such process: the process name is "pid-99999999"
    procs = proc_tree(tmp_path, {pid: containerd(CID, UID), pid - 1: v2("/user.slice")})
    resolver = K8sResolver(
        Metrics(), node_name="node-a", kubelet=KubeletClient(kubelet.url), proc_root=procs
    )
    hook = resource_hook(resolver, {"k8s.cluster.name": "prod", "k8s.pod.name": "agent-pod"})
    res = ProcessResources(Metrics(), service_name=None, static={}, extra=hook).resource(pid)
    assert res.get("service.name") == "checkout"
    assert res.get("k8s.pod.name") == "checkout-7d9f8b6c5d-x2x9q"  # not the env default
    assert res.get("k8s.cluster.name") == "prod"  # env default fills in
    assert res.get("process.pid") == pid
    host = ProcessResources(Metrics(), service_name=None, static={}, extra=hook).resource(pid - 1)
    assert host.get("service.name") == f"pid-{pid - 1}"  # not in a container: process name
    assert host.get("k8s.node.name") == "node-a"
    assert host.get("container.id") is None
    overridden = ProcessResources(Metrics(), service_name="edge", static={}, extra=hook)
    assert overridden.resource(pid).get("service.name") == "edge"


def test_cgroup_cache_is_bounded_and_expires(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(k8s, "MAX_PIDS", 8)
    clock = Clock()
    procs = proc_tree(tmp_path, {p: containerd(CID, UID) for p in range(1, 21)})
    r = K8sResolver(Metrics(), proc_root=procs, clock=clock)
    for p in range(1, 21):
        assert r.cgroup(p) == CgroupInfo(CID, "containerd", UID)
    assert len(r._cgroups) == 8
    # pid 20 is reused by a host process: seen once the entry expires
    (procs / "20" / "cgroup").write_text(v2("/system.slice/cron.service"))
    assert r.cgroup(20) is not None
    clock.t += k8s.CGROUP_TTL_S
    assert r.cgroup(20) is None


# ------------------------------------------------------------------------------- settings


def test_expand_node_name() -> None:
    for form in ("$NODE_NAME", "${NODE_NAME}", "$(NODE_NAME)"):
        assert expand_node_name(f"https://{form}:10250/pods", "n1") == "https://n1:10250/pods"
    assert expand_node_name("https://10.0.0.1:10250/pods", None) == "https://10.0.0.1:10250/pods"
    with pytest.raises(ValueError, match="NODE_NAME"):
        expand_node_name("https://$NODE_NAME:10250/pods", None)


def test_parse_resource_attributes() -> None:
    assert parse_resource_attributes(" k8s.cluster.name = prod ,team=a%2Cb,, ") == {
        "k8s.cluster.name": "prod",
        "team": "a,b",
    }
    with pytest.raises(ValueError, match="key=value"):
        parse_resource_attributes("novalue")
