"""GPU enrichment: window maths, the NVML sampler against the NVML test double, failure paths.

No GPU needed: agent.nvml_fake stands in for pynvml at the NVML boundary. One test also probes
the real NVML, which on a machine without a driver must report "unavailable" with a fix.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nvml_fake import GPU, MEMORY, FakeDevice, FakeNvml
from tracejoin.core import gpu as gj
from tracejoin.core.gpu import DeviceHistory, DeviceState, Series, Stats, window_stats
from tracejoin.core.metrics import Metrics
from tracejoin.enrich.gpu_sampler import GpuSampler, parse_visible_devices, probe_nvml

S = 1_000_000_000
MS = 1_000_000
T0 = 1_700_000_000 * S  # an epoch instant; NVML timestamps are epoch µs
ROOT = Path(__file__).resolve().parent.parent


def series(points: list[tuple[float, float]], max_interval_s: float = 1.0) -> Series[float]:
    """Series from (seconds after T0, value) points."""
    out: Series[float] = Series(1024, int(max_interval_s * S))
    for t, v in points:
        assert out.append(T0 + int(t * S), v)
    return out


def at(t: float) -> int:
    return T0 + round(t * S)


# ---- window maths ------------------------------------------------------------------------


def test_overlap_weighted_average_and_max() -> None:
    # Samples describe (0,1], (1,2], (2,3].
    s = series([(1, 0.2), (2, 0.8), (3, 0.5)])
    st_ = window_stats(s, at(1.5), at(2.5))
    assert st_ is not None
    assert st_.avg == pytest.approx((0.8 * 0.5 + 0.5 * 0.5) / 1.0)
    assert st_.max == 0.8
    assert st_.covered_ns == S
    st2 = window_stats(s, at(0.25), at(2.0))  # 0.75 s of 0.2, 1 s of 0.8
    assert st2 is not None
    assert st2.avg == pytest.approx((0.2 * 0.75 + 0.8 * 1.0) / 1.75)


def test_sample_touching_window_edge_is_not_counted() -> None:
    # Window [1, 2]: (0,1] only touches it at instant 1, so it must not add to avg or max.
    s = series([(1, 0.9), (2, 0.1), (3, 0.9)])
    st_ = window_stats(s, at(1), at(2))
    assert st_ == Stats(0.1, 0.1, S)
    assert gj.overlaps(s, at(1), at(2)) == [(1, S)]
    assert gj.overlaps(s, at(3), at(4)) == []  # touches the last sample's end only


def test_span_shorter_than_one_sample_period_gets_covering_sample() -> None:
    s = series([(1, 0.2), (2, 0.8), (3, 0.5)])
    st_ = window_stats(s, at(1.2), at(1.3))  # inside (1,2]
    assert st_ is not None
    assert (st_.avg, st_.max) == (0.8, 0.8)
    assert st_.covered_ns == pytest.approx(0.1 * S, abs=1)
    # Zero-length windows take the sample whose interval contains the instant.
    assert window_stats(s, at(2), at(2)) == Stats(0.8, 0.8, 0)
    assert window_stats(s, at(1), at(1)) == Stats(0.2, 0.2, 0)
    assert window_stats(s, at(2.0001), at(2.0001)) == Stats(0.5, 0.5, 0)


def test_no_samples_in_window() -> None:
    s = series([(1, 0.2), (2, 0.8)])
    assert window_stats(s, at(2.5), at(4)) is None  # after the last sample
    assert window_stats(s, at(-3), at(-1)) is None  # before the first one's interval
    assert window_stats(s, at(2), at(1)) is None  # inverted window
    assert window_stats(series([]), at(0), at(1)) is None


def test_gap_longer_than_max_interval_is_not_covered() -> None:
    # The sample at 5 s covers (4, 5] only: NVML averages over at most 1 s.
    s = series([(1, 0.3), (5, 0.9)])
    assert s.starts[1] == at(4)
    assert window_stats(s, at(2), at(3)) is None
    st_ = window_stats(s, at(0.5), at(4.5))
    assert st_ is not None
    assert st_.covered_ns == S  # 0.5 s of each
    assert st_.avg == pytest.approx(0.6)


def test_span_over_many_samples() -> None:
    pts = [(i * 0.25, (i * 37 % 101) / 100) for i in range(1, 200)]
    s = series(pts)
    # Window [10.1, 12.6]: first sample partially (10.0,10.25] 0.15 s, last (12.5,12.75] 0.1 s.
    st_ = window_stats(s, at(10.1), at(12.6))
    assert st_ is not None
    inside = [v for t, v in pts if 10.25 < t <= 12.5]
    first = dict(pts)[10.25]
    last = dict(pts)[12.75]
    expect = (first * 0.15 + sum(inside) * 0.25 + last * 0.1) / 2.5
    assert st_.avg == pytest.approx(expect)
    assert st_.max == max([first, last, *inside])
    assert st_.covered_ns == pytest.approx(2.5 * S, abs=2)


def test_series_is_bounded_and_time_ordered() -> None:
    s: Series[float] = Series(3, S)
    for i in range(1, 6):
        s.append(at(i), float(i))
    assert len(s) == 3
    assert s.values == [3.0, 4.0, 5.0]
    assert not s.append(at(5), 9.0)  # not newer: dropped
    assert not s.append(at(4), 9.0)
    assert s.values == [3.0, 4.0, 5.0]


def _reference(points: list[tuple[int, float]], cap: int, lo: int, hi: int) -> float | None:
    """Brute force: overlap of each (start, end] with [lo, hi], weighted mean."""
    total = weight = 0.0
    prev = None
    for t, v in points:
        start = t - cap if prev is None else max(prev, t - cap)
        prev = t
        w = min(hi, t) - max(lo, start)
        if w > 0:
            total += v * w
            weight += w
    return None if weight == 0 else total / weight


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.integers(1, 3000), min_size=0, max_size=40),
    values=st.lists(st.floats(0, 1), min_size=40, max_size=40),
    lo=st.integers(-1000, 60_000),
    length=st.integers(1, 20_000),
)
def test_window_stats_matches_brute_force(
    gaps: list[int], values: list[float], lo: int, length: int
) -> None:
    cap = 1000
    t = 0
    points = []
    for g, v in zip(gaps, values, strict=False):
        t += g
        points.append((t, v))
    s: Series[float] = Series(1024, cap)
    for p, v in points:
        s.append(p, v)
    got = window_stats(s, lo, lo + length)
    want = _reference(points, cap, lo, lo + length)
    if want is None:
        assert got is None
    else:
        assert got is not None
        assert got.avg == pytest.approx(want)
        assert min(values) - 1e-12 <= got.avg <= got.max + 1e-12


# ---- the join over a device history -------------------------------------------------------


def history(index: int = 0, uuid: str = "GPU-a") -> DeviceHistory:
    """Device samples cover up to 1 s back; a process's sample up to 0.5 s (two 4 Hz ticks)."""
    return DeviceHistory(
        index, uuid, "fake", capacity=256, max_interval_ns=S, max_pids=8, process_interval_ns=S // 2
    )


