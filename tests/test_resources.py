"""The per-process resource (agent/enrich/resources.py): attributes and their precedence, process
facts from psutil, pid recycling and expiry, and Kubernetes metadata that arrives in the
background from a real local kubelet server while lookups never wait for it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
from kubelet_fake import CID, CID2, POD_LIST, UID, FakeKubelet, containerd, pod
from tracejoin import __version__
from tracejoin.app import build_agent, kubelet_client
from tracejoin.config import ConfigError, Settings
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import Resource
from tracejoin.enrich.k8s import KubeletClient, parse_cgroup
from tracejoin.enrich.resources import (
    REVALIDATE_S,
    ProcessFacts,
    ResourceResolver,
    read_process_facts,
    read_process_stamp,
)

OTHER_UID = "99999999-8888-7777-6666-555555555555"
CHECKOUT_K8S = {
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


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Procs:
    """A process-facts function over a table the test edits; counts its calls."""

    def __init__(self, table: dict[int, ProcessFacts | None] | None = None) -> None:
        self.table: dict[int, ProcessFacts | None] = dict(table or {})
        self.calls = 0

    def __call__(self, pid: int) -> ProcessFacts | None:
        self.calls += 1
        return self.table.get(pid)


def in_pod(name: str, cid: str = CID, uid: str = UID, start: float = 1.0) -> ProcessFacts:
    return ProcessFacts(start, name, name, parse_cgroup(containerd(cid, uid)))


def attrs(res: Resource) -> dict[str, object]:
    return dict(res.attributes)


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    k = FakeKubelet()
    yield k
    k.close()


def resolver(
    procs: Procs,
    *,
    kubelet: FakeKubelet | None = None,
    clock: Clock | None = None,
    metrics: Metrics | None = None,
    service_name: str | None = None,
    timeout_s: float = 2.0,
    **kw: object,
) -> ResourceResolver:
    return ResourceResolver(
        metrics or Metrics(),
        service_name=service_name,
        static={"tracejoin.tlb.mode": "flush_fallback"},
        kubelet=KubeletClient(kubelet.url, timeout_s=timeout_s) if kubelet else None,
        node_name="node-a",
        facts=procs,
        clock=clock or Clock(),
        **kw,  # type: ignore[arg-type]
    )


def wait_for(cond: object, what: str, timeout_s: float = 30.0) -> None:
    """Poll until cond() (a liveness guard for background work, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------------------- attributes


def test_resource_of_a_host_process_and_the_precedence_of_its_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "k8s.cluster.name=prod, deployment.environment.name = staging ,team=a%2Cb,,"
        # the agent's own identity: never a served process's
        "k8s.pod.name=agent-pod,k8s.namespace.name=tracejoin,service.name=agent,"
        "process.pid=1,host.name=elsewhere,telemetry.sdk.name=x,tracejoin.tlb.mode=x",
    )
    procs = Procs({42: ProcessFacts(1.0, "nginx", "nginx-bin", None)})
    res = attrs(resolver(procs).resource(42))
    assert res == {
        "k8s.cluster.name": "prod",
        "deployment.environment.name": "staging",
        "team": "a,b",
        "service.name": "nginx",
        "host.name": res["host.name"],
        "process.pid": 42,
        "process.executable.name": "nginx-bin",
        "telemetry.sdk.name": "tracejoin",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.version": __version__,
        "k8s.node.name": "node-a",
        "tracejoin.tlb.mode": "flush_fallback",
    }
    assert res["host.name"] == socket.gethostname()


def test_service_name_flag_wins_and_an_unreadable_executable_is_omitted() -> None:
    procs = Procs({42: ProcessFacts(1.0, "worker-thread-7", None, None)})
    res = attrs(resolver(procs).resource(42))
    assert res["service.name"] == "worker-thread-7"
    assert "process.executable.name" not in res  # never the thread name, never a guess
    named = attrs(resolver(procs, service_name="edge").resource(42))
    assert named["service.name"] == "edge"


def test_a_process_gone_before_the_lookup_is_unknown_service() -> None:
    metrics = Metrics()
    r = resolver(Procs(), metrics=metrics)
    res = attrs(r.resource(77))
    assert res["service.name"] == "unknown_service"
    assert res["process.pid"] == 77
    assert "process.executable.name" not in res
    r.resource(77)
    assert metrics.get("resource_process_gone") == 1


