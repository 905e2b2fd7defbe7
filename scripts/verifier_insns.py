"""Instructions the verifier processes for each tail-called program (its limit: 1,000,000).

    sudo .venv/bin/python scripts/verifier_insns.py [--ports] [--cuda] [--sizes]

Compiles bpf/http.c as the agent does (the same knobs), then loads each program's bytecode
once more with BPF_LOG_STATS and prints the verifier's "processed N insns". A program past the
limit prints the verifier's refusal. The scanners' step budgets (SCAN_CHUNK, H2_STEPS) are
sized by these figures (docs/probes.md). --sizes also lists every function's compiled size,
largest first: what clang/LLVM emitted, which its start-up time follows (docs/performance.md).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re

from tracejoin.core.metrics import Metrics
from tracejoin.kernel.features import BPF_PROG_LOAD, _bpf
from tracejoin.kernel.probes import HttpProbes, ProbeConfig

PROGRAMS = ("scan_req", "scan_resp", "run_notes", "h2_scan_rd", "h2_scan_wr", "h2_end")
BPF_PROG_TYPE_TRACEPOINT = 5
BPF_PROG_TYPE_RAW_TRACEPOINT = 17
WORKSET_PROGRAM = "ws_wake_prog"  # the work set's wake handler (a raw tracepoint's tail call)
BPF_LOG_STATS = 4
LOG_SIZE = 1 << 16


def processed(insns: bytes, prog_type: int = BPF_PROG_TYPE_TRACEPOINT) -> str:
    """Load the bytecode (its map fds already in place) with statistics only."""
    code = ctypes.create_string_buffer(insns, len(insns))
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(LOG_SIZE)
    attr = ctypes.create_string_buffer(128)
    ctypes.c_uint32.from_buffer(attr, 0).value = prog_type
    ctypes.c_uint32.from_buffer(attr, 4).value = len(insns) // 8
    ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(code)
    ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(license)
    ctypes.c_uint32.from_buffer(attr, 24).value = BPF_LOG_STATS
    ctypes.c_uint32.from_buffer(attr, 28).value = LOG_SIZE
    ctypes.c_uint64.from_buffer(attr, 32).value = ctypes.addressof(log)
    fd, err = _bpf(BPF_PROG_LOAD, attr)
    text = log.value.decode(errors="replace")
    m = re.search(r"processed (\d+) insns", text)
    figure = f"{int(m.group(1)):,}" if m else "?"
    if fd >= 0:
        os.close(fd)
        return figure
    return f"{figure} (refused: {os.strerror(err)})"


def print_sizes(bpf: object) -> None:
    from bcc import lib

    module = bpf.module  # type: ignore[attr-defined]
    sizes = {}
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        sizes[name.decode()] = lib.bpf_function_size(module, name) // 8
    print(f"compiled: {sum(sizes.values()):,} instructions in {len(sizes)} functions")
    for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]):
        print(f"  {name:44} {n:6,}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ports", action="store_true", help="compile with a port filter")
    ap.add_argument("--cuda", action="store_true", help="compile with the CUDA uprobes")
    ap.add_argument("--sizes", action="store_true", help="list the compiled functions' sizes")
    args = ap.parse_args()
    from bcc import BPF  # Debian's python3-bpfcc

    cfg = ProbeConfig(ports=(8080,) if args.ports else (), cuda=args.cuda)
    src, cflags = HttpProbes(cfg, Metrics()).render()
    bpf = BPF(text=src.encode(), cflags=cflags)
    try:
        for name in PROGRAMS:
            print(f"{name:12} {processed(bpf.dump_func(name.encode()))}", flush=True)
        insns = bpf.dump_func(WORKSET_PROGRAM.encode())
        print(f"{WORKSET_PROGRAM:12} {processed(insns, BPF_PROG_TYPE_RAW_TRACEPOINT)}", flush=True)
        if args.sizes:
            print_sizes(bpf)
    finally:
        bpf.cleanup()


if __name__ == "__main__":
    main()
