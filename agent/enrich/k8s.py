"""Container and Kubernetes metadata for a served process's resource (docs/attributes.md,
"Kubernetes metadata").

Where each value comes from:
  - container.id, container.runtime.name, k8s.pod.uid: the process's /proc/<pid>/cgroup path
    (cgroup v1 and v2; containerd, CRI-O and Docker; cgroupfs and systemd cgroup drivers);
  - k8s.pod.name, k8s.namespace.name, k8s.container.name, the workload and the derived
    service.name: the kubelet's pod list, only when --kubelet-url is set;
  - k8s.node.name: --node-name / NODE_NAME (the downward API's spec.nodeName).
Never from the served process's environment: it can hold secrets (only resources.py reads two
OTEL_* variables of it, with --read-environ).

The kubelet is asked from a background thread (PodCache), never from the thread that reads the
ring buffer: when a pod's container is not in the last list (at most once per MIN_REFRESH_S, a
container still missing after that backs off on its own), and every RESYNC_S. Each request has
a timeout of KUBELET_TIMEOUT_S; after a failure it is not asked again until a backoff (up to
MAX_BACKOFF_S) has passed. Failures are counted (kubelet_errors{reason}) and never fatal: the
resource then carries what the cgroup gives. Its answer is adopted for a container only when
the pod UID it names is the one in the container's cgroup path.
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
from collections.abc import Callable
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
RESYNC_S = 300.0  # pod annotations and owners can change without a new container
SYNC_TIMEOUT_S = 2.0  # start-up waits at most this for the first pod list
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

    A pod's identity comes from the outermost `pod<uid>` component and the first container
    component at or below it: a process can create cgroups only beneath its own, so whatever it
    nests there (a fake `pod<uid>.slice`, another container's id) comes later and never names
    its pod or container. Outside pods the innermost container wins (a kind node is a Docker
    container). Paths seen from another cgroup namespace start with "/../.."; only components
    matter.
    """
    parts = [p for p in path.split("/") if p and p != ".."]
    pod_uid, first = None, 0
    for i, comp in enumerate(parts):
        # containerd's v1 systemd form puts the pod and the container in one component
        pm = _POD.search(comp.split(":", 1)[0])
        if pm:
            pod_uid, first = pm.group(1).replace("_", "-"), i
            break
    order = range(first, len(parts)) if pod_uid else range(len(parts) - 1, -1, -1)
    for i in order:
        comp = parts[i]
        if _NOT_A_CONTAINER.match(comp):
            return None
        for pattern, runtime in _CONTAINER_COMPONENTS:
            m = pattern.search(comp)
            if m is None:
                continue
            if runtime is None and i > 0 and parts[i - 1] == "docker":
                runtime = "docker"  # /docker/<id>: Docker's cgroupfs driver
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
    app_name: str | None = None  # label app.kubernetes.io/name
    otel_annotations: tuple[tuple[str, str], ...] = ()  # resource.opentelemetry.io/<key>


@dataclass
class PodIndex:
    by_container: dict[str, tuple[PodMeta, str]] = field(default_factory=dict)
    by_uid: dict[str, PodMeta] = field(default_factory=dict)
    invalid: int = 0  # items skipped as malformed


def lookup(index: PodIndex, info: CgroupInfo) -> tuple[PodMeta | None, str | None, bool]:
    """(pod, container name, uid mismatch) for a container the cgroup names. The kubelet's
    answer for the container id is adopted only when it names the cgroup's own pod UID, so a
    cgroup path can never claim another pod's metadata; otherwise the pod is looked up by the
    cgroup's UID (then without a container name)."""
    hit = index.by_container.get(info.container_id)
    mismatch = False
    if hit is not None:
        if hit[0].uid == info.pod_uid:
            return hit[0], hit[1], False
        mismatch = True
    if info.pod_uid is not None:
        return index.by_uid.get(info.pod_uid), None, mismatch
    return None, None, mismatch


