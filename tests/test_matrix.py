"""Issue 17, the kernel matrix (tests/matrix/run.py) and the kernel feature probes behind it.

Unit: the matrix's verdict, table, result parsing and docs section; doctor's BPF feature checks
over fake probe results. Privileged, on this host: the helper probes say yes where a real BCC
program using the feature loads, and no for a helper id no kernel has. The matrix regression
(`matrix` marker, TRACEJOIN_MATRIX=1; `.ci/run` runs it): boot the oldest and newest guest
kernels and show the matrix catching a real difference between them: bpf_task_pt_regs, with
which a socket event reads its syscall's buffer, is refused by 5.10 (a real BCC load fails there
and doctor said so) and loads on 6.18; and 5.10 lacks the sock tracepoints, so the agent
refuses it cleanly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from tracejoin.host.doctor import DoctorOptions, ProbeResult, Status, run_checks
from tracejoin.kernel.features import FEATURES, FeatureResult, probe_features, probe_helper

HERE = Path(__file__).parent


def _load_run() -> ModuleType:
    spec = importlib.util.spec_from_file_location("matrix_run", HERE / "matrix" / "run.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["matrix_run"] = mod
    spec.loader.exec_module(mod)
    return mod


run = _load_run()


def _result(supported: bool, checks: list[tuple[str, bool | None]], **kw: Any) -> dict[str, Any]:
    return {
        "name": "x",
        "supported": supported,
        "checks": [{"name": n, "ok": ok, "detail": "d"} for n, ok in checks],
        "kernel": {
            "release": "9.9.0-1-cloud-amd64",
            "headers_release": "9.9",
            "headers_match": True,
        },
        **kw,
    }


# --- unit: verdict, table, parsing, docs ------------------------------------------------------


def test_verdict_supported_kernel_must_pass_every_check() -> None:
    ok = _result(True, [("doctor", True), ("page faults", True)])
    assert run.verdict(ok) == ("supported: 2 smoke checks pass", True)
    bad = _result(True, [("doctor", True), ("page faults", False)])
    text, passed = run.verdict(bad)
    assert not passed and text.startswith("FAIL: page faults")


def test_verdict_unsupported_kernel_passes_only_when_refused_cleanly() -> None:
    refused = _result(
        False, [("agent refuses with the reason", True)], doctor_summary="NOT READY: x"
    )
    assert run.verdict(refused) == ("unsupported, refused cleanly: NOT READY: x", True)
    started = _result(False, [("agent refuses with the reason", False)])
    assert run.verdict(started)[1] is False
    assert run.verdict({"error": "guest timed out"}) == ("FAIL: guest timed out", False)


def test_parse_result_takes_the_last_json_line_of_a_serial_port() -> None:
    text = 'noise\r\n{"release": "5.10"}\r\n{"release": "6.1", "checks": []}\r\n{"trunc'
    assert run.parse_result(text) == {"release": "6.1", "checks": []}
    assert "error" in run.parse_result("")


def test_only_the_emulators_faults_boot_again(tmp_path: Path, monkeypatch) -> None:
    """A root disk the host failed to write, and (under TCG only) an int3 Oops from the
    kernel's own text patching, boot once more; any other death, and any result, stands."""
    log = tmp_path / "console.log"
    log.write_text(
        "nvme0n1: I/O Cmd(0x1) @ LBA 65538, 2 blocks, I/O Error (sct 0x2 / sc 0x80)\n"
        "Kernel panic - not syncing: VFS: Unable to mount root fs on unknown-block(259,1)\n"
    )
    res = {"error": "no result from the guest (see its console log)", "console_log": str(log)}
    assert "root disk" in (run.emulator_fault(res) or "")
    log.write_text("BUG: kernel NULL pointer dereference\n")
    assert run.emulator_fault(res) is None
    assert run.emulator_fault({"checks": [], "console_log": str(log)}) is None
    log.write_text(
        "[   56.555908] Oops: int3: 0000 [#1] SMP NOPTI\n"
        "[   56.556719] RIP: 0010:handle_softirqs+0xd3/0x320\n"
        "[   56.560507] Kernel panic - not syncing: Fatal exception in interrupt\n"
    )
    monkeypatch.delenv("TRACEJOIN_MATRIX_ACCEL", raising=False)
    assert "int3" in (run.emulator_fault(res) or "")
    monkeypatch.setenv("TRACEJOIN_MATRIX_ACCEL", "kvm")  # on KVM it is the kernel's: it stands
    assert run.emulator_fault(res) is None


def test_table_has_a_row_per_kernel_with_signals_and_features() -> None:
    r = _result(
        True,
        [("doctor", True)],
        loads={"ok": True, "programs": 40, "seconds": 300.0},
        signals={"recvq": "on", "tlb": "flush_fallback", "workset": "off: needs the sched signal"},
        features={"task_pt_regs": "unavailable: verifier: invalid func unknown#175"},
    )
    text = run.table([r])
    head, _, row = text.splitlines()
    assert head.split(" | ")[:4] == ["| kernel", "headers", "verdict", "loads"]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "9.9.0-1-cloud-amd64" and cells[3] == "yes, 40 programs in 300 s"
    assert "flush_fallback" in cells and "off: needs the sched signal" in cells
    assert "unavailable: verifier: invalid func unknown#175" in cells


def test_write_docs_replaces_only_the_generated_section(tmp_path: Path) -> None:
    doc = tmp_path / "ops.md"
    doc.write_text(f"before\n{run.MARK_BEGIN}\nold\n{run.MARK_END}\nafter\n")
    run.write_docs(doc, "| t |\n", "make matrix")
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "`make matrix`" in text and "| t |" in text


