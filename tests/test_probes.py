"""Which programs load, and the hardware-TLB path that this VM cannot run."""

from __future__ import annotations

import os
import re

import pytest
from tracejoin.core.metrics import Metrics
from tracejoin.kernel import compiled, probes
from tracejoin.kernel.probes import HttpProbes, ProbeConfig, ProbeError


def _knobs(cfg: ProbeConfig) -> dict[str, int | None]:
    return HttpProbes(cfg, Metrics()).plan()


@pytest.mark.privileged
def test_missing_optional_tracepoint_drops_only_its_signal(require_root):
    knobs = _knobs(ProbeConfig(disabled_tracepoints=frozenset({"sock:sk_data_ready"})))
    assert "WITH_RECVQ" not in knobs
    assert "WITH_SCHED" in knobs and "WITH_TCPSTATS" in knobs


@pytest.mark.privileged
def test_missing_required_tracepoint_is_an_error_naming_it(require_root):
    with pytest.raises(ProbeError, match="sock:sock_recv_length"):
        _knobs(ProbeConfig(disabled_tracepoints=frozenset({"sock:sock_recv_length"})))


@pytest.mark.privileged
def test_tlb_hardware_forced_without_pmu_is_a_clear_error(require_root, monkeypatch):
    monkeypatch.setattr(probes, "pmu_tlb_available", lambda: False)
    with pytest.raises(ProbeError, match="no hardware dTLB/iTLB counter"):
        _knobs(ProbeConfig(tlb_hardware=True))


@pytest.mark.privileged
def test_tlb_hardware_path_is_selected_and_passes_the_verifier(require_root, monkeypatch):
    """With a PMU the hardware path is chosen instead of the flush fallback; its programs
    (the counters read at switch in/out and at request start and finish, in the scanners)
    compile and pass the verifier here even though no counter can be opened in this VM."""
    monkeypatch.setattr(probes, "pmu_tlb_available", lambda: True)
    probe = HttpProbes(ProbeConfig(), Metrics())
    assert "TLB_HW" in probe.plan()
    src, flags = probe.render()
    assert "flush_tlb_hw" in src  # the running slice is read at request start and end
    from bcc import BPF

    # compiled and loaded as a start does: BCC alone cannot link the scanners' bpf_loop callbacks
    b = compiled.cached_bpf(compiled._compile_here(src, flags, "tlb_hw"))
    try:
        b.autoload()
        # raw tracepoints where the kernel's BTF gives task_struct's pid offset (it does here)
        raw = set(b.raw_tracepoint_fds)
        assert b"sched_switch" in raw  # reads the counters at switch in/out
        assert b"tlb_flush" not in raw  # the fallback is compiled out
        assert b.get_table(b"dtlb") is not None and b.get_table(b"itlb") is not None
        for name in (b"scan_req", b"scan_resp"):  # read them at request start and finish
            b.load_func(name, BPF.TRACEPOINT)
    finally:
        b.cleanup()
    assert probes.DTLB_READ_MISS == 3 | (0 << 8) | (1 << 16)
    assert probes.ITLB_READ_MISS == 4 | (0 << 8) | (1 << 16)


@pytest.mark.privileged
def test_tlb_hardware_requires_the_sched_signal(require_root, monkeypatch):
    """The counters are per CPU: a thread's share is right only when read at each of its
    context switches. Without sched:sched_switch, auto falls back to flushes and a forced
    hardware mode is an error naming the missing signal."""
    monkeypatch.setattr(probes, "pmu_tlb_available", lambda: True)
    no_sched = frozenset({"sched:sched_switch"})
    knobs = _knobs(ProbeConfig(disabled_tracepoints=no_sched))
    assert "TLB_HW" not in knobs and "WITH_SCHED" not in knobs
    assert "WITH_TLB_FLUSH" in knobs
    with pytest.raises(ProbeError, match="needs the sched signal"):
        _knobs(ProbeConfig(disabled_tracepoints=no_sched, tlb_hardware=True))
    assert "TLB_HW" in _knobs(ProbeConfig(tlb_hardware=True))


def test_tlb_hardware_without_sched_does_not_compile(tmp_path):
    """The same rule in the C: TLB_HW without WITH_SCHED is a compile error, not a silent 0."""
    src = probes.bpf_source_dir()
    base = {"NCPU": 2, "ARCH_X86_64": None, "TLB_HW": None}
    alone = probes.render_source(src, "http.c", base)
    assert "#error" in alone
    both = probes.render_source(src, "http.c", {**base, "WITH_SCHED": None})
    assert "#error" not in both


