"""A scripted stand-in for the `pynvml` module, for tests and for machines without a GPU.

`FakeNvml` has the pynvml functions the sampler uses, with the same signatures and return
shapes (real pynvml ctypes structs where pynvml returns them), and raises the real pynvml
exception classes, so `except pynvml.NVMLError_NotSupported` behaves as it would on a GPU.
Constants, structs and exception classes it does not define are taken from pynvml itself; a
pynvml *function* it does not implement is an AttributeError, never a silent call into the
real library.

Script it through `FakeDevice`: set its current values, push timestamped samples, make a
function fail with an NVML error code, or `lose()` the GPU mid-capture.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pynvml as _real

GPU = _real.NVML_GPU_UTILIZATION_SAMPLES
MEMORY = _real.NVML_MEMORY_UTILIZATION_SAMPLES


@dataclass(slots=True)
class FakeProcessInfo:
    """Shape of the objects nvmlDeviceGet*RunningProcesses return."""

    pid: int
    usedGpuMemory: int | None  # pynvml's name
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class FakeGpmSample:
    """Opaque GPM sample: remembers what the device reported when it was taken."""

    def __init__(self) -> None:
        self.taken = False
        self.sm_util = 0.0
        self.dram_bw_util = 0.0
        self.freed = False


class _FakeMetric:
    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = _real.NVML_SUCCESS
        self.value = 0.0


class FakeGpmMetricsGet:
    """Python twin of pynvml.c_nvmlGpmMetricsGet_t (holds FakeGpmSample, not ctypes pointers)."""

    def __init__(self) -> None:
        self.version = 0
        self.numMetrics = 0
        self.sample1: FakeGpmSample | None = None
        self.sample2: FakeGpmSample | None = None
        self.metrics = [_FakeMetric() for _ in range(8)]


class FakeDevice:
    """One scripted GPU. Values are NVML's units: percent, bytes, MHz, mW, C, KB/s."""

    def __init__(
        self,
        index: int,
        uuid: str | None = None,
        name: str = "NVIDIA H100 80GB HBM3 (fake)",
        *,
        memory_total: int = 80 * 1024**3,
        gpm_supported: bool = False,
    ) -> None:
        self.index = index
        self.uuid = uuid or f"GPU-00000000-0000-0000-0000-{index:012d}"
        self.name = name
        self.util_gpu = 0  # what nvmlDeviceGetUtilizationRates returns now
        self.util_memory = 0
        self.memory_used = 0
        self.memory_total = memory_total
        self.sm_clock_mhz = 1980
        self.mem_clock_mhz = 2619
        self.power_mw = 120_000
        self.temperature_c = 35
        self.clock_event_reasons = 0
        self.pcie_rx_kbps = 0
        self.pcie_tx_kbps = 0
        self.gpm_supported = gpm_supported
        self.gpm_sm_util = 0.0  # percent, reported by the next pair of GPM samples
        self.gpm_dram_bw_util = 0.0
        self.compute_procs: dict[int, int | None] = {}  # pid -> used bytes
        self.graphics_procs: dict[int, int | None] = {}
        self.errors: dict[str, int] = {}  # function name -> NVML error code it raises
        self.lost = False
        self._samples: dict[int, list[tuple[int, int]]] = {GPU: [], MEMORY: []}
        self._proc_samples: list[tuple[int, int, int, int]] = []

    def push_util_samples(self, kind: int, samples: Iterable[tuple[int, int]]) -> None:
        """Timestamped samples for nvmlDeviceGetSamples: (CPU time in µs, percent)."""
        self._samples[kind].extend(samples)
        self._samples[kind].sort()

    def push_process_samples(self, samples: Iterable[tuple[int, int, int, int]]) -> None:
        """Samples for nvmlDeviceGetProcessUtilization: (pid, time µs, SM %, memory %)."""
        self._proc_samples.extend(samples)

    def fail(self, function: str, code: int) -> None:
        """Make every later call of `function` on this device raise NVMLError(code)."""
        self.errors[function] = code

    def lose(self) -> None:
        """The GPU falls off the bus: every later call on it raises GPU_IS_LOST."""
        self.lost = True