def test_newest_package_by_abi_number() -> None:
    names = ["linux-image-5.10.0-9-cloud-amd64", "linux-image-5.10.0-46-cloud-amd64", "x"]
    assert run.newest(names, run.BY_NAME["5.10"].image_re()) == "linux-image-5.10.0-46-cloud-amd64"


# --- unit: doctor's BPF feature checks ---------------------------------------------------------


def _doctor(features: list[FeatureResult]) -> Any:
    return run_checks(
        DoctorOptions(
            bpf_trial=lambda: ProbeResult(True, "fake trial"),
            nvml_probe=lambda: ProbeResult(False, "no GPU (fake)"),
            bpf_features=lambda: features,
        )
    )


def _feature(name: str) -> Any:
    return next(f for f in FEATURES if f.name == name)


def test_doctor_reports_a_missing_helper_with_the_kernel_that_has_it() -> None:
    fake = [FeatureResult(f, True, "ok") for f in FEATURES if f.name != "task_pt_regs"]
    fake.append(
        FeatureResult(_feature("task_pt_regs"), False, "verifier: invalid func unknown#175")
    )
    report = _doctor(fake)
    (c,) = [c for c in report.checks if c.name == "bpf task_pt_regs"]
    assert c in report.blocking  # every socket event reads its syscall's buffer with it
    assert c.status is Status.UNAVAILABLE and c.required and c.fix == "kernel >= 5.15"
    assert "invalid func unknown#175" in c.detail


def test_doctor_blocks_without_the_ring_buffer_but_not_when_it_cannot_tell() -> None:
    others = [FeatureResult(f, True, "ok") for f in FEATURES if f.name != "ringbuf"]
    missing = _doctor([FeatureResult(_feature("ringbuf"), False, "map type 27 refused"), *others])
    assert [c.name for c in missing.blocking if c.group == "BPF features"] == ["bpf ringbuf"]
    unknown = _doctor([FeatureResult(_feature("ringbuf"), None, "cannot tell: EPERM"), *others])
    assert not [c for c in unknown.blocking if c.group == "BPF features"]


def test_doctor_names_the_minimum_kernel_for_the_sock_tracepoints() -> None:
    report = run_checks(
        DoctorOptions(
            release="5.10.0-46-cloud-amd64",
            disabled_tracepoints={"sock:sock_recv_length"},
            bpf_trial=lambda: ProbeResult(True, "fake trial"),
            nvml_probe=lambda: ProbeResult(False, "no GPU (fake)"),
        )
    )
    (rel,) = [c for c in report.checks if c.name == "kernel release"]
    assert rel.status is Status.UNAVAILABLE and "older than 6.3" in rel.detail
    assert not report.ok and "sock:sock_recv_length" in report.summary_line


# --- privileged: the probes against this kernel --------------------------------------------


@pytest.mark.privileged
def test_feature_probes_agree_with_real_loads_here(privileged: None) -> None:
    from bcc import BPF

    found = {r.feature.name: r for r in probe_features()}
    assert found["ringbuf"].available is True
    # a real program calling bpf_task_pt_regs loads here exactly when the probe says so
    smoke = (HERE / "matrix" / "smoke.py").read_text()
    program = smoke.split('TASK_PT_REGS_PROGRAM = r"""')[1].split('"""')[0]
    try:
        BPF(text=program.encode()).cleanup()
        loaded = True
    except Exception:
        loaded = False
    assert found["task_pt_regs"].available is loaded
    # and the probe can say no: a helper id past every kernel's last
    ok, detail = probe_helper(10_000)
    assert ok is False and "invalid func" in detail


# --- the matrix: oldest and newest guest kernels ------------------------------------------


@pytest.mark.timeout(3600)
def test_matrix_catches_what_5_10_lacks(tmp_path: Path) -> None:
    if os.environ.get("TRACEJOIN_MATRIX") != "1":
        pytest.skip("boots QEMU guests for minutes: TRACEJOIN_MATRIX=1 (`.ci/run` sets it)")
    missing = [t for t in ("qemu-system-x86_64", "mmdebstrap", "mke2fs") if not shutil.which(t)]
    if os.geteuid() != 0 or missing:
        pytest.skip(f"needs root and {missing or 'qemu'}: run `make setup-matrix` as root")
    rc = run.main(["--kernels", "5.10,6.18", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "matrix.json").read_text())
    print((tmp_path / "matrix.md").read_text())
    rows = {r["name"]: r for r in doc["kernels"]}
    old, new = rows["5.10"], rows["6.18"]
    assert rc == 0, [run.verdict(r) for r in doc["kernels"]]
    # 5.10: refused with the reason, before anything loads
    assert old["supported"] is False and "sock:sock_recv_length" in old["doctor_summary"]
    assert old["loads"]["ok"] is False and "6.3" in old["loads"]["detail"]
    # bpf_task_pt_regs: the helper probe and a real BCC load agree, and differ between kernels
    assert old["features"]["task_pt_regs"].startswith("unavailable")
    assert old["task_pt_regs_trial"].startswith("failed")
    assert new["features"]["task_pt_regs"] == "available" and new["task_pt_regs_trial"] == "loaded"
    # 6.18: every smoke check passed, the TLB signal labelled (no PMU under emulation)
    assert new["supported"] is True and new["signals"]["tlb"] == "flush_fallback"
    assert {c["name"] for c in new["checks"] if c["ok"]} >= {
        "trace id + parent",
        "recv-queue wait",
        "page faults",
        "tlb by mode",
        "sigterm",
        "no program left",
    }
