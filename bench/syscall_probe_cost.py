"""What tracejoin's syscall probes cost every other process, by how they keep per-syscall state.

    sudo python -m bench.syscall_probe_cost [--calls 500000] [--rounds 3]

Until 2026-12-04 tracejoin's `sys_enter_read` remembered (fd, buffer, length) per thread for
the socket event inside the read, and `sys_exit_read` forgot it, for EVERY thread on the host
(a port filter cannot act before the socket is known). Since then the socket event reads the
syscall's arguments from the thread's saved registers and nothing runs at the entry; the exit
stays (it runs what a scan left for the syscall's end). This loads, one at a time, small
programs on syscalls:sys_enter_read/sys_exit_read that differ only in that state, and times an
unrelated process's 1-byte read() of /dev/zero (bench/loadgen `syscall`) under each,
interleaved over `rounds`:

  none          nothing attached (the baseline)
  empty         both programs attached, returning at once: the tracepoint + BPF entry cost
  lru_hash      update on entry, delete on exit: bpf/http.c before issue 13
  hash          the same with a preallocated BPF_HASH
  task_storage  BPF_TASK_STORAGE: get-or-create on entry and write; clear a flag on exit:
                bpf/http.c until 2026-12-04
  percpu_array  one slot per CPU (thread id checked on use): no map lookup by key at all
  exit_only     no entry program; the exit reads one per-CPU array slot: bpf/http.c now

Prints ns per read() and the difference to `none`. Not part of `make bench` (it compiles seven
programs); docs/performance.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench import measure as m

HEADER = r"""
struct pending_io {
    u64 buf;
    u64 len;
    u32 fd;
    u32 has_buf;
};
"""

VARIANTS: dict[str, str] = {
    "empty": r"""
TRACEPOINT_PROBE(syscalls, sys_enter_read) { return 0; }
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return 0; }
""",
    "lru_hash": r"""
BPF_TABLE("lru_hash", u64, struct pending_io, pending_rd, 16384);
TRACEPOINT_PROBE(syscalls, sys_enter_read) {
    u64 id = bpf_get_current_pid_tgid();
    struct pending_io p = {.buf = (u64)args->buf, .len = args->count, .fd = args->fd, .has_buf = 1};
    pending_rd.update(&id, &p);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) {
    u64 id = bpf_get_current_pid_tgid();
    pending_rd.delete(&id);
    return 0;
}
""",
    "hash": r"""
BPF_HASH(pending_rd, u64, struct pending_io, 16384);
TRACEPOINT_PROBE(syscalls, sys_enter_read) {
    u64 id = bpf_get_current_pid_tgid();
    struct pending_io p = {.buf = (u64)args->buf, .len = args->count, .fd = args->fd, .has_buf = 1};
    pending_rd.update(&id, &p);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) {
    u64 id = bpf_get_current_pid_tgid();
    pending_rd.delete(&id);
    return 0;
}
""",
    "task_storage": r"""
BPF_TASK_STORAGE(pending_rd, struct pending_io);
TRACEPOINT_PROBE(syscalls, sys_enter_read) {
    struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
    struct pending_io *p = pending_rd.task_storage_get(task, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (p) {
        p->buf = (u64)args->buf;
        p->len = args->count;
        p->fd = args->fd;
        p->has_buf = 1;
    }
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) {
    struct task_struct *task = (struct task_struct *)bpf_get_current_task_btf();
    struct pending_io *p = pending_rd.task_storage_get(task, 0, 0);
    if (p)
        p->has_buf = 0;
    return 0;
}
""",
    "percpu_array": r"""
struct slot { struct pending_io p; u64 id; };
BPF_PERCPU_ARRAY(pending_rd, struct slot, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_read) {
    int z = 0;
    struct slot *s = pending_rd.lookup(&z);
    if (s) {
        s->id = bpf_get_current_pid_tgid();
        s->p.buf = (u64)args->buf;
        s->p.len = args->count;
        s->p.fd = args->fd;
        s->p.has_buf = 1;
    }
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) {
    int z = 0;
    struct slot *s = pending_rd.lookup(&z);
    if (s)
        s->id = 0;
    return 0;
}
""",
    "exit_only": r"""
BPF_PERCPU_ARRAY(scratch, struct pending_io, 1);
TRACEPOINT_PROBE(syscalls, sys_exit_read) {
    int z = 0;
    struct pending_io *s = scratch.lookup(&z);
    if (s && s->has_buf)
        s->has_buf = 0;
    return 0;
}
""",
}


def measure(variant: str, calls: int, cpu: int | None) -> float:
    if variant == "none":
        return float(m.syscalls(calls, 3, cpu)["read_devzero_ns"])
    from bcc import BPF

    bpf = BPF(text=(HEADER + VARIANTS[variant]).encode())
    try:
        return float(m.syscalls(calls, 3, cpu)["read_devzero_ns"])
    finally:
        bpf.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=500_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=1 if (os.cpu_count() or 1) > 1 else None)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("syscall_probe_cost: must run as root (BPF)", file=sys.stderr)
        return 2
    names = ["none", *VARIANTS]
    ns: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            ns[n].append(measure(n, args.calls, args.cpu))
    base = statistics.median(ns["none"])
    print(f"read(/dev/zero, 1 B) by an unrelated process, median of {args.rounds} rounds:")
    print(f"  {'variant':<14} {'ns/read':>8} {'Δ vs none':>10}   rounds")
    for n in names:
        med = statistics.median(ns[n])
        each = " ".join(f"{x:.0f}" for x in ns[n])
        print(f"  {n:<14} {med:>8.0f} {med - base:>+10.0f}   {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
