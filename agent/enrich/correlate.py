"""Join a decoded record to the world outside the kernel: wall-clock time, the caller's trace
context and the connection's addresses (the serving process's resource: enrich/resources.py).

Everything here is cached per pid / connection so the per-request cost stays in microseconds.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from tracejoin.core.metrics import Metrics
from tracejoin.enrich import traceparent
from tracejoin.kernel.decode import REQF_TP_WINDOW, REQF_TUPLE, HttpRecord

try:  # compiled where a C compiler was, at install (_trace_context.c); else parse decides all
    from tracejoin.enrich._trace_context import plain_traceparent as _plain_traceparent
except ImportError:  # pragma: no cover - the pure-Python path, under the same tests
    _plain_traceparent = None
COMPILED = _plain_traceparent is not None  # doctor, bench

log = logging.getLogger(__name__)

# What each /proc read of a served process needs beyond uid 0 (docs/operations.md, "Privileges").
_NEEDS = {
    "fd": "CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE: connections older than the agent keep no "
    "addresses where tcp:tcp_rcv_space_adjust cannot give them",
    "netns": "CAP_SYS_PTRACE: connections older than the agent keep no addresses where "
    "tcp:tcp_rcv_space_adjust cannot give them",
    "exe": "CAP_SYS_PTRACE: process.executable.name is the 15-character comm instead",
    "process_context": "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH: the service.name a process "
    "publishes (OTEP 4719) is not read; the next source names it",
    "environ": "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH: OTEL_SERVICE_NAME of a process is not "
    "read (--read-environ); the next source names it",
    "otlp_connection": "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH: an instrumented service is not "
    "found by its connection to an OTLP port (--instrumented-services can say it)",
}


class ProcReads:
    """Counts reads of another process's /proc files that fail, in
    proc_reads_failed{what, reason}: `denied` (a capability the agent was not granted: the
    first one of each kind is logged, naming it) or `gone` (the process or fd went away)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self._logged: set[str] = set()

    def failed(self, what: str, path: str, exc: OSError) -> None:
        denied = exc.errno in (errno.EACCES, errno.EPERM)
        if self.metrics is not None:
            self.metrics.inc("proc_reads_failed", what=what, reason="denied" if denied else "gone")
        if denied and what not in self._logged:
            self._logged.add(what)
            log.warning("cannot read %s: %s; needs %s", path, exc.strerror, _NEEDS[what])


class KernelClock:
    """bpf_ktime_get_ns() is CLOCK_MONOTONIC; spans need Unix time. The offset between the two
    clocks is re-read every `refresh_s` so NTP slewing cannot accumulate into the spans."""

    def __init__(self, refresh_s: float = 10.0) -> None:
        self._refresh_ns = int(refresh_s * 1e9)
        self._offset = 0
        self._taken_at = -self._refresh_ns
        self.refresh()

    def refresh(self) -> None:
        # Bracket the wall-clock read by two monotonic reads and take the midpoint.
        m0 = time.monotonic_ns()
        wall = time.time_ns()
        m1 = time.monotonic_ns()
        self._offset = wall - (m0 + m1) // 2
        self._taken_at = m1

    def to_epoch_ns(self, mono_ns: int) -> int:
        if mono_ns - self._taken_at > self._refresh_ns:
            self.refresh()
        return mono_ns + self._offset

    def offset_ns(self) -> int:
        """Unix epoch ns minus monotonic ns, as of at most `refresh_s` ago."""
        if time.monotonic_ns() - self._taken_at > self._refresh_ns:
            self.refresh()
        return self._offset


def trace_context(rec: HttpRecord) -> traceparent.TraceParent | str | None:
    """The request's caller context, a rejection reason, or None when it sent none."""
    if _plain_traceparent is not None:  # the common case, compiled: it accepts or abstains
        plain = _plain_traceparent(rec)
        if plain is not None:
            return traceparent.TraceParent(*plain)
    if rec.tp_count == 0:
        return traceparent.BEYOND_SCAN_WINDOW if rec.flags & REQF_TP_WINDOW else None
    if rec.tp_count > 1:
        return traceparent.DUPLICATE
    return traceparent.parse(rec.traceparent_bytes(), total_len=rec.tp_len)


@dataclass(frozen=True, slots=True)
class Endpoints:
    local_addr: str
    local_port: int
    peer_addr: str
    peer_port: int


_ADDR_CACHE_MAX = 4096
_addr_cache: dict[tuple[int, bytes], str] = {}


