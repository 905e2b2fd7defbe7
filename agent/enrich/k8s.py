"""Container and Kubernetes metadata for a served process's resource (docs/attributes.md,
"Kubernetes metadata").

Where each value comes from:
  - container.id, container.runtime.name, k8s.pod.uid: the process's /proc/<pid>/cgroup path
    (cgroup v1 and v2; containerd, CRI-O and Docker; cgroupfs and systemd cgroup drivers);
  - k8s.pod.name, k8s.namespace.name, k8s.container.name, the workload and the derived
    service.name: the kubelet's pod list, only when --kubelet-url is set;
  - k8s.node.name: --node-name / NODE_NAME (the downward API's spec.nodeName).
Never from the served process's environment: it can hold secrets.

The kubelet is asked on a miss only (a container or pod not in the last list), at most once per
MIN_REFRESH_S, with a timeout of KUBELET_TIMEOUT_S, and after a failure not again until a
backoff (up to MAX_BACKOFF_S) has passed. Failures are counted (kubelet_errors{reason}) and
never fatal: the resource then carries what the cgroup gives.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_TOKEN_FILE = SA_DIR / "token"
SA_CA_FILE = SA_DIR / "ca.crt"
KUBELET_TIMEOUT_S = 2.0
MIN_REFRESH_S = 2.0
MAX_BACKOFF_S = 60.0
MAX_POD_LIST_BYTES = 64 << 20
CGROUP_TTL_S = 60.0  # a pid can be reused by another process
MAX_PIDS = 4096
MAX_ANNOTATION_ATTRS = 16
MAX_ATTR_LEN = 256

# ------------------------------------------------------------------------------- cgroup

_ID = r"([0-9a-f]{64})"
# One path component naming a container, innermost first wins (nested runtimes: kind, DinD).
_CONTAINER_COMPONENTS: tuple[tuple[re.Pattern[str], str | None], ...] = (
    (re.compile(rf"^cri-containerd-{_ID}\.scope$"), "containerd"),
    # containerd's systemd driver on cgroup v1: "kubepods-...-pod<uid>.slice:cri-containerd:<id>"
    (re.compile(rf"(?:^|:)cri-containerd:{_ID}$"), "containerd"),
    (re.compile(rf"^crio-{_ID}(?:\.scope)?$"), "cri-o"),
    (re.compile(rf"(?:^|:)crio:{_ID}$"), "cri-o"),
    (re.compile(rf"^docker-{_ID}\.scope$"), "docker"),
    (re.compile(rf"^libpod-{_ID}\.scope$"), "podman"),
    (re.compile(rf"^{_ID}$"), None),  # cgroupfs driver: runtime from the parent, if at all
)
# conmon (CRI-O's monitor) runs beside the container, not in it: never the workload.
_NOT_A_CONTAINER = re.compile(r"^crio-conmon-[0-9a-f]{64}\.scope$")
_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# "pod<uid>" (cgroupfs) or "kubepods[-<qos>]-pod<uid with _>.slice" (systemd). Static pods'
# UIDs are 32 hex digits (a hash of the manifest), not UUIDs.
_POD = re.compile(rf"(?:^|-)pod({_UUID}|[0-9a-f]{{32}})(?:\.slice)?$")


@dataclass(frozen=True)
class CgroupInfo:
    container_id: str  # 64 hex digits
    runtime: str | None  # "containerd", "cri-o", "docker", "podman"; None when not shown
    pod_uid: str | None  # with dashes, as Kubernetes prints it


def parse_cgroup_path(path: str) -> CgroupInfo | None:
    """Container id, runtime and pod UID from one cgroup path; None without a container id.

    Paths seen from another cgroup namespace start with "/../.."; only components matter.
    """
    parts = [p for p in path.split("/") if p and p != ".."]
    for i in range(len(parts) - 1, -1, -1):
        comp = parts[i]
        if _NOT_A_CONTAINER.match(comp):
            return None
        for pattern, runtime in _CONTAINER_COMPONENTS:
            m = pattern.search(comp)
            if m is None:
                continue
            if runtime is None and i > 0 and parts[i - 1] == "docker":
                runtime = "docker"  # /docker/<id>: Docker's cgroupfs driver
            pod_uid = None
            head = comp[: m.start()].rstrip(":")  # the systemd ":cri-containerd:" form
            for cand in ([head] if head else []) + parts[:i][::-1]:
                pm = _POD.search(cand)
                if pm:
                    pod_uid = pm.group(1).replace("_", "-")
                    break
            return CgroupInfo(m.group(1), runtime, pod_uid)
    return None


def parse_cgroup(text: str) -> CgroupInfo | None:
    """/proc/<pid>/cgroup (v1 "id:controllers:path" lines, v2 "0::path", or both in hybrid
    mode) -> what identifies the container. The v2 line is preferred; a v1 line is used when
    the v2 one names no container (hybrid hosts where only v1 controllers are delegated)."""
    v2: list[str] = []
    v1: list[str] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        (v2 if fields[0] == "0" and fields[1] == "" else v1).append(fields[2])
    for path in v2 + v1:
        info = parse_cgroup_path(path)
        if info is not None:
            return info
    return None


def read_cgroup(pid: int, proc_root: Path = Path("/proc")) -> CgroupInfo | None:
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return parse_cgroup(text)


# ------------------------------------------------------------------------------- kubelet


@dataclass(frozen=True)
class PodMeta:
    uid: str
    name: str
    namespace: str
    owner_kind: str | None = None
    owner_name: str | None = None
    template_hash: str | None = None  # label pod-template-hash
    otel_annotations: tuple[tuple[str, str], ...] = ()  # resource.opentelemetry.io/<key>


@dataclass
class PodIndex:
    by_container: dict[str, tuple[PodMeta, str]] = field(default_factory=dict)
    by_uid: dict[str, PodMeta] = field(default_factory=dict)


_RUNTIME_PREFIX = re.compile(r"^[a-z0-9.+-]+://")
_ANNOTATION_PREFIX = "resource.opentelemetry.io/"
# Keys tracejoin itself measures or detects: an annotation must not relabel them.
_PROTECTED_PREFIXES = ("k8s.", "container.", "process.", "host.", "telemetry.", "tracejoin.")


def _controller(owners: Any) -> tuple[str | None, str | None]:
    if not isinstance(owners, list) or not owners:
        return None, None
    chosen = next((o for o in owners if isinstance(o, dict) and o.get("controller")), owners[0])
    if not isinstance(chosen, dict):
        return None, None
    return _str(chosen.get("kind")), _str(chosen.get("name"))


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def parse_pod_list(doc: Any) -> PodIndex:
    """The kubelet's /pods answer (a v1 PodList) -> pods by container id and by UID.
    Malformed items are skipped; a document that is not a PodList raises ValueError."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValueError("not a PodList (no 'items' list)")
    index = PodIndex()
    for item in doc["items"]:
        if not isinstance(item, dict):
            continue
        md = _dict(item.get("metadata"))
        uid, name, ns = _str(md.get("uid")), _str(md.get("name")), _str(md.get("namespace"))
        if not (uid and name and ns):
            continue
        labels = _dict(md.get("labels"))
        annotations = _dict(md.get("annotations"))
        otel = tuple(
            (k[len(_ANNOTATION_PREFIX) :], v[:MAX_ATTR_LEN])
            for k, v in sorted(annotations.items())
            if isinstance(k, str)
            and k.startswith(_ANNOTATION_PREFIX)
            and isinstance(v, str)
            and len(k) > len(_ANNOTATION_PREFIX)
            and not k[len(_ANNOTATION_PREFIX) :].startswith(_PROTECTED_PREFIXES)
        )[:MAX_ANNOTATION_ATTRS]
        kind, owner = _controller(md.get("ownerReferences"))
        meta = PodMeta(
            uid=uid,
            name=name,
            namespace=ns,
            owner_kind=kind,
            owner_name=owner,
            template_hash=_str(labels.get("pod-template-hash")),
            otel_annotations=otel,
        )
        index.by_uid[uid] = meta
        status = _dict(item.get("status"))
        for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for cs in status.get(key) or []:
                if not isinstance(cs, dict):
                    continue
                cname, cid = _str(cs.get("name")), _str(cs.get("containerID"))
                if cname and cid:
                    index.by_container[_RUNTIME_PREFIX.sub("", cid)] = (meta, cname)
    return index


