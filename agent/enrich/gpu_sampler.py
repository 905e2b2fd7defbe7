"""NVML sampler: polls each visible GPU from a daemon thread into bounded DeviceHistory rings.

The nvml module is a parameter (default: the real `pynvml`; tests pass agent.nvml_fake.FakeNvml).
Failures degrade, never stop the agent: no library, no driver or no GPU leave the sampler off
with a reason and a fix (`probe_nvml`, `GpuSampler.start`); a field a GPU does not support is
skipped from then on and reported once; a lost GPU is marked lost and the others keep going.

Per device and tick: NVML's own timestamped utilisation samples (nvmlDeviceGetSamples) when
offered, else one nvmlDeviceGetUtilizationRates snapshot stamped with the tick time; memory,
clocks, power, temperature, clock-event reasons, PCIe throughput (slower: each read blocks
~20 ms), Hopper GPM SM/DRAM metrics, the running-process lists and per-process utilisation.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from tracejoin.core.gpu import (
    NS_PER_S,
    DeviceHistory,
    DeviceState,
    DeviceWindow,
    join_device,
    span_attributes,
)
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue

log = logging.getLogger("tracejoin.gpu")

DEFAULT_INTERVAL_S = 0.25  # 4 Hz: NVML itself averages over 1/6 s .. 1 s; faster adds cost only
DEFAULT_CAPACITY = 1024  # samples kept per series: ~4 min of ticks at 4 Hz
DEFAULT_MAX_PIDS = 64  # processes tracked per device for per-process utilisation
DEFAULT_PCIE_INTERVAL_S = 1.0  # nvmlDeviceGetPcieThroughput measures for 20 ms per call
# NVML timestamps are CPU microseconds, normally Unix epoch. If the newest one is further than
# this from our clock, NVML is on another clock and its timestamps cannot be joined to spans.
CLOCK_MISMATCH_NS = 24 * 3600 * NS_PER_S

# Fields, as named in reports, metrics and docs/gpu.md.
F_UTIL_SAMPLES_GPU = "utilization.samples.gpu"
F_UTIL_SAMPLES_MEMORY = "utilization.samples.memory"
F_UTIL_RATES = "utilization.rates"
F_NVML_TIMESTAMPS = "nvml_timestamps"
F_MEMORY = "memory"
F_CLOCK_SM = "clock.sm"
F_CLOCK_MEM = "clock.mem"
F_POWER = "power"
F_TEMPERATURE = "temperature"
F_CLOCK_EVENT_REASONS = "clock_event_reasons"
F_PCIE_RX = "pcie.rx"
F_PCIE_TX = "pcie.tx"
F_GPM = "gpm"
F_PROCESSES_COMPUTE = "processes.compute"
F_PROCESSES_GRAPHICS = "processes.graphics"
F_PROCESS_UTIL = "process_utilization"


@dataclass(frozen=True, slots=True)
class VisibleDevices:
    """NVIDIA_VISIBLE_DEVICES, parsed. `entries` are indices or UUIDs when not `all`."""

    all: bool
    entries: tuple[str, ...]
    raw: str | None

    def selects(self, index: int, uuid: str) -> bool:
        if self.all:
            return True
        wanted = {e.lower() for e in self.entries}
        return str(index) in wanted or uuid.lower() in wanted


def parse_visible_devices(value: str | None) -> VisibleDevices:
    """Unset: all GPUs (tracejoin runs on the host). "all": all. "", "none", "void": none.

    Otherwise a comma-separated list of NVML indices and/or UUIDs (GPU-...), as the NVIDIA
    container runtime reads it.
    """
    if value is None:
        return VisibleDevices(True, (), None)
    v = value.strip()
    if v.lower() == "all":
        return VisibleDevices(True, (), value)
    if v.lower() in ("", "none", "void"):
        return VisibleDevices(False, (), value)
    return VisibleDevices(False, tuple(e.strip() for e in v.split(",") if e.strip()), value)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    gpm_supported: bool
    lost: bool = False


@dataclass(slots=True)
class NvmlStatus:
    """What `tracejoin doctor` and start-up print about the GPU side."""

    available: bool
    reason: str = ""  # why not available
    fix: str = ""  # what to do about it
    driver_version: str = ""
    gpus: list[GpuInfo] = field(default_factory=list)
    visible_devices: str | None = None  # NVIDIA_VISIBLE_DEVICES as found
    unsupported: dict[int, dict[str, str]] = field(default_factory=dict)  # index -> field -> why
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if not self.available:
            return f"NVML: unavailable: {self.reason}\n  fix: {self.fix}"
        lines = [f"NVML: available, driver {self.driver_version or '?'}, {len(self.gpus)} GPU(s)"]
        for g in self.gpus:
            state = "LOST" if g.lost else f"GPM {'yes' if g.gpm_supported else 'no'}"
            lines.append(f"  GPU {g.index}: {g.name} {g.uuid} ({state})")
            for name, why in sorted(self.unsupported.get(g.index, {}).items()):
                lines.append(f"    unsupported {name}: {why}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


# nvmlInit failures -> (reason, fix), keyed by the NVML_ERROR_* constant's name.
_INIT_FAILURES = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "the NVML library (libnvidia-ml.so.1) was not found",
        "install the NVIDIA driver; in a container use the NVIDIA container runtime with "
        "NVIDIA_DRIVER_CAPABILITIES including 'utility'",
    ),
    "NVML_ERROR_DRIVER_NOT_LOADED": (
        "the NVIDIA kernel driver is not loaded",
        "load it (modprobe nvidia), check dmesg; `nvidia-smi` must list the GPUs",
    ),
    "NVML_ERROR_NO_PERMISSION": (
        "no permission to open the NVIDIA device files",
        "give tracejoin access to /dev/nvidiactl and /dev/nvidia*",
    ),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "the NVML library and the loaded kernel driver have different versions",
        "reload the nvidia kernel module or reboot after the driver upgrade",
    ),
}


class _DeviceLost(Exception):
    pass


class _Device:
    """Sampler-private state for one open GPU."""

    def __init__(self, handle: Any, history: DeviceHistory) -> None:
        self.handle = handle
        self.history = history
        self.index = history.index
        self.unsupported: dict[str, str] = {}
        self.last_seen_us: dict[int, int] = {}  # per nvmlDeviceGetSamples type
        self.proc_last_seen_us = 0
        self.reasons_fn = "nvmlDeviceGetCurrentClocksEventReasons"
        self.gpm_samples: list[Any] = []  # [previous, current] once allocated
        self.gpm_have_previous = False
        self.gpm_query: Any = None
        self.next_pcie_ns = 0
        self.last_processes: dict[int, int | None] | None = None


class GpuSampler:
    """Samples NVML at `interval_s` in its own daemon thread; joins samples to span windows.

    Memory is bounded: per device, three series of at most `capacity` samples (kernel-active,
    memory-controller busy, device state) plus per-process series for at most `max_pids`
    processes, each of at most `capacity` samples.
    """

    def __init__(
        self,
        metrics: Metrics | None = None,
        *,
        nvml: Any = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        capacity: int = DEFAULT_CAPACITY,
        max_pids: int = DEFAULT_MAX_PIDS,
        pcie_interval_s: float = DEFAULT_PCIE_INTERVAL_S,
        visible_devices: str | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        """`visible_devices` None: read NVIDIA_VISIBLE_DEVICES from the environment at start."""
        if interval_s <= 0 or capacity < 1 or max_pids < 1 or pcie_interval_s < 0:
            raise ValueError("interval_s, capacity, max_pids must be positive")
        self._m = metrics if metrics is not None else Metrics()
        self._nvml = nvml
        self._interval_s = interval_s
        self._capacity = capacity
        self._max_pids = max_pids
        self._pcie_interval_ns = int(pcie_interval_s * NS_PER_S)
        self._visible = visible_devices
        self._clock = clock
        # A sample covers back to the previous one, but never further than NVML's longest
        # averaging period (1 s), or two ticks if the sampler is slower than that.
        self._max_interval_ns = max(NS_PER_S, int(2 * interval_s * NS_PER_S))
        self._devices: list[_Device] = []
        self._status = NvmlStatus(False, "not started", "call start()")
        self._initialised = False
        self._lifecycle = threading.Lock()
        self._opened = False
        self._started = False
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported: set[Hashable] = set()
        self._report_lock = threading.Lock()  # the sampler thread adds, doctor/tests read

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> NvmlStatus:
        """Open NVML and start sampling. Never raises for NVML problems; see the status."""
        with self._lifecycle:
            if self._started or self._closed:
                return self._status
            self._started = True
            status = self._open_once()
            if not status.available:
                log.warning("GPU enrichment is off: %s. Fix: %s", status.reason, status.fix)
                return status
            log.info("GPU sampler: %d GPU(s) at %.3g Hz", len(self._devices), 1 / self._interval_s)
            self._thread = threading.Thread(
                target=self._run, name="tracejoin-gpu-sampler", daemon=True
            )
            self._thread.start()
            self._m.set("gpu_sampler_running", 1)
            return status

    def open(self) -> NvmlStatus:
        """Open NVML and the devices without starting the thread (probes, benchmarks, tests
        driving sample_once by hand). Idempotent; shutdown() releases NVML."""
        with self._lifecycle:
            if self._closed:
                return self._status
            return self._open_once()

    def _open_once(self) -> NvmlStatus:
        if not self._opened:
            self._opened = True
            self._open()
            self._m.set("gpu_nvml_available", 1 if self._status.available else 0)
        return self._status

    def shutdown(self) -> None:
        """Stop the thread and release NVML. Idempotent; safe without start()."""
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            thread = self._thread
            if thread is not None:
                thread.join(timeout=max(2.0, 4 * self._interval_s))
                if thread.is_alive():
                    # An NVML call is stuck; shutting NVML down under it could crash the process.
                    log.warning("GPU sampler thread did not stop; leaving NVML initialised")
                    self._m.set("gpu_sampler_running", 0)
                    return
            self._close_nvml()
            self._m.set("gpu_sampler_running", 0)

    @property
    def status(self) -> NvmlStatus:
        return self._status

    def unsupported_fields(self) -> dict[int, dict[str, str]]:
        """Device index -> {field: why} for every field skipped as unsupported (for doctor)."""
        with self._report_lock:
            return {i: dict(f) for i, f in self._status.unsupported.items()}

    def histories(self) -> list[DeviceHistory]:
        return [d.history for d in self._devices]

    # ---- join ------------------------------------------------------------------------------

    def join_windows(self, pid: int | None, start_ns: int, end_ns: int) -> list[DeviceWindow]:
        """Per-device summaries for process `pid` over [start_ns, end_ns] (Unix epoch ns).

        pid None: every device, device-wide figures only (no process attribution)."""
        out = []
        for d in self._devices:
            h = d.history
            with h.lock:
                w = join_device(h, pid, start_ns, end_ns)
            if w is not None:
                out.append(w)
        return out

    def join(self, pid: int, start_ns: int, end_ns: int) -> dict[str, AttrValue]:
        """Span attributes for process `pid` over [start_ns, end_ns]; {} if it used no GPU."""
        return span_attributes(self.join_windows(pid, start_ns, end_ns))

    def covered_until_ns(self) -> int:
        """Time up to which every live device has been sampled (0: nothing yet).

        A span ending after this has part of its window not sampled yet; the span stage can hold
        it until covered_until_ns() >= end_ns (about one interval) for a complete join.
        """
        ends = []
        for d in self._devices:
            h = d.history
            with h.lock:
                if h.lost:
                    continue
                t = h.state.last_ns()
                if len(h.kernel_active):
                    t = min(t, h.kernel_active.last_ns())
                ends.append(t)
        return min(ends) if ends else 0

    # ---- sampling --------------------------------------------------------------------------

    def sample_once(self) -> None:
        """One tick over every live device (the thread calls this; tests and bench may too)."""
        for d in self._devices:
            if d.history.lost:
                continue
            try:
                self._sample_device(d)
            except _DeviceLost as e:
                self._mark_lost(d, str(e))
            except Exception:
                self._m.inc("gpu_sampler_errors")
                if self._first(("tick-error", d.index)):
                    log.exception("GPU %d: sampling failed; will keep trying", d.index)

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            next_t += self._interval_s
            now = time.monotonic()
            if next_t < now:  # a tick overran: skip the missed slots rather than burst
                self._m.inc("gpu_sampler_overruns")
                next_t = now + self._interval_s
            self._stop.wait(next_t - now)

    def _sample_device(self, d: _Device) -> None:
        nvml = self._nvml
        h = d.handle
        now = self._clock()

        kernel = self._util_samples(d, F_UTIL_SAMPLES_GPU, nvml.NVML_GPU_UTILIZATION_SAMPLES, now)
        membusy = self._util_samples(
            d, F_UTIL_SAMPLES_MEMORY, nvml.NVML_MEMORY_UTILIZATION_SAMPLES, now
        )
        if not kernel or not membusy:
            # No new timestamped samples (unsupported, or NVML's buffer ran dry while idle):
            # take NVML's current averages, stamped now.
            rates = self._call(d, F_UTIL_RATES, "nvmlDeviceGetUtilizationRates", h)
            if rates is not None:
                if not kernel:
                    kernel = self._stamped(d, F_UTIL_RATES, now, rates.gpu)
                if not membusy:
                    membusy = self._stamped(d, F_UTIL_RATES, now, rates.memory)

        mem = self._call(d, F_MEMORY, "nvmlDeviceGetMemoryInfo", h)
        power_mw = self._call(d, F_POWER, "nvmlDeviceGetPowerUsage", h)
        rx = tx = None
        if now >= d.next_pcie_ns:
            d.next_pcie_ns = now + self._pcie_interval_ns
            rx = self._call(
                d, F_PCIE_RX, "nvmlDeviceGetPcieThroughput", h, nvml.NVML_PCIE_UTIL_RX_BYTES
            )
            tx = self._call(
                d, F_PCIE_TX, "nvmlDeviceGetPcieThroughput", h, nvml.NVML_PCIE_UTIL_TX_BYTES
            )
        gpm_sm, gpm_dram = self._gpm(d)
        state = DeviceState(
            memory_used=int(mem.used) if mem is not None else None,
            memory_total=int(mem.total) if mem is not None else None,
            sm_clock_mhz=self._call(d, F_CLOCK_SM, "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_SM),
            mem_clock_mhz=self._call(
                d, F_CLOCK_MEM, "nvmlDeviceGetClockInfo", h, nvml.NVML_CLOCK_MEM
            ),
            power_w=power_mw / 1000 if power_mw is not None else None,
            temperature_c=self._call(
                d, F_TEMPERATURE, "nvmlDeviceGetTemperature", h, nvml.NVML_TEMPERATURE_GPU
            ),
            clock_event_reasons=self._call(d, F_CLOCK_EVENT_REASONS, d.reasons_fn, h),
            pcie_rx_kbps=rx,
            pcie_tx_kbps=tx,
            gpm_sm_util=gpm_sm,
            gpm_dram_bw_util=gpm_dram,
            processes=self._processes(d),
        )
        proc_samples, polled = self._process_util(d, now)

        hist = d.history
        with hist.lock:
            for t, r in kernel:
                hist.kernel_active.append(t, r)
            for t, r in membusy:
                hist.memory_busy.append(t, r)
            hist.state.append(now, state)
            if polled:
                hist.process_polls.append(now, len(proc_samples))
            for pid, t, r in proc_samples:
                hist.add_process_sample(pid, t, r)
        self._m.inc("gpu_samples", device=str(d.index))

    def _util_samples(self, d: _Device, fld: str, stype: int, now: int) -> list[tuple[int, float]]:
        """New NVML-timestamped utilisation samples as (epoch ns, ratio), oldest first."""
        if F_NVML_TIMESTAMPS in d.unsupported:
            return []
        since = d.last_seen_us.get(stype, 0)
        res = self._call(d, fld, "nvmlDeviceGetSamples", d.handle, stype, since, empty=(0, []))
        if res is None:
            return []
        vtype, samples = res
        out = []
        for s in samples:
            t_us = int(s.timeStamp)
            d.last_seen_us[stype] = max(d.last_seen_us.get(stype, 0), t_us)
            r = self._ratio(d, fld, _sample_value(s.sampleValue, vtype))
            if r is not None:
                out.append((t_us * 1000, r))
        out.sort()
        if out and not self._nvml_clock_ok(d, out[-1][0], now):
            return []
        return out

    def _stamped(self, d: _Device, fld: str, now: int, percent: Any) -> list[tuple[int, float]]:
        r = self._ratio(d, fld, percent)
        return [] if r is None else [(now, r)]

    def _nvml_clock_ok(self, d: _Device, newest_ns: int, now: int) -> bool:
        if abs(newest_ns - now) <= CLOCK_MISMATCH_NS:
            return True
        self._mark_unsupported(
            d,
            F_NVML_TIMESTAMPS,
            f"NVML sample timestamps are {(newest_ns - now) / NS_PER_S:.0f} s from the wall "
            "clock; using snapshots stamped by tracejoin instead",
        )
        return False

    def _ratio(self, d: _Device, fld: str, percent: Any) -> float | None:
        """NVML percent -> 0..1. Out-of-range values (seen from some drivers) are counted."""
        if percent is None:
            return None
        p = float(percent)
        if 0.0 <= p <= 100.0:
            return p / 100.0
        self._m.inc("gpu_invalid_samples", device=str(d.index), field=fld)
        if self._first(("invalid", d.index, fld)):
            log.warning(
                "GPU %d: %s gave %s%%, out of range; dropping such samples", d.index, fld, p
            )
        return None

    def _processes(self, d: _Device) -> dict[int, int | None] | None:
        """pid -> GPU memory bytes from the running compute and graphics process lists."""
        compute = self._call(
            d, F_PROCESSES_COMPUTE, "nvmlDeviceGetComputeRunningProcesses", d.handle
        )
        graphics = self._call(
            d, F_PROCESSES_GRAPHICS, "nvmlDeviceGetGraphicsRunningProcesses", d.handle
        )
        if compute is None and graphics is None:
            return None
        procs: dict[int, int | None] = {}
        for p in [*(compute or ()), *(graphics or ())]:
            used = p.usedGpuMemory  # None where NVML cannot tell (e.g. Windows WDDM)
            prev = procs.get(p.pid)
            procs[int(p.pid)] = used if prev is None else max(prev, used or 0)
        if procs == d.last_processes:
            return d.last_processes  # share the unchanged dict between samples: bounded memory
        d.last_processes = procs
        return procs

    def _process_util(self, d: _Device, now: int) -> tuple[list[tuple[int, int, float]], bool]:
        """([(pid, epoch ns, SM ratio)], whether NVML answered)."""
        if F_PROCESS_UTIL in d.unsupported:
            return [], False
        # Ask again for the last max-interval too: NVML stamps each process separately, so one
        # process's newest timestamp can hide another's slightly older sample. Repeats are
        # dropped by the series (not newer than its last).
        since = max(0, d.proc_last_seen_us - self._max_interval_ns // 1000)
        res = self._call(
            d, F_PROCESS_UTIL, "nvmlDeviceGetProcessUtilization", d.handle, since, empty=[]
        )
        if res is None:
            return [], False
        out = []
        for s in res:
            t_us = int(s.timeStamp)
            d.proc_last_seen_us = max(d.proc_last_seen_us, t_us)
            r = self._ratio(d, F_PROCESS_UTIL, s.smUtil)
            if r is not None and s.pid > 0:
                out.append((int(s.pid), t_us * 1000, r))
        out.sort(key=lambda x: x[1])
        if out and (
            F_NVML_TIMESTAMPS in d.unsupported or not self._nvml_clock_ok(d, out[-1][1], now)
        ):
            out = [(pid, now, r) for pid, _, r in out]
        return out, True

    def _gpm(self, d: _Device) -> tuple[float | None, float | None]:
        """GPM SM and DRAM-bandwidth utilisation over (previous tick, this tick]."""
        if F_GPM in d.unsupported or not d.gpm_samples:
            return None, None
        nvml = self._nvml
        previous, current = d.gpm_samples
        if self._call(d, F_GPM, "nvmlGpmSampleGet", d.handle, current) is None:
            d.gpm_have_previous = False
            return None, None
        sm = dram = None
        if d.gpm_have_previous:
            q = d.gpm_query
            q.version = nvml.NVML_GPM_METRICS_GET_VERSION
            q.numMetrics = 2
            q.sample1 = previous
            q.sample2 = current
            q.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
            q.metrics[1].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
            if self._call(d, F_GPM, "nvmlGpmMetricsGet", q) is not None:
                sm = self._gpm_value(d, q.metrics[0], "gpm.sm_util")
                dram = self._gpm_value(d, q.metrics[1], "gpm.dram_bw_util")
        d.gpm_samples = [current, previous]
        d.gpm_have_previous = True
        return sm, dram

    def _gpm_value(self, d: _Device, metric: Any, fld: str) -> float | None:
        if metric.nvmlReturn != self._nvml.NVML_SUCCESS:
            if self._first(("gpm-metric", d.index, fld, metric.nvmlReturn)):
                log.warning("GPU %d: %s: NVML returned %s", d.index, fld, metric.nvmlReturn)
            return None
        return self._ratio(d, fld, metric.value)

    # ---- NVML calls and failure handling --------------------------------------------------

    def _call(self, d: _Device, fld: str, fn: str, *args: Any, empty: Any = None) -> Any:
        """nvml.<fn>(*args), timed. None if it failed; `empty` if NVML said "no new samples".

        NOT_SUPPORTED (and kin) marks `fld` unsupported on this device: reported once, skipped
        from then on. GPU_IS_LOST raises _DeviceLost. Anything else is counted and retried
        next tick.
        """
        if fld in d.unsupported:
            return None
        nvml = self._nvml
        try:
            func = getattr(nvml, fn)
        except AttributeError:
            self._mark_unsupported(d, fld, f"{fn} is not in this nvidia-ml-py")
            return None
        t0 = time.perf_counter_ns()
        try:
            return func(*args)
        except nvml.NVMLError as e:
            code = getattr(e, "value", None)
            if empty is not None and code in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_SUCCESS):
                return empty
            if code in (
                nvml.NVML_ERROR_NOT_SUPPORTED,
                nvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                nvml.NVML_ERROR_NO_PERMISSION,
            ):
                self._mark_unsupported(d, fld, f"{fn}: {e}")
                return None
            if code in (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED):
                raise _DeviceLost(f"{fn}: {e}") from e
            self._m.inc("gpu_nvml_errors", function=fn, error=type(e).__name__)
            if self._first(("error", d.index, fld, code)):
                log.warning("GPU %d: %s failed: %s; will retry", d.index, fn, e)
            return None
        finally:
            dt = time.perf_counter_ns() - t0
            self._m.inc("gpu_nvml_call_seconds", dt / NS_PER_S, function=fn)
            self._m.inc("gpu_nvml_calls", function=fn)

    def _mark_unsupported(self, d: _Device, fld: str, why: str) -> None:
        if fld in d.unsupported:
            return
        d.unsupported[fld] = why
        with self._report_lock:
            self._status.unsupported.setdefault(d.index, {})[fld] = why
        self._m.set("gpu_field_unsupported", 1, device=str(d.index), field=fld)
        log.warning("GPU %d: %s unavailable, skipping it: %s", d.index, fld, why)

    def _mark_lost(self, d: _Device, why: str) -> None:
        with d.history.lock:
            d.history.lost = True
        self._m.set("gpu_device_lost", 1, device=str(d.index))
        self._status.gpus = [
            GpuInfo(g.index, g.uuid, g.name, g.gpm_supported, lost=True)
            if g.index == d.index
            else g
            for g in self._status.gpus
        ]
        log.error("GPU %d (%s) is lost (%s); sampling the others", d.index, d.history.uuid, why)

    def _first(self, key: Hashable) -> bool:
        """True the first time `key` is seen: for report-once log lines."""
        if key in self._reported:
            return False
        self._reported.add(key)
        return True

    # ---- open / close ----------------------------------------------------------------------

    def _unavailable(self, reason: str, fix: str, **extra: Any) -> NvmlStatus:
        self._status = NvmlStatus(False, reason, fix, **extra)
        return self._status

    def _open(self) -> NvmlStatus:
        """nvmlInit, pick the visible devices, set up per-device state. Returns the status."""
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                return self._unavailable(
                    "the nvidia-ml-py package (module pynvml) is not installed",
                    "pip install nvidia-ml-py",
                )
            self._nvml = pynvml
        nvml = self._nvml
        raw = (
            self._visible if self._visible is not None else os.environ.get("NVIDIA_VISIBLE_DEVICES")
        )
        visible = parse_visible_devices(raw)
        if not visible.all and not visible.entries:
            return self._unavailable(
                f"NVIDIA_VISIBLE_DEVICES={raw!r} selects no GPU",
                "set NVIDIA_VISIBLE_DEVICES to 'all' or to the GPU indices/UUIDs to sample",
                visible_devices=raw,
            )
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            reason, fix = _init_failure(nvml, e)
            return self._unavailable(reason, fix, visible_devices=raw)
        self._initialised = True
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            driver = ""
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            self._close_nvml()
            return self._unavailable(
                f"nvmlDeviceGetCount failed: {e}", "check `nvidia-smi`", driver_version=driver
            )
        if count == 0:
            self._close_nvml()
            return self._unavailable(
                "NVML works but sees no GPU",
                "check `nvidia-smi`; in a container, request GPUs (NVIDIA_VISIBLE_DEVICES, or "
                "the nvidia.com/gpu resource in Kubernetes)",
                driver_version=driver,
                visible_devices=raw,
            )

        status = NvmlStatus(True, driver_version=driver, visible_devices=raw)
        self._status = status
        matched: set[str] = set()
        for i in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                name = _text(nvml.nvmlDeviceGetName(handle))
            except nvml.NVMLError as e:
                if visible.all or str(i) in visible.entries:
                    status.notes.append(f"GPU {i} could not be opened: {e}")
                    lost = getattr(e, "value", None) == nvml.NVML_ERROR_GPU_IS_LOST
                    status.gpus.append(GpuInfo(i, "", "", False, lost=lost))
                continue
            if not visible.selects(i, uuid):
                continue
            matched |= {str(i), uuid.lower()}
            history = DeviceHistory(
                i,
                uuid,
                name,
                self._capacity,
                self._max_interval_ns,
                self._max_pids,
                process_interval_ns=int(2 * self._interval_s * NS_PER_S),
            )
            d = _Device(handle, history)
            self._devices.append(d)
            try:
                gpm = self._open_gpm(d)
                self._pick_reasons_fn(d)
            except _DeviceLost as e:
                self._mark_lost(d, str(e))
                gpm = False
            status.gpus.append(GpuInfo(i, uuid, name, gpm, lost=d.history.lost))
        for entry in visible.entries:
            if entry.lower() not in matched:
                note = (
                    f"NVIDIA_VISIBLE_DEVICES entry {entry!r} matches no GPU NVML lists "
                    "(indices are NVML's, as tracejoin sees them; UUIDs are unambiguous)"
                )
                status.notes.append(note)
                log.warning("%s", note)
        if not self._devices:
            self._close_nvml()
            return self._unavailable(
                f"no usable GPU among the {count} NVML lists"
                + (f" for NVIDIA_VISIBLE_DEVICES={raw!r}" if raw is not None else ""),
                "check NVIDIA_VISIBLE_DEVICES and `nvidia-smi -L`",
                driver_version=driver,
                gpus=status.gpus,
                visible_devices=raw,
                notes=status.notes,
            )
        self._m.set("gpu_devices", len(self._devices))
        return status

    def _open_gpm(self, d: _Device) -> bool:
        """Set up GPM (Hopper+) sampling if the device supports it."""
        nvml = self._nvml
        support = self._call(d, F_GPM, "nvmlGpmQueryDeviceSupport", d.handle)
        if support is None:
            if F_GPM not in d.unsupported:
                self._mark_unsupported(d, F_GPM, "nvmlGpmQueryDeviceSupport failed")
            return False
        if not support.isSupportedDevice:
            self._mark_unsupported(d, F_GPM, "the device does not support GPM (Hopper or newer)")
            return False
        first = self._call(d, F_GPM, "nvmlGpmSampleAlloc")
        second = self._call(d, F_GPM, "nvmlGpmSampleAlloc")
        if first is not None:
            d.gpm_samples.append(first)
        if second is not None:
            d.gpm_samples.append(second)
        if len(d.gpm_samples) != 2:
            return False
        d.gpm_query = nvml.c_nvmlGpmMetricsGet_t()
        return True

    def _pick_reasons_fn(self, d: _Device) -> None:
        """Drivers before r535 only have the older name for the same bitmask."""
        nvml = self._nvml
        try:
            nvml.nvmlDeviceGetCurrentClocksEventReasons(d.handle)
        except AttributeError:
            d.reasons_fn = "nvmlDeviceGetCurrentClocksThrottleReasons"
        except nvml.NVMLError as e:
            if getattr(e, "value", None) == nvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                d.reasons_fn = "nvmlDeviceGetCurrentClocksThrottleReasons"

    def _close_nvml(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        for d in self._devices:
            for s in d.gpm_samples:
                try:
                    nvml.nvmlGpmSampleFree(s)
                except Exception as e:  # best effort at shutdown
                    log.debug("nvmlGpmSampleFree: %s", e)
            d.gpm_samples = []
        if self._initialised:
            self._initialised = False
            try:
                nvml.nvmlShutdown()
            except Exception as e:
                log.debug("nvmlShutdown: %s", e)


def probe_nvml(
    nvml: Any = None, *, visible_devices: str | None = None, metrics: Metrics | None = None
) -> NvmlStatus:
    """For `tracejoin doctor`: open NVML, list GPUs, take one sample to find unsupported fields.

    Never raises for NVML problems; leaves NVML as it found it.
    """
    sampler = GpuSampler(metrics, nvml=nvml, visible_devices=visible_devices)
    try:
        if sampler.open().available:
            sampler.sample_once()
    finally:
        sampler.shutdown()
    return sampler.status


def _init_failure(nvml: Any, e: Exception) -> tuple[str, str]:
    code = getattr(e, "value", None)
    for const, (reason, fix) in _INIT_FAILURES.items():
        if code is not None and code == getattr(nvml, const, object()):
            return reason, fix
    return f"nvmlInit failed: {e}", "run `nvidia-smi` to see whether the driver works"


# nvmlValueType_t -> the nvmlValue_t union member holding the value.
_VALUE_FIELDS = {
    0: "dVal",
    1: "uiVal",
    2: "ulVal",
    3: "ullVal",
    4: "sllVal",
    5: "siVal",
    6: "usVal",
}


def _sample_value(value: Any, vtype: int) -> Any:
    return getattr(value, _VALUE_FIELDS.get(vtype, "uiVal"))


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