def test_join_device_attributes_for_a_process() -> None:
    h = history()
    for i in range(1, 9):  # ticks every 0.5 s from 0.5 to 4.0
        t = at(i * 0.5)
        h.kernel_active.append(t, 0.9 if i <= 4 else 0.1)
        h.memory_busy.append(t, 0.3)
        h.state.append(
            t,
            DeviceState(
                memory_used=10 << 30,
                memory_total=80 << 30,
                sm_clock_mhz=1980 if i <= 4 else 1400,
                power_w=300.0,
                temperature_c=50 + i,
                clock_event_reasons=0x4 if i == 3 else 0,
                processes={42: (2 << 30) + i},
            ),
        )
        h.process_polls.append(t, 1)
        if i % 2 == 0:  # NVML reported the process on every other poll only
            h.add_process_sample(42, t, 0.8)
    w = gj.join_device(h, 42, at(0.5), at(2.0))  # ticks 2, 3, 4 inside
    assert w is not None
    attrs = gj.span_attributes([w])
    assert attrs[gj.DEVICE_INDEX] == "0"
    assert attrs[gj.DEVICE_UUID] == "GPU-a"
    assert attrs[gj.DEVICE_COUNT] == 1
    assert attrs[gj.KERNEL_ACTIVE_AVG] == pytest.approx(0.9)
    assert attrs[gj.MEM_BUSY_MAX] == pytest.approx(0.3)
    assert attrs[gj.WINDOW_COVERAGE] == pytest.approx(1.0)
    # Polls cover 1.5 s; the process reported 0.8 for (1.5,2.0] (tick 4) and (0.5,1.0] (tick 2).
    assert attrs[gj.PROCESS_SM_UTIL_AVG] == pytest.approx(0.8 * 1.0 / 1.5)
    assert attrs[gj.PROCESS_SM_UTIL_MAX] == pytest.approx(0.8)
    assert attrs[gj.PROCESS_MEMORY_USED_MAX] == (2 << 30) + 4
    assert attrs[gj.MEMORY_USED_MAX] == 10 << 30
    assert attrs[gj.TEMPERATURE_MAX] == 54
    assert attrs[gj.CLOCK_EVENT_REASONS] == "sw_power_cap"
    assert attrs[gj.SM_CLOCK_AVG] == pytest.approx(1980)
    assert gj.GPM_SM_UTIL_AVG not in attrs  # never sampled: never attached
    assert gj.DEVICE_LOST not in attrs

    w2 = gj.join_device(h, 42, at(2.5), at(3.5))
    assert w2 is not None
    later = gj.span_attributes([w2])
    assert later[gj.KERNEL_ACTIVE_AVG] == pytest.approx(0.1)
    assert later[gj.CLOCK_EVENT_REASONS] == "none"


