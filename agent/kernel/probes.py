"""Load, attach, poll and unload the BPF programs in bpf/http.c.

Which programs load is decided here, before compiling: a required tracepoint that is missing is
a start-up error naming it; a missing optional one drops its signal (and its -D define), is
reported once and counted in self-metrics (`probe_mode`), and the rest runs.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import logging
import os
import platform
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from tracejoin.core.metrics import Metrics
from tracejoin.core.record import (
    AGG_NO_PARENT,
    AGG_SHED,
    AGG_UNSAMPLED,
    CNT_MAX,
    KERNEL_COUNTERS,
    PROG_H2_END,
    PROG_H2_RD,
    PROG_H2_WR,
    PROG_RUN_NOTES,
    PROG_SCAN_REQ,
    PROG_SCAN_RESP,
    REC_HTTP_FIXED_SIZE,
    RINGBUF_PAGES,
    WS_SLOTS,
    HttpRecord,
    Policy,
    Sampling,
    WsMember,
)
from tracejoin.kernel import compiled, ring
from tracejoin.kernel.btf import BtfError, struct_offsets
from tracejoin.kernel.cuda import CudaProbes, load_apis
from tracejoin.kernel.perf import perf_event_open_check
from tracejoin.kernel.ring import RingReader, RingWakeups

log = logging.getLogger(__name__)

RING_BYTES = RINGBUF_PAGES * 4096  # the `events` ring buffer (bpf/http.c)
# struct agg_key.why -> the name user space gives it (metrics' `why` label)
AGG_WHY = {AGG_SHED: "shed", AGG_UNSAMPLED: "unsampled", AGG_NO_PARENT: "no_parent"}

TRACEFS_CANDIDATES = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")

# Tracepoints the HTTP pipeline cannot run without.
REQUIRED_TRACEPOINTS: tuple[str, ...] = (
    # Only the exits: a socket event reads its syscall's arguments from the thread's saved
    # registers (syscall_args in bpf/http.c), so no program runs at any syscall's entry.
    *(
        f"syscalls:sys_exit_{c}"
        for c in (
            "read",
            "readv",
            "recvfrom",
            "recvmsg",
            "write",
            "writev",
            "sendto",
            "sendmsg",
            "sendfile64",
        )
    ),
    "sock:sock_recv_length",
    "sock:sock_send_length",
    "sock:inet_sock_set_state",
    "tcp:tcp_destroy_sock",
)

# The oldest kernel tracejoin runs on, and why: the two sock tracepoints that hand the probes the
# socket inside read/write arrived in 6.3. Before them no tracepoint names the socket a syscall
# reads from; the only way is walking task->files->fdt (struct layouts, not a stable interface).
MIN_KERNEL = (6, 3)
MIN_KERNEL_TEXT = "6.3"
MIN_KERNEL_TRACEPOINTS = ("sock:sock_recv_length", "sock:sock_send_length")
MIN_KERNEL_WHY = "sock:sock_recv_length and sock:sock_send_length (added in 6.3)"

# The architectures whose syscall ABI bpf/http.c reads from the saved user registers
# (syscall_args): platform.machine() -> the knob that selects it.
SYSCALL_ABI_KNOBS = {"x86_64": "ARCH_X86_64", "aarch64": "ARCH_ARM64"}


@dataclass(frozen=True)
class OptionalSignal:
    name: str  # as shown by doctor and in the probe_mode metric
    define: str  # -D flag that compiles its programs in
    tracepoints: tuple[str, ...]
    what: str


OPTIONAL_SIGNALS: tuple[OptionalSignal, ...] = (
    OptionalSignal("recvq", "WITH_RECVQ", ("sock:sk_data_ready",), "TCP receive-queue wait"),
    # Planned on its classic tracepoint, which runs only without the socket's offsets in the
    # kernel's BTF; with them sock_recv_length reads the tuple (bpf/http_conn.h sk_tuple), and
    # disabling the tracepoint still turns the signal off.
    OptionalSignal(
        "tuple_at_read",
        "WITH_TUPLE_AT_READ",
        ("tcp:tcp_rcv_space_adjust",),
        "4-tuple and port filter for connections older than the agent",
    ),
    # tcp:tcp_probe likewise runs only without tcp_sock's offsets (sock_send_length reads them)
    OptionalSignal(
        "tcp_stats",
        "WITH_TCPSTATS",
        ("tcp:tcp_retransmit_skb", "tcp:tcp_probe"),
        "retransmissions and smoothed RTT",
    ),
    OptionalSignal(
        "sched",
        "WITH_SCHED",
        ("sched:sched_switch", "sched:sched_wakeup", "sched:sched_wakeup_new"),
        "run-queue delay and off-CPU time",
    ),
    OptionalSignal(
        "tlb_flush", "WITH_TLB_FLUSH", ("tlb:tlb_flush",), "TLB flush counts (fallback when no PMU)"
    ),
    # Needs `sched` too (on-CPU and blocked time come from sched_switch/sched_wakeup). The irq
    # and timer pairs mark interrupt context, whose wakes name no cause (bpf/http_workset.h).
    OptionalSignal(
        "workset",
        "WITH_WORKSET",
        (
            "sched:sched_waking",
            "irq:irq_handler_entry",
            "irq:irq_handler_exit",
            "irq:softirq_entry",
            "irq:softirq_exit",
            "timer:hrtimer_expire_entry",
            "timer:hrtimer_expire_exit",
        ),
        "the request's work set: threads and processes it woke (thread pools, worker processes)",
    ),
)
# Opt-in uprobe signals (--cuda, --cuda-launches): in ProbeStatus.signals only when asked for.
CUDA_SIGNALS = ("cuda", "cuda_launches")
# HTTP/2's three programs: "loading" while `tracejoin run` verifies them after ready
HTTP2_SIGNAL = "http2"
OPTIONAL_TRACEPOINTS: tuple[str, ...] = tuple(
    tp for sig in OPTIONAL_SIGNALS for tp in sig.tracepoints
)

# struct sock_common members sock_recv_length reads for a connection first met at a read
# (bpf/http_conn.h sk_tuple), by knob; sock_common is struct sock's __sk_common
SOCK_COMMON_MEMBERS = {
    "skc_family": "SK_FAMILY_OFF",
    "skc_num": "SK_NUM_OFF",
    "skc_dport": "SK_DPORT_OFF",
    "skc_rcv_saddr": "SK_RCV_SADDR_OFF",
    "skc_daddr": "SK_DADDR_OFF",
    "skc_v6_rcv_saddr": "SK_V6_RCV_SADDR_OFF",
    "skc_v6_daddr": "SK_V6_DADDR_OFF",
}
# struct tcp_sock members sock_send_length reads at a served connection's writes
# (bpf/http_enrich.h tcp_sample_at_write), by knob
TCP_SOCK_MEMBERS = {
    "srtt_us": "TCP_SRTT_OFF",
    "snd_nxt": "TCP_SND_NXT_OFF",
    "snd_una": "TCP_SND_UNA_OFF",
}

# Every macro the planner may define. Conditionals on these are resolved when the source is
# rendered, so `tracejoin ebpf` shows only the code that is compiled; a conditional on anything
# else (an include guard) is left to the compiler.
KNOBS = frozenset(
    {
        *(sig.define for sig in OPTIONAL_SIGNALS),
        "WITH_FAULTS",
        "FILTER_PID",
        "FILTER_PORT",
        "FILTER_COMM",
        "TLB_HW",
        "NCPU",
        "RUNQ_THRESHOLD_NS",
        "WAKE_EVERY",
        "TASK_FLAGS_OFF",
        "TASK_PID_OFF",
        "TASK_TGID_OFF",
        "TASK_COMM_OFF",
        *SOCK_COMMON_MEMBERS.values(),
        *TCP_SOCK_MEMBERS.values(),
        "WITH_IRQ_VECTORS",
        "WITH_CUDA",
        "CUDA_SYNC_THRESHOLD_NS",
        *SYSCALL_ABI_KNOBS.values(),
    }
)
# x86 only: irq_work's own interrupt, where BPF ring buffer and perf wakeups run (the work set
# ignores wakes in interrupt context); elsewhere those wakes are not bracketed
IRQ_VECTOR_TRACEPOINTS = ("irq_vectors:irq_work_entry", "irq_vectors:irq_work_exit")
# task_struct members the work set reads from a woken task (bpf/http_workset.h), by knob
TASK_MEMBERS = {
    "flags": "TASK_FLAGS_OFF",
    "pid": "TASK_PID_OFF",
    "tgid": "TASK_TGID_OFF",
    "comm": "TASK_COMM_OFF",
}
# Every struct whose offsets the planner may pass to the programs, read in one pass over the
# kernel's BTF (_kernel_structs): the work set's and the scheduler's task_struct members, and
# the socket programs' (tuple_at_read: sock_common at struct sock's __sk_common, read by
# sock_recv_length; tcp_stats: tcp_sock, read by sock_send_length)
KERNEL_STRUCTS = {
    "task_struct": tuple(TASK_MEMBERS),
    "sock": ("__sk_common",),
    "sock_common": tuple(SOCK_COMMON_MEMBERS),
    "tcp_sock": tuple(TCP_SOCK_MEMBERS),
}
# -disable-llvm-passes: clang emits the module unoptimised and BCC's own -O3 pass pipeline
# (BPFModule::run_pass_manager, always run before code generation) optimises it once; with
# clang's -O2 pipeline as well, the module went through the optimiser twice, ~30 % of a compile
# (bench.compile_units; docs/performance.md, "A first start's compile"). -g0: no debug info,
# which BCC makes by default for its own BTF and line info; the agent loads the programs with a
# BTF of its own (compiled.ModuleBtf) and never reads BCC's, and the code is the same without it
# (only the map-fd placeholders BCC numbers differ), for ~22 % of a compile ("Fewer states to
# verify"). A map type that needs BTF to be created (local storage) would need it back.
CFLAGS = ("-Wno-macro-redefined", "-Xclang", "-disable-llvm-passes", "-g0")
# bpf_loop callbacks of bpf/http.c, named in C by LOOP_CB(fn) and linked by the loader
LOOP_CALLBACKS = (
    "scan_req_steps",
    "scan_resp_steps",
    "flush_conn_step",
    "h2_steps_rd",
    "h2_steps_wr",
    "h2_end_queued",
    "h2_end_flush",
)

# perf_event_attr.config for PERF_TYPE_HW_CACHE: cache | (op << 8) | (result << 16)
_HW_CACHE_DTLB, _HW_CACHE_ITLB, _OP_READ, _RESULT_MISS = 3, 4, 0, 1
DTLB_READ_MISS = _HW_CACHE_DTLB | (_OP_READ << 8) | (_RESULT_MISS << 16)
ITLB_READ_MISS = _HW_CACHE_ITLB | (_OP_READ << 8) | (_RESULT_MISS << 16)


class ProbeError(RuntimeError):
    """Start-up failure with a message that says what is missing and how to fix it."""


def tracefs_root() -> Path | None:
    for cand in TRACEFS_CANDIDATES:
        if os.path.isdir(os.path.join(cand, "events")):
            return Path(cand)
    return None


def tracepoint_exists(tp: str, disabled: frozenset[str] = frozenset()) -> bool:
    if tp in disabled:
        return False
    root = tracefs_root()
    if root is None:
        return False
    cat, name = tp.split(":", 1)
    return (root / "events" / cat / name / "format").is_file()


def bpf_source_dir() -> Path:
    """bpf/ as installed with the package: found without relying on the current directory."""
    return Path(str(resources.files("tracejoin.bpf")))


@dataclass
class ProbeConfig:
    pids: tuple[int, ...] = ()
    ports: tuple[int, ...] = ()
    comm: str | None = None
    # OTLP receivers' ports: connections to them are counted (kernel otlp_connects), so the
    # inspector reads TCP tables again only after one (agent/enrich/inspector.py)
    otlp_ports: tuple[int, ...] = ()
    runq_threshold_ns: int = 1_000_000
    # Tracepoints to treat as absent (tests; or to switch a costly signal off).
    disabled_tracepoints: frozenset[str] = frozenset()
    tlb_hardware: bool | None = None  # None: use the PMU when it opens
    page_faults: bool = True
    workset: bool = True  # follow the work into the threads a request wakes (needs sched)
    cuda: bool = False  # uprobes on CUDA libraries (agent/kernel/cuda.py; needs the work set)
    cuda_launches: bool = False  # ... kernel launches too (on the critical path: opt-in)
    cuda_sync_threshold_ns: int = 1_000_000  # synchronisations kept as child spans
    # Verify the HTTP/2 programs in a thread once start() returns, and at a start that
    # compiles, compile them there too (tracejoin run: ready and HTTP/1.x traced sooner,
    # docs/performance.md); False: start() compiles and loads them too (capture, tests).
    http2_after_ready: bool = False
    # Keep the compiled programs here, so a later start on this kernel loads them instead of
    # compiling (agent/kernel/compiled.py); None: compile in child processes at every start
    bpf_cache_dir: Path | None = None
    # Read the records ring with the compiled consumer (kernel/ring.py) where it was built;
    # False: BCC's reader, one Python callback per record (the fallback; tests and the bench
    # run both).
    compiled_ring: bool = ring.COMPILED


@dataclass
class ProbeStatus:
    signals: dict[str, str] = field(default_factory=dict)  # name -> "on" / "off: why"
    tlb_mode: str = "off"  # "hardware", "flush_fallback", "off"
    load_seconds: float = 0.0
    http2_load_seconds: float = 0.0  # verifying the HTTP/2 programs (after ready or in start())
    http2_compile_seconds: float = 0.0  # compiling them after ready (compile_later)
    # Where the compiled programs came from (agent/kernel/compiled.py): "cache", or "compiled"
    # in child processes for this start; the entry's path ("" when not kept)
    bpf_source: str = ""
    bpf_cache_path: str = ""
    compile_seconds: float = 0.0  # obtaining them: the children's compile, or reading the entry
    compile_peak_bytes: int = 0  # the compiling children's peak resident memory, summed
    compile_units: int = 0  # compiling children run at once (1, or 2 on two CPUs; 0: cache)
    compile_later: bool = False  # HTTP/2's programs compile after ready (http2_after_ready)
    code_released_bytes: int = 0  # clang/LLVM's code pages unmapped (release_compiler_code)

    @property
    def compile_text(self) -> str:
        """How the programs were obtained, for a log line or a summary."""
        kept = f"kept in {self.bpf_cache_path}" if self.bpf_cache_path else "not kept"
        if self.bpf_source == "cache":
            return f"compiled programs from the cache ({self.bpf_cache_path})"
        mib = f"{self.compile_peak_bytes / 2**20:.0f} MiB"
        if self.compile_units > 1:
            how = (
                f"compiled in {self.compile_units} child processes at once in "
                f"{self.compile_seconds:.1f}s (peaks {mib} summed)"
            )
        else:
            how = f"compiled in a child process in {self.compile_seconds:.1f}s (peak {mib})"
        if self.compile_later:
            return f"{how}, HTTP/2's to compile after ready; {kept} then"
        return f"{how}, {kept}"


T = TypeVar("T")


def _ncpus() -> int:
    return os.cpu_count() or 1


def run_concurrently(calls: Sequence[Callable[[], T]], workers: int, name: str) -> list[T]:
    """Run blocking calls, up to `workers` at once, and return their results in order; the
    first failure is raised, after every call has returned. For calls that block in the kernel
    (ctypes releases the GIL for them): program loads and detaches."""
    if workers <= 1 or len(calls) <= 1:
        return [call() for call in calls]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"tracejoin-{name}") as pool:
        futures = [pool.submit(call) for call in calls]
    return [f.result() for f in futures]


# Beside HTTP/2's programs (h2_*), the programs the second of a compiling start's two
# compilers takes (compiled.unit_texts): with them, each compiler's CPU time is about half of
# the whole's, plus what each pays to start (python -m bench.compile_units).
COMPILED_APART = (
    "ws_wake_prog",
    "ws_wake_more",
    "tracepoint__sock__inet_sock_set_state",
    "CUDA_APIS(CUDA_AT_ENTRY)",  # --cuda: the calls without a return probe (bpf/cuda.h)
)
# ... and, when HTTP/2's programs compile after ready (http2_after_ready), the request scanner
# and the notes program too, which take HTTP/2's place in the balance (bench.compile_units'
# "all but HTTP/2's" rows: 1.24 s in one child, 0.85 s in two at once)
COMPILED_APART_AFTER_READY = (*COMPILED_APART, "scan_req", "scan_req_steps", "run_notes")


def compiled_later(name: str) -> bool:
    """Whether a program compiles after ready at a start that compiles (http2_after_ready):
    HTTP/2's, which also load after ready."""
    return name.startswith("h2_")


