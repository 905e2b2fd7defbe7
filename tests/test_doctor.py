"""tracejoin doctor: the real host (as root), and the decision logic on a fake sysroot (no root).

The real-host tests assert what these machines are documented to give (docs: DESIGN.md "What
these machines give you"): every tracepoint, no hardware PMU, no kprobes, generic non-matching
headers, no GPU. Where a host differs (a PMU, a GPU, matching headers) that assertion skips with
the reason instead of failing.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import privileged_missing
from tracejoin.host.doctor import (
    CAP_BPF,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    CAP_SYS_RESOURCE,
    CORE_SIGNAL,
    OPTIONAL_SIGNALS,
    OPTIONAL_TRACEPOINTS,
    PERF_COUNT_HW_CACHE_DTLB,
    PERF_COUNT_HW_CACHE_ITLB,
    PERF_COUNT_HW_CACHE_OP_READ,
    PERF_COUNT_HW_CACHE_RESULT_MISS,
    PERF_TYPE_HW_CACHE,
    REQUIRED_TRACEPOINTS,
    TLB_FALLBACK,
    TLB_SIGNAL,
    Check,
    DoctorOptions,
    ProbeResult,
    Report,
    Signal,
    Status,
    _from_gpu_probe,
    _privilege_gaps,
    check_bpf_cache,
    check_request_framing,
    check_ring_reader,
    check_span_encoder,
    check_traceparent_reader,
    decode_caps,
    headers_version,
    hw_cache_config,
    run_checks,
)
from tracejoin.kernel.perf import perf_event_open_check

REPORT_KEYS = {"ok", "exit_code", "summary", "kernel", "signals", "checks", "duration_s"}
CHECK_KEYS = {"name", "group", "status", "required", "detail", "fix", "notes", "data"}
SIGNAL_KEYS = {"name", "status", "required", "detail", "sources", "fallback", "fix"}


def check(report: Report, name: str) -> Check:
    (c,) = [c for c in report.checks if c.name == name]
    return c


def signal(report: Report, name: str) -> Signal:
    (s,) = [s for s in report.signals if s.name == name]
    return s


# --- the real host, as root ----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_trial() -> ProbeResult:
    """One real BPF trial load per module; the other real-host runs reuse its result."""
    reason = privileged_missing()
    if reason:
        pytest.skip(f"privileged test needs: {reason}")
    from tracejoin.host.doctor import bpf_trial_load

    return bpf_trial_load()


@pytest.fixture(scope="module")
def host(real_trial: ProbeResult) -> Report:
    return run_checks(DoctorOptions(bpf_trial=lambda: real_trial))


@pytest.mark.privileged
def test_host_is_ready(host: Report) -> None:
    assert host.exit_code == 0, host.format_text()
    assert host.summary_line.startswith("ready")
    assert host.format_text().splitlines()[0] == host.summary_line
    assert signal(host, CORE_SIGNAL).status is Status.AVAILABLE


@pytest.mark.privileged
def test_host_trial_load_counts_calls(host: Report) -> None:
    trial = check(host, "bpf trial load")
    assert trial.status is Status.AVAILABLE, trial.detail
    assert trial.required
    assert trial.data["counted"] >= 1
    assert trial.data["counted"] <= trial.data["calls"]  # filtered to this process


@pytest.mark.privileged
def test_host_has_every_tracepoint(host: Report) -> None:
    tps = {c.data["tracepoint"]: c for c in host.checks if "tracepoint" in c.data}
    assert set(tps) == set(REQUIRED_TRACEPOINTS) | set(OPTIONAL_TRACEPOINTS)
    missing = [name for name, c in tps.items() if c.status is not Status.AVAILABLE]
    assert not missing
    assert all(tps[t].required for t in REQUIRED_TRACEPOINTS)
    assert not any(tps[t].required for t in OPTIONAL_TRACEPOINTS)


@pytest.mark.privileged
def test_host_hardware_tlb_counters_fall_back(host: Report) -> None:
    if Path("/sys/bus/event_source/devices/cpu").exists():
        pytest.skip("this host has a hardware PMU (/sys/bus/event_source/devices/cpu)")
    for name in ("hw dTLB-load-misses", "hw iTLB-load-misses"):
        c = check(host, name)
        assert c.status is Status.UNAVAILABLE
        assert c.detail.startswith("no hardware PMU: E"), c.detail  # errno name follows
        assert c.data["type"] == PERF_TYPE_HW_CACHE
        assert c.fix
    tlb = signal(host, TLB_SIGNAL)
    assert tlb.status is Status.FALLBACK
    assert tlb.fallback == TLB_FALLBACK
    assert "tracejoin.tlb.flushes" in tlb.fallback and "not misses" in tlb.fallback
    assert "no hardware PMU" in tlb.detail
    assert "tlb:tlb_flush" in host.summary_line  # a degraded signal is named up front


@pytest.mark.privileged
def test_host_software_perf_events(host: Report) -> None:
    assert check(host, "software perf events").status is Status.AVAILABLE
    assert perf_event_open_check("software", 0) is None  # the helper tracejoin.kernel.probes shares


@pytest.mark.privileged
def test_host_kprobes_reported_not_required(host: Report) -> None:
    kp = check(host, "kprobes")
    assert not kp.required
    assert kp.data["needed"] is False
    assert "not needed" in kp.detail
    if not Path("/sys/bus/event_source/devices/kprobe").exists():
        assert kp.status is Status.UNAVAILABLE
    assert check(host, "uprobes").status is Status.AVAILABLE


@pytest.mark.privileged
def test_host_headers_present_but_not_matching(host: Report) -> None:
    hdr = check(host, "kernel headers")
    assert hdr.status is Status.AVAILABLE
    if hdr.data["match"]:
        pytest.skip(f"this host has matching headers ({hdr.data['version']})")
    assert hdr.data["version"] and hdr.data["version"] != os.uname().release
    assert "do not match" in hdr.detail and os.uname().release in hdr.detail
    assert "tracepoint arguments" in hdr.detail
    assert not hdr.required


@pytest.mark.privileged
def test_host_nvml_unavailable_without_gpu(host: Report) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("this host has an NVIDIA GPU (/dev/nvidia0)")
    nvml = check(host, "nvml")
    assert nvml.status is Status.UNAVAILABLE and not nvml.required
    assert nvml.fix
    gpu = signal(host, "GPU (NVML)")
    assert gpu.status is Status.UNAVAILABLE
    assert host.exit_code == 0  # a missing GPU only degrades


@pytest.mark.privileged
def test_host_disabled_required_tracepoint_blocks(real_trial: ProbeResult) -> None:
    tp = "sock:sock_recv_length"
    report = run_checks(DoctorOptions(disabled_tracepoints={tp}, bpf_trial=lambda: real_trial))
    assert report.exit_code != 0
    assert tp in report.summary_line
    assert report.summary_line.startswith("NOT READY")
    assert report.format_text().splitlines()[0] == report.summary_line
    assert signal(report, CORE_SIGNAL).status is Status.UNAVAILABLE
    assert [c.data["tracepoint"] for c in report.blocking] == [tp]


@pytest.mark.privileged
def test_host_disabled_optional_tracepoint_degrades(real_trial: ProbeResult) -> None:
    tp = "sock:sk_data_ready"
    report = run_checks(DoctorOptions(disabled_tracepoints={tp}, bpf_trial=lambda: real_trial))
    assert report.exit_code == 0
    lost = signal(report, OPTIONAL_SIGNALS[tp])
    assert lost.status is Status.UNAVAILABLE
    assert tp in lost.detail
    assert lost in report.degraded
    assert OPTIONAL_SIGNALS[tp] in report.summary_line


@pytest.mark.privileged
def test_host_json_has_stable_keys(host: Report) -> None:
    doc = json.loads(json.dumps(host.to_json()))
    assert set(doc) == REPORT_KEYS
    assert doc["exit_code"] == host.exit_code and doc["summary"] == host.summary_line
    assert set(doc["kernel"]) == {"release", "machine"}
    assert doc["checks"] and all(set(c) == CHECK_KEYS for c in doc["checks"])
    assert doc["signals"] and all(set(s) == SIGNAL_KEYS for s in doc["signals"])
    statuses = {c["status"] for c in doc["checks"]} | {s["status"] for s in doc["signals"]}
    assert statuses <= {"available", "fallback", "unavailable"}


# --- pure logic: encodings and capability rules --------------------------------------------


def test_hw_cache_config_encoding() -> None:
    read, miss = PERF_COUNT_HW_CACHE_OP_READ, PERF_COUNT_HW_CACHE_RESULT_MISS
    assert hw_cache_config(PERF_COUNT_HW_CACHE_DTLB, read, miss) == 0x10003
    assert hw_cache_config(PERF_COUNT_HW_CACHE_ITLB, read, miss) == 0x10004


def test_decode_caps() -> None:
    caps = decode_caps("000001fffeffffff")  # this VM: everything but CAP_SYS_RESOURCE
    assert {CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN} <= caps
    assert CAP_SYS_RESOURCE not in caps
    assert decode_caps("0000000000000000") == set()


def test_privilege_rules() -> None:
    missing, _ = _privilege_gaps({CAP_BPF, CAP_PERFMON}, 0, (6, 1))
    assert missing == []
    missing, _ = _privilege_gaps({CAP_SYS_ADMIN}, 0, (6, 1))  # SYS_ADMIN implies both
    assert missing == []
    missing, _ = _privilege_gaps({CAP_BPF}, 1000, (6, 1))
    assert any("CAP_PERFMON" in m for m in missing)
    assert any("CAP_DAC_READ_SEARCH" in m for m in missing)  # tracefs is root-only
    missing, _ = _privilege_gaps({CAP_BPF, CAP_PERFMON}, 0, (5, 4))
    assert any("CAP_SYS_ADMIN" in m for m in missing)
    _, notes = _privilege_gaps({CAP_BPF, CAP_PERFMON}, 0, (6, 18))
    assert any("CAP_SYS_RESOURCE" in n and "not needed" in n for n in notes)


# --- decision logic on a fake sysroot ------------------------------------------------------

RELEASE = "6.18.0-test"


def _fake_host(root: Path, headers_for: str = "6.1.0-57-amd64") -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/status").write_text(
        "Name:\tpython\nUid:\t0\t0\t0\t0\nCapEff:\t000001fffeffffff\n"
    )
    events = root / "sys/kernel/tracing/events"
    for tp in (*REQUIRED_TRACEPOINTS, *OPTIONAL_TRACEPOINTS):
        d = events.joinpath(*tp.split(":"))
        d.mkdir(parents=True)
        (d / "format").write_text("name: x\n")
    (root / "sys/bus/event_source/devices/uprobe").mkdir(parents=True)
    (root / "sys/kernel/btf").mkdir(parents=True)
    (root / "sys/kernel/btf/vmlinux").write_bytes(bytes(4096))
    hdr = root / f"usr/src/linux-headers-{headers_for}"
    (hdr / "include/generated").mkdir(parents=True)
    (hdr / "include/generated/utsrelease.h").write_text(f'#define UTS_RELEASE "{headers_for}"\n')
    (root / f"lib/modules/{RELEASE}").mkdir(parents=True)
    (root / f"lib/modules/{RELEASE}/build").symlink_to(hdr)
    return root


def _no_pmu(type_: int, config: int) -> tuple[int, int]:
    return (-1, errno.ENOENT) if type_ == PERF_TYPE_HW_CACHE else (0, 0)


def _opts(root: Path, **kw: object) -> DoctorOptions:
    base: dict = {
        "sysroot": root,
        "release": RELEASE,
        "perf_open": _no_pmu,
        "bpf_trial": lambda: ProbeResult(True, "fake trial"),
        "nvml_probe": lambda: ProbeResult(False, "no GPU (fake)", "install a GPU"),
    }
    base.update(kw)
    return DoctorOptions(**base)


def test_fake_host_ready_with_fallbacks(tmp_path: Path) -> None:
    report = run_checks(_opts(_fake_host(tmp_path)))
    assert report.exit_code == 0, report.format_text()
    assert signal(report, TLB_SIGNAL).status is Status.FALLBACK
    assert signal(report, "GPU (NVML)").status is Status.UNAVAILABLE
    hdr = check(report, "kernel headers")
    assert hdr.data["match"] is False and hdr.data["version"] == "6.1.0-57-amd64"


def test_fake_host_without_btf_is_not_ready(tmp_path: Path) -> None:
    """The probes call bpf_get_current_task_btf and bpf_task_pt_regs: no load without BTF."""
    root = _fake_host(tmp_path)
    (root / "sys/kernel/btf/vmlinux").unlink()
    report = run_checks(_opts(root))
    c = check(report, "btf")
    assert c.status is Status.UNAVAILABLE and c in report.blocking, report.format_text()
    assert "bpf_task_pt_regs" in c.detail and report.exit_code != 0


def test_fake_host_missing_required_tracepoint(tmp_path: Path) -> None:
    root = _fake_host(tmp_path)
    (root / "sys/kernel/tracing/events/tcp/tcp_destroy_sock/format").unlink()
    report = run_checks(_opts(root))
    assert report.exit_code == 1
    assert "tcp:tcp_destroy_sock" in report.summary_line
    assert check(report, "tracepoint tcp:tcp_destroy_sock").fix


def test_fake_host_without_tracefs(tmp_path: Path) -> None:
    root = _fake_host(tmp_path)
    (root / "sys/kernel/tracing/events").rename(root / "sys/kernel/tracing/gone")
    report = run_checks(_opts(root))
    assert report.exit_code == 1
    assert report.summary_line.startswith("NOT READY: tracefs: not mounted")
    assert "mount -t tracefs" in (check(report, "tracefs").fix or "")


def test_fake_host_failed_trial_and_caps(tmp_path: Path) -> None:
    root = _fake_host(tmp_path)
    (root / "proc/self/status").write_text("Uid:\t1000\t1000\t1000\t1000\nCapEff:\t0\n")
    failing = ProbeResult(False, "compile/load failed: fake", "run `make setup`")
    report = run_checks(_opts(root, bpf_trial=lambda: failing))
    assert report.exit_code == 1
    assert "privileges: uid 1000 lacks CAP_BPF" in report.summary_line
    assert "bpf trial load: compile/load failed" in report.summary_line


def test_fake_host_pmu_present_and_matching_headers(tmp_path: Path) -> None:
    root = _fake_host(tmp_path, headers_for=RELEASE)
    report = run_checks(_opts(root, perf_open=lambda t, c: (0, 0)))
    assert signal(report, TLB_SIGNAL).status is Status.AVAILABLE
    assert signal(report, TLB_SIGNAL).fallback is None
    assert check(report, "kernel headers").data["match"] is True
    assert report.exit_code == 0


def test_fake_host_pmu_without_sched_is_not_the_hardware_path(tmp_path: Path) -> None:
    """Hardware TLB counters need the sched signal (read at each context switch): with a PMU
    but no sched:sched_switch, the TLB signal is the flush fallback, saying why."""
    root = _fake_host(tmp_path, headers_for=RELEASE)
    (root / "sys/kernel/tracing/events/sched/sched_switch/format").unlink()
    report = run_checks(_opts(root, perf_open=lambda t, c: (0, 0)))
    tlb = signal(report, TLB_SIGNAL)
    assert tlb.status is Status.FALLBACK
    assert "sched:sched_switch is missing" in tlb.detail


def test_fake_host_probe_that_raises_is_reported(tmp_path: Path) -> None:
    def broken() -> ProbeResult:
        raise RuntimeError("driver exploded")

    report = run_checks(_opts(_fake_host(tmp_path), nvml_probe=broken))
    assert "driver exploded" in check(report, "nvml").detail
    assert report.exit_code == 0


def test_headers_version_from_directory_name(tmp_path: Path) -> None:
    d = tmp_path / "linux-headers-6.1.0-9-amd64"
    d.mkdir()
    assert headers_version(d) == "6.1.0-9-amd64"


def test_gpu_probe_status_is_adapted() -> None:
    """probe_nvml()'s NvmlStatus fields (read by name) become the nvml check."""
    gone = SimpleNamespace(available=False, reason="no libnvidia-ml", fix="install the driver")
    r = _from_gpu_probe(gone)
    assert (r.ok, r.detail, r.fix) == (False, "no libnvidia-ml", "install the driver")
    gpu = SimpleNamespace(name="NVIDIA H200")
    up = SimpleNamespace(available=True, driver_version="570.1", gpus=[gpu], notes=[])
    r = _from_gpu_probe(up)
    assert r.ok and r.detail == "driver 570.1, 1 GPU(s): NVIDIA H200"


