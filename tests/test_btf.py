"""Struct member offsets from BTF (agent/kernel/btf.py): a synthetic blob, bad input, the running
kernel's own type information checked against bpftool where both exist, and the work-set signal
the planner turns off (saying why) without them."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from tracejoin.core.metrics import Metrics
from tracejoin.kernel import probes
from tracejoin.kernel.btf import VMLINUX_BTF, BtfError, member_offsets, struct_offsets
from tracejoin.kernel.probes import HttpProbes, ProbeConfig

STRINGS = b"\0int\0a\0b\0task\0flags\0bits\0"


def _name(s: str) -> int:
    return STRINGS.index(b"\0" + s.encode() + b"\0") + 1


def _blob(members_flag: int = 0) -> bytes:
    """int; struct { int a; int b; } (anonymous); struct task { int flags; <anon>; int bits:3 }"""
    t = struct.pack("<III", _name("int"), 1 << 24, 4) + struct.pack("<I", 32)
    t += struct.pack("<III", 0, (4 << 24) | 2, 8)
    t += struct.pack("<III", _name("a"), 1, 0) + struct.pack("<III", _name("b"), 1, 32)
    t += struct.pack("<III", _name("task"), (4 << 24) | 3 | members_flag, 24)
    t += struct.pack("<III", _name("flags"), 1, 0)
    t += struct.pack("<III", 0, 2, 64)
    bits = (3 << 24) | 128 if members_flag else 128
    t += struct.pack("<III", _name("bits"), 1, bits)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(t), len(t), len(STRINGS))
    return hdr + t + STRINGS


def test_members_and_anonymous_members(tmp_path: Path) -> None:
    f = tmp_path / "btf"
    f.write_bytes(_blob())
    assert member_offsets("task", ("flags", "a", "b"), f) == {"flags": 0, "a": 8, "b": 12}


def test_a_bitfield_or_a_missing_member_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "btf"
    f.write_bytes(_blob(members_flag=1 << 31))
    with pytest.raises(BtfError, match="bitfield"):
        member_offsets("task", ("bits",), f)
    f.write_bytes(_blob())
    with pytest.raises(BtfError, match="no member nope"):
        member_offsets("task", ("nope",), f)
    with pytest.raises(BtfError, match="not in"):
        member_offsets("other", ("a",), f)


def test_several_structs_in_one_pass_each_with_its_own_answer(tmp_path: Path) -> None:
    """struct_offsets (the planner's one read of the blob) answers per struct: offsets for the
    one that is there, the reason for each that is not, as member_offsets would raise it."""
    f = tmp_path / "btf"
    f.write_bytes(_blob())
    got = struct_offsets({"task": ("flags", "b"), "other": ("a",)}, f)
    assert got["task"] == {"flags": 0, "b": 12}
    assert isinstance(got["other"], BtfError) and "not in" in str(got["other"])
    got = struct_offsets({"task": ("flags", "nope")}, f)
    assert isinstance(got["task"], BtfError) and "no member nope" in str(got["task"])


@pytest.mark.parametrize(
    "blob",
    [b"", b"\x9f\xeb" + b"\0" * 30, _blob()[:40], b"\0" * 64],
    ids=["empty", "short-sections", "truncated", "bad-magic"],
)
def test_malformed_blobs_raise_btf_error(tmp_path: Path, blob: bytes) -> None:
    f = tmp_path / "btf"
    f.write_bytes(blob)
    with pytest.raises(BtfError):
        member_offsets("task", ("flags",), f)


def test_missing_file_raises_btf_error(tmp_path: Path) -> None:
    with pytest.raises(BtfError, match="cannot read"):
        member_offsets("task_struct", ("flags",), tmp_path / "absent")


def test_running_kernel_task_struct_matches_bpftool() -> None:
    if not VMLINUX_BTF.exists():
        pytest.skip(f"{VMLINUX_BTF} is missing: this kernel has no BTF")
    ours = member_offsets("task_struct", ("flags", "pid", "tgid", "comm"))
    assert ours["pid"] + 4 == ours["tgid"]  # adjacent pid_t fields in every kernel since 2.6
    bpftool = shutil.which("bpftool")
    if bpftool is None:
        pytest.skip("bpftool is not installed to cross-check the offsets")
    raw = subprocess.run(
        [bpftool, "btf", "dump", "file", str(VMLINUX_BTF), "format", "raw"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    body = raw[raw.index("STRUCT 'task_struct' size") :]
    for member, off in ours.items():
        m = re.search(rf"'{member}' type_id=\d+ bits_offset=(\d+)", body)
        assert m is not None and int(m.group(1)) == off * 8, member


def test_syscall_register_offsets_are_the_running_kernels() -> None:
    """bpf/http.c reads a socket event's syscall number and arguments from the thread's saved
    registers at fixed offsets (the user ABI's layout): they are struct pt_regs' own here."""
    if not VMLINUX_BTF.exists():
        pytest.skip(f"{VMLINUX_BTF} is missing: this kernel has no BTF")
    text = (probes.bpf_source_dir() / "http.c").read_text()

    def at(name: str) -> int:
        m = re.search(rf"#define {name} (\d+)", text)
        assert m is not None, name
        return int(m.group(1))

    machine = os.uname().machine
    if machine == "x86_64":
        names = ("dx", "si", "di", "orig_ax", "ip", "cs")  # the order syscall_args reads them
        ours = member_offsets("pt_regs", names)
        assert [ours[n] for n in names] == [at("PT_REGS_DX_AT") + 8 * i for i in range(6)]
    elif machine == "aarch64":
        ours = member_offsets("pt_regs", ("regs", "pstate", "orig_x0", "syscallno"))
        assert ours["regs"] + 8 == at("PT_REGS_X1_AT")
        assert (ours["pstate"], ours["orig_x0"], ours["syscallno"]) == (
            at("PT_REGS_PSTATE_AT"),
            at("PT_REGS_PSTATE_AT") + 8,
            at("PT_REGS_PSTATE_AT") + 16,
        )
    else:
        pytest.skip(f"bpf/http.c reads no syscall registers on {machine}")


def _plan(cfg: ProbeConfig) -> tuple[dict[str, int | None], dict[str, str]]:
    p = HttpProbes(cfg, Metrics())
    return p.plan(), p.status.signals


@pytest.mark.privileged
def test_workset_knobs_are_the_running_kernels_offsets(require_root):
    knobs, signals = _plan(ProbeConfig())
    assert signals["workset"] == "on"
    offsets = member_offsets("task_struct", ("flags", "pid", "tgid", "comm"))
    assert {k: knobs[k] for k in probes.TASK_MEMBERS.values()} == {
        probes.TASK_MEMBERS[m]: off for m, off in offsets.items()
    }
    assert "WITH_WORKSET" in knobs


@pytest.mark.privileged
@pytest.mark.parametrize(
    ("cfg", "why"),
    [
        (ProbeConfig(workset=False), "off: disabled by configuration"),
        (
            ProbeConfig(disabled_tracepoints=frozenset({"sched:sched_switch"})),
            "off: needs the sched signal",
        ),
        (
            ProbeConfig(disabled_tracepoints=frozenset({"sched:sched_waking"})),
            "off: tracepoint sched:sched_waking missing",
        ),
    ],
)
def test_workset_off_says_why_and_drops_its_knobs(require_root, cfg, why):
    knobs, signals = _plan(cfg)
    assert signals["workset"] == why
    assert "WITH_WORKSET" not in knobs
    # the pid offset stays for the scheduler's raw tracepoints, where sched is on
    assert set(probes.TASK_MEMBERS.values()) & set(knobs) <= {"TASK_PID_OFF"}
    assert ("TASK_PID_OFF" in knobs) == ("WITH_SCHED" in knobs)


@pytest.mark.privileged
def test_workset_off_without_btf(require_root, monkeypatch):
    def no_btf(*_a: object, **_k: object) -> dict[str, int]:
        raise BtfError("cannot read /sys/kernel/btf/vmlinux: gone")

    monkeypatch.setattr(probes, "struct_offsets", no_btf)
    knobs, signals = _plan(ProbeConfig())
    assert signals["workset"].startswith("off: task_struct offsets not found in the kernel's BTF")
    assert "WITH_WORKSET" not in knobs and "WITH_SCHED" in knobs
    assert "TASK_PID_OFF" not in knobs  # the scheduler's programs: classic tracepoints


@pytest.mark.privileged
def test_sched_without_btf_attaches_classic_tracepoints_that_still_measure(
    require_root, monkeypatch
):
    """Without BTF the scheduler programs read the pids from the perf trace record instead of
    the tasks: a run-queue wait behind a spinner on the server's CPU is still measured."""
    from harness import Agent, free_ports, new_traceparent, raw_request, server

    def no_btf(*_a: object, **_k: object) -> dict[str, int]:
        raise BtfError("cannot read /sys/kernel/btf/vmlinux: gone")

    monkeypatch.setattr(probes, "struct_offsets", no_btf)
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs to pin the server and its spinner apart from the agent")
    cpu = (os.cpu_count() or 2) - 1
    (port,) = free_ports(1)
    agent = Agent([port], None)
    agent.start()
    try:
        bpf = agent.pipeline.source._bpf
        assert b"sched:sched_switch" in bpf.tracepoint_fds
        assert b"sched:sched_wakeup" in bpf.tracepoint_fds
        assert b"sched_switch" not in bpf.raw_tracepoint_fds
        with server("threaded", port, cpu=cpu):
            hog = subprocess.Popen(["taskset", "-c", str(cpu), "python3", "-c", "while 1: pass"])
            try:
                waits = []
                for _ in range(3):
                    tp, trace_id, _ = new_traceparent()
                    raw_request(
                        port,
                        f"GET /spin?ms=40 HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n"
                        "Connection: close\r\n\r\n".encode(),
                    )
                    (span,) = agent.server_spans(trace_id)
                    waits.append(span.attributes["tracejoin.sched.runq_wait_ns"])
            finally:
                hog.kill()
                hog.wait()
        assert max(waits) > 5e6, waits  # sharing one CPU with a spinner: milliseconds
    finally:
        agent.shutdown()


def _btf(types: bytes, strings: bytes, type_len: int | None = None) -> bytes:
    """A BTF blob: header, then the type section (`type_len` may claim less than is there)."""
    tlen = len(types) if type_len is None else type_len
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, tlen, len(types), len(strings))
    return hdr + types + strings


def test_descends_through_modifiers_and_unions_declared_after_the_struct(tmp_path: Path) -> None:
    """The first `task` has no members (skipped, as a forward declaration would be); the second
    names `task` through its own copy of the string (not deduplicated) and reaches `a` and `b`
    through a const anonymous union and a nested anonymous struct, all with higher type ids."""
    strings = b"\0int\0task\0flags\0a\0b\0task\0"

    def off(s: str, nth: int = 0) -> int:
        i = -1
        for _ in range(nth + 1):
            i = strings.index(b"\0" + s.encode() + b"\0", i + 1)
        return i + 1

    t = struct.pack("<IIII", off("int"), 1 << 24, 4, 32)  # 1: int
    t += struct.pack("<III", off("task"), 4 << 24, 0)  # 2: struct task {} (no members)
    t += struct.pack("<III", off("task", 1), (4 << 24) | 2, 24)  # 3: struct task
    t += struct.pack("<III", off("flags"), 1, 0) + struct.pack("<III", 0, 4, 64)
    t += struct.pack("<III", 0, 10 << 24, 5)  # 4: const -> 5
    t += struct.pack("<III", 0, (5 << 24) | 2, 8)  # 5: union { int a; struct {...} }
    t += struct.pack("<III", off("a"), 1, 0) + struct.pack("<III", 0, 6, 0)
    t += struct.pack("<III", 0, (4 << 24) | 1, 8)  # 6: struct { <32 bits> int b; }
    t += struct.pack("<III", off("b"), 1, 32)
    f = tmp_path / "btf"
    f.write_bytes(_btf(t, strings))
    assert member_offsets("task", ("flags", "a", "b"), f) == {"flags": 0, "a": 8, "b": 12}


def test_a_member_not_on_a_byte_boundary_is_refused(tmp_path: Path) -> None:
    strings = b"\0int\0task\0odd\0"
    t = struct.pack("<IIII", 1, 1 << 24, 4, 32)
    t += struct.pack("<III", 5, (4 << 24) | 1, 8) + struct.pack("<III", 10, 1, 4)
    f = tmp_path / "btf"
    f.write_bytes(_btf(t, strings))
    with pytest.raises(BtfError, match="member odd is not byte-aligned"):
        member_offsets("task", ("odd",), f)


@pytest.mark.parametrize(
    ("types", "type_len", "error"),
    [
        (struct.pack("<III", 0, 31 << 24, 0), None, "unknown BTF kind 31"),
        # a struct whose member list runs past the length the header gives the type section
        (struct.pack("<III", 1, (4 << 24) | 2, 8) + b"\0" * 24, 24, "runs past the type section"),
        # a pointer, then 4 bytes: not a whole 12-byte record
        (struct.pack("<III", 0, 2 << 24, 1) + b"\0" * 4, None, "runs past the type section"),
    ],
    ids=["unknown-kind", "members-past-section", "partial-record"],
)
def test_malformed_type_sections_raise_btf_error(
    tmp_path: Path, types: bytes, type_len: int | None, error: str
) -> None:
    f = tmp_path / "btf"
    f.write_bytes(_btf(types, b"\0task\0", type_len))
    with pytest.raises(BtfError, match=error):
        member_offsets("task", ("flags",), f)


@pytest.mark.privileged
@pytest.mark.parametrize("btf", [True, False], ids=["raw tracepoints", "no BTF: classic"])
def test_socket_programs_read_the_tuple_and_rtt_with_or_without_btf(require_root, monkeypatch, btf):
    """With the BTF's offsets sock_recv_length reads the tuple from the socket and
    sock_send_length the RTT (nothing at tcp_rcv_space_adjust or tcp_probe); without them both
    are classic tracepoints reading the perf trace record: either way a keep-alive connection
    opened before the agent started gets its 4-tuple (and the port filter) from the kernel, and
    its request an RTT. /proc is taken away, so the tuple can only be the kernel's."""
    from harness import Agent, free_ports, server
    from hostile import Conn, get_bytes, new_sent
    from tracejoin.enrich import correlate

    if not btf:

        def no_btf(*_a: object, **_k: object) -> dict[str, int]:
            raise BtfError("cannot read /sys/kernel/btf/vmlinux: gone")

        monkeypatch.setattr(probes, "struct_offsets", no_btf)
    monkeypatch.setattr(correlate.ConnectionTable, "_resolve", lambda *_a: None)
    (port,) = free_ports(1)
    with server("go", port):
        early = Conn(port)  # before the agent: no inet_sock_set_state for it
        agent = Agent([port], None)
        agent.start()
        try:
            bpf = agent.pipeline.source._bpf
            for tp in ("tcp_rcv_space_adjust", "tcp_probe"):
                assert tp.encode() not in bpf.raw_tracepoint_fds
                assert (f"tcp:{tp}".encode() in bpf.tracepoint_fds) is not btf
            s = new_sent("/early")
            assert early.request(get_bytes(s)) == 200
            (span,) = agent.server_spans(s.trace_id)
            attrs = span.attributes
            host, cport = early.sock.getsockname()
            assert (attrs["client.address"], attrs["client.port"]) == (host, cport)
            assert attrs["server.port"] == port
            assert attrs.get("tracejoin.tcp.srtt_us", 0) > 0
        finally:
            early.close()
            agent.shutdown()
