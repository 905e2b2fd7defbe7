"""What this kernel's BPF offers, probed the way `bpftool feature probe` does: create a map of a
type, or load a two-instruction program that calls a helper, and read the verifier's answer.

No compiler, no headers, microseconds each: doctor runs them on every host. A helper is missing
when the verifier says "invalid func"/"unknown func" for it (or that this program type "cannot
use helper" it); a load that fails for any other
reason (arguments the probe leaves unset) still proves the helper is there. So the answer is
the kernel's own, not a version number's guess, and a backport counts.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from dataclasses import dataclass

# bpf(2) commands, map/program types and helper ids from include/uapi/linux/bpf.h
BPF_MAP_CREATE = 0
BPF_PROG_LOAD = 5
BPF_MAP_TYPE_RINGBUF = 27  # 5.8
BPF_PROG_TYPE_TRACEPOINT = 5
BPF_FUNC_TASK_PT_REGS = 175  # 5.15
BPF_FUNC_LOOP = 181  # 5.17

_SYS_BPF = {"x86_64": 321, "aarch64": 280}
_LOG_SIZE = 4096


@dataclass(frozen=True)
class Feature:
    name: str  # short key (the matrix table's column)
    what: str  # as doctor shows it
    since: str  # the mainline release that added it, for the fix hint
    used: str | None  # what of tracejoin needs it; None: nothing yet (reported for what may)
    required: bool = False


FEATURES: tuple[Feature, ...] = (
    Feature("ringbuf", "BPF ring buffer (map type)", "5.8", "every record", required=True),
    Feature(
        "task_pt_regs",
        "a task's saved user registers (bpf_task_pt_regs)",
        "5.15",
        "each socket read/write's buffer, from its syscall's arguments (syscall_args)",
        required=True,
    ),
    Feature(
        "bpf_loop",
        "bpf_loop helper",
        "5.17",
        "the HTTP/1.x scanners' steps and connection flushes (bpf_loop callbacks)",
        required=True,
    ),
)


@dataclass(frozen=True)
class FeatureResult:
    feature: Feature
    available: bool | None  # None: could not tell (no permission, unknown architecture)
    detail: str


class _Insn(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint8),
        ("regs", ctypes.c_uint8),
        ("off", ctypes.c_int16),
        ("imm", ctypes.c_int32),
    ]


def bpf_syscall(cmd: int, attr: ctypes.Array[ctypes.c_char]) -> tuple[int, int]:
    nr = _SYS_BPF.get(platform.machine())
    if nr is None:
        return -1, errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(nr, cmd, ctypes.byref(attr), ctypes.sizeof(attr)))
    return (fd, 0) if fd >= 0 else (-1, ctypes.get_errno())


def probe_map(map_type: int, key: int, value: int, max_entries: int) -> tuple[bool | None, str]:
    attr = ctypes.create_string_buffer(64)
    for i, v in enumerate((map_type, key, value, max_entries)):
        ctypes.c_uint32.from_buffer(attr, 4 * i).value = v
    fd, err = bpf_syscall(BPF_MAP_CREATE, attr)
    if fd >= 0:
        os.close(fd)
        return True, "map created"
    if err in (errno.EPERM, errno.EACCES):
        return None, f"cannot tell: {os.strerror(err)}"
    return False, f"map type {map_type} refused: {errno.errorcode.get(err, err)}"


def probe_helper(
    func_id: int, prog_type: int = BPF_PROG_TYPE_TRACEPOINT
) -> tuple[bool | None, str]:
    """r1..r5 = 0; call func_id; exit. The verifier names an unknown helper before it looks at
    the arguments, so any other refusal means the helper exists for this program type."""
    insns = (_Insn * 7)(
        *(_Insn(0xB7, r, 0, 0) for r in range(1, 6)),  # BPF_MOV64_IMM(rN, 0)
        _Insn(0x85, 0, 0, func_id),  # BPF_CALL
        _Insn(0x95, 0, 0, 0),  # BPF_EXIT
    )
    license = ctypes.create_string_buffer(b"GPL")
    log = ctypes.create_string_buffer(_LOG_SIZE)
    attr = ctypes.create_string_buffer(48)  # through prog_flags: every kernel since 4.x
    ctypes.c_uint32.from_buffer(attr, 0).value = prog_type
    ctypes.c_uint32.from_buffer(attr, 4).value = len(insns)
    ctypes.c_uint64.from_buffer(attr, 8).value = ctypes.addressof(insns)
    ctypes.c_uint64.from_buffer(attr, 16).value = ctypes.addressof(license)
    ctypes.c_uint32.from_buffer(attr, 24).value = 1  # log_level
    ctypes.c_uint32.from_buffer(attr, 28).value = _LOG_SIZE
    ctypes.c_uint64.from_buffer(attr, 32).value = ctypes.addressof(log)
    fd, err = bpf_syscall(BPF_PROG_LOAD, attr)
    if fd >= 0:
        os.close(fd)
        return True, "a program calling it loaded"
    text = log.value.decode(errors="replace").strip()
    missing = ("invalid func", "unknown func", "cannot use helper")
    if any(m in text for m in missing):
        line = next(ln for ln in text.splitlines() if any(m in ln for m in missing))
        return False, f"verifier: {line.strip()}"
    if err in (errno.EPERM, errno.EACCES) and not text:
        return None, f"cannot tell: {os.strerror(err)}"
    return True, "the verifier knows it"


def probe_features() -> list[FeatureResult]:
    out = []
    for f in FEATURES:
        if f.name == "ringbuf":
            ok, detail = probe_map(
                BPF_MAP_TYPE_RINGBUF, 0, 0, max(os.sysconf("SC_PAGE_SIZE"), 4096)
            )
        elif f.name == "task_pt_regs":
            ok, detail = probe_helper(BPF_FUNC_TASK_PT_REGS)
        else:
            ok, detail = probe_helper(BPF_FUNC_LOOP)
        out.append(FeatureResult(f, ok, detail))
    return out
