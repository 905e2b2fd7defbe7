"""The processes bench/run.py drives, and what it reads from them.

- the traced server: tests/servers/goserver (Go net/http; `/` answers in µs, `/sleep?ms=N`
  sleeps N ms), pinned to one CPU;
- the agent: the real `tracejoin run` (probes -> decode -> spans -> OTLP-JSON file on tmpfs),
  a separate process pinned to one CPU; its /metrics give the loss counters;
- load: `wrk` (closed loop, saturation) with bench/traceparent.lua, and bench/loadgen
  (`tj-loadgen rate`: open loop, constant rate); every request carries a unique traceparent;
- an unrelated process: `tj-loadgen syscall` (ns per read/write/getppid call);
- /proc: CPU time and peak RSS per process, busy time per CPU; BPF run time per program
  (kernel.bpf_stats_enabled, bpftool), for the agent's own programs only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tests.harness import CACHE, free_ports, go_server_binary

HERE = Path(__file__).parent
LOADGEN_SRC = HERE / "loadgen"
LUA = HERE / "traceparent.lua"
CLK_TCK = os.sysconf("SC_CLK_TCK")
TRACING_PROG_TYPES = {"tracepoint", "raw_tracepoint", "perf_event", "kprobe", "tracing"}

_build_lock = threading.Lock()


def loadgen_binary() -> Path:
    """bench/loadgen built once and cached beside the test server (stdlib only: no downloads)."""
    out = CACHE / "tj-loadgen"
    src = LOADGEN_SRC / "main.go"
    with _build_lock:
        if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
            CACHE.mkdir(parents=True, exist_ok=True)
            subprocess.run(["go", "build", "-o", str(out), "."], cwd=LOADGEN_SRC, check=True)
    return out


def pinned(cmd: list[str], cpu: int | None, nice: int = 0) -> list[str]:
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    return ["nice", "-n", str(nice), *cmd] if nice else cmd


def repin(pid: int, cpu: int | None) -> None:
    """Move every thread of a running process to `cpu` (None: all CPUs)."""
    cpus = set(range(os.cpu_count() or 1)) if cpu is None else {cpu}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


# ------------------------------------------------------------------------------ /proc


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads, exited ones included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def on_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of a process, to the nanosecond: its CPU-time clock (clock_gettime on
    MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)), which sums every thread's sum_exec_runtime,
    those that exited included. /proc/<pid>/stat's utime + stime is the same total rounded to
    clock ticks: 10 ms, i.e. 4 µs a record over the 2,500 records of a quick loss-curve step.
    Summing /proc/<pid>/task/*/schedstat instead drops a thread's time when it exits: the
    thread that verifies HTTP/2's programs after ready took ~2.9 s with it during a 1k req/s
    step on 2026-12-04 (-1140 µs a record). None when the process is gone."""
    clock = ((~pid) << 3) | 2  # CPUCLOCK_SCHED of the whole process (linux/posix-timers.h)
    try:
        return time.clock_gettime_ns(clock) / 1e9
    except OSError:
        return None


class Cpu(NamedTuple):
    """An agent's CPU time so far, in seconds: user and system from /proc/<pid>/stat (clock
    ticks), and their sum to the nanosecond from its CPU-time clock (on_cpu_seconds)."""

    user: float
    system: float
    on_cpu: float


