"""What tracejoin's host-wide programs add to a thread it does not trace: a context switch.

    sudo .venv/bin/python -m bench.switch_cost [--trips 200000] [--rounds 5] [--against DIR ...]

Two processes ping-pong one byte over two pipes on one CPU (`tj-loadgen switch`, pinned to
CPU1): each round trip is two context switches, two wake-ups, two writes and two reads, none of
them on a traced connection. Measured with nothing attached and with the probes loaded in this
process (port filter on a port no one uses; this process on CPU0), interleaved round by round;
prints the median ns per round trip of each and, from kernel.bpf_stats_enabled (on for a second
run only: its clock reads cost more than some programs), what each of tracejoin's programs ran
per round trip. With --against DIR (repeatable), the bpf/ sources in
DIR (an older checkout, say) are loaded and measured the same way, in the same rounds. Not part
of `make bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from typing import Any

from bench import measure as m
from tests.harness import free_ports

LOAD_CPU = 1


def round_trip_ns(trips: int) -> float:
    cmd = [str(m.loadgen_binary()), "switch", "-n", str(trips), "-rounds", "1"]
    out = subprocess.run(m.pinned(cmd, LOAD_CPU), capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)["round_trip_ns"])


def with_probes(
    src: m.ProbeSource, port: int, trips: int, stats: m.BpfStatsSwitch
) -> tuple[float, dict[str, Any]]:
    """(ns per round trip, the BPF table per round trip) with the probes from `src` loaded: the
    time with bpf_stats off (its clock reads cost more than some programs), then the table
    from a second run with it on."""
    with m.probes_from(src, (port,)):
        ids = m.own_prog_ids(os.getpid())
        round_trip_ns(trips // 10)  # warm: the first wakes of a freshly loaded set
        ns = round_trip_ns(trips)
        stats.on()
        before = m.prog_stats(ids)
        round_trip_ns(trips)
        table = m.bpf_table(before, m.prog_stats(ids), trips)
        stats.restore()
    return ns, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=200_000, help="round trips per measurement")
    ap.add_argument("--rounds", type=int, default=5)
    m.add_against(ap)
    args = ap.parse_args()
    os.sched_setaffinity(0, {0})  # the agent's side, as in bench.run; the pair runs on CPU1
    variants = m.source_trees(args.against, args.against_cflags)
    (port,) = free_ports(1)
    nothing: list[float] = []
    got: dict[str, list[tuple[float, dict[str, Any]]]] = {k: [] for k in variants}
    stats = m.BpfStatsSwitch()
    try:
        for _ in range(args.rounds):
            nothing.append(round_trip_ns(args.trips))
            for label, src in variants.items():
                got[label].append(with_probes(src, port, args.trips, stats))
    finally:
        stats.restore()
    base = statistics.median(nothing)
    print(f"round trip (2 switches, 2 wake-ups, 2 pipe writes, 2 reads), median of {args.rounds}:")
    print(f"  nothing attached  {base:8,.0f} ns  [{min(nothing):,.0f}..{max(nothing):,.0f}]")
    for label, runs in got.items():
        ns = [r[0] for r in runs]
        med = statistics.median(ns)
        print(
            f"  {label:16}  {med:8,.0f} ns  [{min(ns):,.0f}..{max(ns):,.0f}]  "
            f"+{med - base:,.0f} ns over nothing attached"
        )
    for label, runs in got.items():
        print(f"{label}: BPF run time per round trip (median over rounds; bpf_stats on)")
        per: dict[str, list[tuple[float, float]]] = {}
        for _, table in runs:
            for prog in table["programs"]:
                per.setdefault(prog["name"], []).append(
                    (prog["hits_per_request"], prog["ns_per_request"])
                )
        rows = sorted(per.items(), key=lambda kv: -statistics.median(v[1] for v in kv[1]))
        total = statistics.median(t["ns_per_request"] for _, t in runs)
        for name, vals in rows:
            ns_per = statistics.median(v[1] for v in vals)
            if ns_per >= 1:
                hits = statistics.median(v[0] for v in vals)
                print(f"  {name:40} {hits:5.2f} hits  {ns_per:7.1f} ns")
        print(f"  {'all programs':40} {'':10} {total:7.1f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
