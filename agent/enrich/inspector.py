"""The slow reads about a served process, on a thread of their own: its published process
context, its OpenTelemetry environment (opt-in) and whether it holds a connection to an OTLP
port (docs/attributes.md, "service.name" and "Instrumented services").

They read another process's maps, memory, environment and file descriptors: reads that take
that process's mmap lock or walk its fd table, and can take milliseconds, or stall behind a
process stuck in the kernel. So the reader thread never does them. `ProcessInspector.get(key)`
answers from the last inspection of a process (pid and start time, so a recycled pid is another
process); a process seen for the first time is inspected at once, and the first lookup waits at
most `first_wait_s` for it (the first span of a process is then named like the rest, unless
its /proc is that slow). Inspections are repeated every `refresh_s` while the process is still
asked about: an SDK can publish, or connect to its collector, after the process started.

OTLP connection: an established TCP connection from the process to a port in `otlp_ports`
(4317, 4318 by default). Read from /proc/<pid>/net/tcp{,6}, and only where that namespace has
such a connection, from the process's /proc/<pid>/fd. Reading a namespace's TCP table walks
the kernel's whole established hash (5 ms per table on a 24 GiB host, more on larger ones,
whatever the namespace holds), so it is read once, then again only after the kernel counted
a connection to an OTLP port anywhere on the host (`otlp_connects`, the probes'
inet_sock_set_state; an SDK connects at its first export, a few seconds after its first span):
on a node whose services never connect, once per namespace. Without that count (another
record source), every refresh. It is a heuristic: a process may talk to a collector for other
reasons (a proxy).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tracejoin.core.metrics import Metrics
from tracejoin.core.model import AttrValue
from tracejoin.enrich.correlate import ProcReads
from tracejoin.enrich.process_context import (
    InvalidContext,
    read_otel_environ,
    read_process_context,
)

log = logging.getLogger(__name__)

OTLP_PORTS = (4317, 4318)
REFRESH_S = 10.0
# A new process's first lookup waits this long for its inspection, at most once per
# WAIT_INTERVAL_S, so a burst of new processes cannot hold the reader for more than a tenth of
# its time. Reading a network namespace's TCP table walks the kernel's whole connection hash:
# about 15 ms per address family on a host with a large one (measured here: 20 ms for
# /proc/net/tcp with 226 entries, 15 ms for tcp6 with 4).
FIRST_WAIT_S = 0.1
WAIT_INTERVAL_S = 1.0
MAX_ENTRIES = 4096
TCP_ESTABLISHED = "01"

Key = tuple[int, float]  # (pid, process start time)


@dataclass(frozen=True, slots=True)
class Inspection:
    """What a process says about itself, as last read."""

    context: dict[str, AttrValue] | None = None  # its OTEP 4719 resource; None: none published
    environ: dict[str, AttrValue] | None = None  # from OTEL_* variables (--read-environ)
    otlp_connected: bool = False  # an established connection to an OTLP port
    read_at: float = field(default=0.0, compare=False)


class ProcessInspector:
    """Thread-safe; start() runs the inspecting thread, shutdown() is idempotent and safe
    without start. Without start, `get` inspects in the calling thread (tests, tools)."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        read_environ: bool = False,
        check_otlp: bool = True,
        otlp_ports: Collection[int] = OTLP_PORTS,
        refresh_s: float = REFRESH_S,
        first_wait_s: float = FIRST_WAIT_S,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
        proc: str = "/proc",
        otlp_connects: Callable[[], int | None] | None = None,
    ) -> None:
        self.metrics = metrics
        self.read_environ = read_environ
        # off when --instrumented yes/no makes the answer moot
        self.otlp_ports = frozenset(otlp_ports) if check_otlp else frozenset()
        self.refresh_s = refresh_s
        self.first_wait_s = first_wait_s
        self._max_entries = max_entries
        self._clock = clock
        self._proc = proc
        self._reads = ProcReads(metrics)
        self._lock = threading.Lock()
        self._results: OrderedDict[Key, Inspection] = OrderedDict()
        self._pending: dict[Key, threading.Event] = {}
        self._wake = threading.Condition(self._lock)
        self._queue: deque[Key] = deque()
        self._thread: threading.Thread | None = None
        self._stop = False
        # the kernel's count of connections to an OTLP port (None: not counted, or not now)
        self._otlp_connects = otlp_connects
        # network namespace -> (inodes of its connections to an OTLP port, when read, the
        # count of connections to an OTLP port just before)
        self._netns: dict[str, tuple[frozenset[int], float, int | None]] = {}
        self._waited_at = -WAIT_INTERVAL_S  # clock() of the last first-lookup wait
        self.generation = 0  # bumped whenever an inspection's result changes

    def read_own_namespace(self) -> None:
        """Read the OTLP connections of the agent's own network namespace now. It is the host's
        as deployed, the one a node's host-network services share: its tables are then read as
        the agent starts (~9 ms on the bench's VM) rather than on the first look at a served
        process, which the reader may be waiting for (FIRST_WAIT_S)."""
        if self.otlp_ports:
            self._otlp_tables(os.getpid(), self._clock())

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="tracejoin-inspector", daemon=True
            )
            self._thread.start()

    def shutdown(self, timeout_s: float = 1.0) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def get(self, key: Key) -> Inspection | None:
        """The last inspection of the process; asks for a new one when it is older than
        `refresh_s`. The first time a process is asked about, waits up to `first_wait_s` for
        it (unless it waited for another process less than WAIT_INTERVAL_S ago); None if it did
        not come in time (counted: process_inspection_late)."""
        now = self._clock()
        with self._lock:
            got = self._results.get(key)
            started = self._thread is not None
            if got is not None:
                self._results.move_to_end(key)
                if now - got.read_at < self.refresh_s:
                    return got
                if started:
                    self._ask(key)
                    return got
            pending = self._ask(key) if started else None
        if pending is None:  # not started: inspect here
            return self._inspect(key)
        if now - self._waited_at < WAIT_INTERVAL_S:
            self.metrics.inc("process_inspection_late")  # waited for another one just now
            return None
        self._waited_at = now
        if not pending.wait(self.first_wait_s):
            self.metrics.inc("process_inspection_late")
        with self._lock:
            return self._results.get(key)

    def _ask(self, key: Key) -> threading.Event:
        """Queue key (once); the event is set when its inspection lands. Under the lock."""
        event = self._pending.get(key)
        if event is None:
            event = self._pending[key] = threading.Event()
            if len(self._queue) < self._max_entries:
                self._queue.append(key)
                self._wake.notify()
            else:  # far behind (a fork storm): never inspected, never waited for
                event.set()
                del self._pending[key]
        return event

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stop:
                    self._wake.wait()
                if self._stop:
                    return
                key = self._queue.popleft()
            try:
                self._inspect(key)
            except Exception:  # a bug here must not stop inspections: count and go on
                log.exception("inspecting pid %d failed", key[0])
                self.metrics.inc("process_inspection_errors")
            with self._lock:
                event = self._pending.pop(key, None)
            if event is not None:
                event.set()

    def _inspect(self, key: Key) -> Inspection:
        pid = key[0]
        now = self._clock()
        with self._lock:
            before = self._results.get(key)
        context = self._context(pid)
        # The connection check is the costly read (a TCP table walk): not needed where the
        # process context already says it, nor again once seen (an SDK does not leave).
        connected = context is None and (
            (before is not None and before.otlp_connected) or self._otlp_connected(pid, now)
        )
        got = Inspection(
            context=context,
            environ=self._environ(pid) if self.read_environ else None,
            otlp_connected=connected,
            read_at=now,
        )
        with self._lock:
            if before != got:
                self.generation += 1
            self._results[key] = got
            self._results.move_to_end(key)
            while len(self._results) > self._max_entries:
                self._results.popitem(last=False)
        return got

    # -- the reads ---------------------------------------------------------------------------

    def _context(self, pid: int) -> dict[str, AttrValue] | None:
        try:
            return read_process_context(pid, self._proc)
        except InvalidContext as exc:
            self.metrics.inc("process_context_invalid", reason=exc.reason)
        except OSError as exc:
            self._reads.failed("process_context", f"{self._proc}/{pid}/mem", exc)
        return None

    def _environ(self, pid: int) -> dict[str, AttrValue] | None:
        try:
            return read_otel_environ(pid, self._proc)
        except OSError as exc:
            self._reads.failed("environ", f"{self._proc}/{pid}/environ", exc)
        return None

    def _otlp_connected(self, pid: int, now: float) -> bool:
        if not self.otlp_ports:
            return False
        inodes = self._otlp_tables(pid, now)
        if not inodes:
            return False  # no connection to an OTLP port in its namespace: no fd walk
        return self._holds_one_of(pid, inodes)

    def _otlp_tables(self, pid: int, now: float) -> frozenset[int] | None:
        """The inodes of the connections to an OTLP port in pid's network namespace, as last
        read (read again when stale); None when they cannot be read."""
        proc = f"{self._proc}/{pid}"
        try:
            netns = os.readlink(f"{proc}/ns/net")
        except OSError as exc:
            self._reads.failed("otlp_connection", f"{proc}/ns/net", exc)
            return None
        cached = self._netns.get(netns)
        # read before the table: a connection counted after it is read again next time
        connects = self._otlp_connects() if self._otlp_connects is not None else None
        if cached is None or self._tables_stale(cached, now, connects):
            try:
                inodes = self._otlp_inodes(proc)
            except OSError:
                return None  # gone meanwhile
            self.metrics.inc("otlp_tables_read")
            cached = self._netns[netns] = (inodes, now, connects)
            if len(self._netns) > self._max_entries:
                self._netns.pop(next(iter(self._netns)))
        return cached[0]

    def _tables_stale(
        self, cached: tuple[frozenset[int], float, int | None], now: float, connects: int | None
    ) -> bool:
        """A namespace's tables are read again once the kernel counted a connection to an
        OTLP port since; without that count (then or now), once refresh_s has passed."""
        _, read_at, connects_then = cached
        if connects is None or connects_then is None:
            return now - read_at >= self.refresh_s
        return connects != connects_then

    def _otlp_inodes(self, proc: str) -> frozenset[int]:
        """Socket inodes of the established TCP connections to an OTLP port in the network
        namespace of the process at `proc` (the kernel's <proc>/net/tcp and tcp6 tables)."""
        out: set[int] = set()
        for table in ("tcp", "tcp6"):
            try:
                with open(f"{proc}/net/{table}") as f:
                    lines = f.read().splitlines()[1:]
            except FileNotFoundError:
                continue  # no IPv6
            for line in lines:
                # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                fields = line.split()
                if len(fields) < 10 or fields[3] != TCP_ESTABLISHED:
                    continue
                if int(fields[2].rsplit(":", 1)[1], 16) in self.otlp_ports:
                    out.add(int(fields[9]))
        return frozenset(out)

    def _holds_one_of(self, pid: int, inodes: frozenset[int]) -> bool:
        fd_dir = f"{self._proc}/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError as exc:
            self._reads.failed("otlp_connection", fd_dir, exc)
            return False
        for name in names:
            try:
                link = os.readlink(f"{fd_dir}/{name}")
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EPERM):
                    self._reads.failed("otlp_connection", fd_dir, exc)
                    return False
                continue  # closed meanwhile
            if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                return True
        return False
