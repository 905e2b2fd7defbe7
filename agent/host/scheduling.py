"""The agent's threads ask the CPU scheduler for a long slice (`--cpu-slice-ms`), so that a
workload thread that wakes on their CPU runs at once instead of after the agent's slice.

Linux's EEVDF scheduler (6.6+) lets a waking task preempt the running one only when the waking
task asks for a shorter slice than the running one, or has the earlier virtual deadline; a task's
deadline is its vruntime plus its slice. Every task asks for the default slice (base_slice_ns,
~0.7 ms × (1 + log2 CPUs)), so a workload thread that wakes behind the agent's batch can wait that
long: at ½ saturation of a 5 ms server that wait is the agent's share of the p99. With a longer
slice of its own (sched_attr.sched_runtime, Linux 6.12+), the agent's deadline is later than a
default task's, and a default task that wakes preempts it at once; the agent's weight, so its
share of a saturated CPU (and the overload budget's view of it), is unchanged. Threads started
later, and the compile's children, inherit it.

Before 6.12 the kernel accepts the request and ignores it (`Slice.honoured` is false). Asking for
a slice needs no capability; the policy and nice value are read first and kept.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass

DEFAULT_SLICE_MS = 5.0
# The kernel accepts a requested slice from 0.1 to 100 ms (kernel/sched/syscalls.c).
MIN_SLICE_MS, MAX_SLICE_MS = 0.1, 100.0

# (sched_setattr, sched_getattr) by machine; both are in the generic table from 3.14.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}


class _SchedAttr(ctypes.Structure):
    """struct sched_attr (include/uapi/linux/sched/types.h), SCHED_ATTR_SIZE_VER1."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


@dataclass(frozen=True)
class Slice:
    """What asking for a slice came to, for the log, /metrics and the doctor."""

    requested_ms: float  # 0: not asked (the kernel's default kept)
    threads: int  # threads asked
    granted_ns: int  # the slice the kernel reports for this thread afterwards (0: not reported)
    error: str = ""  # why it was not asked ("" when it was, or when not asked for)

    @property
    def honoured(self) -> bool:
        return self.requested_ms > 0 and self.granted_ns == round(self.requested_ms * 1e6)

    def describe(self) -> str:
        if self.requested_ms <= 0:
            return "the kernel's default slice (--cpu-slice-ms 0)"
        if self.error:
            return f"a {self.requested_ms:g} ms slice was not asked for: {self.error}"
        if self.honoured:
            return (
                f"{self.threads} threads run with a {self.requested_ms:g} ms slice: a workload "
                "thread that wakes on their CPU preempts them"
            )
        return (
            f"a {self.requested_ms:g} ms slice was asked for and this kernel ignores it "
            "(requested slices: Linux 6.12+); the threads keep the default"
        )


def _calls() -> tuple[int, int] | None:
    return _SYSCALLS.get(platform.machine())


def get_attr(tid: int) -> _SchedAttr:
    calls = _calls()
    if calls is None:
        raise OSError(f"sched_getattr: no syscall number known for {platform.machine()}")
    attr = _SchedAttr()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(calls[1], tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sched_getattr({tid}): {os.strerror(err)}")
    return attr


def set_slice(tid: int, ms: float) -> None:
    """Thread `tid` asks for a slice of `ms`, keeping its policy, nice value and the rest. A
    realtime or deadline thread is left as it is (a slice is the fair class's)."""
    calls = _calls()
    assert calls is not None  # get_attr raised first
    attr = get_attr(tid)
    if attr.sched_policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return
    attr.size = ctypes.sizeof(attr)
    attr.sched_flags = 0
    attr.sched_runtime = round(ms * 1e6)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(calls[0], tid, ctypes.byref(attr), 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sched_setattr({tid}): {os.strerror(err)}")


def request_slice(ms: float) -> Slice:
    """Every thread of this process asks for a slice of `ms` (0: nothing is asked). Never
    raises: the agent runs as well without it, and the result says why not."""
    if ms <= 0:
        return Slice(0.0, 0, 0)
    asked = 0
    try:
        for name in os.listdir("/proc/self/task"):
            try:
                set_slice(int(name), ms)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
            asked += 1
        granted = get_attr(0).sched_runtime
    except OSError as exc:
        return Slice(ms, asked, 0, str(exc))
    return Slice(ms, asked, granted)