# Deployment -> ReplicaSet "<deployment>-<hash>"; the hash is made of these characters
# (k8s.io/apimachinery rand.SafeEncodeString), used when the pod-template-hash label is absent.
_RS_HASH = re.compile(r"^(.+)-[bcdfghjklmnpqrstvwxz2456789]{5,10}$")


def workload_attributes(meta: PodMeta, node_name: str | None = None) -> dict[str, AttrValue]:
    """k8s.<workload>.name attributes and the service.name the OTel k8s conventions derive:
    the resource.opentelemetry.io/service.name annotation, else the Deployment, ReplicaSet,
    StatefulSet, DaemonSet or Job name, else the pod name."""
    attrs: dict[str, AttrValue] = {}
    kind, owner = meta.owner_kind, meta.owner_name
    service = None
    if kind == "ReplicaSet" and owner:
        attrs["k8s.replicaset.name"] = owner
        deployment = None
        if meta.template_hash and owner.endswith("-" + meta.template_hash):
            deployment = owner[: -len(meta.template_hash) - 1]
        elif not meta.template_hash:
            m = _RS_HASH.match(owner)
            deployment = m.group(1) if m else None
        if deployment:
            attrs["k8s.deployment.name"] = deployment
        service = deployment or owner
    elif kind in ("StatefulSet", "DaemonSet", "Job") and owner:
        attrs[f"k8s.{kind.lower()}.name"] = owner
        service = owner
    elif kind == "Node" and node_name and meta.name.endswith("-" + node_name):
        service = meta.name[: -len(node_name) - 1]  # a static pod: "<name>-<node>"
    attrs["service.name"] = service or meta.name
    attrs["service.namespace"] = meta.namespace
    for key, value in meta.otel_annotations:
        attrs[key] = value  # includes service.name / service.namespace when annotated
    return attrs