def test_bad_resource_attributes_and_kubelet_url_are_config_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for bad in ("oops", "k=v,=x", "a=b, novalue"):
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", bad)
        with pytest.raises(ValueError, match="OTEL_RESOURCE_ATTRIBUTES: expected key=value"):
            resolver(Procs())
        with pytest.raises(ConfigError, match="OTEL_RESOURCE_ATTRIBUTES: expected key=value"):
            build_agent(Settings(gpu=False), Metrics(), [])
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    with pytest.raises(ConfigError, match=r"kubelet_url \(--kubelet-url\).*NODE_NAME"):
        kubelet_client(Settings(kubelet_url="https://${NODE_NAME}:10250/pods"))
    assert kubelet_client(Settings()) is None
    client = kubelet_client(Settings(kubelet_url="http://$NODE_NAME:10255/pods", node_name="n1"))
    assert client is not None and client.url == "http://n1:10255/pods"


# ------------------------------------------------------------------------------- process facts


def test_read_process_facts_of_real_processes() -> None:
    me = read_process_facts(os.getpid())
    assert me is not None
    assert me.start_time == psutil.Process().create_time()
    assert me.executable == os.path.basename(os.path.realpath(sys.executable))
    assert me.name == psutil.Process().name()
    # a zombie has a name and a start time, but no executable to read: omitted, no fallback
    child = subprocess.Popen(["sleep", "0"])
    try:
        wait_for(
            lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, "a zombie child"
        )
        zombie = read_process_facts(child.pid)
        assert zombie is not None
        assert (zombie.name, zombie.executable) == ("sleep", None)
    finally:
        child.wait()
    assert read_process_facts(child.pid) is None  # reaped: gone


# ------------------------------------------------------------------------------- pid recycling


def test_a_recycled_pid_gets_its_own_resource() -> None:
    metrics, clock = Metrics(), Clock()
    procs = Procs({100: ProcessFacts(1.0, "api", "api", None)})
    r = resolver(procs, clock=clock, metrics=metrics)
    first = r.resource(100)
    assert first.get("service.name") == "api"
    # the process exits; another one, started later, gets pid 100
    procs.table[100] = ProcessFacts(2.0, "cron", "cron", None)
    clock.t += REVALIDATE_S
    second = r.resource(100)
    assert second.get("service.name") == "cron"
    assert second.get("process.executable.name") == "cron"
    assert metrics.get("resource_pid_reused") == 1


def test_a_recycled_pid_never_keeps_another_pods_metadata(kubelet: FakeKubelet) -> None:
    clock = Clock()
    other_cid = "ee" * 32
    kubelet.doc = {"items": [*POD_LIST["items"], pod("batch-xyz", OTHER_UID, {"job": other_cid})]}
    procs = Procs({100: in_pod("python3")})
    r = resolver(procs, kubelet=kubelet, clock=clock)
    assert r.resource(100).get("service.name") == "python3"  # the list is not read yet
    assert r.pods is not None
    r.pods.poll()  # the refresher's step, run here without its thread
    assert attrs(r.resource(100)).items() >= CHECKOUT_K8S.items()
    procs.table[100] = in_pod("python3", other_cid, OTHER_UID, start=2.0)
    clock.t += REVALIDATE_S
    res = attrs(r.resource(100))
    assert (res["k8s.pod.name"], res["k8s.container.name"], res["service.name"]) == (
        "batch-xyz",
        "job",
        "batch-xyz",
    )
    assert "k8s.deployment.name" not in res and "service.version" not in res


def test_facts_are_cached_then_read_again_after_expiry() -> None:
    clock = Clock()
    procs = Procs({100: ProcessFacts(1.0, "api", "api", None)})
    r = resolver(procs, clock=clock)
    first = r.resource(100)
    for _ in range(50):
        assert r.resource(100) is first
    assert procs.calls == 1  # one /proc read for any number of lookups meanwhile
    # same process (same start time) after an exec: its new name is seen once expired
    procs.table[100] = ProcessFacts(1.0, "api-v2", "api-v2", None)
    clock.t += REVALIDATE_S
    assert r.resource(100).get("service.name") == "api-v2"
    assert procs.calls == 2
    # unchanged facts keep the very same Resource object (exporters group spans by it)
    clock.t += REVALIDATE_S
    again = r.resource(100)
    assert again.get("service.name") == "api-v2" and procs.calls == 3
    clock.t += REVALIDATE_S
    assert r.resource(100) is again