# ------------------------------------------------------------------------------ rendering


def test_render_inlines_local_includes_and_resolves_knob_conditionals(tmp_path):
    (tmp_path / "a.h").write_text(
        "#ifndef A_H\n#define A_H\nint in_a;\n#ifdef WITH_SCHED\nint sched;\n#else\n"
        "int no_sched;\n#endif\n#endif\n"
    )
    (tmp_path / "main.c").write_text(
        '#include <linux/types.h>\n#include "a.h"\n#include "a.h"\n'
        "#if defined(WITH_TLB_FLUSH) && !defined(TLB_HW)\nint flush;\n#endif\n"
        "#ifndef NCPU\n#define NCPU 64\n#endif\n#ifdef FILTER_PID\nint pid;\n#endif\n"
    )
    text = probes.render_source(tmp_path, "main.c", {"NCPU": 4, "WITH_TLB_FLUSH": None})
    lines = text.splitlines()
    assert "#define NCPU 4" in lines and "#define WITH_TLB_FLUSH" in lines
    assert "#include <linux/types.h>" in lines  # system headers stay
    assert not any(line.startswith('#include "') for line in lines)
    assert lines.count("int in_a;") == 1
    assert "int no_sched;" in lines and "int sched;" not in lines
    assert "int flush;" in lines and "int pid;" not in lines
    assert "#define NCPU 64" not in lines  # the default is dead code once NCPU is a knob
    assert "#ifndef A_H" in lines  # a guard is not a knob: left to the compiler
    for knob in ("WITH_SCHED", "FILTER_PID", "NCPU", "TLB_HW"):
        assert not any(knob in line for line in lines if line.lstrip().startswith("#if")), knob


def test_every_conditional_in_the_bpf_sources_is_a_knob_or_a_guard():
    """So the rendered text has no conditional left that the planner decides."""
    names = set()
    for f in probes.bpf_source_dir().iterdir():
        if f.suffix in (".c", ".h"):
            for line in f.read_text().splitlines():
                m = re.match(r"\s*#\s*(ifdef|ifndef|if)\s+(.*)", line)
                if m:
                    names |= set(re.findall(r"[A-Z][A-Z0-9_]+", m.group(2)))
    assert {n for n in names if not n.endswith("_H")} <= probes.KNOBS


@pytest.mark.privileged
def test_ebpf_command_prints_exactly_the_text_that_is_compiled(require_root):
    from click.testing import CliRunner
    from tracejoin.commands.cli import main

    out = CliRunner().invoke(main, ["ebpf", "--disable-tracepoint", "sched:sched_switch"])
    assert out.exit_code == 0, out.output
    probe = HttpProbes(
        ProbeConfig(disabled_tracepoints=frozenset({"sched:sched_switch"})),
        Metrics(),
    )
    src, flags = probe.render()
    assert out.output == f"// cflags: {' '.join(flags)}\n{src}\n"
    assert not any(f.startswith(("-D", "-I")) for f in flags)  # everything is in the text
    for name in ("http_record.h", "http_conn.h", "http_request.h", "http_response.h"):
        assert f"/* ---- bpf/{name} ---- */" in src
    assert "#define WITH_RECVQ" in src.splitlines()
    assert "RAW_TRACEPOINT_PROBE(sk_data_ready)" in src
    assert "sched_switch" not in src  # its signal is off: its program is not compiled
    assert "#ifdef" not in src.replace("#ifdef TRACEJOIN", "")


@pytest.mark.privileged
def test_start_compiles_in_a_child_and_releases_the_compilers_code(require_root):
    """The agent never runs clang/LLVM itself: start() has a child compile, loads what it
    made, then drops the mappings of clang/LLVM's code that `import bcc` touched (tens of MB,
    bench/startup.py; here only: some). Dropped code is read back from the file on use: a
    compile in this process still works afterwards, and so does the module."""
    from bcc import BPF

    probe = HttpProbes(ProbeConfig(), Metrics())
    try:
        probe.start()
        assert probe.status.bpf_source == "compiled" and probe.status.bpf_cache_path == ""
        assert probe.status.compile_peak_bytes > 50 * 2**20  # the children's, not ours
        # two compilers at once, where there are two CPUs for them
        assert probe.status.compile_units == min(2, len(os.sched_getaffinity(0)))
        assert probe.status.code_released_bytes > 8 * 2**20
        again = BPF(text=b"int empty(void *ctx) { return 0; }")  # runs clang and LLVM again
        try:
            assert again.load_func(b"empty", BPF.TRACEPOINT).fd >= 0
        finally:
            again.cleanup()
        assert "records_submitted" in probe.kernel_counters()
        # every read and write on the host passes the syscall tracepoints: only their exits
        # run a program (a socket event reads its syscall's arguments from the registers)
        attached = {bytes(tp).decode() for tp in probe._bpf.tracepoint_fds}
        assert "syscalls:sys_exit_read" in attached and "syscalls:sys_exit_sendmsg" in attached
        assert not [tp for tp in attached if tp.startswith("syscalls:sys_enter_")]
        probe.poll(0)
    finally:
        probe.shutdown()