APP_NAME_LABEL = "app.kubernetes.io/name"
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


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def parse_pod_list(doc: Any) -> PodIndex:
    """The kubelet's /pods answer (a v1 PodList) -> pods by container id and by UID.
    Every value's type is checked: malformed items are skipped and counted (`invalid`), a
    malformed field is ignored; a document that is not a PodList raises ValueError."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValueError("not a PodList (no 'items' list)")
    index = PodIndex()
    for item in doc["items"]:
        md = _dict(item.get("metadata")) if isinstance(item, dict) else {}
        uid, name, ns = _str(md.get("uid")), _str(md.get("name")), _str(md.get("namespace"))
        if not (isinstance(item, dict) and uid and name and ns):
            index.invalid += 1
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
            app_name=_str(labels.get(APP_NAME_LABEL)),
            otel_annotations=otel,
        )
        index.by_uid[uid] = meta
        status = _dict(item.get("status"))
        for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for cs in _list(status.get(key)):
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
    the resource.opentelemetry.io/service.name annotation, else the app.kubernetes.io/name
    label, else the Deployment, ReplicaSet, StatefulSet, DaemonSet or Job name, else the pod
    name (k8s_service_name_source says which)."""
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
    attrs["service.name"] = meta.app_name or service or meta.name
    attrs["service.namespace"] = meta.namespace
    for key, value in meta.otel_annotations:
        attrs[key] = value  # includes service.name / service.namespace when annotated
    return attrs


def k8s_service_name_source(meta: PodMeta) -> str:
    """Where workload_attributes took service.name from: k8s_annotation, k8s_label or
    k8s_workload (a workload's name, or the pod's)."""
    if any(key == "service.name" for key, _ in meta.otel_annotations):
        return "k8s_annotation"
    return "k8s_label" if meta.app_name else "k8s_workload"


class KubeletError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib follows redirects with every header of the request, Authorization included, to
    whatever host the Location names: the kubelet's pod list never redirects, so refuse."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises HTTPError with the 3xx code


