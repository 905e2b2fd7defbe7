"""GPU sample history and the per-request join: pure data and maths, no NVML.

The sampler (agent/gpu_sampler.py) fills one DeviceHistory per GPU; for a span of process P over
[start_ns, end_ns] (Unix epoch ns), `join_device` summarises the samples that overlap that time
window and `span_attributes` turns the summaries into span attributes. Attribution is a time
window: device-wide figures describe everything that ran on the GPU meanwhile, not only P.

Overlap rule: sample i describes the half-open interval (starts[i], ends[i]], where ends[i] is
its timestamp and starts[i] the previous sample's timestamp in the same series, but never more
than `max_interval_ns` earlier (NVML averages over at most 1 s, so an older gap is not covered
by this sample). Averages are weighted by how long each sample's interval overlaps the window;
a zero-length window takes the one sample whose interval contains its instant. Everything here
runs per request, so lookups bisect instead of scanning.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from tracejoin.core.model import AttrValue

V = TypeVar("V")

NS_PER_S = 1_000_000_000

# Attribute names. Ratios are 0..1; every name ends in what it summarises (.avg/.max over the
# window). NVML "utilization.gpu" is the share of time at least one kernel ran, not SM occupancy,
# hence "kernel_active"; "utilization.memory" is the share of time device memory was being read
# or written, hence "memory_controller_busy". docs/gpu.md lists each with unit and source.
P = "tracejoin.gpu."
DEVICE_COUNT = P + "device.count"
DEVICE_INDEX = P + "device.index"
DEVICE_UUID = P + "device.uuid"
DEVICE_LOST = P + "device.lost"
WINDOW_COVERAGE = P + "window.coverage.ratio"
KERNEL_ACTIVE_AVG = P + "kernel_active.ratio.avg"
KERNEL_ACTIVE_MAX = P + "kernel_active.ratio.max"
MEM_BUSY_AVG = P + "memory_controller_busy.ratio.avg"
MEM_BUSY_MAX = P + "memory_controller_busy.ratio.max"
PROCESS_SM_UTIL_AVG = P + "process.sm_util.ratio.avg"
PROCESS_SM_UTIL_MAX = P + "process.sm_util.ratio.max"
PROCESS_MEMORY_USED_MAX = P + "process.memory.used.max"
MEMORY_USED_MAX = P + "memory.used.max"
MEMORY_TOTAL = P + "memory.total"
SM_CLOCK_AVG = P + "clock.sm.avg"
POWER_AVG = P + "power.avg"
TEMPERATURE_MAX = P + "temperature.max"
PCIE_RX_AVG = P + "pcie.rx_throughput.avg"
PCIE_TX_AVG = P + "pcie.tx_throughput.avg"
CLOCK_EVENT_REASONS = P + "clock_event_reasons"
GPM_SM_UTIL_AVG = P + "gpm.sm_util.ratio.avg"
GPM_SM_UTIL_MAX = P + "gpm.sm_util.ratio.max"
GPM_DRAM_BW_AVG = P + "gpm.dram_bw_util.ratio.avg"
GPM_DRAM_BW_MAX = P + "gpm.dram_bw_util.ratio.max"

ALL_ATTRIBUTES = (
    DEVICE_COUNT,
    DEVICE_INDEX,
    DEVICE_UUID,
    DEVICE_LOST,
    WINDOW_COVERAGE,
    KERNEL_ACTIVE_AVG,
    KERNEL_ACTIVE_MAX,
    MEM_BUSY_AVG,
    MEM_BUSY_MAX,
    PROCESS_SM_UTIL_AVG,
    PROCESS_SM_UTIL_MAX,
    PROCESS_MEMORY_USED_MAX,
    MEMORY_USED_MAX,
    MEMORY_TOTAL,
    SM_CLOCK_AVG,
    POWER_AVG,
    TEMPERATURE_MAX,
    PCIE_RX_AVG,
    PCIE_TX_AVG,
    CLOCK_EVENT_REASONS,
    GPM_SM_UTIL_AVG,
    GPM_SM_UTIL_MAX,
    GPM_DRAM_BW_AVG,
    GPM_DRAM_BW_MAX,
)

# nvmlClocksEventReason* bits (an ABI-stable bitmask in nvml.h), named in snake_case.
CLOCK_EVENT_REASON_NAMES = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def clock_event_reason_names(mask: int) -> list[str]:
    """Names of the bits set in an NVML clock-event (throttle) reason mask, lowest bit first."""
    names = []
    bit = 1
    while bit <= mask:
        if mask & bit:
            names.append(CLOCK_EVENT_REASON_NAMES.get(bit, f"unknown_{bit:#x}"))
        bit <<= 1
    return names


class Series(Generic[V]):
    """Time-ordered samples, at most `capacity` of them (the oldest are dropped).

    Parallel lists rather than a list of tuples so `bisect` runs on plain ints. Not thread-safe by
    itself: the owner (DeviceHistory) holds its lock around appends and joins.
    """

    __slots__ = ("capacity", "ends", "max_interval_ns", "starts", "values")

    def __init__(self, capacity: int, max_interval_ns: int) -> None:
        if capacity < 1 or max_interval_ns < 1:
            raise ValueError("capacity and max_interval_ns must be positive")
        self.capacity = capacity
        self.max_interval_ns = max_interval_ns
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.values: list[V] = []

    def __len__(self) -> int:
        return len(self.ends)

    def append(self, t_ns: int, value: V) -> bool:
        """Add a sample stamped t_ns. Returns False (and drops it) if not newer than the last."""
        start = t_ns - self.max_interval_ns
        if self.ends:
            last = self.ends[-1]
            if t_ns <= last:
                return False
            start = max(start, last)
        self.starts.append(start)
        self.ends.append(t_ns)
        self.values.append(value)
        if len(self.ends) > self.capacity:
            del self.starts[0], self.ends[0], self.values[0]
        return True

    def last_ns(self) -> int:
        return self.ends[-1] if self.ends else 0


def overlaps(series: Series[V], start_ns: int, end_ns: int) -> list[tuple[int, int]]:
    """(index, overlap in ns) of each sample whose interval overlaps [start_ns, end_ns].

    A zero-length window gets the single sample whose interval contains it, with weight 1.
    """
    ends, starts = series.ends, series.starts
    if end_ns < start_ns:
        return []
    if end_ns == start_ns:
        i = bisect_left(ends, start_ns)
        return [(i, 1)] if i < len(ends) and starts[i] < start_ns else []
    out = []
    i = bisect_right(ends, start_ns)  # first sample ending after the window starts
    n = len(ends)
    while i < n and starts[i] < end_ns:
        out.append((i, min(end_ns, ends[i]) - max(start_ns, starts[i])))
        i += 1
    return out


class Stats(NamedTuple):
    avg: float  # weighted by overlap duration
    max: float
    covered_ns: int  # how much of the window the samples cover (0 for a zero-length window)


class _Acc:
    """Running overlap-weighted sum and maximum of one quantity."""

    __slots__ = ("top", "total", "weight")

    def __init__(self) -> None:
        self.total = 0.0
        self.weight = 0
        self.top = 0.0

    def add(self, v: float, w: int) -> None:
        if self.weight == 0 or v > self.top:
            self.top = v
        self.total += v * w
        self.weight += w

    def stats(self, zero_length: bool) -> Stats | None:
        if self.weight == 0:
            return None
        return Stats(self.total / self.weight, self.top, 0 if zero_length else self.weight)

    def avg(self) -> float | None:
        return self.total / self.weight if self.weight else None


def window_stats(series: Series[float], start_ns: int, end_ns: int) -> Stats | None:
    """Overlap-weighted average and maximum of a scalar series over a window (None: no samples)."""
    acc = _Acc()
    values = series.values
    for i, w in overlaps(series, start_ns, end_ns):
        acc.add(values[i], w)
    return acc.stats(end_ns == start_ns)


class DeviceState(NamedTuple):
    """What one sampler tick read from a device. None: not read (unsupported or failed)."""

    memory_used: int | None = None  # bytes, whole device
    memory_total: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    power_w: float | None = None
    temperature_c: int | None = None
    clock_event_reasons: int | None = None  # NVML bitmask
    pcie_rx_kbps: int | None = None  # NVML's KB/s, read every pcie_interval_s only
    pcie_tx_kbps: int | None = None
    gpm_sm_util: float | None = None  # ratio over (previous GPM sample, this one]
    gpm_dram_bw_util: float | None = None
    processes: dict[int, int | None] | None = None  # pid -> GPU memory bytes (None: not known)


class DeviceHistory:
    """Everything sampled from one GPU. Appends and joins hold `lock`; each series is bounded."""

    def __init__(
        self,
        index: int,
        uuid: str,
        name: str,
        capacity: int,
        max_interval_ns: int,
        max_pids: int,
        process_interval_ns: int | None = None,
    ) -> None:
        self.index = index
        self.uuid = uuid
        self.name = name
        self.lock = threading.Lock()
        self.capacity = capacity
        self.max_interval_ns = max_interval_ns
        self.max_pids = max_pids
        # NVML omits a process that was idle, so a per-process sample covers at most this much
        # before its timestamp even when the process's previous sample is older.
        self.process_interval_ns = process_interval_ns or max_interval_ns
        self.lost = False
        self.kernel_active: Series[float] = Series(capacity, max_interval_ns)
        self.memory_busy: Series[float] = Series(capacity, max_interval_ns)
        self.state: Series[DeviceState] = Series(capacity, max_interval_ns)
        # Per-process SM utilisation (ratio). NVML omits processes that were idle, so
        # `process_polls` records when it was asked and answered: inside those intervals a
        # missing sample means zero.
        self.process_sm: dict[int, Series[float]] = {}
        self.process_polls: Series[int] = Series(capacity, max_interval_ns)

    def add_process_sample(self, pid: int, t_ns: int, sm_ratio: float) -> None:
        series = self.process_sm.get(pid)
        if series is None:
            if len(self.process_sm) >= self.max_pids:
                # Bounded: forget the process heard from least recently.
                stale = min(self.process_sm, key=lambda p: self.process_sm[p].last_ns())
                del self.process_sm[stale]
            # A quarter of the device capacity: joins look seconds back, not minutes, and there
            # can be max_pids of these per device.
            cap = max(1, self.capacity // 4)
            series = self.process_sm[pid] = Series(cap, self.process_interval_ns)
        series.append(t_ns, sm_ratio)


@dataclass(slots=True)
class DeviceWindow:
    """One device's samples summarised over one span's window. None: nothing sampled."""

    index: int
    uuid: str
    lost: bool
    coverage: float  # share of the window covered by kernel-active samples, 0..1
    kernel_active: Stats | None = None
    memory_busy: Stats | None = None
    process_sm_util: Stats | None = None
    process_memory_used_max: int | None = None
    memory_used_max: int | None = None
    memory_total: int | None = None
    sm_clock_avg_mhz: float | None = None
    power_avg_w: float | None = None
    temperature_max_c: int | None = None
    pcie_rx_avg_kbps: float | None = None
    pcie_tx_avg_kbps: float | None = None
    clock_event_reasons: int | None = None  # OR of every mask seen
    gpm_sm_util: Stats | None = None
    gpm_dram_bw_util: Stats | None = None


def process_on_device(h: DeviceHistory, pid: int, start_ns: int, end_ns: int) -> bool:
    """Did NVML list `pid` on this device during the window?

    Looks `max_interval_ns` further back than the window: a request that ends between two
    sampler ticks has no tick inside it yet, and the process was listed at the previous one.
    """
    lo = start_ns - h.max_interval_ns
    states = h.state.values
    for i, _ in overlaps(h.state, lo, end_ns):
        procs = states[i].processes
        if procs is not None and pid in procs:
            return True
    series = h.process_sm.get(pid)
    return series is not None and bool(overlaps(series, lo, end_ns))


def join_device(
    h: DeviceHistory, pid: int | None, start_ns: int, end_ns: int
) -> DeviceWindow | None:
    """Summarise one device over [start_ns, end_ns] for process `pid`.

    None when the process was not on this device (or the window is inverted). pid None: the
    device whatever ran on it, without per-process figures. The caller holds h.lock if a
    sampler may be appending concurrently.
    """
    if end_ns < start_ns:
        return None
    if pid is not None and not process_on_device(h, pid, start_ns, end_ns):
        return None
    zero = end_ns == start_ns
    kernel = window_stats(h.kernel_active, start_ns, end_ns)
    coverage = 0.0
    if kernel is not None:
        coverage = 1.0 if zero else min(1.0, kernel.covered_ns / (end_ns - start_ns))
    w = DeviceWindow(h.index, h.uuid, h.lost, coverage, kernel)
    w.memory_busy = window_stats(h.memory_busy, start_ns, end_ns)
    if pid is not None:
        w.process_sm_util = _process_sm(h, pid, start_ns, end_ns)

    # One pass over the tick samples (per request: keep it cheap).
    clock, power, rx, tx, gpm_sm, gpm_dram = _Acc(), _Acc(), _Acc(), _Acc(), _Acc(), _Acc()
    states = h.state.values
    for i, wt in overlaps(h.state, start_ns, end_ns):
        s = states[i]
        if s.memory_used is not None:
            w.memory_used_max = max(w.memory_used_max or 0, s.memory_used)
        if s.memory_total is not None:
            w.memory_total = max(w.memory_total or 0, s.memory_total)
        if s.temperature_c is not None:
            w.temperature_max_c = max(w.temperature_max_c or 0, s.temperature_c)
        if s.clock_event_reasons is not None:
            w.clock_event_reasons = (w.clock_event_reasons or 0) | s.clock_event_reasons
        if s.sm_clock_mhz is not None:
            clock.add(s.sm_clock_mhz, wt)
        if s.power_w is not None:
            power.add(s.power_w, wt)
        if s.pcie_rx_kbps is not None:
            rx.add(s.pcie_rx_kbps, wt)
        if s.pcie_tx_kbps is not None:
            tx.add(s.pcie_tx_kbps, wt)
        if s.gpm_sm_util is not None:
            gpm_sm.add(s.gpm_sm_util, wt)
        if s.gpm_dram_bw_util is not None:
            gpm_dram.add(s.gpm_dram_bw_util, wt)
        if pid is not None and s.processes is not None:
            used = s.processes.get(pid)
            if used is not None:
                w.process_memory_used_max = max(w.process_memory_used_max or 0, used)
    w.sm_clock_avg_mhz = clock.avg()
    w.power_avg_w = power.avg()
    w.pcie_rx_avg_kbps = rx.avg()
    w.pcie_tx_avg_kbps = tx.avg()
    w.gpm_sm_util = gpm_sm.stats(zero)
    w.gpm_dram_bw_util = gpm_dram.stats(zero)
    return w


def _process_sm(h: DeviceHistory, pid: int, start_ns: int, end_ns: int) -> Stats | None:
    """The process's SM utilisation over the window, counting unreported polled time as zero.

    Denominator: the part of the window NVML was asked about (process_polls), or the part the
    process's own samples cover if that is larger. None if NVML was never asked in the window.
    """
    polled = overlaps(h.process_polls, start_ns, end_ns)
    if not polled:
        return None
    zero = end_ns == start_ns
    series = h.process_sm.get(pid)
    own = window_stats(series, start_ns, end_ns) if series is not None else None
    if zero:
        return own or Stats(0.0, 0.0, 0)
    polled_ns = sum(w for _, w in polled)
    if own is None:
        return Stats(0.0, 0.0, polled_ns)
    weight = max(polled_ns, own.covered_ns)
    return Stats(own.avg * own.covered_ns / weight, own.max, weight)


def span_attributes(windows: Sequence[DeviceWindow]) -> dict[str, AttrValue]:
    """Flatten per-device windows into span attributes. No devices: no attributes.

    With several devices (a process using more than one GPU): ratios average the per-device
    averages and take the overall maximum; memory, power and PCIe figures are summed; clock is
    averaged; temperature is the maximum; reasons are the union; index and UUID list every device
    in index order, comma-separated.
    """
    if not windows:
        return {}
    if len(windows) == 1:
        return _one_device(windows[0])
    ws = sorted(windows, key=lambda w: w.index)
    attrs: dict[str, AttrValue] = {
        DEVICE_COUNT: len(ws),
        DEVICE_INDEX: ",".join(str(w.index) for w in ws),
        DEVICE_UUID: ",".join(w.uuid for w in ws),
        WINDOW_COVERAGE: min(w.coverage for w in ws),
    }
    if any(w.lost for w in ws):
        attrs[DEVICE_LOST] = True
    _put_stats(attrs, KERNEL_ACTIVE_AVG, KERNEL_ACTIVE_MAX, [w.kernel_active for w in ws])
    _put_stats(attrs, MEM_BUSY_AVG, MEM_BUSY_MAX, [w.memory_busy for w in ws])
    _put_stats(attrs, PROCESS_SM_UTIL_AVG, PROCESS_SM_UTIL_MAX, [w.process_sm_util for w in ws])
    _put_stats(attrs, GPM_SM_UTIL_AVG, GPM_SM_UTIL_MAX, [w.gpm_sm_util for w in ws])
    _put_stats(attrs, GPM_DRAM_BW_AVG, GPM_DRAM_BW_MAX, [w.gpm_dram_bw_util for w in ws])
    _put_sum(attrs, PROCESS_MEMORY_USED_MAX, [w.process_memory_used_max for w in ws])
    _put_sum(attrs, MEMORY_USED_MAX, [w.memory_used_max for w in ws])
    _put_sum(attrs, MEMORY_TOTAL, [w.memory_total for w in ws])
    _put_sum(attrs, POWER_AVG, [w.power_avg_w for w in ws])
    _put_sum(attrs, PCIE_RX_AVG, [w.pcie_rx_avg_kbps for w in ws])
    _put_sum(attrs, PCIE_TX_AVG, [w.pcie_tx_avg_kbps for w in ws])
    clocks = [w.sm_clock_avg_mhz for w in ws if w.sm_clock_avg_mhz is not None]
    if clocks:
        attrs[SM_CLOCK_AVG] = sum(clocks) / len(clocks)
    temps = [w.temperature_max_c for w in ws if w.temperature_max_c is not None]
    if temps:
        attrs[TEMPERATURE_MAX] = max(temps)
    masks = [w.clock_event_reasons for w in ws if w.clock_event_reasons is not None]
    if masks:
        union = 0
        for m in masks:
            union |= m
        attrs[CLOCK_EVENT_REASONS] = _reasons_text(union)
    return attrs


def _one_device(w: DeviceWindow) -> dict[str, AttrValue]:
    """span_attributes for the common case, one GPU, without the aggregation lists."""
    attrs: dict[str, AttrValue] = {
        DEVICE_COUNT: 1,
        DEVICE_INDEX: str(w.index),
        DEVICE_UUID: w.uuid,
        WINDOW_COVERAGE: w.coverage,
    }
    if w.lost:
        attrs[DEVICE_LOST] = True
    for avg_key, max_key, st in (
        (KERNEL_ACTIVE_AVG, KERNEL_ACTIVE_MAX, w.kernel_active),
        (MEM_BUSY_AVG, MEM_BUSY_MAX, w.memory_busy),
        (PROCESS_SM_UTIL_AVG, PROCESS_SM_UTIL_MAX, w.process_sm_util),
        (GPM_SM_UTIL_AVG, GPM_SM_UTIL_MAX, w.gpm_sm_util),
        (GPM_DRAM_BW_AVG, GPM_DRAM_BW_MAX, w.gpm_dram_bw_util),
    ):
        if st is not None:
            attrs[avg_key] = st.avg
            attrs[max_key] = st.max
    for key, v in (
        (PROCESS_MEMORY_USED_MAX, w.process_memory_used_max),
        (MEMORY_USED_MAX, w.memory_used_max),
        (MEMORY_TOTAL, w.memory_total),
        (SM_CLOCK_AVG, w.sm_clock_avg_mhz),
        (POWER_AVG, w.power_avg_w),
        (TEMPERATURE_MAX, w.temperature_max_c),
        (PCIE_RX_AVG, w.pcie_rx_avg_kbps),
        (PCIE_TX_AVG, w.pcie_tx_avg_kbps),
    ):
        if v is not None:
            attrs[key] = v
    if w.clock_event_reasons is not None:
        attrs[CLOCK_EVENT_REASONS] = _reasons_text(w.clock_event_reasons)
    return attrs


def _reasons_text(mask: int) -> str:
    return ",".join(clock_event_reason_names(mask)) or "none"


def _put_stats(
    attrs: dict[str, AttrValue], avg_key: str, max_key: str, stats: list[Stats | None]
) -> None:
    present = [s for s in stats if s is not None]
    if present:
        attrs[avg_key] = sum(s.avg for s in present) / len(present)
        attrs[max_key] = max(s.max for s in present)


def _put_sum(attrs: dict[str, AttrValue], key: str, values: Sequence[float | int | None]) -> None:
    present = [v for v in values if v is not None]
    if present:
        attrs[key] = sum(present)
