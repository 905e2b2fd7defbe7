"""Decoded record -> enriched record: everything a span needs that the kernel could not know.

The trace context (W3C rules, with the sampling decision), the offset from the kernel's
monotonic clock to Unix time, the connection's endpoints and the serving process's resource.
Nothing here builds spans; the span builder is a pure function of what this stage produces.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue, Resource
from tracejoin.core.record import WS_SLOTS
from tracejoin.enrich import traceparent
from tracejoin.enrich.correlate import (
    ConnectionTable,
    Endpoints,
    KernelClock,
    ProcReads,
    sampling_decision,
    trace_context,
)
from tracejoin.enrich.resources import ServedProcess
from tracejoin.kernel.decode import HttpRecord


@dataclass(slots=True)
class EnrichedRecord:
    rec: HttpRecord
    trace_id: int
    parent_id: int  # 0: a new root trace
    trace_flags: int
    clock_offset_ns: int  # kernel monotonic ns + this = Unix epoch ns
    resource: Resource
    endpoints: Endpoints | None = None
    rejected: str | None = None  # why the traceparent was rejected, if it was
    gpu: dict[str, AttrValue] = field(default_factory=dict)  # filled by the GPU join
    # process name of each work-set helper's process other than the reader's (by pid)
    process_names: dict[int, str] = field(default_factory=dict)
    service_name_source: str | None = None  # tracejoin.service_name.source; None: not known
    # how the serving process is known to make its own SERVER spans; None: it does not
    instrumented: str | None = None

    def epoch_ns(self, mono_ns: int) -> int:
        return mono_ns + self.clock_offset_ns

    @property
    def start_mono_ns(self) -> int:
        rec = self.rec
        return rec.arrival_ns if 0 < rec.arrival_ns <= rec.read_ns else rec.read_ns

    @property
    def end_mono_ns(self) -> int:
        return max(self.rec.end_ns, self.rec.read_ns)


# How long one answer of the resource resolver is reused for a pid: the resolver itself caches
# for seconds, but asking it costs a lock, its clock and its generations per record; records
# come in batches every POLL_MS (100-200 ms), so this asks it about once per pid per batch.
SERVED_MEMO_S = 0.1
_SERVED_MEMO_MAX = 4096


class Enricher:
    def __init__(
        self,
        metrics: Metrics,
        # the resolver's `served` (a bare Resource: the process's naming is not known)
        resource_for_pid: Callable[[int], Resource | ServedProcess],
        *,
        no_parent: str = "root",  # no valid traceparent: "root" (a new trace) or "skip"
        unsampled: str = "follow",  # caller did not sample: "follow" (no span) or "record"
    ) -> None:
        self.metrics = metrics
        self.resource_for_pid = resource_for_pid
        self.no_parent = no_parent
        self.unsampled = unsampled
        self.clock = KernelClock()
        # /proc reads of other processes that a missing capability denies are counted
        self.conns = ConnectionTable(reads=ProcReads(metrics))
        self._rand = random.Random()
        self._served_memo: dict[int, tuple[float, ServedProcess]] = {}

    def new_id(self, bits: int) -> int:
        while True:
            v = self._rand.getrandbits(bits)
            if v:
                return v

    def enrich(self, rec: HttpRecord) -> EnrichedRecord | None:
        """None when no span is to be made (the caller did not sample, or no parent and
        --no-parent skip); every rejection is counted by reason."""
        ctx = trace_context(rec)
        decision = sampling_decision(ctx, self.metrics, self.no_parent, self.unsampled)
        if decision == "drop":
            return None
        if isinstance(ctx, traceparent.TraceParent):
            trace_id, parent_id, flags = ctx.trace_id, ctx.parent_id, ctx.flags
        else:
            trace_id, parent_id, flags = self.new_id(128), 0, 1
        served = self.served(rec.pid)
        return EnrichedRecord(
            rec=rec,
            trace_id=trace_id,
            parent_id=parent_id,
            trace_flags=flags,
            clock_offset_ns=self.clock.offset_ns(),
            resource=served.resource,
            endpoints=self.conns.endpoints(rec),
            rejected=ctx if isinstance(ctx, str) else None,
            process_names=self._helper_processes(rec),
            service_name_source=served.service_name_source or None,
            instrumented=served.instrumented,
        )

    def served(self, pid: int) -> ServedProcess:
        """The resolver's answer for pid, reused for SERVED_MEMO_S."""
        now = time.monotonic()
        memo = self._served_memo.get(pid)
        if memo is not None and now < memo[0]:
            return memo[1]
        got = self.resource_for_pid(pid)
        served = got if isinstance(got, ServedProcess) else ServedProcess(got, "")
        if len(self._served_memo) >= _SERVED_MEMO_MAX:
            self._served_memo.clear()
        self._served_memo[pid] = (now + SERVED_MEMO_S, served)
        return served

    def _helper_processes(self, rec: HttpRecord) -> dict[int, str]:
        """Names of the processes the work set reached besides the reader's, from their
        resources (cached per pid by the resolver)."""
        names: dict[int, str] = {}
        for m in rec.members[: min(rec.ws_nslots, WS_SLOTS)]:
            if m.pid and m.pid != rec.pid and m.pid not in names:
                names[m.pid] = process_name(self.served(m.pid).resource, m.pid)
        return names


def process_name(resource: Resource, pid: int) -> str:
    """The executable's name, as the resource says; the pid when it could not be read."""
    name = resource.get("process.executable.name")
    return str(name) if name else f"pid {pid}"
