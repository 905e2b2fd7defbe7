"""Where the traced server's CPU goes in the kernel side: a sampled profile of its CPU at
saturation with the probes loaded.

    sudo .venv/bin/python -m bench.kernel_profile [--seconds 6] [--conns 32]

The Go test server alone on CPU1, wrk (a unique traceparent per request) and this process on
CPU0, the probes loaded here (port filter on the server; records read and dropped). After a
2-second warm-up, `perf record -C 1 -F 4999 -g` samples CPU1 while wrk runs on; the stacks are
sorted into: each BPF program that was entered (its tail calls and helpers included), where
inside them the sample landed (a program's own code or the kernel function it called), the map
operations inside them, and the classic tracepoints' dispatch outside any program (the perf
trace record, `trace_call_bpf`, `perf_syscall_exit`). Percentages are of CPU1's samples.
cpu-clock sampling cannot land where interrupts are off, so programs that run there (the
scheduler's) are not seen: `bench.run`'s BPF table has those. Needs `perf` (Debian:
linux-perf); not part of `make bench`.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tracejoin.kernel import probes

from bench import measure as m
from tests.harness import free_ports

SERVER_CPU, LOAD_CPU = 1, 0
_PROG = re.compile(r"^bpf_prog_[0-9a-f]+_")
_MAP_OPS = ("htab", "lru", "lookup_nulls", "prealloc", "memcmp", "jhash")
_DISPATCH = (
    "trace_call_bpf",
    "perf_syscall_exit",
    "perf_trace_run_bpf_submit",
    "perf_trace_buf_alloc",
)


def stacks(perf_data: Path) -> list[list[str]]:
    """Each sample's stack, leaf first, as symbol names."""
    out = subprocess.run(
        ["perf", "script", "-i", str(perf_data), "-F", "ip,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got: list[list[str]] = []
    cur: list[str] = []
    for line in out.splitlines():
        line = line.strip()
        if not line:
            if cur:
                got.append(cur)
                cur = []
            continue
        parts = line.split(None, 1)
        cur.append(parts[1] if len(parts) > 1 else "?")
    if cur:
        got.append(cur)
    return got


def breakdown(samples: list[list[str]]) -> dict[str, collections.Counter[str]]:
    """Sample counts: by the BPF program entered (outermost), by map operation, and by the
    tracepoint dispatch outside programs."""
    entered: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    maps: collections.Counter[str] = collections.Counter()
    dispatch: collections.Counter[str] = collections.Counter()
    for st in samples:
        progs = [s for s in st if _PROG.match(s)]
        if progs:
            entered[_PROG.sub("", progs[-1])] += 1
            leaves[_PROG.sub("", st[0]) + ("" if _PROG.match(st[0]) else " (helper)")] += 1
            if any(k in st[0] for k in _MAP_OPS):
                op = next((s for s in st if s.startswith(("htab_", "__htab"))), st[0])
                maps[op] += 1
        elif st[0] in _DISPATCH or st[0].startswith("perf_trace_"):
            dispatch[st[0]] += 1
    return {"entered": entered, "leaves": leaves, "maps": maps, "dispatch": dispatch}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=6, help="sampled seconds")
    ap.add_argument("--conns", type=int, default=32, help="wrk connections")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        print("bench.kernel_profile needs perf (Debian: apt install linux-perf)", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {LOAD_CPU})
    (port,) = free_ports(1)
    with tempfile.TemporaryDirectory(prefix="tjprof-") as tmp:
        data = Path(tmp) / "perf.data"
        with (
            m.go_server(port, SERVER_CPU),
            m.probes_from(m.ProbeSource(probes.bpf_source_dir()), (port,)),
        ):
            load = threading.Thread(
                target=m.wrk, args=(port, "/", args.conns, args.seconds + 3, LOAD_CPU, -10)
            )
            load.start()
            time.sleep(2.0)
            record = ["perf", "record", "-q", "-F", "4999", "-C", str(SERVER_CPU), "-g"]
            record += ["-o", str(data), "--", "sleep", str(args.seconds)]
            subprocess.run(record, check=True, capture_output=True)
            load.join()
        samples = stacks(data)
    n = max(1, len(samples))
    parts = breakdown(samples)
    in_progs = sum(parts["entered"].values())
    in_dispatch = sum(parts["dispatch"].values())
    print(f"CPU{SERVER_CPU} (the server), {len(samples):,} samples over {args.seconds} s at wrk")
    print(f"saturation: BPF programs {100 * in_progs / n:.1f} %, classic tracepoint dispatch")
    print(f"outside them {100 * in_dispatch / n:.1f} %")
    print("by the program entered (its tail calls, callbacks and helpers included):")
    for name, c in parts["entered"].most_common(16):
        print(f"  {100 * c / n:5.2f} %  {name}")
    print("where it lands: a program's own instructions, or the kernel function it called:")
    for name, c in parts["leaves"].most_common(16):
        print(f"  {100 * c / n:5.2f} %  {name}")
    print(f"map operations inside programs: {100 * sum(parts['maps'].values()) / n:.2f} %")
    for name, c in parts["maps"].most_common(6):
        print(f"  {100 * c / n:5.2f} %  {name}")
    print("dispatch outside programs:")
    for name, c in parts["dispatch"].most_common(8):
        print(f"  {100 * c / n:5.2f} %  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
