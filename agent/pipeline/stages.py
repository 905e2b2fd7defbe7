"""The stages, in the one direction data flows:

    source.poll() -> decode -> enrich -> GPU hold -> build_spans -> destinations (+ observers)

One reader thread pulls batches of raw records from the record source (the BPF ring buffer, or a
test's list) and carries each through the stages; each stage hands its result to the next and
nothing reaches back. Exporters run behind bounded queues on their own threads, so a slow or dead
destination never stalls reading from the kernel.

Shutdown runs source-first under one deadline: detach the source (nothing new arrives), drain
what it already queued, release what the GPU hold stage keeps, then flush the destinations in
parallel with what is left of the deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue, ExportSpan, Span
from tracejoin.enrich.enricher import EnrichedRecord, Enricher
from tracejoin.kernel.decode import HttpRecord, RecordDecoder
from tracejoin.kernel.probes import ProbeStatus
from tracejoin.pipeline.span_bytes import BatchWriter, WrittenSpans, encode_spans
from tracejoin.pipeline.spans import SpanOptions, build_spans

log = logging.getLogger(__name__)

# The reader takes what the ring holds every POLL_MS (the kernel wakes it earlier only when half
# the ring could be full): one wake-up per batch instead of one per record; spans leave at most
# this much later (the OTLP exporter sends every --export-interval, 2 s by default, at the rates
# where it waits this long). A
# wake-up is dear: ~70-140 µs of the thread's CPU on the 2-vCPU KVM guests (an empty epoll wait,
# alone: bench.idle_cost), and each batch starts with cold caches. At 500 req/s, 200 ms instead
# of 100 took the reader from ~7 to ~5 µs per record (docs/performance.md).
POLL_MS = 200
# ... except where a record may name its connection only by pid and fd (a kernel without
# tcp:tcp_rcv_space_adjust, for connections older than the agent: the source's
# addresses_from_fds): its addresses are read from /proc/<pid>/fd/<fd>, which must still be open
# then, so the reader comes sooner. 200 ms lost more of those reads to a closed connection.
POLL_MS_FDS = 100
# With nothing to read the reader waits twice as long each time, up to IDLE_POLL_MS: an idle
# agent wakes ~3 times a second instead of 10. A burst still wakes it at once (the kernel's
# forced wake-up); a request after a quiet spell is read at most this late. Well under
# shutdown's 1 s join of the reader.
IDLE_POLL_MS = 400
DRAIN_ROUNDS = 64  # bounded: a source that never empties cannot hold shutdown forever


class RecordSource(Protocol):
    """Where raw records come from. HttpProbes is the real one; tests inject their own."""

    status: ProbeStatus

    def start(self) -> None: ...
    def poll(self, timeout_ms: int) -> list[bytes]: ...
    def detach(self) -> None: ...
    def kernel_counters(self) -> dict[str, int]: ...
    def shutdown(self) -> None: ...


class Destination(Protocol):
    name: str
    # True when the destination only sends OTLP protobuf and so takes model.EncodedSpan too
    accepts_encoded: bool

    def start(self) -> None: ...
    def submit(self, span: ExportSpan) -> bool: ...
    def shutdown(self, timeout_s: float = ...) -> None: ...


class GpuJoiner(Protocol):
    def join(self, pid: int, start_ns: int, end_ns: int) -> dict[str, AttrValue]: ...
    def covered_until_ns(self) -> int: ...


# Observers see each request's spans after they are handed to the destinations (the capture's
# summary). They must be quick; an exception is counted, never fatal.
Observer = Callable[[list[Span], HttpRecord], None]


# What GpuHold holds: a record for the stages, or the spans the batch writer already wrote.
Held = EnrichedRecord | WrittenSpans


class GpuHold:
    """NVML samples for a request's last moments arrive up to one sampling interval after it
    ends: hold each request until the sampler has covered its end (or `hold_s` has passed), then
    join the GPU window onto it: an enriched record, or the batch writer's spans for one request.
    Bounded: beyond `max_held` the oldest is joined early."""

    def __init__(
        self, gpu: GpuJoiner, metrics: Metrics, hold_s: float = 1.0, max_held: int = 50_000
    ) -> None:
        self.gpu = gpu
        self.metrics = metrics
        self.hold_s = hold_s
        self.max_held = max_held
        self._held: deque[tuple[float, int, Held]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def push(self, e: Held, now: float | None = None) -> list[Held]:
        """Hold `e`; returns what must leave now to keep the bound."""
        now = time.monotonic() if now is None else now
        out = []
        if len(self._held) >= self.max_held:
            self.metrics.inc("gpu_join_early")
            out.append(self._join(self._held.popleft()[2]))
        end = e.end_ns if isinstance(e, WrittenSpans) else e.epoch_ns(e.end_mono_ns)
        self._held.append((now + self.hold_s, end, e))
        return out

    def release(self, force: bool = False, now: float | None = None) -> list[Held]:
        """Records whose end the sampler has covered, or whose hold expired (all, if force)."""
        if not self._held:
            return []
        covered = self.gpu.covered_until_ns()
        now = time.monotonic() if now is None else now
        out = []
        while self._held:
            deadline, end_ns, _ = self._held[0]
            if not force and end_ns > covered and now < deadline:
                break
            out.append(self._join(self._held.popleft()[2]))
        return out

    def _join(self, e: Held) -> Held:
        try:
            if isinstance(e, WrittenSpans):
                e.with_gpu(self.gpu.join(e.pid, e.start_ns, e.end_ns))
            else:
                e.gpu = self.gpu.join(
                    e.rec.pid, e.epoch_ns(e.start_mono_ns), e.epoch_ns(e.end_mono_ns)
                )
        except Exception:
            log.exception("GPU join failed")
            self.metrics.inc("gpu_join_errors")
        return e


class Pipeline:
    """Carries records from a started source to the destinations. start() runs the reader
    thread; shutdown(timeout_s) is idempotent and safe without start."""

    def __init__(
        self,
        source: RecordSource,
        enricher: Enricher,
        span_options: SpanOptions,
        destinations: Sequence[Destination],
        metrics: Metrics,
        *,
        gpu_hold: GpuHold | None = None,
        observers: Sequence[Observer] = (),
        on_fill: Callable[[float], None] | None = None,
    ) -> None:
        self.source = source
        # Told each batch's share of the source's ring (`ring_bytes`, where it has one): the
        # overload budget reacts to a reader falling behind before the ring overflows.
        self.on_fill = on_fill
        self._ring_bytes = int(getattr(source, "ring_bytes", 0) or 0)
        self._backlog: Callable[[], float] | None = getattr(source, "backlog", None)
        self.metrics = metrics
        self.decoder = RecordDecoder(metrics)
        self.enricher = enricher
        self.span_options = span_options
        self.destinations = list(destinations)
        self.gpu_hold = gpu_hold
        self.observers = list(observers)
        # The object-free path (span_bytes: the server span written straight to OTLP bytes)
        # when every destination sends OTLP protobuf and no observer needs the Span objects;
        # otherwise build_spans, the reference path, for all.
        self.encode = (
            bool(self.destinations)
            and not self.observers
            and all(getattr(d, "accepts_encoded", False) for d in self.destinations)
        )
        # The common request's spans from the ring's bytes in one C call per batch, where it
        # was compiled (with a GPU join, held like the stages' records: GpuHold)
        self.batch_writer: BatchWriter | None = (
            BatchWriter(enricher, span_options) if self.encode and BatchWriter.available() else None
        )
        self._stop = threading.Event()
        self._paused = threading.Event()
        # pauses asked for, and the last one the reader saw (it polls no more until resumed)
        self._pause_cond = threading.Condition()
        self._pauses_asked = self._pauses_seen = 0
        self._reader: threading.Thread | None = None
        self._stopped = False
        # the kernel's unsampled_aggregated already added to requests_unsampled
        self._unsampled_folded = 0
        self._fold_lock = threading.Lock()

    # -- the stages -----------------------------------------------------------------------

    def process(self, batch: list[bytes]) -> None:
        """decode -> enrich -> (GPU hold) -> spans -> destinations, for one batch. Counters and
        the destinations' queues are touched once per batch, not once per record."""
        if self.on_fill is not None and self._ring_bytes:
            # How far behind the reader was: this batch (in the ring each record has an 8-byte
            # header and is padded to 8, up to 7 more) and what it left there, if known.
            used = sum(map(len, batch)) + 15 * len(batch)
            try:
                left = self._backlog() if self._backlog is not None else 0.0
                self.on_fill(used / self._ring_bytes + left)
            except Exception:
                log.exception("the overload budget's fill check failed")
        if not batch:
            if self.gpu_hold is not None:
                self._emit_held(self.gpu_hold.release())
            return
        self.metrics.inc("records_received", len(batch))
        self.metrics.inc("record_batches")
        written: list[ExportSpan] = []
        held: list[Held] = []  # released by the GPU hold
        if self.batch_writer is not None:
            try:
                if self.gpu_hold is None:
                    batch = self.batch_writer.write(batch, written)
                else:
                    requests, batch = self.batch_writer.write_held(batch)
                    for w in requests:
                        held += self.gpu_hold.push(w)
            except Exception:  # a bug there must lose nothing: the stages take every record
                log.exception("the batch span writer failed; the stages write every span now")
                self.metrics.inc("reader_errors")
                self.batch_writer = None
        ready: list[EnrichedRecord] = []
        undecodable = failed = 0
        decode, enrich = self.decoder.decode, self.enricher.enrich
        for data in batch:
            rec = decode(data)
            if not isinstance(rec, HttpRecord):
                undecodable += 1
                continue
            try:
                e = enrich(rec)
            except Exception:
                log.exception("enriching a record failed")
                failed += 1
                continue
            if e is None:
                continue
            if self.gpu_hold is None:
                ready.append(e)
            else:
                held += self.gpu_hold.push(e)
        if undecodable:
            self.metrics.inc("records_dropped_userspace", undecodable, reason="undecodable")
        if failed:
            self.metrics.inc("records_dropped_userspace", failed, reason="build_error")
        if self.gpu_hold is not None:
            held += self.gpu_hold.release()
        self._emit_held(held, ready, written)

    def _emit_held(
        self,
        held: list[Held],
        ready: list[EnrichedRecord] | None = None,
        written: list[ExportSpan] | None = None,
    ) -> None:
        """_emit_all, with what the GPU hold released: records for the stages, and requests
        the batch writer wrote."""
        ready = [] if ready is None else ready
        written = [] if written is None else written
        for h in held:
            if isinstance(h, WrittenSpans):
                written += h.spans
            else:
                ready.append(h)
        self._emit_all(ready, written)

    def _emit_all(self, records: list[EnrichedRecord], out: list[ExportSpan] | None = None) -> None:
        """Spans for `records`, sent with those already in `out`."""
        out = [] if out is None else out
        if not records and not out:
            return
        failed = 0
        observed: list[tuple[list[Span], HttpRecord]] = []
        opts, new_id = self.span_options, self.enricher.new_id
        for e in records:
            try:
                if self.encode:
                    out += encode_spans(e, opts, new_id)
                    continue
                spans = build_spans(e, opts, new_id)
            except Exception:
                log.exception("building a span failed")
                failed += 1
                continue
            out += spans
            if self.observers:
                observed.append((spans, e.rec))
        if failed:
            self.metrics.inc("records_dropped_userspace", failed, reason="build_error")
        if out:
            self.metrics.inc("spans_built", len(out))
            for dest in self.destinations:
                submit_many = getattr(dest, "submit_many", None)
                if submit_many is not None:
                    submit_many(out)
                else:
                    for span in out:
                        dest.submit(span)
        for spans, rec in observed:
            for observe in self.observers:
                try:
                    observe(spans, rec)
                except Exception:
                    log.exception("a span observer failed")
                    self.metrics.inc("observer_errors")

    # -- the reader -----------------------------------------------------------------------

    def start(self) -> None:
        self._reader = threading.Thread(
            target=self._read_loop, name="tracejoin-reader", daemon=True
        )
        self._reader.start()

    def reader_alive(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def _read_loop(self) -> None:
        busy = POLL_MS_FDS if getattr(self.source, "addresses_from_fds", False) else POLL_MS
        wait = busy
        while not self._stop.is_set():
            if self._paused.is_set():
                with self._pause_cond:
                    self._pauses_seen = self._pauses_asked
                    self._pause_cond.notify_all()
                time.sleep(0.05)
                continue
            try:
                batch = self.source.poll(wait)
                wait = busy if batch else min(2 * wait, IDLE_POLL_MS)
                self.process(batch)
            except Exception:  # a bug here must not kill the agent: count and go on
                log.exception("reading the record source failed")
                self.metrics.inc("reader_errors")
                time.sleep(0.1)

    def pause_reading(self, paused: bool, timeout_s: float = 5.0) -> None:
        """Stop consuming the source (tests of loss accounting use this). Pausing returns once
        the reader has seen it, so no poll begun before it takes records after it (a wait can
        last IDLE_POLL_MS); at most timeout_s."""
        if not paused:
            self._paused.clear()
            return
        with self._pause_cond:
            self._pauses_asked += 1
            asked = self._pauses_asked
            self._paused.set()
            if self.reader_alive():
                self._pause_cond.wait_for(lambda: self._pauses_seen >= asked, timeout_s)

    def kernel_counters(self) -> dict[str, int]:
        counters = self.source.kernel_counters()
        for name, value in counters.items():
            self.metrics.set("kernel_" + name, value)
        # requests_unsampled counts every request whose caller did not sample it, wherever the
        # decision was made: the ones the kernel kept (--unsampled follow) are added here
        with self._fold_lock:
            kept = counters.get("unsampled_aggregated", 0)
            if kept > self._unsampled_folded:
                self.metrics.inc("requests_unsampled", kept - self._unsampled_folded)
                self._unsampled_folded = kept
        return counters

    def _detach(self, deadline: float) -> None:
        """Detach the source, waiting at most until the deadline. A tracepoint's detach waits
        for the kernel (an RCU grace period); while the verifier keeps a CPU busy (HTTP/2's
        programs after ready) that can take seconds, and the bound holds regardless: the
        drain and flush go on, and the source's shutdown leaves what is still attached to the
        process's exit."""
        t = threading.Thread(
            target=_detach_or_log, args=(self.source,), name="tracejoin-detach", daemon=True
        )
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            log.warning("detaching the probes outlasted the shutdown bound; the exit releases them")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Idempotent. Detach the source so nothing new arrives, drain what it already queued,
        release held records, then give the destinations what is left of the deadline."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        try:
            self._detach(deadline)
            for _ in range(DRAIN_ROUNDS):
                batch = self.source.poll(0)
                if not batch:
                    break
                self.process(batch)
            self.kernel_counters()
            if self.gpu_hold is not None:
                self._emit_held(self.gpu_hold.release(force=True))
        except Exception:
            log.exception("final drain failed")
        self.source.shutdown()
        flush_in_parallel(self.destinations, deadline)


def _detach_or_log(source: RecordSource) -> None:
    try:
        source.detach()
    except Exception:
        log.exception("detaching the source failed")


# A destination whose export hangs waits for it until the deadline, then counts what it abandons
# (spans_dropped{reason="shutdown"}): wait that much past the deadline for the count, or the
# final counters are read before it (the run's hard-exit grace, 1 s, covers it).
COUNT_GRACE_S = 0.25


def flush_in_parallel(destinations: Sequence[Destination], deadline: float) -> None:
    """Shut destinations down in parallel under one deadline: a hung one cannot starve another."""
    stoppers = [
        threading.Thread(
            target=d.shutdown, args=(max(0.1, deadline - time.monotonic()),), daemon=True
        )
        for d in destinations
    ]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(max(0.1, deadline - time.monotonic()) + COUNT_GRACE_S)
