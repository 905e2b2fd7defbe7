"""Record -> spans: one SERVER span per request in the caller's trace, plus child spans for the
intervals the kernel timed (receive-queue wait, long run-queue waits).

Attribute names: docs/attributes.md. OTel semantic conventions where one exists; tracejoin's own
measurements under `tracejoin.*`, named for what was measured (a TLB flush is not a miss).
"""

from __future__ import annotations

import random
import re
import socket
from collections.abc import Callable

from tracejoin.core.metrics import Metrics
from tracejoin.core.model import (
    KIND_INTERNAL,
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_UNSET,
    AttrValue,
    Resource,
    Span,
)
from tracejoin.enrich import traceparent
from tracejoin.enrich.correlate import (
    ConnectionTable,
    KernelClock,
    ProcessTable,
    ProcReads,
    sampling_decision,
    trace_context,
)
from tracejoin.kernel.decode import (
    REQF_FIRST_ON_CONN,
    REQF_NO_RESPONSE,
    REQF_PATH_TRUNC,
    REQF_RESP_UNTERM,
    REQF_TLB_HW,
    HttpRecord,
)

# Path segments that look like identifiers become "{id}" in the span name, so a route like
# /users/123/orders/9f1c... names one operation, not one per user.
_ID_SEGMENT = re.compile(
    r"^(?:\d+|[0-9a-fA-F]{8,}|[0-9a-fA-F-]{32,36}|(?=[^/]*\d)[A-Za-z0-9_\-]{16,})$"
)
MAX_ROUTE_SEGMENTS = 4


def route_of(path: str) -> str:
    """Bounded-cardinality route for span names: ids -> {id}, at most 4 segments."""
    if not path.startswith("/"):
        return path[:32] or "/"
    segs = path.split("/")[1:]
    out = ["{id}" if _ID_SEGMENT.match(s) else s for s in segs[:MAX_ROUTE_SEGMENTS]]
    route = "/" + "/".join(out)
    if len(segs) > MAX_ROUTE_SEGMENTS:
        route += "/{...}"
    return route


