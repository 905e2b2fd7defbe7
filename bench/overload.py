"""Overload: what the CPU budget does when the traffic is more than the agent can read.

    sudo python -m bench.overload [--rate 20000] [--seconds 6] [--rounds 2] [--settle 5]
                                  [--json PATH] [--report PATH]

`tracejoin run` (the Go test server alone on CPU1; the agent, tj-loadgen at nice -10 and the
OTLP sink on CPU0: the bench's standard placement) under open-loop traffic at --rate, once with
`--cpu-budget 0` (off) and once with the default budget, alternated for --rounds. Each phase is
its own agent process. Per phase: requests sent, records lost in the kernel (`ringbuf_full`),
requests the budget shed (counted apart, never a loss), spans exported and the agent's CPU per
record; then the sampling ratio as /metrics showed it every half second, during the load and
for --settle seconds after it at a tenth of the rate (the budget raising the ratio back), and
the agent's budget log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any

from bench import measure as m
from bench.run import agent_delta

SERVER_CPU, AGENT_CPU = 1, 0


def phase(port: int, sink: int, budget: str, args: argparse.Namespace) -> dict[str, Any]:
    """One agent process, one burst at --rate, then --settle seconds at a tenth of it."""
    agent = m.AgentRun([port], AGENT_CPU, sink_port=sink, extra_args=["--cpu-budget", budget])
    agent.start()
    ratios: list[tuple[float, float, int]] = []  # (s since start, ratio, lost so far)
    done = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not done.wait(0.5):
            try:
                now = agent.metrics()
            except OSError:
                continue
            if "sampling_ratio" in now:
                lost = now.get("kernel_ringbuf_full", 0) - before.get("kernel_ringbuf_full", 0)
                ratios.append((round(time.monotonic() - t0, 1), now["sampling_ratio"], int(lost)))

    try:
        before, c0 = agent.metrics(), agent.cpu_split()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        load = m.rate(port, "/", args.rate, args.seconds, 16, AGENT_CPU, warmup_s=0.3, nice=-10)
        mid = agent.wait_drained(before)
        c1 = agent.cpu_split()
        if args.settle:
            m.rate(port, "/", args.rate / 10, args.settle, 16, AGENT_CPU, warmup_s=0, nice=-10)
        done.set()
        sampler.join()
    finally:
        done.set()
        agent.stop()
    d = agent_delta(m.delta(before, mid), c0, c1)
    return {
        "cpu_budget": budget,
        "sent": load["requests_total"],
        "achieved_rps": round(load["rps"]),
        **d,
        "ratio_over_time": ratios,
        "budget_log": [line for line in agent.log if "cpu budget" in line],
    }


def show(p: dict[str, Any]) -> None:
    sent = p["sent"] or 1
    name = "off" if float(p["cpu_budget"]) == 0 else p["cpu_budget"]
    print(
        f"  budget {name:>4}: sent {p['sent']:,} at {p['achieved_rps']:,}/s; "
        f"lost {p['lost_kernel_ringbuf_full']:,} ({p['lost_kernel_ringbuf_full'] / sent:.1%}); "
        f"shed {p['sampled_out_budget']:,} ({p['sampled_out_budget'] / sent:.1%}); "
        f"spans exported {p['spans_exported']:,}; {p['cpu_us_per_record']} µs/record"
    )
    if p["ratio_over_time"]:
        trace = ", ".join(f"{t:g}s {r:.3g} ({lost:,})" for t, r, lost in p["ratio_over_time"])
        print(f"    sampling ratio (lost so far): {trace}")
    for line in p["budget_log"][:12]:
        print(f"    {line.split('cpu budget', 1)[1].strip()}")
    if len(p["budget_log"]) > 12:
        print(f"    ... {len(p['budget_log']) - 12} more")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=20000, help="requests per second (open loop)")
    ap.add_argument("--seconds", type=float, default=6, help="length of the burst")
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    ap.add_argument("--settle", type=float, default=5, help="seconds at rate/10 after the burst")
    ap.add_argument("--budget", default="0.5", help="the --cpu-budget of the 'on' phases")
    ap.add_argument("--json", help="write every phase's figures here")
    ap.add_argument("--report", help="print a saved --json result again; run nothing")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        a = saved["args"]
        print(f"{a['rate']:,.0f} req/s for {a['seconds']:g} s, {a['rounds']} rounds")
        for p in saved["phases"]:
            show(p)
        return 0
    if os.geteuid() != 0:
        print("bench.overload loads BPF programs: run it as root", file=sys.stderr)
        return 2
    (port,) = m.free_ports(1)
    phases: list[dict[str, Any]] = []
    with m.go_server(port, SERVER_CPU), m.otlp_sink(AGENT_CPU) as sink:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}, {args.rate:,.0f} req/s for {args.seconds:g} s")
            for budget in ("0", args.budget):
                p = phase(port, sink, budget, args)
                phases.append(p)
                show(p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "phases": phases}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