def proc_status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def cpu_jiffies() -> dict[str, tuple[int, int]]:
    """Per CPU (busy, total) jiffies from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *vals = line.split()
                v = [int(x) for x in vals]
                idle = v[3] + v[4]  # idle + iowait
                out[name] = (sum(v[:8]) - idle, sum(v[:8]))
    return out


PF_KTHREAD = 0x00200000


def process_cpu_table() -> dict[int, float]:
    """CPU seconds (user+sys) of every user-space process now, by pid (kernel threads left out:
    ksoftirqd works for our own network load)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[6]) & PF_KTHREAD:
            continue
        out[int(entry)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def other_cpu_seconds(a: dict[int, float], b: dict[int, float], mine: set[int]) -> float:
    """CPU used between two process_cpu_table() snapshots by processes that are not `mine`
    (nor children of this process, which are the load generators): other people's work."""
    me = os.getpid()
    total = 0.0
    for pid, cpu in b.items():
        if pid in mine or pid == me or _ppid(pid) == me:
            continue
        total += cpu - a.get(pid, 0.0)
    return max(0.0, total)


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def busy_fraction(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> dict[str, float]:
    return {
        cpu: round((b[cpu][0] - a[cpu][0]) / max(1, b[cpu][1] - a[cpu][1]), 3)
        for cpu in a
        if cpu in b
    }


# ------------------------------------------------------------------------------ BPF stats


def own_prog_ids(pid: int) -> set[int]:
    """BPF program ids the process holds file descriptors for (from /proc/PID/fdinfo)."""
    ids = set()
    fd_dir = Path(f"/proc/{pid}/fdinfo")
    for fdinfo in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            text = fdinfo.read_text()
            m = re.search(r"^prog_id:\s*(\d+)", text, re.M)
            if m:
                ids.add(int(m.group(1)))
    return ids


def bpf_progs() -> list[dict[str, Any]]:
    """Every loaded BPF program as bpftool shows it (run_time_ns/run_cnt with stats on)."""
    out = subprocess.run(
        ["bpftool", "prog", "show", "-j"], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out or "[]")


def prog_stats(ids: set[int]) -> dict[int, dict[str, Any]]:
    return {
        p["id"]: {
            "name": p.get("name", "?"),
            "run_time_ns": int(p.get("run_time_ns", 0)),
            "run_cnt": int(p.get("run_cnt", 0)),
        }
        for p in bpf_progs()
        if p["id"] in ids
    }


def bpf_table(p0: dict, p1: dict, requests: int) -> dict[str, Any]:
    """Per program between two prog_stats() readings: hits, ns per hit, per request."""
    progs = []
    for pid, b in p1.items():
        a = p0.get(pid, {"run_time_ns": 0, "run_cnt": 0})
        cnt = b["run_cnt"] - a["run_cnt"]
        ns = b["run_time_ns"] - a["run_time_ns"]
        if cnt <= 0:
            continue
        progs.append(
            {
                "name": b["name"],
                "hits": cnt,
                "ns_per_hit": round(ns / cnt, 1),
                "hits_per_request": round(cnt / max(1, requests), 2),
                "ns_per_request": round(ns / max(1, requests), 1),
            }
        )
    progs.sort(key=lambda p: -p["ns_per_request"])
    total = sum(p["ns_per_request"] for p in progs)
    return {"requests": requests, "programs": progs, "ns_per_request": round(total, 1)}


def foreign_tracing_progs(own: set[int]) -> int:
    """Tracing programs loaded by someone else (another tracejoin under test, say): noise."""
    try:
        return sum(1 for p in bpf_progs() if p["type"] in TRACING_PROG_TYPES and p["id"] not in own)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return -1


class BpfStatsSwitch:
    """kernel.bpf_stats_enabled on for a while, then back to what it was (also on exit)."""

    PATH = Path("/proc/sys/kernel/bpf_stats_enabled")

    def __init__(self) -> None:
        self.saved: str | None = None

    def on(self) -> None:
        if self.saved is None:
            self.saved = self.PATH.read_text().strip()
        self.PATH.write_text("1\n")

    def restore(self) -> None:
        if self.saved is not None:
            with contextlib.suppress(OSError):
                self.PATH.write_text(self.saved + "\n")
            self.saved = None


# ------------------------------------------------------------------------------ processes


@contextlib.contextmanager
def go_server(port: int, cpu: int | None) -> Iterator[subprocess.Popen[str]]:
    """The Go net/http test server (GOMAXPROCS follows the pinned CPU set)."""
    proc = subprocess.Popen(
        pinned([str(go_server_binary()), str(port)], cpu), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"goserver did not start: {line!r}")
        yield proc
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def otlp_sink(cpu: int | None) -> Iterator[int]:
    """bench/otlp_sink on a free port: an OTLP/HTTP endpoint that discards. Yields the port."""
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "bench.otlp_sink", str(port)]
    proc = subprocess.Popen(pinned(cmd, cpu), stdout=subprocess.PIPE, text=True, cwd=HERE.parent)
    try:
        assert proc.stdout is not None
        if "ready" not in proc.stdout.readline():
            raise RuntimeError("the OTLP sink did not start")
        yield port
    finally:
        proc.kill()
        proc.wait()


def http2_pending(ready_line: str) -> bool:
    """`tracejoin run`'s ready line says HTTP/2's programs are verified after it..."""
    return "'http2': 'loading'" in ready_line


def http2_settled(line: str) -> bool:
    """... and this later line that they came on, or did not (agent/kernel/probes.py)."""
    return "http2 on:" in line or "signal http2 is off" in line


_WITH_CFLAGS = (
    "import json, sys; from tracejoin.kernel import probes; "
    "probes.CFLAGS = tuple(json.loads(sys.argv.pop(1))); "
    "from tracejoin.commands.cli import main; sys.argv[0] = 'tracejoin'; main()"
)


@dataclass
class AgentRun:
    """One `tracejoin run` process: start, counters, CPU, memory, stop. Spans go to an OTLP/HTTP
    endpoint (`sink_port`: protobuf, the production path) or, without one, to an OTLP-JSON file
    on tmpfs."""

    ports: list[int]
    cpu: int | None
    sink_port: int | None = None
    extra_args: list[str] = field(default_factory=list)
    # --bpf-cache: where the compiled probes are kept (None: "", compile at every start)
    bpf_cache: Path | None = None
    # the probes compiled with these flags instead of agent/kernel/probes.py's CFLAGS (A/B of
    # compiler flags, bench.agent_ab --variant cflags=...; None: the agent as it is)
    cflags: tuple[str, ...] | None = None
    proc: subprocess.Popen[str] | None = None
    startup_s: float = 0.0  # process start -> "ready" log line
    load_s: float = 0.0  # the agent's own figure: compile (or cache read) + load + attach
    bpf_source: str = ""  # "compiled" (in a child, this start) or "cache"
    scheduler: str = ""  # the agent's "scheduler: ..." log line: the CPU slice its threads ask for
    compile_s: float = 0.0  # the child's compile, when it ran
    compile_peak_mb: float = 0.0  # the compiling children's peak RSS, summed, when they ran
    # process start -> HTTP/2 on (verified after ready: its own log line; start() waits for it,
    # since the verifier's CPU is the agent's and its programs are measured too)
    http2_s: float = 0.0
    stop_s: float = 0.0
    peak_rss_kb: int = 0
    rss_kb: dict[str, int] = field(default_factory=dict)  # at stop: VmRSS, RssAnon, RssFile
    log: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 180.0) -> None:  # a loaded shared VM compiles slowly
        self._dir = Path(tempfile.mkdtemp(prefix="tjbench-", dir=_tmpfs()))
        self.spans_file = self._dir / "spans.otlp.jsonl"
        (self.metrics_port,) = free_ports(1)
        tracejoin = Path(sys.executable).parent / "tracejoin"
        cmd = [str(tracejoin), "run"]
        if self.cflags is not None:  # the same CLI, CFLAGS replaced before it imports the probes
            cmd = [sys.executable, "-c", _WITH_CFLAGS, json.dumps(self.cflags), "run"]
        if self.sink_port is None:
            cmd += ["--spans-file", str(self.spans_file)]
        else:
            endpoint = f"http://127.0.0.1:{self.sink_port}"
            cmd += ["--otlp-endpoint", endpoint, "--otlp-protocol", "http/protobuf"]
        cmd += ["--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1"]
        for p in self.ports:
            cmd += ["--port", str(p)]
        cmd += ["--bpf-cache", str(self.bpf_cache or "")]
        ready, http2 = threading.Event(), threading.Event()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            pinned(cmd + self.extra_args, self.cpu),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            # the OTEL_* variables of whoever runs the bench must not redirect the spans
            env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        )

        def read_log() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                c = re.search(
                    r"compiled in (?:a child process|\d+ child processes at once) in ([\d.]+)s"
                    r" \(peaks? (\d+) MiB",
                    line,
                )
                if c:
                    self.bpf_source = "compiled"
                    self.compile_s, self.compile_peak_mb = float(c.group(1)), float(c.group(2))
                elif "compiled programs from the cache" in line:
                    self.bpf_source = "cache"
                elif (sched := re.search(r"scheduler: (.*)", line)) and not self.scheduler:
                    self.scheduler = sched.group(1)
                m = re.search(r"ready: probes loaded in ([\d.]+)s", line)
                if m and not ready.is_set():
                    self.startup_s = time.monotonic() - t0
                    self.load_s = float(m.group(1))
                    ready.set()
                    if not http2_pending(line):  # --http2-before-ready
                        self.http2_s = self.startup_s
                        http2.set()
                elif ready.is_set() and http2_settled(line) and not http2.is_set():
                    self.http2_s = time.monotonic() - t0
                    http2.set()

        threading.Thread(target=read_log, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not (ready.wait(0.05) and http2.wait(0.05)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("tracejoin run did not get ready:\n" + "\n".join(self.log))
        self.prog_ids = own_prog_ids(self.proc.pid)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def metrics(self) -> dict[str, float]:
        """Counters from /metrics, summed over their labels (name without the prefix)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0].removeprefix("tracejoin_").removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def cpu_split(self) -> Cpu:
        user, system = cpu_seconds(self.pid)
        exact = on_cpu_seconds(self.pid)
        return Cpu(user, system, user + system if exact is None else exact)

    def wait_drained(self, before: dict[str, float], timeout_s: float = 8.0) -> dict[str, float]:
        """Wait until the agent has read what the kernel submitted since `before` (or stops
        making progress); return the counters then."""
        deadline = time.monotonic() + timeout_s
        last = -1.0
        while True:
            m = self.metrics()
            d = delta(before, m)
            want = d.get("kernel_records_submitted", 0) - d.get("kernel_ringbuf_full", 0)
            got = d.get("records_received", 0)
            # /metrics renders with 6 significant digits: allow that rounding
            if got >= want - max(2.0, 2e-6 * m.get("records_received", 0)) and got == last:
                return m
            if time.monotonic() > deadline:
                return m
            last = got
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.peak_rss_kb = max(self.peak_rss_kb, proc_status_kb(self.proc.pid, "VmHWM"))
            for key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                self.rss_kb[key] = proc_status_kb(self.proc.pid, key)
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stop_s = time.monotonic() - t0
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def agent_beside_go_server() -> Iterator[tuple[int, AgentRun]]:
    """The one-off tools' placement, as bench.run's: the Go test server alone on CPU1, the
    OTLP sink and a started `tracejoin run` on CPU0. Yields (the server's port, the agent);
    stops both."""
    (port,) = free_ports(1)
    with go_server(port, 1), otlp_sink(0) as sink:
        agent = AgentRun([port], 0, sink_port=sink)
        agent.start()
        try:
            yield port, agent
        finally:
            agent.stop()


@dataclass(frozen=True)
class ProbeSource:
    """What a compile of the probes is made from: a bpf/ source tree (this one's or another
    checkout's) and the compiler flags (None: this tree's agent/kernel/probes.py CFLAGS)."""

    src: Path
    cflags: tuple[str, ...] | None = None


@contextlib.contextmanager
def probes_from(source: ProbeSource, ports: tuple[int, ...]) -> Iterator[None]:
    """The probes compiled from `source`, loaded in this process with a port filter, their
    records read and dropped by a thread; unloaded after. For the tools that compare sources
    or flags in one run (--against, --against-cflags)."""
    from tracejoin.core.metrics import Metrics
    from tracejoin.kernel import probes

    original = probes.bpf_source_dir, probes.CFLAGS
    probes.bpf_source_dir = lambda: source.src  # type: ignore[assignment]
    if source.cflags is not None:
        probes.CFLAGS = source.cflags
    try:
        p = probes.HttpProbes(probes.ProbeConfig(ports=ports), Metrics())
        p.start()
    finally:
        probes.bpf_source_dir, probes.CFLAGS = original  # type: ignore[assignment]
    stop = threading.Event()
    reader = threading.Thread(target=lambda: [p.poll(50) for _ in iter(stop.is_set, True)])
    reader.start()
    try:
        yield
    finally:
        stop.set()
        reader.join()
        p.shutdown()


def add_against(ap: Any) -> None:
    """--against DIR and --against-cflags FLAGS (each repeatable) on an argparse parser: bpf/
    trees, and compiler flags for this tree's, to compare with this tree as it is."""
    ap.add_argument(
        "--against",
        type=Path,
        action="append",
        default=[],
        help="another bpf/ source directory to compare (repeatable)",
    )
    ap.add_argument(
        "--against-cflags",
        action="append",
        default=[],
        metavar="FLAGS",
        help="this tree's sources compiled with these flags instead of CFLAGS, as one "
        "argument: --against-cflags=-Wno-macro-redefined (repeatable)",
    )


def source_trees(against: list[Path], against_cflags: Sequence[str] = ()) -> dict[str, ProbeSource]:
    """{label: what to compile}: this tree's first, then each --against, each --against-cflags."""
    import shlex

    from tracejoin.kernel import probes

    here = probes.bpf_source_dir()
    return {
        "this tree": ProbeSource(here),
        **{str(d): ProbeSource(d) for d in against},
        **{f"cflags {f!r}": ProbeSource(here, tuple(shlex.split(f))) for f in against_cflags},
    }


def _tmpfs() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0.0) for k in b}


# ------------------------------------------------------------------------------ load


def wrk(
    port: int, path: str, conns: int, seconds: int, cpu: int | None, nice: int = 0
) -> dict[str, Any]:
    """Closed loop, as fast as the server answers: `conns` keep-alive connections, 1 thread."""
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "-s", str(LUA)]
    cmd.append(f"http://127.0.0.1:{port}{path}")
    out = subprocess.run(pinned(cmd, cpu, nice), capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("JSON "):
            r: dict[str, Any] = json.loads(line[5:])
            r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
            r["completed"] = r["requests"]
            r["requests_total"] = r["requests"]
            return r
    raise RuntimeError(f"wrk printed no summary:\n{out}")


def rate(
    port: int,
    path: str,
    rps: float,
    seconds: float,
    conns: int,
    cpu: int | None,
    warmup_s: float = 0.5,
    nice: int = 0,
    unsampled: bool = False,
) -> dict[str, Any]:
    """Open loop at a constant rate (bench/loadgen): latency counted from each due time.
    `unsampled`: every traceparent's sampled flag clear."""
    cmd = [str(loadgen_binary()), "rate", "-addr", f"127.0.0.1:{port}", "-path", path]
    cmd += ["-rate", f"{rps:.0f}", "-duration", f"{seconds}s", "-conns", str(conns)]
    cmd += ["-warmup", f"{warmup_s}s"] + (["-unsampled"] if unsampled else [])
    out = subprocess.run(pinned(cmd, cpu, nice), capture_output=True, text=True, check=True).stdout
    r: dict[str, Any] = json.loads(out)
    r["rps"] = r["achieved_rps"]
    r["requests_total"] = r["total_sent"]  # the warm-up's requests are traced too
    return r


def syscalls(n: int, rounds: int, cpu: int | None) -> dict[str, Any]:
    cmd = [str(loadgen_binary()), "syscall", "-n", str(n), "-rounds", str(rounds)]
    out = subprocess.run(pinned(cmd, cpu), capture_output=True, text=True, check=True).stdout
    r: dict[str, Any] = json.loads(out)
    return r
