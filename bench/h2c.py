"""HTTP/2 (h2c) overhead: the Go h2c test server (tests/servers/goh2c, golang.org/x/net/http2)
under a Go h2c client, C concurrent request loops multiplexed on one connection, each request
with its own traceparent (Huffman-coded and indexed by Go's HPACK, the heavy case for the
kernel's decoder):

    sudo python -m bench.h2c             # ~2 min
    sudo python -m bench.h2c --quick     # ~1 min

Phases: off, on, on, off, off (the real `tracejoin run`, spans to OTLP-JSON on tmpfs): the
agent starts once (its BCC compile takes most of a minute); "on" is compared with the mean of
the "off" phases before and after it. Server pinned to CPU1, client and agent to CPU0,
as bench/run.py pins its HTTP/1.x rows. Reports requests/s, p50/p99 latency, records per
request and the HTTP/2 loss counters (docs/probes.md).
"""

from __future__ import annotations

import argparse
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
    try:
        assert srv.stdout is not None and "ready" in srv.stdout.readline()
        load(exe, port, 1.0, args.concurrency)  # warm-up
        phases: list[tuple[str, dict[str, float]]] = [
            ("off", load(exe, port, seconds, args.concurrency))
        ]
        agent = m.AgentRun(ports=[port], cpu=0)
        agent.start()
        try:
            for _ in range(2):
                before = agent.metrics()
                on = load(exe, port, seconds, args.concurrency)
                after = agent.wait_drained(before)
                d = m.delta(before, after)
                on["records_per_request"] = d.get("kernel_records_submitted", 0) / max(
                    1, on["requests"]
                )
                on.update({k: v for k, v in d.items() if k.startswith("kernel_h2_") and v})
                phases.append(("on", on))
        finally:
            agent.stop()
        for _ in range(2):
            phases.append(("off", load(exe, port, seconds, args.concurrency)))
    finally:
        srv.kill()
        srv.wait()
    offs = [p for k, p in phases if k == "off"]
    ons = [p for k, p in phases if k == "on"]
    mean = lambda xs, key: sum(x[key] for x in xs) / len(xs)  # noqa: E731
    print(f"h2c, {args.concurrency} streams on one connection, {seconds:.0f} s phases")
    row = "  {:<3} {:>9.0f} req/s  p50 {:>6.0f} us  p99 {:>6.0f} us{}"
    for kind, p in phases:
        shown = {k: v for k, v in p.items() if k.startswith(("records", "kernel"))}
        extra = "".join(f"  {k}={v:g}" for k, v in shown.items())
        print(row.format(kind, p["rps"], p["p50_us"], p["p99_us"], extra))
    for key in ("rps", "p50_us", "p99_us"):
        off, on = mean(offs, key), mean(ons, key)
        print(f"  {key:<7} off {off:>9.0f}  on {on:>9.0f}  on/off {on / off:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
