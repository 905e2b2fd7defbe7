"""What following the work costs, and how often it finds the work (issue 19), in one run:

    sudo python -m bench.workset            # ~2 min
    sudo python -m bench.workset --quick    # ~1 min

0. What a process outside every work set pays: a pipe ping-pong between two unrelated
   processes (each round trip: two wakes, four context switches), BPF ns per round trip with
   the work set off and on, and ns per hit of `sched_waking`, whose early exit is one `threads`
   lookup, beside `sched_wakeup`, which does one lookup too.
1. BPF ns per request with the work set on and off. The probes load in this process (real BPF,
   ports filtered to the test server), `kernel.bpf_stats_enabled` is on, and the run time of
   every program this process holds is read before and after each phase (bpftool). Phases
   alternate off/on (>= 2 of each) against the same server, a Python thread-per-request server
   whose handler hands each request's work to a 2-thread pool (`/pool?n=16`) under wrk. The
   sched, irq and timer programs run for every task on the host, so their figures include
   whatever else ran meanwhile: compare the two variants, which share that noise.
2. Join rate as load rises: open-loop load at rising rates on `/pool?n=512`; for each rate, the
   share of requests whose pool worker was found (the work set holds the 512 faults, own or
   shared), and the median share of each request's time that the reader waited with no member
   runnable (`unexplained_wait_ns`). A worker that is busy when the next task arrives takes it
   without being woken, and the work set cannot see that hand-off (docs/attributes.md).

Prints two tables; needs root, wrk, bpftool and Go (bench/loadgen).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracejoin.core.metrics import Metrics
from tracejoin.core.record import WSF_TRACKED, WSIG_MINFLT, HttpRecord
from tracejoin.kernel.decode import RecordDecoder
from tracejoin.kernel.probes import HttpProbes, ProbeConfig

from bench import measure as m
from tests.harness import free_ports, server

POOL_PAGES_COST = 16  # pages per request in the cost phases
POOL_PAGES_JOIN = 512  # pages per request in the join-rate phases: ~1 ms of a worker


@dataclass
class Collector:
    """Polls the ring buffer on a thread; keeps decoded records (or just counts them)."""

    probes: HttpProbes
    keep: bool = False
    records: list[HttpRecord] = field(default_factory=list)
    count: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        dec = RecordDecoder(Metrics())

        def run() -> None:
            while not self._stop.is_set():
                for raw in self.probes.poll(50):
                    self.count += 1
                    if self.keep:
                        rec = dec.decode(raw)
                        if isinstance(rec, HttpRecord):
                            self.records.append(rec)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        time.sleep(0.3)  # the last records
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def probes(port: int, workset: bool) -> HttpProbes:
    p = HttpProbes(ProbeConfig(ports=(port,), workset=workset), Metrics())
    p.start()
    want = "on" if workset else "off: disabled by configuration"
    assert p.status.signals.get("workset") == want, p.status.signals
    return p


def run_time(ids: set[int]) -> dict[str, tuple[int, int]]:
    """Program name -> (run_time_ns, run_cnt), summed over programs of the same name."""
    out: dict[str, tuple[int, int]] = defaultdict(lambda: (0, 0))
    for st in m.prog_stats(ids).values():
        t, c = out[st["name"]]
        out[st["name"]] = (t + st["run_time_ns"], c + st["run_cnt"])
    return out


PING_PONG = """
import os
r1, w1 = os.pipe()
r2, w2 = os.pipe()
n = {n}
if os.fork() == 0:
    for _ in range(n):
        os.read(r1, 1)
        os.write(w2, b"x")
    os._exit(0)
for _ in range(n):
    os.write(w1, b"x")
    os.read(r2, 1)