class SpanBuilder:
    def __init__(
        self,
        metrics: Metrics,
        *,
        service_name: str | None = None,
        resource_attributes: dict[str, AttrValue] | None = None,
        no_parent: str = "root",  # "root": a new trace; "skip": no span
        unsampled: str = "follow",  # "follow": no span, like the caller; "record": a span anyway
        runq_child_threshold_ns: int = 1_000_000,
        tlb_mode: str = "off",
        resource_for_pid: Callable[[int], dict[str, AttrValue]] | None = None,
    ) -> None:
        self.metrics = metrics
        self.clock = KernelClock()
        reads = ProcReads(metrics)  # /proc reads of other processes a capability would allow
        self.conns = ConnectionTable(reads=reads)
        self.procs = ProcessTable(reads=reads)
        self.service_name = service_name
        self.extra_resource = dict(resource_attributes or {})
        self.no_parent = no_parent
        self.unsampled = unsampled
        self.runq_child_threshold_ns = runq_child_threshold_ns
        self.tlb_mode = tlb_mode
        self.resource_for_pid = resource_for_pid
        self._resources: dict[int, Resource] = {}
        self._host = socket.gethostname()
        self._rand = random.Random()

    def resource(self, pid: int) -> Resource:
        res = self._resources.get(pid)
        if res is not None:
            return res
        proc = self.procs.get(pid)
        attrs: dict[str, AttrValue] = {
            "service.name": self.service_name or proc.name,
            "host.name": self._host,
            "process.pid": pid,
            "process.executable.name": proc.executable,
            "telemetry.sdk.name": "tracejoin",
            "telemetry.sdk.language": "python",
            "tracejoin.tlb.mode": self.tlb_mode,
        }
        if self.resource_for_pid is not None:
            attrs.update(self.resource_for_pid(pid))
        attrs.update(self.extra_resource)
        if self.service_name:
            attrs["service.name"] = self.service_name
        res = Resource(tuple(attrs.items()))
        if len(self._resources) > 4096:
            self._resources.clear()
        self._resources[pid] = res
        return res

    def _new_id(self, bits: int) -> int:
        while True:
            v = self._rand.getrandbits(bits)
            if v:
                return v

    def build(self, rec: HttpRecord) -> list[Span]:
        ctx = trace_context(rec)
        decision = sampling_decision(ctx, self.metrics, self.no_parent, self.unsampled)
        if decision == "drop":
            return []
        if decision == "child":
            assert isinstance(ctx, traceparent.TraceParent)
            trace_id, parent_id, flags = ctx.trace_id, ctx.parent_id, ctx.flags
        else:
            trace_id, parent_id, flags = self._new_id(128), 0, 1

        to_epoch = self.clock.to_epoch_ns
        start_mono = rec.arrival_ns if 0 < rec.arrival_ns <= rec.read_ns else rec.read_ns
        end_mono = max(rec.end_ns, rec.read_ns)
        method = rec.method_str()
        path = rec.path_bytes().decode("utf-8", "replace")
        attrs: dict[str, AttrValue] = {
            "http.request.method": method,
            "url.path": path,
            "network.protocol.name": "http",
            "network.transport": "tcp",
            "thread.id": rec.tid,
            "http.request.size": rec.req_bytes,
            "http.response.size": rec.resp_bytes,
            "tracejoin.connection.id": rec.conn_id,
            "tracejoin.connection.request_seq": rec.seq,
        }
        if rec.status:
            attrs["http.response.status_code"] = rec.status
        ep = self.conns.endpoints(rec)
        if ep is not None:
            attrs["server.address"] = ep.local_addr
            attrs["server.port"] = ep.local_port
            attrs["client.address"] = ep.peer_addr
            attrs["client.port"] = ep.peer_port
        if isinstance(ctx, str):
            attrs["tracejoin.traceparent.rejected"] = ctx
        if rec.flags & REQF_PATH_TRUNC:
            attrs["tracejoin.http.path_truncated"] = True
        if rec.arrival_ns and rec.arrival_ns <= rec.read_ns:
            attrs["tracejoin.tcp.receive_queue_wait_ns"] = rec.read_ns - rec.arrival_ns
        if rec.flags & REQF_FIRST_ON_CONN and 0 < rec.est_ns <= rec.read_ns:
            attrs["tracejoin.tcp.handshake_to_first_read_ns"] = rec.read_ns - rec.est_ns
        if rec.resp_start_ns:
            attrs["tracejoin.http.time_to_first_response_byte_ns"] = max(
                0, rec.resp_start_ns - rec.read_ns
            )
        attrs["tracejoin.tcp.retransmits"] = rec.retrans
        if rec.srtt_us:
            attrs["tracejoin.tcp.srtt_us"] = rec.srtt_us
        if rec.unacked_max:
            attrs["tracejoin.tcp.unacked_max_bytes"] = rec.unacked_max
        attrs["tracejoin.sched.runq_wait_ns"] = rec.runq_ns
        attrs["tracejoin.sched.runq_wait_max_ns"] = rec.runq_max_ns
        attrs["tracejoin.sched.offcpu_ns"] = rec.offcpu_ns
        attrs["tracejoin.sched.context_switches"] = rec.nr_switches
        attrs["tracejoin.mm.minor_faults"] = rec.minflt
        attrs["tracejoin.mm.major_faults"] = rec.majflt
        if rec.flags & REQF_TLB_HW:
            attrs["tracejoin.tlb.dtlb_load_misses"] = rec.tlb_a
            attrs["tracejoin.tlb.itlb_load_misses"] = rec.tlb_b
        elif self.tlb_mode == "flush_fallback":
            attrs["tracejoin.tlb.flushes"] = rec.tlb_a
            attrs["tracejoin.tlb.full_flushes"] = rec.tlb_b

        start_ns, end_ns = to_epoch(start_mono), to_epoch(end_mono)

        status, message = STATUS_UNSET, ""
        if rec.flags & REQF_NO_RESPONSE:
            status, message = STATUS_ERROR, "connection closed before a response"
        elif rec.status >= 500:
            status = STATUS_ERROR
        if rec.flags & REQF_RESP_UNTERM:
            attrs["tracejoin.http.response_unframed"] = True

        resource = self.resource(rec.pid)
        span_id = self._new_id(64)
        server = Span(
            trace_id=trace_id,
            span_id=span_id,
            parent_span_id=parent_id,
            name=f"{method} {route_of(path)}",
            kind=KIND_SERVER,
            start_ns=start_ns,
            end_ns=end_ns,
            resource=resource,
            attributes=attrs,
            status_code=status,
            status_message=message,
            trace_flags=flags,
        )
        spans = [server]
        if "tracejoin.tcp.receive_queue_wait_ns" in attrs:
            spans.append(
                self._child(
                    server,
                    "tcp.receive_queue_wait",
                    to_epoch(rec.arrival_ns),
                    to_epoch(rec.read_ns),
                )
            )
        for w in rec.runq:
            if w.dur_ns >= self.runq_child_threshold_ns and w.start_ns:
                s0 = to_epoch(w.start_ns)
                spans.append(self._child(server, "sched.runq_wait", s0, s0 + w.dur_ns))
        return spans

    def _child(self, parent: Span, name: str, start_ns: int, end_ns: int) -> Span:
        return Span(
            trace_id=parent.trace_id,
            span_id=self._new_id(64),
            parent_span_id=parent.span_id,
            name=name,
            kind=KIND_INTERNAL,
            start_ns=start_ns,
            end_ns=end_ns,
            resource=parent.resource,
            attributes={"tracejoin.interval.kernel_measured": True},
            trace_flags=parent.trace_flags,
        )
