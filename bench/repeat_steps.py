"""The same loss-curve step, several times in a row on one fresh agent: what the first carries.

    sudo python -m bench.repeat_steps [--rate 1000] [--seconds 2] [--steps 3]

`bench.run`'s loss curve starts a fresh agent and its first step is its lowest rate, so that
step also pays what an agent pays once per server it meets: the inspector's first look, the
first resolution of the process's resource, the exporter's first connection. This starts the
agent and the Go test server as `bench.run` does (agent on CPU0, server on CPU1, OTLP/HTTP
protobuf to the local sink), sends --rate requests a second for --seconds, --steps times in a
row, and prints the agent's CPU (its process CPU-time clock, every thread) per record of
each step: the first against the steady state, in the same run.
"""

from __future__ import annotations

import argparse
import os
import sys

from bench import measure as m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=1000, help="requests a second")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each step")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.repeat_steps loads BPF programs: run it as root", file=sys.stderr)
        return 2
    with m.agent_beside_go_server() as (port, agent):
        assert agent.proc is not None
        for i in range(args.steps):
            c0, before = m.on_cpu_seconds(agent.proc.pid), agent.metrics()
            m.rate(port, "/", args.rate, args.seconds, 16, 0, nice=-10)
            after = agent.wait_drained(before)
            c1 = m.on_cpu_seconds(agent.proc.pid)
            n = after.get("records_received", 0) - before.get("records_received", 0)
            if c0 is None or c1 is None or n <= 0:
                print(f"step {i + 1}: no records or no CPU reading", file=sys.stderr)
                return 1
            print(
                f"step {i + 1} at {args.rate:,.0f} req/s: {n:,.0f} records, "
                f"{(c1 - c0) * 1e6 / n:.1f} µs of agent CPU a record"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
