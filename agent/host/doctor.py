"""`tracejoin doctor`: what this host lets tracejoin measure, and what to do where it can't.

Two layers:
  * checks: one fact each about the host (capabilities, tracefs, one tracepoint, a perf event,
    kernel headers, a trial BPF load, NVML), status available / unavailable, with a fix hint;
  * signals: what tracejoin offers (HTTP request spans, receive-queue wait, TLB misses, GPU ...),
    derived from the checks: available, fallback (naming the substitute), or unavailable (why).

The exit code is 0 when the core pipeline can run: privileges, tracefs, every required
tracepoint and a trial compile-load-attach of a BPF program. Optional signals only degrade.

Everything host-specific can be pointed elsewhere through `DoctorOptions` (a fake sysroot, fake
perf_event_open / BPF trial / NVML callables), so the decision logic is testable without root.
"""

from __future__ import annotations

import errno
import os
import platform
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from tracejoin.host.scheduling import Slice, probe_slice
from tracejoin.kernel import probes
from tracejoin.kernel.compiled import DEFAULT_CACHE_DIR
from tracejoin.kernel.features import FeatureResult, probe_features
from tracejoin.kernel.perf import (
    PERF_COUNT_HW_CACHE_DTLB,
    PERF_COUNT_HW_CACHE_ITLB,
    PERF_COUNT_HW_CACHE_OP_READ,
    PERF_COUNT_HW_CACHE_RESULT_MISS,
    PERF_COUNT_SW_CPU_CLOCK,
    PERF_TYPE_HW_CACHE,
    PERF_TYPE_SOFTWARE,
    errno_text,
    hw_cache_config,
    perf_event_open,
)

# One source of truth: the tracepoints the probes attach to, and the signal each feeds.
REQUIRED_TRACEPOINTS: tuple[str, ...] = probes.REQUIRED_TRACEPOINTS
OPTIONAL_TRACEPOINTS: tuple[str, ...] = probes.OPTIONAL_TRACEPOINTS
# Tracepoints not listed here (a list passed in) become a signal of their own name.
OPTIONAL_SIGNALS: dict[str, str] = {
    tp: sig.what for sig in probes.OPTIONAL_SIGNALS for tp in sig.tracepoints
}

CORE_SIGNAL = "HTTP request spans"
TLB_SIGNAL = "TLB misses (hardware counters)"
TLB_FALLBACK_TRACEPOINT = "tlb:tlb_flush"
TLB_HW_NEEDS = "sched:sched_switch"  # the hardware path reads the counters at each switch
TLB_FALLBACK = "tlb:tlb_flush counts, exported as tracejoin.tlb.flushes, not misses"
FIX_SETUP = "run `make setup` as root"


class Status(StrEnum):
    AVAILABLE = "available"
    FALLBACK = "fallback"
    UNAVAILABLE = "unavailable"


@dataclass
class Check:
    """One fact about the host."""

    name: str
    group: str
    status: Status
    detail: str
    required: bool = False  # the core pipeline cannot run without it
    fix: str | None = None
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    short: str | None = None  # the reason as the one-line summary puts it; default: detail

    @property
    def ok(self) -> bool:
        return self.status is Status.AVAILABLE

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "status": str(self.status),
            "required": self.required,
            "detail": self.detail,
            "fix": self.fix,
            "notes": list(self.notes),
            "data": dict(self.data),
        }


@dataclass
class Signal:
    """Something tracejoin measures, and whether this host gives it."""

    name: str
    status: Status
    detail: str
    required: bool = False
    sources: list[str] = field(default_factory=list)  # the check names it depends on
    fallback: str | None = None
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": str(self.status),
            "required": self.required,
            "detail": self.detail,
            "sources": list(self.sources),
            "fallback": self.fallback,
            "fix": self.fix,
        }


# --- injectable host interfaces ------------------------------------------------------------

# perf_event_open(type, config) -> (fd, 0) or (-1, errno); the callee closes nothing.
PerfOpen = Callable[[int, int], tuple[int, int]]


@dataclass
class ProbeResult:
    """Outcome of an active probe (BPF trial load, NVML)."""

    ok: bool
    detail: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DoctorOptions:
    required_tracepoints: Sequence[str] = REQUIRED_TRACEPOINTS
    optional_tracepoints: Sequence[str] = OPTIONAL_TRACEPOINTS
    # Treated as absent, to rehearse a kernel that lacks them ("category:name").
    disabled_tracepoints: AbstractSet[str] = frozenset()
    sysroot: Path = Path("/")  # where /proc, /sys and /lib/modules are read from
    release: str | None = None  # kernel release; default os.uname().release
    perf_open: PerfOpen | None = None  # default: the real perf_event_open(2)
    bpf_trial: Callable[[], ProbeResult] | None = None  # default: bpf_trial_load
    nvml_probe: Callable[[], ProbeResult] | None = None  # default: nvml_status
    cpu_slice: Callable[[float | None], Slice] | None = None  # default: probe_slice
    bpf_features: Callable[[], list[FeatureResult]] | None = None  # default: probe_features
    bpf_cache: Path = DEFAULT_CACHE_DIR  # --bpf-cache


# --- a running agent --------------------------------------------------------------------------

_GAUGE = re.compile(
    r"^tracejoin_(sampling_ratio|agent_cpu_share|kernel_sampled_out_budget_total) (\S+)$", re.M
)