def test_only_the_compilers_code_mappings_are_dropped():
    """r-xp mappings of libLLVM/libclang-cpp only: not their data (relocated, private
    copies), not other libraries, not anonymous code."""
    maps = [
        "7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/libLLVM-14.so.1",
        "7f0000001000-7f0000009000 r-xp 00001000 08:01 1 /usr/lib/libLLVM-14.so.1",
        "7f0000009000-7f000000a000 rw-p 00009000 08:01 1 /usr/lib/libLLVM-14.so.1",
        "7f0000010000-7f0000020000 r-xp 00000000 08:01 2 /usr/lib/llvm-14/lib/libclang-cpp.so.14",
        "7f0000030000-7f0000031000 r-xp 00000000 08:01 3 /usr/lib/libc.so.6",
        "7f0000040000-7f0000041000 r-xp 00000000 08:01 4 /usr/lib/libbcc.so.0.26.0",
        "7f0000050000-7f0000051000 r-xp 00000000 00:00 0",
    ]
    assert probes.compiler_code_ranges(maps) == [
        (0x7F0000001000, 0x7F0000009000),
        (0x7F0000010000, 0x7F0000020000),
    ]


@pytest.mark.privileged
def test_a_per_cpu_array_read_in_one_batch_matches_key_by_key(require_root):
    """kernel_counters reads `counters` with one BPF_MAP_LOOKUP_BATCH: the same sums as a
    lookup per key, on a per-CPU array this process's own syscalls count into."""
    import ctypes
    import os

    from bcc import BPF

    b = BPF(
        text=b"""
BPF_PERCPU_ARRAY(counts, u64, 16);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if ((bpf_get_current_pid_tgid() >> 32) != TGID)
        return 0;
    u32 i = bpf_get_prandom_u32() % 16;
    u64 *v = counts.lookup(&i);
    if (v)
        (*v) += i + 1;
    return 0;
}
""",
        cflags=[f"-DTGID={os.getpid()}"],
    )
    try:
        for _ in range(500):
            os.getppid()
        table = b[b"counts"]
        batch = probes._batch_values(table, 16)
        assert batch is not None
        by_key = [sum(table[ctypes.c_int(i)]) for i in range(16)]
        assert [sum(v) for v in batch] == by_key
        assert sum(n // (i + 1) for i, n in enumerate(by_key)) == 500  # every call counted once
    finally:
        b.cleanup()


@pytest.mark.privileged
def test_the_other_architectures_syscall_branch_compiles(require_root, tmp_path):
    """Only one architecture's syscall_args runs on a host; the other's must not rot unseen: it
    compiles (the compiler's child, as a start does; nothing is loaded or attached)."""
    p = HttpProbes(ProbeConfig(), Metrics())
    knobs = p.plan()
    ours = next(k for k in probes.SYSCALL_ABI_KNOBS.values() if k in knobs)
    other = next(k for k in probes.SYSCALL_ABI_KNOBS.values() if k != ours)
    del knobs[ours]
    text, cflags = p.render({**knobs, other: None})
    assert f"#define {other}" in text
    units, _ = compiled._compile_in_children([text], cflags, "other-arch", tmp_path)
    assert len(units) == 1


@pytest.mark.privileged
def test_only_a_kernel_without_the_tuple_at_read_has_addresses_read_from_fds(require_root):
    """The reader polls sooner (stages.POLL_MS_FDS) only where a record may carry its pid and fd
    instead of its addresses: without tcp:tcp_rcv_space_adjust. Before the plan: the cautious
    answer."""
    probe = HttpProbes(ProbeConfig(), Metrics())
    assert probe.addresses_from_fds
    probe.plan()
    assert not probe.addresses_from_fds
    no_tuple = frozenset({"tcp:tcp_rcv_space_adjust"})
    probe = HttpProbes(ProbeConfig(disabled_tracepoints=no_tuple), Metrics())
    probe.plan()
    assert probe.addresses_from_fds
