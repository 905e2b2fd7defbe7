"""Issue 14: the CUDA calls a request made, on its span, through uprobes on the CUDA libraries.

No GPU here: the libraries are test doubles built at test time (tests/cuda_stubs), exporting the
real symbol names with the real signatures; the runtime calls the driver beneath it as the real
one does. Real uprobes attach to them. Each variant serves GET /work?n=N, which makes exactly:
cudaMalloc(N), cudaMemcpy(N, host to device), cudaStreamSynchronize (the driver sleeps SYNC_US),
cudaMemcpy(N, device to host), cudaFree. The span must show exactly that, once.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import cuda_stubs
import psutil
import pytest
from harness import HERE, Agent, free_ports, new_traceparent, raw_request
from jaeger import parent_span_id, span_tags
from tracejoin.core.model import Span
from tracejoin.kernel.probes import ProbeConfig

pytestmark = pytest.mark.privileged

CUDASERVER = HERE / "servers" / "cudaserver.py"
SYNC_NS = cuda_stubs.SYNC_US * 1000
THRESHOLD_NS = 5_000_000  # syncs this long become child spans; the stub's is 30 ms


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> cuda_stubs.Stubs:
    if cuda_stubs.compiler() is None:
        pytest.skip("no C compiler (gcc) to build the CUDA test doubles")
    return cuda_stubs.build(tmp_path_factory.mktemp("cuda"))


@pytest.fixture(scope="module")
def cuda_agent(jaeger, stubs) -> Iterator[Agent]:
    from conftest import privileged_missing

    if reason := privileged_missing():
        pytest.skip(reason)
    ports = free_ports(8)
    cfg = ProbeConfig(ports=tuple(ports), cuda=True, cuda_sync_threshold_ns=THRESHOLD_NS)
    a = Agent(ports, "http://" + jaeger.otlp_grpc_endpoint, cfg)
    a.start()
    yield a
    a.shutdown()


@contextmanager
def serve(cmd: list[str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert "ready" in proc.stdout.readline(), cmd
        yield proc
    finally:
        proc.kill()
        proc.wait()


def py_server(mode: str, lib: Path, port: int):
    return serve([sys.executable, str(CUDASERVER), mode, str(lib), str(port)])


def work(agent: Agent, port: int, n: int) -> tuple[bytes, Span, list[Span]]:
    """GET /work?n=N with a fresh traceparent: the body, the server span and the spans under it."""
    tp, trace_id, _ = new_traceparent()
    head = f"GET /work?n={n} HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\nConnection: close\r\n\r\n"
    body = raw_request(port, head.encode()).split(b"\r\n\r\n", 1)[1]
    (span,) = agent.server_spans(trace_id)
    time.sleep(0.2)  # children are built with the server span
    kids = [s for s in agent.spans() if s.trace_id == trace_id and s is not span]
    return body, span, kids


def wait_probed(agent: Agent, pid: int, kind: str, timeout_s: float = 20.0):
    """The CUDA file of `kind` that process pid maps, once the agent has attached to it."""
    cuda = agent.source.cuda
    assert cuda is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for f in cuda.files():
            if pid in f.pids and f.kind == kind and f.attached:
                assert not f.error, f.state
                return f
        time.sleep(0.1)
    raise AssertionError(f"no {kind} CUDA file probed for pid {pid}: {cuda.files()}")


def nested(agent: Agent) -> int:
    return agent.source.kernel_counters()["cuda_nested"]


def assert_exact(span: Span, kids: list[Span], n: int, sync_api: str) -> Span:
    """The span shows exactly one request's calls, counted once; returns the sync's child."""
    a = span.attributes
    assert a["tracejoin.cuda.memcpy.bytes.host_to_device"] == n, a
    assert a["tracejoin.cuda.memcpy.bytes.device_to_host"] == n
    assert a["tracejoin.cuda.memcpy.bytes.device_to_device"] == 0
    assert a["tracejoin.cuda.memcpy.count"] == 2  # not 4: the driver calls beneath are not
    assert a["tracejoin.cuda.sync.count"] == 1
    assert a["tracejoin.cuda.sync.wait_ns"] >= SYNC_NS
    assert a["tracejoin.cuda.alloc.bytes"] == n
    assert a["tracejoin.cuda.alloc.count"] == 1
    assert a["tracejoin.cuda.free.count"] == 1
    assert a["tracejoin.cuda.errors"] == 0
    assert "tracejoin.cuda.launches" not in a  # opt-in, not asked for
    assert not [k for k in a if k.startswith("tracejoin.work.shared.cuda")]
    (sync,) = [k for k in kids if "tracejoin.cuda.sync.wait_ns" in k.attributes]
    assert span.trace_id == sync.trace_id
    assert sync.name == sync_api
    assert sync.attributes["tracejoin.cuda.sync.wait_ns"] == a["tracejoin.cuda.sync.wait_ns"]
    assert sync.end_ns - sync.start_ns >= SYNC_NS
    assert span.start_ns <= sync.start_ns <= sync.end_ns <= span.end_ns
    return sync


@pytest.mark.parametrize("name", ["libcudart.so.12", cuda_stubs.HASHED])
def test_runtime_calls_land_on_the_span_once(cuda_agent, stubs, jaeger, name):
    port = cuda_agent.take_port()
    with py_server("shared", stubs.dir / name, port) as proc:
        work(cuda_agent, port, 1)  # the agent sees the process serve: it rescans it
        f = wait_probed(cuda_agent, proc.pid, "runtime")
        assert f.path.endswith(name)
        wait_probed(cuda_agent, proc.pid, "driver")
        for n in (4096, 12345, 1 << 20):
            before = nested(cuda_agent)
            body, span, kids = work(cuda_agent, port, n)
            assert body.split()[:2] == [str(n).encode(), b"2"]  # the stub saw the same copy
            sync = assert_exact(span, kids, n, "cudaStreamSynchronize")
            assert sync.attributes["thread.id"] == span.attributes["thread.id"]
            # five runtime calls, each with a driver call beneath it, counted once
            assert nested(cuda_agent) - before >= 5
    trace = jaeger.get_trace(span.trace_id_hex, min_spans=1 + len(kids))
    (got,) = [s for s in trace["spans"] if s["spanID"] == sync.span_id_hex]
    assert got["operationName"] == "cudaStreamSynchronize"
    assert parent_span_id(got) == span.span_id_hex
    assert span_tags(got)["tracejoin.cuda.sync.wait_ns"] >= SYNC_NS


def test_driver_calls_beneath_no_runtime_call_are_counted_at_their_entry(cuda_agent, stubs):
    """cuMemAlloc_v2, cuMemcpyHtoD_v2, cuMemFree_v2 called directly have no return probe: each
    entry program hands the call to cuda_count (a tail call), which adds it to the request."""
    port = cuda_agent.take_port()
    with py_server("shared", stubs.runtime, port) as proc:
        work(cuda_agent, port, 1)
        wait_probed(cuda_agent, proc.pid, "driver")
        for n in (4096, 54321):
            tp, trace_id, _ = new_traceparent()
            head = (
                f"GET /driver?n={n} HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n"
                "Connection: close\r\n\r\n"
            )
            assert raw_request(port, head.encode()).endswith(b"driver\n")
            (span,) = cuda_agent.server_spans(trace_id)
            a = span.attributes
            assert a["tracejoin.cuda.memcpy.bytes.host_to_device"] == n, a
            assert a["tracejoin.cuda.memcpy.count"] == 1
            assert a["tracejoin.cuda.alloc.bytes"] == n
            assert a["tracejoin.cuda.alloc.count"] == 1
            assert a["tracejoin.cuda.free.count"] == 1
            assert a["tracejoin.cuda.sync.count"] == 0


def test_library_opened_after_the_agent_started_is_found(cuda_agent, stubs, tmp_path):
    # a file of its own: a uprobe is per file, and the other tests' copy may be probed already
    lib = tmp_path / "libcudart.so.12"
    lib.write_bytes(stubs.runtime.read_bytes())
    port = cuda_agent.take_port()
    with py_server("dlopen", lib, port) as proc:
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libcudart" not in maps  # not loaded until the first request
        work(cuda_agent, port, 1)  # ctypes.CDLL now
        wait_probed(cuda_agent, proc.pid, "runtime")
        _, span, kids = work(cuda_agent, port, 65536)
    assert_exact(span, kids, 65536, "cudaStreamSynchronize")


def test_runtime_linked_statically_is_probed_through_the_symbol_table(cuda_agent, stubs):
    port = cuda_agent.take_port()
    with serve([str(stubs.static_server), str(port)]) as proc:
        work(cuda_agent, port, 1)
        f = wait_probed(cuda_agent, proc.pid, "static")
        assert f.path == str(stubs.static_server)
        assert "cudaMemcpy" in f.symbols
        wait_probed(cuda_agent, proc.pid, "driver")
        _, span, kids = work(cuda_agent, port, 777)
    # the runtime's own call names the wait: probed in the executable, not only the driver
    assert_exact(span, kids, 777, "cudaStreamSynchronize")


def test_calls_of_a_worker_process_land_on_the_request_through_the_work_set(cuda_agent, stubs):
    port = cuda_agent.take_port()
    with py_server("worker", stubs.runtime, port) as proc:
        work(cuda_agent, port, 1)  # the worker joins the work set: the agent rescans it
        (worker,) = [c.pid for c in psutil.Process(proc.pid).children()]
        wait_probed(cuda_agent, worker, "runtime")
        results = [work(cuda_agent, port, n) for n in (5000, 300000)]
    for n, (_, span, kids) in zip((5000, 300000), results, strict=True):
        assert span.attributes["tracejoin.work.processes"] >= 2  # the front and the worker
        sync = assert_exact(span, kids, n, "cudaStreamSynchronize")
        assert sync.attributes["thread.id"] == worker  # the worker waited, not the front
        assert span.attributes["thread.id"] != worker
        # under the worker's own span: where the request's work waited on the GPU
        (helper,) = [k for k in kids if k.attributes.get("process.pid") == worker]
        assert sync.parent_span_id == helper.span_id


def test_calls_of_a_batching_worker_are_shared_never_a_request_s_own(cuda_agent, stubs):
    """One GPU worker thread serves two open requests with one set of calls: both spans carry
    them as shared (under tracejoin.work.shared.cuda.*), neither as its own."""
    port = cuda_agent.take_port()
    with py_server("batch", stubs.runtime, port) as proc:
        pair: list[tuple[bytes, Span, list[Span]]] = []

        def batch() -> None:
            out: dict[int, tuple[bytes, Span, list[Span]]] = {}

            def one(i: int) -> None:
                out[i] = work(cuda_agent, port, 1000 * (i + 1))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
            for t in threads:
                # the worker must be asleep again when the second request comes: a wake reaches
                # only a sleeping thread (docs/attributes.md, work set: what it cannot see)
                t.start()
                time.sleep(0.3)
            for t in threads:
                t.join()
            pair[:] = [out[0], out[1]]

        batch()  # the agent sees the process serve: it rescans it
        wait_probed(cuda_agent, proc.pid, "runtime")
        batch()
    for _, span, kids in pair:
        a = span.attributes
        assert a["tracejoin.work.shared_with_max"] >= 1, a
        # the batch's calls (one copy each way of both requests' bytes) are shared ...
        assert a["tracejoin.work.shared.cuda.memcpy.bytes.host_to_device"] == 3000, a
        assert a["tracejoin.work.shared.cuda.memcpy.count"] == 2
        assert a["tracejoin.work.shared.cuda.sync.wait_ns"] >= SYNC_NS
        # ... and never the request's own
        assert a["tracejoin.cuda.memcpy.bytes.host_to_device"] == 0
        assert a["tracejoin.cuda.memcpy.count"] == 0
        assert a["tracejoin.cuda.sync.wait_ns"] == 0
        (sync,) = [k for k in kids if "tracejoin.cuda.sync.wait_ns" in k.attributes]
        assert sync.attributes["tracejoin.work.shared"] is True
