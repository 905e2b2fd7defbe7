"""The slice the agent's threads ask the scheduler for (--cpu-slice-ms, tracejoin.host.scheduling),
read back from /proc/<pid>/task/<tid>/sched, the kernel's own account, not from the call that set
it. A requested slice is Linux 6.12+'s; older kernels ignore it, and these tests say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_ports, server
from hostile import agent_process
from tracejoin.host.doctor import check_cpu_slice
from tracejoin.host.scheduling import AUTO_FACTOR, Slice

HONOURED = tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 12)
needs_slices = pytest.mark.skipif(not HONOURED, reason="requested slices are Linux 6.12+")


def kernel_default() -> int:
    """The kernel's default slice, from a process that never asked for one: pid 1's."""
    try:
        return slices(1)[1] if os.path.exists("/proc/1/task/1") else 0
    except (PermissionError, KeyError):
        return 0


def slices(pid: int) -> dict[int, int]:
    """Each thread's se.slice in ns, as /proc shows it."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/sched").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        for line in text.splitlines():
            if line.startswith("se.slice"):
                out[int(tid)] = int(line.split(":")[1])
    return out


# A thread that is SCHED_BATCH at nice 3 before the request, one started after it; each
# reports its slice, nice value and policy as the kernel has them. argv: the slice to ask for
# (ms or "auto"), and a slice the process has before (ms, 0: none), as one it inherited would be.
_CHILD = """
import json, os, sys, threading
from pathlib import Path
from tracejoin.host.scheduling import request_slice, set_slice

if float(sys.argv[2]):
    set_slice(threading.get_native_id(), float(sys.argv[2]))

def facts():
    tid = threading.get_native_id()
    sched = Path(f"/proc/self/task/{tid}/sched").read_text().splitlines()
    sl = [int(l.split(":")[1]) for l in sched if l.startswith("se.slice")][0]
    return {"slice": sl, "nice": os.getpriority(os.PRIO_PROCESS, tid),
            "policy": os.sched_getscheduler(tid)}

go, done, got = threading.Event(), threading.Event(), {}
def before():
    tid = threading.get_native_id()
    os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, 3)
    done.set(); go.wait(); got["before"] = facts()
t = threading.Thread(target=before); t.start(); done.wait()
default = facts()["slice"]
result = request_slice(None if sys.argv[1] == "auto" else float(sys.argv[1]))
go.set(); t.join()
after = threading.Thread(target=lambda: got.update(after=facts())); after.start(); after.join()
got["main"] = facts()
print(json.dumps({"default": default, "threads": result.threads, "honoured": result.honoured,
                  **got}))
"""


def _child(ms: float | str, inherited_ms: float = 0) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ms), str(inherited_ms)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@needs_slices
def test_every_thread_asks_for_the_slice_and_keeps_its_policy_and_nice() -> None:
    got = _child(7.5)
    assert got["default"] != 7_500_000  # the kernel's own default is something else
    assert got["threads"] >= 2 and got["honoured"]  # (the probe thread may not be reaped yet)
    assert got["main"] == {"slice": 7_500_000, "nice": 0, "policy": os.SCHED_OTHER}
    assert got["before"] == {"slice": 7_500_000, "nice": 3, "policy": os.SCHED_BATCH}
    assert got["after"]["slice"] == 7_500_000  # a thread started later inherits it


@needs_slices
@pytest.mark.parametrize("inherited_ms", [0, 50])
def test_by_default_twice_the_kernels_default(inherited_ms: float) -> None:
    """Twice the kernel's default, whatever slice the process started with: an inherited one
    (a test runner's, a shell's) is not doubled again."""
    want = round(AUTO_FACTOR * kernel_default())
    got = _child("auto", inherited_ms)
    assert want and got["honoured"]
    assert got["main"]["slice"] == got["before"]["slice"] == got["after"]["slice"] == want
    assert got["before"]["nice"] == 3


@needs_slices
def test_the_doctors_probe_leaves_its_process_as_it_was() -> None:
    script = (
        "import threading, json; from pathlib import Path\n"
        "from tracejoin.host.scheduling import probe_slice\n"
        "def mine():\n"
        "    t = Path(f'/proc/self/task/{threading.get_native_id()}/sched').read_text()\n"
        "    return [int(l.split(':')[1]) for l in t.splitlines() if l.startswith('se.slice')][0]\n"
        "before = mine(); got = probe_slice(); after = mine()\n"
        "print(json.dumps([before, after, got.requested_ms, got.granted_ns, got.honoured]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    before, after, requested_ms, granted_ns, honoured = json.loads(out.stdout)
    assert before == after
    assert honoured and granted_ns == round(AUTO_FACTOR * kernel_default()) == requested_ms * 1e6


def test_zero_asks_for_nothing() -> None:
    got = _child(0)
    assert got["threads"] == 0 and not got["honoured"]
    assert got["main"]["slice"] == got["default"] == got["after"]["slice"]
    assert got["before"] == {"slice": got["default"], "nice": 3, "policy": os.SCHED_BATCH}


def test_the_doctor_says_when_the_kernel_ignores_the_request() -> None:
    ignored = check_cpu_slice(lambda ms: Slice(2.8, 3, 0))
    assert ignored.status.value == "fallback" and "ignores it" in ignored.detail
    refused = check_cpu_slice(lambda ms: Slice(2.8, 0, 0, "sched_setattr(1): not permitted"))
    assert refused.status.value == "fallback" and "not permitted" in refused.detail
    old_kernel = check_cpu_slice(lambda ms: Slice(0.0, 0, 0, "no default slice to go by"))
    assert old_kernel.status.value == "fallback" and "no default slice" in old_kernel.detail
    granted = check_cpu_slice(lambda ms: Slice(2.8, 1, 2_800_000, "", 1_400_000))
    assert granted.status.value == "available" and "2.8 ms slice" in granted.detail


@needs_slices
@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_tracejoin_run_threads_run_with_the_slice(tmp_path: Path) -> None:
    """Every thread of a ready `tracejoin run` (the reader, the exporters, the metrics server)
    has the default --cpu-slice-ms, twice the kernel's default slice, and /metrics says so."""
    want = round(AUTO_FACTOR * kernel_default())
    port, metrics_port = free_ports(2)
    with server("go", port) as srv:
        args = ["--port", str(port), "--pid", str(srv.pid), "--no-gpu"]
        args += ["--spans-file", str(tmp_path / "spans.jsonl")]
        with agent_process(args, tmp_path, metrics_port) as agent:
            agent.wait_ready()
            got = slices(agent.pid)
            assert len(got) >= 3, got
            assert set(got.values()) == {want}, got
            assert agent.scrape().get("cpu_slice_seconds") == want / 1e9
