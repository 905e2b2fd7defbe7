"""The resource of a served process: what every span it serves says produced it
(docs/attributes.md, "Resource").

`ResourceResolver.resource(pid)` runs on the thread that reads the ring buffer, so it never
waits for the network and never holds a lock across I/O:
  - process facts (psutil: start time, name, executable; the cgroup path) are read from /proc
    the first time a pid is seen, and again when its entry is older than `revalidate_s`;
  - a pid whose process start time changed is another process (the pid was recycled): it gets a
    resource of its own, never the previous process's service.name or pod;
  - Kubernetes metadata comes from a PodCache snapshot refreshed by a background thread. A pod's
    container not in it yet asks for a refresh and gets what the cgroup gives (container.id,
    k8s.pod.uid) meanwhile; once the refresh lands, the next lookup rebuilds the resource.

Attribute precedence, lowest first: OTEL_RESOURCE_ATTRIBUTES (keys that describe the node or
cluster only), the process (service.name = its name, process.*, host.name, telemetry.sdk.*),
the container and pod, `static` (tracejoin.tlb.mode), and --service-name / OTEL_SERVICE_NAME.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import psutil
from opentelemetry.sdk.resources import OTEL_RESOURCE_ATTRIBUTES, OTELResourceDetector
from tracejoin import __version__
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue, Resource
from tracejoin.enrich.correlate import ProcReads
from tracejoin.enrich.k8s import (
    SYNC_TIMEOUT_S,
    CgroupInfo,
    KubeletClient,
    PodCache,
    PodIndex,
    lookup,
    read_cgroup,
    workload_attributes,
)

log = logging.getLogger(__name__)

REVALIDATE_S = 1.0  # how long a pid's facts are trusted before /proc is read again
MAX_ENTRIES = 4096
UNKNOWN_SERVICE = "unknown_service"  # the OpenTelemetry default when no name is known

# OTEL_RESOURCE_ATTRIBUTES describes the agent. Keys that identify one process, container,
# pod, workload or service would describe the agent's own pod, not the processes it observes
# (an agent pod's k8s.pod.name must never label other pods), and the keys tracejoin always
# sets are its own: both are ignored. Node- and cluster-wide keys (k8s.cluster.name, cloud.*,
# deployment.environment.name, ...) apply to every span.
_NOT_FROM_ENV = frozenset(
    {"service.name", "service.instance.id", "host.name", "k8s.namespace.name"}
)
_NOT_FROM_ENV_PREFIXES = (
    "process.",
    "container.",
    "k8s.pod.",
    "k8s.container.",
    "k8s.replicaset.",
    "k8s.deployment.",
    "k8s.statefulset.",
    "k8s.daemonset.",
    "k8s.job.",
    "k8s.cronjob.",
    "telemetry.",
    "tracejoin.",
)


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    start_time: float  # seconds since the epoch (psutil create_time); with the pid, the identity
    name: str  # psutil's name: comm, or argv[0]'s basename when comm is cut at 15 characters
    executable: str | None  # basename of /proc/<pid>/exe; None when it cannot be read
    cgroup: CgroupInfo | None  # None: not in a container


def read_process_facts(pid: int, reads: ProcReads | None = None) -> ProcessFacts | None:
    """psutil's view of pid (/proc/<pid>/stat for start time and name, a readlink of exe)
    plus its cgroup; None when the process is gone. The executable of another user's
    process needs CAP_SYS_PTRACE: without it, it is None, never the thread name, and the
    denial is counted in `reads` (proc_reads_failed{what="exe"})."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            start, name = proc.create_time(), proc.name()
    except psutil.Error:
        return None
    # The link itself, not psutil.exe(): where the link is denied, that guesses from argv[0],
    # which the process chose. A name we did not read is omitted, never guessed.
    try:
        exe: str | None = os.path.basename(os.readlink(f"/proc/{pid}/exe")) or None
    except OSError as exc:
        exe = None
        if reads is not None:
            reads.failed("exe", f"/proc/{pid}/exe", exc)
    return ProcessFacts(start, name, exe, read_cgroup(pid))


def env_resource_attributes() -> dict[str, AttrValue]:
    """OTEL_RESOURCE_ATTRIBUTES as the OpenTelemetry SDK reads it (W3C Baggage octets,
    percent-decoded values), less the keys that cannot describe an observed process. The SDK
    logs and skips an item that is not key=value; the agent refuses to start instead
    (ValueError naming the variable: a ConfigError at start-up), so a typo never silently drops
    an attribute."""
    for item in os.environ.get(OTEL_RESOURCE_ATTRIBUTES, "").split(","):
        key, sep, _ = item.partition("=")
        if item.strip() and (not sep or not key.strip()):
            raise ValueError(
                f"{OTEL_RESOURCE_ATTRIBUTES}: expected key=value, got {item.strip()!r}"
            )
    # the detector also reads OTEL_SERVICE_NAME into service.name: config.py already did (flag >
    # environment > file), and service_name is the resolver's argument, dropped below
    detected = OTELResourceDetector(raise_on_error=True).detect().attributes
    out: dict[str, AttrValue] = {}
    ignored = []
    for key, value in detected.items():
        if key in _NOT_FROM_ENV or key.startswith(_NOT_FROM_ENV_PREFIXES):
            ignored.append(key)
        elif isinstance(value, str | bool | int | float):
            out[key] = value
    if os.environ.get("OTEL_SERVICE_NAME"):  # service.name is then that variable's
        ignored.remove("service.name")
    if ignored:
        log.warning(
            "%s: %s ignored: they would describe the agent, not the processes it observes",
            OTEL_RESOURCE_ATTRIBUTES,
            ", ".join(sorted(ignored)),
        )
    return out


