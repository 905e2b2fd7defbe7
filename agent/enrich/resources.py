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

  - what the process says about itself (its OTEP 4719 process context; with --read-environ,
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES of its environment) and whether it holds a
    connection to an OTLP port come from a ProcessInspector, which reads them on a thread of its
    own, per (pid, start time), and refreshes them.

Attribute precedence, lowest first: OTEL_RESOURCE_ATTRIBUTES (keys that describe the node or
cluster only), the process (service.name = its name, process.*, host.name, telemetry.sdk.*),
the container and pod, the process's environment (--read-environ), its published process
context, `static` (tracejoin.tlb.mode), and --service-name / OTEL_SERVICE_NAME. So service.name
is, first found: --service-name, the process context, the environment, the pod (annotation,
app.kubernetes.io/name label, workload), the process name (SERVICE_NAME_SOURCES).

Instrumented (the process makes its own SERVER spans; tracejoin's span is then INTERNAL): the
per-service list (--instrumented-services), else --instrumented yes/no, else (auto) a published
process context (certain), else a connection to an OTLP port (a heuristic, said on the span).
"""

from __future__ import annotations

import dataclasses
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
from tracejoin.enrich.inspector import Inspection, ProcessInspector
from tracejoin.enrich.k8s import (
    SYNC_TIMEOUT_S,
    CgroupInfo,
    KubeletClient,
    PodCache,
    PodIndex,
    k8s_service_name_source,
    lookup,
    read_cgroup,
    workload_attributes,
)

log = logging.getLogger(__name__)

REVALIDATE_S = 1.0  # how long a pid's facts are trusted before /proc is read again
MAX_ENTRIES = 4096
UNKNOWN_SERVICE = "unknown_service"  # the OpenTelemetry default when no name is known
# Where service.name came from, first found first (tracejoin.service_name.source on spans).
SERVICE_NAME_SOURCES = (
    "config",  # --service-name / OTEL_SERVICE_NAME of the agent: every span
    "process_context",  # the resource the process published (OTEP 4719)
    "environ",  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES of its environment (opt-in)
    "k8s_annotation",  # pod annotation resource.opentelemetry.io/service.name
    "k8s_label",  # pod label app.kubernetes.io/name
    "k8s_workload",  # the pod's Deployment, ReplicaSet, StatefulSet, DaemonSet, Job, or the pod
    "process_name",  # psutil's name of the process (comm, or argv[0]'s basename)
    "unknown",  # the process was gone before it could be read
)
# How a process is known to make its own spans (tracejoin.instrumented.source on spans).
INSTRUMENTED_SOURCES = ("config", "process_context", "otlp_connection")
INSTRUMENTED_MODES = ("auto", "yes", "no")

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


def read_process_stamp(pid: int) -> bytes | None:
    """What read_process_facts reads pid's facts from, raw and cheap: the comm and start time
    in /proc/<pid>/stat, the exe link, the cgroup file, and argv when psutil's name comes from
    it (a comm cut at 15 characters). Equal stamps, equal facts: the once-a-REVALIDATE_S check
    of a known process is these reads (~20 µs), not psutil's and a rebuilt resource. Taken
    before the facts, so a change between the two is seen at the next check. None: the stat
    file cannot be read (the process is gone); an unreadable link or file is part of it."""
    try:
        stat = _read_bytes(f"/proc/{pid}/stat")
    except OSError:
        return None
    head, _, rest = stat.rpartition(b")")  # the comm may hold spaces and parentheses
    fields = rest.split(b" ", 21)
    if len(fields) < 21:
        return None
    comm = head.partition(b"(")[2]
    parts = [fields[20], comm]  # field 22, the start time in clock ticks since boot
    parts.append(_raw(os.readlink, f"/proc/{pid}/exe"))
    parts.append(_raw(_read_bytes, f"/proc/{pid}/cgroup"))
    if len(comm) >= 15:  # cut: psutil names it from argv[0]
        parts.append(_raw(_read_bytes, f"/proc/{pid}/cmdline"))
    return b"\0\0".join(parts)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _raw(read: Callable[[str], str | bytes], path: str) -> bytes:
    """read(path) as bytes, or the errno it failed with (a denial is part of a stamp too)."""
    try:
        got = read(path)
    except OSError as exc:
        return b"\0" + str(exc.errno).encode()
    return os.fsencode(got) if isinstance(got, str) else got


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
class ServedProcess:
    """What every span a process serves shares: its resource, where its service.name came
    from, and whether (and how it is known that) it makes its own SERVER spans."""

    resource: Resource
    service_name_source: str  # one of SERVICE_NAME_SOURCES
    instrumented: str | None = None  # one of INSTRUMENTED_SOURCES; None: not instrumented


def parse_instrumented_services(items: tuple[str, ...]) -> dict[str, bool]:
    """--instrumented-services values (`name=yes|no`, repeatable or comma-separated) ->
    {service.name: instrumented}. ValueError names the bad item."""
    out: dict[str, bool] = {}
    for item in (part.strip() for value in items for part in value.split(",")):
        if not item:
            continue
        name, sep, answer = item.rpartition("=")
        if not sep or not name.strip() or answer.strip() not in ("yes", "no"):
            raise ValueError(f"expected service.name=yes or service.name=no, got {item!r}")
        out[name.strip()] = answer.strip() == "yes"
    return out


@dataclass(frozen=True, slots=True)
class _Entry:
    facts: ProcessFacts | None  # None: the process was gone when first looked up
    stamp: bytes | None  # read_process_stamp before the facts were read; None: none taken
    served: ServedProcess
    valid_until: float  # clock() after which the facts are read again
    pods_generation: int  # the PodCache snapshot the resource was built from
    inspected_generation: int  # the ProcessInspector generation it was built from


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
        stamp: Callable[[int], bytes | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        revalidate_s: float = REVALIDATE_S,
        max_entries: int = MAX_ENTRIES,
        inspector: ProcessInspector | None = None,
        instrumented: str = "auto",
        instrumented_services: Mapping[str, bool] | None = None,
    ) -> None:
        if instrumented not in INSTRUMENTED_MODES:
            raise ValueError(f"instrumented: {instrumented!r} is not one of auto, yes, no")
        self.metrics = metrics
        self.inspector = inspector
        self._instrumented = instrumented
        self._instrumented_services = dict(instrumented_services or {})
        self.pods = PodCache(kubelet, metrics, clock=clock) if kubelet is not None else None
        self._service_name = service_name or None
        self._static = dict(static)
        self._node_name = node_name or None
        # denied reads of another process's executable are counted, and logged once
        self._facts = facts or functools.partial(read_process_facts, reads=ProcReads(metrics))
        # the cheap check of whether the facts changed: /proc's, unless the facts are a test's
        self._stamp = stamp or (read_process_stamp if facts is None else None)
        self._clock = clock
        self._revalidate_s = revalidate_s
        self._max_entries = max_entries
        # every span's attributes that do not depend on the process, in precedence order
        self._env = env_resource_attributes()
        self._host = socket.gethostname()
        self._lock = threading.Lock()  # guards _cache only
        self._cache: OrderedDict[int, _Entry] = OrderedDict()

    def start(self, sync_timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Read the agent's own network namespace's OTLP connections and start the inspector;
        start the kubelet refresher and wait up to `sync_timeout_s` for the first pod list, so
        the pods already on the node are named from the first span (start-up, not a reader)."""
        if self.inspector is not None:
            self.inspector.read_own_namespace()
            self.inspector.start()
        if self.pods is not None:
            self.pods.start(sync_timeout_s)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Stop the kubelet refresher; idempotent, safe without start. `resource` keeps
        answering afterwards (from what it has)."""
        if self.pods is not None:
            self.pods.shutdown(timeout_s)
        if self.inspector is not None:
            self.inspector.shutdown(timeout_s)

    def resource(self, pid: int) -> Resource:
        return self.served(pid).resource

    def served(self, pid: int) -> ServedProcess:
        now = self._clock()
        generation, index = self.pods.snapshot if self.pods is not None else (0, None)
        inspected = self.inspector.generation if self.inspector is not None else 0
        with self._lock:
            entry = self._cache.get(pid)
            fresh = entry is not None and now < entry.valid_until
            if (
                fresh
                and entry is not None
                and entry.pods_generation == generation
                and entry.inspected_generation == inspected
            ):
                self._cache.move_to_end(pid)
                return entry.served
        if fresh and entry is not None:
            # only the pod list or an inspection changed: no /proc read
            facts, stamp, valid_until = entry.facts, entry.stamp, entry.valid_until
        else:
            # taken before the facts: a change between the two is seen at the next check
            stamp = self._stamp(pid) if self._stamp is not None else None
            valid_until = now + self._revalidate_s
            if entry is not None and stamp is not None and stamp == entry.stamp:
                facts = entry.facts  # read from the same raw facts: not read again
                if entry.pods_generation == generation and entry.inspected_generation == inspected:
                    with self._lock:
                        self._cache[pid] = dataclasses.replace(entry, valid_until=valid_until)
                        self._cache.move_to_end(pid)
                    return entry.served
            else:
                facts = self._facts(pid)
                if facts is None:
                    if entry is None or entry.facts is not None:
                        self.metrics.inc("resource_process_gone")
                elif (
                    entry is not None
                    and entry.facts is not None
                    and entry.facts.start_time != facts.start_time
                ):
                    self.metrics.inc("resource_pid_reused")
        # off the reader thread: a cached answer, or (a new process) a bounded wait for one
        inspection = (
            self.inspector.get((pid, facts.start_time))
            if self.inspector is not None and facts is not None
            else None
        )
        if self.inspector is not None:
            inspected = self.inspector.generation
        served, result, mismatch = self._build(pid, facts, index, inspection)
        if entry is not None and entry.served == served:
            served = entry.served  # unchanged: keep the resource object exporters group by
        else:
            self.metrics.inc("k8s_resolved", result=result)
            self.metrics.inc("service_name_resolved", source=served.service_name_source)
            if mismatch:
                self.metrics.inc("kubelet_uid_mismatch")
        with self._lock:
            self._cache[pid] = _Entry(facts, stamp, served, valid_until, generation, inspected)
            self._cache.move_to_end(pid)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return served

    def _build(
        self,
        pid: int,
        facts: ProcessFacts | None,
        index: PodIndex | None,
        inspection: Inspection | None = None,
    ) -> tuple[ServedProcess, str, bool]:
        attrs: dict[str, AttrValue] = dict(self._env)
        if facts is not None and facts.name:
            attrs["service.name"], source = facts.name, "process_name"
        else:
            attrs["service.name"], source = UNKNOWN_SERVICE, "unknown"
        attrs["host.name"] = self._host
        attrs["process.pid"] = pid
        if facts is not None and facts.executable:
            attrs["process.executable.name"] = facts.executable
        attrs["telemetry.sdk.name"] = "tracejoin"
        attrs["telemetry.sdk.language"] = "python"
        attrs["telemetry.sdk.version"] = __version__
        if self._node_name:
            attrs["k8s.node.name"] = self._node_name
        result, mismatch, k8s_source = self._container(
            attrs, facts.cgroup if facts is not None else None, index
        )
        source = k8s_source or source
        if inspection is not None:
            # what the process says of itself: lowest the environment, then its context
            for said, said_source in (
                (inspection.environ, "environ"),
                (inspection.context, "process_context"),
            ):
                if said:
                    attrs.update(said)
                    if "service.name" in said:
                        source = said_source
        attrs.update(self._static)
        if self._service_name:
            attrs["service.name"], source = self._service_name, "config"
        resource = Resource(tuple(attrs.items()))
        instrumented = self._instrumented_source(str(attrs["service.name"]), inspection)
        return ServedProcess(resource, source, instrumented), result, mismatch

    def _instrumented_source(self, service: str, inspection: Inspection | None) -> str | None:
        """How the process is known to make its own SERVER spans; None when it is not."""
        listed = self._instrumented_services.get(service)
        if listed is not None:
            return "config" if listed else None
        if self._instrumented != "auto":
            return "config" if self._instrumented == "yes" else None
        if inspection is None:
            return None
        if inspection.context is not None:
            return "process_context"  # only an SDK publishes one
        if inspection.otlp_connected:
            return "otlp_connection"  # a heuristic
        return None

    def _container(
        self, attrs: dict[str, AttrValue], info: CgroupInfo | None, index: PodIndex | None
    ) -> tuple[str, bool, str | None]:
        """Add what the cgroup and the pod list say; returns the k8s_resolved result, whether
        the pod list contradicted the cgroup's pod UID, and the service.name source of a pod."""
        if info is None:
            return "host", False, None
        attrs["container.id"] = info.container_id
        if info.runtime:
            attrs["container.runtime.name"] = info.runtime
        if info.pod_uid is None:
            return "container", False, None  # a container outside Kubernetes: no kubelet
        attrs["k8s.pod.uid"] = info.pod_uid
        if index is None or self.pods is None:
            return "container", False, None
        meta, cname, mismatch = lookup(index, info)
        if cname is None and not mismatch:
            # not in the list yet: refresh in the background (a contradicting answer is not
            # one a refresh changes: container ids are never reused)
            self.pods.want(info.container_id)
        if meta is None:
            return "container", mismatch, None
        attrs["k8s.pod.name"] = meta.name
        attrs["k8s.namespace.name"] = meta.namespace
        if cname:
            attrs["k8s.container.name"] = cname
        attrs.update(workload_attributes(meta, self._node_name))
        return "pod", mismatch, k8s_service_name_source(meta)


__all__ = [
    "INSTRUMENTED_SOURCES",
    "SERVICE_NAME_SOURCES",
    "ProcessFacts",
    "ResourceResolver",
    "ServedProcess",
    "env_resource_attributes",
    "parse_instrumented_services",
    "read_process_facts",
]
