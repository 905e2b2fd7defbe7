"""What reading the kernel counters costs the agent's main thread (once a second):
HttpProbes.kernel_counters() with the whole per-CPU array in one BPF_MAP_LOOKUP_BATCH, against a
lookup per counter (its fallback where a kernel refuses the batch for arrays), alternated.

    sudo python -m bench.counter_reads [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tracejoin.core.metrics import Metrics
from tracejoin.kernel.probes import HttpProbes, ProbeConfig

from bench import measure as m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="calls per round")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.counter_reads loads BPF programs: run it as root", file=sys.stderr)
        return 2
    probes = HttpProbes(ProbeConfig(ports=tuple(m.free_ports(1))), Metrics())
    probes.start()
    try:
        for batch in (True, False, True, False):
            probes._counters_batch = batch  # the fallback, forced
            t = time.thread_time()
            for _ in range(args.calls):
                probes.kernel_counters()
            how = "one batch" if batch else "a lookup per counter"
            print(f"{how}: {(time.thread_time() - t) / args.calls * 1e6:.0f} µs a call")
    finally:
        probes.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