def running_agent(
    port: int, host: str = "127.0.0.1", timeout_s: float = 0.5
) -> dict[str, float] | None:
    """The overload budget's state of the agent serving /metrics on host:port (in the agent's
    pod, `kubectl exec ... tracejoin doctor` reaches it there): its sampling ratio, its CPU share
    and what it shed. None when no agent answers."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as r:
            text = r.read(1 << 20).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    found = {name: float(value) for name, value in _GAUGE.findall(text)}
    return found if "sampling_ratio" in found else None


def running_agent_text(port: int, state: dict[str, float] | None) -> str:
    if state is None:
        return f"Running agent: none answering on 127.0.0.1:{port} (its sampling ratio shows here)"
    return (
        f"Running agent (127.0.0.1:{port}): sampling ratio {state['sampling_ratio']:.4g} "
        f"(CPU budget), agent at {state.get('agent_cpu_share', 0.0):.2f} of a CPU, "
        f"{int(state.get('kernel_sampled_out_budget_total', 0))} requests sampled out"
    )


# --- the report ----------------------------------------------------------------------------


@dataclass
class Report:
    checks: list[Check]
    signals: list[Signal]
    kernel_release: str
    machine: str = field(default_factory=platform.machine)
    duration_s: float = 0.0

    @property
    def blocking(self) -> list[Check]:
        """Required checks that failed: each one stops the core pipeline."""
        return [c for c in self.checks if c.required and not c.ok]

    @property
    def degraded(self) -> list[Signal]:
        return [s for s in self.signals if not s.required and s.status is not Status.AVAILABLE]

    @property
    def ok(self) -> bool:
        return not self.blocking

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    @property
    def summary_line(self) -> str:
        if not self.ok:
            return "NOT READY: " + _blocking_reason(self.blocking)
        if not self.degraded:
            return "ready: the core pipeline can run and every signal is available"
        parts = [
            f"{s.name} -> fallback: {s.fallback}" if s.fallback else f"{s.name} {s.status}"
            for s in self.degraded
        ]
        return "ready: the core pipeline can run; degraded: " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "summary": self.summary_line,
            "kernel": {"release": self.kernel_release, "machine": self.machine},
            "signals": [s.to_json() for s in self.signals],
            "checks": [c.to_json() for c in self.checks],
            "duration_s": round(self.duration_s, 3),
        }

    def format_text(self) -> str:
        lines = [self.summary_line, ""]
        names = [c.name for c in self.checks] + [s.name for s in self.signals]
        width = max(len(n) for n in names)
        lines.append("Signals")
        for s in self.signals:
            detail = s.detail + (f"; fallback: {s.fallback}" if s.fallback else "")
            lines.append(_row(s.status, s.name, detail, width, s.required))
            if s.fix and s.status is not Status.AVAILABLE:
                lines.append(_hint("fix", s.fix, width))
        group = None
        for c in self.checks:
            if c.group != group:
                group = c.group
                lines += ["", group]
            lines.append(_row(c.status, c.name, c.detail, width, c.required))
            lines += [_hint("note", n, width) for n in c.notes]
            if c.fix and not c.ok:
                lines.append(_hint("fix", c.fix, width))
        return "\n".join(lines) + "\n"


_STATUS_WIDTH = len("unavailable") + 1


def _row(status: Status, name: str, detail: str, width: int, required: bool) -> str:
    # A failed required item is shouted, so it stands out among optional ones.
    shown = str(status).upper() if required and status is not Status.AVAILABLE else str(status)
    return f"  {shown:<{_STATUS_WIDTH}} {name:<{width}}  {detail}"


def _hint(kind: str, text: str, width: int) -> str:
    return f"  {'':<{_STATUS_WIDTH}} {'':<{width}}  {kind}: {text}"


_SUMMARY_PART_MAX = 160
_SUMMARY_TRACEPOINTS_MAX = 4


def _blocking_reason(blocking: list[Check]) -> str:
    """One line: each blocking check's short reason, tracepoints folded into one list."""
    names = {c.name for c in blocking}
    tps = [c.data["tracepoint"] for c in blocking if "tracepoint" in c.data]
    others = [c for c in blocking if "tracepoint" not in c.data]
    parts = [_clip(f"{c.name}: {c.short or c.detail}") for c in others]
    if tps and "tracefs" in names:
        parts.append("required tracepoints unreadable without tracefs")
    elif tps:
        noun = "tracepoint" if len(tps) == 1 else "tracepoints"
        shown = ", ".join(tps[:_SUMMARY_TRACEPOINTS_MAX])
        more = len(tps) - _SUMMARY_TRACEPOINTS_MAX
        parts.append(f"required {noun} missing: {shown}" + (f" (+{more} more)" if more > 0 else ""))
    return "; ".join(parts)


def _clip(text: str) -> str:
    return text if len(text) <= _SUMMARY_PART_MAX else text[: _SUMMARY_PART_MAX - 1] + "…"


# --- entry point ---------------------------------------------------------------------------


def run_checks(options: DoctorOptions | None = None) -> Report:
    opts = options or DoctorOptions()
    t0 = time.monotonic()
    release = opts.release or os.uname().release
    root = opts.sysroot
    kver = kernel_version(release)
    tracefs, tracefs_check = check_tracefs(root)
    checks = [check_privileges(root, kver), check_kernel_release(release), tracefs_check]
    checks.append(check_btf(root))
    checks += check_tracepoints(tracefs, opts.required_tracepoints, True, opts.disabled_tracepoints)
    checks += check_tracepoints(
        tracefs, opts.optional_tracepoints, False, opts.disabled_tracepoints
    )
    checks += check_perf_events(root, opts.perf_open or perf_event_open)
    checks += [check_uprobes(root, tracefs), check_kprobes(root, tracefs)]
    checks += check_bpf_features(opts.bpf_features or probe_features)
    checks += [
        check_headers(root, release),
        check_bpf_cache(opts.bpf_cache),
        check_ring_reader(),
        check_traceparent_reader(),
        check_span_encoder(),
        check_request_framing(),
        check_cpu_slice(opts.cpu_slice or probe_slice),
    ]
    checks.append(_from_probe("bpf trial load", "BPF", True, opts.bpf_trial or bpf_trial_load))
    checks.append(_from_probe("nvml", "GPU", False, opts.nvml_probe or nvml_status))
    checks.append(check_cuda(root))
    signals = derive_signals(checks, opts)
    return Report(checks, signals, release, duration_s=time.monotonic() - t0)


