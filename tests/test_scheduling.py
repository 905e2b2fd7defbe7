"""The slice the agent's threads ask the scheduler for (--cpu-slice-ms, tracejoin.host.scheduling),
read back from /proc/<pid>/task/<tid>/sched, the kernel's own account, not from the call that set
it. A requested slice is Linux 6.12+'s; older kernels ignore it, and these tests say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from harness import free_ports, server
from hostile import agent_process
from tracejoin.host.doctor import check_cpu_slice
from tracejoin.host.scheduling import AUTO_FACTOR, Slice

HONOURED = tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 12)
needs_slices = pytest.mark.skipif(not HONOURED, reason="requested slices are Linux 6.12+")


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
# reports its slice, nice value and policy as the kernel has them.
_CHILD = """
import json, os, sys, threading
from pathlib import Path
from tracejoin.host.scheduling import request_slice

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


def _child(ms: float | str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ms)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@needs_slices
def test_every_thread_asks_for_the_slice_and_keeps_its_policy_and_nice() -> None:
    got = _child(7.5)
    assert got["default"] != 7_500_000  # the kernel's own default is something else
    assert got["threads"] == 2 and got["honoured"]
    assert got["main"] == {"slice": 7_500_000, "nice": 0, "policy": os.SCHED_OTHER}
    assert got["before"] == {"slice": 7_500_000, "nice": 3, "policy": os.SCHED_BATCH}
    assert got["after"]["slice"] == 7_500_000  # a thread started later inherits it


@needs_slices
def test_by_default_twice_the_kernels_default() -> None:
    got = _child("auto")
    want = round(AUTO_FACTOR * got["default"])
    assert got["default"] > 0 and got["honoured"]
    assert got["main"]["slice"] == got["before"]["slice"] == got["after"]["slice"] == want
    assert got["before"]["nice"] == 3


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
    granted = check_cpu_slice(lambda ms: Slice(2.8, 3, 2_800_000, "", 1_400_000))
    assert granted.status.value == "available" and "2.8 ms slice" in granted.detail


@needs_slices
@pytest.mark.privileged
@pytest.mark.usefixtures("require_root")
def test_tracejoin_run_threads_run_with_the_slice(tmp_path: Path) -> None:
    """Every thread of a ready `tracejoin run` (the reader, the exporters, the metrics server)
    has the default --cpu-slice-ms, twice the kernel's default slice, and /metrics says so."""
    want = round(AUTO_FACTOR * slices(os.getpid())[threading.get_native_id()])
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