class KubeletError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KubeletClient:
    """GET the kubelet's pod list (stdlib urllib). The bearer token is read at each request
    (projected tokens rotate) and sent over https only."""

    def __init__(
        self,
        url: str,
        *,
        token_file: Path | None = DEFAULT_TOKEN_FILE,
        ca_file: Path | None = None,
        insecure_tls: bool = False,
        timeout_s: float = KUBELET_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.token_file = token_file
        self.timeout_s = timeout_s
        self._https = urllib.parse.urlsplit(url).scheme == "https"
        self._ssl: ssl.SSLContext | None = None
        if self._https:
            if insecure_tls:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            else:
                ca = (
                    ca_file
                    if ca_file is not None
                    else (SA_CA_FILE if SA_CA_FILE.exists() else None)
                )
                ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
            self._ssl = ctx
        self._token_warned = False

    def _token(self) -> str | None:
        if not self._https or self.token_file is None:
            return None
        try:
            return self.token_file.read_text().strip() or None
        except OSError as exc:
            if not self._token_warned:
                log.warning("kubelet: no service-account token (%s); asking without one", exc)
                self._token_warned = True
            return None

    def fetch(self) -> PodIndex:
        req = urllib.request.Request(self.url, headers={"Accept": "application/json"})
        token = self._token()
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ssl) as resp:
                body = resp.read(MAX_POD_LIST_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise KubeletError(f"http_{exc.code}", f"{self.url}: HTTP {exc.code}") from exc
        except urllib.error.URLError as exc:
            r = exc.reason
            if isinstance(r, ssl.SSLError):
                raise KubeletError("tls", f"{self.url}: TLS: {r}") from exc
            if isinstance(r, TimeoutError):
                raise KubeletError("timeout", f"{self.url}: timed out") from exc
            raise KubeletError("connect", f"{self.url}: {r}") from exc
        except TimeoutError as exc:
            raise KubeletError("timeout", f"{self.url}: timed out") from exc
        except ssl.SSLError as exc:
            raise KubeletError("tls", f"{self.url}: TLS: {exc}") from exc
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise KubeletError("connect", f"{self.url}: {exc}") from exc
        if len(body) > MAX_POD_LIST_BYTES:
            raise KubeletError("parse", f"{self.url}: pod list over {MAX_POD_LIST_BYTES} bytes")
        try:
            return parse_pod_list(json.loads(body))
        except ValueError as exc:
            raise KubeletError("parse", f"{self.url}: {exc}") from exc


# ------------------------------------------------------------------------------- resolver


class K8sResolver:
    """pid -> container/Kubernetes resource attributes; SpanBuilder's `resource_for_pid` hook.

    Thread-safe. cgroup results are cached per pid (bounded, expiring); the pod list is
    replaced wholesale at each refresh, so memory stays bounded by the node's pods.
    """

    def __init__(
        self,
        metrics: Metrics,
        *,
        node_name: str | None = None,
        kubelet: KubeletClient | None = None,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        min_refresh_s: float = MIN_REFRESH_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.metrics = metrics
        self.node_name = node_name
        self.kubelet = kubelet
        self.proc_root = proc_root
        self._clock = clock
        self._min_refresh_s = min_refresh_s
        self._max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._cgroups: OrderedDict[int, tuple[float, CgroupInfo | None]] = OrderedDict()
        self._index = PodIndex()
        self._next_refresh = 0.0
        self._failures = 0

    def cgroup(self, pid: int) -> CgroupInfo | None:
        now = self._clock()
        with self._lock:
            hit = self._cgroups.get(pid)
            if hit is not None and now - hit[0] < CGROUP_TTL_S:
                return hit[1]
        info = read_cgroup(pid, self.proc_root)
        with self._lock:
            self._cgroups[pid] = (now, info)
            self._cgroups.move_to_end(pid)
            while len(self._cgroups) > MAX_PIDS:
                self._cgroups.popitem(last=False)
        return info

    def _lookup(self, info: CgroupInfo) -> tuple[PodMeta | None, str | None]:
        hit = self._index.by_container.get(info.container_id)
        if hit is not None:
            return hit
        if info.pod_uid is not None:
            return self._index.by_uid.get(info.pod_uid), None
        return None, None

    def _refresh(self) -> None:
        """Ask the kubelet again unless asked too recently or backing off after failures."""
        assert self.kubelet is not None
        now = self._clock()
        if now < self._next_refresh:
            return
        try:
            index = self.kubelet.fetch()
        except KubeletError as exc:
            self._failures += 1
            backoff = min(self._max_backoff_s, self._min_refresh_s * 2**self._failures)
            self._next_refresh = self._clock() + backoff
            self.metrics.inc("kubelet_errors", reason=exc.reason)
            if self._failures == 1 or self._failures % 10 == 0:
                log.warning(
                    "kubelet pod list failed (%s; %d in a row), retrying in %.0fs: "
                    "pod names are missing meanwhile",
                    exc,
                    self._failures,
                    backoff,
                )
            return
        if self._failures:
            log.info("kubelet pod list read again after %d failures", self._failures)
        self._failures = 0
        self._next_refresh = self._clock() + self._min_refresh_s
        self._index = index
        self.metrics.inc("kubelet_refreshes")
        self.metrics.set("kubelet_pods", len(index.by_uid))

    def __call__(self, pid: int) -> dict[str, AttrValue]:
        attrs: dict[str, AttrValue] = {}
        if self.node_name:
            attrs["k8s.node.name"] = self.node_name
        info = self.cgroup(pid)
        if info is None:
            self.metrics.inc("k8s_resolved", result="host")
            return attrs
        attrs["container.id"] = info.container_id
        if info.runtime:
            attrs["container.runtime.name"] = info.runtime
        if info.pod_uid:
            attrs["k8s.pod.uid"] = info.pod_uid
        meta, cname = None, None
        if self.kubelet is not None:
            with self._lock:  # one refresh at a time; others wait for its answer
                meta, cname = self._lookup(info)
                # only a pod's container is worth asking the kubelet about again
                if info.pod_uid is not None and (meta is None or cname is None):
                    self._refresh()
                    meta, cname = self._lookup(info)
        if meta is None:
            self.metrics.inc("k8s_resolved", result="container")
            return attrs
        attrs["k8s.pod.uid"] = meta.uid
        attrs["k8s.pod.name"] = meta.name
        attrs["k8s.namespace.name"] = meta.namespace
        if cname:
            attrs["k8s.container.name"] = cname
        attrs.update(workload_attributes(meta, self.node_name))
        self.metrics.inc("k8s_resolved", result="pod")
        return attrs


# ------------------------------------------------------------------------------- settings


_NODE_REF = re.compile(r"\$\{NODE_NAME\}|\$\(NODE_NAME\)|\$NODE_NAME\b")


def expand_node_name(url: str, node_name: str | None) -> str:
    """Replace $NODE_NAME, ${NODE_NAME} or $(NODE_NAME) in a kubelet URL; ValueError when the
    URL refers to it and no node name is set."""
    if not _NODE_REF.search(url):
        return url
    if not node_name:
        raise ValueError("refers to NODE_NAME, but no node name is set (--node-name / NODE_NAME)")
    return _NODE_REF.sub(node_name, url)


def parse_resource_attributes(text: str) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES: "k=v,k2=v2", percent-decoded (W3C Baggage octets)."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = urllib.parse.unquote(key.strip()), urllib.parse.unquote(value.strip())
        if not sep or not key:
            raise ValueError(f"expected key=value, got {item.strip()!r}")
        out[key] = value
    return out


# Keys SpanBuilder always sets from the process: environment defaults never replace them.
_PER_PROCESS = frozenset(
    {
        "service.name",
        "host.name",
        "process.pid",
        "process.executable.name",
        "telemetry.sdk.name",
        "telemetry.sdk.language",
        "tracejoin.tlb.mode",
    }
)


def resource_hook(
    resolver: Callable[[int], Mapping[str, AttrValue]] | None,
    env_attributes: Mapping[str, str] | None = None,
) -> Callable[[int], dict[str, AttrValue]]:
    """SpanBuilder's `resource_for_pid`: OTEL_RESOURCE_ATTRIBUTES as defaults (never over a
    value detected for the process, so an agent pod's own k8s.pod.name cannot mislabel the
    pods it observes), then what `resolver` finds for the pid."""
    defaults = {k: v for k, v in (env_attributes or {}).items() if k not in _PER_PROCESS}

    def hook(pid: int) -> dict[str, AttrValue]:
        attrs: dict[str, AttrValue] = dict(defaults)
        if resolver is not None:
            attrs.update(resolver(pid))
        return attrs

    return hook
