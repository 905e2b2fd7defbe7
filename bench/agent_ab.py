"""The agent as deployed against one variant of it, beside no agent: the latency of the work
that shares the agent's CPU, and the agent's CPU per request.

    sudo python -m bench.agent_ab [--variant sched_batch|sched_idle|nice=N|slice=MS
                                   | --variant cflags='FLAGS' | --variant '--cpu-slice-ms 0']
                                  [--path /] [--rate 40000] [--conns 16] [--rounds 4]
                                  [--seconds 5]

bench.run's placement: the Go server alone on CPU1; the open-loop load generator (nice -10)
and `tracejoin run` (--cpu-budget 0, OTLP/HTTP to bench/otlp_sink) on CPU0 (`--agent-cpu 1`: on
the server's CPU instead). Per round, in an
order that rotates: no agent ("off"), the agent as deployed ("as_deployed") and the variant:
`sched_batch`, `sched_idle`, `nice=N` and `slice=MS` (a requested EEVDF slice) move every
thread of the agent to that scheduling once it is ready (threads it starts later inherit it);
`cflags=FLAGS` compiles its probes with those flags instead of CFLAGS; anything else is extra
`tracejoin run` arguments. Prints each phase's p50 and p99
(counted from each request's due time) and, per round, each agent's change against that
round's no-agent phase; then the medians. The ms-scale server: --path '/sleep?ms=5'
--rate 5000 --conns 96.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from collections.abc import Callable

from tracejoin.host.scheduling import set_slice

from bench import measure as m

MODES = ("off", "as_deployed", "variant")


# Variants that change how the kernel schedules the agent's threads once it is ready (threads
# it starts later inherit it), by name (and =VALUE).
SCHEDULING: dict[str, Callable[[int, str], None]] = {
    "sched_batch": lambda tid, _: os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0)),
    "sched_idle": lambda tid, _: os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0)),
    "nice": lambda tid, value: os.setpriority(os.PRIO_PROCESS, tid, int(value)),
    "slice": lambda tid, value: set_slice(tid, float(value)),
}


def phase(port: int, sink: int, mode: str, args: argparse.Namespace) -> dict[str, float]:
    def load() -> dict:
        return m.rate(port, args.path, args.rate, args.seconds, args.conns, 0, nice=-10)

    if mode == "off":
        r = load()
        return {"p50": r["latency_us"]["p50"], "p99": r["latency_us"]["p99"], "cpu_us": 0.0}
    extra = ["--cpu-budget", "0"]
    scheduling = mode == "variant" and args.variant.split("=")[0] in SCHEDULING
    cflags = None
    if mode == "variant" and args.variant.startswith("cflags="):
        cflags = tuple(shlex.split(args.variant.partition("=")[2]))
    elif mode == "variant" and not scheduling:
        extra += shlex.split(args.variant)
    agent = m.AgentRun([port], args.agent_cpu, sink_port=sink, extra_args=extra, cflags=cflags)
    agent.start()
    try:
        if scheduling:
            assert agent.proc is not None
            name, _, value = args.variant.partition("=")
            for tid in os.listdir(f"/proc/{agent.proc.pid}/task"):
                SCHEDULING[name](int(tid), value)
        c0 = agent.cpu_split()
        r = load()
        c1 = agent.cpu_split()
    finally:
        agent.stop()
    cpu_us = (c1.on_cpu - c0.on_cpu) * 1e6 / max(1, r["requests_total"])
    return {"p50": r["latency_us"]["p50"], "p99": r["latency_us"]["p99"], "cpu_us": cpu_us}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--variant",
        default="sched_batch",
        help="sched_batch, sched_idle, nice=N, slice=MS (a requested EEVDF slice), "
        "cflags='FLAGS' (the probes compiled with other flags than CFLAGS), or extra "
        "`tracejoin run` arguments (one string)",
    )
    ap.add_argument("--path", default="/", help="the Go server's path ('/sleep?ms=5': ms-scale)")
    ap.add_argument("--rate", type=float, default=40_000, help="requests a second, open loop")
    ap.add_argument("--conns", type=int, default=16, help="keep-alive connections")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5, help="each phase")
    ap.add_argument(
        "--agent-cpu",
        type=int,
        default=0,
        choices=(0, 1),
        help="the agent's CPU: 0, the load generator's (bench.run's placement), or 1, the server's",
    )
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.agent_ab loads BPF programs: run it as root", file=sys.stderr)
        return 2
    (port,) = m.free_ports(1)
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    print(
        f"{args.path} at {args.rate:,.0f} req/s open loop, {args.conns} connections; "
        f"variant: {args.variant}"
    )
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
                    for mode in MODES[1:]
                )
            )
    print("medians over rounds:")
    base99 = [r["p99"] for r in rows["off"]]
    for mode in MODES:
        p50 = statistics.median(r["p50"] for r in rows[mode])
        p99 = statistics.median(r["p99"] for r in rows[mode])
        line = f"  {mode:<12} p50 {p50:>7.0f} µs  p99 {p99:>7.0f} µs"
        if mode != "off":
            d99 = [r["p99"] / b - 1 for r, b in zip(rows[mode], base99, strict=True)]
            cpu = statistics.median(r["cpu_us"] for r in rows[mode])
            line += f"  Δp99 vs off {statistics.median(d99):+.1%}  agent {cpu:.1f} µs/req"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
