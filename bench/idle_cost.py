"""What `tracejoin run` costs with nothing to trace: its CPU per second, idle.

    sudo python -m bench.idle_cost [--seconds 20] [--runs 2]

Starts the agent on a port nothing listens on (the probes attached, no traffic), waits 3 s
after ready, then reads the process's CPU time (user + system, all threads) over --seconds.
What is left is the agent's fixed cost: the reader's wake-ups (POLL_MS, backing off to
IDLE_POLL_MS with nothing to read), the
once-a-second counter reads, the exporter's and the other threads' timers. The baseline, in
the same run: a bare Python loop of empty epoll waits on an idle pipe, at POLL_MS and at a few
other timeouts (what one sleep and wake-up costs a thread on this machine).
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time

from tracejoin.pipeline.stages import POLL_MS

from bench import measure as m


def wake_cost_us(timeout_ms: float, seconds: float = 3.0) -> float:
    """Thread CPU µs per empty epoll wait of `timeout_ms` (nothing ever arrives)."""
    r, w = os.pipe()
    ep = select.epoll()
    ep.register(r, select.EPOLLIN)
    try:
        n, c0, end = 0, time.thread_time(), time.monotonic() + seconds
        while time.monotonic() < end:
            ep.poll(timeout_ms / 1000)
            n += 1
        return (time.thread_time() - c0) * 1e6 / n
    finally:
        ep.close()
        os.close(r)
        os.close(w)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20, help="how long to measure each run")
    ap.add_argument("--runs", type=int, default=2, help="agent processes, one after another")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.idle_cost loads BPF programs: run it as root", file=sys.stderr)
        return 2
    for timeout_ms in sorted({1, 25, POLL_MS, 200}):
        mark = " (POLL_MS)" if timeout_ms == POLL_MS else ""
        cost = wake_cost_us(timeout_ms)
        print(f"bare epoll wait of {timeout_ms} ms{mark}: {cost:.1f} µs of CPU each")
    (port,) = m.free_ports(1)
    for run in range(args.runs):
        agent = m.AgentRun([port], None)
        agent.start()
        try:
            time.sleep(3)
            c0, t0 = agent.cpu_split().on_cpu, time.monotonic()
            time.sleep(args.seconds)
            c1, t1 = agent.cpu_split().on_cpu, time.monotonic()
        finally:
            agent.stop()
        print(f"run {run + 1}: idle agent {(c1 - c0) / (t1 - t0) * 1e3:.1f} ms of CPU a second")
    return 0


if __name__ == "__main__":
    sys.exit(main())
