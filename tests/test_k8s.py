"""Container and Kubernetes metadata (agent/k8s.py): cgroup paths of containerd, CRI-O and
Docker under cgroup v1 and v2; the kubelet's pod list served by a real local HTTP(S) server;
service.name derivation; the resource SpanBuilder puts on spans."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubelet_fake import (
    CID,
    CID2,
    POD_LIST,
    UID,
    UID_,
    FakeKubelet,
    make_tls_cert,
    pod,
    tls_server_context,
    v2,
)
from tracejoin.core.metrics import Metrics
from tracejoin.enrich import k8s
from tracejoin.enrich.k8s import (
    CgroupInfo,
    KubeletClient,
    KubeletError,
    PodCache,
    PodMeta,
    expand_node_name,
    lookup,
    parse_cgroup,
    parse_pod_list,
    workload_attributes,
)

STATIC_UID = "5f0c1e2d3c4b5a69788796a5b4c3d2e1"
VICTIM_UID = "99999999-8888-7777-6666-555555555555"
VICTIM_UID_ = VICTIM_UID.replace("-", "_")

# ------------------------------------------------------------------------------- cgroup

V1_CONTROLLERS = ("cpuset", "cpu,cpuacct", "memory", "devices", "pids", "blkio", "freezer")


def v1(path: str, systemd_path: str | None = None) -> str:
    """A cgroup v1 /proc/<pid>/cgroup: every controller at `path`, name=systemd too."""
    lines = [f"{12 - i}:{c}:{path}" for i, c in enumerate(V1_CONTROLLERS)]
    lines.append(f"1:name=systemd:{systemd_path or path}")
    return "\n".join(lines) + "\n"


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
        "a nested cgroup cannot claim another pod (the outermost pod and its container win)",
        v2(
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
            f"cri-containerd-{CID}.scope/kubepods-pod{VICTIM_UID_}.slice/"
            f"cri-containerd-{CID2}.scope"
        ),
        CgroupInfo(CID, "containerd", UID),
    ),
    (
        "Docker inside a pod's container: the container Kubernetes knows",
        v1(f"/kubepods/burstable/pod{UID}/{CID}/docker/{CID2}"),
        CgroupInfo(CID, None, UID),
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


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    k = FakeKubelet()
    yield k
    k.close()


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


def test_kubelet_unreachable_is_a_connect_error(tmp_path: Path) -> None:
    from jaeger import free_port

    client = KubeletClient(f"http://127.0.0.1:{free_port()}/pods", timeout_s=0.5)
    with pytest.raises(KubeletError) as err:
        client.fetch()
    assert err.value.reason == "connect"


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cert = make_tls_cert(tmp_path_factory.mktemp("tls"))
    if cert is None:
        pytest.skip("the kubelet TLS tests need the openssl command (apt-get install openssl)")
    return cert


@pytest.fixture
def tls_kubelet(tls_cert: tuple[Path, Path]) -> Iterator[FakeKubelet]:
    k = FakeKubelet(tls=tls_server_context(tls_cert))
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


def test_lookup_adopts_a_container_only_with_its_own_pod_uid() -> None:
    index = parse_pod_list(POD_LIST)
    meta, cname, mismatch = lookup(index, CgroupInfo(CID, "containerd", UID))
    assert (meta and meta.name, cname, mismatch) == ("checkout-7d9f8b6c5d-x2x9q", "app", False)
    # a cgroup that names the checkout container under another pod's UID: the kubelet's answer
    # for the container is not adopted, and that pod (unknown here) has no metadata
    meta, cname, mismatch = lookup(index, CgroupInfo(CID, "containerd", VICTIM_UID))
    assert (meta, cname, mismatch) == (None, None, True)
    # ... or, when the cgroup's own pod is known, that pod without a container name
    db_uid = "11111111-2222-3333-4444-555555555555"
    meta, cname, mismatch = lookup(index, CgroupInfo(CID, "containerd", db_uid))
    assert (meta and meta.name, cname, mismatch) == ("db-0", None, True)
    # a container the cgroup does not place in a pod claims none
    assert lookup(index, CgroupInfo(CID, "docker", None)) == (None, None, True)


@pytest.mark.parametrize("target_scheme", ["http", "https"])
def test_kubelet_redirect_is_refused_and_the_token_never_follows_it(
    tmp_path: Path, tls_cert: tuple[Path, Path], tls_kubelet: FakeKubelet, target_scheme: str
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    target = FakeKubelet(tls=tls_server_context(tls_cert) if target_scheme == "https" else None)
    try:
        tls_kubelet.mode = "redirect"
        tls_kubelet.location = target.url
        client = KubeletClient(tls_kubelet.url, token_file=token, ca_file=tls_cert[0])
        with pytest.raises(KubeletError) as err:
            client.fetch()
        assert err.value.reason == "redirect"
        assert tls_kubelet.requests[-1]["Authorization"] == "Bearer s3cret-token"
        assert target.requests == []  # not followed: the token went to the kubelet only
    finally:
        target.close()


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(
    "body",
    [DEEP, b'{"items": ' + DEEP + b"}", b'{"items": 5}', b"[1, 2]", b'"PodList"', b"\xff\xfe"],
    ids=["deep-array", "deep-items", "items-not-a-list", "not-an-object", "string", "not-utf8"],
)
def test_garbage_pod_lists_are_parse_errors(kubelet: FakeKubelet, body: bytes) -> None:
    kubelet.mode, kubelet.body = "body", body
    with pytest.raises(KubeletError) as err:
        KubeletClient(kubelet.url).fetch()
    assert err.value.reason == "parse"


def test_pod_list_items_of_the_wrong_types_are_skipped_and_counted() -> None:
    ok = pod("web-0", UID, {"web": CID})
    doc = {
        "items": [
            {"metadata": {"uid": 5, "name": [], "namespace": {}}},
            {"metadata": "x"},
            7,
            {**ok, "status": {"containerStatuses": 5, "initContainerStatuses": "abc"}},
            {
                "metadata": {"uid": VICTIM_UID, "name": "b", "namespace": "n", "labels": []},
                "status": {"containerStatuses": [5, {"name": 3, "containerID": []}]},
            },
        ]
    }
    index = parse_pod_list(doc)
    assert index.invalid == 3
    assert set(index.by_uid) == {UID, VICTIM_UID}
    assert index.by_container == {}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_pod_cache_counts_a_garbage_answer_and_backs_off(kubelet: FakeKubelet) -> None:
    metrics, clock = Metrics(), Clock()
    kubelet.mode, kubelet.body = "body", DEEP
    cache = PodCache(KubeletClient(kubelet.url), metrics, clock=clock)
    cache.want(CID)
    assert cache.poll() == 2 * k8s.MIN_REFRESH_S  # the first backoff
    assert metrics.get("kubelet_errors", reason="parse") == 1
    assert len(kubelet.requests) == 1
    # lookups keep wanting the container: not one more request until the backoff has passed
    for _ in range(100):
        cache.want(CID)
        cache.want(CID2)
        cache.poll()
    assert len(kubelet.requests) == 1
    assert cache.snapshot[0] == 0  # nothing adopted
    clock.t += 2 * k8s.MIN_REFRESH_S
    cache.poll()  # fails again: the backoff doubles
    assert len(kubelet.requests) == 2
    clock.t += 2 * k8s.MIN_REFRESH_S
    cache.poll()
    assert len(kubelet.requests) == 2
    kubelet.mode = "ok"
    clock.t += 2 * k8s.MIN_REFRESH_S
    cache.poll()
    assert len(kubelet.requests) == 3
    generation, index = cache.snapshot
    assert generation == 1 and CID in index.by_container
    assert metrics.get("kubelet_errors", reason="parse") == 2
    assert metrics.get("kubelet_pods_invalid") == 2  # POD_LIST's two malformed items


def test_pod_cache_asks_again_for_a_missing_container_with_a_backoff(
    kubelet: FakeKubelet,
) -> None:
    clock = Clock()
    cache = PodCache(KubeletClient(kubelet.url), Metrics(), clock=clock)
    missing = "ee" * 32
    cache.want(missing)
    cache.poll()
    assert len(kubelet.requests) == 1
    # still not listed: wanting it again does not ask before min_refresh_s * 2
    clock.t += k8s.MIN_REFRESH_S
    cache.want(missing)
    cache.poll()
    assert len(kubelet.requests) == 1
    clock.t += k8s.MIN_REFRESH_S
    cache.want(missing)
    cache.poll()
    assert len(kubelet.requests) == 2
    # nothing wanted: only the resync reads the list again
    clock.t += k8s.MAX_BACKOFF_S
    cache.poll()
    assert len(kubelet.requests) == 2
    clock.t += k8s.RESYNC_S
    cache.poll()
    assert len(kubelet.requests) == 3


def test_pod_cache_thread_refreshes_in_the_background(kubelet: FakeKubelet) -> None:
    cache = PodCache(KubeletClient(kubelet.url), Metrics())
    cache.shutdown()  # safe without start
    cache = PodCache(KubeletClient(kubelet.url), Metrics())
    cache.start()
    try:
        cache.want(CID)
        deadline = time.monotonic() + 30
        while cache.snapshot[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert CID in cache.snapshot[1].by_container
    finally:
        cache.shutdown()
        cache.shutdown()  # idempotent


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


# ------------------------------------------------------------------------------- settings


def test_expand_node_name() -> None:
    for form in ("$NODE_NAME", "${NODE_NAME}", "$(NODE_NAME)"):
        assert expand_node_name(f"https://{form}:10250/pods", "n1") == "https://n1:10250/pods"
    assert expand_node_name("https://10.0.0.1:10250/pods", None) == "https://10.0.0.1:10250/pods"
    with pytest.raises(ValueError, match="NODE_NAME"):
        expand_node_name("https://$NODE_NAME:10250/pods", None)
