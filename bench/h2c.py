"""HTTP/2 (h2c) overhead: the Go h2c test server (tests/servers/goh2c, golang.org/x/net/http2)
under a Go h2c client, C concurrent request loops multiplexed on one connection, each request
with its own traceparent (Huffman-coded and indexed by Go's HPACK, the heavy case for the
kernel's decoder):

    sudo python -m bench.h2c             # ~2 min
    sudo python -m bench.h2c --quick     # ~1 min

Phases: off, on, on, off, off (the real `tracejoin run`, spans over OTLP/HTTP protobuf to
bench/otlp_sink.py on the client's CPU, as bench/run.py's rows; `--destination file`: OTLP-JSON
on tmpfs, which takes the object path, not the direct encoder): the
agent starts once (its BCC compile takes most of a minute); "on" is compared with the mean of
the "off" phases before and after it. Server pinned to CPU1, client and agent to CPU0,
as bench/run.py pins its HTTP/1.x rows. Reports requests/s, p50/p99 latency, records and
requests shed by the overload budget per request (the two add up to 1 when nothing is lost;
`--cpu-budget 0` sheds none), the HTTP/2 loss counters (docs/probes.md), and where the cost
goes: the agent process's CPU per request and the kernel's, program by program
(kernel.bpf_stats_enabled on during the "on" phases only, then restored; it adds its own
clock reads to every program run).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from bench import measure as m

GOH2C = Path(__file__).parent.parent / "tests" / "servers" / "goh2c"
CACHE = Path("/var/cache/tracejoin")


def binary() -> Path:
    h = hashlib.sha256()
    for name in ("main.go", "go.mod", "go.sum"):
        h.update((GOH2C / name).read_bytes())
    out = CACHE / f"tj-goh2c-{h.hexdigest()[:12]}"
    if not out.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-o", str(out), "."], cwd=GOH2C, check=True)
    return out


def load(exe: Path, port: int, seconds: float, conc: int) -> dict[str, float]:
    out = subprocess.run(
        m.pinned([str(exe), "load", str(port), str(seconds), str(conc)], 0),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    n, errors, p50, p99 = (int(x) for x in out)
    return {"requests": n, "errors": errors, "rps": n / seconds, "p50_us": p50, "p99_us": p99}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--destination", choices=("otlp", "file"), default="otlp")
    ap.add_argument(
        "--cpu-budget", type=float, default=None, help="the agent's --cpu-budget (default: its own)"
    )
    args = ap.parse_args(argv)
    seconds = 3.0 if args.quick else 8.0
    if shutil.which("go") is None:
        print("needs Go (builds tests/servers/goh2c)", file=sys.stderr)
        return 2
    exe = binary()
    (port,) = m.free_ports(1)
    srv = subprocess.Popen(
        m.pinned([str(exe), "server", str(port)], 1), stdout=subprocess.PIPE, text=True
    )
    with contextlib.ExitStack() as stack:
        assert srv.stdout is not None and "ready" in srv.stdout.readline()
        stack.callback(srv.wait)
        stack.callback(srv.kill)
        sink = stack.enter_context(m.otlp_sink(0)) if args.destination == "otlp" else None
        load(exe, port, 1.0, args.concurrency)  # warm-up
        phases: list[tuple[str, dict[str, float]]] = [
            ("off", load(exe, port, seconds, args.concurrency))
        ]
        budget = [] if args.cpu_budget is None else ["--cpu-budget", f"{args.cpu_budget:g}"]
        agent = m.AgentRun(ports=[port], cpu=0, sink_port=sink, extra_args=budget)
        agent.start()
        stats = m.BpfStatsSwitch()
        progs: list[dict] = []
        try:
            stats.on()
            for _ in range(2):
                before, c0, p0 = agent.metrics(), agent.cpu_split(), m.prog_stats(agent.prog_ids)
                on = load(exe, port, seconds, args.concurrency)
                after = agent.wait_drained(before)
                c1, p1 = agent.cpu_split(), m.prog_stats(agent.prog_ids)
                d = m.delta(before, after)
                n = max(1, on["requests"])
                on["records_per_request"] = d.get("kernel_records_submitted", 0) / n
                on["shed_per_request"] = d.get("kernel_sampled_out_budget", 0) / n
                on.update({k: v for k, v in d.items() if k.startswith("kernel_h2_") and v})
                cpu_us = (c1.on_cpu - c0.on_cpu) * 1e6
                on["agent_cpu_us_per_request"] = round(cpu_us / n, 1)
                on["agent_cpu_us_per_record"] = round(
                    cpu_us / max(1, d.get("records_received", 0)), 1
                )
                table = m.bpf_table(p0, p1, int(n))
                on["bpf_us_per_request"] = round(table["ns_per_request"] / 1000, 1)
                progs = table["programs"]
                phases.append(("on", on))
        finally:
            stats.restore()
            agent.stop()
        for _ in range(2):
            phases.append(("off", load(exe, port, seconds, args.concurrency)))
    offs = [p for k, p in phases if k == "off"]
    ons = [p for k, p in phases if k == "on"]
    mean = lambda xs, key: sum(x[key] for x in xs) / len(xs)  # noqa: E731
    print(
        f"h2c, {args.concurrency} streams on one connection, {seconds:.0f} s phases,"
        f" spans to {args.destination}"
    )
    row = "  {:<3} {:>9.0f} req/s  p50 {:>6.0f} us  p99 {:>6.0f} us{}"
    for kind, p in phases:
        shown = {
            k: v
            for k, v in p.items()
            if k.startswith(("records", "shed", "kernel", "agent", "bpf"))
        }
        extra = "".join(f"  {k}={v:g}" for k, v in shown.items())
        print(row.format(kind, p["rps"], p["p50_us"], p["p99_us"], extra))
    for key in ("rps", "p50_us", "p99_us"):
        off, on = mean(offs, key), mean(ons, key)
        print(f"  {key:<7} off {off:>9.0f}  on {on:>9.0f}  on/off {on / off:.3f}")
    print("  the kernel's programs in the last on phase (with stats on), per request:")
    for p in progs[:8]:
        print(
            f"    {p['name']:<16} {p['hits_per_request']:>6.2f} hits"
            f" {p['ns_per_hit']:>9.0f} ns/hit {p['ns_per_request'] / 1000:>7.1f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