def test_join_skips_devices_the_process_did_not_use() -> None:
    h = history()
    h.kernel_active.append(at(1), 0.5)
    h.state.append(at(1), DeviceState(processes={7: 1}))
    assert gj.join_device(h, 8, at(0.5), at(1)) is None
    assert gj.join_device(h, 7, at(0.5), at(1)) is not None
    assert gj.span_attributes([]) == {}


def test_join_of_a_span_ending_before_the_next_tick() -> None:
    # The process was listed at the last tick; the window has no sample yet: device known,
    # coverage 0, no made-up utilisation.
    h = history()
    h.kernel_active.append(at(1), 0.5)
    h.state.append(at(1), DeviceState(processes={7: 1}))
    w = gj.join_device(h, 7, at(1.1), at(1.2))
    assert w is not None
    attrs = gj.span_attributes([w])
    assert attrs[gj.DEVICE_INDEX] == "0"
    assert attrs[gj.WINDOW_COVERAGE] == 0.0
    assert gj.KERNEL_ACTIVE_AVG not in attrs


def test_span_attributes_over_several_devices() -> None:
    ws = []
    for idx, busy in ((1, 0.2), (0, 0.6)):
        h = history(idx, f"GPU-{idx}")
        h.kernel_active.append(at(1), busy)
        h.state.append(
            at(1),
            DeviceState(
                memory_used=100, power_w=10.0, clock_event_reasons=1 << idx, processes={5: 7}
            ),
        )
        w = gj.join_device(h, 5, at(0.5), at(1))
        assert w is not None
        ws.append(w)
    attrs = gj.span_attributes(ws)
    assert attrs[gj.DEVICE_COUNT] == 2
    assert attrs[gj.DEVICE_INDEX] == "0,1"
    assert attrs[gj.DEVICE_UUID] == "GPU-0,GPU-1"
    assert attrs[gj.KERNEL_ACTIVE_AVG] == pytest.approx(0.4)
    assert attrs[gj.KERNEL_ACTIVE_MAX] == pytest.approx(0.6)
    assert attrs[gj.PROCESS_MEMORY_USED_MAX] == 14
    assert attrs[gj.POWER_AVG] == pytest.approx(20.0)
    assert attrs[gj.CLOCK_EVENT_REASONS] == "gpu_idle,applications_clocks_setting"


def test_clock_event_reason_names() -> None:
    assert gj.clock_event_reason_names(0) == []
    assert gj.clock_event_reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert gj.clock_event_reason_names(0x1000) == ["unknown_0x1000"]


