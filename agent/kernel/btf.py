"""Member offsets of a kernel struct, read from the running kernel's BTF (/sys/kernel/btf/vmlinux).

DESIGN principle 1: the probes read what tracepoints hand them; where a struct field is
unavoidable (the work set needs a woken task's flags and process, which sched_waking's
tracepoint format does not carry), its offset comes from the running kernel's own type
information and is passed to the program as a `-D` define, so a header that does not match the
kernel can never skew it.

Only what that needs is decoded. vmlinux BTF holds 100k+ types (~5 MB); turning each into Python
objects cost ~40 MB of peak RSS at agent start-up. Instead one pass steps over the type section
keeping just each record's start (4 bytes per type id, the only way to reach a type by id since
records vary in length) and the ids of the wanted structs; then only their members are
decoded, descending through the start table into anonymous members (task_struct groups fields in
unnamed structs and unions).
Format: https://docs.kernel.org/bpf/btf.html
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Mapping
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

_MAGIC = 0xEB9F
# magic, version, flags, hdr_len, type_off, type_len, str_off, str_len
_HEADER = struct.Struct("<HBBIIIII")
# a btf_type record (name_off, info, size_or_type) and a btf_member (name_off, type, offset) alike
_U32X3 = struct.Struct("<III")
_KIND_STRUCT, _KIND_UNION = 4, 5
# typedef, volatile, const, restrict, type tag: they only name another type
_MODIFIERS = frozenset((8, 9, 10, 11, 18))
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
    got = struct_offsets({struct_name: members}, path)[struct_name]
    if isinstance(got, BtfError):
        raise got
    return got


def struct_offsets(
    wanted: Mapping[str, tuple[str, ...]], path: Path = VMLINUX_BTF
) -> dict[str, dict[str, int] | BtfError]:
    """member_offsets for several structs from one read of the blob and one pass over its
    types (each ~30 ms here): per struct, its members' offsets, or the BtfError saying why not
    (the struct absent, a member missing or a bitfield). Raises BtfError when the file cannot
    be read or parsed at all."""
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise BtfError(f"cannot read {path}: {exc}") from exc
    btf = _Btf(blob, frozenset(wanted))
    out: dict[str, dict[str, int] | BtfError] = {}
    for struct_name, members in wanted.items():
        target = btf.targets.get(struct_name)
        if not target:
            out[struct_name] = BtfError(f"struct {struct_name} is not in {path}")
            continue
        names = set(members)
        found: dict[str, int] = {}
        try:
            btf.collect(target, 0, names, found)
        except BtfError as exc:
            out[struct_name] = exc
            continue
        missing = names - found.keys()
        out[struct_name] = (
            BtfError(f"struct {struct_name} has no member {', '.join(sorted(missing))}")
            if missing
            else found
        )
    return out


class _Btf:
    """The blob plus where each type record starts; `targets` maps each of `struct_names` to
    the id of the first STRUCT with members of that name (absent when there is none)."""

    def __init__(self, blob: bytes, struct_names: frozenset[str]) -> None:
        if len(blob) < _HEADER.size:
            raise BtfError("BTF blob too short")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = (
            _HEADER.unpack_from(blob, 0)
        )
        if magic != _MAGIC:
            raise BtfError("not a little-endian BTF blob")
        tstart, sstart = hdr_len + type_off, hdr_len + str_off
        if tstart + type_len > len(blob) or sstart + str_len > len(blob):
            raise BtfError("BTF sections run past the blob")
        self.blob = blob
        # offsets into `blob` rather than a copy of the string section: nothing is duplicated
        self.sstart, self.send = sstart, sstart + str_len
        self.starts = starts = array("I", [0])  # index = type id; void (id 0) has no record
        self.targets: dict[str, int] = {}
        unpack = _U32X3.unpack_from  # this loop runs 100k+ times: skip the attribute lookups
        pos, end = tstart, tstart + type_len
        while pos < end:
            if pos + 12 > end:
                raise BtfError("BTF type record runs past the type section")
            name_off, info, _size = unpack(blob, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            trailer = _TRAILER.get(kind)
            if trailer is None:
                raise BtfError(f"unknown BTF kind {kind}")
            starts.append(pos)
            # the whole section is still walked after a match: anonymous member types may
            # come later, and any record may be the malformed one
            if kind == _KIND_STRUCT and vlen and len(self.targets) < len(struct_names):
                name = self.name(name_off)
                if name in struct_names and name not in self.targets:
                    self.targets[name] = len(starts) - 1
            pos += 12 + trailer[0] + trailer[1] * vlen
        if pos > end:
            raise BtfError("BTF type record runs past the type section")

    def name(self, off: int) -> str:
        start = self.sstart + off
        if start >= self.send:
            return ""
        stop = self.blob.find(b"\0", start, self.send)
        return self.blob[start : stop if stop >= 0 else self.send].decode("ascii", "replace")

    def record(self, type_id: int) -> tuple[int, int, int]:
        """(kind, info, size_or_type) of a type id in 1..len(starts)-1."""
        _name_off, info, size_or_type = _U32X3.unpack_from(self.blob, self.starts[type_id])
        return (info >> 24) & 0x1F, info, size_or_type

    def resolve(self, type_id: int) -> int:
        """Follow typedef/const/volatile/restrict/type-tag to the type they name (32 hops at
        most, so a cyclic blob cannot hang us)."""
        for _ in range(32):
            kind, _info, ref = self.record(type_id)
            if kind not in _MODIFIERS or not 0 < ref < len(self.starts):
                return type_id
            type_id = ref
        return type_id

    def collect(
        self, type_id: int, base_bits: int, wanted: set[str], found: dict[str, int]
    ) -> None:
        """Record the offsets of `wanted` members of STRUCT/UNION `type_id`, placed `base_bits`
        into the outer struct, into `found`."""
        pos = self.starts[type_id]
        _kind, info, _size = self.record(type_id)
        # kind_flag set: the offset's top 8 bits hold the bitfield size, the low 24 the offset
        kflag, vlen = bool(info >> 31), info & 0xFFFF
        for i in range(vlen):
            name_off, member_type, offset = _U32X3.unpack_from(self.blob, pos + 12 + 12 * i)
            bits = base_bits + (offset & 0xFFFFFF if kflag else offset)
            name = self.name(name_off)
            if name in wanted:
                if kflag and offset >> 24:
                    raise BtfError(f"member {name} is a bitfield")
                if bits % 8:
                    raise BtfError(f"member {name} is not byte-aligned")
                found[name] = bits // 8
            elif not name and 0 < member_type < len(self.starts):
                sub = self.resolve(member_type)
                if self.record(sub)[0] in (_KIND_STRUCT, _KIND_UNION):
                    self.collect(sub, bits, wanted, found)
