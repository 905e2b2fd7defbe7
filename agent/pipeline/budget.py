"""The overload budget (`--cpu-budget`): the agent keeps its own CPU near a share of one CPU by
lowering an in-kernel sampling ratio, and raises the ratio again when load falls.

The ratio is applied in the kernel (bpf/http_conn.h budget_keeps) by trace id, with the rule of
OpenTelemetry's TraceIdRatioBased sampler: keep when the trace id's low 8 bytes, read big-endian,
are below ratio x 2^64. Every agent applying the same ratio keeps the same traces, so a trace that
crosses nodes stays whole. What is shed is counted (`kernel_sampled_out_budget`) and aggregated
per endpoint in the kernel (counts and latencies), apart from losses.

The controller is a pure function of readings (the agent's CPU seconds, the kernel's ringbuf_full
count, the fill of each batch the reader takes, the time), so tests drive it with made-up ones.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

DEFAULT_CPU_BUDGET = 0.5  # a share of one CPU; the DaemonSet's CPU limit is 1
MIN_RATIO = 1 / 1024  # never shed everything: some traces always get through
RAISE_BELOW = 0.7  # raise the ratio while the agent uses less than this share of its budget
OVER_TICKS = 2  # consecutive readings above the budget before lowering (start-up, GC, a blip)
# Readings closer than this to the last one are ignored: /metrics scrapes read too, and a share
# over a few ms is noise (two of them right after HTTP/2's verification once shed 30 %).
MIN_INTERVAL_S = 0.9
# Batches that found at least this share of the ring to read, FILL_BATCHES in a row and the
# backlog not draining by FILL_DRAIN a batch: the reader is falling behind, and at 20k req/s
# the ring is full a fraction of a second later, long before the next reading. The ratio is
# halved at once, at most once per FILL_STEP_S. (One full batch alone is a backlog, not a rate:
# a reader that was paused, or stopped and continued; a draining one is being caught up with:
# halving again while it drains would overshoot.)
FILL_HIGH = 0.5
# Caught up with: the backlog shrank by at least this share of the ring since the last batch
# (the compiled reader takes an eighth per batch: a reader that keeps up drains about that much;
# a starved one, a little or nothing, and it is still losing once the ring is full).
FILL_DRAIN = 1 / 16
FILL_BATCHES = 2
FILL_STEP_S = 0.1


@dataclass
class BudgetController:
    """Call `update` about once a second with running totals; it returns the ratio to apply.

    Lowering: the agent's CPU is mostly per record, so the ratio is scaled by budget/share (with
    10 % headroom), at most 4x at once. Ring-buffer losses while the agent was busy (at least half
    its budget) halve it: the reader is not keeping up (unless the fill rule below halved it in
    that interval already). Losses while it was idle are not its load (a stopped process, a
    reader paused on purpose) and change nothing. Between readings, the reader reports how much
    of the ring each batch found to read (`filled`): FILL_BATCHES in a row from FILL_HIGH on,
    the backlog not draining by FILL_DRAIN a batch, halve the ratio at once, before the ring
    overflows (a CPU-starved reader falls behind below its budget too). Raising: by 1.5x a
    reading while the share stays below RAISE_BELOW of the budget, nothing is lost and no batch
    filled the ring that far since the last reading.

    `update` (the main thread's readings) and `filled` (the reader's batches) may run at once:
    both change the ratio under one lock and return it."""

    budget: float = DEFAULT_CPU_BUDGET  # 0: off (the ratio stays 1)
    ratio: float = 1.0
    share: float = 0.0  # the agent's CPU share over the last interval
    _last: tuple[float, float, int] | None = field(default=None, repr=False)
    _over: int = field(default=0, repr=False)
    _filled_at: float | None = field(default=None, repr=False)  # the last fill-lowering
    _full_batches: int = field(default=0, repr=False)  # in a row, from FILL_HIGH on
    _prev_fill: float = field(default=0.0, repr=False)
    _filled_since: bool = field(default=False, repr=False)  # one since the last reading
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def skip(self) -> None:
        """Forget the last reading: the agent is doing start-up work (verifying programs after
        ready), CPU that shedding requests would not lower. The next update starts afresh."""
        self._last = None
        self._over = 0

    def filled(self, now_s: float, fraction: float) -> float:
        """The reader took a batch that filled `fraction` of the ring; returns the ratio."""
        with self._lock:
            behind = fraction >= FILL_HIGH and fraction > self._prev_fill - FILL_DRAIN
            self._prev_fill = fraction
            self._full_batches = self._full_batches + 1 if behind else 0
            if self.budget <= 0 or self._full_batches < FILL_BATCHES:
                return self.ratio
            if self._filled_at is not None and 0 <= now_s - self._filled_at < FILL_STEP_S:
                return self.ratio
            self._filled_at, self._filled_since = now_s, True
            self.ratio = max(MIN_RATIO, self.ratio * 0.5)
            return self.ratio

    def update(self, now_s: float, cpu_s: float, ringbuf_full: int) -> float:
        with self._lock:
            return self._update(now_s, cpu_s, ringbuf_full)

    def _update(self, now_s: float, cpu_s: float, ringbuf_full: int) -> float:
        last = self._last
        if last is not None and 0 < now_s - last[0] < MIN_INTERVAL_S:
            return self.ratio  # too soon: the interval runs on from the last reading
        self._last = (now_s, cpu_s, ringbuf_full)
        filled, self._filled_since = self._filled_since, False
        if last is None or self.budget <= 0 or now_s <= last[0]:
            return self.ratio
        self.share = share = max(0.0, cpu_s - last[1]) / (now_s - last[0])
        # losses the fill rule already answered in this interval are not halved for again
        lost = ringbuf_full > last[2] and share >= self.budget / 2 and not filled
        self._over = self._over + 1 if share > self.budget else 0
        if lost or self._over >= OVER_TICKS:
            scale = 0.5 if lost else 1.0
            if share > self.budget:
                scale = min(scale, max(0.25, 0.9 * self.budget / share))
            self.ratio = max(MIN_RATIO, self.ratio * scale)
        elif share < RAISE_BELOW * self.budget and ringbuf_full == last[2] and not filled:
            self.ratio = min(1.0, self.ratio * 1.5)
        return self.ratio
