"""Run a command under an OCI seccomp profile, as runc applies one to a container.

    python3 tests/seccomp_exec.py PROFILE.json -- COMMAND [ARG...]

Builds the filter with libseccomp (libseccomp.so.2, through ctypes: no headers or Python
binding needed), loads it (with no_new_privs, libseccomp's default, as a pod with
allowPrivilegeEscalation: false has) and execs COMMAND. The translation follows runc's
libcontainer/seccomp: syscall names resolved for the native architecture and skipped when
unknown (to this kernel's libseccomp), every listed architecture added, a rule whose action
equals the default action skipped, and conditions on the same argument split into separate
rules (libseccomp cannot AND two conditions on one argument). Prints what it skipped to stderr.

Used by tests/test_deploy.py to run the agent under deploy/seccomp/tracejoin.json.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
from typing import Any

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO = 0x00050000
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_ACT_LOG = 0x7FFC0000
OPS = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}


class ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    return lib


def _action(name: str, errno_ret: int | None) -> int:
    if name == "SCMP_ACT_ALLOW":
        return SCMP_ACT_ALLOW
    if name == "SCMP_ACT_ERRNO":
        return SCMP_ACT_ERRNO | ((errno.EPERM if errno_ret is None else errno_ret) & 0xFFFF)
    if name in ("SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL"):
        return SCMP_ACT_KILL_PROCESS
    if name == "SCMP_ACT_LOG":
        return SCMP_ACT_LOG
    raise ValueError(f"unsupported seccomp action {name!r}")


def load(profile: dict[str, Any]) -> list[str]:
    """Install `profile` on this process (and what it execs); returns what was skipped."""
    lib = _lib()
    default = _action(profile["defaultAction"], profile.get("defaultErrnoRet"))
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise OSError("seccomp_init failed")
    skipped: list[str] = []
    for arch in profile.get("architectures", []):
        token = lib.seccomp_arch_resolve_name(arch.removeprefix("SCMP_ARCH_").lower().encode())
        if token == 0:
            skipped.append(f"architecture {arch}")
            continue
        rc = lib.seccomp_arch_add(ctx, token)
        if rc not in (0, -errno.EEXIST):
            raise OSError(-rc, f"seccomp_arch_add({arch})")
    for rule in profile["syscalls"]:
        action = _action(rule["action"], rule.get("errnoRet"))
        if action == default:
            continue  # runc: a rule that changes nothing is not added
        conds = [
            ArgCmp(a["index"], OPS[a["op"]], a.get("value", 0), a.get("valueTwo", 0))
            for a in rule.get("args") or []
        ]
        indexes = [c.arg for c in conds]
        groups = [[c] for c in conds] if len(set(indexes)) < len(indexes) else [conds]
        for name in rule["names"]:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                skipped.append(name)
                continue
            for group in groups:
                array = (ArgCmp * len(group))(*group)
                rc = lib.seccomp_rule_add_array(ctx, action, nr, len(group), array)
                if rc != 0:
                    raise OSError(-rc, f"seccomp_rule_add({name}): {os.strerror(-rc)}")
    rc = lib.seccomp_load(ctx)
    if rc != 0:
        raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    return skipped


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[2] != "--":
        sys.exit("usage: seccomp_exec.py PROFILE.json -- COMMAND [ARG...]")
    with open(argv[1]) as fh:
        profile = json.load(fh)
    skipped = load(profile)
    if skipped:
        print(
            f"seccomp_exec: not known to libseccomp here, skipped: {' '.join(skipped)}",
            file=sys.stderr,
        )
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    main(sys.argv)
