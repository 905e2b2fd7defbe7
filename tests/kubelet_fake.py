"""A real local HTTP(S) server standing in for the kubelet's /pods endpoint, and the pod lists
it serves (tests/test_k8s.py, tests/test_resources.py)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CID = "3f4e5d6c7b8a99887766554433221100ffeeddccbbaa00112233445566778899"
CID2 = "aa" * 32
UID = "7c1e6c5a-0b9e-4d8e-9a51-2f3c4d5e6f70"
UID_ = UID.replace("-", "_")


def v2(path: str) -> str:
    return f"0::{path}\n"


def containerd(cid: str, uid: str) -> str:
    """/proc/<pid>/cgroup of a containerd container in a burstable pod (cgroup v2, systemd)."""
    uid_ = uid.replace("-", "_")
    return v2(
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/"
        f"cri-containerd-{cid}.scope"
    )


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
POD_LIST: dict[str, Any] = {
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
    """A real HTTP(S) server answering GET /pods with `self.doc`, or as `self.mode` says:
    ok | 500 | garbage (not JSON) | body (`self.body` as is) | slow (`self.delay_s`, then ok) |
    hang (until `self.release` is set, then ok) | redirect (302 to `self.location`)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.doc: Any = POD_LIST
        self.mode = "ok"
        self.body = b""
        self.delay_s = 2.0
        self.location = ""
        self.release = threading.Event()
        self.arrived = threading.Event()  # set when a request reaches the handler
        self.requests: list[dict[str, str]] = []
        self.answered = 0
        kube = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                kube.requests.append({"path": self.path, **dict(self.headers.items())})
                kube.arrived.set()
                headers = {"Content-Type": "application/json"}
                if kube.mode == "slow":
                    time.sleep(kube.delay_s)
                elif kube.mode == "hang":
                    kube.release.wait(60)
                if kube.mode == "500":
                    body, code = b"boom", 500
                elif kube.mode == "garbage":
                    body, code = b"<html>not json</html>", 200
                elif kube.mode == "body":
                    body, code = kube.body, 200
                elif kube.mode == "redirect":
                    body, code = b"", 302
                    headers["Location"] = kube.location
                else:
                    body, code = json.dumps(kube.doc).encode(), 200
                try:
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    kube.answered += 1
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
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def make_tls_cert(directory: Path) -> tuple[Path, Path] | None:
    """A self-signed certificate for 127.0.0.1 (cert, key); None without the openssl command."""
    if shutil.which("openssl") is None:
        return None
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
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


def tls_server_context(cert: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(*cert)
    return ctx