@dataclass(frozen=True, slots=True)
class _Entry:
    facts: ProcessFacts | None  # None: the process was gone when first looked up
    resource: Resource
    valid_until: float  # clock() after which the facts are read again
    pods_generation: int  # the PodCache snapshot the resource was built from


class ResourceResolver:
    """pid -> Resource for the spans it serves. Thread-safe; `resource` is cheap on a hit (a
    dict lookup under a lock never held across I/O) and reads /proc on a miss only."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        service_name: str | None,
        static: Mapping[str, AttrValue],
        kubelet: KubeletClient | None,
        node_name: str | None,
        facts: Callable[[int], ProcessFacts | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        revalidate_s: float = REVALIDATE_S,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.metrics = metrics
        self.pods = PodCache(kubelet, metrics, clock=clock) if kubelet is not None else None
        self._service_name = service_name or None
        self._static = dict(static)
        self._node_name = node_name or None
        # denied reads of another process's executable are counted, and logged once
        self._facts = facts or functools.partial(read_process_facts, reads=ProcReads(metrics))
        self._clock = clock
        self._revalidate_s = revalidate_s
        self._max_entries = max_entries
        # every span's attributes that do not depend on the process, in precedence order
        self._env = env_resource_attributes()
        self._host = socket.gethostname()
        self._lock = threading.Lock()  # guards _cache only
        self._cache: OrderedDict[int, _Entry] = OrderedDict()

    def start(self, sync_timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Start the kubelet refresher; waits up to `sync_timeout_s` for the first pod list, so
        the pods already on the node are named from the first span (start-up, not a reader)."""
        if self.pods is not None:
            self.pods.start(sync_timeout_s)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Stop the kubelet refresher; idempotent, safe without start. `resource` keeps
        answering afterwards (from what it has)."""
        if self.pods is not None:
            self.pods.shutdown(timeout_s)

    def resource(self, pid: int) -> Resource:
        now = self._clock()
        generation, index = self.pods.snapshot if self.pods is not None else (0, None)
        with self._lock:
            entry = self._cache.get(pid)
            fresh = entry is not None and now < entry.valid_until
            if fresh and entry is not None and entry.pods_generation == generation:
                self._cache.move_to_end(pid)
                return entry.resource
        if fresh and entry is not None:
            facts = entry.facts  # only the pod list changed: rebuild, no /proc read
            valid_until = entry.valid_until
        else:
            facts = self._facts(pid)
            valid_until = now + self._revalidate_s
            if facts is None:
                if entry is None or entry.facts is not None:
                    self.metrics.inc("resource_process_gone")
            elif (
                entry is not None
                and entry.facts is not None
                and entry.facts.start_time != facts.start_time
            ):
                self.metrics.inc("resource_pid_reused")
        resource, result, mismatch = self._build(pid, facts, index)
        if entry is not None and entry.resource == resource:
            resource = entry.resource  # unchanged: keep the object exporters group by
        else:
            self.metrics.inc("k8s_resolved", result=result)
            if mismatch:
                self.metrics.inc("kubelet_uid_mismatch")
        with self._lock:
            self._cache[pid] = _Entry(facts, resource, valid_until, generation)
            self._cache.move_to_end(pid)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return resource

    def _build(
        self, pid: int, facts: ProcessFacts | None, index: PodIndex | None
    ) -> tuple[Resource, str, bool]:
        attrs: dict[str, AttrValue] = dict(self._env)
        attrs["service.name"] = facts.name if facts is not None and facts.name else UNKNOWN_SERVICE
        attrs["host.name"] = self._host
        attrs["process.pid"] = pid
        if facts is not None and facts.executable:
            attrs["process.executable.name"] = facts.executable
        attrs["telemetry.sdk.name"] = "tracejoin"
        attrs["telemetry.sdk.language"] = "python"
        attrs["telemetry.sdk.version"] = __version__
        if self._node_name:
            attrs["k8s.node.name"] = self._node_name
        result, mismatch = self._container(
            attrs, facts.cgroup if facts is not None else None, index
        )
        attrs.update(self._static)
        if self._service_name:
            attrs["service.name"] = self._service_name
        return Resource(tuple(attrs.items())), result, mismatch

    def _container(
        self, attrs: dict[str, AttrValue], info: CgroupInfo | None, index: PodIndex | None
    ) -> tuple[str, bool]:
        """Add what the cgroup and the pod list say; returns the k8s_resolved result and
        whether the pod list contradicted the cgroup's pod UID."""
        if info is None:
            return "host", False
        attrs["container.id"] = info.container_id
        if info.runtime:
            attrs["container.runtime.name"] = info.runtime
        if info.pod_uid is None:
            return "container", False  # a container outside Kubernetes: no kubelet knows it
        attrs["k8s.pod.uid"] = info.pod_uid
        if index is None or self.pods is None:
            return "container", False
        meta, cname, mismatch = lookup(index, info)
        if cname is None and not mismatch:
            # not in the list yet: refresh in the background (a contradicting answer is not
            # one a refresh changes: container ids are never reused)
            self.pods.want(info.container_id)
        if meta is None:
            return "container", mismatch
        attrs["k8s.pod.name"] = meta.name
        attrs["k8s.namespace.name"] = meta.namespace
        if cname:
            attrs["k8s.container.name"] = cname
        attrs.update(workload_attributes(meta, self._node_name))
        return "pod", mismatch


__all__ = [
    "ProcessFacts",
    "ResourceResolver",
    "env_resource_attributes",
    "read_process_facts",
]
