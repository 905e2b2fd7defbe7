"""Bounded batching queue in front of one exporter: batching, retries, and loss accounting.

Every span given to `submit` ends up in exactly one of these counters:
  spans_exported                           the destination accepted it
  spans_dropped{reason="queue_full"}       refused by submit (queue at max_queue_spans)
  spans_dropped{reason="export_failed"}    permanent failure, or retries/elapsed time used up
  spans_dropped{reason="rejected"}         accepted request, span refused (OTLP partial success)
  spans_dropped{reason="shutdown"}         still queued or in flight when shutdown's deadline came,
                                           in a batch whose next retry would come after it, or
                                           submitted after shutdown began
plus export_retries (re-sent batches) and export_failures (batches given up on). Every series
carries exporter=<name>, so a fanout's destinations stay apart; all of them start at 0 when the
queue is made (tracejoin.core.metrics declares the names, labels and reasons).

Each count is made under the queue's lock, and whichever of the worker and shutdown() comes
first counts a batch, so once shutdown() returns: submitted == exported + dropped, exactly.

Memory is bounded: at most max_queue_spans queued plus one batch (max_batch) in flight.

A batch is one export request: up to max_batch spans (2048) and, by their encoded bodies, up
to max_batch_bytes (2 MiB), so a request stays well under the 4 MiB a gRPC receiver takes by
default however large the spans. Fewer, larger requests: the exporter thread spent 1.9-2.3 µs
a span with batches of 512 and 1.1-1.5 µs with 2048 at 5k and 15k spans a second
(bench.profile_agent --rate R, docs/performance.md): the per-request work, shared by four times
the spans.

Retries happen here and only here. The OTLP package's exporters would retry inside export()
(backoff up to their 10 s timeout, 6 attempts); ours make one attempt per call, so a failure
is never retried twice over. The queue is the right place because it alone knows the shutdown
deadline (a retry that cannot finish before it is not started), it counts every retry
(export_retries) and every given-up batch, it applies one policy to every destination (the
file included), and its window (max_elapsed_s, 60 s, backoff capped at 8 s) outlasts a collector
restart, which the package's 10 s does not.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from tracejoin.core.metrics import Metrics
from tracejoin.core.model import EncodedSpan, ExportSpan, Span
from tracejoin.exporters.base import ExportResult, SpanExporter

log = logging.getLogger(__name__)

DROPPED = "spans_dropped"
EXPORTED = "spans_exported"
RETRIES = "export_retries"
FAILURES = "export_failures"

MAX_BATCH = 2048
MAX_BATCH_BYTES = 2 << 20
# What a span not yet encoded (a model.Span: the file, console and Perfetto destinations' path)
# counts for against max_batch_bytes: a server span with its enrichment encodes to ~700 B.
SPAN_BYTES_GUESS = 1024

try:  # compiled where a C compiler was, at install (_request_bytes.c): the same batches
    from tracejoin.exporters._request_bytes import take as _take_c
except ImportError:  # pragma: no cover - the Python loop, under the same tests
    _take_c = None
_take_fast = _take_c  # None: _take_py (tests and the bench switch it)


def use_compiled(on: bool) -> None:
    """For tests and the bench: take batches with _request_bytes.c (as installed) or not."""
    global _take_fast
    if on and _take_c is None:
        raise RuntimeError("_request_bytes.c was not built (gcc, python3-dev: scripts/setup.sh)")
    _take_fast = _take_c if on else None


class BatchExportQueue:
    def __init__(
        self,
        exporter: SpanExporter,
        metrics: Metrics,
        *,
        max_queue_spans: int = 8192,
        max_batch: int = MAX_BATCH,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        flush_interval_s: float = 1.0,
        max_retries: int = 5,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_elapsed_s: float = 60.0,
        name: str,
        rng: random.Random | None = None,
    ) -> None:
        if max_queue_spans < 1 or max_batch < 1:
            raise ValueError("max_queue_spans and max_batch must be at least 1")
        self.exporter = exporter
        self.metrics = metrics
        self.name = name
        self.max_queue_spans = max_queue_spans
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.flush_interval_s = flush_interval_s
        self.max_retries = max_retries
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_elapsed_s = max_elapsed_s
        self._labels = {"exporter": name}
        # An exporter that only sends OTLP protobuf (class attribute accepts_encoded) also takes
        # model.EncodedSpan, the span builder's object-free output; the pipeline sends those only
        # when every destination accepts them.
        self.accepts_encoded: bool = getattr(exporter, "accepts_encoded", False)
        self._rng = rng or random.Random()

        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[ExportSpan] = collections.deque()
        self._inflight: list[ExportSpan] | None = None
        self._accepting = True
        self._flush_requested = False
        self._deadline: float | None = None  # set when shutdown begins
        self._stop = threading.Event()
        self._abandoned = False  # shutdown has counted what was left; the worker must not
        self._finished = False
        self._thread: threading.Thread | None = None
        self._failing = False  # for logging state changes only, not every failed batch
        for metric in (EXPORTED, DROPPED, RETRIES, FAILURES):
            metrics.declare(metric, exporter=name)

    # -- producer side ---------------------------------------------------------------------

    def submit(self, span: ExportSpan) -> bool:
        """Queue one span; never waits. False (and counted) when full or shut down."""
        with self._cond:
            if self._accepting and len(self._queue) < self.max_queue_spans:
                self._queue.append(span)
                if len(self._queue) == self.max_batch:
                    self._cond.notify_all()
                return True
            reason = "queue_full" if self._accepting else "shutdown"
            self.metrics.inc(DROPPED, 1, reason=reason, **self._labels)
        return False

    def submit_many(self, spans: Sequence[ExportSpan]) -> int:
        """Queue what fits of `spans` under one lock; the rest is dropped and counted, as
        submit() would have. Returns how many were queued."""
        with self._cond:
            room = self.max_queue_spans - len(self._queue) if self._accepting else 0
            taken = spans if len(spans) <= room else spans[: max(0, room)]
            if taken:
                before = len(self._queue)
                self._queue.extend(taken)
                if before < self.max_batch <= len(self._queue):
                    self._cond.notify_all()
            refused = len(spans) - len(taken)
            if refused:
                reason = "queue_full" if self._accepting else "shutdown"
                self.metrics.inc(DROPPED, refused, reason=reason, **self._labels)
        return len(taken)

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker (idempotent; a no-op once shutdown has begun)."""
        with self._cond:
            if self._thread is not None or self._deadline is not None:
                return
            label = f"-{self.name}" if self.name else ""
            # A daemon: a hung destination can never keep the process alive past shutdown.
            self._thread = threading.Thread(
                target=self._run, name=f"tracejoin-export{label}", daemon=True
            )
            self._thread.start()

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export everything queued now; True if the queue drained within the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._thread is None:
                return not self._queue and self._inflight is None
            self._flush_requested = True
            self._cond.notify_all()
            while self._queue or self._inflight is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
            return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, flush what fits before the deadline, count the rest as dropped and
        close the exporter. Returns within timeout_s whatever the exporter does; idempotent."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        self._begin_shutdown(deadline)
        self._finish_shutdown()

    def _begin_shutdown(self, deadline: float) -> None:
        with self._cond:
            if self._deadline is not None:
                return
            self._deadline = deadline
            self._accepting = False
            self._cond.notify_all()
        self._stop.set()

    def _finish_shutdown(self) -> None:
        with self._cond:
            if self._finished or self._deadline is None:
                return
            self._finished = True
            deadline = self._deadline
            thread = self._thread
        if thread is not None:
            thread.join(max(deadline - time.monotonic(), 0.0))
        with self._cond:
            self._abandoned = True
            left = len(self._queue) + len(self._inflight or ())
            self._queue.clear()
            self._inflight = None
            self._cond.notify_all()
            if left:
                self.metrics.inc(DROPPED, left, reason="shutdown", **self._labels)
        if left:
            log.warning("export%s: shutdown dropped %d spans", self._label_text(), left)
        # The exporter's own shutdown is bounded by the same deadline.
        closer = threading.Thread(target=self._close_exporter, name="tracejoin-export-close")
        closer.daemon = True
        closer.start()
        closer.join(max(deadline - time.monotonic(), 0.0))

    def _close_exporter(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception:
            log.exception("export%s: exporter shutdown failed", self._label_text())

    # -- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._export(batch)
            except Exception as err:  # keep the worker alive: a dead one would fill the queue
                log.exception("export%s: worker error", self._label_text())
                self._settle(batch, ExportResult.fail(repr(err)))

    def _next_batch(self) -> list[ExportSpan] | None:
        """Wait for a full batch, the flush interval, a flush request or shutdown; None: stop."""
        next_flush = time.monotonic() + self.flush_interval_s
        with self._cond:
            while True:
                q = self._queue
                now = time.monotonic()
                if self._deadline is not None:
                    if not q or now >= self._deadline:
                        return None  # whatever is left, shutdown counts
                    break
                if len(q) >= self.max_batch or (q and (self._flush_requested or now >= next_flush)):
                    break
                if now >= next_flush:
                    next_flush = now + self.flush_interval_s
                self._cond.wait(next_flush - now)
            batch = self._take(q)
            self._inflight = batch
            if not q:
                self._flush_requested = False
            return batch

    def _take(self, q: collections.deque[ExportSpan]) -> list[ExportSpan]:
        """The next batch off q (under the lock): up to max_batch spans, stopping before the
        span that would take it past max_batch_bytes; at least one span."""
        if _take_fast is not None:
            return _take_fast(
                q, self.max_batch, self.max_batch_bytes, EncodedSpan, SPAN_BYTES_GUESS
            )
        return self._take_py(q)

    def _take_py(self, q: collections.deque[ExportSpan]) -> list[ExportSpan]:
        """_take in Python: the reference (_request_bytes.c's take is the same loop)."""
        batch: list[ExportSpan] = []
        size, limit, most = 0, self.max_batch_bytes, min(len(q), self.max_batch)
        while len(batch) < most:
            span = q[0]
            size += len(span.body) if isinstance(span, EncodedSpan) else SPAN_BYTES_GUESS
            if size > limit and batch:
                break
            batch.append(q.popleft())
        return batch

    def _export(self, batch: list[ExportSpan]) -> None:
        started = time.monotonic()
        attempt = 0
        while True:
            timeout: float | None = None
            if self._deadline is not None:
                timeout = self._deadline - time.monotonic()
                if timeout <= 0:
                    self._settle_shutdown(batch)
                    return
            try:
                # EncodedSpans are in `batch` only when the exporter accepts_encoded
                spans = cast("list[Span]", batch)
                result = self.exporter.export(spans, timeout_s=timeout)
            except Exception as err:  # a bug would fail the same way again: do not retry
                log.exception("export%s: exporter raised", self._label_text())
                result = ExportResult.fail(repr(err))
            if result.ok:
                self._settle(batch, result)
                return
            if not result.retryable or attempt >= self.max_retries:
                self._settle(batch, result)
                return
            delay = self._backoff(attempt, result.retry_after_s)
            if time.monotonic() + delay - started > self.max_elapsed_s:
                self._settle(batch, result)
                return
            if not self._pause(delay):
                # The retry would land after the shutdown deadline. Count the batch now: the
                # worker goes on to give the batches queued behind it one attempt each, and
                # that would otherwise overwrite _inflight and lose this one (issue 18, #5).
                self._settle_shutdown(batch)
                return
            attempt += 1
            self.metrics.inc(RETRIES, 1, **self._labels)

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return max(retry_after_s, 0.0)
        cap = min(self.max_backoff_s, self.initial_backoff_s * (2**attempt))
        # Jitter spreads the retries of many agents after a shared collector outage.
        return cap * self._rng.uniform(0.5, 1.0)

    def _pause(self, delay: float) -> bool:
        """Sleep `delay`; False (at once) if shutdown's deadline would fall first."""
        wake = time.monotonic() + delay
        while True:
            deadline = self._deadline
            if deadline is not None and wake > deadline:
                return False
            left = wake - time.monotonic()
            if left <= 0:
                return True
            if self._stop.is_set():
                time.sleep(left)  # the deadline leaves room for this retry
            else:
                self._stop.wait(left)  # wakes early when shutdown begins, to re-check

    def _settle(self, batch: list[ExportSpan], result: ExportResult) -> None:
        """Count a batch's outcome once, unless shutdown has already counted it."""
        n = len(batch)
        # Counted under the lock that shutdown takes to count what is left: whichever side
        # comes first counts the batch, and shutdown() never returns with a count pending.
        # Only the batch in flight is counted, and only once.
        with self._cond:
            if self._abandoned or self._inflight is not batch:
                return
            self._inflight = None
            self._cond.notify_all()
            if result.ok:
                rejected = min(result.rejected_spans, n)
                self.metrics.inc(EXPORTED, n - rejected, **self._labels)
                if rejected:
                    self.metrics.inc(DROPPED, rejected, reason="rejected", **self._labels)
            else:
                self.metrics.inc(FAILURES, 1, **self._labels)
                self.metrics.inc(DROPPED, n, reason="export_failed", **self._labels)
        if result.ok:
            if self._failing:
                self._failing = False
                log.info("export%s: recovered", self._label_text())
            return
        if not self._failing:  # log when the destination goes bad, not for every batch after
            self._failing = True
            log.warning(
                "export%s: dropped %d spans: %s", self._label_text(), n, result.detail or result
            )

    def _settle_shutdown(self, batch: list[ExportSpan]) -> None:
        """The batch cannot be sent before the shutdown deadline: count it as dropped."""
        with self._cond:
            if self._abandoned or self._inflight is not batch:
                return
            self._inflight = None
            self._cond.notify_all()
            self.metrics.inc(DROPPED, len(batch), reason="shutdown", **self._labels)

    def _label_text(self) -> str:
        return f"[{self.name}]" if self.name else ""


class FanoutQueue:
    """One BatchExportQueue per destination, fed the same spans, stopped under one deadline
    (all flush in parallel, so a slow destination does not eat another's shutdown time)."""

    def __init__(self, queues: Iterable[BatchExportQueue]) -> None:
        self.queues = list(queues)
        self.accepts_encoded = all(q.accepts_encoded for q in self.queues)

    def submit(self, span: ExportSpan) -> bool:
        """True if every destination took the span (each counts its own drops)."""
        ok = True
        for q in self.queues:
            ok = q.submit(span) and ok
        return ok

    def submit_many(self, spans: Sequence[ExportSpan]) -> int:
        """Each destination takes what fits (each counts its own drops); returns the fewest
        any destination took."""
        return min((q.submit_many(spans) for q in self.queues), default=len(spans))

    def start(self) -> None:
        for q in self.queues:
            q.start()

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        return all([q.force_flush(max(deadline - time.monotonic(), 0.0)) for q in self.queues])

    def shutdown(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        for q in self.queues:
            q._begin_shutdown(deadline)
        for q in self.queues:
            q._finish_shutdown()


def fanout(
    exporters: Mapping[str, SpanExporter] | Sequence[tuple[str, SpanExporter]],
    metrics: Metrics,
    **queue_options: Any,
) -> FanoutQueue:
    """A FanoutQueue with one named BatchExportQueue per (name, exporter)."""
    pairs = exporters.items() if isinstance(exporters, Mapping) else exporters
    return FanoutQueue(
        BatchExportQueue(exp, metrics, name=name, **queue_options) for name, exp in pairs
    )
