"""The agent's threads ask the CPU scheduler for a slice longer than the kernel's default
(`--cpu-slice-ms`), so that a workload thread that wakes on their CPU runs at once instead of
after the agent's slice.

Linux's EEVDF scheduler (6.6+) lets a waking task preempt the running one at once when the
waking task asks for a shorter slice than the running one and has the earlier virtual deadline
(its vruntime plus its slice). Every task asks for the default slice (base_slice_ns, about
0.7 ms × (1 + log2 CPUs), at most 8 counted), so a workload thread that wakes behind one of the
agent's batches can wait that long: at ½ saturation of a 5 ms server that wait was the agent's
share of the p99. With a longer slice of its own (sched_attr.sched_runtime, Linux 6.12+) the
agent's deadlines are later, and a default thread that wakes preempts it. The price is on a CPU
where the agent and a workload thread both stay runnable: once picked, the agent may run for its
whole slice before the other gets the CPU back (the same share in longer turns), so the slice
asked for is only a little longer than the default: twice it, by default (bench.agent_ab: 5 ms,
3.6× the default here, stalled a busy server sharing the agent's CPU by tens of ms where twice
did not). Its weight, so its share of a saturated CPU and the overload budget, is unchanged.
Threads started later, and the compile's children, inherit it.

Before 6.12 the kernel accepts the request and ignores it (`Slice.honoured` is false). Asking for
a slice needs no capability; each thread's policy and nice value are read first and kept.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

AUTO_FACTOR = 2.0  # --cpu-slice-ms unset: this times the kernel's default slice
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
    default_ns: int = 0  # the kernel's default slice, as it reported it before (0: not reported)

    @property
    def honoured(self) -> bool:
        return self.requested_ms > 0 and self.granted_ns == round(self.requested_ms * 1e6)

    def describe(self) -> str:
        if self.error:
            return f"no slice was asked for: {self.error}"
        if self.requested_ms <= 0:
            return "the kernel's default slice (--cpu-slice-ms 0)"
        if self.honoured:
            default = (
                f" (the kernel's default: {self.default_ns / 1e6:g} ms)" if self.default_ns else ""
            )
            return (
                f"the agent's threads run with a {self.requested_ms:g} ms slice{default}: a "
                "workload thread that wakes on their CPU preempts them"
            )
        return (
            f"a {self.requested_ms:g} ms slice was asked for and this kernel ignores it "
            "(requested slices: Linux 6.12+); the threads keep the default"
        )


def _syscall(which: int, name: str, tid: int, attr: _SchedAttr, *more: int) -> None:
    """sched_setattr (which 0) or sched_getattr (1) of thread `tid`; OSError naming it."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        raise OSError(f"{name}: no syscall number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(calls[which], tid, ctypes.byref(attr), *more) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}({tid}): {os.strerror(err)}")


def get_attr(tid: int) -> _SchedAttr:
    attr = _SchedAttr()
    _syscall(1, "sched_getattr", tid, attr, ctypes.sizeof(attr), 0)
    return attr


def set_slice(tid: int, ms: float) -> None:
    """Thread `tid` asks for a slice of `ms`, keeping its policy, nice value and the rest. A
    realtime or deadline thread is left as it is (a slice is the fair class's)."""
    attr = get_attr(tid)
    if attr.sched_policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return
    attr.size = ctypes.sizeof(attr)
    attr.sched_flags = 0
    attr.sched_runtime = round(ms * 1e6)
    _syscall(0, "sched_setattr", tid, attr, 0)


def _on_a_new_thread(fn: Callable[[int], T]) -> T:
    """fn(tid) on a thread started for it: what it changes of its own scheduling ends with it,
    and it starts from what this thread has."""
    out: list[T] = []
    err: list[OSError] = []

    def run() -> None:
        try:
            out.append(fn(threading.get_native_id()))
        except OSError as exc:
            err.append(exc)

    t = threading.Thread(target=run, name="tracejoin-slice-probe")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _default_ns(tid: int) -> int:
    """The kernel's default slice: thread `tid` asks for none (which gives it the default back,
    whatever it inherited), and reads what it got. 0 before 6.12."""
    set_slice(tid, 0)
    return int(get_attr(tid).sched_runtime)


_NO_DEFAULT = "this kernel reports no default slice to go by (requested slices: Linux 6.12+)"


def _ask(tids: list[int], ms: float | None, default_ns: int, reader: int) -> Slice:
    """Threads `tids` ask for `ms` (None: AUTO_FACTOR times `default_ns`, inside the range the
    kernel would clamp it to, so that what it grants is what was asked); `reader` reports what
    it got."""
    if ms is None and not default_ns:
        return Slice(0.0, 0, 0, _NO_DEFAULT)
    want = ms if ms is not None else round(AUTO_FACTOR * default_ns / 1e6, 3)
    want = min(max(want, MIN_SLICE_MS), MAX_SLICE_MS)
    asked = 0
    for tid in tids:
        try:
            set_slice(tid, want)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        asked += 1
    return Slice(want, asked, int(get_attr(reader).sched_runtime), "", default_ns)


def request_slice(ms: float | None) -> Slice:
    """Every thread of this process asks for a slice of `ms` (None: AUTO_FACTOR times the
    kernel's default; 0: nothing is asked). Never raises: the agent runs as well without it,
    and the result says why not."""
    if ms is not None and ms <= 0:
        return Slice(0.0, 0, 0)
    default_ns = 0
    try:
        default_ns = _on_a_new_thread(_default_ns)
        return _ask([int(t) for t in os.listdir("/proc/self/task")], ms, default_ns, 0)
    except OSError as exc:
        return Slice(ms or 0.0, 0, 0, str(exc), default_ns)


def probe_slice(ms: float | None = None) -> Slice:
    """What request_slice(ms) would get, asked on a thread of its own (tracejoin doctor): this
    process's threads keep their scheduling."""
    try:
        return _on_a_new_thread(lambda tid: _ask([tid], ms, _default_ns(tid), tid))
    except OSError as exc:
        return Slice(ms or 0.0, 0, 0, str(exc))