os.wait()
"""


def unrelated_phase(workset: bool, rounds: int) -> dict[str, tuple[int, int]]:
    """Program -> (ns, hits) while an unrelated pipe ping-pong runs `rounds` round trips."""
    (port,) = free_ports(1)  # nothing listens there: no request is ever traced
    p = probes(port, workset)
    try:
        ids = m.own_prog_ids(os.getpid())
        before = run_time(ids)
        subprocess.run([sys.executable, "-c", PING_PONG.format(n=rounds)], check=True)
        after = run_time(ids)
    finally:
        p.shutdown()
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}


def cost_phase(port: int, workset: bool, seconds: int, conns: int) -> dict[str, Any]:
    p = probes(port, workset)
    col = Collector(p)
    col.start()
    try:
        m.wrk(port, "/pool?n=1", conns, 1, None)  # warm: pool threads exist, caches hot
        ids = m.own_prog_ids(os.getpid())
        before, n0 = run_time(ids), col.count
        load = m.wrk(port, f"/pool?n={POOL_PAGES_COST}", conns, seconds, None)
        time.sleep(0.3)
        after, n1 = run_time(ids), col.count
    finally:
        col.stop()
        p.shutdown()
    requests = max(1, n1 - n0)
    progs = {
        name: ((after[name][0] - before[name][0]), (after[name][1] - before[name][1]))
        for name in after
    }
    return {"requests": requests, "rps": load["rps"], "progs": progs}


def join_phase(port: int, p: HttpProbes, rps: int, seconds: float) -> dict[str, Any]:
    col = Collector(p, keep=True)
    col.start()
    try:
        load = m.rate(port, f"/pool?n={POOL_PAGES_JOIN}", rps, seconds, 32, None, warmup_s=0.3)
    finally:
        col.stop()
    recs = [r for r in col.records if r.path_bytes() == b"/pool" and r.ws_flags & WSF_TRACKED]
    need = 0.9 * POOL_PAGES_JOIN
    found = [r for r in recs if r.minflt + r.shared[WSIG_MINFLT] >= need]
    helpers = [r for r in recs if r.ws_threads >= 2]
    unexplained = [
        r.unexplained_wait_ns / max(1, r.end_ns - r.read_ns) for r in recs if r.end_ns > r.read_ns
    ]
    return {
        "offered": rps,
        "achieved": load["rps"],
        "p50_ms": load.get("latency_us", {}).get("p50", 0) / 1000,
        "records": len(recs),
        "found": len(found) / max(1, len(recs)),
        "helpers": len(helpers) / max(1, len(recs)),
        "unexplained": statistics.median(unexplained) if unexplained else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    rounds, seconds = (2, 2) if args.quick else (3, 4)
    rates = (100, 400, 1600) if args.quick else (50, 100, 200, 400, 800, 1600)
    conns = 4
    stats = m.BpfStatsSwitch()
    stats.on()
    (port,) = free_ports(1)
    try:
        ping = {ws: [unrelated_phase(ws, 20_000) for _ in range(rounds)] for ws in (False, True)}
        print_unrelated(ping)
        with server("workers", port):
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(rounds):
                for ws in (False, True):
                    runs[ws].append(cost_phase(port, ws, seconds, conns))
            print_cost(runs, conns)
            p = probes(port, True)
            try:
                m.wrk(port, "/pool?n=1", 2, 1, None)
                while p.poll(200):  # the warm-up's records are not the phases'
                    pass
                rows = [join_phase(port, p, r, seconds) for r in rates]
            finally:
                p.shutdown()
            print_join(rows)
    finally:
        stats.restore()
    return 0


def print_unrelated(ping: dict[bool, list[dict[str, tuple[int, int]]]]) -> None:
    def per_trip(ws: bool) -> float:
        return statistics.median(sum(ns for ns, _ in r.values()) / 20_000 for r in ping[ws])

    def per_hit(name: str) -> str:
        ns = sum(r.get(name, (0, 0))[0] for r in ping[True])
        hits = sum(r.get(name, (0, 0))[1] for r in ping[True])
        if not hits:
            return "no hits (not attached?)"
        return f"{ns / hits:.0f} ns/hit ({hits / len(ping[True]) / 20_000:.2f} hits/trip)"

    print("\n0. A process in no work set: pipe ping-pong between two unrelated processes")
    print(f"   BPF ns per round trip: work set off {per_trip(False):.0f}, on {per_trip(True):.0f}")
    print(f"   sched_waking (early exit, one lookup): {per_hit('sched_waking')}")
    # raw tracepoints, which the kernel names after their tracepoint (bcc's RAW_TRACEPOINT_PROBE)
    print(f"   sched_wakeup (one lookup): {per_hit('sched_wakeup')}")


def print_cost(runs: dict[bool, list[dict[str, Any]]], conns: int) -> None:
    def per_req(ws: bool) -> dict[str, list[float]]:
        out: dict[str, list[float]] = defaultdict(list)
        for r in runs[ws]:
            total = 0.0
            for name, (ns, _cnt) in r["progs"].items():
                out[name].append(ns / r["requests"])
                total += ns / r["requests"]
            out["= total"].append(total)
        return out

    def per_hit(ws: bool, name: str) -> float:
        ns = sum(r["progs"].get(name, (0, 0))[0] for r in runs[ws])
        cnt = sum(r["progs"].get(name, (0, 0))[1] for r in runs[ws])
        return ns / cnt if cnt else float("nan")

    off, on = per_req(False), per_req(True)
    rps = {ws: statistics.median(r["rps"] for r in runs[ws]) for ws in runs}
    n = {ws: sum(r["requests"] for r in runs[ws]) for ws in runs}
    print(
        f"\n1. BPF ns per request, work set off vs on: /pool?n={POOL_PAGES_COST} (a 2-thread pool"
        f" hand-off), wrk c{conns}; medians of {len(runs[True])} alternating phases each"
    )
    print(f"   requests: off {n[False]} ({rps[False]:.0f}/s), on {n[True]} ({rps[True]:.0f}/s)")
    print(f"   {'program':<34}{'off ns/req':>11}{'on ns/req':>11}{'on ns/hit':>11}")
    names = sorted(set(off) | set(on), key=lambda k: -statistics.median(on.get(k, [0.0])))
    for name in names:
        a = statistics.median(off[name]) if name in off else 0.0
        b = statistics.median(on[name]) if name in on else 0.0
        if a < 5 and b < 5 and name != "= total":
            continue
        hit = "" if name == "= total" else f"{per_hit(True, name):>11.0f}"
        print(f"   {name:<34}{a:>11.0f}{b:>11.0f}{hit}")


def print_join(rows: list[dict[str, Any]]) -> None:
    print(
        f"\n2. Join rate as load rises: /pool?n={POOL_PAGES_JOIN} (2 pool threads), open loop"
        " (bench/loadgen, 32 connections)"
    )
    print(
        f"   {'offered/s':>9}{'achieved/s':>11}{'p50 ms':>8}{'records':>8}"
        f"{'worker found':>13}{'helpers>=1':>11}{'unexplained (median share)':>28}"
    )
    for r in rows:
        print(
            f"   {r['offered']:>9}{r['achieved']:>11.0f}{r['p50_ms']:>8.1f}{r['records']:>8}"
            f"{r['found']:>12.0%} {r['helpers']:>10.0%} {r['unexplained']:>27.0%}"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
