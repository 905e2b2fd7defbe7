"""What the kernel verifier spends on each program: a cached start's floor (docs/performance.md,
"The compile moves out of the agent").

    sudo .venv/bin/python -m bench.verifier_cost [--top 10] [--ports] [--cuda] [--set N=V ...]

Renders bpf/http.c as `tracejoin run` would (--ports: with a port filter; --cuda: with the CUDA
uprobes), compiles it in this process (no program loaded), creates the maps, then loads each
program (the bpf_loop callbacks linked into it) once with the verifier's statistics on
(log_level 4) and prints its size, the instructions the verifier processed (of its 1M limit),
its states and its own time; a program the verifier refuses says so. The scanners' step budgets
(SCAN_CHUNK, LOOP_STEPS, H2_STEPS) are sized by these figures (docs/probes.md). `--set
NAME=VALUE` replaces a `#define NAME` of the rendered text first, to see what a constant costs
the verifier (its runtime effect is not measured here).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import time

from tracejoin.core.metrics import Metrics
from tracejoin.kernel import compiled
from tracejoin.kernel.probes import HttpProbes, ProbeConfig

_PROG_LOAD, _TRACEPOINT, _RAW_TRACEPOINT, _KPROBE = 5, 5, 17, 2


def _kind(name: str) -> int:
    if name.startswith("raw_tracepoint__") or name in ("ws_wake_prog", "ws_wake_more"):
        return _RAW_TRACEPOINT
    if name.startswith("cuda_"):
        return _KPROBE
    return _TRACEPOINT


def verify(bpf: object, name: str) -> tuple[float, str]:
    """Load `name` once with log_level 4 (statistics only); (seconds, the verifier's line)."""
    log = ctypes.create_string_buffer(1 << 16)
    t0 = time.monotonic()
    fd, err, _ = compiled.prog_load(bpf, name, _kind(name), 4, log)
    secs = time.monotonic() - t0
    if fd >= 0:
        os.close(fd)
    stats = [ln for ln in log.value.decode(errors="replace").splitlines() if "processed" in ln]
    line = stats[0] if stats else ""
    return secs, line if fd >= 0 else f"refused ({os.strerror(err)}): {line}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=10, help="the N largest programs (0: all)")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE: a #define to change")
    ap.add_argument("--ports", action="store_true", help="render with a port filter")
    ap.add_argument("--cuda", action="store_true", help="render with the CUDA uprobes")
    args = ap.parse_args()
    cfg = ProbeConfig(ports=(8080,) if args.ports else (), cuda=args.cuda)
    src, cflags = HttpProbes(cfg, Metrics()).render()
    for item in args.set:
        key, _, value = item.partition("=")
        src, n = re.subn(
            rf"^#define {re.escape(key)} .*$", f"#define {key} {value}", src, flags=re.M
        )
        if not n:
            raise SystemExit(f"--set {item}: no '#define {key}' in the rendered text")
    entry = compiled._compile_here(src, list(cflags), "verifier_cost")
    bpf = compiled.cached_bpf(entry)
    try:
        # a bpf_loop callback is verified inside each program it is linked into
        linked = {cb for f in entry.funcs.values() for _, cb in f.subprogs}
        names = sorted(set(entry.funcs) - linked, key=lambda n: -len(entry.funcs[n].insns))
        print(f"{'program':40s} {'insns':>6s} {'verify s':>8s}  verifier")
        total = 0.0
        for name in names[: args.top or None]:
            secs, line = verify(bpf, name)
            total += secs
            print(f"{name[:40]:40s} {len(entry.funcs[name].insns) // 8:6d} {secs:8.2f}  {line}")
        print(f"{'(these, one after another)':40s} {'':6s} {total:8.2f}")
    finally:
        bpf.cleanup()


if __name__ == "__main__":
    main()
