"""Work-set records -> spans, on synthetic records (no BPF): the work attributes, shared values
kept apart from the request's own, one child span per reported helper, and what a lost or
malformed set gives."""

from __future__ import annotations

import ctypes

from records import PID, TID, record
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import KIND_INTERNAL, Resource
from tracejoin.core.record import (
    WS_SLOTS,
    WSF_CAP,
    WSF_NO_GAP,
    WSF_STATS,
    WSF_TRACKED,
    WSIG_MINFLT,
    WSIG_ONCPU,
    WsMember,
)
from tracejoin.enrich.enricher import Enricher
from tracejoin.kernel.decode import HttpRecord
from tracejoin.pipeline.spans import SpanOptions, build_spans

SIGNALS = frozenset({"sched", "page_faults", "tlb_flush", "workset"})
TP = f"00-{TID:032x}-{PID:016x}-01"


def resource(pid: int) -> Resource:
    exe = {1: "python3", 77: "engine"}.get(pid)
    attrs = (("process.pid", pid),) + ((("process.executable.name", exe),) if exe else ())
    return Resource(attrs)


def build(rec: HttpRecord, signals: frozenset[str] = SIGNALS) -> list:
    enricher = Enricher(Metrics(), resource)
    e = enricher.enrich(rec)
    assert e is not None
    return build_spans(e, SpanOptions(signals, "flush_fallback"), enricher.new_id)


def helper(rec: HttpRecord, i: int, tid: int, pid: int, comm: bytes, **values: int) -> WsMember:
    m = rec.members[i]
    m.tid, m.pid = tid, pid
    ctypes.memmove(ctypes.addressof(m) + WsMember.comm.offset, comm, len(comm))
    m.join_ns, m.leave_ns = rec.read_ns + 1000, rec.read_ns + 3_000_000
    for k, v in values.items():
        setattr(m, k, v)
    rec.ws_nslots = max(rec.ws_nslots, i + 1)
    return m


def pool_record() -> HttpRecord:
    """A thread-pool hand-off: the reader (pid 1) and one worker that touched 512 pages."""
    r = record(TP)
    r.ws_flags |= WSF_TRACKED
    r.ws_threads, r.ws_processes = 2, 1
    r.oncpu_ns, r.helper_oncpu_ns = 3_000_000, 2_700_000
    r.minflt, r.unexplained_wait_ns = 515, 20_000
    helper(r, 0, 4242, 1, b"python", oncpu_ns=2_700_000, minflt=512, runq_ns=5, tlb_a=3)
    return r


def test_pool_hand_off_gives_work_attributes_and_a_worker_span():
    server, worker = build(pool_record())
    a = server.attributes
    assert a["tracejoin.work.threads"] == 2
    assert a["tracejoin.work.processes"] == 1
    assert a["tracejoin.work.on_cpu_ns"] == 3_000_000
    assert a["tracejoin.work.reader_on_cpu_ns"] == 300_000
    assert a["tracejoin.work.unexplained_wait_ns"] == 20_000
    assert a["tracejoin.work.shared_with_max"] == 0
    assert a["tracejoin.mm.minor_faults"] == 515
    assert not any(k.startswith("tracejoin.work.shared.") for k in a)  # nothing was shared
    assert (worker.name, worker.kind, worker.parent_span_id) == (
        "python3/python",
        KIND_INTERNAL,
        server.span_id,
    )
    w = worker.attributes
    assert (w["thread.id"], w["thread.name"], w["process.pid"]) == (4242, "python", 1)
    assert (w["tracejoin.work.on_cpu_ns"], w["tracejoin.mm.minor_faults"]) == (2_700_000, 512)
    assert (w["tracejoin.sched.runq_wait_ns"], w["tracejoin.tlb.flushes"]) == (5, 3)
    assert worker.duration_ns == 2_999_000
    assert server.start_ns <= worker.start_ns and worker.end_ns <= server.end_ns


def test_a_worker_process_is_named_after_its_own_executable():
    r = pool_record()
    r.ws_processes = 2
    helper(r, 1, 77, 77, b"engine-core")
    spans = build(r)
    assert [s.name for s in spans[1:]] == ["python3/python", "engine/engine-core"]


def test_shared_values_are_reported_apart_never_as_the_requests_own():
    r = record(TP)
    r.ws_flags, r.ws_threads, r.ws_processes = WSF_TRACKED, 1, 1
    r.ws_shared_with_max = 3
    r.minflt, r.oncpu_ns = 0, 0  # its own part: the loop did nothing for it alone
    r.shared[WSIG_MINFLT], r.shared[WSIG_ONCPU] = 1804, 19_000_000
    r.shared_apportioned_ns = 5_000_000
    (server,) = build(r)
    a = server.attributes
    assert a["tracejoin.mm.minor_faults"] == 0
    assert a["tracejoin.work.on_cpu_ns"] == 0
    assert a["tracejoin.work.shared_with_max"] == 3
    assert a["tracejoin.work.shared.mm.minor_faults"] == 1804
    assert a["tracejoin.work.shared.on_cpu_ns"] == 19_000_000
    assert a["tracejoin.work.shared.on_cpu_apportioned_ns"] == 5_000_000
    assert a["tracejoin.work.shared.tlb.flushes"] == 0
    assert "tracejoin.work.shared.sched.runq_wait_ns" in a


