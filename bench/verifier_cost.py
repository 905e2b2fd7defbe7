"""What the kernel verifier spends on each program: a cached start's floor (docs/performance.md,
"The compile moves out of the agent").

    sudo .venv/bin/python -m bench.verifier_cost [--top 10] [--set SCAN_CHUNK=128 ...]

Renders bpf/http.c as `tracejoin run` would, compiles it in this process (no program loaded),
creates the maps, then loads each program once with the verifier's statistics on (log_level 4)
and prints its size, the instructions the verifier processed (of its 1M limit), its states and
its own time. `--set NAME=VALUE` replaces a `#define NAME` of the rendered text first, to see
what a constant costs the verifier (its runtime effect is not measured here).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import struct
import time

from tracejoin.core.metrics import Metrics
from tracejoin.kernel import compiled
from tracejoin.kernel.features import bpf_syscall
from tracejoin.kernel.probes import HttpProbes, ProbeConfig

_PROG_LOAD, _TRACEPOINT, _RAW_TRACEPOINT, _KPROBE = 5, 5, 17, 2


def _kind(name: str) -> int:
    if name.startswith("raw_tracepoint__") or name == "ws_wake_prog":
        return _RAW_TRACEPOINT
    if name.startswith("cuda_"):
        return _KPROBE
    return _TRACEPOINT


def verify(bpf: object, entry: compiled.Entry, name: str) -> tuple[float, str]:
    """Load `name` once with log_level 4 (statistics only); (seconds, the verifier's line)."""
    spec = entry.funcs[name]
    insns = ctypes.create_string_buffer(spec.insns, len(spec.insns))
    for at, idx in spec.map_refs:
        struct.pack_into("<i", insns, at * 8 + 4, bpf._map_fds[idx])  # type: ignore[attr-defined]
    log = ctypes.create_string_buffer(1 << 16)
    license = ctypes.create_string_buffer(b"GPL")
    attr = ctypes.create_string_buffer(72)
    struct.pack_into(
        "<IIQQIIQ",
        attr,
        0,
        _kind(name),
        len(spec.insns) // 8,
        ctypes.addressof(insns),
        ctypes.addressof(license),
        4,
        len(log),
        ctypes.addressof(log),
    )
    t0 = time.monotonic()
    fd, err = bpf_syscall(_PROG_LOAD, attr)
    secs = time.monotonic() - t0
    if fd >= 0:
        os.close(fd)
    stats = [ln for ln in log.value.decode(errors="replace").splitlines() if "processed" in ln]
    return secs, stats[0] if stats else f"refused: {os.strerror(err)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=10, help="the N largest programs (0: all)")
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE: a #define to change")
    args = ap.parse_args()
    src, cflags = HttpProbes(ProbeConfig(), Metrics()).render()
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
        names = sorted(entry.funcs, key=lambda n: -len(entry.funcs[n].insns))
        print(f"{'program':40s} {'insns':>6s} {'verify s':>8s}  verifier")
        total = 0.0
        for name in names[: args.top or None]:
            secs, line = verify(bpf, entry, name)
            total += secs
            print(f"{name[:40]:40s} {len(entry.funcs[name].insns) // 8:6d} {secs:8.2f}  {line}")
        print(f"{'(these, one after another)':40s} {'':6s} {total:8.2f}")
    finally:
        bpf.cleanup()


if __name__ == "__main__":
    main()
