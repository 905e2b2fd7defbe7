"""What `tracejoin run` costs with nothing to trace: its CPU per second, idle.

    sudo python -m bench.idle_cost [--seconds 20] [--runs 2]

Starts the agent on a port nothing listens on (the probes attached, no traffic), waits 3 s
after ready, then reads the process's CPU time (user + system, all threads) over --seconds.
What is left is the agent's fixed cost: the reader's wake-ups (every POLL_MS), the
once-a-second counter reads, the exporter's and the other threads' timers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench import measure as m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20, help="how long to measure each run")
    ap.add_argument("--runs", type=int, default=2, help="agent processes, one after another")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.idle_cost loads BPF programs: run it as root", file=sys.stderr)
        return 2
    (port,) = m.free_ports(1)
    for run in range(args.runs):
        agent = m.AgentRun([port], None)
        agent.start()
        try:
            time.sleep(3)
            c0, t0 = sum(agent.cpu_split()), time.monotonic()
            time.sleep(args.seconds)
            c1, t1 = sum(agent.cpu_split()), time.monotonic()
        finally:
            agent.stop()
        print(f"run {run + 1}: idle agent {(c1 - c0) / (t1 - t0) * 1e3:.1f} ms of CPU a second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
