"""What the agent's scheduling policy does to the latency of work that shares its CPU.

    sudo python -m bench.sched_policy [--path /] [--rate 40000] [--conns 16] [--rounds 4]
                                      [--seconds 5]

bench.run's placement: the Go server alone on CPU1; the open-loop load generator (nice -10)
and `tracejoin run` (--cpu-budget 0, OTLP/HTTP to bench/otlp_sink) on CPU0. Per round, in an
order that rotates: no agent, the agent as deployed (SCHED_OTHER) and the agent with every
thread moved to SCHED_BATCH once it is ready (threads it starts later inherit it): the same
weight, but a waking thread never preempts the task running on its CPU. Prints each phase's
p50 and p99 (counted from each request's due time) and, per round, the two agents' change
against that round's no-agent phase; then the medians. The agent's own CPU per request is
printed too: the policy should not change it.
The ms-scale server: --path '/sleep?ms=5' --rate 5000 --conns 96.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench import measure as m

MODES = ("off", "batch", "normal")


def phase(port: int, sink: int, mode: str, args: argparse.Namespace) -> dict[str, float]:
    load = lambda: m.rate(  # noqa: E731 - the same load for each mode
        port, args.path, args.rate, args.seconds, args.conns, 0, nice=-10
    )
    if mode == "off":
        r = load()
        return {"p50": r["latency_us"]["p50"], "p99": r["latency_us"]["p99"], "cpu_us": 0.0}
    agent = m.AgentRun([port], 0, sink_port=sink, extra_args=["--cpu-budget", "0"])
    agent.start()
    try:
        if mode == "batch":
            assert agent.proc is not None
            for tid in os.listdir(f"/proc/{agent.proc.pid}/task"):
                os.sched_setscheduler(int(tid), os.SCHED_BATCH, os.sched_param(0))
        c0 = agent.cpu_split()
        r = load()
        c1 = agent.cpu_split()
    finally:
        agent.stop()
    cpu_us = (c1.on_cpu - c0.on_cpu) * 1e6 / max(1, r["requests_total"])
    return {"p50": r["latency_us"]["p50"], "p99": r["latency_us"]["p99"], "cpu_us": cpu_us}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--path", default="/", help="the Go server's path ('/sleep?ms=5': ms-scale)")
    ap.add_argument("--rate", type=float, default=40_000, help="requests a second, open loop")
    ap.add_argument("--conns", type=int, default=16, help="keep-alive connections")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5, help="each phase")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.sched_policy loads BPF programs: run it as root", file=sys.stderr)
        return 2
    (port,) = m.free_ports(1)
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    print(f"{args.path} at {args.rate:,.0f} req/s open loop, {args.conns} connections")
    with m.go_server(port, 1), m.otlp_sink(0) as sink:
        m.rate(port, args.path, args.rate, 2, args.conns, 0, nice=-10)  # warm the server
        for k in range(args.rounds):
            order = MODES[k % 3 :] + MODES[: k % 3]
            got = {mode: phase(port, sink, mode, args) for mode in order}
            for mode in MODES:
                rows[mode].append(got[mode])
            base = got["off"]
            print(
                f"round {k + 1}: off p50/p99 {base['p50']:.0f}/{base['p99']:.0f} µs; "
                + "; ".join(
                    f"{mode} {got[mode]['p50']:.0f}/{got[mode]['p99']:.0f} µs "
                    f"(Δp99 {got[mode]['p99'] / base['p99'] - 1:+.1%}, "
                    f"agent {got[mode]['cpu_us']:.1f} µs/req)"
                    for mode in ("batch", "normal")
                )
            )
    print("medians over rounds:")
    base99 = [r["p99"] for r in rows["off"]]
    for mode in MODES:
        p50 = statistics.median(r["p50"] for r in rows[mode])
        p99 = statistics.median(r["p99"] for r in rows[mode])
        line = f"  {mode:<7} p50 {p50:>7.0f} µs  p99 {p99:>7.0f} µs"
        if mode != "off":
            d99 = [r["p99"] / b - 1 for r, b in zip(rows[mode], base99, strict=True)]
            cpu = statistics.median(r["cpu_us"] for r in rows[mode])
            line += f"  Δp99 vs off {statistics.median(d99):+.1%}  agent {cpu:.1f} µs/req"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
