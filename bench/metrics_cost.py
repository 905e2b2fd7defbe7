"""Cost of one self-metric update on the per-request path, beside what it is measured against.

    python -m bench.metrics_cost [--against GIT_REV]

Each case is timed interleaved with the others, best of many short runs (a shared machine's
noise only ever adds time). Baselines in the same run: an empty Python call of the same shape,
and prometheus_client's own Counter (which tracejoin.core.metrics renders through but does not
count with: its labelled path costs more). `--against REV` adds the Metrics class of
agent/core/metrics.py at that git revision, for a before/after. Then a /metrics scrape's
rendering: Metrics.prometheus_text beside prometheus_client's generate_latest.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import timeit
import types
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from tracejoin.core.metrics import Metrics

CASES = (
    ("inc, no labels", "m.inc('records_received')"),
    ("inc, a value", "m.inc('spans_built', 2)"),
    ("inc, 1 label", "m.inc('decode_errors', reason='short')"),
    ("inc, 2 labels", "m.inc('spans_dropped', 1, exporter='otlp', reason='queue_full')"),
    ("set, no labels", "m.set('ready', 1)"),
)


def _metrics_at(rev: str) -> Any:
    """A Metrics from agent/core/metrics.py as it was at `rev` (the module imports nothing of
    tracejoin's, so its text alone makes it)."""
    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(
        ["git", "-C", str(root), "show", f"{rev}:agent/core/metrics.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    mod = types.ModuleType(f"metrics_at_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(src, f"{rev}:agent/core/metrics.py", "exec"), mod.__dict__)
    return mod.Metrics()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="GIT_REV", help="also time Metrics at this revision")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    n = 20_000

    subjects: dict[str, Any] = {"now": Metrics()}
    if args.against:
        subjects[args.against] = _metrics_at(args.against)
    reg = CollectorRegistry()
    pc_plain = Counter("records_received", "", registry=reg)
    pc_labels = Counter("spans_dropped", "", ["exporter", "reason"], registry=reg)

    def empty(name: str, value: float = 1, **labels: str) -> None:
        pass

    extra: dict[str, tuple[str, dict[str, Any]]] = {
        "empty call, 2 kwargs": ("f('x', 1, a='b', c='d')", {"f": empty}),
        "prometheus_client inc()": ("c.inc()", {"c": pc_plain}),
        "prometheus_client labels(2).inc()": (
            "c.labels(exporter='otlp', reason='queue_full').inc()",
            {"c": pc_labels},
        ),
    }
    best: dict[tuple[str, str], float] = {}

    def time_it(key: tuple[str, str], stmt: str, env: dict[str, Any]) -> None:
        ns = timeit.timeit(stmt, globals=env, number=n) / n * 1e9
        best[key] = min(best.get(key, float("inf")), ns)

    for _ in range(args.rounds):
        for what, stmt in CASES:
            for label, m in subjects.items():
                time_it((what, label), stmt, {"m": m})
        for what, (stmt, env) in extra.items():
            time_it((what, ""), stmt, env)

    print(f"{'ns per call':<36}" + "".join(f"{label:>12}" for label in subjects))
    for what, _ in CASES:
        print(f"{what:<36}" + "".join(f"{best[(what, label)]:12.0f}" for label in subjects))
    for what in extra:
        print(f"{what:<36}{best[(what, '')]:12.0f}")

    # A scrape's rendering, every series a fresh agent declares (~130 samples): tracejoin's
    # writer beside prometheus_client's generate_latest over the same registry, best of 10.
    m = Metrics()
    render = {
        "prometheus_text()": m.prometheus_text,
        "generate_latest (reference)": m.prometheus_text_reference,
    }
    us = {n: min(timeit.repeat(f, number=50, repeat=10)) * 1e6 / 50 for n, f in render.items()}
    samples = sum(1 for line in m.prometheus_text().splitlines() if not line.startswith("#"))
    print(f"{'µs per scrape render (' + str(samples) + ' samples)':<36}")
    for name, v in us.items():
        print(f"  {name:<34}{v:12.0f}")


if __name__ == "__main__":
    main()