def test_per_process_series_are_bounded() -> None:
    h = history()
    for pid in range(1, 20):
        h.add_process_sample(pid, at(pid), 0.5)
    assert len(h.process_sm) == h.max_pids
    assert min(h.process_sm) == 20 - h.max_pids  # the least recently heard were forgotten


def test_attribute_names_say_what_they_measure_and_are_documented() -> None:
    doc = (ROOT / "docs" / "gpu.md").read_text()
    table_names = set(re.findall(r"^\| `(tracejoin\.gpu\.[a-z0-9_.]+)` \|", doc, re.M))
    assert gj.KERNEL_ACTIVE_AVG in gj.ALL_ATTRIBUTES and gj.DEVICE_UUID in gj.ALL_ATTRIBUTES
    assert table_names == set(gj.ALL_ATTRIBUTES)
    for name in gj.ALL_ATTRIBUTES:
        assert name.startswith("tracejoin.gpu.")
        # "utilization" alone is NVML's ambiguous word; device-level names must say what it is.
        assert ".utilization" not in name
    assert "kernel_active" in gj.KERNEL_ACTIVE_AVG
    assert "memory_controller_busy" in gj.MEM_BUSY_AVG


# ---- the sampler against the NVML test double ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now

    def tick(self, seconds: float = 0.25) -> int:
        self.now += int(seconds * S)
        return self.now


def make(devices: list[FakeDevice]) -> tuple[GpuSampler, FakeNvml, Metrics, Clock]:
    """A sampler over fake GPUs, opened, driven by hand (sample_once) at 4 Hz of fake time."""
    fake = FakeNvml(devices)
    metrics = Metrics()
    clock = Clock()
    sampler = GpuSampler(metrics, nvml=fake, clock=clock, visible_devices="all", pcie_interval_s=0)
    status = sampler.open()
    assert status.available, status.reason
    return sampler, fake, metrics, clock