def test_an_unchanged_stamp_skips_the_facts_and_keeps_the_resource() -> None:
    """The once-an-interval check reads the process's stamp first: unchanged, the facts are not
    read again and the very same Resource is kept; changed (an exec, a recycled pid), the facts
    are read and the resource rebuilt. Gone (no stamp): the facts say so, as before."""
    clock = Clock()
    procs = Procs({100: ProcessFacts(1.0, "api", "api", None)})
    stamps = {100: b"1 api"}
    r = resolver(procs, clock=clock, stamp=stamps.get)
    first = r.resource(100)
    assert procs.calls == 1
    for _ in range(3):
        clock.t += REVALIDATE_S
        assert r.resource(100) is first
    assert procs.calls == 1  # three checks, no facts read
    procs.table[100], stamps[100] = ProcessFacts(1.0, "api-v2", "api-v2", None), b"1 api-v2"
    clock.t += REVALIDATE_S
    assert r.resource(100).get("service.name") == "api-v2" and procs.calls == 2
    procs.table[100] = None
    del stamps[100]
    clock.t += REVALIDATE_S
    assert r.resource(100).get("service.name") == "unknown_service" and procs.calls == 3


def test_a_real_process_stamp_changes_with_exec_and_not_with_time() -> None:
    """read_process_stamp over /proc: the same for a process that only runs on (its CPU times
    move in the same stat file), another once it execs another program under the same pid."""
    me = read_process_stamp(os.getpid())
    spent = time.process_time()
    while time.process_time() - spent < 0.05:  # past a few of stat's 10 ms CPU ticks
        pass
    assert read_process_stamp(os.getpid()) == me
    child = subprocess.Popen(
        ["sh", "-c", "read _; exec sleep 30"], stdin=subprocess.PIPE, text=True
    )
    try:
        before = read_process_stamp(child.pid)
        assert before is not None and b"sh" in before
        assert read_process_stamp(child.pid) == before
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        wait_for(lambda: read_process_stamp(child.pid) != before, "the exec")
        after = read_process_stamp(child.pid)
        assert after is not None and b"sleep" in after
    finally:
        child.kill()
        child.wait()
    assert read_process_stamp(child.pid) is None  # reaped: gone


def test_the_cache_is_bounded() -> None:
    procs = Procs({p: ProcessFacts(1.0, f"p{p}", None, None) for p in range(10)})
    r = resolver(procs, max_entries=4)
    for p in range(10):
        r.resource(p)
    assert procs.calls == 10
    r.resource(9)  # recent: cached
    assert procs.calls == 10
    r.resource(0)  # evicted: read again
    assert procs.calls == 11


# ------------------------------------------------------------------------------- kubernetes


def test_pod_metadata_arrives_in_the_background(kubelet: FakeKubelet) -> None:
    metrics = Metrics()
    procs = Procs({100: in_pod("python3"), 101: in_pod("envoy", CID2)})
    r = resolver(procs, kubelet=kubelet, metrics=metrics, clock=time.monotonic)  # type: ignore[arg-type]
    scheduled, kubelet.doc = kubelet.doc, {"kind": "PodList", "items": []}
    r.start()  # the start-up sync reads the (empty) list
    try:
        assert metrics.get("kubelet_refreshes") == 1
        kubelet.doc = scheduled  # the pod starts after the agent
        res = attrs(r.resource(100))
        # meanwhile: what the cgroup gives, and nothing invented
        assert res["container.id"] == CID and res["k8s.pod.uid"] == UID
        assert "k8s.pod.name" not in res and res["service.name"] == "python3"
        wait_for(lambda: metrics.get("kubelet_refreshes") == 2, "the pod list")
        assert attrs(r.resource(100)).items() >= CHECKOUT_K8S.items()
        assert attrs(r.resource(101))["k8s.container.name"] == "istio-proxy"
        assert len(kubelet.requests) == 2  # the second container came from the same list
        assert "Authorization" not in kubelet.requests[1]  # never a token over plain http
        assert metrics.get("k8s_resolved", result="container") == 1
        assert metrics.get("k8s_resolved", result="pod") == 2
    finally:
        r.shutdown()