def check_cuda(root: Path) -> Check:
    """The CUDA libraries processes map now (what `--cuda` would probe), and what could not be
    probed, with why. Optional, and only informative: a library mapped later is found then."""
    from tracejoin.kernel.cuda import discover

    try:
        files, notes = discover(probes.bpf_source_dir() / "cuda.h", root / "proc")
    except Exception as e:  # never crash a doctor on one process's odd files
        return Check("cuda libraries", "GPU", Status.UNAVAILABLE, f"scan failed: {e}")
    ok = [f for f in files if not f.error]
    lines = [
        f"{f.path} ({f.kind}): "
        + (f"{len(f.symbols)} probed calls" if not f.error else f"not probeable: {f.error}")
        + f"; pids {', '.join(str(p) for p in sorted(f.pids)[:8])}"
        for f in files
    ]
    lines += [f"pid {pid}: {why}" for pid, why in sorted(notes.items())]
    data = {
        "files": [
            {"path": f.path, "kind": f.kind, "calls": list(f.symbols), "error": f.error}
            for f in files
        ],
        "not_probeable": {str(pid): why for pid, why in notes.items()},
    }
    if not files:
        detail = "no process maps libcudart or libcuda now (--cuda finds them when they do)"
        return Check("cuda libraries", "GPU", Status.UNAVAILABLE, detail, notes=lines, data=data)
    status = Status.AVAILABLE if ok else Status.UNAVAILABLE
    detail = f"{len(ok)} of {len(files)} CUDA files probeable with --cuda"
    return Check("cuda libraries", "GPU", status, detail, notes=lines, data=data)


def check_bpf_cache(path: Path) -> Check:
    """Whether starts keep the compiled probes and load them (docs/operations.md, "The BPF
    cache"); without it every start compiles, which works, slower."""
    from tracejoin.kernel.compiled import cache_state

    problem, entries = cache_state(path)
    if problem is not None:
        return Check(
            "bpf cache",
            "Build",
            Status.FALLBACK,
            f"{problem}: every start compiles, in child processes (seconds)",
            fix=f"make {path} a directory owned by root, mode 0700 (or mount it writable)",
            data={"path": str(path)},
        )
    if not entries:
        detail = f"{path}: nothing kept yet; the next start compiles and keeps its programs"
    else:
        age = time.time() - entries[0].stat().st_mtime
        detail = f"{path}: {len(entries)} kept, the most recent used {_ago(age)} ago"
    data = {"path": str(path), "entries": len(entries)}
    return Check("bpf cache", "Build", Status.AVAILABLE, detail, data=data)