def test_a_lost_set_gives_no_kernel_values_rather_than_zeros():
    r = pool_record()
    r.ws_flags = WSF_STATS  # the kernel lost the set before the response
    (server,) = build(r)
    a = server.attributes
    kernel = ("tracejoin.work.", "tracejoin.mm.", "tracejoin.sched.")
    assert not any(k.startswith(kernel) for k in a)
    assert "tracejoin.tlb.flushes" not in a


def test_without_the_workset_signal_the_readers_values_stand_alone():
    (server,) = build(pool_record(), SIGNALS - {"workset"})
    a = server.attributes
    assert a["tracejoin.mm.minor_faults"] == 515
    assert not any(k.startswith("tracejoin.work.") for k in a)
    r = pool_record()
    r.ws_flags = 0  # the reader's counters were never taken (its read's exit never ran it)
    (server,) = build(r, SIGNALS - {"workset"})
    assert "tracejoin.mm.minor_faults" not in server.attributes


def test_cap_unslotted_and_no_gap_are_said():
    r = pool_record()
    r.ws_flags |= WSF_CAP | WSF_NO_GAP
    r.ws_refused, r.ws_unslotted = 9, 3
    (server, _) = build(r)
    a = server.attributes
    assert (a["tracejoin.work.threads_refused"], a["tracejoin.work.helpers_without_span"]) == (9, 3)
    assert "tracejoin.work.unexplained_wait_ns" not in a  # not measured: never a made-up zero


def test_hostile_thread_names_and_a_corrupt_slot_count_are_inert():
    r = pool_record()
    helper(r, 0, 1, 1, b"\x1b[31mred\xff\n")
    r.ws_nslots = 200  # corrupt: bounded by the record's slots
    spans = build(r)
    assert len(spans) == 1 + 1  # slots without a join time make no span
    name = spans[1].attributes["thread.name"]
    assert "\x1b" not in name and "\n" not in name
    assert name == "\\x1b[31mred\\xff\\x0a"
    assert len(r.members) == WS_SLOTS


# ---- the capture summary's work-set table -------------------------------------------------


def test_summary_work_table_splits_reader_and_others_and_marks_shared():
    from tracejoin.commands.summary import WIDTH, Summary

    s = Summary()
    for i in range(20):
        for span in build(pool_record()):
            s.add_span(span)
        r = record(TP, path=b"/asleep")
        r.ws_flags, r.ws_threads, r.ws_processes, r.ws_shared_with_max = WSF_TRACKED, 1, 1, 3
        r.shared[WSIG_ONCPU], r.shared[WSIG_MINFLT] = 19_000_000, 1804 + i
        for span in build(r):
            s.add_span(span)
    text = s.format()
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    rows = {
        line.split()[1]: line.split()[2:]
        for line in text[text.index("\nwork set") + 1 :].splitlines()[3:5]
    }
    # reader, others, ~cpu, ~faults, unexpl, threads, procs
    assert rows["/x"] == ["0.30/0.30", "2.70/2.70", "0/0", "0/0", "0.02/0.02", "2/2", "1/1"]
    assert rows["/asleep"][2:4] == ["~19/~19", "~1.8k/~1.8k"]
    assert "shared, not the request's own" in " ".join(text.split())


# ---- the Perfetto timeline ------------------------------------------------------------------


def test_perfetto_puts_each_helper_on_its_own_thread_track():
    from tracejoin.exporters.perfetto import trace_document

    r = pool_record()
    helper(r, 1, 78, 77, b"engine-core", oncpu_ns=1)
    server, pool_thread, engine = build(r)
    doc = trace_document([server, pool_thread, engine], origin_ns=server.start_ns)
    x = {e["args"]["span_id"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    assert (x[server.span_id_hex]["pid"], x[server.span_id_hex]["tid"]) == (1, 1)
    assert (x[pool_thread.span_id_hex]["pid"], x[pool_thread.span_id_hex]["tid"]) == (1, 4242)
    assert (x[engine.span_id_hex]["pid"], x[engine.span_id_hex]["tid"]) == (77, 78)
    assert x[engine.span_id_hex]["args"]["parent_span_id"] == server.span_id_hex
    procs = {
        e["pid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert procs[77] == "engine (pid 77)"
