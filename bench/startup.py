"""Where start-up time and memory go, step by step, in one process as `tracejoin run` does it.

    sudo .venv/bin/python -m bench.startup [--runs 3]

Each run is a fresh interpreter (a child of this one) that does what HttpProbes.start() does,
timing each step and reading /proc/self/status after it: VmHWM (peak RSS so far), RssAnon,
RssFile. BPF() is split into the clang/LLVM compile (its own time) and the kernel verifier
(every load_func, timed through a wrapper; BCC's autoload calls load_func too). The last row
is the same process after malloc_trim(0), which hands LLVM's freed heap back to the kernel.
Requires root (it loads the real programs); prints a table of medians over the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import ctypes, json, os, sys, time
t_exec = float(sys.argv[1])
rows = []
def mark(step, t0):
    st = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmHWM", "RssAnon", "RssFile"):
            st[k] = int(v.split()[0]) // 1024
    rows.append((step, time.monotonic() - t0, st))
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
orig = BPF.load_func
def timed(self, *a, **k):
    t0 = time.monotonic()
    try:
        return orig(self, *a, **k)
    finally:
        verify[0] += time.monotonic() - t0
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
class Reuse(BPF):  # bpf is no Reuse, so __init__ (the compile) is not run again
    def __new__(cls, *a, **k):
        return bpf
bcc.BPF = Reuse
p2 = HttpProbes(ProbeConfig(), Metrics())
t = time.monotonic()
p2.start()
bcc.BPF = BPF
t = mark("rest of start(): tail-call loads, perf events, ring buffer", t)
libc = ctypes.CDLL("libc.so.6")
libc.malloc_trim(0)
t = mark("after malloc_trim(0)", t)
bpf.cleanup()
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
    return [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
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
