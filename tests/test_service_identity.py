"""service.name from what a served process says about itself, and one SERVER span per hop beside
an instrumented server (docs/attributes.md, "service.name" and "Instrumented services").

Pure logic on a fake /proc (maps, mem, environ, net/tcp, fd): the OTEP 4719 reader, the
environment reader, the resolver's order and the instrumented rule. Real processes: a hostile
OTEL_SERVICE_NAME; a reader without CAP_SYS_PTRACE (skipped, counted, next source). The
end-to-end checks with real BPF and a real Jaeger are in test_service_identity_e2e.py.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from records import PID, TID, record
from tracejoin.commands.summary import Summary, add_otlp_json
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import KIND_INTERNAL, KIND_SERVER
from tracejoin.enrich.enricher import Enricher
from tracejoin.enrich.inspector import ProcessInspector
from tracejoin.enrich.k8s import CgroupInfo, PodIndex, PodMeta
from tracejoin.enrich.process_context import (
    MAX_VALUE,
    InvalidContext,
    decode_resource,
    find_mapping,
    parse_otel_environ,
    read_process_context,
)
from tracejoin.enrich.resources import (
    ProcessFacts,
    ResourceResolver,
    ServedProcess,
    parse_instrumented_services,
)
from tracejoin.exporters.otlp_json import encode_request_json
from tracejoin.pipeline.spans import SpanOptions, build_spans

HEADER = struct.Struct("=8sIIQQ")
CTX_ADDR = 0x10000  # where the fake process's OTEL_CTX mapping starts (an offset in fake mem)
SERVER_PID = 4242
START = 1_700_000_000.0


def resource_proto(**attrs: str) -> bytes:
    return ResourceProto(
        attributes=[KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in attrs.items()]
    ).SerializeToString()


def fake_proc(
    root: Path,
    *,
    context: bytes | None = None,
    environ: dict[str, str] | None = None,
    otlp_port: int | None = None,
    maps_name: str = "/memfd:OTEL_CTX (deleted)",
    header: bytes | None = None,
) -> str:
    """A /proc with one process, SERVER_PID, as the inspector reads it."""
    d = root / str(SERVER_PID)
    (d / "net").mkdir(parents=True)
    (d / "fd").mkdir()
    (d / "ns").mkdir()
    (d / "ns" / "net").symlink_to("net:[4026531840]")
    maps = "55d0c0000000-55d0c0001000 r--p 00000000 08:01 1234 /usr/bin/python3.11\n"
    mem = bytearray(CTX_ADDR + 8192)
    if context is not None or header is not None:
        maps += f"{CTX_ADDR:x}-{CTX_ADDR + 8192:x} rw-s 00000000 00:01 99 {maps_name}\n"
        payload = context or b""
        mem[CTX_ADDR : CTX_ADDR + HEADER.size] = header or HEADER.pack(
            b"OTEL_CTX", 2, len(payload), 1, CTX_ADDR + HEADER.size
        )
        mem[CTX_ADDR + HEADER.size : CTX_ADDR + HEADER.size + len(payload)] = payload
    (d / "maps").write_text(maps)
    (d / "mem").write_bytes(bytes(mem))
    env = {"PATH": "/usr/bin", "DB_PASSWORD": "hunter2", **(environ or {})}
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    rows = ""
    if otlp_port is not None:
        rows = (
            f"   0: 0100007F:9C40 0100007F:{otlp_port:04X} 01 00000000:00000000 00:00000000 "
            "00000000     0        0 777001 1 0000000000000000 20 4 30 10 -1\n"
        )
        (d / "fd" / "7").symlink_to("socket:[777001]")
    (d / "fd" / "3").symlink_to("socket:[5]")
    (d / "net" / "tcp").write_text(head + rows)
    (d / "net" / "tcp6").write_text(head)
    return str(root)


def resolver(
    proc: str,
    *,
    read_environ: bool = False,
    instrumented: str = "auto",
    services: dict[str, bool] | None = None,
    service_name: str | None = None,
    cgroup: CgroupInfo | None = None,
    kubelet: bool = False,
    metrics: Metrics | None = None,
) -> ResourceResolver:
    facts = ProcessFacts(START, "python3", "python3.11", cgroup)
    r = ResourceResolver(
        metrics or Metrics(),
        service_name=service_name,
        static={},
        kubelet=None,
        node_name=None,
        facts=lambda _pid: facts,
        inspector=ProcessInspector(Metrics(), read_environ=read_environ, proc=proc),
        instrumented=instrumented,
        instrumented_services=services,
    )
    if kubelet:
        r.pods = _Pods()  # type: ignore[assignment]
    return r


POD_UID = "0f0e0d0c-0b0a-4908-8706-050403020100"
CID = "a" * 64


class _Pods:
    """The PodCache surface the resolver reads: a snapshot with one pod."""

    def __init__(self) -> None:
        meta = PodMeta(
            uid=POD_UID,
            name="checkout-7d9f8b6c5d-x2x9q",
            namespace="shop",
            owner_kind="ReplicaSet",
            owner_name="checkout-7d9f8b6c5d",
            template_hash="7d9f8b6c5d",
            app_name="checkout-app",
        )
        self.snapshot = (1, PodIndex(by_container={CID: (meta, "app")}, by_uid={POD_UID: meta}))

    def want(self, _cid: str) -> None:
        pass


# ------------------------------------------------------------------------------- the readers


@pytest.mark.parametrize(
    ("name", "found"),
    [
        ("/memfd:OTEL_CTX (deleted)", True),
        ("/memfd:OTEL_CTX", True),
        ("[anon:OTEL_CTX]", True),
        ("[anon_shmem:OTEL_CTX]", True),
        ("[anon:OTEL_CTX_old]", False),
        ("/tmp/OTEL_CTX", False),
        ("", False),
    ],
)
def test_the_mapping_is_found_by_its_exact_name(name: str, found: bool) -> None:
    maps = f"7f00-7f02 rw-s 00000000 00:01 9 {name}\n" if name else "7f00-7f02 rw-p 0 00:00 0\n"
    assert find_mapping(maps) == (0x7F00 if found else None)


def test_process_context_is_read_and_cleaned(tmp_path: Path) -> None:
    payload = resource_proto(
        **{
            "service.name": "checkout",
            "service.version": "1.4.2",
            "k8s.pod.name": "someone-else",  # tracejoin's own keys never come from the process
            "process.pid": "1",
            "bad key!": "x",
        }
    )
    proc = fake_proc(tmp_path, context=payload)
    assert read_process_context(SERVER_PID, proc) == {
        "service.name": "checkout",
        "service.version": "1.4.2",
    }


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (HEADER.pack(b"OTEL_CTY", 2, 10, 1, CTX_ADDR + 32), "signature"),
        (HEADER.pack(b"OTEL_CTX", 1, 10, 1, CTX_ADDR + 32), "version"),
        (HEADER.pack(b"OTEL_CTX", 2, 1 << 30, 1, CTX_ADDR + 32), "size"),
        (HEADER.pack(b"OTEL_CTX", 2, 0, 1, CTX_ADDR + 32), "size"),
        (HEADER.pack(b"OTEL_CTX", 2, 64, 1, 1 << 63), "size"),  # beyond any offset
        (HEADER.pack(b"OTEL_CTX", 2, 10, 0, CTX_ADDR + 32), "torn"),  # always being updated
        (HEADER.pack(b"OTEL_CTX", 2, 4, 1, CTX_ADDR + 32), "decode"),  # 4 zero bytes
    ],
)
def test_a_bad_context_is_rejected_by_reason(tmp_path: Path, header: bytes, reason: str) -> None:
    proc = fake_proc(tmp_path, header=header)
    with pytest.raises(InvalidContext) as exc:
        read_process_context(SERVER_PID, proc)
    assert exc.value.reason == reason
    m = Metrics()
    ProcessInspector(m, proc=proc).get((SERVER_PID, START))
    assert m.get("process_context_invalid", reason=reason) == 1


def test_garbage_payload_is_a_decode_error() -> None:
    with pytest.raises(InvalidContext):
        decode_resource(b"\xff\xff\xff\xff")


def test_environ_keeps_only_the_two_variables() -> None:
    env = (
        b"PATH=/bin\0DB_PASSWORD=hunter2\0OTEL_SERVICE_NAME=orders\0"
        b"OTEL_RESOURCE_ATTRIBUTES=service.name=ignored,service.version=2%2E0,"
        b"deployment.environment.name=prod,k8s.pod.name=spoof,host.name=spoof,junk\0"
        b"OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer s3cret\0"
    )
    got = parse_otel_environ(env)
    assert got == {
        "service.name": "orders",  # OTEL_SERVICE_NAME wins, as in the SDK
        "service.version": "2.0",
        "deployment.environment.name": "prod",
    }
    assert "hunter2" not in repr(got) and "s3cret" not in repr(got)
    assert parse_otel_environ(b"PATH=/bin\0HOME=/root\0") is None


def test_hostile_service_name_is_sanitised_and_bounded() -> None:
    hostile = b"\x1b[31mevil\x07\r\n\xc2\x9b\xe2\x80\xae" + b"A" * 10_000
    got = parse_otel_environ(b"OTEL_SERVICE_NAME=" + hostile + b"\0")
    assert got is not None
    name = str(got["service.name"])
    assert len(name) <= MAX_VALUE
    assert name.startswith("\\x1b[31mevil\\x07\\x0d\\x0a\\u009b\\u202e")
    assert name.isprintable()


# ------------------------------------------------------------------------------- the order


def test_context_then_environ_then_k8s_then_process_name(tmp_path: Path) -> None:
    pod = CgroupInfo(CID, "containerd", POD_UID)
    ctx = resource_proto(**{"service.name": "from-context"})
    env = {"OTEL_SERVICE_NAME": "from-environ"}
    cases = [
        (fake_proc(tmp_path / "a", context=ctx, environ=env), True, True, "process_context"),
        (fake_proc(tmp_path / "b", environ=env), True, True, "environ"),
        (fake_proc(tmp_path / "c", environ=env), False, True, "k8s_label"),  # not opted in
        (fake_proc(tmp_path / "d"), True, False, "process_name"),
    ]
    names = {
        "process_context": "from-context",
        "environ": "from-environ",
        "k8s_label": "checkout-app",
        "process_name": "python3",
    }
    for proc, read_environ, in_pod, source in cases:
        r = resolver(
            proc, read_environ=read_environ, cgroup=pod if in_pod else None, kubelet=in_pod
        )
        s = r.served(SERVER_PID)
        assert (s.resource.get("service.name"), s.service_name_source) == (names[source], source)
        assert r.metrics.get("service_name_resolved", source=source) == 1
    # the agent's --service-name / OTEL_SERVICE_NAME names every span, above all of them
    s = resolver(cases[0][0], service_name="edge").served(SERVER_PID)
    assert (s.resource.get("service.name"), s.service_name_source) == ("edge", "config")


def test_k8s_label_then_workload() -> None:
    from tracejoin.enrich.k8s import k8s_service_name_source, workload_attributes

    meta = PodMeta(POD_UID, "web-5f7b-abcde", "shop", "ReplicaSet", "web-5f7b", "5f7b")
    assert workload_attributes(meta)["service.name"] == "web"
    assert k8s_service_name_source(meta) == "k8s_workload"
    labelled = PodMeta(
        POD_UID, "web-5f7b-abcde", "shop", "ReplicaSet", "web-5f7b", "5f7b", "shop-web"
    )
    assert workload_attributes(labelled)["service.name"] == "shop-web"
    assert k8s_service_name_source(labelled) == "k8s_label"


# ------------------------------------------------------------------------------- instrumented


def test_instrumented_by_context_by_otlp_connection_or_by_config(tmp_path: Path) -> None:
    ctx = resource_proto(**{"service.name": "api"})
    with_ctx = fake_proc(tmp_path / "ctx", context=ctx)
    connected = fake_proc(tmp_path / "otlp", otlp_port=4318)
    elsewhere = fake_proc(tmp_path / "other", otlp_port=5432)
    bare = fake_proc(tmp_path / "bare")
    assert resolver(with_ctx).served(SERVER_PID).instrumented == "process_context"
    assert resolver(connected).served(SERVER_PID).instrumented == "otlp_connection"
    assert resolver(elsewhere).served(SERVER_PID).instrumented is None
    assert resolver(bare).served(SERVER_PID).instrumented is None
    assert resolver(bare, instrumented="yes").served(SERVER_PID).instrumented == "config"
    assert resolver(with_ctx, instrumented="no").served(SERVER_PID).instrumented is None
    # the per-service list wins over both
    assert resolver(with_ctx, services={"api": False}).served(SERVER_PID).instrumented is None
    r = resolver(bare, instrumented="no", services={"python3": True})
    assert r.served(SERVER_PID).instrumented == "config"


def test_instrumented_services_parse() -> None:
    assert parse_instrumented_services(("a=yes,b=no", "c.d=yes")) == {
        "a": True,
        "b": False,
        "c.d": True,
    }
    for bad in ("a", "a=maybe", "=yes"):
        with pytest.raises(ValueError, match=r"service\.name=yes"):
            parse_instrumented_services((bad,))


def test_inspections_are_refreshed_and_the_resource_follows(tmp_path: Path) -> None:
    """An SDK that publishes after the process was first seen is picked up at the next
    refresh, off the lookup: the lookup itself keeps answering from the cache."""
    now = [0.0]
    proc = fake_proc(tmp_path)
    m = Metrics()
    inspector = ProcessInspector(m, proc=proc, clock=lambda: now[0], refresh_s=10)
    r = ResourceResolver(
        m,
        service_name=None,
        static={},
        kubelet=None,
        node_name=None,
        facts=lambda _pid: ProcessFacts(START, "python3", "python3.11", None),
        clock=lambda: now[0],
        inspector=inspector,
    )
    assert r.served(SERVER_PID).service_name_source == "process_name"
    shutil.rmtree(tmp_path / str(SERVER_PID))
    fake_proc(tmp_path, context=resource_proto(**{"service.name": "late"}))
    now[0] = 5.0
    assert r.served(SERVER_PID).service_name_source == "process_name"  # not due yet
    now[0] = 11.0
    s = r.served(SERVER_PID)
    assert (s.resource.get("service.name"), s.instrumented) == ("late", "process_context")


# ------------------------------------------------------------------------------- spans


def _spans(served: ServedProcess) -> list:
    enricher = Enricher(Metrics(), lambda _pid: served)
    e = enricher.enrich(record(f"00-{TID:032x}-{PID:016x}-01"))
    assert e is not None
    opts = SpanOptions(frozenset({"recvq", "tcp_stats", "sched", "page_faults"}))
    return build_spans(e, opts, enricher.new_id)


def test_instrumented_request_span_is_internal_with_the_same_parent_and_attributes() -> None:
    from tracejoin.core.model import Resource

    res = Resource((("service.name", "app-server"),))
    plain = _spans(ServedProcess(res, "environ"))
    inst = _spans(ServedProcess(res, "environ", "otlp_connection"))
    assert (plain[0].kind, plain[0].name) == (KIND_SERVER, "GET /x")
    assert (inst[0].kind, inst[0].name) == (KIND_INTERNAL, "GET /x (kernel)")
    assert inst[0].parent_span_id == plain[0].parent_span_id == PID
    assert inst[0].attributes.pop("tracejoin.instrumented.source") == "otlp_connection"
    assert inst[0].attributes == plain[0].attributes
    assert plain[0].attributes["tracejoin.service_name.source"] == "environ"
    # the receive-queue child stays tracejoin's span's child
    assert inst[1].name == "tcp.receive_queue_wait" and inst[1].parent_span_id == inst[0].span_id
    assert not any(s.kind == KIND_SERVER for s in inst)


def test_summary_counts_kernel_spans_and_shows_both_trees() -> None:
    from tracejoin.core.model import Resource

    res = Resource((("service.name", "app-server"),))
    summary, from_file = Summary(), Summary()
    for served in (
        ServedProcess(res, "environ", "otlp_connection"),
        ServedProcess(res, "process_name"),
    ):
        spans = _spans(served)
        for s in spans:
            summary.add_span(s)
        add_otlp_json(from_file, json.loads(encode_request_json(spans)))
    assert summary.requests == from_file.requests == 2
    text = summary.format()
    assert text == from_file.format()
    assert "GET /x (kernel)" in text and "INTERNAL" in text and "SERVER" in text
    assert "otlp_connection" in text and "the app's own SERVER span" in text


# ------------------------------------------------------------------------------- real processes

_SLEEPER = "import sys, time; print('ready', flush=True); time.sleep(60)"


def _sleeper(env: dict[str, str], prefix: list[str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*(prefix or []), sys.executable, "-c", _SLEEPER],
        env={"PATH": os.environ.get("PATH", "/usr/bin"), **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_real_hostile_environment_is_bounded() -> None:
    hostile = "\x1b]0;pwned\x07" + "\x01" * 100 + "B" * 10_000
    proc = _sleeper({"OTEL_SERVICE_NAME": hostile, "API_TOKEN": "t0ken"})
    try:
        m = Metrics()
        r = ResourceResolver(
            m,
            service_name=None,
            static={},
            kubelet=None,
            node_name=None,
            inspector=ProcessInspector(m, read_environ=True),
        )
        s = r.served(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    name = str(s.resource.get("service.name"))
    assert s.service_name_source == "environ"
    assert name.startswith("\\x1b]0;pwned\\x07\\x01") and len(name) == MAX_VALUE
    assert name.isprintable() and "t0ken" not in repr(s)


_READER = """
import json, sys
from tracejoin.core.metrics import Metrics
from tracejoin.enrich.inspector import ProcessInspector
from tracejoin.enrich.resources import ResourceResolver
m = Metrics()
r = ResourceResolver(m, service_name=None, static={}, kubelet=None, node_name=None,
                     inspector=ProcessInspector(m, read_environ=True))