class KubeletClient:
    """GET the kubelet's pod list (stdlib urllib). The bearer token is read at each request
    (projected tokens rotate) and sent over https only, to the configured URL only: redirects
    are refused."""

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
        self._opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=self._ssl), _NoRedirect()
        )
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
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                body = resp.read(MAX_POD_LIST_BYTES + 1)
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:
                raise KubeletError(
                    "redirect",
                    f"{self.url}: HTTP {exc.code} redirect to {exc.headers.get('Location')!r} "
                    "not followed (the token never follows a redirect)",
                ) from exc
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
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            raise KubeletError("parse", f"{self.url}: {type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------------------- pod cache


class PodCache:
    """The kubelet's pod list, read once at start-up (a bounded wait) and then kept fresh by a
    background thread, the way the OpenTelemetry Collector's k8sattributes processor keeps its
    pod informer: readers take `snapshot` (generation, index) without a lock and never wait
    for the kubelet.

    `want(container_id)` (from any thread; O(1), no I/O) asks for a refresh because a pod's
    container is not in the list. The thread then fetches, at most once per `min_refresh_s`;
    a container still missing from the answer is not a reason to ask again for
    `min_refresh_s * 2**misses` (up to `max_backoff_s`). After a failed request, nothing is
    asked until the backoff has passed, whatever `want` is called with. Every `resync_s` the
    list is read again anyway (annotations and owners change without a new container).
    """

    def __init__(
        self,
        client: KubeletClient,
        metrics: Metrics,
        *,
        min_refresh_s: float = MIN_REFRESH_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        resync_s: float = RESYNC_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self._min_refresh_s = min_refresh_s
        self._max_backoff_s = max_backoff_s
        self._resync_s = resync_s
        self._clock = clock
        # replaced whole by the refresher; a reference read is atomic, so readers need no lock
        self.snapshot: tuple[int, PodIndex] = (0, PodIndex())
        self._lock = threading.Lock()  # guards _wanted and _misses only; never held across I/O
        self._wanted: set[str] = set()
        self._misses: dict[str, tuple[int, float]] = {}  # container id -> (misses, not before)
        self._next_fetch = 0.0  # the minimum interval, or the backoff after a failure
        self._resync_at: float | None = None  # after the first list
        self._failures = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._answered = threading.Event()  # the first fetch has succeeded or failed
        self._thread: threading.Thread | None = None

    def start(self, sync_timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Start the refresher and wait (bounded) for its first answer, as an informer syncs
        before the processor runs: the pods already on the node are named from the first
        span on. Start-up may wait; a reader never does."""
        if self._thread is not None or self._stop.is_set():
            return
        self._resync_at = self._clock()  # the first list is due now
        self._thread = threading.Thread(target=self._run, name="tracejoin-kubelet", daemon=True)
        self._thread.start()
        if not self._answered.wait(sync_timeout_s):
            log.warning("kubelet pod list not read within %.0fs of start-up", sync_timeout_s)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Stop the refresher; idempotent, safe without start. A request in flight is not
        waited for beyond `timeout_s` (the thread is a daemon and ends with its timeout)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def want(self, container_id: str) -> None:
        now = self._clock()
        with self._lock:
            miss = self._misses.get(container_id)
            if container_id in self._wanted or (miss is not None and now < miss[1]):
                return
            if len(self._wanted) >= MAX_PIDS:
                return  # a burst of new containers: the next list answers the ones asked
            self._wanted.add(container_id)
        self._wake.set()

    def poll(self) -> float:
        """One step of the refresher: read the list if something is wanted or the resync is
        due, and neither the minimum interval nor a backoff forbids it. Returns the seconds
        until the next step can have work. Blocks on the kubelet: the refresher thread's (and
        tests') to call, never a reader's."""
        now = self._clock()
        with self._lock:
            due = bool(self._wanted) or (self._resync_at is not None and now >= self._resync_at)
        if not due:
            return self._resync_s if self._resync_at is None else self._resync_at - now
        if now < self._next_fetch:
            return self._next_fetch - now
        with self._lock:
            asked, self._wanted = self._wanted, set()
        try:
            index = self.client.fetch()
        except KubeletError as exc:
            self._failures += 1
            backoff = min(self._max_backoff_s, self._min_refresh_s * 2**self._failures)
            self._next_fetch = self._clock() + backoff
            self.metrics.inc("kubelet_errors", reason=exc.reason)
            with self._lock:
                self._wanted |= asked  # still wanted: asked for after the backoff
            if self._failures == 1 or self._failures % 10 == 0:
                log.warning(
                    "kubelet pod list failed (%s; %d in a row), retrying in %.0fs: "
                    "pod names are missing meanwhile",
                    exc,
                    self._failures,
                    backoff,
                )
            return backoff
        if self._failures:
            log.info("kubelet pod list read again after %d failures", self._failures)
        self._failures = 0
        now = self._clock()
        self._next_fetch = now + self._min_refresh_s
        self._resync_at = now + self._resync_s
        self.snapshot = (self.snapshot[0] + 1, index)
        self.metrics.inc("kubelet_refreshes")
        self.metrics.set("kubelet_pods", len(index.by_uid))
        if index.invalid:
            self.metrics.inc("kubelet_pods_invalid", index.invalid)
        with self._lock:
            for cid in asked:
                if cid in index.by_container:
                    self._misses.pop(cid, None)
                    continue
                n = self._misses.get(cid, (0, 0.0))[0] + 1
                self._misses[cid] = (n, now + min(self._max_backoff_s, self._min_refresh_s * 2**n))
            if len(self._misses) > MAX_PIDS:
                self._misses = {c: m for c, m in self._misses.items() if now < m[1]}
        return self._min_refresh_s

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before poll: a want() during the fetch wakes the next wait
            try:
                delay = self.poll()
            except Exception:  # never lose the refresher to a bug; the cgroup attributes remain
                log.exception("kubelet refresher failed")
                delay = self._max_backoff_s
            if self._failures or self.snapshot[0]:
                self._answered.set()
            self._wake.wait(max(0.0, delay))


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
