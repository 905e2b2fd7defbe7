"""The probes' compiled form, kept on disk, so a start loads programs instead of compiling them.

BCC compiles bpf/http.c with its embedded clang/LLVM at every start: ~3-4 s of a quiet start and,
with LLVM's heap and code, most of the agent's peak memory (docs/performance.md, "Start-up and
RSS"). BCC 0.26 has no way to load a compiled object, so the split is ours, and BCC stays the
compiler and the runtime:

- `obtain()` has BCC compile in a short-lived child process (`python -m
  tracejoin.kernel.compiled`), so the agent never maps LLVM's heap. From the compiled module
  it keeps, per program, the instructions BCC would load and where they name a map (the
  ld_imm64 BCC relocated to the map's fd); per map, its attributes as the kernel created them,
  and BCC's key/leaf type descriptions.
- `cached_bpf(entry)` is a `bcc.BPF` made from such an entry: it creates the maps and loads a
  program when it is first asked for, with the same two bpf(2) calls BCC makes
  (BPF_MAP_CREATE, BPF_PROG_LOAD) and a BTF of our own (`ModuleBtf`: what local storage
  maps require, and each program's full name). Every program is asked for through BCC's own
  `load_func` path (autoloaded tracepoints at `autoload()`, tail calls, perf events and CUDA
  uprobes through BCC's attach methods); tables, the ring buffer, attach, detach and cleanup
  are BCC's code.

An entry is keyed by everything that decides the compile's output: the rendered C text (the
knobs, kernel struct offsets from BTF included), the flags, the kernel (release and build), the
BCC library, and this file's format. The cache directory is root's: a program loaded from it
runs in the kernel, so an entry is used only from a directory and file no one else can write.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import ctypes
import hashlib
import json
import logging
import math
import os
import re
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracejoin.kernel.features import bpf_syscall

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("/var/cache/tracejoin/bpf")  # --bpf-cache's default
KEEP_ENTRIES = 8  # entries kept in a cache directory, the most recently used
FORMAT = 2  # bump when an entry's content or meaning changes: older entries are then unused

# bpf(2) commands and instruction encoding (include/uapi/linux/bpf.h)
_BPF_MAP_CREATE = 0
_BPF_OBJ_GET_INFO_BY_FD = 15
_BPF_PROG_LOAD = 5
_BPF_BTF_LOAD = 18
_LD_IMM64 = 0x18  # BPF_LD | BPF_IMM | BPF_DW: two instruction slots
_PSEUDO_MAP_FD = 1  # src_reg of an ld_imm64 whose imm is a map fd
_PSEUDO_FUNC = 4  # src_reg of an ld_imm64 naming a subprogram: imm is relative to the insn after
_LOOP_CB_MARK = 0x7A6A6C70  # high half of the constant naming a bpf_loop callback ("zjlp")
_INSN = 8
_MAP_INFO_SIZE = 40  # struct bpf_map_info through name[16]
# Local storage maps (sk, inode, task, cgroup) are created only with BTF for their key and value
_STORAGE_MAP_TYPES = frozenset({24, 28, 29, 32})


class CompileError(RuntimeError):
    """BCC could not compile the text, or its output cannot be kept (said why)."""


@dataclass(frozen=True)
class MapSpec:
    """One map, as the kernel created it for BCC, and BCC's description of its types."""

    name: str  # BCC's table name
    kernel_name: str  # the name the kernel holds (BCC's, cut to 15 bytes)
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    key_desc: str  # BCC's JSON type description (bcc.BPF._decode_table_type)
    leaf_desc: str


@dataclass(frozen=True)
class FuncSpec:
    insns: bytes
    map_refs: tuple[tuple[int, int], ...]  # (instruction index, index into maps) to patch
    subprogs: tuple[tuple[int, str], ...] = ()  # (first instruction, function) linked in


