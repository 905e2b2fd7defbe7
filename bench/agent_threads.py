"""Where a running `tracejoin run` spends its CPU, thread by thread, beside a served process.

    sudo python -m bench.agent_threads [--rate 200] [--seconds 40]

Starts the Go test server and the agent (OTLP/HTTP protobuf to a local sink that discards),
sends --rate requests a second for --seconds (open loop, bench/loadgen), and prints each of the
agent's threads' CPU a second (their sum_exec_runtime, /proc/<pid>/task/*/schedstat) with the
system call it waits in between (the reader waits in epoll_wait; the exporter, the inspector
and the main thread in futex), then the agent's counters of the inspector's TCP-table reads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench import measure as m

SYSCALLS = {"7": "poll", "202": "futex", "232": "epoll_wait", "281": "epoll_pwait"}  # x86-64


def threads(pid: int) -> dict[str, tuple[str, int]]:
    """tid -> (the system call it is in, ns on a CPU so far)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            call = (task / "syscall").read_text().split()[0]
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        out[task.name] = (SYSCALLS.get(call, call), ns)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=200, help="requests a second")
    ap.add_argument("--seconds", type=float, default=40, help="how long to measure")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.agent_threads loads BPF programs: run it as root", file=sys.stderr)
        return 2
    with m.agent_beside_go_server() as (port, agent):
        m.rate(port, "/", args.rate, 2, 4, 0)  # the server is seen and inspected first
        before = threads(agent.pid)
        m.rate(port, "/", args.rate, args.seconds, 4, 0)
        after = threads(agent.pid)
        counters = agent.metrics()
    print(f"tracejoin run beside the Go server at {args.rate:g} req/s for {args.seconds:g} s:")
    for tid, (call, ns) in sorted(after.items(), key=lambda kv: int(kv[0])):
        used = (ns - before.get(tid, (call, 0))[1]) / 1e6 / args.seconds
        print(f"  thread {tid} (waits in {call}): {used:.3f} ms of CPU a second")
    for name in ("otlp_tables_read", "kernel_otlp_connects"):
        print(f"  {name}: {counters.get(name, 0):g} (the agent's whole run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
