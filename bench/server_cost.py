"""What the probes add to the traced server's own CPU per request, at a fixed rate.

    sudo .venv/bin/python -m bench.server_cost [--rate 20000] [--seconds 3] [--rounds 5]
                                               [--against DIR ...] [--against-cflags FLAGS ...]

The Go test server alone on CPU1, the open-loop load generator (a unique sampled traceparent
per request) and this process on CPU0. Each round measures the server's CPU time per request
(its process CPU clock: every thread, to the nanosecond) with nothing attached, then with the
probes loaded in this process (port filter on the server; records read and dropped here), for
this tree, each --against DIR (another checkout's bpf/) and each --against-cflags FLAGS (this
tree's sources compiled with other flags), interleaved, each round starting at the next variant
(no variant is always the one measured first after nothing). The BPF that runs in the server's
syscalls, and in the softirqs that land on its CPU, is charged to it: this is the kernel side
of the µs server's throughput at saturation (bench.run's probes-only row), at a rate where
neither CPU is saturated, so the figure is the cost and not a queue. Prints the medians and
each variant's added µs per request. Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

from bench import measure as m
from tests.harness import free_ports

SERVER_CPU, LOAD_CPU = 1, 0


def cpu_per_request(server_pid: int, port: int, rate: float, seconds: float) -> float:
    """The server's CPU µs per request over one open-loop phase (its warm-up excluded)."""
    result: dict = {}

    def load() -> None:
        result.update(m.rate(port, "/", rate, seconds, 16, LOAD_CPU, warmup_s=0.5))

    t = threading.Thread(target=load)
    t.start()
    # the warm-up's requests are served before the window opens: start counting after it
    time.sleep(0.6)
    c0 = m.on_cpu_seconds(server_pid) or 0.0
    t.join()
    c1 = m.on_cpu_seconds(server_pid) or 0.0
    done = result.get("completed", 0)
    return (c1 - c0) / max(1, done) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=20_000, help="requests a second, open loop")
    ap.add_argument("--seconds", type=float, default=3.0, help="each phase's measured window")
    ap.add_argument("--rounds", type=int, default=5)
    m.add_against(ap)
    args = ap.parse_args()
    os.sched_setaffinity(0, {LOAD_CPU})
    variants = m.source_trees(args.against, args.against_cflags)
    (port,) = free_ports(1)
    nothing: list[float] = []
    got: dict[str, list[float]] = {k: [] for k in variants}
    with m.go_server(port, SERVER_CPU) as srv:

        def run() -> float:
            return cpu_per_request(srv.pid, port, args.rate, args.seconds)

        run()  # warm the server (its heap, its connections' first requests)
        order = list(variants.items())
        for r in range(args.rounds):
            nothing.append(run())
            # each round starts at another variant: none is always the first after nothing
            for label, src in order[r % len(order) :] + order[: r % len(order)]:
                with m.probes_from(src, (port,)):
                    got[label].append(run())
    base = statistics.median(nothing)
    print(
        f"Go server's CPU per request at {args.rate:,.0f} req/s open loop "
        f"({args.seconds:g} s phases), median of {args.rounds} rounds:"
    )
    print(f"  nothing attached  {base:6.2f} µs  [{min(nothing):.2f}..{max(nothing):.2f}]")
    for label, vals in got.items():
        med = statistics.median(vals)
        print(
            f"  {label:16}  {med:6.2f} µs  [{min(vals):.2f}..{max(vals):.2f}]  "
            f"+{med - base:.2f} µs a request"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
