"""What a span's resource costs the ring-buffer reader (agent/enrich/resources.py).

    python -m bench.resources

CPU µs per call, best of 3, on this process's own pid, beside baselines measured in the same
run: a dict lookup (the floor of any cache) and one raw read of /proc/<pid>/stat (the floor
of any check of a process's start time).
  - hit: a pid whose facts are younger than REVALIDATE_S (nearly every lookup);
  - revalidate: the once-per-REVALIDATE_S check of a pid already seen, its process unchanged
    (read_process_stamp: the raw stat, exe link and cgroup compared, nothing rebuilt);
  - new pid: the first lookup (the stamp, then psutil: start time, name, executable; the
    cgroup path; building the resource), and a revalidation that finds a change.
The kubelet is never on this path (a background thread), so it is not measured here.
Neither is the ProcessInspector (its own thread): its reads are measured apart, as what that
thread spends per process every REFRESH_S (the OTEP 4719 process context, the environment, the
network namespace's TCP tables, the fd walk), and the hit with an inspector attached.
"""

from __future__ import annotations

import os
import time

from tracejoin.core.metrics import Metrics
from tracejoin.enrich.inspector import ProcessInspector
from tracejoin.enrich.process_context import read_otel_environ, read_process_context
from tracejoin.enrich.resources import ResourceResolver, read_process_facts, read_process_stamp

from bench.stages import _best_us


def _raw_stat(pid: int) -> bytes:
    fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    try:
        return os.read(fd, 1024)
    finally:
        os.close(fd)


def run(n: int = 20_000) -> dict[str, float]:
    pid = os.getpid()

    def resolver(revalidate_s: float) -> ResourceResolver:
        return ResourceResolver(
            Metrics(),
            service_name=None,
            static={"tracejoin.tlb.mode": "off"},
            kubelet=None,
            node_name="node-a",
            revalidate_s=revalidate_s,
        )

    warm, cold = resolver(3600.0), resolver(0.0)
    inspected = ResourceResolver(
        Metrics(),
        service_name=None,
        static={},
        kubelet=None,
        node_name=None,
        revalidate_s=3600.0,
        inspector=ProcessInspector(Metrics(), read_environ=True),
    )
    inspector = ProcessInspector(Metrics(), read_environ=True, refresh_s=0.0)
    cached = ProcessInspector(Metrics(), read_environ=True, refresh_s=3600.0)
    table = {pid: object()}

    def new_pid(r: ResourceResolver) -> object:
        r._cache.clear()  # as a pid never seen: its stamp and facts read, its resource built
        return r.resource(pid)

    return {
        "baseline: dict.get": _best_us(lambda: table.get(pid), n),
        "baseline: read /proc/<pid>/stat": _best_us(lambda: _raw_stat(pid), n // 10),
        "resource(pid), hit": _best_us(lambda: warm.resource(pid), n),
        "read_process_facts(pid)": _best_us(lambda: read_process_facts(pid), n // 10),
        "read_process_stamp(pid)": _best_us(lambda: read_process_stamp(pid), n // 10),
        "resource(pid), revalidate": _best_us(lambda: cold.resource(pid), n // 10),
        "resource(pid), new pid": _best_us(lambda: new_pid(cold), n // 10),
        "served(pid), hit, inspector attached": _best_us(lambda: inspected.served(pid), n),
        "inspector: process context (maps scan)": _best_us(
            lambda: read_process_context(pid), n // 100
        ),
        "inspector: environ (two variables)": _best_us(lambda: read_otel_environ(pid), n // 100),
        "inspector: OTLP check, TCP tables read": _best_us(
            lambda: inspector._otlp_connected(pid, time.monotonic()), 20
        ),
        "inspector: OTLP check, tables cached": _best_us(
            lambda: cached._otlp_connected(pid, time.monotonic()), n // 100
        ),
    }


def main() -> None:
    res = run()
    base = res["baseline: read /proc/<pid>/stat"]
    for name, us in res.items():
        print(f"{name:40s} {us:8.2f} µs  ({us / base:5.2f}x a raw stat read)")
    hit, reval = res["resource(pid), hit"], res["resource(pid), revalidate"]
    print(
        f"per request at 1000 req/s on one pid: {hit + reval / 1000:.2f} µs "
        "(hits, plus one revalidation a second)"
    )


if __name__ == "__main__":
    main()
