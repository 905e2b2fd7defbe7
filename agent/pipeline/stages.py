"""Wire the stages together: probes -> decode -> correlate/spans -> exporters.

One reader thread polls the ring buffer and builds spans; exporters run behind bounded queues on
their own threads, so a slow or dead destination never stalls reading from the kernel. Start
runs source-last; shutdown runs in reverse (stop the source, drain, flush exporters).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue, Span
from tracejoin.kernel.decode import HttpRecord, RecordDecoder
from tracejoin.kernel.probes import HttpProbes, ProbeConfig
from tracejoin.pipeline.spans import SpanBuilder

log = logging.getLogger(__name__)


class Destination(Protocol):
    def start(self) -> None: ...
    def submit(self, span: Span) -> bool: ...
    def shutdown(self, timeout_s: float = ...) -> None: ...


class GpuJoiner(Protocol):
    def join(self, pid: int, start_ns: int, end_ns: int) -> dict[str, AttrValue]: ...
    def covered_until_ns(self) -> int: ...


MAX_HELD = 50_000  # spans waiting for GPU samples; beyond it the oldest are joined early


class Pipeline:
    def __init__(
        self,
        probe_config: ProbeConfig,
        builder_factory: Callable[[str], SpanBuilder],
        destinations: Sequence[Destination],
        metrics: Metrics,
        on_spans: Callable[[list[Span], HttpRecord], None] | None = None,
        gpu: GpuJoiner | None = None,
        gpu_hold_s: float = 1.0,
    ) -> None:
        self.metrics = metrics
        self.decoder = RecordDecoder(metrics)
        self.probes = HttpProbes(probe_config, metrics, self._on_raw)
        self._builder_factory = builder_factory
        self.builder: SpanBuilder | None = None
        self.destinations = list(destinations)
        self.on_spans = on_spans
        # GPU samples for a request's last moments arrive up to one sampling interval after
        # it ends: hold its spans until the sampler has covered its end (or gpu_hold_s).
        self.gpu = gpu
        self.gpu_hold_s = gpu_hold_s
        self._held: deque[tuple[float, list[Span], HttpRecord]] = deque()
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._reader: threading.Thread | None = None
        self.ready = threading.Event()
        self._stopped = False

    def start(self) -> None:
        for dest in self.destinations:
            dest.start()
        self.probes.start()
        self.builder = self._builder_factory(self.probes.status.tlb_mode)
        self._reader = threading.Thread(
            target=self._read_loop, name="tracejoin-reader", daemon=True
        )
        self._reader.start()
        self.ready.set()

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            if self._paused.is_set():
                time.sleep(0.05)
                continue
            try:
                self.probes.poll(100)
                if self._held:
                    self._release_held()
            except Exception:  # a bug here must not kill the agent: count and go on
                log.exception("ring buffer poll failed")
                self.metrics.inc("reader_errors")
                time.sleep(0.1)

    def pause_reading(self, paused: bool) -> None:
        """Stop consuming the ring buffer (tests of loss accounting use this)."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()

    def _on_raw(self, data: bytes) -> None:
        self.metrics.inc("records_received")
        rec = self.decoder.decode(data)
        if not isinstance(rec, HttpRecord) or self.builder is None:
            self.metrics.inc("records_dropped_userspace", reason="undecodable")
            return
        try:
            spans = self.builder.build(rec)
        except Exception:
            log.exception("building a span failed")
            self.metrics.inc("records_dropped_userspace", reason="build_error")
            return
        if not spans:
            return
        if self.gpu is not None:
            if len(self._held) >= MAX_HELD:
                self.metrics.inc("gpu_join_early")
                self._release_one(*self._held.popleft())
            self._held.append((time.monotonic() + self.gpu_hold_s, spans, rec))
            return
        self._emit(spans, rec)

    def _release_held(self, force: bool = False) -> None:
        assert self.gpu is not None
        covered = self.gpu.covered_until_ns()
        now = time.monotonic()
        while self._held:
            deadline, spans, rec = self._held[0]
            if not force and spans[0].end_ns > covered and now < deadline:
                break
            self._held.popleft()
            self._release_one(deadline, spans, rec)

    def _release_one(self, _deadline: float, spans: list[Span], rec: HttpRecord) -> None:
        assert self.gpu is not None
        server = spans[0]
        try:
            server.attributes.update(self.gpu.join(rec.pid, server.start_ns, server.end_ns))
        except Exception:
            log.exception("GPU join failed")
            self.metrics.inc("gpu_join_errors")
        self._emit(spans, rec)

    def _emit(self, spans: list[Span], rec: HttpRecord) -> None:
        self.metrics.inc("spans_built", len(spans))
        for dest in self.destinations:
            for span in spans:
                dest.submit(span)
        if self.on_spans is not None:
            self.on_spans(spans, rec)

    def kernel_counters(self) -> dict[str, int]:
        counters = self.probes.kernel_counters()
        for name, value in counters.items():
            self.metrics.set("kernel_" + name, value)
        return counters

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Idempotent. Detach probes first so nothing new arrives, drain what the ring buffer
        holds, then give exporters what is left of the deadline."""
        if self._stopped:
            return
        self._stopped = True
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=1.0)
        try:
            self.probes.poll(0)  # records already in the ring buffer
            self.kernel_counters()
            if self._held:
                self._release_held(force=True)
        except Exception:
            log.exception("final drain failed")
        self.probes.shutdown()
        # destinations flush in parallel under one deadline: a hung one cannot starve another
        stoppers = [
            threading.Thread(
                target=d.shutdown, args=(max(0.1, deadline - time.monotonic()),), daemon=True
            )
            for d in self.destinations
        ]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(max(0.1, deadline - time.monotonic()))
