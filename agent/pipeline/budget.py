"""The overload budget (`--cpu-budget`): the agent keeps its own CPU near a share of one CPU by
lowering an in-kernel sampling ratio, and raises the ratio again when load falls.

The ratio is applied in the kernel (bpf/http_conn.h budget_keeps) by trace id, with the rule of
OpenTelemetry's TraceIdRatioBased sampler: keep when the trace id's low 8 bytes, read big-endian,
are below ratio x 2^64. Every agent applying the same ratio keeps the same traces, so a trace that
crosses nodes stays whole. What is shed is counted (`kernel_sampled_out_budget`) and aggregated
per endpoint in the kernel (counts and latencies), apart from losses.

The controller is a pure function of readings (the agent's CPU seconds, the kernel's ringbuf_full
count, the time), so tests drive it with made-up ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_CPU_BUDGET = 0.5  # a share of one CPU; the DaemonSet's CPU limit is 1
MIN_RATIO = 1 / 1024  # never shed everything: some traces always get through
RAISE_BELOW = 0.7  # raise the ratio while the agent uses less than this share of its budget
OVER_TICKS = 2  # consecutive readings above the budget before lowering (start-up, GC, a blip)
# Readings closer than this to the last one are ignored: /metrics scrapes read too, and a share
# over a few ms is noise (two of them right after HTTP/2's verification once shed 30 %).
MIN_INTERVAL_S = 0.9


@dataclass
class BudgetController:
    """Call `update` about once a second with running totals; it returns the ratio to apply.

    Lowering: the agent's CPU is mostly per record, so the ratio is scaled by budget/share (with
    10 % headroom), at most 4x at once. Ring-buffer losses while the agent was busy (at least half
    its budget) halve it: the reader is not keeping up. Losses while it was idle are not its load
    (a stopped process, a reader paused on purpose) and change nothing. Raising: by 1.5x a
    reading while the share stays below RAISE_BELOW of the budget and nothing is lost."""

    budget: float = DEFAULT_CPU_BUDGET  # 0: off (the ratio stays 1)
    ratio: float = 1.0
    share: float = 0.0  # the agent's CPU share over the last interval
    _last: tuple[float, float, int] | None = field(default=None, repr=False)
    _over: int = field(default=0, repr=False)

    def skip(self) -> None:
        """Forget the last reading: the agent is doing start-up work (verifying programs after
        ready), CPU that shedding requests would not lower. The next update starts afresh."""
        self._last = None
        self._over = 0

    def update(self, now_s: float, cpu_s: float, ringbuf_full: int) -> float:
        last = self._last
        if last is not None and 0 < now_s - last[0] < MIN_INTERVAL_S:
            return self.ratio  # too soon: the interval runs on from the last reading
        self._last = (now_s, cpu_s, ringbuf_full)
        if last is None or self.budget <= 0 or now_s <= last[0]:
            return self.ratio
        self.share = share = max(0.0, cpu_s - last[1]) / (now_s - last[0])
        lost = ringbuf_full > last[2] and share >= self.budget / 2
        self._over = self._over + 1 if share > self.budget else 0
        if lost or self._over >= OVER_TICKS:
            scale = 0.5 if lost else 1.0
            if share > self.budget:
                scale = min(scale, max(0.25, 0.9 * self.budget / share))
            self.ratio = max(MIN_RATIO, self.ratio * scale)
        elif share < RAISE_BELOW * self.budget and ringbuf_full == last[2]:
            self.ratio = min(1.0, self.ratio * 1.5)
        return self.ratio
