"""Synthetic kernel records for the tests that run without BPF."""

from __future__ import annotations

import ctypes

from tracejoin.core.record import WSF_STATS
from tracejoin.kernel.decode import REQF_TUPLE, HttpRecord

TID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PID = 0x00F067AA0BA902B7


def record(
    tp: str | None = None,
    *,
    status: int = 200,
    path: bytes = b"/x",
    flags: int = 0,
    arrival: int = 1_000_000,
    read: int = 3_000_000,
    end: int = 9_000_000,
) -> HttpRecord:
    r = HttpRecord()
    r.type, r.pid, r.tid, r.status, r.flags = 1, 1, 1, status, flags | REQF_TUPLE
    r.family, r.lport, r.rport = 2, 8080, 40000
    r.laddr[:4], r.raddr[:4] = [127, 0, 0, 1], [10, 0, 0, 9]
    r.method = b"GET"
    r.method_len = 3
    ctypes.memmove(ctypes.addressof(r) + HttpRecord.path.offset, path, len(path))
    r.path_len = len(path)
    if tp is not None:
        raw = tp.encode()
        ctypes.memmove(ctypes.addressof(r) + HttpRecord.tp.offset, raw, min(len(raw), 56))
        r.tp_len, r.tp_count = len(raw), 1
    r.arrival_ns, r.read_ns, r.resp_start_ns, r.end_ns = arrival, read, read + 1000, end
    r.ws_flags = WSF_STATS  # the reader's counters were taken at the read
    return r


class FakeGpu:
    """A GPU joiner (pipeline.stages.GpuJoiner) whose sampler has covered up to `covered`; it
    remembers what it joined."""

    def __init__(self) -> None:
        self.covered = 0
        self.joined: list[tuple[int, int, int]] = []

    def covered_until_ns(self) -> int:
        return self.covered

    def join(self, pid: int, start_ns: int, end_ns: int) -> dict[str, float]:
        self.joined.append((pid, start_ns, end_ns))
        return {"tracejoin.gpu.kernel_active.ratio.avg": 0.5}