def _addr(family: int, raw: bytes) -> str:
    """The address as text; cached, since a host's peers repeat (two ipaddress objects per
    record cost ~2 µs, most of the tuple's share of a span)."""
    key = (family, raw)
    text = _addr_cache.get(key)
    if text is None:
        if len(_addr_cache) >= _ADDR_CACHE_MAX:
            _addr_cache.clear()
        text = _addr_cache[key] = _addr_text(family, raw)
    return text


def carried_addresses(family: int, laddr: bytes, raddr: bytes) -> tuple[str, str]:
    """The local and peer addresses a record carries (REQF_TUPLE), as text."""
    return _addr(family, laddr), _addr(family, raddr)


def _addr_text(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    addr = ipaddress.IPv6Address(raw[:16])
    return str(addr.ipv4_mapped or addr)


class ConnectionTable:
    """4-tuples for records whose connection predates the probes (no REQF_TUPLE): resolved from
    /proc/<pid>/fd/<fd> -> socket inode -> /proc/<pid>/net/tcp{,6}.

    Parsing /proc/net/tcp costs milliseconds on a busy host, and this runs on the reader
    thread: each network namespace's table is parsed at most once per `refresh_s` and shared by
    every lookup meanwhile; results are cached per connection."""

    def __init__(
        self, max_entries: int = 65536, refresh_s: float = 1.0, reads: ProcReads | None = None
    ) -> None:
        self.reads = reads or ProcReads()
        self._cache: dict[int, Endpoints | None] = {}
        # REQF_TUPLE records carry their tuple, the same for every request on a connection:
        # kept per conn_id (unique while the probes are loaded) rather than re-made per record
        self._carried: dict[int, Endpoints] = {}
        self._tables: dict[str, tuple[float, dict[str, Endpoints]]] = {}
        self._max = max_entries
        self._refresh_s = refresh_s
        self._lock = threading.Lock()

    def endpoints(self, rec: HttpRecord) -> Endpoints | None:
        if rec.flags & REQF_TUPLE:
            conn_id = rec.conn_id
            got = self._carried.get(conn_id)
            if got is None:
                local, peer = carried_addresses(rec.family, bytes(rec.laddr), bytes(rec.raddr))
                got = Endpoints(local, rec.lport, peer, rec.rport)
                if len(self._carried) >= self._max:
                    self._carried.clear()
                if conn_id:  # 0: the kernel could not number it
                    self._carried[conn_id] = got
            return got
        with self._lock:
            if rec.conn_id in self._cache:
                return self._cache[rec.conn_id]
        found = self._resolve(rec.pid, rec.fd)
        with self._lock:
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[rec.conn_id] = found
        return found

    def _resolve(self, pid: int, fd: int) -> Endpoints | None:
        what, path = "fd", f"/proc/{pid}/fd/{fd}"
        try:
            link = os.readlink(path)
            what, path = "netns", f"/proc/{pid}/ns/net"
            netns = os.readlink(path)
        except OSError as exc:
            self.reads.failed(what, path, exc)
            return None
        if not link.startswith("socket:["):
            return None
        inode = link[8:-1]
        now = time.monotonic()
        taken, table = self._tables.get(netns, (-1e9, {}))
        if inode not in table and now - taken >= self._refresh_s:
            table = read_tcp_table(pid)
            if len(self._tables) > 256:
                self._tables.clear()
            self._tables[netns] = (now, table)
        return table.get(inode)


def read_tcp_table(pid: int) -> dict[str, Endpoints]:
    """Socket inode -> endpoints for the TCP sockets of pid's network namespace."""
    out: dict[str, Endpoints] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{name}") as fh:
                next(fh)
                for line in fh:
                    cols = line.split()
                    if len(cols) > 9:
                        lhost, lport = _proc_addr(cols[1], family)
                        rhost, rport = _proc_addr(cols[2], family)
                        out[cols[9]] = Endpoints(lhost, lport, rhost, rport)
        except (OSError, StopIteration):
            continue
    return out


def _proc_addr(field: str, family: int) -> tuple[str, int]:
    host_hex, port_hex = field.split(":")
    raw = bytes.fromhex(host_hex)
    # /proc/net/tcp prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return _addr(family, raw), int(port_hex, 16)


def sampling_decision(
    ctx: traceparent.TraceParent | str | None, metrics: Metrics, no_parent: str, unsampled: str
) -> str:
    """'child', 'root' or 'drop' for one request, counting rejections by reason."""
    if isinstance(ctx, traceparent.TraceParent):
        if ctx.sampled or unsampled == "record":
            return "child"
        metrics.inc("requests_unsampled")
        return "drop"
    if isinstance(ctx, str):
        metrics.inc("traceparent_rejected", reason=ctx)
    return "root" if no_parent == "root" else "drop"