def compiled_apart(name: str) -> bool:
    """Whether a program compiles in the second compiler: HTTP/2's (bpf/http2_scan.h), nearly
    half of what the compiler does, and COMPILED_APART."""
    return name.startswith("h2_") or name in COMPILED_APART


def compiled_apart_after_ready(name: str) -> bool:
    """compiled_apart for the programs a start compiles before ready when HTTP/2's compile
    after it (compiled_later)."""
    return name in COMPILED_APART_AFTER_READY


def load_programs(bpf: Any, programs: Sequence[tuple[str, int]], workers: int) -> list[int]:
    """Load (verify) BCC functions, up to `workers` at once, and return their fds in order.
    The kernel verifies a program in the thread that loads it, so on idle CPUs the wall time
    falls to the slowest program's (`bench.startup --verify`)."""
    loads = [partial(bpf.load_func, name.encode(), kind) for name, kind in programs]
    return [fn.fd for fn in run_concurrently(loads, workers, "verify")]


class HttpProbes:
    """The kernel half of the pipeline, and the pipeline's record source. start() compiles and
    attaches; poll() returns the raw records the ring buffer holds; detach() stops every program
    from firing while the ring buffer stays readable; shutdown() unloads everything (idempotent,
    safe without start)."""

    def __init__(self, config: ProbeConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.status = ProbeStatus()
        self._bpf: object | None = None
        self._batch: list[bytes] = []
        self._ring: RingReader | None = None
        self._wakeups: RingWakeups | None = None  # BCC's reader: our edge-triggered wait
        self._counters_batch = True  # read `counters` in one BPF_MAP_LOOKUP_BATCH
        self.ring_bytes = RING_BYTES  # the records ring's size (the overload budget)
        self.cuda: CudaProbes | None = None
        self._h2_loader: threading.Thread | None = None
        self._compiling: compiled.Deferred | None = None  # HTTP/2's programs, after ready
        self._detaching = False  # detach() has begun and not returned (shutdown() checks it)

    # -- build ---------------------------------------------------------------------------

    def plan(self) -> dict[str, int | None]:
        """The knobs to compile with: name -> value (None: defined, without a value)."""
        cfg = self.config
        missing = [
            tp for tp in REQUIRED_TRACEPOINTS if not tracepoint_exists(tp, cfg.disabled_tracepoints)
        ]
        if tracefs_root() is None:
            raise ProbeError(
                "tracefs is not mounted: run `mount -t tracefs tracefs "
                "/sys/kernel/tracing` (or mount it into the container)"
            )
        if missing:
            too_old = set(missing) & set(MIN_KERNEL_TRACEPOINTS)
            raise ProbeError(
                f"required tracepoint(s) missing: {', '.join(missing)}; "
                "this kernel cannot run tracejoin (see `tracejoin doctor`)"
                + (
                    f"; tracejoin needs kernel >= {MIN_KERNEL_TEXT}: {MIN_KERNEL_WHY}"
                    if too_old
                    else ""
                )
            )
        arch = SYSCALL_ABI_KNOBS.get(platform.machine())
        if arch is None:
            raise ProbeError(
                f"tracejoin reads syscall arguments as x86_64 and aarch64 pass them; this "
                f"machine is {platform.machine() or 'of an unknown architecture'}"
            )
        knobs: dict[str, int | None] = {
            arch: None,
            "NCPU": _ncpus(),
            "RUNQ_THRESHOLD_NS": int(cfg.runq_threshold_ns),
            "WAKE_EVERY": wake_every(_ncpus()),
        }
        task: dict[str, int] | str = "sched is off"  # task_struct's offsets, or why not
        structs: dict[str, dict[str, int] | BtfError] = {}  # read once, when first needed
        for sig in OPTIONAL_SIGNALS:
            absent = [
                tp for tp in sig.tracepoints if not tracepoint_exists(tp, cfg.disabled_tracepoints)
            ]
            if absent:
                self.status.signals[sig.name] = f"off: tracepoint {', '.join(absent)} missing"
            elif sig.name == "workset" and not cfg.workset:
                self.status.signals[sig.name] = "off: disabled by configuration"
            elif sig.name == "workset" and "WITH_SCHED" not in knobs:
                self.status.signals[sig.name] = "off: needs the sched signal"
            elif sig.name == "workset" and (
                why := _workset_knobs(knobs, task, cfg.disabled_tracepoints)
            ):
                self.status.signals[sig.name] = f"off: {why}"
            else:
                self.status.signals[sig.name] = "on"
                knobs[sig.define] = None
                if sig.name in ("sched", "tuple_at_read", "tcp_stats"):
                    structs = structs or _kernel_structs()
                if sig.name == "sched":
                    task = _sched_knobs(knobs, structs)
                elif sig.name in ("tuple_at_read", "tcp_stats"):
                    _socket_knobs(knobs, sig.name, structs)
        if cfg.cuda:
            if "WITH_WORKSET" in knobs:
                self.status.signals["cuda"] = "on"
                knobs["WITH_CUDA"] = None
                knobs["CUDA_SYNC_THRESHOLD_NS"] = int(cfg.cuda_sync_threshold_ns)
                if cfg.cuda_launches:
                    self.status.signals["cuda_launches"] = "on"
            else:  # a call is a request's through its work set: without one, nothing to say
                self.status.signals["cuda"] = "off: needs the work set"
        if cfg.page_faults:
            knobs["WITH_FAULTS"] = None
        if cfg.pids:
            knobs["FILTER_PID"] = None
        if cfg.ports:
            knobs["FILTER_PORT"] = None
        if cfg.comm:
            knobs["FILTER_COMM"] = None
        if cfg.tlb_hardware is not False:
            if not pmu_tlb_available():
                if cfg.tlb_hardware:
                    raise ProbeError(
                        "--tlb hardware: no hardware dTLB/iTLB counter opens here "
                        "(no PMU, e.g. in a VM); use --tlb auto for the "
                        "tlb:tlb_flush fallback (see `tracejoin doctor`)"
                    )
            elif self.status.signals.get("sched") != "on":
                # The counters are per CPU: a thread's share is only right when it is read
                # at every switch of the thread, which needs sched:sched_switch.
                if cfg.tlb_hardware:
                    raise ProbeError(
                        "--tlb hardware needs the sched signal (sched:sched_switch): the "
                        f"counters are read at each context switch; sched is "
                        f"{self.status.signals.get('sched')}"
                    )
            else:
                knobs["TLB_HW"] = None
        return knobs

    def render(self, knobs: dict[str, int | None] | None = None) -> tuple[str, list[str]]:
        """The C text and flags exactly as compiled (for `tracejoin ebpf`): bpf/http.c with
        its local includes inlined and the knobs applied."""
        if knobs is None:
            knobs = self.plan()
        defines = compiled.loop_callback_defines(LOOP_CALLBACKS)
        return render_source(bpf_source_dir(), "http.c", knobs, defines), list(CFLAGS)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        try:
            from bcc import BPF, PerfSWConfig, PerfType  # Debian's python3-bpfcc
        except ImportError as exc:
            raise ProbeError(
                f"cannot import bcc ({exc}): install python3-bpfcc and run `make setup`"
            ) from exc
        t0 = time.monotonic()
        knobs = self.plan()
        src, cflags = self.render(knobs)
        t_obtain = time.monotonic()
        after_ready = self.config.http2_after_ready
        try:
            # compiled in child processes (tracejoin run: HTTP/2's after ready), or taken from
            # the cache (agent/kernel/compiled.py)
            got = compiled.obtain(
                src,
                list(cflags),
                self.config.bpf_cache_dir,
                apart=compiled_apart_after_ready if after_ready else compiled_apart,
                later=compiled_later if after_ready else None,
            )
        except compiled.CompileError as exc:
            raise ProbeError(
                f"BPF compile failed: {exc}. Kernel headers must exist at "
                f"/lib/modules/{os.uname().release}/build (run `make setup`, or mount the "
                "host's /lib/modules and /usr/src)"
            ) from exc
        self.status.bpf_source = got.source
        self.status.bpf_cache_path = str(got.path) if got.path else ""
        self.status.compile_seconds = time.monotonic() - t_obtain
        self.status.compile_peak_bytes = got.compile_peak_bytes
        self.status.compile_units = got.units
        self.status.compile_later = got.later is not None
        self._compiling = got.later
        try:
            bpf = compiled.cached_bpf(got.entry)
        except Exception as exc:
            raise ProbeError(f"BPF maps could not be created: {exc}") from exc
        self._bpf = bpf
        # what the programs read is in place before the first of them runs
        if "WITH_WORKSET" in knobs:
            bpf[b"agent_tgid"][ctypes.c_int(0)] = ctypes.c_uint32(os.getpid())
        self._fill_filters(bpf)
        tail_calls = [
            (b"progs", PROG_SCAN_REQ, "scan_req", BPF.TRACEPOINT),
            (b"progs", PROG_SCAN_RESP, "scan_resp", BPF.TRACEPOINT),
            (b"progs", PROG_RUN_NOTES, "run_notes", BPF.TRACEPOINT),
        ]
        if "WITH_WORKSET" in knobs:  # the work set's wake handler, behind its raw tracepoints
            tail_calls.append((b"ws_progs", 0, "ws_wake_prog", BPF.RAW_TRACEPOINT))
            tail_calls.append((b"ws_progs", 1, "ws_wake_more", BPF.RAW_TRACEPOINT))
        try:
            # Everything HTTP/1.x needs is verified at once on every CPU, the largest first:
            # the verifier runs in the loading thread, so the wall time approaches the
            # verifier's CPU time over the CPUs (bench.startup, bench.verifier_cost).
            # Then the tail-call slots are filled and only then does anything attach, so no
            # request is seen by a program whose tail calls are not there yet.
            programs = [(name, kind) for _, _, name, kind in tail_calls]
            fds = load_programs(bpf, [*programs, *bpf.autoload_programs()], _ncpus())
            for (table, idx, _, _), fd in zip(tail_calls, fds[: len(tail_calls)], strict=True):
                bpf[table][ctypes.c_int(idx)] = ctypes.c_int(fd)
            bpf.autoload()  # attaches the tracepoint programs, loaded above
        except Exception as exc:
            raise ProbeError(f"BPF load failed: {exc}") from exc
        if "WITH_FAULTS" in knobs:
            try:
                bpf.attach_perf_event(
                    ev_type=PerfType.SOFTWARE,
                    ev_config=PerfSWConfig.PAGE_FAULTS_MIN,
                    fn_name=b"on_minflt",
                    sample_period=1,
                )
                bpf.attach_perf_event(
                    ev_type=PerfType.SOFTWARE,
                    ev_config=PerfSWConfig.PAGE_FAULTS_MAJ,
                    fn_name=b"on_majflt",
                    sample_period=1,
                )
                self.status.signals["page_faults"] = "on"
            except Exception as exc:
                self.status.signals["page_faults"] = f"off: software perf events: {exc}"
        else:
            self.status.signals["page_faults"] = "off: disabled by configuration"
        if "TLB_HW" in knobs:
            bpf[b"dtlb"].open_perf_event(PerfType.HW_CACHE, DTLB_READ_MISS)
            bpf[b"itlb"].open_perf_event(PerfType.HW_CACHE, ITLB_READ_MISS)
            self.status.tlb_mode = "hardware"
        elif self.status.signals.get("tlb_flush") == "on":
            self.status.tlb_mode = "flush_fallback"
        events = bpf[b"events"]
        if self.config.compiled_ring:
            self._ring = RingReader(events.map_fd, self.ring_bytes)
        else:
            events.open_ring_buffer(self._on_record)
            self._wakeups = RingWakeups(events.map_fd)
        if "WITH_CUDA" in knobs:
            apis = load_apis(bpf_source_dir() / "cuda.h")
            self.cuda = CudaProbes(bpf, apis, self.metrics, launches=self.config.cuda_launches)
            self.cuda.start()
        if self.config.http2_after_ready:
            self.status.signals[HTTP2_SIGNAL] = "loading"
            self._h2_loader = threading.Thread(
                target=self._load_http2, args=(bpf,), name="tracejoin-http2", daemon=True
            )
        else:
            self._load_http2(bpf)
        self.status.load_seconds = time.monotonic() - t0
        self.status.code_released_bytes = release_compiler_code()
        log.info("probes loaded in %.1fs: %s", self.status.load_seconds, self.status.compile_text)
        for name, state in self.status.signals.items():
            self._report_signal(name, state)
        self.metrics.set("probe_mode", 1, signal=f"tlb_{self.status.tlb_mode}")
        if self._h2_loader is not None:
            self._h2_loader.start()

    @property
    def loading(self) -> bool:
        """Programs are still being verified after start() returned (HTTP/2's, after ready):
        the agent's CPU then is start-up work, not records (the overload budget skips it)."""
        return self._h2_loader is not None and self._h2_loader.is_alive()

    def _report_signal(self, name: str, state: str) -> None:
        self.metrics.set("probe_mode", 1 if state == "on" else 0, signal=name)
        if state not in ("on", "loading"):
            log.warning("signal %s is %s", name, state)

    def _load_http2(self, bpf: Any) -> None:
        """Verify the HTTP/2 programs (bpf/http2_scan.h: the largest programs to verify) and
        put them in the tail-call table, the end program first since the scanners tail-call
        it; at a start that compiles them after ready, wait for that compile first. Until they
        are in, a connection that turns HTTP/2 is ignored and counted (kernel
        h2_not_loaded); if they fail to load, HTTP/2 stays off and HTTP/1.x runs on."""
        from bcc import BPF

        t0 = time.monotonic()
        if self._compiling is not None:
            try:
                bpf.extend(self._compiling.result())
            except (compiled.CompileError, compiled.CachedBPFError) as exc:
                self._http2_settled(f"off: its programs did not compile ({exc})", t0)
                return
            self.status.compile_peak_bytes += self._compiling.peak_bytes
            self.status.http2_compile_seconds = time.monotonic() - t0
            t0 = time.monotonic()
        programs = (("h2_end", PROG_H2_END), ("h2_scan_wr", PROG_H2_WR), ("h2_scan_rd", PROG_H2_RD))
        # after ready, one CPU stays free for the workload and the reader
        workers = max(1, _ncpus() - 1) if self._h2_loader is not None else _ncpus()
        try:
            fds = load_programs(bpf, [(name, BPF.TRACEPOINT) for name, _ in programs], workers)
            for (_, idx), fd in zip(programs, fds, strict=True):
                bpf[b"progs"][ctypes.c_int(idx)] = ctypes.c_int(fd)
            state = "on"
        except Exception as exc:
            state = f"off: its programs did not load ({exc})"
        self._http2_settled(state, t0)

    def _http2_settled(self, state: str, t0: float) -> None:
        self.status.http2_load_seconds = time.monotonic() - t0
        self.status.signals[HTTP2_SIGNAL] = state
        if self._h2_loader is None:
            return  # start() reports it with the other signals
        self._report_signal(HTTP2_SIGNAL, state)  # off: warned as any signal is
        if state == "on":
            compiled_for = self.status.http2_compile_seconds
            how = f"compiled in {compiled_for:.1f}s, " if compiled_for else ""
            seconds = self.status.http2_load_seconds
            log.info("http2 on: its programs %sverified in %.1fs", how, seconds)

    def _fill_filters(self, bpf: object) -> None:
        cfg = self.config
        one = ctypes.c_uint8(1)
        for pid in cfg.pids:
            bpf[b"filter_pid"][ctypes.c_uint32(pid)] = one  # type: ignore[index]
        for port in cfg.ports:
            bpf[b"filter_port"][ctypes.c_uint16(port)] = one  # type: ignore[index]
        for port in cfg.otlp_ports:
            bpf[b"otlp_ports"][ctypes.c_uint16(port)] = one  # type: ignore[index]
        if cfg.comm:
            table = bpf[b"filter_comm"]  # type: ignore[index]
            leaf = table.Leaf()
            raw = cfg.comm.encode()[:15]
            ctypes.memmove(ctypes.addressof(leaf), raw, len(raw))
            table[ctypes.c_int(0)] = leaf

    def _on_record(self, _ctx: object, data: int, size: int) -> None:
        self._batch.append(ctypes.string_at(data, size))

    def poll(self, timeout_ms: int = 100) -> list[bytes]:
        """Wait up to timeout_ms (0: not at all), then return the records the ring holds (at
        most READ_SLICE of them with the compiled reader; the rest make the next poll return
        at once).

        The kernel submits records without waking the reader (bpf/http_conn.h emit()), except
        when enough have gathered to fill half the ring: so this sleeps the whole timeout in
        the common case, wakes early in a burst, and takes a batch either way. epoll returning
        on its timeout consumes nothing, hence the consume after it."""
        if self._bpf is None:
            return []
        if self._ring is not None:
            batch = self._ring.poll(timeout_ms, READ_SLICE)
        else:
            bpf: Any = self._bpf
            if timeout_ms and self._wakeups is not None:
                self._wakeups.wait(timeout_ms)  # not ring_buffer_poll: level-triggered
            bpf.ring_buffer_consume()
            batch, self._batch = self._batch, []
        if self.cuda is not None:
            try:  # finding libraries never costs a record
                self.cuda.track(_record_pids(batch))
                self.cuda.poll()
            except Exception:
                self.metrics.inc("cuda_rescan_errors")
                log.exception("CUDA library rescan failed (the records are kept)")
        return batch

    @property
    def addresses_from_fds(self) -> bool:
        """Whether a record may carry no addresses, only its pid and fd, for user space to read
        from /proc while the connection is open (a connection older than the agent, on a kernel
        without tcp:tcp_rcv_space_adjust): the reader then polls sooner (stages.POLL_MS_FDS).
        True until start() has decided."""
        return self.status.signals.get("tuple_at_read") != "on"

    def backlog(self) -> float:
        """The share of the ring still to read, now (0 with BCC's reader: not known)."""
        return self._ring.backlog() if self._ring is not None else 0.0

    def set_sampling(self, ratio: float) -> None:
        """Keep a request's record when its trace id's low 8 bytes (big-endian) are below
        ratio x 2^64, as OpenTelemetry's TraceIdRatioBased decides; 1: keep everything."""
        if self._bpf is None:
            return
        table = self._bpf[b"sampling"]  # type: ignore[index]
        table[ctypes.c_int(0)] = sampling_entry(ratio)

    def set_policy(self, *, unsampled: str, no_parent: str) -> None:
        """Tell the kernel which requests no span is made of (--unsampled, --no-parent), so it
        aggregates them instead of sending them. Until this is called every request is sent
        and user space decides, as it does for everything the kernel cannot be sure of."""
        if self._bpf is None:
            return
        table = self._bpf[b"policy"]  # type: ignore[index]
        table[ctypes.c_int(0)] = Policy(
            agg_unsampled=unsampled == "follow", agg_no_parent=no_parent == "skip"
        )

    def shed(self) -> dict[tuple[int, int], tuple[int, int, list[int]]]:
        """What the budget shed, per endpoint (pid, port): requests, summed latency in ns,
        and log2-µs latency buckets (bpf/http_record.h struct agg_val), summed over CPUs."""
        return self.aggregates().get(AGG_WHY[AGG_SHED], {})

    def aggregates(self) -> dict[str, dict[tuple[int, int], tuple[int, int, list[int]]]]:
        """Every request the kernel kept instead of sending, by why ("shed", "unsampled",
        "no_parent") then endpoint (pid, port): requests, summed latency in ns and log2-µs
        latency buckets (struct agg_val), summed over CPUs."""
        if self._bpf is None:
            return {}
        out: dict[str, dict[tuple[int, int], tuple[int, int, list[int]]]] = {}
        for key, per_cpu in self._bpf[b"shed"].items():  # type: ignore[index]
            why = AGG_WHY.get(key.why)
            if why is None:
                continue
            count = sum(v.count for v in per_cpu)
            total = sum(v.sum_ns for v in per_cpu)
            hist = [sum(v.hist[i] for v in per_cpu) for i in range(len(per_cpu[0].hist))]
            out.setdefault(why, {})[(key.pid, key.lport)] = (count, total, hist)
        return out

    def detach(self) -> None:
        """Detach every tracepoint and perf event; the ring buffer keeps what was submitted."""
        bpf: Any = self._bpf
        if bpf is None:
            return
        detaches: list[Callable[[], object]] = [
            *(partial(bpf.detach_tracepoint, tp) for tp in list(bpf.tracepoint_fds)),
            *(partial(bpf.detach_raw_tracepoint, raw) for raw in list(bpf.raw_tracepoint_fds)),
            *(partial(bpf.detach_perf_event, *ev) for ev in list(bpf.open_perf_events)),
            # CUDA (agent/kernel/cuda.py)
            *(partial(bpf.detach_uprobe_event, ev) for ev in list(bpf.uprobe_fds)),
        ]
        self._detaching = True
        try:
            # One after another: each waits for an RCU grace period in the kernel (seconds in
            # all while the verifier keeps a CPU busy; the pipeline bounds its wait). At once
            # they were faster, but a 6.18 guest under QEMU TCG panicked (int3 in a patched
            # tracepoint site) during them, once: not done again until that is understood.
            run_concurrently(detaches, 1, "detach")
        finally:
            self._detaching = False
        self.cuda = None  # no rescans (they would attach again)

    def kernel_counter(self, name: str) -> int | None:
        """One kernel counter (KERNEL_COUNTERS), from kernel_counters; None while no programs
        are loaded (other threads ask: the inspector)."""
        try:
            return self.kernel_counters().get(name)
        except Exception:  # unloaded meanwhile (shutdown)
            return None

    def kernel_counters(self) -> dict[str, int]:
        """Per-CPU kernel counters summed (CNT_* in bpf/http_record.h). The whole array in one
        BPF_MAP_LOOKUP_BATCH where the kernel has it for arrays (a syscall and a per-CPU
        lookup per counter otherwise: ~0.4 ms of the agent's CPU each read; read at each
        scrape, and once a second for the overload budget)."""
        if self._bpf is None:
            return {}
        table = self._bpf[b"counters"]  # type: ignore[index]
        values = _batch_values(table, CNT_MAX) if self._counters_batch else None
        if values is None:
            self._counters_batch = False  # not for arrays on this kernel: key by key from now
            values = [table[ctypes.c_int(idx)] for idx in range(CNT_MAX)]
        return {
            name: int(sum(values[idx])) for idx, name in KERNEL_COUNTERS.items() if idx < CNT_MAX
        }

    def map_sizes(self) -> dict[str, int]:
        """Live entries in the per-connection maps (for bound checks)."""
        if self._bpf is None:
            return {}
        bpf: Any = self._bpf
        names = ["conns", "reqs", "threads"]
        if self.status.signals.get("workset") == "on":
            names.append("worksets")
        return {name: len(list(bpf[name.encode()].keys())) for name in names}

    def shutdown(self) -> None:
        bpf: Any = self._bpf
        self._bpf = None
        if self._compiling is not None:
            self._compiling.cancel()  # leave no compiler running behind the agent
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._wakeups is not None:
            self._wakeups.close()
            self._wakeups = None
        busy = "HTTP/2 programs still loading" if self.loading else ""
        busy = busy or ("probes still detaching" if self._detaching else "")
        if bpf is not None and busy:
            # freeing the module under a thread still in libbcc would crash it; the process is
            # exiting (tracejoin run), and exit closes every program and map. So BCC's own
            # exit-time cleanup is called off too (it would free the module the same way, or
            # detach one by one past the shutdown bound).
            atexit.unregister(bpf.cleanup)
            log.info("%s at shutdown: left to the process's exit", busy)
            return
        if bpf is not None:
            bpf.cleanup()


_PID_AT = HttpRecord.pid.offset
_NSLOTS_AT = HttpRecord.ws_nslots.offset
_MEMBER_PIDS_AT = tuple(
    HttpRecord.members.offset + i * ctypes.sizeof(WsMember) + WsMember.pid.offset
    for i in range(WS_SLOTS)
)


# The compiled reader takes at most an eighth of the ring per poll (~470 records of the fixed
# size): a reader falling behind hands the pipeline, and so the overload budget's fill check,
# a batch every few tens of ms instead of a whole ring's worth after seconds. Records left in
# the ring make the next poll return at once.
READ_SLICE = RING_BYTES // 8 // (REC_HTTP_FIXED_SIZE + 8)


def _record_pids(batch: list[bytes]) -> set[int]:
    """The processes that served or worked for these records (read from the raw bytes, before
    decoding: only to know whom to rescan for CUDA libraries)."""
    out: set[int] = set()
    for data in batch:
        if len(data) <= _NSLOTS_AT:
            continue
        out.add(int.from_bytes(data[_PID_AT : _PID_AT + 4], "little"))
        for at in _MEMBER_PIDS_AT[: min(data[_NSLOTS_AT], WS_SLOTS)]:
            if len(data) >= at + 4:
                out.add(int.from_bytes(data[at : at + 4], "little"))
    return out


def _kernel_structs() -> dict[str, dict[str, int] | BtfError]:
    """KERNEL_STRUCTS' member offsets from one read of the kernel's BTF: per struct, its
    offsets or the error saying why there are none (a blob that cannot be read: every one)."""
    try:
        return struct_offsets(KERNEL_STRUCTS)
    except BtfError as exc:
        return dict.fromkeys(KERNEL_STRUCTS, exc)


def _sched_knobs(
    knobs: dict[str, int | None], structs: dict[str, dict[str, int] | BtfError]
) -> dict[str, int] | str:
    """task_struct's offsets (TASK_MEMBERS), or why there are none, for the scheduler and the
    work set. With them the scheduler programs are raw tracepoints that read the next and the
    woken task's pid themselves and skip the perf trace record (bpf/http_enrich.h); without,
    classic tracepoints that see the same, at more cost per event."""
    offsets = structs["task_struct"]
    if isinstance(offsets, BtfError):
        log.info(
            "sched: classic tracepoints (no task_struct offsets in the kernel's BTF: %s)", offsets
        )
        return str(offsets)
    knobs["TASK_PID_OFF"] = offsets["pid"]
    return offsets


def _socket_knobs(
    knobs: dict[str, int | None], signal: str, structs: dict[str, dict[str, int] | BtfError]
) -> None:
    """The socket offsets that spare `signal` a classic tracepoint's perf trace record at every
    packet or read of the host: struct sock_common's tuple for tuple_at_read (sock_recv_length
    reads it for a connection it first meets; no program at tcp_rcv_space_adjust), tcp_sock's
    RTT and sequence numbers for tcp_stats (sock_send_length reads them at a served
    connection's writes; no program at tcp_probe). Without BTF (or a member) a classic
    tracepoint sees them in its trace record."""
    if signal == "tuple_at_read":
        sock, common = structs["sock"], structs["sock_common"]
        if isinstance(sock, dict) and isinstance(common, dict):
            base = sock["__sk_common"]
            knobs.update({knob: base + common[m] for m, knob in SOCK_COMMON_MEMBERS.items()})
            return
        why = sock if isinstance(sock, BtfError) else common
    else:
        tcp = structs["tcp_sock"]
        if isinstance(tcp, dict):
            knobs.update({knob: tcp[m] for m, knob in TCP_SOCK_MEMBERS.items()})
            return
        why = tcp
    log.info("%s: a classic tracepoint (socket offsets not in the kernel's BTF: %s)", signal, why)


def _workset_knobs(
    knobs: dict[str, int | None], task: dict[str, int] | str, disabled: frozenset[str]
) -> str | None:
    """Add the knobs the work set needs (task_struct offsets, the agent's pid, the x86 irq_work
    tracepoints when present); or say why it cannot load."""
    if isinstance(task, str):
        return f"task_struct offsets not found in the kernel's BTF ({task})"
    offsets = task
    for member, knob in TASK_MEMBERS.items():
        knobs[knob] = offsets[member]
    if all(tracepoint_exists(tp, disabled) for tp in IRQ_VECTOR_TRACEPOINTS):
        knobs["WITH_IRQ_VECTORS"] = None
    return None


def _batch_values(table: Any, n: int) -> list[Any] | None:
    """Values of keys 0..n-1 of a BCC array table (per-CPU values as BCC's leaf arrays) in one
    BPF_MAP_LOOKUP_BATCH; None where the kernel refuses it for this map."""
    from bcc.libbcc import lib

    keys = (ctypes.c_uint32 * n)()
    values = (table.Leaf * n)()
    count, out_batch = ctypes.c_uint32(n), ctypes.c_uint32(0)
    res = lib.bpf_lookup_batch(
        table.map_fd, None, ctypes.byref(out_batch), keys, values, ctypes.byref(count)
    )
    # ENOENT: the end of the map was reached, i.e. all of it was read
    if (res != 0 and ctypes.get_errno() != errno.ENOENT) or count.value != n:
        return None
    if list(keys) != list(range(n)):
        return None
    return list(values)


def wake_every(ncpus: int) -> int:
    """Records per CPU between forced reader wake-ups: the largest power of two with which all
    CPUs together cannot fill more than half the ring with records no one was woken for."""
    per_cpu = RING_BYTES // (ctypes.sizeof(HttpRecord) + 8) // 2 // max(1, ncpus)
    return 1 << max(0, per_cpu.bit_length() - 1) if per_cpu else 1


def sampling_entry(ratio: float) -> Sampling:
    """The kernel's sampling entry for a ratio: the bound is OpenTelemetry's
    TraceIdRatioBased.get_bound_for_rate (round(ratio x 2^64)); ratio 1 switches it off."""
    ratio = min(1.0, max(0.0, ratio))
    bound = round(ratio * (1 << 64))
    if bound >= 1 << 64:
        return Sampling(bound=0, active=0)
    return Sampling(bound=bound, active=1)


def rss_bytes(kind: str) -> int:
    """This process's resident memory of a kind ("RssAnon", "RssFile" in /proc/self/status),
    in bytes; 0 if unread."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(f"{kind}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# The shared libraries BCC compiles with (Debian: libLLVM-N.so, libclang-cpp.so.N). The agent
# never compiles (a child does, agent/kernel/compiled.py), but `import bcc` maps them and runs
# their static initialisers; nothing after that runs their code (table access, the ring buffer
# and attaches are libbcc's).
COMPILER_LIBRARIES = ("/libLLVM", "/libclang-cpp")
_MADV_DONTNEED = 4


def compiler_code_ranges(maps_lines: list[str]) -> list[tuple[int, int]]:
    """The [start, end) address ranges of the compiler libraries' code in a /proc/<pid>/maps
    listing: r-xp mappings only (read-only code, never written; their relocated data segments
    are private copies and must stay)."""
    out = []
    for line in maps_lines:
        parts = line.split(maxsplit=5)  # address perms offset dev inode path
        if (
            len(parts) == 6
            and parts[1] == "r-xp"
            and any(lib in parts[5] for lib in COMPILER_LIBRARIES)
        ):
            lo, hi = parts[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def release_compiler_code() -> int:
    """Drop this process's page mappings of clang/LLVM's code: ~44 MB that loading the
    libraries touched (their static initialisers) and that would otherwise stay in the agent's
    RSS for its lifetime (bench/startup.py). Nothing is lost: a later call into that code
    faults the pages back in from the file (the page cache). Returns the resident file-backed
    memory released, in bytes."""
    try:
        with open("/proc/self/maps") as f:
            ranges = compiler_code_ranges(f.read().splitlines())
        madvise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    before = rss_bytes("RssFile")
    for lo, hi in ranges:
        madvise(lo, hi - lo, _MADV_DONTNEED)  # a hint: a failure only leaves the pages in
    return max(0, before - rss_bytes("RssFile"))


def pmu_tlb_available() -> bool:
    """Whether a hardware dTLB-load-miss counter opens (false in most VMs)."""
    return perf_event_open_check("hw_cache", DTLB_READ_MISS) is None


# ------------------------------------------------------------------------------ rendering

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([\w.]+)"\s*$')
_CONDITIONAL = re.compile(r"^\s*#\s*(ifdef|ifndef|if|elif|else|endif)\b\s*(.*?)\s*(?:/\*.*)?$")
_DEFINED = re.compile(r"defined\s*\(\s*(\w+)\s*\)|defined\s+(\w+)")


def render_source(
    src_dir: Path, name: str, knobs: dict[str, int | None], defines: Sequence[str] = ()
) -> str:
    """`name` with its local ("...") includes inlined, the knobs #defined at the top (then
    `defines`, lines the loader needs), and every conditional on a knob resolved: the text is
    exactly what the compiler sees of ours."""
    head = [
        f"/* tracejoin: bpf/{name} as compiled: local includes inlined, knobs applied. */",
        *(f"#define {k}" if v is None else f"#define {k} {int(v)}" for k, v in knobs.items()),
        *defines,
    ]
    lines = _resolve_knobs(_inline(src_dir, name, set()), set(knobs))
    return "\n".join([*head, *lines]) + "\n"


def _inline(src_dir: Path, name: str, seen: set[str]) -> list[str]:
    if name in seen:  # a second include of the same file: its guard would make it empty
        return []
    seen.add(name)
    out: list[str] = []
    for line in (src_dir / name).read_text().splitlines():
        m = _LOCAL_INCLUDE.match(line)
        if m:
            out.append(f"/* ---- bpf/{m.group(1)} ---- */")
            out.extend(_inline(src_dir, m.group(1), seen))
            out.append(f"/* ---- end of bpf/{m.group(1)} ---- */")
        else:
            out.append(line)
    return out


def _knob_condition(kind: str, expr: str, defined: set[str]) -> bool | None:
    """The value of a conditional that tests knobs only; None when it tests anything else."""
    if kind in ("ifdef", "ifndef"):
        if expr not in KNOBS:
            return None
        return (expr in defined) == (kind == "ifdef")
    names = [a or b for a, b in _DEFINED.findall(expr)]
    if not names or any(n not in KNOBS for n in names):
        return None
    py = _DEFINED.sub(lambda m: str((m.group(1) or m.group(2)) in defined), expr)
    py = py.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
    if not re.fullmatch(r"[\s()]*((True|False|and|or|not)[\s()]*)+", py):
        return None
    return bool(eval(py, {"__builtins__": {}}))  # only True/False/and/or/not/parentheses


def _resolve_knobs(lines: list[str], defined: set[str]) -> list[str]:
    out: list[str] = []
    # one entry per open conditional: (resolved here, branch active, a branch already taken)
    stack: list[tuple[bool, bool, bool]] = []

    def emitting() -> bool:
        return all(active for resolved, active, _ in stack if resolved)

    for line in lines:
        m = _CONDITIONAL.match(line)
        if not m:
            if emitting():
                out.append(line)
            continue
        kind, expr = m.group(1), m.group(2).strip()
        if kind in ("ifdef", "ifndef", "if"):
            value = _knob_condition(kind, expr, defined)
            if value is None:
                if emitting():
                    out.append(line)
                stack.append((False, True, True))
            else:
                stack.append((True, value, value))
        elif kind == "elif":
            if stack[-1][0]:
                raise ValueError(f"#elif on a knob is not supported: {line!r}")
            if emitting():
                out.append(line)
        elif kind == "else":
            resolved, _, taken = stack[-1]
            if resolved:
                stack[-1] = (True, not taken, True)
            elif emitting():
                out.append(line)
        else:  # endif
            resolved, _, _ = stack.pop()
            if not resolved and emitting():
                out.append(line)
    if stack:
        raise ValueError("unterminated conditional in the BPF source")
    return out