s = r.served(int(sys.argv[1]))
print(json.dumps({
    "name": s.resource.get("service.name"), "source": s.service_name_source,
    "environ": m.get("proc_reads_failed", what="environ", reason="denied"),
    "context": m.get("proc_reads_failed", what="process_context", reason="denied"),
}))
"""


@pytest.mark.usefixtures("require_root")
def test_without_ptrace_access_the_environment_is_skipped_and_counted() -> None:
    """A process of another user (nobody), read by root with the agent pod's default
    capabilities (CAP_BPF, CAP_PERFMON: no CAP_SYS_PTRACE, no CAP_DAC_READ_SEARCH): the kernel
    refuses its environ and its maps; both are counted and the next source (the process name)
    names it. With the opt-in pair the same reader gets its OTEL_SERVICE_NAME."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv(1) (util-linux) is not installed")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    proc = _sleeper({"OTEL_SERVICE_NAME": "nobodys-app"}, nobody)
    try:

        def read(prefix: list[str]) -> dict:
            out = subprocess.run(
                [*prefix, sys.executable, "-c", _READER, str(proc.pid)],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            return dict(json.loads(out.stdout))

        def confined(caps: str) -> list[str]:
            return ["setpriv", "--no-new-privs", f"--bounding-set=-all,{caps}", "--"]

        denied = read(confined("+bpf,+perfmon"))
        allowed = read(confined("+bpf,+perfmon,+sys_ptrace,+dac_read_search"))
        comm = psutil.Process(proc.pid).name()
    finally:
        proc.kill()
        proc.wait()
    # its maps (no context published) are readable on some kernels without the pair, on
    # others counted as process_context denied: either way the next source names it
    assert denied.pop("context") in (0, 1)
    assert denied == {"name": comm, "source": "process_name", "environ": 1}
    assert allowed == {"name": "nobodys-app", "source": "environ", "environ": 0, "context": 0}


def test_the_otlp_check_is_skipped_with_a_context_and_sticky_once_seen(tmp_path: Path) -> None:
    ctx = resource_proto(**{"service.name": "api"})
    both = fake_proc(tmp_path / "both", context=ctx, otlp_port=4317)
    got = ProcessInspector(Metrics(), proc=both).get((SERVER_PID, START))
    assert got is not None and got.context is not None and not got.otlp_connected
    now = [0.0]
    proc = fake_proc(tmp_path / "otlp", otlp_port=4317)
    inspector = ProcessInspector(Metrics(), proc=proc, clock=lambda: now[0], refresh_s=10)
    first = inspector.get((SERVER_PID, START))
    assert first is not None and first.otlp_connected
    (tmp_path / "otlp" / str(SERVER_PID) / "fd" / "7").unlink()  # reconnecting, say
    now[0] = 20.0
    again = inspector.get((SERVER_PID, START))
    assert again is not None and again.otlp_connected and again.read_at == 20.0
    off = ProcessInspector(Metrics(), proc=fake_proc(tmp_path / "off", otlp_port=4317),
                           check_otlp=False)  # fmt: skip
    got = off.get((SERVER_PID, START))
    assert got is not None and not got.otlp_connected


def test_tcp_tables_are_read_again_only_after_a_connection_to_an_otlp_port(
    tmp_path: Path,
) -> None:
    """With the kernel's count of connections to an OTLP port, a namespace's TCP table (a walk
    of the kernel's whole established hash) is read once and again only after the count moves;
    an SDK that connects late is then found at the next refresh. Without the count, every
    refresh, as before."""
    now, connects = [0.0], [3]
    m = Metrics()
    proc = fake_proc(tmp_path / "counted")
    inspector = ProcessInspector(
        m, proc=proc, clock=lambda: now[0], refresh_s=10, otlp_connects=lambda: connects[0]
    )
    key = (SERVER_PID, START)
    first = inspector.get(key)
    assert first is not None and not first.otlp_connected
    assert m.get("otlp_tables_read") == 1
    shutil.rmtree(tmp_path / "counted" / str(SERVER_PID))
    fake_proc(tmp_path / "counted", otlp_port=4318)  # the SDK connected: the kernel counts it
    for t in (11.0, 22.0, 33.0):  # not counted yet (the count lags): the table is not read
        now[0] = t
        got = inspector.get(key)
        assert got is not None and not got.otlp_connected and got.read_at == t
    assert m.get("otlp_tables_read") == 1
    connects[0] = 4
    now[0] = 44.0
    got = inspector.get(key)
    assert got is not None and got.otlp_connected
    assert m.get("otlp_tables_read") == 2

    m = Metrics()  # no count (another record source, or not loaded): every refresh
    now[0] = 0.0
    proc = fake_proc(tmp_path / "uncounted")
    inspector = ProcessInspector(
        m, proc=proc, clock=lambda: now[0], refresh_s=10, otlp_connects=lambda: None
    )
    assert not inspector.get(key).otlp_connected  # type: ignore[union-attr]
    shutil.rmtree(tmp_path / "uncounted" / str(SERVER_PID))
    fake_proc(tmp_path / "uncounted", otlp_port=4318)
    now[0] = 11.0
    assert inspector.get(key).otlp_connected  # type: ignore[union-attr]
    assert m.get("otlp_tables_read") == 2


def test_the_agents_own_namespace_is_read_as_it_starts(tmp_path: Path) -> None:
    """read_own_namespace (at start) reads the tables of the agent's network namespace; a served
    process in that namespace is then inspected without reading them again, and still found
    connected to its collector."""
    m = Metrics()
    proc = fake_proc(tmp_path / "p", otlp_port=4317)
    own = tmp_path / "p" / str(os.getpid())
    shutil.copytree(tmp_path / "p" / str(SERVER_PID), own, symlinks=True)
    inspector = ProcessInspector(m, proc=proc, otlp_connects=lambda: 1)
    inspector.read_own_namespace()
    assert m.get("otlp_tables_read") == 1
    got = inspector.get((SERVER_PID, START))
    assert got is not None and got.otlp_connected
    assert m.get("otlp_tables_read") == 1
    # another namespace is read on its first look, as before
    (tmp_path / "p" / str(SERVER_PID) / "ns" / "net").unlink()
    (tmp_path / "p" / str(SERVER_PID) / "ns" / "net").symlink_to("net:[4026532001]")
    got = inspector.get((SERVER_PID, START + 1))
    assert got is not None and got.otlp_connected
    assert m.get("otlp_tables_read") == 2
    off = Metrics()
    ProcessInspector(off, proc=proc, check_otlp=False).read_own_namespace()
    assert off.get("otlp_tables_read") == 0


def test_perfetto_draws_the_kernel_span_as_the_request() -> None:
    from tracejoin.core.model import Resource
    from tracejoin.exporters.perfetto import TraceEventEncoder

    res = Resource((("service.name", "app-server"), ("process.pid", 77)))
    spans = _spans(ServedProcess(res, "environ", "otlp_connection"))
    events = TraceEventEncoder(spans[0].start_ns).span_events(spans)
    slices = {e["name"]: e for e in events if e["ph"] == "X"}
    request, child = slices["GET /x (kernel)"], slices["tcp.receive_queue_wait"]
    assert (request["cat"], child["cat"]) == ("http", "kernel")
    assert (request["pid"], request["tid"]) == (child["pid"], child["tid"])  # nested under it