def test_a_slow_kubelet_never_delays_a_lookup(kubelet: FakeKubelet) -> None:
    kubelet.mode, kubelet.delay_s = "slow", 2.0
    metrics = Metrics()
    procs = Procs({100: in_pod("python3")})
    r = resolver(procs, kubelet=kubelet, metrics=metrics, clock=time.monotonic, timeout_s=10)  # type: ignore[arg-type]
    r.start(sync_timeout_s=0)  # lookups while the first list is still on its way
    try:
        assert "k8s.pod.name" not in attrs(r.resource(100))
        wait_for(kubelet.arrived.is_set, "the kubelet request")
        for _ in range(20):  # while the kubelet sleeps
            assert "k8s.pod.name" not in attrs(r.resource(100))
        assert kubelet.answered == 0  # every lookup above returned before the kubelet did
        wait_for(lambda: metrics.get("kubelet_refreshes") == 1, "the slow pod list")
        assert attrs(r.resource(100))["k8s.pod.name"] == "checkout-7d9f8b6c5d-x2x9q"
    finally:
        r.shutdown()


def test_lookups_never_block_on_a_hung_kubelet(kubelet: FakeKubelet) -> None:
    """Fails if resource() waits for the kubelet, or for a lock held across its request: the
    kubelet answers only once the test releases it, after the lookups."""
    kubelet.mode = "hang"
    procs = Procs({100: in_pod("python3"), 200: in_pod("envoy", CID2)})
    r = resolver(procs, kubelet=kubelet, clock=time.monotonic, timeout_s=60)  # type: ignore[arg-type]
    r.start(sync_timeout_s=0.5)  # start-up's wait is bounded too
    results: list[Resource] = []

    def lookups() -> None:
        results.append(r.resource(100))
        kubelet.arrived.wait(30)  # the refresher is now inside its request
        results.append(r.resource(100))
        results.append(r.resource(200))  # a pid not seen yet

    t = threading.Thread(target=lookups, daemon=True)
    try:
        t.start()
        t.join(30)
        assert not t.is_alive(), "resource() blocked while the kubelet was answering"
        assert kubelet.arrived.is_set() and kubelet.answered == 0
        assert [res.get("container.id") for res in results] == [CID, CID, CID2]
        assert all(res.get("k8s.pod.name") is None for res in results)
    finally:
        kubelet.release.set()
        r.shutdown()


def test_a_kubelet_answer_for_another_pods_uid_is_not_adopted(kubelet: FakeKubelet) -> None:
    metrics = Metrics()
    # the cgroup places the checkout container's id under another pod's UID
    procs = Procs({100: in_pod("python3", CID, OTHER_UID)})
    r = resolver(procs, kubelet=kubelet, metrics=metrics)
    assert r.pods is not None
    r.pods.want(CID)
    r.pods.poll()
    res = attrs(r.resource(100))
    assert res["k8s.pod.uid"] == OTHER_UID
    for key in ("k8s.pod.name", "k8s.container.name", "k8s.deployment.name", "service.version"):
        assert key not in res
    assert res["service.name"] == "python3"
    assert metrics.get("kubelet_uid_mismatch") == 1
    # and it is no reason to ask the kubelet again
    assert r.pods.poll() > 0 and len(kubelet.requests) == 1


def test_kubelet_failures_leave_the_cgroup_attributes(kubelet: FakeKubelet) -> None:
    metrics, clock = Metrics(), Clock()
    kubelet.mode = "500"
    procs = Procs({100: in_pod("python3")})
    r = resolver(procs, kubelet=kubelet, clock=clock, metrics=metrics)
    assert r.pods is not None
    r.resource(100)
    r.pods.poll()
    assert metrics.get("kubelet_errors", reason="http_500") == 1
    assert attrs(r.resource(100)) == {
        "service.name": "python3",
        "host.name": attrs(r.resource(100))["host.name"],
        "process.pid": 100,
        "process.executable.name": "python3",
        "telemetry.sdk.name": "tracejoin",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.version": __version__,
        "k8s.node.name": "node-a",
        "container.id": CID,
        "container.runtime.name": "containerd",
        "k8s.pod.uid": UID,
        "tracejoin.tlb.mode": "flush_fallback",
    }


def test_shutdown_is_idempotent_and_safe_without_start(kubelet: FakeKubelet) -> None:
    r = resolver(Procs(), kubelet=kubelet)
    r.shutdown()
    r.shutdown()
    assert r.resource(1).get("process.pid") == 1  # still answers
    plain = resolver(Procs())
    plain.start()
    plain.shutdown()
    plain.shutdown()