def test_sampler_prefers_nvml_timestamped_samples() -> None:
    dev = FakeDevice(0)
    dev.compute_procs = {42: 1 << 30}
    dev.util_gpu = 5  # the snapshot value, which must not be used while samples flow
    sampler, fake, _, clock = make([dev])
    pushed = []
    for _ in range(6):
        t = clock.tick()
        # NVML's own samples, 1/8 s apart, stamped by NVML (µs), the newest 10 ms before the tick.
        ts = [(t - 10 * MS - k * S // 8) // 1000 for k in (1, 0)]
        pushed += ts
        dev.push_util_samples(GPU, [(u, 90) for u in ts])
        dev.push_util_samples(MEMORY, [(u, 40) for u in ts])
        sampler.sample_once()
    h = sampler.histories()[0]
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 0
    assert h.kernel_active.ends == [u * 1000 for u in pushed]  # NVML's stamps, not the ticks
    assert h.memory_busy.ends == [u * 1000 for u in pushed]
    attrs = sampler.join(42, clock.now - S, clock.now - 20 * MS)
    assert attrs[gj.KERNEL_ACTIVE_AVG] == pytest.approx(0.9)
    assert attrs[gj.MEM_BUSY_AVG] == pytest.approx(0.4)
    assert attrs[gj.WINDOW_COVERAGE] == pytest.approx(1.0)


def test_sampler_falls_back_to_utilization_rates_stamped_at_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dev = FakeDevice(0)
    dev.compute_procs = {42: 1 << 30}
    dev.fail("nvmlDeviceGetSamples", pynvml.NVML_ERROR_NOT_SUPPORTED)
    dev.util_gpu, dev.util_memory = 60, 20
    with caplog.at_level(logging.WARNING, logger="tracejoin.gpu"):
        sampler, fake, metrics, clock = make([dev])
        ticks = []
        for _ in range(5):
            ticks.append(clock.tick())
            sampler.sample_once()
    h = sampler.histories()[0]
    assert h.kernel_active.ends == ticks  # stamped with the sampling time
    assert h.kernel_active.values == [0.6] * 5
    assert h.memory_busy.values == [0.2] * 5
    # Tried once per sample type, then skipped; reported once each.
    assert fake.calls["nvmlDeviceGetSamples"] == 2
    assert set(sampler.unsupported_fields()[0]) == {
        "utilization.samples.gpu",
        "utilization.samples.memory",
        "gpm",
    }
    assert metrics.get("gpu_field_unsupported", device="0", field="utilization.samples.gpu") == 1
    lines = [r.getMessage() for r in caplog.records if "utilization.samples.gpu" in r.getMessage()]
    assert len(lines) == 1


def test_sampler_uses_snapshot_when_nvml_buffer_is_empty() -> None:
    # Idle GPUs can leave NVML's sample buffer empty (NOT_FOUND): that is 0 %, not "unknown".
    dev = FakeDevice(0)
    dev.compute_procs = {1: None}
    sampler, fake, _, clock = make([dev])
    clock.tick()
    sampler.sample_once()
    assert sampler.unsupported_fields().get(0, {}).keys() == {"gpm"}
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 1
    assert sampler.histories()[0].kernel_active.values == [0.0]


def test_not_supported_field_is_skipped_and_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dev = FakeDevice(0)
    dev.compute_procs = {42: 1 << 30}
    dev.temperature_c = 61
    dev.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with caplog.at_level(logging.WARNING, logger="tracejoin.gpu"):
        sampler, fake, metrics, clock = make([dev])
        for _ in range(5):
            clock.tick()
            sampler.sample_once()
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1
    assert "power" in sampler.unsupported_fields()[0]
    assert "Not Supported" in sampler.unsupported_fields()[0]["power"]
    assert metrics.get("gpu_field_unsupported", device="0", field="power") == 1
    assert sum("power" in r.getMessage() for r in caplog.records) == 1
    attrs = sampler.join(42, T0, clock.now)
    assert gj.POWER_AVG not in attrs
    assert attrs[gj.TEMPERATURE_MAX] == 61  # the rest still works
    assert metrics.get("gpu_samples", device="0") == 5


def test_transient_error_is_counted_and_retried() -> None:
    dev = FakeDevice(0)
    dev.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_TIMEOUT)
    sampler, fake, metrics, clock = make([dev])
    for _ in range(3):
        clock.tick()
        sampler.sample_once()
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 3
    assert "memory" not in sampler.unsupported_fields().get(0, {})
    errs = metrics.get(
        "gpu_nvml_errors", function="nvmlDeviceGetMemoryInfo", error="NVMLError_Timeout"
    )
    assert errs == 3
    del dev.errors["nvmlDeviceGetMemoryInfo"]
    dev.memory_used = 123
    clock.tick()
    sampler.sample_once()
    assert sampler.histories()[0].state.values[-1].memory_used == 123


def test_gpu_lost_mid_capture_keeps_sampling_the_others(caplog: pytest.LogCaptureFixture) -> None:
    d0, d1 = FakeDevice(0), FakeDevice(1)
    d0.compute_procs = {10: 1}
    d1.compute_procs = {11: 1}
    d0.util_gpu = d1.util_gpu = 50
    sampler, fake, metrics, clock = make([d0, d1])
    for _ in range(3):
        clock.tick()
        sampler.sample_once()
    before = clock.now
    d1.lose()
    with caplog.at_level(logging.ERROR, logger="tracejoin.gpu"):
        for _ in range(4):
            clock.tick()
            sampler.sample_once()
    calls_after_loss = fake.calls.copy()
    clock.tick()
    sampler.sample_once()
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == calls_after_loss["nvmlDeviceGetMemoryInfo"] + 1
    assert metrics.get("gpu_samples", device="0") == 8
    assert metrics.get("gpu_samples", device="1") == 3
    assert metrics.get("gpu_device_lost", device="1") == 1
    assert metrics.get("gpu_device_lost", device="0") == 0
    assert [g.lost for g in sampler.status.gpus] == [False, True]
    assert sum("lost" in r.getMessage() for r in caplog.records) == 1
    # Samples from before the loss still join, flagged; the live GPU is unaffected.
    old = sampler.join(11, T0, before)
    assert old[gj.KERNEL_ACTIVE_AVG] == pytest.approx(0.5)
    assert old[gj.DEVICE_LOST] is True
    live = sampler.join(10, before, clock.now)
    assert live[gj.KERNEL_ACTIVE_AVG] == pytest.approx(0.5)
    assert gj.DEVICE_LOST not in live
    assert sampler.covered_until_ns() == clock.now  # lost devices do not hold coverage back


def test_process_sm_util_counts_unreported_polls_as_zero() -> None:
    dev = FakeDevice(0)
    dev.compute_procs = {42: 5 << 20}
    sampler, _, _, clock = make([dev])
    for i in range(8):
        t = clock.tick()
        if i % 4 == 3:  # NVML lists a process only when it had non-zero utilisation
            dev.push_process_samples([(42, t // 1000, 60, 5)])
        sampler.sample_once()
    # Polls cover (0.25 s, 2 s]. The samples at 1 s and 2 s cover two sampler intervals each
    # (0.5 s); the rest of the polled time counts as zero.
    attrs = sampler.join(42, T0 + S // 4, clock.now)
    assert attrs[gj.PROCESS_SM_UTIL_MAX] == pytest.approx(0.6)
    assert attrs[gj.PROCESS_SM_UTIL_AVG] == pytest.approx(0.6 * 1.0 / 1.75)
    assert attrs[gj.PROCESS_MEMORY_USED_MAX] == 5 << 20
    assert sampler.join(43, T0, clock.now) == {}  # not on any GPU: nothing attached


def test_gpm_metrics_when_supported() -> None:
    hopper = FakeDevice(0, gpm_supported=True)
    older = FakeDevice(1)
    hopper.compute_procs = older.compute_procs = {42: 1}
    hopper.gpm_sm_util, hopper.gpm_dram_bw_util = 72.5, 31.0
    sampler, fake, _, clock = make([hopper, older])
    assert [g.gpm_supported for g in sampler.status.gpus] == [True, False]
    for _ in range(4):
        clock.tick()
        sampler.sample_once()
    ws = {w.index: w for w in sampler.join_windows(42, T0 + S // 2, clock.now)}
    assert ws[0].gpm_sm_util is not None and ws[0].gpm_sm_util.avg == pytest.approx(0.725)
    assert ws[0].gpm_dram_bw_util is not None and ws[0].gpm_dram_bw_util.avg == pytest.approx(0.31)
    assert ws[1].gpm_sm_util is None
    assert fake.calls["nvmlGpmSampleGet"] == 4  # only the GPM-capable device
    sampler.shutdown()
    assert fake.gpm_allocated and all(s.freed for s in fake.gpm_allocated)


def test_out_of_range_values_are_dropped_and_counted() -> None:
    dev = FakeDevice(0)
    dev.util_gpu = 250  # seen from some drivers for per-process samples
    sampler, _, metrics, clock = make([dev])
    clock.tick()
    sampler.sample_once()
    assert len(sampler.histories()[0].kernel_active) == 0
    assert metrics.get("gpu_invalid_samples", device="0", field="utilization.rates") == 1


def test_nvml_timestamps_on_another_clock_fall_back_to_tick_stamps() -> None:
    dev = FakeDevice(0)
    dev.push_util_samples(GPU, [(5_000_000, 70)])  # µs since boot, not since the epoch
    dev.util_gpu = 30
    sampler, _, _, clock = make([dev])
    clock.tick()
    sampler.sample_once()
    assert "nvml_timestamps" in sampler.unsupported_fields()[0]
    h = sampler.histories()[0]
    assert h.kernel_active.ends == [clock.now]
    assert h.kernel_active.values == [0.3]


def test_self_metrics_per_call_latency() -> None:
    sampler, _, metrics, clock = make([FakeDevice(0)])
    for _ in range(3):
        clock.tick()
        sampler.sample_once()
    assert metrics.get("gpu_nvml_calls", function="nvmlDeviceGetMemoryInfo") == 3
    assert metrics.get("gpu_nvml_call_seconds", function="nvmlDeviceGetMemoryInfo") > 0
    assert metrics.get("gpu_samples", device="0") == 3
    text = metrics.prometheus_text()
    assert 'tracejoin_gpu_nvml_calls_total{function="nvmlDeviceGetSamples"}' in text


# ---- no library, no driver, no GPU -------------------------------------------------------


def test_no_nvml_library() -> None:
    status = probe_nvml(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert not status.available
    assert "libnvidia-ml" in status.reason
    assert "driver" in status.fix
    assert "unavailable" in status.describe()


def test_driver_not_loaded() -> None:
    status = probe_nvml(FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    assert not status.available
    assert "kernel driver is not loaded" in status.reason
    assert "modprobe" in status.fix


def test_no_gpu() -> None:
    fake = FakeNvml([])
    status = probe_nvml(fake)
    assert not status.available
    assert "no GPU" in status.reason
    assert fake.initialised == 0  # NVML released again


def test_sampler_without_nvml_keeps_running() -> None:
    metrics = Metrics()
    sampler = GpuSampler(
        metrics, nvml=FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), visible_devices=None
    )
    status = sampler.start()  # must not raise
    assert not status.available
    assert metrics.get("gpu_nvml_available") == 0
    assert metrics.get("gpu_sampler_running") == 0
    assert sampler.join(1, T0, T0 + S) == {}
    assert sampler.covered_until_ns() == 0
    sampler.shutdown()
    sampler.shutdown()


def test_probe_real_nvml() -> None:
    """The real pynvml: on this machine (no driver) it must say why and how to fix it."""
    status = probe_nvml()
    if status.available:
        assert status.gpus and all(g.uuid for g in status.gpus)
    else:
        assert status.reason and status.fix


def test_probe_lists_gpus_and_unsupported_fields() -> None:
    d0, d1 = FakeDevice(0, gpm_supported=True), FakeDevice(1, name="Tesla T4 (fake)")
    d1.fail("nvmlDeviceGetProcessUtilization", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake = FakeNvml([d0, d1])
    status = probe_nvml(fake, visible_devices="all")
    assert status.available
    assert status.driver_version == "570.86.15"
    assert [(g.index, g.uuid, g.gpm_supported) for g in status.gpus] == [
        (0, d0.uuid, True),
        (1, d1.uuid, False),
    ]
    assert set(status.unsupported[1]) == {"gpm", "process_utilization"}
    assert 0 not in status.unsupported
    assert "Tesla T4" in status.describe()
    assert fake.initialised == 0


# ---- NVIDIA_VISIBLE_DEVICES --------------------------------------------------------------


def test_parse_visible_devices() -> None:
    assert parse_visible_devices(None).all
    assert parse_visible_devices("all").all
    assert parse_visible_devices(" ALL ").all
    for nothing in ("", "none", "void", "NONE"):
        v = parse_visible_devices(nothing)
        assert not v.all and v.entries == ()
    v = parse_visible_devices("0, 2,GPU-abc")
    assert not v.all and v.entries == ("0", "2", "GPU-abc")
    assert v.selects(2, "GPU-x") and v.selects(5, "gpu-ABC") and not v.selects(1, "GPU-x")


def test_visible_devices_env_limits_opened_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    devs = [FakeDevice(i) for i in range(4)]
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", f"1,{devs[3].uuid.lower()},7")
    fake = FakeNvml(devs)
    sampler = GpuSampler(nvml=fake, clock=Clock())
    status = sampler.open()
    assert status.available
    assert [h.index for h in sampler.histories()] == [1, 3]
    assert [g.index for g in status.gpus] == [1, 3]
    assert any("'7'" in n for n in status.notes)  # an entry matching nothing is reported
    sampler.sample_once()
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 2


@pytest.mark.parametrize("value", ["none", "void", ""])
def test_visible_devices_none_opens_nothing(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", value)
    fake = FakeNvml([FakeDevice(0)])
    status = probe_nvml(fake)
    assert not status.available
    assert "NVIDIA_VISIBLE_DEVICES" in status.reason
    assert fake.calls["nvmlInit"] == 0


def test_visible_devices_unset_means_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    status = probe_nvml(FakeNvml([FakeDevice(0), FakeDevice(1)]))
    assert [g.index for g in status.gpus] == [0, 1]


# ---- the thread ----------------------------------------------------------------------------


def test_sampler_thread_samples_and_join_attaches() -> None:
    dev = FakeDevice(0)
    pid = os.getpid()
    dev.compute_procs = {pid: 3 << 30}
    dev.util_gpu, dev.util_memory = 75, 25
    dev.clock_event_reasons = 0x40
    fake = FakeNvml([dev])
    metrics = Metrics()
    sampler = GpuSampler(metrics, nvml=fake, interval_s=0.02, visible_devices="all")
    start_ns = time.time_ns()
    status = sampler.start()
    assert status.available
    assert metrics.get("gpu_sampler_running") == 1
    time.sleep(0.15)
    end_ns = time.time_ns()
    deadline = time.monotonic() + 5
    while sampler.covered_until_ns() < end_ns and time.monotonic() < deadline:
        time.sleep(0.01)
    attrs = sampler.join(pid, start_ns, end_ns)
    sampler.shutdown()
    assert metrics.get("gpu_samples", device="0") >= 5
    assert attrs[gj.KERNEL_ACTIVE_AVG] == pytest.approx(0.75)
    assert attrs[gj.MEM_BUSY_MAX] == pytest.approx(0.25)
    assert attrs[gj.PROCESS_MEMORY_USED_MAX] == 3 << 30
    assert attrs[gj.CLOCK_EVENT_REASONS] == "hw_thermal_slowdown"
    assert float(attrs[gj.WINDOW_COVERAGE]) > 0.9
    assert metrics.get("gpu_sampler_running") == 0
    assert fake.initialised == 0
    n = metrics.get("gpu_samples", device="0")
    time.sleep(0.06)
    assert metrics.get("gpu_samples", device="0") == n  # the thread has stopped
    sampler.shutdown()  # idempotent
    assert fake.calls["nvmlShutdown"] == 1
    sampler.start()  # no restart after shutdown
    time.sleep(0.06)
    assert metrics.get("gpu_samples", device="0") == n
    assert metrics.get("gpu_sampler_running") == 0


def test_shutdown_without_start_is_safe() -> None:
    fake = FakeNvml([FakeDevice(0)])
    sampler = GpuSampler(nvml=fake)
    sampler.shutdown()
    sampler.shutdown()
    assert fake.calls["nvmlInit"] == 0
    sampler.start()  # after shutdown: does not open NVML or start a thread
    assert fake.calls["nvmlInit"] == 0


# ---- the test double itself ---------------------------------------------------------------


def test_fake_matches_pynvml_surface() -> None:
    fake = FakeNvml([FakeDevice(0)])
    assert fake.NVML_ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert fake.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    with pytest.raises(AttributeError):
        fake.nvmlDeviceGetBAR1MemoryInfo  # noqa: B018 - not implemented: never the real library
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    fake.nvmlInit()
    dev = fake.nvmlDeviceGetHandleByIndex(0)
    dev.fail("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetPowerUsage(dev)
    with pytest.raises(pynvml.NVMLError_NotFound):
        fake.nvmlDeviceGetSamples(dev, GPU, 0)
    dev.lose()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(dev)
    # Every pynvml function the sampler calls exists in the real module with that name.
    # (by name, as `_call` takes them, or called directly on the module)
    src = (ROOT / "agent" / "enrich" / "gpu_sampler.py").read_text()
    called = set(re.findall(r'"(nvml[A-Z][A-Za-z]+)"|\bnvml\.(nvml[A-Z][A-Za-z]+)\(', src))
    names = {quoted or direct for quoted, direct in called}
    assert {"nvmlInit", "nvmlShutdown", "nvmlDeviceGetMemoryInfo", "nvmlGpmSampleGet"} <= names
    for name in names:
        assert callable(getattr(pynvml, name)), name
        assert callable(getattr(fake, name)), name


# ---- bench helpers (the GPU check itself needs a GPU) ------------------------------------


def test_bench_call_costs_with_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is a plain directory, not installed
    from bench.gpu_check import measure_nvml_call_costs, skip_reason

    dev = FakeDevice(0, gpm_supported=True)
    costs = measure_nvml_call_costs(FakeNvml([dev]), repeats=20)
    by_name = {c.function: c for c in costs}
    assert {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo"} <= set(by_name)
    for c in costs:
        assert c.calls == (10 if "Pcie" in c.function else 20)  # PCIe reads block ~20 ms each
        assert c.mean_us > 0
        assert 0 < c.p50_us <= c.p99_us
    reason = skip_reason(FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert reason is not None and "libnvidia-ml" in reason
