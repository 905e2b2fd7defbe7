"""The pipeline, the GPU hold stage and the composition root without root: a fake record source
stands where the BPF ring buffer would be (the privileged tests run the real one)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from records import FakeGpu, record
from tracejoin.app import build_agent
from tracejoin.config import Settings
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import KIND_SERVER, Resource, Span
from tracejoin.enrich.enricher import Enricher
from tracejoin.exporters.base import InMemoryExporter
from tracejoin.exporters.queue import BatchExportQueue
from tracejoin.kernel.probes import ProbeError, ProbeStatus
from tracejoin.pipeline.spans import SpanOptions
from tracejoin.pipeline.stages import IDLE_POLL_MS, POLL_MS, POLL_MS_FDS, GpuHold, Pipeline

SIGNALS = {"recvq": "on", "tcp_stats": "on", "sched": "on", "page_faults": "on"}


def traced(i: int) -> tuple[bytes, int]:
    trace_id = random.getrandbits(128) | 1
    rec = record(f"00-{trace_id:032x}-{i + 1:016x}-01")
    return bytes(rec), trace_id


class FakeSource:
    """A record source shaped like HttpProbes: records 'arrive in the kernel' through push();
    after detach() nothing new arrives, and what was queued can still be polled."""

    def __init__(self, fail_start: bool = False) -> None:
        self.status = ProbeStatus(signals=dict(SIGNALS), tlb_mode="off", load_seconds=0.01)
        self.calls: list[str] = []
        self._queue: list[bytes] = []
        self._lock = threading.Lock()
        self.detached = False
        self.fail_start = fail_start
        self.lost_after_detach = 0
        self.waits: list[int] = []  # each poll's timeout, in order

    def push(self, data: bytes) -> None:
        with self._lock:
            if self.detached:
                self.lost_after_detach += 1
            else:
                self._queue.append(data)

    def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise ProbeError("required tracepoint(s) missing: sock:sock_recv_length")

    def poll(self, timeout_ms: int) -> list[bytes]:
        self.waits.append(timeout_ms)
        with self._lock:
            batch, self._queue = self._queue, []
        if not batch and timeout_ms:
            time.sleep(timeout_ms / 1000 / 10)
        if timeout_ms == 0:
            self.calls.append("drain")
        return batch

    def detach(self) -> None:
        self.calls.append("detach")
        with self._lock:
            self.detached = True

    def kernel_counters(self) -> dict[str, int]:
        return {"records_submitted": 0}

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class RecordingExporter(InMemoryExporter):
    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.order = order

    def shutdown(self) -> None:
        self.order.append("destination_shutdown")


def resource(_pid: int) -> Resource:
    return Resource((("service.name", "svc"),))


def pipeline_over(
    source: FakeSource, gpu_hold: GpuHold | None = None
) -> tuple[Pipeline, InMemoryExporter, Metrics]:
    metrics = Metrics()
    memory = RecordingExporter(source.calls)
    queue = BatchExportQueue(memory, metrics, flush_interval_s=0.02, name="memory")
    queue.start()
    pipe = Pipeline(
        source,
        Enricher(metrics, resource),
        SpanOptions.from_status(source.status.signals, "off", 1_000_000),
        [queue],
        metrics,
        gpu_hold=gpu_hold,
    )
    return pipe, memory, metrics


def test_records_flow_one_way_to_the_destination():
    source = FakeSource()
    pipe, memory, metrics = pipeline_over(source)
    pipe.start()
    ids = []
    for i in range(20):
        data, trace_id = traced(i)
        source.push(data)
        ids.append(trace_id)
    source.push(b"\x07garbage")  # an unknown record type: counted, not fatal
    deadline = time.monotonic() + 10
    while len([s for s in memory.spans if s.kind == KIND_SERVER]) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pipe.shutdown(2.0)
    servers = [s for s in memory.spans if s.kind == KIND_SERVER]
    assert sorted(s.trace_id for s in servers) == sorted(ids)
    assert metrics.get("records_received") == 21
    assert metrics.get("decode_errors", reason="unknown_type") == 1
    assert metrics.get("records_dropped_userspace", reason="undecodable") == 1
    assert metrics.get("spans_built") == len(memory.spans)


@pytest.mark.parametrize("from_fds", [False, True], ids=["addresses_carried", "from_fds"])
def test_an_idle_reader_waits_longer_and_records_bring_it_back(from_fds: bool):
    """Each empty wait doubles the next, up to IDLE_POLL_MS; a batch with records resets it. A
    source whose records may name their connection by fd only is read sooner (POLL_MS_FDS),
    while /proc/<pid>/fd/<fd> is still open."""
    source = FakeSource()
    source.addresses_from_fds = from_fds  # type: ignore[attr-defined]
    busy = POLL_MS_FDS if from_fds else POLL_MS
    assert POLL_MS_FDS < POLL_MS
    pipe, memory, _ = pipeline_over(source)
    pipe.start()
    deadline = time.monotonic() + 10
    while source.waits.count(IDLE_POLL_MS) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    doubling = [busy]
    while doubling.count(IDLE_POLL_MS) < 2:
        doubling.append(min(2 * doubling[-1], IDLE_POLL_MS))
    assert source.waits[: len(doubling)] == doubling
    seen = len(source.waits)
    source.push(traced(0)[0])
    while not memory.spans or busy not in source.waits[seen:]:
        assert time.monotonic() < deadline, source.waits[seen:]
        time.sleep(0.01)
    pipe.shutdown(2.0)


class BlockingSource(FakeSource):
    """A poll that waits until released: a reader in a long wait when the pause comes."""

    def __init__(self) -> None:
        super().__init__()
        self.polling, self.release = threading.Event(), threading.Event()

    def poll(self, timeout_ms: int) -> list[bytes]:
        self.polling.set()
        self.release.wait(10)
        self.polling.clear()
        return super().poll(0)


def test_pausing_returns_once_no_poll_is_under_way():
    """A poll begun before the pause must not take records after it: pause_reading waits for
    the reader to leave its wait (up to IDLE_POLL_MS on an idle agent)."""
    source = BlockingSource()
    pipe, _, _ = pipeline_over(source)
    pipe.start()
    assert source.polling.wait(5)
    pauser = threading.Thread(target=pipe.pause_reading, args=(True,))
    pauser.start()
    pauser.join(0.3)
    assert pauser.is_alive(), "returned while the reader was still in its poll"
    source.release.set()
    pauser.join(5)
    assert not pauser.is_alive() and not source.polling.is_set()
    polls = len(source.waits)
    source.push(traced(0)[0])
    time.sleep(0.2)
    assert len(source.waits) == polls and source._queue, "paused: nothing is read"
    pipe.pause_reading(False)
    pipe.shutdown(2.0)


def test_shutdown_detaches_before_it_drains_and_loses_nothing_queued():
    """Records the kernel queued before the detach are exported; the order is detach, drain,
    close the source, then flush the destinations."""
    source = FakeSource()
    pipe, memory, metrics = pipeline_over(source)
    pipe.start()
    pipe.pause_reading(True)  # the reader is behind: records pile up in the "ring buffer"
    ids = []
    for i in range(50):
        data, trace_id = traced(i)
        source.push(data)
        ids.append(trace_id)
    pipe.shutdown(2.0)
    source.push(traced(99)[0])  # after the detach: never arrives
    assert source.calls[0] == "detach"
    assert source.calls.index("drain") > source.calls.index("detach")
    assert source.calls.index("shutdown") > source.calls.index("drain")
    assert source.calls[-1] == "destination_shutdown"
    assert sorted(s.trace_id for s in memory.spans if s.kind == KIND_SERVER) == sorted(ids)
    assert metrics.get("records_received") == 50
    assert source.lost_after_detach == 1
    pipe.shutdown(2.0)  # idempotent
    assert source.calls.count("shutdown") == 1


class StuckDetachSource(FakeSource):
    """A source whose detach blocks until released, as a tracepoint detach does while the kernel
    verifier keeps a CPU busy (HTTP/2's programs after ready)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def detach(self) -> None:
        self.calls.append("detach")
        self.release.wait(30)
        with self._lock:
            self.detached = True


def test_shutdown_holds_its_bound_while_the_detach_is_stuck():
    """The detach gets at most the shutdown's deadline; then what the ring buffer holds is
    still drained and exported, the source is told to shut down (it leaves what is attached to
    the process's exit) and the destinations are flushed, all while the detach is blocked."""
    source = StuckDetachSource()
    pipe, memory, metrics = pipeline_over(source)
    pipe.start()
    pipe.pause_reading(True)
    ids = []
    for i in range(20):
        data, trace_id = traced(i)
        source.push(data)
        ids.append(trace_id)
    try:
        pipe.shutdown(0.3)
        assert not source.release.is_set() and not source.detached  # returned while stuck
        assert source.calls[0] == "detach"
        assert source.calls.index("drain") > 0
        assert "shutdown" in source.calls
        assert source.calls[-1] == "destination_shutdown"
        assert sorted(s.trace_id for s in memory.spans if s.kind == KIND_SERVER) == sorted(ids)
        assert metrics.get("records_received") == 20
    finally:
        source.release.set()


def enriched(i: int):
    e = Enricher(Metrics(), resource).enrich(record(f"00-{i + 1:032x}-{i + 1:016x}-01"))
    assert e is not None
    return e


def test_gpu_hold_waits_for_the_sampler_to_cover_the_end():
    gpu = FakeGpu()
    hold = GpuHold(gpu, Metrics(), hold_s=10.0)
    e = enriched(0)
    assert hold.push(e, now=0.0) == []
    assert hold.release(now=1.0) == []  # not covered, not expired
    gpu.covered = e.epoch_ns(e.end_mono_ns)  # the sampler has caught up with its end
    (out,) = hold.release(now=1.0)
    assert out.gpu == {"tracejoin.gpu.kernel_active.ratio.avg": 0.5}
    assert gpu.joined == [(1, e.epoch_ns(e.start_mono_ns), e.epoch_ns(e.end_mono_ns))]


def test_gpu_hold_expires_bounds_and_forces():
    gpu = FakeGpu()
    metrics = Metrics()
    hold = GpuHold(gpu, metrics, hold_s=1.0, max_held=3)
    for i in range(3):
        assert hold.push(enriched(i), now=0.0) == []
    early = hold.push(enriched(3), now=0.0)  # over the bound: the oldest leaves early
    assert [x.trace_id for x in early] == [1]
    assert metrics.get("gpu_join_early") == 1
    assert len(hold.release(now=2.0)) == 3  # expired
    hold.push(enriched(4), now=5.0)
    assert len(hold.release(force=True, now=5.0)) == 1
    assert len(hold) == 0


def test_gpu_window_reaches_the_span_through_the_pipeline():
    source = FakeSource()
    gpu = FakeGpu()
    gpu.covered = 2**62
    pipe, memory, _ = pipeline_over(source, GpuHold(gpu, Metrics(), hold_s=5.0))
    pipe.start()
    data, trace_id = traced(0)
    source.push(data)
    deadline = time.monotonic() + 10
    while not [s for s in memory.spans if s.trace_id == trace_id]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pipe.shutdown(2.0)
    (server,) = [s for s in memory.spans if s.kind == KIND_SERVER]
    assert server.attributes["tracejoin.gpu.kernel_active.ratio.avg"] == 0.5


def test_agent_lifecycle_over_an_injected_source():
    """The composition root with an injected source: start, spans out, one shutdown path."""
    source = FakeSource()
    metrics = Metrics()
    memory = RecordingExporter(source.calls)
    queue = BatchExportQueue(memory, metrics, flush_interval_s=0.02, name="memory")
    agent = build_agent(Settings(gpu=False), metrics, [queue], source=source)
    seen: list[Span] = []
    agent.observers.append(lambda spans, _rec: seen.extend(spans))
    agent.start()
    assert agent.ready.is_set() and agent.alive()
    agent.refresh_metrics()  # the agent's own cost, as /metrics and a capture report it
    assert metrics.get("process_resident_memory_bytes") > 10 * 2**20  # a Python process
    assert metrics.get("process_cpu_seconds") > 0
    data, trace_id = traced(0)
    source.push(data)
    deadline = time.monotonic() + 10
    while not memory.spans:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    agent.shutdown(2.0)
    agent.shutdown(2.0)
    assert [s.trace_id for s in memory.spans if s.kind == KIND_SERVER] == [trace_id]
    assert [s.trace_id for s in seen if s.kind == KIND_SERVER] == [trace_id]
    assert memory.spans[0].resource.get("tracejoin.tlb.mode") == "off"
    assert source.calls == ["start", "detach", "drain", "shutdown", "destination_shutdown"]


def test_agent_cleans_up_after_a_failed_start():
    source = FakeSource(fail_start=True)
    metrics = Metrics()
    queue = BatchExportQueue(RecordingExporter(source.calls), metrics, name="memory")
    agent = build_agent(Settings(gpu=False), metrics, [queue], source=source)
    with pytest.raises(ProbeError):
        agent.start()
    agent.shutdown(1.0)
    assert source.calls == ["start", "shutdown", "destination_shutdown"]
    assert not agent.ready.is_set()


def test_each_batch_reports_its_share_of_the_ring():
    """The overload budget hears how full each batch the reader took was (the records' bytes,
    their 8-byte headers and at most 7 bytes of padding each, against the ring's size), empty
    ones too: a reader falling behind is seen between the budget's readings."""
    source = FakeSource()
    source.ring_bytes = 100_000  # type: ignore[attr-defined]
    fills: list[float] = []
    metrics = Metrics()
    pipe = Pipeline(
        source,
        Enricher(metrics, resource),
        SpanOptions.from_status(source.status.signals, "off", 1_000_000),
        [],
        metrics,
        on_fill=fills.append,
    )
    batch = [traced(i)[0] for i in range(10)]
    pipe.process(batch)
    pipe.process([])
    assert fills == [(sum(map(len, batch)) + 15 * len(batch)) / 100_000, 0.0]
    assert metrics.get("records_received") == 10, "the records themselves go on as before"


class SamplingSource(FakeSource):
    ring_bytes = 1_000_000

    def __init__(self) -> None:
        super().__init__()
        self.ratios: list[float] = []

    def set_sampling(self, ratio: float) -> None:
        self.ratios.append(ratio)


def test_a_reader_behind_lowers_the_kernels_ratio_at_once():
    source = SamplingSource()
    metrics = Metrics()
    agent = build_agent(Settings(gpu=False), metrics, [], source=source)
    agent.start()
    assert agent.pipeline is not None
    agent.pipeline.pause_reading(True)  # its empty batches would report 0.0 in between
    try:
        agent._budget_fill(0.9)
        assert source.ratios == [], "one full batch: a backlog, not yet a rate"
        agent._budget_fill(0.95)
        assert source.ratios == [0.5]
        agent.refresh_metrics()
        assert metrics.get("sampling_ratio") == 0.5
    finally:
        agent.shutdown(2.0)


def test_a_connections_carried_tuple_is_kept_per_connection_and_never_crosses_to_another():
    """REQF_TUPLE records: the endpoints are made once per conn_id and reused; another
    connection, or a record the kernel could not number (conn_id 0), gets its own."""
    from tracejoin.enrich.correlate import ConnectionTable

    table = ConnectionTable(max_entries=2)

    def rec(conn_id: int, rport: int):
        r = record()
        r.conn_id, r.rport = conn_id, rport
        return r

    first = table.endpoints(rec(7, 40000))
    assert first is not None and (first.peer_addr, first.peer_port) == ("10.0.0.9", 40000)
    assert table.endpoints(rec(7, 40000)) is first
    other = table.endpoints(rec(8, 40001))
    assert other is not None and other.peer_port == 40001
    for port in (50000, 50001):  # unnumbered: never cached, never another's
        got = table.endpoints(rec(0, port))
        assert got is not None and got.peer_port == port
    for i in range(10):  # bounded
        table.endpoints(rec(100 + i, 1000 + i))
    assert len(table._carried) <= 2


def test_the_resolver_is_asked_once_per_pid_within_the_memo_window(monkeypatch):
    """Records of one process in one batch share one answer of the resource resolver; another
    pid gets its own, and once the window has passed the resolver is asked again."""
    from tracejoin.enrich import enricher as enricher_module

    asked: list[int] = []

    def resolve(pid: int) -> Resource:
        asked.append(pid)
        return Resource((("service.name", f"svc-{pid}"),))

    enricher = Enricher(Metrics(), resolve)
    tp = f"00-{1:032x}-{2:016x}-01"
    for pid in (1, 1, 2, 1, 2):
        r = record(tp)
        r.pid = pid
        e = enricher.enrich(r)
        assert e is not None and e.resource.get("service.name") == f"svc-{pid}"
    assert asked == [1, 2]
    monkeypatch.setattr(enricher_module, "SERVED_MEMO_S", 0.0)
    enricher._served_memo.clear()
    for _ in range(3):
        enricher.enrich(record(tp))
    assert asked == [1, 2, 1, 1, 1]