class FakeNvml:
    """Duck-types the pynvml module over scripted FakeDevices."""

    # Structs the caller instantiates: the fake's own, since its samples are not ctypes.
    c_nvmlGpmMetricsGet_t = FakeGpmMetricsGet

    def __init__(
        self,
        devices: Iterable[FakeDevice] = (),
        *,
        init_error: int | None = None,
        driver_version: str = "570.86.15",
    ) -> None:
        self.devices = list(devices)
        self.init_error = init_error
        self.driver_version = driver_version
        self.initialised = 0  # nvmlInit refcount, as NVML keeps it
        self.calls: Counter[str] = Counter()
        self.gpm_allocated: list[FakeGpmSample] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(_real, name)  # AttributeError if pynvml lacks it too
        if inspect.isfunction(value):
            raise AttributeError(f"FakeNvml does not implement {name}")
        return value

    # ---- helpers ---------------------------------------------------------------------------

    def _enter(self, fn: str, device: FakeDevice | None = None) -> None:
        self.calls[fn] += 1
        if not self.initialised:
            raise _real.NVMLError(_real.NVML_ERROR_UNINITIALIZED)
        if device is not None:
            if device.lost:
                raise _real.NVMLError(_real.NVML_ERROR_GPU_IS_LOST)
            code = device.errors.get(fn)
            if code is not None:
                raise _real.NVMLError(code)

    # ---- library ---------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise _real.NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        dev = self.devices[index]
        self._enter("nvmlDeviceGetHandleByIndex", dev)
        return dev

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeDevice:
        self._enter("nvmlDeviceGetHandleByUUID")
        for dev in self.devices:
            if dev.uuid == uuid:
                return dev
        raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)

    # ---- identity --------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, dev: FakeDevice) -> str:
        self._enter("nvmlDeviceGetUUID", dev)
        return dev.uuid

    def nvmlDeviceGetName(self, dev: FakeDevice) -> str:
        self._enter("nvmlDeviceGetName", dev)
        return dev.name

    def nvmlDeviceGetIndex(self, dev: FakeDevice) -> int:
        self._enter("nvmlDeviceGetIndex", dev)
        return dev.index

    # ---- device state ----------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, dev: FakeDevice) -> Any:
        self._enter("nvmlDeviceGetUtilizationRates", dev)
        u = _real.c_nvmlUtilization_t()
        u.gpu = dev.util_gpu
        u.memory = dev.util_memory
        return u

    def nvmlDeviceGetSamples(self, dev: FakeDevice, sampling_type: int, last_seen: int) -> Any:
        self._enter("nvmlDeviceGetSamples", dev)
        if sampling_type not in dev._samples:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        newer = [(t, v) for t, v in dev._samples[sampling_type] if t > last_seen]
        if not newer:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)
        out = []
        for t, v in newer:
            s = _real.c_nvmlSample_t()
            s.timeStamp = t
            s.sampleValue.uiVal = v
            out.append(s)
        return (_real.NVML_VALUE_TYPE_UNSIGNED_INT, out)

    def nvmlDeviceGetMemoryInfo(self, dev: FakeDevice, version: Any = None) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo", dev)
        m = _real.c_nvmlMemory_t()
        m.total = dev.memory_total
        m.used = dev.memory_used
        m.free = dev.memory_total - dev.memory_used
        return m

    def nvmlDeviceGetClockInfo(self, dev: FakeDevice, clock_type: int) -> int:
        self._enter("nvmlDeviceGetClockInfo", dev)
        if clock_type == _real.NVML_CLOCK_SM:
            return dev.sm_clock_mhz
        if clock_type == _real.NVML_CLOCK_MEM:
            return dev.mem_clock_mhz
        raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetPowerUsage(self, dev: FakeDevice) -> int:
        self._enter("nvmlDeviceGetPowerUsage", dev)
        return dev.power_mw

    def nvmlDeviceGetTemperature(self, dev: FakeDevice, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", dev)
        return dev.temperature_c

    def nvmlDeviceGetCurrentClocksEventReasons(self, dev: FakeDevice) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons", dev)
        return dev.clock_event_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, dev: FakeDevice) -> int:
        self._enter("nvmlDeviceGetCurrentClocksThrottleReasons", dev)
        return dev.clock_event_reasons

    def nvmlDeviceGetPcieThroughput(self, dev: FakeDevice, counter: int) -> int:
        self._enter("nvmlDeviceGetPcieThroughput", dev)
        return dev.pcie_rx_kbps if counter == _real.NVML_PCIE_UTIL_RX_BYTES else dev.pcie_tx_kbps

    # ---- processes -------------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, dev: FakeDevice) -> list[FakeProcessInfo]:
        self._enter("nvmlDeviceGetComputeRunningProcesses", dev)
        return [FakeProcessInfo(pid, used) for pid, used in dev.compute_procs.items()]

    def nvmlDeviceGetGraphicsRunningProcesses(self, dev: FakeDevice) -> list[FakeProcessInfo]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses", dev)
        return [FakeProcessInfo(pid, used) for pid, used in dev.graphics_procs.items()]

    def nvmlDeviceGetProcessUtilization(self, dev: FakeDevice, last_seen: int) -> list[Any]:
        self._enter("nvmlDeviceGetProcessUtilization", dev)
        out = []
        for pid, t, sm, mem in dev._proc_samples:
            if t > last_seen:
                s = _real.c_nvmlProcessUtilizationSample_t()
                s.pid, s.timeStamp, s.smUtil, s.memUtil = pid, t, sm, mem
                out.append(s)
        if not out:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_FOUND)
        return out

    # ---- GPM -------------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, dev: FakeDevice) -> Any:
        self._enter("nvmlGpmQueryDeviceSupport", dev)
        s = _real.c_nvmlGpmSupport_t()
        s.version = _real.NVML_GPM_SUPPORT_VERSION
        s.isSupportedDevice = 1 if dev.gpm_supported else 0
        return s

    def nvmlGpmSampleAlloc(self) -> FakeGpmSample:
        self._enter("nvmlGpmSampleAlloc")
        sample = FakeGpmSample()
        self.gpm_allocated.append(sample)
        return sample

    def nvmlGpmSampleFree(self, sample: FakeGpmSample) -> None:
        self._enter("nvmlGpmSampleFree")
        sample.freed = True

    def nvmlGpmSampleGet(self, dev: FakeDevice, sample: FakeGpmSample) -> FakeGpmSample:
        self._enter("nvmlGpmSampleGet", dev)
        if not dev.gpm_supported:
            raise _real.NVMLError(_real.NVML_ERROR_NOT_SUPPORTED)
        sample.taken = True
        sample.sm_util = dev.gpm_sm_util
        sample.dram_bw_util = dev.gpm_dram_bw_util
        return sample

    def nvmlGpmMetricsGet(self, q: FakeGpmMetricsGet) -> FakeGpmMetricsGet:
        self._enter("nvmlGpmMetricsGet")
        s1, s2 = q.sample1, q.sample2
        if q.version != _real.NVML_GPM_METRICS_GET_VERSION or s1 is None or s2 is None:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        if not (s1.taken and s2.taken) or s1 is s2:
            raise _real.NVMLError(_real.NVML_ERROR_INVALID_ARGUMENT)
        # The newer sample carries the rate over the interval between the two.
        for m in q.metrics[: q.numMetrics]:
            m.nvmlReturn = _real.NVML_SUCCESS
            if m.metricId == _real.NVML_GPM_METRIC_SM_UTIL:
                m.value = s2.sm_util
            elif m.metricId == _real.NVML_GPM_METRIC_DRAM_BW_UTIL:
                m.value = s2.dram_bw_util
            else:
                m.nvmlReturn = _real.NVML_ERROR_NOT_SUPPORTED
        return q