@dataclass(frozen=True)
class Entry:
    key: str
    license: str
    kern_version: int
    maps: tuple[MapSpec, ...]
    funcs: dict[str, FuncSpec]

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "key": self.key,
            "license": self.license,
            "kern_version": self.kern_version,
            "maps": [m.__dict__ for m in self.maps],
            "funcs": {
                name: {
                    "insns": base64.b64encode(f.insns).decode(),
                    "map_refs": f.map_refs,
                    "subprogs": f.subprogs,
                }
                for name, f in self.funcs.items()
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Entry:
        doc = json.loads(raw)
        if doc.get("format") != FORMAT:
            raise ValueError(f"entry format {doc.get('format')!r}, not {FORMAT}")
        return cls(
            key=doc["key"],
            license=doc["license"],
            kern_version=int(doc["kern_version"]),
            maps=tuple(MapSpec(**m) for m in doc["maps"]),
            funcs={
                name: FuncSpec(
                    base64.b64decode(f["insns"]),
                    tuple((int(i), int(m)) for i, m in f["map_refs"]),
                    tuple((int(i), str(n)) for i, n in f["subprogs"]),
                )
                for name, f in doc["funcs"].items()
            },
        )


# ----------------------------------------------------------------------------- the cache key


def cache_key(text: str, cflags: list[str]) -> str:
    """What decides the compile's output: the text and flags, the kernel whose headers and
    helpers it compiled against, and the BCC that compiled it."""
    h = hashlib.sha256()
    uname = os.uname()
    for part in (str(FORMAT), text, "\0".join(cflags), uname.release, uname.version, _libbcc_id()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _libbcc_id() -> str:
    """The BCC library's file identity (path, size, mtime): an upgrade makes new entries."""
    from bcc.libbcc import lib

    path = os.path.realpath(_loaded_path(lib._name))
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _loaded_path(soname: str) -> str:
    """The file a loaded shared library came from (its soname resolved as the loader did)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(soname):
                return parts[5].strip()
    return soname


# ------------------------------------------------------------------- compile (the child's side)


def extract(bpf: Any, key: str) -> Entry:
    """What BCC has just compiled in this process (no program loaded), as an entry whose
    callbacks are not linked yet (merge() links them)."""
    from bcc.libbcc import lib

    module = bpf.module
    for fn, res, args in (
        (lib.bpf_num_tables, ctypes.c_size_t, [ctypes.c_void_p]),
        (lib.bpf_table_name, ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
        (lib.bpf_table_fd_id, ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]),
        (lib.bpf_table_key_desc_id, ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
        (lib.bpf_table_leaf_desc_id, ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]),
    ):
        fn.restype, fn.argtypes = res, args
    maps: list[MapSpec] = []
    fd_index: dict[int, int] = {}
    for i in range(lib.bpf_num_tables(module)):
        fd = lib.bpf_table_fd_id(module, i)
        if fd < 0:
            continue
        info = _obj_info(fd, _MAP_INFO_SIZE)
        kind, _id, key_size, value_size, max_entries, flags = struct.unpack_from("<6I", info)
        fd_index[fd] = len(maps)
        maps.append(
            MapSpec(
                name=lib.bpf_table_name(module, i).decode(),
                kernel_name=info[24:40].split(b"\0", 1)[0].decode(),
                type=kind,
                key_size=key_size,
                value_size=value_size,
                max_entries=max_entries,
                flags=flags,
                key_desc=(lib.bpf_table_key_desc_id(module, i) or b"").decode(),
                leaf_desc=(lib.bpf_table_leaf_desc_id(module, i) or b"").decode(),
            )
        )
    funcs = {}
    for i in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, i)
        insns = ctypes.string_at(
            lib.bpf_function_start(module, name), lib.bpf_function_size(module, name)
        )
        funcs[name.decode()] = FuncSpec(insns, _map_refs(name.decode(), insns, fd_index))
    return Entry(
        key=key,
        license=lib.bpf_module_license(module).decode(),
        kern_version=int(lib.bpf_module_kern_version(module)),
        maps=tuple(maps),
        funcs=funcs,
    )


# A program's definition in our C: it begins at column 0 and ends at the first line that
# begins with "}" (or on its own line). BCC names a probe macro's function as below. A line
# that is only a macro applied to a macro, `CUDA_APIS(CUDA_AT_ENTRY)`, is a group of programs
# an X-macro table makes, one line, named by that text.
_PROGRAM = re.compile(
    r"^(?:TRACEPOINT_PROBE\((\w+),\s*(\w+)\)|RAW_TRACEPOINT_PROBE\((\w+)\)|int (\w+)\(|"
    r"(\w+\(\w+\))\s*$)"
)


def _program_name(m: re.Match[str]) -> str:
    if m.group(1):
        return f"tracepoint__{m.group(1)}__{m.group(2)}"
    if m.group(3):
        return f"raw_tracepoint__{m.group(3)}"
    return m.group(4) or m.group(5)


def unit_texts(text: str, apart: Callable[[str], bool]) -> list[str]:
    """`text` as two compile units: one without the programs `apart` names, one with only
    them (and every other declaration, helper and map). Each compiles in a compiler of its
    own, at once on two CPUs (`obtain`); clang compiles a helper only where a program of its
    unit calls it, so the two share out the optimiser's and code generator's work. A group of
    programs an X-macro makes goes by its line (`CUDA_APIS(CUDA_AT_ENTRY)`); a program made any
    other way would stay in both, and merge() keeps one. One unit (the text itself) when
    `apart` names none."""
    units: list[list[str]] = [[], []]
    skipping = [False, False]
    named = False
    for line in text.split("\n"):
        m = _PROGRAM.match(line)
        if m is not None and line.rstrip().endswith(";"):
            m = None  # a declaration (a prototype): both units keep it
        is_apart = m is not None and apart(_program_name(m))
        named = named or is_apart
        for unit, out in enumerate(units):
            if skipping[unit]:
                skipping[unit] = not line.startswith("}")
                continue
            if m is not None and is_apart != (unit == 1):  # this program is the other unit's
                skipping[unit] = not (m.group(5) or line.rstrip().endswith("}"))
                continue
            out.append(line)
    if not named:
        return [text]
    return ["\n".join(lines) for lines in units]


def merge(units: list[Entry]) -> Entry:
    """One entry from the units compiled apart: every unit created the same maps from the same
    declarations, so a program's map references are renumbered by map name; a program in two
    units must have compiled the same. The bpf_loop callbacks are linked last: a callback need
    not be in its caller's unit."""
    maps: list[MapSpec] = []
    index: dict[str, int] = {}
    funcs: dict[str, FuncSpec] = {}
    for unit in units:
        renumber = []
        for spec in unit.maps:
            if spec.name not in index:
                index[spec.name] = len(maps)
                maps.append(spec)
            elif maps[index[spec.name]] != spec:
                raise CompileError(f"map {spec.name}: the compile units made it differently")
            renumber.append(index[spec.name])
        for name, f in unit.funcs.items():
            spec_f = FuncSpec(f.insns, tuple((at, renumber[m]) for at, m in f.map_refs))
            if funcs.setdefault(name, spec_f) != spec_f:
                raise CompileError(f"{name}: the compile units compiled it differently")
    first = units[0]
    return Entry(first.key, first.license, first.kern_version, tuple(maps), link_callbacks(funcs))


def loop_callback_defines(names: tuple[str, ...]) -> list[str]:
    """The #defines by which C code names its bpf_loop callbacks: `LOOP_CB(fn)` (bpf/http.c) is
    the constant LOOP_CB_MARK << 32 | LOOP_CB_fn, which link_callbacks() turns into a reference
    to the function. BCC can do neither itself: it compiles each function into a section of
    its own and resolves no reference between them."""
    lines = [f"#define LOOP_CB_MARK {_LOOP_CB_MARK:#x}ULL"]
    return lines + [f"#define LOOP_CB_{name} {_callback_id(name):#x}ULL" for name in names]


def _callback_id(name: str) -> int:
    return zlib.crc32(name.encode())


def link_callbacks(funcs: dict[str, FuncSpec]) -> dict[str, FuncSpec]:
    """Each program that names a bpf_loop callback by its marker, with the callback's
    instructions appended (once per program) and the marker's ld_imm64 made the kernel's
    reference to that subprogram (BPF_PSEUDO_FUNC, relative). A callback names none itself."""
    by_id = {_callback_id(name): name for name in funcs}
    linked = {}
    for name, spec in funcs.items():
        insns = bytearray(spec.insns)
        refs = list(spec.map_refs)
        starts: dict[str, int] = {}
        for i, src, lo, hi in _ld_imm64(spec.insns):
            if hi != _LOOP_CB_MARK or src != 0:
                continue
            callback = by_id.get(lo)
            if callback is None:
                raise CompileError(
                    f"{name}: instruction {i} names callback {lo:#x}: no such function"
                )
            if callback not in starts:
                cb = funcs[callback]
                if any(h == _LOOP_CB_MARK for _, _, _, h in _ld_imm64(cb.insns)):
                    raise CompileError(f"{callback}: a bpf_loop callback names a callback itself")
                starts[callback] = len(insns) // _INSN
                insns += cb.insns
                refs += [(at + starts[callback], m) for at, m in cb.map_refs]
            insns[i * _INSN + 1] = (insns[i * _INSN + 1] & 0x0F) | (_PSEUDO_FUNC << 4)
            struct.pack_into("<i", insns, i * _INSN + 4, starts[callback] - i - 1)
            struct.pack_into("<i", insns, (i + 1) * _INSN + 4, 0)
        subprogs = tuple(sorted((at, cb) for cb, at in starts.items()))
        linked[name] = FuncSpec(bytes(insns), tuple(refs), subprogs)
    return linked


def _ld_imm64(insns: bytes) -> list[tuple[int, int, int, int]]:
    """(index, src_reg, low 32 bits, high 32 bits) of each ld_imm64 in a program (two slots)."""
    out = []
    i = 0
    while i < len(insns) // _INSN:
        if insns[i * _INSN] == _LD_IMM64:
            lo = struct.unpack_from("<I", insns, i * _INSN + 4)[0]
            hi = struct.unpack_from("<I", insns, (i + 1) * _INSN + 4)[0]
            out.append((i, insns[i * _INSN + 1] >> 4, lo, hi))
            i += 2
        else:
            i += 1
    return out


def _map_refs(name: str, insns: bytes, fd_index: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """Where the program names a map by fd; any other kind of relocation cannot be replayed."""
    refs = []
    for i, src, fd, _ in _ld_imm64(insns):
        if src == _PSEUDO_MAP_FD:
            if fd not in fd_index:
                raise CompileError(f"{name}: instruction {i} names fd {fd}, not a map")
            refs.append((i, fd_index[fd]))
        elif src not in (0, _PSEUDO_FUNC):
            raise CompileError(f"{name}: instruction {i}: ld_imm64 kind {src} is not kept")
    return tuple(refs)


def _obj_info(fd: int, size: int) -> bytes:
    """BPF_OBJ_GET_INFO_BY_FD into a `size`-byte info struct."""
    info = ctypes.create_string_buffer(size)
    attr = ctypes.create_string_buffer(16)
    struct.pack_into("<IIQ", attr, 0, fd, size, ctypes.addressof(info))
    res, err = bpf_syscall(_BPF_OBJ_GET_INFO_BY_FD, attr)
    if res < 0:
        raise CompileError(f"BPF_OBJ_GET_INFO_BY_FD: {os.strerror(err)}")
    return info.raw


def _compile_here(text: str, cflags: list[str], key: str) -> Entry:
    """The entry for `text`, compiled in this process (tools and tests; the agent compiles in
    a child, `obtain`)."""
    return merge([_compile_unit(text, cflags, key)])


def _compile_unit(text: str, cflags: list[str], key: str) -> Entry:
    from bcc import BPF

    class CompileOnly(BPF):
        def _trace_autoload(self) -> None:  # keep the compile; load nothing
            pass

    try:
        bpf = CompileOnly(text=text.encode(), cflags=cflags)
    except Exception as exc:
        raise CompileError(str(exc)) from exc
    try:
        return extract(bpf, key)
    finally:
        bpf.cleanup()


def _child_main() -> int:
    """`python -m tracejoin.kernel.compiled OUT`: compile the text on stdin ({"text", "cflags",
    "key"} as JSON) and write its unlinked entry to OUT. Exit 2 with the reason on stderr if
    not."""
    job = json.load(sys.stdin)
    try:
        entry = _compile_unit(job["text"], job["cflags"], job["key"])
    except CompileError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    Path(sys.argv[1]).write_bytes(entry.to_bytes())
    return 0


# ---------------------------------------------------------------------- the agent's side


@dataclass
class Obtained:
    entry: Entry
    source: str  # "cache": an entry on disk; "compiled": compiled in a child for this start
    path: Path | None  # where the entry is kept (None: not kept)
    compile_peak_bytes: int  # the children's peak resident memory, summed (0 from the cache)
    units: int  # compile units, one child each, run at once (0 from the cache)
    later: Deferred | None = None  # the programs `later` named, still compiling (obtain)


def obtain(
    text: str,
    cflags: list[str],
    cache_dir: Path | None,
    apart: Callable[[str], bool] | None = None,
    later: Callable[[str], bool] | None = None,
) -> Obtained:
    """The compiled form of `text`: the cache's entry for it, or one compiled now in child
    processes (and kept in cache_dir when there is one and it is safe to write). With `apart`,
    two CPUs to run on and the memory for two compilers, the programs it names compile in a
    second child beside the first (unit_texts); the entry is the same either way. With `later`,
    a compile returns without the programs it names as soon as the rest are compiled (split by
    `apart` as above), and `Obtained.later` compiles them when asked (Deferred); the cache keeps
    only the whole entry."""
    key = cache_key(text, cflags)
    usable = cache_dir is not None and _private_dir(cache_dir)
    path = cache_dir / f"{key}.bpf.json" if usable and cache_dir is not None else None
    if path is not None:
        entry = _read_entry(path, key)
        if entry is not None:
            _touch(path)  # recently used: kept when the cache is pruned
            return Obtained(entry, "cache", path, 0, 0)
    deferred_text = None
    if later is not None:
        split = unit_texts(text, later)
        if len(split) == 2:
            text, deferred_text = split
    units = unit_texts(text, apart) if apart is not None and _room_for_two() else [text]
    with tempfile.TemporaryDirectory(prefix="tracejoin-compile-") as tmp:
        compiled_units, peak = _compile_in_children(units, cflags, key, Path(tmp))
    entry = merge(compiled_units)
    if deferred_text is not None:
        deferred = Deferred(compiled_units, deferred_text, cflags, key, path)
        return Obtained(entry, "compiled", path, peak, len(units), deferred)
    if path is not None:
        _write_atomically(path, entry.to_bytes())
    return Obtained(entry, "compiled", path, peak, len(units))


class Deferred:
    """The programs a compiling start left for after ready (obtain's `later`). result()
    compiles them in a child of its own (the start has returned by then: on one CPU, that
    compiler beside the first, or beside the verifier after it, would have taken its time from
    them), links them with the rest and keeps the whole entry in the cache, so the next start
    loads everything from it; cancel() stops that compiler (an agent that stops first leaves
    none behind)."""

    def __init__(
        self, rest: list[Entry], text: str, cflags: list[str], key: str, path: Path | None
    ) -> None:
        self._rest = rest  # the rest's compile units, unlinked
        self._text = text
        self._cflags = cflags
        self._key = key
        self._path = path
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self.peak_bytes = 0  # the deferred compiler's peak resident memory, once it is done

    def result(self) -> Entry:
        """The whole entry: the rest's programs and the deferred ones, linked (CompileError if
        they did not compile, or if the agent stopped first)."""
        with tempfile.TemporaryDirectory(prefix="tracejoin-compile-") as tmp:
            with self._lock:
                if self._cancelled:
                    raise CompileError("the agent stopped before the programs compiled")
                self._child = _start_child(self._text, self._cflags, self._key, Path(tmp), 0)
            later, self.peak_bytes = _finish(self._child)
        entry = merge([*self._rest, later])
        if self._path is not None:
            _write_atomically(self._path, entry.to_bytes())
        return entry

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._child is not None:
                self._child.kill()


# Two compilers at once peak ~290 MiB together (one: ~150 MiB; bench.compile_units): a memory
# cgroup with less room than this above what it holds now gets one, so a tight pod limit
# slows a first start instead of having the kernel kill a compiler.
TWO_COMPILERS_BYTES = 400 << 20
_CGROUP_FS = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 62  # cgroup v1 reports "no limit" as a page-rounded LONG_MAX


def _room_for_two() -> bool:
    """Two CPUs to run two compilers on (the CPUs this process may run on, and its cgroup's
    CPU limit rounded up), and the memory for both."""
    cpus = len(os.sched_getaffinity(0))
    limit = cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    if cpus < 2:
        return False
    headroom = memory_headroom()
    if headroom is None or headroom >= TWO_COMPILERS_BYTES:
        return True
    log.info(
        "compiling in one child: the memory cgroup has %d MiB of room, two compilers at once "
        "need ~%d",
        headroom >> 20,
        TWO_COMPILERS_BYTES >> 20,
    )
    return False


def memory_headroom(proc_cgroup: str | None = None, fs: Path = _CGROUP_FS) -> int | None:
    """Bytes this process's memory cgroup may still charge: the least, over its cgroup and
    those above it, of limit less usage (cgroup v1's memory controller where it is mounted,
    else v2's). None when no limit applies or none can be read."""
    found = _cgroup_dirs("memory", proc_cgroup, fs)
    if found is None:
        return None
    v1, groups = found
    files = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
        if v1
        else ("memory.max", "memory.current")
    )
    least = None
    for group in groups:
        try:
            raw = (group / files[0]).read_text().strip()
            limit = _NO_LIMIT if raw == "max" else int(raw)
            usage = int((group / files[1]).read_text())
        except (OSError, ValueError):  # not a cgroup with a limit (the root has none)
            continue
        if limit < _NO_LIMIT:
            room = max(0, limit - usage)
            least = room if least is None else min(least, room)
    return least


def cpu_limit(proc_cgroup: str | None = None, fs: Path = _CGROUP_FS) -> float | None:
    """CPUs' worth of time this process's cgroup may use: the least, over its cgroup and those
    above it, of quota / period (a pod's CPU limit; cgroup v1's cpu controller where it is
    mounted, else v2's cpu.max). None when no quota applies or none can be read."""
    found = _cgroup_dirs("cpu", proc_cgroup, fs)
    if found is None:
        return None
    v1, groups = found
    least = None
    for group in groups:
        try:
            if v1:
                quota = int((group / "cpu.cfs_quota_us").read_text())
                period = int((group / "cpu.cfs_period_us").read_text())
            else:
                raw_quota, raw_period = (group / "cpu.max").read_text().split()
                quota = -1 if raw_quota == "max" else int(raw_quota)
                period = int(raw_period)
        except (OSError, ValueError):  # not a cgroup with a quota (the root has none)
            continue
        if quota > 0 and period > 0:
            cpus = quota / period
            least = cpus if least is None else min(least, cpus)
    return least


def _cgroup_dirs(
    controller: str, proc_cgroup: str | None, fs: Path
) -> tuple[bool, list[Path]] | None:
    """(v1?, this process's cgroup directory for `controller` and those above it, up to the
    hierarchy's root): v1's hierarchy where the controller is mounted there, else v2's."""
    try:
        text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    v1 = v2 = None
    for line in text.splitlines():
        hid, controllers, path = [*line.split(":", 2), "", ""][:3]
        if controller in controllers.split(","):
            v1 = (fs / controllers, path)  # where it is mounted: cpu,cpuacct for cpu
        elif hid == "0" and controllers == "":
            v2 = (fs, path)
    chosen = v1 if v1 is not None else v2
    if chosen is None:
        return None
    base, path = chosen
    if v1 is not None and not base.exists():  # mounted under the controller's own name only
        base = fs / controller
    groups = []
    group = base / path.lstrip("/")
    while True:
        groups.append(group)
        if group == base or base not in group.parents:
            return v1 is not None, groups
        group = group.parent


@dataclass
class _Child:
    """A compiler child: its process, the file it writes its entry to, its stderr."""

    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    def kill(self) -> None:
        """Stop it and reap it (a _finish waiting on it in another thread then says so)."""
        if self.proc.returncode is None:
            self.proc.kill()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.proc.pid, 0)
            self.proc.returncode = -9


def _start_child(unit: str, cflags: list[str], key: str, tmp: Path, n: int) -> _Child:
    """A compiler child for one unit. stderr goes to a file, so a chatty compiler never waits
    on a pipe this process is not yet reading."""
    out, err = tmp / f"unit{n}.json", tmp / f"unit{n}.err"
    with err.open("wb") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tracejoin.kernel.compiled", str(out)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
    child = _Child(proc, out, err)
    try:
        assert proc.stdin is not None
        with proc.stdin:  # the child reads all of it before it writes anything
            job = {"text": unit, "cflags": cflags, "key": key}
            proc.stdin.write(json.dumps(job).encode())
    except BaseException:
        child.kill()
        raise
    return child


def _finish(child: _Child) -> tuple[Entry, int]:
    """Wait for a compiler child (reaped here, wait4, for its rusage): (its entry, its peak
    resident memory); CompileError with the tail of its stderr if it failed."""
    try:
        _, status, usage = os.wait4(child.proc.pid, 0)
    except ChildProcessError:  # kill() reaped it: Deferred.cancel() from another thread
        raise CompileError("the compiler was stopped") from None
    child.proc.returncode = os.waitstatus_to_exitcode(status)
    if child.proc.returncode != 0:
        lines = child.err.read_bytes().decode(errors="replace").strip().splitlines()
        raise CompileError("\n".join(lines[-40:]) or f"compiler exited {child.proc.returncode}")
    return Entry.from_bytes(child.out.read_bytes()), usage.ru_maxrss * 1024


def _compile_in_children(
    units: list[str], cflags: list[str], key: str, tmp: Path
) -> tuple[list[Entry], int]:
    """Compile each unit in a child of its own, all at once, and return their entries and
    the children's peak resident memory, summed (they run together)."""
    children: list[_Child] = []
    try:
        for n, unit in enumerate(units):
            children.append(_start_child(unit, cflags, key, tmp, n))
    except BaseException:  # no second child: leave no compiler behind
        for child in children:
            child.kill()
        raise
    entries, peak, failed = [], 0, []
    for child in children:
        try:
            entry, child_peak = _finish(child)
        except CompileError as exc:
            failed.append(exc)
            continue
        entries.append(entry)
        peak += child_peak
    if failed:
        raise failed[0]
    return entries, peak


def _private_dir(path: Path) -> bool:
    """Make the cache directory if needed; usable only when it is ours and no one else can
    write it (an entry's programs run in the kernel)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        log.warning("BPF cache %s unusable (%s): compiling without keeping it", path, exc)
        return False
    if not _ours_alone(st):
        log.warning("BPF cache %s is writable by others or not owned by this user: not used", path)
        return False
    return True


def _ours_alone(st: os.stat_result) -> bool:
    """Owned by this user and writable by no one else: the only files whose programs load."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def cache_state(path: Path) -> tuple[str | None, list[Path]]:
    """What a start would find in a cache directory, without changing it (`tracejoin
    doctor`): why it cannot be used (None: it can, or will be created), and its entries, the
    most recently used first."""
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), Path("/"))
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"{path} does not exist and {parent} is not writable", []
        return None, []
    try:
        st = path.stat()
        entries = sorted(path.glob("*.bpf.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError as exc:
        return f"{path}: {exc.strerror}", []
    if not path.is_dir():
        return f"{path} is not a directory", []
    if not _ours_alone(st):
        mode = f"{st.st_mode & 0o777:o}"
        return f"{path} is not this user's alone (owner uid {st.st_uid}, mode {mode})", []
    return None, entries


def _read_entry(path: Path, key: str) -> Entry | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("BPF cache entry %s unreadable (%s): compiling", path, exc)
        return None
    with os.fdopen(fd, "rb") as f:
        if not _ours_alone(os.fstat(f.fileno())):
            log.warning("BPF cache entry %s is writable by others: compiling", path)
            return None
        raw = f.read()
    try:
        entry = Entry.from_bytes(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("BPF cache entry %s is damaged (%s): compiling", path, exc)
        return None
    if entry.key != key:
        log.warning("BPF cache entry %s is for another text: compiling", path)
        return None
    return entry


def _write_atomically(path: Path, raw: bytes) -> None:
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".entry-")
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("BPF cache entry %s not written (%s): the next start compiles", path, exc)
        return
    _prune(path.parent)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _prune(cache_dir: Path, keep: int = KEEP_ENTRIES) -> None:
    """Remove all but the `keep` most recently used entries: every upgrade of tracejoin or of
    the kernel, and every change of settings that changes the programs, makes a new one."""
    try:
        entries = sorted(
            cache_dir.glob("*.bpf.json"), key=lambda p: p.stat().st_mtime, reverse=True
        )
        for old in entries[keep:]:
            old.unlink()
    except OSError as exc:  # a concurrent prune or start: harmless, the next write retries
        log.debug("BPF cache prune: %s", exc)


class CachedBPFError(RuntimeError):
    pass


def cached_bpf(entry: Entry) -> Any:
    """A bcc.BPF over an entry: its maps created, no program loaded yet (autoload() loads and
    attaches the tracepoint programs, as BCC's constructor would have)."""
    from bcc import BPF
    from bcc import table as bcc_table

    table_classes = {
        1: bcc_table.HashTable,
        2: bcc_table.Array,
        3: bcc_table.ProgArray,
        4: bcc_table.PerfEventArray,
        5: bcc_table.PerCpuHash,
        6: bcc_table.PerCpuArray,
        9: bcc_table.LruHash,
        10: bcc_table.LruPerCpuHash,
        27: bcc_table.RingBuf,
    }

    class CachedBPF(BPF):
        def __init__(self, entry: Entry) -> None:
            # What BPF.__init__ sets up, without its compile (bcc/__init__.py, 0.26)
            self.kprobe_fds: dict[Any, Any] = {}
            self.uprobe_fds: dict[Any, Any] = {}
            self.tracepoint_fds: dict[Any, Any] = {}
            self.raw_tracepoint_fds: dict[Any, Any] = {}
            self.kfunc_entry_fds: dict[Any, Any] = {}
            self.kfunc_exit_fds: dict[Any, Any] = {}
            self.lsm_fds: dict[Any, Any] = {}
            self.perf_buffers: dict[Any, Any] = {}
            self.open_perf_events: dict[Any, Any] = {}
            self._ringbuf_manager = None
            self.tracefile = None
            self.debug = 0
            self.funcs: dict[bytes, Any] = {}
            self.tables: dict[bytes, Any] = {}
            self.module = None
            self._entry = entry
            self._map_ids = {spec.name: i for i, spec in enumerate(entry.maps)}
            self._btf_fds: list[int] = []
            self._map_fds: list[int] = []
            try:
                maps_btf, maps_btf_fd = self._load_names(entry)
                for spec in entry.maps:
                    btf = None
                    if spec.type in _STORAGE_MAP_TYPES:
                        btf = (maps_btf_fd, maps_btf.int_id, maps_btf.value_ids[spec.value_size])
                    self._map_fds.append(_create_map(spec, btf))
            except Exception:
                self._close_maps()
                raise
            atexit.register(self.cleanup)

        def _load_names(self, entry: Entry) -> tuple[ModuleBtf, int]:
            """A BTF naming every program of `entry`, loaded; the next program loads use it
            (prog_load reads the pair once, so a load beside extend() gets one or the other)."""
            sizes = sorted({m.value_size for m in entry.maps if m.type in _STORAGE_MAP_TYPES})
            btf = ModuleBtf(sizes, list(entry.funcs))
            fd = _load_btf(btf.blob)
            self._btf_fds.append(fd)
            self._names = (btf, fd)
            return self._names

        def extend(self, entry: Entry) -> None:
            """Take the whole entry a Deferred compile made: the maps already created here
            (checked), and more programs, named in a BTF of their own (one loaded BTF cannot
            grow). Their loads then go through load_func as any other's."""
            if entry.maps != self._entry.maps:
                raise CachedBPFError("the programs compiled later declare other maps")
            self._load_names(entry)
            self._entry = entry

        def autoload_programs(self) -> list[tuple[str, int]]:
            """The programs BCC's constructor would load and attach by their names
            (BPF._trace_autoload): (name, program type), the largest first (loaded
            concurrently, the longest verifications should start first)."""
            out = []
            funcs = self._entry.funcs
            for name in sorted(funcs, key=lambda n: -len(funcs[n].insns)):
                if name.startswith("tracepoint__"):
                    out.append((name, BPF.TRACEPOINT))
                elif name.startswith("raw_tracepoint__"):
                    out.append((name, BPF.RAW_TRACEPOINT))
            return out

        def autoload(self) -> None:
            """Load (where not yet loaded) and attach the autoload_programs, as BCC's
            constructor does for a module it compiled."""
            for name, kind in self.autoload_programs():
                fn = self.load_func(name.encode(), kind)
                if kind == BPF.TRACEPOINT:
                    tp = fn.name[len(b"tracepoint__") :].replace(b"__", b":")
                    self.attach_tracepoint(tp=tp, fn_name=fn.name)
                else:
                    self.attach_raw_tracepoint(
                        tp=fn.name[len(b"raw_tracepoint__") :], fn_name=fn.name
                    )

        def load_func(
            self, func_name: Any, prog_type: int, device: Any = None, attach_type: int = -1
        ) -> Any:
            name = func_name if isinstance(func_name, bytes) else func_name.encode()
            if name in self.funcs:
                return self.funcs[name]
            fd, err, log = prog_load(self, name.decode(), prog_type)
            if fd < 0:  # again with the verifier's log, whose tail goes in the error
                log = ctypes.create_string_buffer(_LOG_BYTES)
                fd, err, log = prog_load(self, name.decode(), prog_type, 1, log)
            if fd < 0:
                tail = log.value.decode(errors="replace").strip().splitlines()[-12:]
                raise Exception(
                    f"Failed to load BPF program {name.decode()}: {os.strerror(err)}"
                    + ("\n" + "\n".join(tail) if tail else "")
                )
            fn = BPF.Function(self, name, fd)
            self.funcs[name] = fn
            return fn

        def get_table(
            self, name: Any, keytype: Any = None, leaftype: Any = None, reducer: Any = None
        ) -> Any:
            name = name if isinstance(name, bytes) else name.encode()
            map_id = self._map_ids.get(name.decode())
            if map_id is None:
                raise KeyError(name)
            spec = self._entry.maps[map_id]
            cls = table_classes.get(spec.type)
            if cls is None:
                raise Exception(f"map {spec.name}: type {spec.type} has no table here")
            key = keytype or BPF._decode_table_type(json.loads(spec.key_desc))
            leaf = leaftype or BPF._decode_table_type(json.loads(spec.leaf_desc))
            fd = self._map_fds[map_id]
            args = (self, map_id, fd, key, leaf)
            if cls in (bcc_table.PerfEventArray, bcc_table.RingBuf):
                t = cls(*args, name)
            elif cls in (bcc_table.PerCpuArray, bcc_table.PerCpuHash):
                t = cls(*args, reducer=reducer)
            else:
                t = cls(*args)
            # TableBase read these from the module, which an entry has not
            t.ttype, t.flags, t.max_entries = spec.type, spec.flags, spec.max_entries
            return t

        def close(self) -> None:
            super().close()
            self._close_maps()

        def _close_maps(self) -> None:
            for fd in self._map_fds:
                os.close(fd)
            self._map_fds = []
            for fd in self._btf_fds:
                os.close(fd)
            self._btf_fds = []

    return CachedBPF(entry)


class ModuleBtf:
    """The BTF a start loads for an entry's maps and programs, made here: BCC's own BTF for the
    module could be read back only with BPF_BTF_GET_FD_BY_ID (CAP_SYS_ADMIN, which the agent
    does not hold). Local storage maps need a key `int` and a value of their size (the kernel
    checks nothing else of them); each program gets a FUNC of its full name, which bpftool and
    the bench show instead of the kernel's 15-character program name."""

    def __init__(self, storage_value_sizes: list[int], func_names: list[str]) -> None:
        strings = bytearray(b"\0")

        def name(text: str) -> int:
            strings.extend(text.encode() + b"\0")
            return len(strings) - len(text) - 1

        kind = {"int": 1, "array": 3, "func": 12, "func_proto": 13}
        types = bytearray()
        self.int_id = 1  # [1] int: signed, 32 bits
        types += struct.pack("<IIII", name("int"), kind["int"] << 24, 4, (1 << 24) | 32)
        char_id = 2  # [2] char: 8 bits
        types += struct.pack("<IIII", name("char"), kind["int"] << 24, 1, 8)
        next_id = 3
        self.value_ids: dict[int, int] = {}
        for size in storage_value_sizes:  # char[size]: btf_array {type, index_type, nelems}
            types += struct.pack("<III", 0, kind["array"] << 24, 0)
            types += struct.pack("<III", char_id, self.int_id, size)
            self.value_ids[size] = next_id
            next_id += 1
        proto_id = next_id  # int (void): every program's, its context as BCC declares it unnamed
        types += struct.pack("<III", 0, kind["func_proto"] << 24, self.int_id)
        next_id += 1
        self.func_ids: dict[str, int] = {}
        for func in func_names:  # static linkage: the kernel checks no arguments
            types += struct.pack("<III", name(func), kind["func"] << 24, proto_id)
            self.func_ids[func] = next_id
            next_id += 1
        header = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(types), len(types), len(strings))
        self.blob = header + bytes(types) + bytes(strings)


def _load_btf(blob: bytes) -> int:
    buf = ctypes.create_string_buffer(blob, len(blob))
    attr = ctypes.create_string_buffer(32)
    # union bpf_attr for BPF_BTF_LOAD: u64 btf, u64 btf_log_buf, u32 btf_size, ...; no log: the
    # kernel checked this blob when the compile loaded it
    struct.pack_into("<QQI", attr, 0, ctypes.addressof(buf), 0, len(blob))
    fd, err = bpf_syscall(_BPF_BTF_LOAD, attr)
    if fd < 0:
        raise CachedBPFError(f"BPF_BTF_LOAD: {os.strerror(err)}")
    return fd


_LOG_BYTES = 1 << 22  # a failed load is loaded again with the verifier's log, its tail shown
_PREFIXES = ("tracepoint__", "raw_tracepoint__", "kprobe__", "kretprobe__")


def prog_load(
    bpf: Any,
    name: str,
    prog_type: int,
    log_level: int = 0,
    log: ctypes.Array[ctypes.c_char] | None = None,
) -> tuple[int, int, ctypes.Array[ctypes.c_char]]:
    """One BPF_PROG_LOAD of an entry's program into a cached_bpf's maps, as BCC's load_func
    makes it (the kernel's name: the function's, its autoload prefix dropped, cut to 15 bytes),
    with a func_info (first instruction, BTF FUNC) for the program and each subprogram linked
    in, naming them in full. (fd or -1, errno, log)."""
    entry: Entry = bpf._entry
    if name not in entry.funcs:
        raise Exception(f"Unknown program {name}")
    spec = entry.funcs[name]
    insns = ctypes.create_string_buffer(spec.insns, len(spec.insns))
    for at, idx in spec.map_refs:
        struct.pack_into("<i", insns, at * _INSN + 4, bpf._map_fds[idx])
    names, btf_fd = bpf._names
    ids = names.func_ids
    funcs = [(0, ids[name]), *((at, ids[cb]) for at, cb in spec.subprogs)]
    func_info = (ctypes.c_uint32 * (2 * len(funcs)))(*(v for f in funcs for v in f))
    license = ctypes.create_string_buffer(entry.license.encode())
    short = next((name[len(p) :] for p in _PREFIXES if name.startswith(p)), name)
    log = log if log is not None else ctypes.create_string_buffer(0)
    attr = ctypes.create_string_buffer(120)
    struct.pack_into(
        "<IIQQIIQII16s",
        attr,
        0,
        prog_type,
        len(insns) // _INSN,
        ctypes.addressof(insns),
        ctypes.addressof(license),
        log_level,
        len(log) if log_level else 0,
        ctypes.addressof(log) if log_level else 0,
        entry.kern_version,
        0,  # prog_flags
        short.encode()[:15],
    )
    # prog_btf_fd, func_info_rec_size, func_info (bpf_func_info {insn_off, type_id}), count
    struct.pack_into("<IIQI", attr, 72, btf_fd, 8, ctypes.addressof(func_info), len(funcs))
    fd, err = bpf_syscall(_BPF_PROG_LOAD, attr)
    return fd, err, log


def _create_map(spec: MapSpec, btf: tuple[int, int, int] | None) -> int:
    """BPF_MAP_CREATE as BCC did it; btf: (fd, key type id, value type id) where needed."""
    attr = ctypes.create_string_buffer(72)
    struct.pack_into(
        "<5I", attr, 0, spec.type, spec.key_size, spec.value_size, spec.max_entries, spec.flags
    )
    # map_name[16] after inner_map_fd and numa_node
    struct.pack_into("16s", attr, 28, spec.kernel_name.encode()[:15])
    if btf is not None:
        struct.pack_into("<3I", attr, 48, *btf)
    fd, err = bpf_syscall(_BPF_MAP_CREATE, attr)
    if fd < 0:
        raise CachedBPFError(f"map {spec.name}: BPF_MAP_CREATE: {os.strerror(err)}")
    return fd


if __name__ == "__main__":
    sys.exit(_child_main())
