"""Where start-up time and memory go, step by step, in one process as `tracejoin run` does it.

    sudo .venv/bin/python -m bench.startup [--runs 3]          # the steps, in one process
    sudo .venv/bin/python -m bench.startup --agent [--runs 3]  # `tracejoin run` starts
    sudo .venv/bin/python -m bench.startup --verify [--runs 3] # tail-call loads, 1 by 1 or not
    sudo .venv/bin/python -m bench.startup --agent-http2 [--runs 3]  # ready before/after HTTP/2

Each run is a fresh interpreter (a child of this one) that does what HttpProbes.start() does,
timing each step and reading /proc/self/status after it: VmHWM (peak RSS so far), RssAnon,
RssFile. BPF() is split into the clang/LLVM compile (its own time) and the kernel verifier
(every load_func, timed through a wrapper; BCC's autoload calls load_func too). The two
`release_*` rows are what start() does after the compile: malloc_trim(0), which hands LLVM's
freed heap back to the kernel, and unmapping clang/LLVM's code (agent/kernel/probes.py).
Requires root (it loads the real programs); prints a table of medians over the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from bench.measure import http2_pending, http2_settled

_CHILD = r"""
import ctypes, json, os, sys, time
t_exec = float(sys.argv[1])
rows = []
def status():
    st = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "RssAnon", "RssFile"):
            st[k] = int(v.split()[0]) // 1024
    return st
def mark(step, t0):
    rows.append((step, time.monotonic() - t0, status()))
    return time.monotonic()
t = time.monotonic()
rows.append(("interpreter up (exec -> here)", time.time() - t_exec, {}))
t = time.monotonic()
import tracejoin.app  # noqa: what `tracejoin run` imports before it starts anything
t = mark("import tracejoin.app", t)
from bcc import BPF
t = mark("import bcc (maps libbcc + LLVM/clang)", t)
from tracejoin.core.metrics import Metrics
from tracejoin.kernel.probes import HttpProbes, ProbeConfig
p = HttpProbes(ProbeConfig(), Metrics())
knobs = p.plan()
src, cflags = p.render(knobs)
t = mark(f"plan + render ({len(src)} bytes of C)", t)
verify = [0.0]
per_prog, hwm = {}, {}
orig = BPF.load_func
def timed(self, name, *a, **k):
    t0 = time.monotonic()
    try:
        return orig(self, name, *a, **k)
    finally:
        verify[0] += time.monotonic() - t0
        per_prog[name] = per_prog.get(name, 0.0) + time.monotonic() - t0
        hwm[name] = status()
BPF.load_func = timed
t1 = time.monotonic()
bpf = BPF(text=src.encode(), cflags=cflags)
whole = time.monotonic() - t1
t = mark("BPF(): compile (clang + LLVM) + autoload", t1)
rows[-1] = ("BPF(): clang front end + LLVM codegen", whole - verify[0], rows[-1][2])
rows.append(("BPF(): verifier + attach of autoloaded tracepoints", verify[0], {}))
# the rest of HttpProbes.start() (tail-call loads, perf events, ring buffer) on the object
# just compiled: start() with BPF() handing it back instead of compiling again
import bcc
import tracejoin.kernel.probes as probes
class Reuse(BPF):  # bpf is no Reuse, so __init__ (the compile) is not run again
    def __new__(cls, *a, **k):
        return bpf
bcc.BPF = Reuse
p2 = HttpProbes(ProbeConfig(), Metrics())
p2.plan = lambda: knobs  # planned above (a second BTF parse would add its own peak)
# done below, as their own steps
probes.release_freed_heap = probes.release_compiler_code = lambda: 0
t = time.monotonic()
p2.start()
bcc.BPF = BPF
t = mark("rest of start(): tail-call loads, perf events, ring buffer", t)
libc = ctypes.CDLL("libc.so.6")
libc.malloc_trim(0)
t = mark("release_freed_heap(): malloc_trim(0)", t)
for lo, hi in probes.compiler_code_ranges(open("/proc/self/maps").read().splitlines()):
    libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)
t = mark("release_compiler_code(): clang/LLVM code unmapped", t)
bpf.cleanup()
for name, secs in sorted(per_prog.items(), key=lambda kv: -kv[1])[:4]:
    rows.append((f"  of which load_func({name.decode()})", secs, hwm[name]))
t = time.monotonic()
BPF(text=b"int empty(void *ctx) { return 0; }").cleanup()
t = mark("BCC's fixed cost: compile an empty program", t)
print(json.dumps(rows))
"""


def one_run() -> list[tuple[str, float, dict[str, int]]]:
    import time

    out = subprocess.run(
        [sys.executable, "-c", _CHILD, repr(time.time())],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(f"the measuring child failed:\n{out.stderr}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return [(str(step), float(secs), dict(st)) for step, secs, st in rows]


# `tracejoin run` itself; with no-trim, the same code with the two releases switched off; any
# further arguments are tracejoin run's
_AGENT = r"""
import sys
if sys.argv[1] == "no-trim":
    import tracejoin.kernel.probes as p
    p.release_freed_heap = p.release_compiler_code = lambda: 0
