"""What the two socket-data programs (and the scanners they tail-call) cost per hit.

    python -m bench.scanner_cost [--requests 1000] [--rounds 2] [--against DIR ...]

Loads the probes in this process (port filter on two servers of its own: Go net/http and
Python http.server), sends keep-alive requests and a chunked response workload, and prints
ns per hit of `sock_recv_length` (+ `scan_req`) and `sock_send_length` (+ `scan_resp`) from
kernel.bpf_stats_enabled (a tail call's time counts in the program that made it). With
--against DIR (repeatable), the bpf/ sources in DIR (an older checkout, say) are measured the
same way, interleaved, so the sets of figures share the machine's load. Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench import measure as m
from tests.harness import free_ports, server
from tests.hostile import Conn, get_bytes, keepalive_load, new_sent

PROGRAMS = ("tracepoint__sock__sock_recv_length", "tracepoint__sock__sock_send_length")


def _chunked(port: int, n: int) -> None:
    c = Conn(port)
    for _ in range(n):
        c.sock.sendall(get_bytes(new_sent("/chunks?n=20")))
        buf = b""
        while not buf.endswith(b"0\r\n\r\n"):
            buf += c.sock.recv(65536)
    c.close()


def measure(
    src: m.ProbeSource, ports: tuple[int, int], requests: int
) -> dict[str, dict[str, float]]:
    """{workload: {program: ns per hit}} for the sources in `src`."""
    with m.probes_from(src, ports):
        return _per_hit(ports, requests)


def _per_hit(ports: tuple[int, int], requests: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    ids = m.own_prog_ids(os.getpid())
    go, py = ports
    for name, run in (
        ("go keep-alive", lambda: keepalive_load(go, requests, conns=2)),
        ("python keep-alive", lambda: keepalive_load(py, requests, conns=2)),
        ("go chunked x20", lambda: _chunked(go, requests // 4)),
    ):
        before = m.prog_stats(ids)
        run()
        time.sleep(0.3)
        after = m.prog_stats(ids)
        row = {}
        for pid, b in after.items():
            if b["name"] in PROGRAMS or any(b["name"] == n[:15] for n in PROGRAMS):
                a = before.get(pid, {"run_time_ns": 0, "run_cnt": 0})
                hits = b["run_cnt"] - a["run_cnt"]
                if hits:
                    row[b["name"]] = (b["run_time_ns"] - a["run_time_ns"]) / hits
        out[name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    m.add_against(ap)
    args = ap.parse_args()
    variants = m.source_trees(args.against, args.against_cflags)
    stats = m.BpfStatsSwitch()
    results: dict[str, dict[str, dict[str, list[float]]]] = {k: {} for k in variants}
    go, py = free_ports(2)
    try:
        stats.on()
        with server("go", go), server("threaded", py):
            for _ in range(args.rounds):
                for label, src in variants.items():
                    for work, row in measure(src, (go, py), args.requests).items():
                        for prog, ns in row.items():
                            results[label].setdefault(work, {}).setdefault(prog, []).append(ns)
    finally:
        stats.restore()
    for label, works in results.items():
        print(f"{label}:")
        for work, progs in works.items():
            cells = ", ".join(
                f"{prog.removeprefix('tracepoint__sock__')} {statistics.median(v):,.0f} ns/hit"
                f" [{min(v):,.0f}..{max(v):,.0f}]"
                for prog, v in sorted(progs.items())
            )
            print(f"  {work:18} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
