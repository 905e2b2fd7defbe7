"""perf_event_open(2) without a libc wrapper: open a counter to learn whether it exists here.

Used by the probes (hardware-TLB choice) and by `tracejoin doctor`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

PERF_TYPE_SOFTWARE = 1
PERF_TYPE_HW_CACHE = 3
PERF_COUNT_SW_CPU_CLOCK = 0
PERF_COUNT_HW_CACHE_DTLB = 3
PERF_COUNT_HW_CACHE_ITLB = 4
PERF_COUNT_HW_CACHE_OP_READ = 0
PERF_COUNT_HW_CACHE_RESULT_MISS = 1
PERF_FLAG_FD_CLOEXEC = 1 << 3
_PERF_ATTR_DISABLED = 1 << 0  # bit 0 of the flags word: create the event stopped

# perf_event_open(2) has no libc wrapper: syscall numbers per architecture.
_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "riscv64": 241, "ppc64le": 319}


def hw_cache_config(cache: int, op: int, result: int) -> int:
    """PERF_TYPE_HW_CACHE config: cache id | op << 8 | result << 16 (perf_event_open(2))."""
    return cache | op << 8 | result << 16


class PerfEventAttr(ctypes.Structure):
    """struct perf_event_attr up to PERF_ATTR_SIZE_VER0 (64 bytes); the kernel zero-fills
    the rest for a smaller `size`."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup_events", ctypes.c_uint32),
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
    ]


def perf_event_open(type_: int, config: int) -> tuple[int, int]:
    """Open (stopped) and close one counter on cpu 0 for all pids; (0, 0) or (-1, errno)."""
    nr = _SYS_PERF_EVENT_OPEN.get(platform.machine())
    if nr is None:
        return -1, errno.ENOSYS
    attr = PerfEventAttr(type=type_, size=ctypes.sizeof(PerfEventAttr), config=config)
    attr.flags = _PERF_ATTR_DISABLED
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(
        ctypes.c_long(nr),
        ctypes.byref(attr),
        ctypes.c_long(-1),  # pid: all processes
        ctypes.c_long(0),  # cpu 0
        ctypes.c_long(-1),  # no group
        ctypes.c_ulong(PERF_FLAG_FD_CLOEXEC),
    )
    if fd < 0:
        return -1, ctypes.get_errno()
    os.close(fd)
    return 0, 0


PERF_KINDS = {"software": PERF_TYPE_SOFTWARE, "hw_cache": PERF_TYPE_HW_CACHE}


def perf_event_open_check(kind: str, config: int) -> str | None:
    """None when a `kind` ("software" | "hw_cache") counter with `config` opens on cpu 0, else
    why not ("ENOENT (No such file or directory)"). Shared with the probes' PMU choice."""
    fd, err = perf_event_open(PERF_KINDS[kind], config)
    return None if fd >= 0 else errno_text(err)


def errno_text(err: int) -> str:
    return f"{errno.errorcode.get(err, str(err))} ({os.strerror(err)})"