def _ago(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def check_span_encoder() -> Check:
    """Which encoder writes the server spans' bytes: the compiled one, or the pure-Python
    fallback an install without a C compiler gets (the same bytes, more CPU per span)."""
    from tracejoin.pipeline import span_bytes

    return _compiled_or_fallback(
        "span encoder",
        span_bytes.COMPILED,
        "compiled encoder (_span_bytes.c): the common request's span from the ring's bytes, a "
        "batch a call; the server span of the others",
        "pure-Python encoder: the install had no C compiler; the same spans, more agent CPU per "
        "span (docs/performance.md)",
    )


def check_request_framing() -> Check:
    """How the OTLP exporter frames a request around its spans and takes them off its queue:
    one C call a batch, or Python per span."""
    from tracejoin.exporters import otlp_proto

    return _compiled_or_fallback(
        "otlp request framing",
        otlp_proto.COMPILED,
        "compiled (_request_bytes.c): a batch taken off the queue and framed in one call each",
        "Python per span: the install had no C compiler; the same requests, more exporter CPU "
        "per span (docs/performance.md)",
    )


def check_ring_reader() -> Check:
    """How the records ring is read: the compiled consumer, or BCC's reader (one Python
    callback per record) that an install without a C compiler gets."""
    from tracejoin.kernel import ring

    return _compiled_or_fallback(
        "ring reader",
        ring.COMPILED,
        "compiled consumer (_ring_read.c)",
        "BCC's reader, one Python callback per record: the install had no C compiler; the "
        "same records, more agent CPU per record (docs/performance.md)",
    )


def check_traceparent_reader() -> Check:
    """How a record's traceparent is read: the compiled common case (one plain valid value read
    from the record), or traceparent.parse for every record."""
    from tracejoin.enrich import correlate

    return _compiled_or_fallback(
        "traceparent reader",
        correlate.COMPILED,
        "compiled common case (_trace_context.c); the W3C rules in Python for the rest",
        "Python for every traceparent: the install had no C compiler; the same trace "
        "contexts, more agent CPU per record (docs/performance.md)",
    )


def check_cpu_slice(request: Callable[[float | None], Slice]) -> Check:
    """Whether this kernel gives the agent's threads the longer slice they ask for by default
    (--cpu-slice-ms), so that a workload thread that wakes on their CPU preempts them: asked
    on a thread of the doctor's own, for itself."""
    got = request(None)
    if got.honoured:
        detail = (
            f"a {got.requested_ms:g} ms slice, twice the kernel's default "
            f"({got.default_ns / 1e6:g} ms), is honoured: a workload thread that wakes on the "
            "agent's CPU runs at once"
        )
        return Check("cpu slice", "Kernel", Status.AVAILABLE, detail)
    return Check(
        "cpu slice",
        "Kernel",
        Status.FALLBACK,
        got.describe(),
        fix="nothing to do: the agent runs with the kernel's default slice (Linux 6.12+ "
        "honours a requested one; a seccomp profile must allow sched_getattr and sched_setattr)",
    )


def _compiled_or_fallback(name: str, compiled: bool, built: str, fallback: str) -> Check:
    """A compiled hot path's check: built, or the Python fallback with the fix."""
    if compiled:
        return Check(name, "Build", Status.AVAILABLE, built)
    fix = "reinstall with gcc and python3-dev present (scripts/setup.sh installs them)"
    return Check(name, "Build", Status.FALLBACK, fallback, fix=fix)


def _from_probe(name: str, group: str, required: bool, probe: Callable[[], ProbeResult]) -> Check:
    try:
        r = probe()
    except Exception as e:  # a doctor reports a broken probe; it never crashes on one
        r = ProbeResult(False, f"probe raised {type(e).__name__}: {e}")
    status = Status.AVAILABLE if r.ok else Status.UNAVAILABLE
    return Check(name, group, status, r.detail, required, fix=r.fix, data=r.data)


# --- privileges ----------------------------------------------------------------------------

CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_PERFMON = 38
CAP_BPF = 39

CAP_NAMES = {
    CAP_DAC_OVERRIDE: "CAP_DAC_OVERRIDE",
    CAP_DAC_READ_SEARCH: "CAP_DAC_READ_SEARCH",
    CAP_SYS_ADMIN: "CAP_SYS_ADMIN",
    CAP_SYS_RESOURCE: "CAP_SYS_RESOURCE",
    CAP_PERFMON: "CAP_PERFMON",
    CAP_BPF: "CAP_BPF",
}


def decode_caps(hex_mask: str) -> set[int]:
    """Capability numbers set in a /proc/<pid>/status Cap* hex mask."""
    mask = int(hex_mask, 16)
    return {bit for bit in range(mask.bit_length()) if mask >> bit & 1}


def parse_status(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def kernel_version(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def missing_capabilities() -> list[str]:
    """What this process lacks to load and attach the probes (empty: nothing)."""
    try:
        status = parse_status(Path("/proc/self/status").read_text())
        caps = decode_caps(status["CapEff"])
        euid = int(status["Uid"].split()[1])
    except (OSError, KeyError, ValueError, IndexError) as e:
        return [f"unknown (cannot read /proc/self/status: {e})"]
    return _privilege_gaps(caps, euid, kernel_version(os.uname().release))[0]


def check_privileges(root: Path, kver: tuple[int, int]) -> Check:
    """CapEff decides, not the uid: a root uid in a container can lack CAP_BPF."""
    try:
        status = parse_status((root / "proc/self/status").read_text())
        caps = decode_caps(status["CapEff"])
        euid = int(status["Uid"].split()[1])
    except (OSError, KeyError, ValueError, IndexError) as e:
        return Check(
            "privileges",
            "Privileges",
            Status.UNAVAILABLE,
            f"cannot read CapEff/Uid from /proc/self/status: {e}",
            required=True,
        )
    missing, notes = _privilege_gaps(caps, euid, kver)
    data = {
        "euid": euid,
        "cap_eff": status["CapEff"],
        "caps": sorted(CAP_NAMES[c] for c in caps if c in CAP_NAMES),
    }
    who = "root (uid 0)" if euid == 0 else f"uid {euid}"
    if missing:
        return Check(
            "privileges",
            "Privileges",
            Status.UNAVAILABLE,
            f"{who} lacks " + "; ".join(missing),
            short=f"{who} lacks " + ", ".join(m.split(" (")[0] for m in missing),
            required=True,
            fix="run as root, or grant CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH and "
            "CAP_SYS_PTRACE (the DaemonSet in deploy/ does; see docs/operations.md)",
            notes=notes,
            data=data,
        )
    have = ", ".join(n for c, n in sorted(CAP_NAMES.items()) if c in caps)
    return Check(
        "privileges",
        "Privileges",
        Status.AVAILABLE,
        f"{who}; effective: {have}",
        required=True,
        notes=notes,
        data=data,
    )


def _privilege_gaps(
    caps: set[int], euid: int, kver: tuple[int, int]
) -> tuple[list[str], list[str]]:
    """(what is missing and what for, explanatory notes). Kernel rules: bpf_capable() is CAP_BPF
    or CAP_SYS_ADMIN and perfmon_capable() is CAP_PERFMON or CAP_SYS_ADMIN since 5.8; before
    5.8 only CAP_SYS_ADMIN loads tracing programs. Since 5.11 BPF memory is charged to the
    memory cgroup; before, to RLIMIT_MEMLOCK, which libbcc raises on EPERM (CAP_SYS_RESOURCE)."""
    missing: list[str] = []
    notes: list[str] = []
    admin = CAP_SYS_ADMIN in caps
    if kver < (5, 8):
        if not admin:
            missing.append(f"CAP_SYS_ADMIN (kernel {kver[0]}.{kver[1]} < 5.8 has no CAP_BPF)")
    else:
        if CAP_BPF not in caps and not admin:
            missing.append("CAP_BPF (load BPF programs, create maps)")
        if CAP_PERFMON not in caps and not admin:
            missing.append("CAP_PERFMON (attach tracepoints and perf events system-wide)")
        if admin:
            notes.append(
                "CAP_SYS_ADMIN: not needed on kernel >= 5.8 given CAP_BPF + CAP_PERFMON; "
                "only to mount tracefs when it is not mounted"
            )
    if euid != 0 and not caps & {CAP_DAC_READ_SEARCH, CAP_DAC_OVERRIDE}:
        missing.append("CAP_DAC_READ_SEARCH (tracefs is root-only: tracepoint formats and ids)")
    if CAP_SYS_RESOURCE not in caps:
        if kver >= (5, 11):
            notes.append(
                f"CAP_SYS_RESOURCE absent: not needed, kernel {kver[0]}.{kver[1]} >= 5.11 "
                "charges BPF memory to the memory cgroup, not RLIMIT_MEMLOCK"
            )
        elif _memlock_unlimited():
            notes.append("CAP_SYS_RESOURCE absent: not needed, RLIMIT_MEMLOCK is unlimited")
        else:
            missing.append(
                f"CAP_SYS_RESOURCE (kernel {kver[0]}.{kver[1]} < 5.11 charges BPF maps to "
                "RLIMIT_MEMLOCK; or raise it: ulimit -l unlimited)"
            )
    return missing, notes


def _memlock_unlimited() -> bool:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft == resource.RLIM_INFINITY


# --- kernel interfaces ---------------------------------------------------------------------


def check_kernel_release(release: str) -> Check:
    """The release against tracejoin's minimum. Informational: the tracepoint checks decide,
    since a distribution kernel may carry the tracepoints as a backport."""
    kver = kernel_version(release)
    data = {"release": release, "minimum": probes.MIN_KERNEL_TEXT}
    if kver >= probes.MIN_KERNEL:
        detail = f"{release} (tracejoin needs >= {probes.MIN_KERNEL_TEXT})"
        return Check("kernel release", "Kernel", Status.AVAILABLE, detail, data=data)
    return Check(
        "kernel release",
        "Kernel",
        Status.UNAVAILABLE,
        f"{release} is older than {probes.MIN_KERNEL_TEXT}, the first release with "
        f"{probes.MIN_KERNEL_WHY}; the tracepoint checks below say whether this kernel has them",
        fix=f"kernel >= {probes.MIN_KERNEL_TEXT}",
        data=data,
    )


TRACEFS_CANDIDATES = ("sys/kernel/tracing", "sys/kernel/debug/tracing")


def check_tracefs(root: Path) -> tuple[Path | None, Check]:
    tried = []
    for rel in TRACEFS_CANDIDATES:
        path = root / rel
        tried.append(f"/{rel}")
        try:
            if (path / "events").is_dir() and os.listdir(path / "events"):
                return path, Check("tracefs", "Kernel", Status.AVAILABLE, f"/{rel}", required=True)
        except PermissionError:
            return None, Check(
                "tracefs",
                "Kernel",
                Status.UNAVAILABLE,
                f"/{rel} is not readable (permission denied)",
                required=True,
                fix="run as root (tracefs is mode 0700)",
            )
    return None, Check(
        "tracefs",
        "Kernel",
        Status.UNAVAILABLE,
        f"not mounted (no events/ under {' or '.join(tried)})",
        required=True,
        fix="mount -t tracefs tracefs /sys/kernel/tracing (`make setup` does this)",
    )


def check_btf(root: Path) -> Check:
    path = root / "sys/kernel/btf/vmlinux"
    if path.is_file():
        size = path.stat().st_size
        return Check(
            "btf", "Kernel", Status.AVAILABLE, f"/sys/kernel/btf/vmlinux ({size // 1024} KiB)"
        )
    return Check(
        "btf",
        "Kernel",
        Status.UNAVAILABLE,
        "no /sys/kernel/btf/vmlinux; the probes cannot load without it: they read the current "
        "task's saved registers (bpf_get_current_task_btf, bpf_task_pt_regs), and the work set "
        "reads task_struct offsets from it",
        required=True,
        fix="a kernel built with CONFIG_DEBUG_INFO_BTF=y",
    )


def check_tracepoints(
    tracefs: Path | None,
    names: Sequence[str],
    required: bool,
    disabled: AbstractSet[str],
) -> list[Check]:
    group = "Tracepoints (required)" if required else "Tracepoints (optional)"
    return [_tracepoint(tracefs, tp, required, disabled, group) for tp in names]


def _tracepoint(
    tracefs: Path | None, tp: str, required: bool, disabled: AbstractSet[str], group: str
) -> Check:
    category, _, event = tp.partition(":")
    data = {"tracepoint": tp}
    name = f"tracepoint {tp}"
    lost = "tracejoin cannot run without it" if required else f"loses {_signal_of(tp)}"
    if tp in disabled:
        detail = f"disabled (simulated missing); {lost}"
        return Check(name, group, Status.UNAVAILABLE, detail, required, data=data)
    if tracefs is None:
        return Check(name, group, Status.UNAVAILABLE, "tracefs unavailable", required, data=data)
    fmt = tracefs / "events" / category / event / "format"
    try:
        with open(fmt, "rb") as f:
            f.read(1)
    except OSError as e:
        reason = errno.errorcode.get(e.errno or 0, str(e.errno))
        return Check(
            name,
            group,
            Status.UNAVAILABLE,
            f"events/{category}/{event}/format not readable ({reason}); {lost}",
            required,
            fix=_tracepoint_fix(category, tp),
            data=data,
        )
    return Check(name, group, Status.AVAILABLE, "present", required, data=data)


def _tracepoint_fix(category: str, tp: str = "") -> str:
    if tp in probes.MIN_KERNEL_TRACEPOINTS:
        return f"kernel >= {probes.MIN_KERNEL_TEXT}: {probes.MIN_KERNEL_WHY}"
    if category == "syscalls":
        return "a kernel built with CONFIG_FTRACE_SYSCALLS=y"
    return f"a kernel that has this {category} tracepoint (newer kernel, or its config option)"


def _signal_of(tp: str) -> str:
    return OPTIONAL_SIGNALS.get(tp, tp)


# --- perf events ---------------------------------------------------------------------------

HW_TLB_EVENTS = {
    "dTLB-load-misses": hw_cache_config(
        PERF_COUNT_HW_CACHE_DTLB, PERF_COUNT_HW_CACHE_OP_READ, PERF_COUNT_HW_CACHE_RESULT_MISS
    ),
    "iTLB-load-misses": hw_cache_config(
        PERF_COUNT_HW_CACHE_ITLB, PERF_COUNT_HW_CACHE_OP_READ, PERF_COUNT_HW_CACHE_RESULT_MISS
    ),
}


def check_perf_events(root: Path, perf_open: PerfOpen) -> list[Check]:
    fd, err = perf_open(PERF_TYPE_SOFTWARE, PERF_COUNT_SW_CPU_CLOCK)
    if fd >= 0:
        sw = Check(
            "software perf events", "Perf events", Status.AVAILABLE, "cpu-clock opened on cpu 0"
        )
    else:
        sw = Check(
            "software perf events",
            "Perf events",
            Status.UNAVAILABLE,
            f"cpu-clock on cpu 0: {errno_text(err)}",
            fix="CAP_PERFMON, or kernel.perf_event_paranoid <= 0",
        )
    return [sw] + [_hw_check(root, name, cfg, perf_open) for name, cfg in HW_TLB_EVENTS.items()]


def _has_cpu_pmu(root: Path) -> bool:
    devices = root / "sys/bus/event_source/devices"
    return any((devices / d).exists() for d in ("cpu", "cpu_core", "cpu_atom", "armv8_pmuv3"))


def _hw_check(root: Path, name: str, config: int, perf_open: PerfOpen) -> Check:
    fd, err = perf_open(PERF_TYPE_HW_CACHE, config)
    data: dict[str, Any] = {"type": PERF_TYPE_HW_CACHE, "config": config}
    if fd >= 0:
        return Check(f"hw {name}", "Perf events", Status.AVAILABLE, "opened on cpu 0", data=data)
    data["errno"] = errno.errorcode.get(err, str(err))
    if err in (errno.EACCES, errno.EPERM):
        why, fix = "permission denied", "CAP_PERFMON, or kernel.perf_event_paranoid <= 0"
    elif not _has_cpu_pmu(root) or err in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV):
        why = "no hardware PMU"
        fix = "bare metal, or a VM with the PMU exposed (vPMU; QEMU/KVM: -cpu host,pmu=on)"
    else:
        why, fix = "cannot open", "check `perf stat -e " + name + "`"
    return Check(
        f"hw {name}",
        "Perf events",
        Status.UNAVAILABLE,
        f"{why}: {errno_text(err)}",
        fix=fix,
        data=data,
    )


# --- uprobes / kprobes ---------------------------------------------------------------------


def check_uprobes(root: Path, tracefs: Path | None) -> Check:
    pmu = (root / "sys/bus/event_source/devices/uprobe").exists()
    events = tracefs is not None and (tracefs / "uprobe_events").exists()
    if pmu:
        extra = ", tracefs uprobe_events" if events else ""
        detail = f"perf PMU /sys/bus/event_source/devices/uprobe{extra}"
        return Check("uprobes", "Probe types", Status.AVAILABLE, detail)
    return Check(
        "uprobes",
        "Probe types",
        Status.UNAVAILABLE,
        "no /sys/bus/event_source/devices/uprobe",
        fix="a kernel built with CONFIG_UPROBE_EVENTS=y",
    )


def check_kprobes(root: Path, tracefs: Path | None) -> Check:
    """Reported for completeness: tracejoin never uses kprobes (design principle 1)."""
    pmu = (root / "sys/bus/event_source/devices/kprobe").exists()
    events = tracefs is not None and (tracefs / "kprobe_events").exists()
    found = [what for what, ok in (("kprobe PMU", pmu), ("tracefs kprobe_events", events)) if ok]
    not_needed = "not needed: tracejoin attaches only to tracepoints, perf events and uprobes"
    status = Status.AVAILABLE if found else Status.UNAVAILABLE
    detail = (", ".join(found) if found else "absent") + f"; {not_needed}"
    return Check("kprobes", "Probe types", status, detail, data={"needed": False})


# --- BPF features --------------------------------------------------------------------------


def check_bpf_features(probe: Callable[[], list[FeatureResult]]) -> list[Check]:
    try:
        results = probe()
    except Exception as e:  # a doctor reports a broken probe; it never crashes on one
        return [Check("bpf features", "BPF features", Status.UNAVAILABLE, f"probe raised {e!r}")]
    out = []
    for r in results:
        f = r.feature
        use = f"used by {f.used}" if f.used else "not used by tracejoin's programs yet"
        data = {"feature": f.name, "since": f.since, "used": f.used, "available": r.available}
        if r.available:
            status, detail, fix = Status.AVAILABLE, f"{r.detail}; {use}", None
        else:
            status, detail = Status.UNAVAILABLE, f"{r.detail}; {use}"
            fix = None if r.available is None else f"kernel >= {f.since}"
        # "cannot tell" (no permission) never blocks: the privileges check says why
        required = f.required and r.available is not None
        out.append(
            Check(f"bpf {f.name}", "BPF features", status, detail, required, fix=fix, data=data)
        )
    return out


# --- kernel headers ------------------------------------------------------------------------


def headers_version(build: Path) -> str | None:
    """The kernel release the headers are for: utsrelease.h, else the directory's name."""
    try:
        text = (build / "include/generated/utsrelease.h").read_text()
        m = re.search(r'UTS_RELEASE\s+"([^"]+)"', text)
        if m:
            return m.group(1)
    except OSError:
        pass
    m = re.match(r"linux-headers-(.+)", build.resolve().name)
    return m.group(1) if m else None


def check_headers(root: Path, release: str) -> Check:
    build = root / "lib/modules" / release / "build"
    shown = f"/lib/modules/{release}/build"
    fix = (
        "install linux-headers-$(uname -r); on Debian VMs without them, `make setup` links "
        "linux-headers-amd64"
    )
    if not build.exists():
        what = "is a dangling link" if build.is_symlink() else "is missing"
        return Check(
            "kernel headers",
            "Build",
            Status.UNAVAILABLE,
            f"{shown} {what}; BCC cannot compile the probes",
            fix=fix,
        )
    target = build.resolve()
    version = headers_version(build)
    match = version == release
    data = {"path": shown, "target": str(target), "version": version, "match": match}
    if match:
        detail = f"present, {target}, match the running kernel {release}"
    else:
        detail = (
            f"present ({target}), {version or 'unknown version'} headers, do not match running "
            f"{release}; OK because probes read only tracepoint arguments and fields at the "
            "offsets the running kernel's BTF gives"
        )
    return Check("kernel headers", "Build", Status.AVAILABLE, detail, data=data)


# --- BPF trial load ------------------------------------------------------------------------

# Counts this process's getppid() calls: proves compile, load, attach and map reads all work.
TRIAL_PROGRAM = r"""
BPF_ARRAY(hits, u64, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if ((bpf_get_current_pid_tgid() >> 32) != TRIAL_TGID)
        return 0;
    int key = 0;
    u64 *count = hits.lookup(&key);
    if (count)
        __sync_fetch_and_add(count, 1);
    return 0;
}
"""

BPF_FIX = "install python3-bpfcc and linux-headers-amd64 (or matching headers): run `make setup`"


def bpf_trial_load() -> ProbeResult:
    try:
        from bcc import BPF
    except Exception as e:  # ImportError, or libbcc.so failing to load (OSError)
        return ProbeResult(False, f"cannot import bcc: {type(e).__name__}: {e}", BPF_FIX)
    t0 = time.monotonic()
    err: Exception | None = None
    with _Fd2Capture() as stderr:
        try:
            bpf = BPF(text=TRIAL_PROGRAM.encode(), cflags=[f"-DTRIAL_TGID={os.getpid()}"])
        except Exception as e:  # bcc raises bare Exception on compile/load failure
            err = e
    if err is not None:
        tail = _bcc_errors(stderr.text())
        return ProbeResult(
            False, f"compile/load failed: {err}" + (f" ({tail})" if tail else ""), BPF_FIX
        )
    try:
        load_s = time.monotonic() - t0
        calls = 3
        for _ in range(calls):
            os.getppid()
        count = int(bpf[b"hits"][0].value)
    finally:
        bpf.cleanup()
    data = {"load_s": round(load_s, 3), "calls": calls, "counted": count}
    if count < 1:
        return ProbeResult(
            False,
            f"loaded and attached, but counted {count} of {calls} getppid calls",
            "check that syscalls:sys_enter_getppid fires (CONFIG_FTRACE_SYSCALLS)",
            data,
        )
    detail = (
        f"TRACEPOINT_PROBE on syscalls:sys_enter_getppid compiled and loaded in {load_s:.2f} s, "
        f"counted {count} of {calls} calls"
    )
    return ProbeResult(True, detail, data=data)


def _bcc_errors(text: str) -> str:
    """The lines of libbcc's stderr that say what went wrong (clang also prints warnings)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return " | ".join((errors or lines)[-3:])


class _Fd2Capture:
    """Redirect file descriptors 2 and 1 into a temp file: libbcc prints compile errors on 2,
    and "Unable to find kernel headers" on 1, which would corrupt `doctor --json` (found by the
    kernel matrix, on a guest without headers)."""

    def __enter__(self) -> _Fd2Capture:
        sys.stdout.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = [os.dup(2), os.dup(1)]
        os.dup2(self._file.fileno(), 2)
        os.dup2(self._file.fileno(), 1)
        return self

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved[0], 2)
        os.dup2(self._saved[1], 1)
        for fd in self._saved:
            os.close(fd)

    def text(self) -> str:
        self._file.seek(0)
        data = self._file.read().decode(errors="replace")
        self._file.close()
        return data


# --- NVML ----------------------------------------------------------------------------------

NVML_FIX = "an NVIDIA GPU with its driver (libnvidia-ml.so.1); without a GPU this stays off"


def nvml_status() -> ProbeResult:
    """What the GPU sampler's own probe says about NVML on this host."""
    from tracejoin.enrich.gpu_sampler import probe_nvml

    return _from_gpu_probe(probe_nvml())


def _field(obj: Any, *names: str) -> Any:
    """The first of `names` present (and not None) as a key or attribute of obj."""
    for n in names:
        value = obj.get(n) if isinstance(obj, dict) else getattr(obj, n, None)
        if value is not None:
            return value
    return None


def _from_gpu_probe(result: Any) -> ProbeResult:
    """Adapt probe_nvml()'s status (tracejoin.enrich.gpu_sampler.NvmlStatus: available, reason, fix,
    driver_version, gpus[].name, notes), reading fields by name so a dict also works."""
    if isinstance(result, ProbeResult):
        return result
    gpus = _field(result, "gpus", "devices") or []
    ok = _field(result, "available", "ok")
    ok = bool(gpus) if ok is None else bool(ok)
    names = [str(_field(g, "name") or g) for g in gpus]
    driver = _field(result, "driver_version")
    data: dict[str, Any] = {"gpus": names, "driver": driver}
    notes = [str(n) for n in _field(result, "notes") or []]
    if notes:
        data["notes"] = notes
    if ok:
        found = f"{len(names)} GPU(s): {', '.join(names)}" if names else "NVML initialised"
        return ProbeResult(True, (f"driver {driver}, " if driver else "") + found, data=data)
    reason = _field(result, "reason", "error", "detail") or "NVML unavailable"
    return ProbeResult(False, str(reason), str(_field(result, "fix") or NVML_FIX), data)


# --- signals -------------------------------------------------------------------------------


def derive_signals(checks: list[Check], opts: DoctorOptions) -> list[Signal]:
    by_name = {c.name: c for c in checks}
    out = [_core_signal(checks)]
    out += [
        _needs_btf(s, by_name["btf"])
        for s in _tracepoint_signals(by_name, opts.optional_tracepoints)
    ]
    out.append(_tlb_signal(by_name))
    out.append(_single("software perf events (cpu-clock)", by_name["software perf events"]))
    out.append(_single("uprobes", by_name["uprobes"]))
    out.append(_single("GPU (NVML)", by_name["nvml"]))
    return out


def _core_signal(checks: list[Check]) -> Signal:
    required = [c for c in checks if c.required]
    failed = [c for c in required if not c.ok]
    sources = [c.name for c in required]
    if not failed:
        n_tp = sum(1 for c in required if "tracepoint" in c.data)
        detail = f"privileges, tracefs, {n_tp} required tracepoints, BPF trial load"
        return Signal(CORE_SIGNAL, Status.AVAILABLE, detail, True, sources)
    fix = next((c.fix for c in failed if c.fix), None)
    return Signal(CORE_SIGNAL, Status.UNAVAILABLE, _blocking_reason(failed), True, sources, fix=fix)


def _tracepoint_signals(by_name: dict[str, Check], optional: Sequence[str]) -> list[Signal]:
    groups: dict[str, list[str]] = {}
    for tp in optional:
        groups.setdefault(_signal_of(tp), []).append(tp)
    out = []
    for signal, tps in groups.items():
        checks = [by_name[f"tracepoint {tp}"] for tp in tps]
        missing = [c.data["tracepoint"] for c in checks if not c.ok]
        sources = [c.name for c in checks]
        if not missing:
            out.append(Signal(signal, Status.AVAILABLE, "via " + ", ".join(tps), False, sources))
            continue
        fix = next((c.fix for c in checks if c.fix and not c.ok), None)
        detail = "missing " + ", ".join(missing)
        out.append(Signal(signal, Status.UNAVAILABLE, detail, False, sources, fix=fix))
    return out


def _needs_btf(signal: Signal, btf: Check) -> Signal:
    """The work set reads a woken task's flags and process at offsets from the kernel's BTF."""
    workset = next(sig.what for sig in probes.OPTIONAL_SIGNALS if sig.name == "workset")
    if signal.name != workset or btf.ok or signal.status is not Status.AVAILABLE:
        return signal
    return Signal(
        signal.name, Status.UNAVAILABLE, btf.detail, False, [*signal.sources, btf.name], fix=btf.fix
    )


def _tlb_signal(by_name: dict[str, Check]) -> Signal:
    hw = [by_name[f"hw {n}"] for n in HW_TLB_EVENTS]
    flush = by_name.get(f"tracepoint {TLB_FALLBACK_TRACEPOINT}")
    # The counters are per CPU: a thread's share needs a read at each of its context switches.
    sched = by_name.get(f"tracepoint {TLB_HW_NEEDS}")
    sources = (
        [c.name for c in hw] + ([sched.name] if sched else []) + ([flush.name] if flush else [])
    )
    failed = [c for c in hw if not c.ok]
    if not failed and sched is not None and sched.ok:
        detail = "dTLB-load-misses, iTLB-load-misses per thread"
        return Signal(TLB_SIGNAL, Status.AVAILABLE, detail, False, sources)
    if not failed:
        why = f"hardware counters open, but {TLB_HW_NEEDS} is missing: they are read at each switch"
        fix = sched.fix if sched is not None else None
    elif len({c.detail for c in failed}) == 1:  # the usual case: one cause for both counters
        why = ", ".join(c.name.removeprefix("hw ") for c in failed) + ": " + failed[0].detail
        fix = next((c.fix for c in hw if c.fix), None)
    else:
        why = "; ".join(f"{c.name.removeprefix('hw ')}: {c.detail}" for c in failed)
        fix = next((c.fix for c in hw if c.fix), None)
    if flush is not None and flush.ok:
        return Signal(
            TLB_SIGNAL, Status.FALLBACK, why, False, sources, fallback=TLB_FALLBACK, fix=fix
        )
    no_flush = f"; {TLB_FALLBACK_TRACEPOINT} fallback missing too" if flush else ""
    return Signal(TLB_SIGNAL, Status.UNAVAILABLE, why + no_flush, False, sources, fix=fix)


def _single(signal: str, check: Check) -> Signal:
    return Signal(signal, check.status, check.detail, False, [check.name], fix=check.fix)
