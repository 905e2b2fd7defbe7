"""Where start-up time and memory go, step by step, in one process as `tracejoin run` does it.

    sudo .venv/bin/python -m bench.startup [--runs 3]          # the steps, in one process
    sudo .venv/bin/python -m bench.startup --agent [--runs 3]  # `tracejoin run` starts
    sudo .venv/bin/python -m bench.startup --verify [--runs 3] # tail-call loads, 1 by 1 or not
    sudo .venv/bin/python -m bench.startup --agent-http2 [--runs 3]  # ready before/after HTTP/2

Each run is two fresh interpreters (children of this one) doing what HttpProbes.start() does,
timing each step and reading /proc/self/status after it: VmHWM (peak RSS so far), RssAnon,
RssFile. The first finds an empty cache of compiled programs (a first start on a node: child
processes compile, HTTP/2's programs beside the rest, agent/kernel/compiled.py), the second the
entry the first kept (every later start). Each step is timed through a wrapper around the
function start() calls for it; `--agent` times `tracejoin run` itself, exec to ready, on an
empty cache and then on the one it kept.
Requires root (it loads the real programs); prints a table of medians over the runs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench.measure import http2_pending, http2_settled

_CHILD = r"""
import json, sys, time
from pathlib import Path
t_exec, cache = float(sys.argv[1]), Path(sys.argv[2])
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
rows.append(("interpreter up (exec -> here)", time.time() - t_exec, {}))
t = time.monotonic()
import tracejoin.app  # noqa: what `tracejoin run` imports before it starts anything
t = mark("import tracejoin.app", t)
from bcc import BPF
t = mark("import bcc (maps libbcc + LLVM/clang)", t)
from tracejoin.core.metrics import Metrics
from tracejoin.kernel import compiled, probes
from tracejoin.kernel.probes import HttpProbes, ProbeConfig
# as tracejoin run: HTTP/2's programs verify after start() returns (not timed here)
p = HttpProbes(ProbeConfig(bpf_cache_dir=cache, http2_after_ready=True), Metrics())
knobs = p.plan()
src, cflags = p.render(knobs)
t = mark(f"plan + render ({len(src)} bytes of C)", t)
p.plan = lambda: knobs  # start() below: planned above
spent = {}
def timed(label, fn):
    def wrapper(*a, **k):
        t0 = time.monotonic()
        try:
            return fn(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.monotonic() - t0
            spent[label + " mem"] = status()
    return wrapper
obtain, cached_bpf = compiled.obtain, compiled.cached_bpf
got = {}
def obtain_kept(*a, **k):
    got["it"] = obtain(*a, **k)
    return got["it"]
compiled.obtain = timed("obtain", obtain_kept)
def made(entry):
    bpf = cached_bpf(entry)
    bpf.autoload = timed("autoload", bpf.autoload)
    return bpf
compiled.cached_bpf = timed("maps", made)
release = probes.release_compiler_code
probes.release_compiler_code = timed("release", release)
t0 = time.monotonic()
p.start()
whole = time.monotonic() - t0
o = got["it"]
what = (
    "cache: read the entry"
    if o.source == "cache"
    else f"compile in child processes (peaks summed {o.compile_peak_bytes >> 20} MiB)"
)
rows.append((what, spent["obtain"], spent["obtain mem"]))
rows.append(("create the maps", spent["maps"], spent["maps mem"]))
rest = whole - spent["obtain"] - spent["maps"] - spent["autoload"] - spent["release"]
rows.append(("verify every HTTP/1.x program at once; perf events, ring", rest, status()))
rows.append(("autoload: attach the tracepoint programs", spent["autoload"], {}))
rows.append(("release_compiler_code(): clang/LLVM code unmapped", spent["release"], status()))
rows.append(("start() in all", whole, {}))
while p.loading:  # HTTP/2's compile and load, after ready: the cache keeps the entry once done
    time.sleep(0.05)
p.shutdown()
print(json.dumps(rows))
"""


def one_run(cache: str) -> list[tuple[str, float, dict[str, int]]]:
    import time

    out = subprocess.run(
        [sys.executable, "-c", _CHILD, repr(time.time()), cache],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(f"the measuring child failed:\n{out.stderr}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return [(str(step), float(secs), dict(st)) for step, secs, st in rows]


# `tracejoin run` itself; any arguments are tracejoin run's
_AGENT = r"""
import sys
from tracejoin.commands.cli import main
sys.argv = ["tracejoin", "run", "--spans-file", "/dev/null", "--metrics-port", "0", *sys.argv[1:]]
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
    from tracejoin.kernel import compiled
    from tracejoin.kernel.probes import HttpProbes, ProbeConfig, load_programs

    p = HttpProbes(ProbeConfig(), Metrics())
    src, cflags = p.render()
    bpf = compiled.cached_bpf(compiled._compile_here(src, cflags, "verify_split"))
    progs = [("scan_req", BPF.TRACEPOINT), ("scan_resp", BPF.TRACEPOINT)]
    progs += [("run_notes", BPF.TRACEPOINT), ("ws_wake_prog", BPF.RAW_TRACEPOINT)]
    progs += [("ws_wake_more", BPF.RAW_TRACEPOINT)]

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


def agent_start(*flags: str) -> tuple[float, dict[str, int], float, str]:
    """Seconds from exec to the `ready:` log line of `tracejoin run`, its memory 2 s after
    ready (VmHWM is the peak so far), seconds from exec to HTTP/2 on (its `http2 on` log line,
    or ready when ready waited for it), and how it got its programs (its log line)."""
    import signal
    import time

    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", _AGENT, *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    how = ""
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"probes loaded in [\d.]+s: (.*)", line)
            if m:
                how = re.sub(r" \(/.*|, kept in .*", "", m.group(1))
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
        return ready, _status_mb(proc.pid), http2, how
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
                secs, st, h2, _ = agent_start(*flags)
                label = " ".join(flags) or "(default: HTTP/2 after ready)"
                print(f"| {label} | {secs:.2f} | {h2:.2f} | {st['VmHWM']} |", flush=True)
        return
    if args.verify:
        verify_split(args.runs)
        return
    if args.agent:
        print("| tracejoin run | exec -> ready, s | VmHWM | RssAnon | RssFile |")
        print("|---|---:|---:|---:|---:|")
        for _ in range(args.runs):  # a first start on an empty cache, then one that loads it
            cache = tempfile.mkdtemp(prefix="tjstart-")
            try:
                for _ in range(2):
                    secs, st, _, how = agent_start("--bpf-cache", cache)
                    cells = f"{st['VmHWM']} | {st['RssAnon']} | {st['RssFile']}"
                    print(f"| {how} | {secs:.2f} | {cells} |", flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        return
    for label, warm in (("first start on a node: empty cache", False), ("cache kept", True)):
        runs = []
        for _ in range(args.runs):
            cache = tempfile.mkdtemp(prefix="tjstart-")
            try:
                if warm:
                    one_run(cache)  # fills it
                runs.append(one_run(cache))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        print(f"\n{label}: median of {args.runs} runs; MB = MiB from /proc/self/status after it")
        print("| step | seconds | VmHWM | RssAnon | RssFile |")
        print("|---|---:|---:|---:|---:|")
        for i, (step, _, _) in enumerate(runs[0]):
            secs = statistics.median(r[i][1] for r in runs)
            st = runs[-1][i][2]
            row = [str(st[k]) if k in st else "" for k in ("VmHWM", "RssAnon", "RssFile")]
            print(f"| {step} | {secs:.2f} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