from tracejoin.commands.cli import main
sys.argv = ["tracejoin", "run", "--spans-file", "/dev/null", "--metrics-port", "0", *sys.argv[2:]]
main()
"""


def verify_split(rounds: int) -> None:
    """The tail-call programs' loads (the verifier) one after another vs all at once (the
    agent's load_programs, as start() calls it: one thread per CPU), alternating, on one
    compiled module (each load verifies the program again)."""
    import os
    import time

    from bcc import BPF
    from tracejoin.core.metrics import Metrics
    from tracejoin.kernel.probes import HttpProbes, ProbeConfig, load_programs

    p = HttpProbes(ProbeConfig(), Metrics())
    src, cflags = p.render()
    bpf = BPF(text=src.encode(), cflags=cflags)
    progs = [("scan_req", BPF.TRACEPOINT), ("scan_resp", BPF.TRACEPOINT)]
    progs += [("run_notes", BPF.TRACEPOINT), ("ws_wake_prog", BPF.RAW_TRACEPOINT)]

    def fresh() -> None:  # forget the loaded programs, so the next load verifies again
        for name, _ in progs:
            fn = bpf.funcs.pop(name.encode(), None)
            if fn is not None:
                os.close(fn.fd)

    times: dict[str, list[float]] = {"one after another": [], "all at once": []}
    try:
        for _ in range(rounds):
            for label, how in (
                ("one after another", lambda: load_programs(bpf, progs, 1)),
                ("all at once", lambda: load_programs(bpf, progs, os.cpu_count() or 1)),
            ):
                fresh()
                t0 = time.monotonic()
                how()
                times[label].append(time.monotonic() - t0)
    finally:
        fresh()
        bpf.cleanup()
    print(f"tail-call loads ({', '.join(n for n, _ in progs)}), {os.cpu_count()} CPUs")
    for label, ts in times.items():
        print(f"  {label:18s} median {statistics.median(ts):.2f} s  {[round(t, 2) for t in ts]}")


def _status_mb(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) // 1024
    return out


def agent_start(trim: bool, *flags: str) -> tuple[float, dict[str, int], float]:
    """Seconds from exec to the `ready:` log line of `tracejoin run`, its memory 2 s after
    ready (VmHWM is the peak so far), and seconds from exec to HTTP/2 on (its `http2 on` log
    line, or ready when ready waited for it)."""
    import signal
    import time

    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _AGENT, "trim" if trim else "no-trim", *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "ready:" in line:
                ready = time.monotonic() - t0
                break
        else:
            sys.exit("tracejoin run exited before it was ready")
        http2 = ready
        if http2_pending(line):
            for line in proc.stderr:
                if http2_settled(line):
                    http2 = time.monotonic() - t0
                    break
        time.sleep(2)
        return ready, _status_mb(proc.pid), http2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--agent", action="store_true", help="time `tracejoin run` starts, releases on/off"
    )
    ap.add_argument(
        "--verify", action="store_true", help="tail-call loads: sequential vs concurrent"
    )
    ap.add_argument(
        "--agent-http2",
        action="store_true",
        help="time `tracejoin run` starts: HTTP/2 verified after ready (default) vs before",
    )
    args = ap.parse_args()
    if args.agent_http2:
        print("| tracejoin run | exec -> ready, s | exec -> HTTP/2 on, s | VmHWM |")
        print("|---|---:|---:|---:|")
        for _ in range(args.runs):  # alternating, so that drift in load hits both alike
            for flags in ((), ("--http2-before-ready",)):
                secs, st, h2 = agent_start(True, *flags)
                label = " ".join(flags) or "(default: HTTP/2 after ready)"
                print(f"| {label} | {secs:.2f} | {h2:.2f} | {st['VmHWM']} |", flush=True)
        return
    if args.verify:
        verify_split(args.runs)
        return
    if args.agent:
        print("| tracejoin run | exec -> ready, s | VmHWM | RssAnon | RssFile |")
        print("|---|---:|---:|---:|---:|")
        for trim in (False, True):
            for _ in range(args.runs):
                secs, st, _ = agent_start(trim)
                label = "heap and code released" if trim else "without the releases"
                print(
                    f"| {label} | {secs:.2f} | {st['VmHWM']} | {st['RssAnon']} | {st['RssFile']} |"
                )
        return
    runs = [one_run() for _ in range(args.runs)]
    print(f"median of {args.runs} runs; MB = MiB from /proc/self/status after the step")
    print("| step | seconds | VmHWM | RssAnon | RssFile |")
    print("|---|---:|---:|---:|---:|")
    for i, (step, _, _) in enumerate(runs[0]):
        secs = statistics.median(r[i][1] for r in runs)
        st = runs[-1][i][2]
        cells = [str(st[k]) if k in st else "" for k in ("VmHWM", "RssAnon", "RssFile")]
        print(f"| {step} | {secs:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
