"""Member offsets of a kernel struct, read from the running kernel's BTF (/sys/kernel/btf/vmlinux).

DESIGN principle 1: the probes read what tracepoints hand them; where a struct field is
unavoidable (the work set needs a woken task's flags and process, which sched_waking's
tracepoint format does not carry), its offset comes from the running kernel's own type
information and is passed to the program as a `-D` define, so a header that does not match the
kernel can never skew it.

Only what that needs is parsed: the type section's records (to step over them) and STRUCT /
UNION members, descending into anonymous members (task_struct groups fields in unnamed structs).
Format: https://docs.kernel.org/bpf/btf.html
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

_MAGIC = 0xEB9F
_KIND_STRUCT, _KIND_UNION = 4, 5
# bytes that follow the 12-byte btf_type record, by kind: (fixed, per vlen item)
_TRAILER: dict[int, tuple[int, int]] = {
    1: (4, 0),  # INT
    2: (0, 0),  # PTR
    3: (12, 0),  # ARRAY
    4: (0, 12),  # STRUCT
    5: (0, 12),  # UNION
    6: (0, 8),  # ENUM
    7: (0, 0),  # FWD
    8: (0, 0),  # TYPEDEF
    9: (0, 0),  # VOLATILE
    10: (0, 0),  # CONST
    11: (0, 0),  # RESTRICT
    12: (0, 0),  # FUNC
    13: (0, 8),  # FUNC_PROTO
    14: (4, 0),  # VAR
    15: (0, 12),  # DATASEC
    16: (0, 0),  # FLOAT
    17: (4, 0),  # DECL_TAG
    18: (0, 0),  # TYPE_TAG
    19: (0, 12),  # ENUM64
}


class BtfError(ValueError):
    """The BTF blob is missing, malformed or of a kind this parser does not know."""


def member_offsets(
    struct_name: str, members: tuple[str, ...], path: Path = VMLINUX_BTF
) -> dict[str, int]:
    """Byte offset of each named member of `struct struct_name` (anonymous members searched
    too). Raises BtfError when the file cannot be parsed, the struct is absent, or a member is
    missing or a bitfield."""
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise BtfError(f"cannot read {path}: {exc}") from exc
    types, strings = _parse(blob)
    wanted = set(members)
    for kind, name_off, _size, items, _kflag in types[1:]:
        if kind == _KIND_STRUCT and _name(strings, name_off) == struct_name and items:
            found: dict[str, int] = {}
            _collect(types, strings, items, _kflag, 0, wanted, found)
            missing = wanted - found.keys()
            if missing:
                raise BtfError(f"struct {struct_name} has no member {', '.join(sorted(missing))}")
            return found
    raise BtfError(f"struct {struct_name} is not in {path}")


# (kind, name_off, size_or_type, members as (name_off, type, offset), kind_flag); index = type id
_Type = tuple[int, int, int, list[tuple[int, int, int]], bool]


def _parse(blob: bytes) -> tuple[list[_Type], bytes]:
    if len(blob) < 24:
        raise BtfError("BTF blob too short")
    magic, _version, _flags, hdr_len = struct.unpack_from("<HBBI", blob, 0)
    if magic != _MAGIC:
        raise BtfError("not a little-endian BTF blob")
    type_off, type_len, str_off, str_len = struct.unpack_from("<IIII", blob, 8)
    tstart, sstart = hdr_len + type_off, hdr_len + str_off
    if tstart + type_len > len(blob) or sstart + str_len > len(blob):
        raise BtfError("BTF sections run past the blob")
    strings = blob[sstart : sstart + str_len]
    types: list[_Type] = [(0, 0, 0, [], False)]  # type id 0 is void
    pos, end = tstart, tstart + type_len
    while pos < end:
        name_off, info, size = struct.unpack_from("<III", blob, pos)
        pos += 12
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31)
        if kind not in _TRAILER:
            raise BtfError(f"unknown BTF kind {kind}")
        fixed, per = _TRAILER[kind]
        items: list[tuple[int, int, int]] = []
        if kind in (_KIND_STRUCT, _KIND_UNION):
            items = [struct.unpack_from("<III", blob, pos + 12 * i) for i in range(vlen)]
        pos += fixed + per * vlen
        types.append((kind, name_off, size, items, kflag))
    return types, strings


def _name(strings: bytes, off: int) -> str:
    end = strings.find(b"\0", off)
    return strings[off : end if end >= 0 else len(strings)].decode("ascii", "replace")


def _collect(
    types: list[_Type],
    strings: bytes,
    items: list[tuple[int, int, int]],
    kflag: bool,
    base_bits: int,
    wanted: set[str],
    found: dict[str, int],
) -> None:
    for name_off, type_id, offset in items:
        bits = base_bits + (offset & 0xFFFFFF if kflag else offset)
        name = _name(strings, name_off)
        if name in wanted:
            if kflag and offset >> 24:
                raise BtfError(f"member {name} is a bitfield")
            if bits % 8:
                raise BtfError(f"member {name} is not byte-aligned")
            found[name] = bits // 8
        elif not name and 0 < type_id < len(types):
            kind, _, _, sub, sub_kflag = _resolve(types, type_id)
            if kind in (_KIND_STRUCT, _KIND_UNION):
                _collect(types, strings, sub, sub_kflag, bits, wanted, found)


def _resolve(types: list[_Type], type_id: int) -> _Type:
    """Follow typedef/const/volatile/restrict/type-tag to the type they name."""
    for _ in range(32):
        t = types[type_id]
        if t[0] not in (8, 9, 10, 11, 18) or not 0 < t[2] < len(types):
            return t
        type_id = t[2]
    return types[type_id]
