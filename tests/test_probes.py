"""Which programs load, and the hardware-TLB path that this VM cannot run."""

from __future__ import annotations

import pytest
from tracejoin.core.metrics import Metrics
from tracejoin.kernel import probes
from tracejoin.kernel.probes import HttpProbes, ProbeConfig, ProbeError


def _flags(cfg: ProbeConfig) -> list[str]:
    return HttpProbes(cfg, Metrics()).render()[1]


@pytest.mark.privileged
def test_missing_optional_tracepoint_drops_only_its_signal(require_root):
    flags = _flags(ProbeConfig(disabled_tracepoints=frozenset({"sock:sk_data_ready"})))
    assert "-DWITH_RECVQ" not in flags
    assert "-DWITH_SCHED" in flags and "-DWITH_TCPSTATS" in flags


@pytest.mark.privileged
def test_missing_required_tracepoint_is_an_error_naming_it(require_root):
    with pytest.raises(ProbeError, match="sock:sock_recv_length"):
        _flags(ProbeConfig(disabled_tracepoints=frozenset({"sock:sock_recv_length"})))


@pytest.mark.privileged
def test_tlb_hardware_forced_without_pmu_is_a_clear_error(require_root, monkeypatch):
    monkeypatch.setattr(probes, "pmu_tlb_available", lambda: False)
    with pytest.raises(ProbeError, match="no hardware dTLB/iTLB counter"):
        _flags(ProbeConfig(tlb_hardware=True))


@pytest.mark.privileged
def test_tlb_hardware_path_is_selected_and_passes_the_verifier(require_root, monkeypatch):
    """With a PMU the hardware path is chosen instead of the flush fallback; its programs
    compile and load here even though no counter can be opened in this VM."""
    monkeypatch.setattr(probes, "pmu_tlb_available", lambda: True)
    src, flags = HttpProbes(ProbeConfig(), Metrics()).render()
    assert "-DTLB_HW" in flags
    from bcc import BPF

    b = BPF(text=src.encode(), cflags=[*flags, "-Wno-macro-redefined"])
    try:
        attached = set(b.tracepoint_fds)
        assert b"sched:sched_switch" in attached  # reads the counters at switch in/out
        assert b"tlb:tlb_flush" not in attached  # the fallback is compiled out
        assert b.get_table(b"dtlb") is not None and b.get_table(b"itlb") is not None
    finally:
        b.cleanup()
    assert probes.DTLB_READ_MISS == 3 | (0 << 8) | (1 << 16)
    assert probes.ITLB_READ_MISS == 4 | (0 << 8) | (1 << 16)
