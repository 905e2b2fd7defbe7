"""What a compiling start's compile costs, in one compiler and in the agent's two at once
(agent/kernel/compiled.py: unit_texts; agent/kernel/probes.py: compiled_apart, compiled_later,
compiled_apart_after_ready).

    sudo .venv/bin/python -m bench.compile_units [--runs 3] [--cuda] [--apart NAME ...]
                                                 [--against-cflags=FLAGS ...]

Renders bpf/http.c as `tracejoin run` would and compiles it as the agent does, in child
processes, `--runs` times each way: the whole text in one child; each of the two units alone
(CPU seconds, user+sys from the children's rusage: how evenly the split shares out the work,
without the other compiler beside it); both units at once (wall seconds: what a start that
waits for every program waits for, `--http2-before-ready`); and everything but HTTP/2's
programs (what `tracejoin run`'s first start waits for: HTTP/2's compile after ready), in one
child and in two at once (COMPILED_APART_AFTER_READY). Prints medians and the ratio of the
two-at-once wall time to the one child's, in the same run. `--apart NAME` moves another
program into the second unit, to try another split; `--against-cflags=FLAGS` (repeatable)
measures every way again with other compiler flags than CFLAGS, interleaved. Root: the
compilers create the maps, as BCC does.
"""

from __future__ import annotations

import argparse
import resource
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tracejoin.core.metrics import Metrics
from tracejoin.kernel import compiled
from tracejoin.kernel.probes import (
    HttpProbes,
    ProbeConfig,
    compiled_apart,
    compiled_apart_after_ready,
    compiled_later,
)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(units: list[str], cflags: list[str]) -> tuple[float, float, int]:
    """Compile `units` at once, one child each: (wall s, the children's CPU s, peaks summed)."""
    cpu0, t0 = _children_cpu(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tracejoin-bench-") as tmp:
        _, peak = compiled._compile_in_children(units, cflags, "bench", Path(tmp))
    return time.monotonic() - t0, _children_cpu() - cpu0, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cuda", action="store_true", help="render with the CUDA uprobes")
    ap.add_argument("--apart", action="append", default=[], help="another program to move")
    ap.add_argument(
        "--against-cflags",
        action="append",
        default=[],
        metavar="FLAGS",
        help="every way again with these flags instead of CFLAGS, as one argument: "
        "--against-cflags=-Wno-macro-redefined (repeatable)",
    )
    args = ap.parse_args()
    text, cflags = HttpProbes(ProbeConfig(cuda=args.cuda), Metrics()).render()
    extra = set(args.apart)
    apart: Callable[[str], bool] = lambda name: compiled_apart(name) or name in extra  # noqa: E731
    first, second = compiled.unit_texts(text, apart)
    http1, _ = compiled.unit_texts(text, compiled_later)
    http1_units = compiled.unit_texts(http1, compiled_apart_after_ready)
    ways = {
        "the whole text, one child": [text],
        "unit 1 alone (the rest)": [first],
        "unit 2 alone (HTTP/2's and COMPILED_APART)": [second],
        "units 1 and 2 at once (a start that waits for HTTP/2)": [first, second],
        "all but HTTP/2's, one child (tracejoin run's first start, one CPU)": [http1],
        "all but HTTP/2's, two children at once (... two CPUs)": http1_units,
    }
    flag_sets = {"": cflags, **{f: shlex.split(f) for f in args.against_cflags}}
    got: dict[tuple[str, str], list[tuple[float, float, int]]] = {
        (flags, way): [] for flags in flag_sets for way in ways
    }
    for _ in range(args.runs):  # interleaved, so a noisy minute touches every way alike
        for flags, flag_list in flag_sets.items():
            for way, units in ways.items():
                got[flags, way].append(measure(units, flag_list))
    print(f"{len(text)} bytes of C; median of {args.runs} runs each")
    for flags, flag_list in flag_sets.items():
        print(f"\ncflags: {' '.join(flag_list)}" + (" (CFLAGS)" if not flags else ""))
        print("| compile | wall s | CPU s | peak MiB (summed) |")
        print("|---|---:|---:|---:|")
        med = {}
        for way in ways:
            runs = got[flags, way]
            wall, cpu, peak = (statistics.median(r[i] for r in runs) for i in range(3))
            med[way] = wall
            print(f"| {way} | {wall:.2f} | {cpu:.2f} | {peak / 2**20:.0f} |")
        whole, both = med["the whole text, one child"], med[list(ways)[3]]
        print(f"two at once / one child, wall: {both / whole:.2f}")


if __name__ == "__main__":
    main()