def test_default_required_tracepoints_match_probes() -> None:
    """The doctor's defaults must not drift from what tracejoin.kernel.probes attaches to."""
    probes = pytest.importorskip("tracejoin.kernel.probes")
    assert set(REQUIRED_TRACEPOINTS) == set(probes.REQUIRED_TRACEPOINTS)


def test_fake_host_work_set_needs_btf(tmp_path: Path) -> None:
    from tracejoin.kernel.probes import OPTIONAL_SIGNALS

    workset = next(s.what for s in OPTIONAL_SIGNALS if s.name == "workset")
    root = _fake_host(tmp_path)
    assert signal(run_checks(_opts(root)), workset).status is Status.AVAILABLE
    (root / "sys/kernel/btf/vmlinux").unlink()
    without = signal(run_checks(_opts(root)), workset)
    assert without.status is Status.UNAVAILABLE
    assert "CONFIG_DEBUG_INFO_BTF" in (without.fix or "")


@pytest.mark.privileged
def test_json_stays_json_when_bcc_cannot_find_headers(privileged: None) -> None:
    """libbcc prints "Unable to find kernel headers" on stdout; `doctor --json` must still be one
    JSON document, naming the failure (found by the kernel matrix, issue 17)."""
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare"):
        pytest.skip("needs unshare (util-linux) to hide /lib/modules in a mount namespace")
    hide = 'mount -t tmpfs none /lib/modules && exec "$@"'
    cli = "from tracejoin.commands.cli import main; main()"
    p = subprocess.run(
        ["unshare", "-m", "sh", "-c", hide, "sh", sys.executable, "-c", cli, "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    doc = json.loads(p.stdout)
    assert p.returncode == 1 and doc["ok"] is False
    (trial,) = [c for c in doc["checks"] if c["name"] == "bpf trial load"]
    assert trial["status"] == "unavailable" and "kernel headers" in trial["detail"]


@pytest.mark.parametrize(
    ("check", "module", "says"),
    [
        (check_span_encoder, "tracejoin.pipeline.span_bytes", "pure-Python"),
        (check_ring_reader, "tracejoin.kernel.ring", "callback per record"),
        (check_traceparent_reader, "tracejoin.enrich.correlate", "Python for every"),
        (check_request_framing, "tracejoin.exporters.otlp_proto", "Python per span"),
    ],
)
def test_the_build_checks_say_which_path_runs(monkeypatch, check, module, says):
    """The test install builds every compiled path (scripts/setup.sh installs gcc and
    python3-dev); an install without them is told so, with the fix, and nothing else changes."""
    built = check()
    assert built.status is Status.AVAILABLE, built.detail
    assert not built.required
    monkeypatch.setattr(importlib.import_module(module), "COMPILED", False)
    fallback = check()
    assert fallback.status is Status.FALLBACK
    assert says in fallback.detail and fallback.fix and "gcc" in fallback.fix


def test_bpf_cache_check_says_whether_starts_keep_and_load_the_compiled_probes(tmp_path):
    """Not there yet: fine, the first start makes it. Kept entries: counted. A directory
    others can write: every start compiles (a fallback, named with the fix), and nothing in
    it is loaded. The check changes nothing on disk."""
    cache = tmp_path / "bpf"
    c = check_bpf_cache(cache)
    assert c.status == Status.AVAILABLE and "nothing kept yet" in c.detail
    assert not cache.exists()
    cache.mkdir(mode=0o700)
    for name in ("a", "b"):
        (cache / f"{name}.bpf.json").write_bytes(b"{}")
    c = check_bpf_cache(cache)
    assert c.status == Status.AVAILABLE and "2 kept" in c.detail and c.data["entries"] == 2
    cache.chmod(0o777)
    c = check_bpf_cache(cache)
    assert c.status == Status.FALLBACK and "every start compiles" in c.detail
    assert c.fix and "0700" in c.fix
    assert not c.required
