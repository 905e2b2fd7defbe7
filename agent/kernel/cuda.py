"""CUDA libraries on this host: find them per process, and attach bpf/cuda.h's uprobes to them.

Opt-in (`--cuda`). What is found, per process (/proc/<pid>/maps, through /proc/<pid>/root so a
container's own files are probed):
- the runtime, `libcudart.so.*`, including auditwheel's renamed copies
  (`torch/lib/libcudart-<hash>.so.12`) and the pip wheels' `nvidia/cuda_runtime/lib/` and
  `nvidia/cu13/lib/` copies: the file name is what is matched, wherever it lives;
- the driver, `libcuda.so.1`: always shared, and the fallback when the runtime is not found;
- an executable with the runtime linked statically (nvcc's default), through its symbol table.
  One that maps the driver but has no runtime symbols is reported as not probeable (its driver
  calls are still probed).

A uprobe is attached to a file (its inode), so each file is attached once, for every process that
maps it now or later. Libraries opened later with dlopen are found by rescanning: every
TRACKED_RESCAN_S the processes the agent saw serving or working for a request, and every
FULL_RESCAN_S all of them.

`tracejoin doctor` prints `discover()`'s findings; nothing here needs the probes loaded except
`CudaProbes.attach`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracejoin.core.metrics import Metrics

log = logging.getLogger(__name__)

TRACKED_RESCAN_S = 1.0
FULL_RESCAN_S = 15.0
TRACKED_MAX = 4096  # processes remembered for the fast rescan (most recent first)

_RUNTIME = re.compile(r"^libcudart(?:-[0-9a-f]{8,})?\.so(?:\.\d+)*$")
_DRIVER = re.compile(r"^libcuda\.so(?:\.\d+)*$")
_ROW = re.compile(r"X\((\d+),\s*(\w+),\s*(CC_\w+),\s*(\d+),\s*(\w+),\s*([01])\)")


@dataclass(frozen=True)
class CudaApi:
    """One row of bpf/cuda.h CUDA_APIS."""

    api: int
    symbol: str
    cls: str  # CC_*
    ret: bool = True  # a return probe too (runtime calls and synchronisations)

    @property
    def layer(self) -> str:
        return "runtime" if self.symbol.startswith("cuda") else "driver"

    @property
    def entry_fn(self) -> str:
        return f"cuda_e_{self.api}"


def load_apis(header: Path) -> tuple[CudaApi, ...]:
    """The probed calls, read from the table the BPF programs are generated from."""
    text = header.read_text()
    body = text[text.index("#define CUDA_APIS(X)") :]
    body = body[: body.index("\n\n")]
    return tuple(CudaApi(int(a), s, c, r == "1") for a, s, c, _, _, r in _ROW.findall(body))


def library_kind(path: str) -> str | None:
    """ "runtime", "driver", or None, from a mapped file's name."""
    name = path.rsplit("/", 1)[-1]
    if _RUNTIME.match(name):
        return "runtime"
    if _DRIVER.match(name):
        return "driver"
    return None


@dataclass
class CudaFile:
    """A file to probe (or that could not be): a library, or an executable with a static runtime."""

    path: str  # as seen inside the process (for people)
    open_path: str  # through /proc/<pid>/root (to open and attach)
    kind: str  # "runtime", "driver", "static"
    key: tuple[int, int]  # (st_dev, st_ino): one attach per file
    pids: set[int] = field(default_factory=set)
    symbols: tuple[str, ...] = ()  # probed calls it defines
    probes: int = 0  # uprobes attached (entry + return)
    error: str | None = None  # why it is not probed
    attached: bool = False  # attach() has run on it

    @property
    def state(self) -> str:
        if self.error:
            return f"not probeable: {self.error}"
        return f"probed ({self.probes} uprobes)" if self.attached else "found"


def _maps_paths(pid: int, proc: Path) -> list[str]:
    try:
        data = (proc / str(pid) / "maps").read_bytes()
    except OSError:
        return []
    if b"libcud" not in data:  # the common case: no CUDA library at all
        return []
    out = []
    for line in data.split(b"\n"):
        parts = line.split(None, 5)
        if len(parts) == 6 and b"libcud" in parts[5]:
            path = parts[5].decode("utf-8", "replace").strip()
            if path not in out:
                out.append(path)
    return out


def function_symbols(path: str) -> set[str]:
    """Names of the functions a file defines (symbol table and dynamic symbols)."""
    from bcc import BPF  # Debian's python3-bpfcc: its ELF reader, no BPF loaded

    names = BPF.get_user_functions_and_addresses(path.encode(), rb"^cu")
    return {n.decode() for n, addr in names if addr}


class Discovery:
    """What CUDA each process maps; each file looked at once (by device and inode)."""

    def __init__(
        self,
        apis: Iterable[CudaApi],
        proc: Path = Path("/proc"),
        symbols: Callable[[str], set[str]] = function_symbols,
    ) -> None:
        self.apis = tuple(apis)
        self.proc = proc
        self._symbols = symbols
        self.files: dict[tuple[int, int], CudaFile] = {}
        self.notes: dict[int, str] = {}  # pid -> what could not be probed in it, and why
        self._exes: dict[tuple[int, int], bool] = {}  # executables looked at: has a runtime

    def all_pids(self) -> list[int]:
        try:
            return [int(n) for n in os.listdir(self.proc) if n.isdigit()]
        except OSError:
            return []

    def scan(self, pids: Iterable[int]) -> list[CudaFile]:
        """Look at these processes; return the files not seen before."""
        new: list[CudaFile] = []
        for pid in pids:
            new.extend(self._scan_pid(pid))
        return new

    def _scan_pid(self, pid: int) -> list[CudaFile]:
        root = self.proc / str(pid) / "root"
        new: list[CudaFile] = []
        kinds = set()
        for path in _maps_paths(pid, self.proc):
            kind = library_kind(path.removesuffix(" (deleted)"))
            if kind is None:
                continue
            kinds.add(kind)
            f = self._file(pid, path, str(root) + path, kind, new)
            if f is not None and path.endswith(" (deleted)"):
                f.error = "deleted on disk since it was mapped"
        if "driver" in kinds and "runtime" not in kinds:
            self._static(pid, root, new)
        return new

    def _file(
        self, pid: int, path: str, open_path: str, kind: str, new: list[CudaFile]
    ) -> CudaFile | None:
        try:
            st = os.stat(open_path)
        except PermissionError:  # another pod's files: the ptrace access check on /proc/<pid>/root
            self.notes[pid] = (
                f"{path}: cannot be opened through /proc/{pid}/root (the agent lacks "
                "CAP_SYS_PTRACE for this process): not probed"
            )
            return None
        except OSError:
            return None  # gone, or the process exited
        key = (st.st_dev, st.st_ino)
        f = self.files.get(key)
        if f is None:
            f = CudaFile(path, open_path, kind, key)
            try:
                have = self._symbols(open_path)
            except Exception as exc:  # an unreadable or odd ELF: reported, never fatal
                f.error = f"symbols unreadable ({exc})"
                have = set()
            f.symbols = tuple(a.symbol for a in self.apis if a.symbol in have)
            if not f.error and not f.symbols:
                f.error = "defines none of the probed calls"
            self.files[key] = f
            new.append(f)
        f.pids.add(pid)
        return f

    def _static(self, pid: int, root: Path, new: list[CudaFile]) -> None:
        """The process maps the driver but no runtime library: a runtime linked statically into
        its executable is probed through the executable's symbol table, when it has one."""
        exe = self.proc / str(pid) / "exe"
        try:
            target = os.readlink(exe)
            st = os.stat(exe)
        except OSError:
            return
        key = (st.st_dev, st.st_ino)
        if key not in self._exes:
            try:
                have = self._symbols(str(root) + target)
            except Exception:
                have = set()
            runtime = {a.symbol for a in self.apis if a.layer == "runtime"}
            self._exes[key] = bool(have & runtime)
        if self._exes[key]:
            self._file(pid, target, str(root) + target, "static", new)
        else:
            self.notes[pid] = (
                f"{target}: maps the driver but no runtime library, and its executable has no "
                "runtime symbols (a stripped static cudart, or the driver API only): only its "
                "driver calls are probed"
            )


class CudaProbes:
    """Attaches bpf/cuda.h's programs to every CUDA file found, and rescans for new ones."""

    def __init__(
        self,
        bpf: Any,
        apis: Iterable[CudaApi],
        metrics: Metrics,
        launches: bool = False,
        proc: Path = Path("/proc"),
    ) -> None:
        self.bpf = bpf
        self.metrics = metrics
        self.launches = launches
        self.discovery = Discovery(apis, proc)
        self._by_symbol = {a.symbol: a for a in self.discovery.apis}
        self._tracked: dict[int, None] = {}  # insertion-ordered set, most recent last
        self._next_tracked = 0.0
        self._next_full = 0.0

    def start(self) -> None:
        # the program that counts a call at its entry, in the slot the entries tail-call,
        # before any entry is attached (bpf/cuda.h, cuda_count)
        from bcc import BPF

        fn = self.bpf.load_func(b"cuda_count", BPF.KPROBE)
        self.bpf[b"cuda_progs"][ctypes.c_int(0)] = ctypes.c_int(fn.fd)
        self.rescan(full=True)

    def track(self, pids: Iterable[int]) -> None:
        """Processes seen serving or working for a request: rescanned often (dlopen)."""
        for pid in pids:
            if pid:
                self._tracked.pop(pid, None)
                self._tracked[pid] = None
        while len(self._tracked) > TRACKED_MAX:
            self._tracked.pop(next(iter(self._tracked)))

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now >= self._next_full:
            self.rescan(full=True, now=now)
        elif now >= self._next_tracked:
            self.rescan(full=False, now=now)

    def rescan(self, full: bool, now: float | None = None) -> list[CudaFile]:
        now = time.monotonic() if now is None else now
        pids = self.discovery.all_pids() if full else list(self._tracked)
        if full:
            self._next_full = now + FULL_RESCAN_S
            for f in self.files():  # rebuilt from the live processes below: bounded
                f.pids.clear()
            alive = set(pids)
            for pid in [p for p in self._tracked if p not in alive]:
                del self._tracked[pid]
        self._next_tracked = now + TRACKED_RESCAN_S
        new = self.discovery.scan(pids)
        for f in new:
            self.attach(f)
        if new:
            self._metrics()
        return new

    def attach(self, f: CudaFile) -> None:
        if f.error:
            f.attached = True
            log.warning("CUDA: %s %s", f.path, f.state)
            return
        path = f.open_path.encode()
        for sym in f.symbols:
            api = self._by_symbol[sym]
            if api.cls == "CC_LAUNCH" and not self.launches:
                continue
            try:
                self.bpf.attach_uprobe(name=path, sym=sym.encode(), fn_name=api.entry_fn.encode())
                f.probes += 1
                if api.ret:
                    self.bpf.attach_uretprobe(name=path, sym=sym.encode(), fn_name=b"cuda_ret")
                    f.probes += 1
            except Exception as exc:  # reported per file; the other files still attach
                f.error = f"attaching {sym} failed ({exc})"
                break
        f.attached = True
        log.info("CUDA: %s (%s) %s", f.path, f.kind, f.state)

    def files(self) -> list[CudaFile]:
        return list(self.discovery.files.values())

    def _metrics(self) -> None:
        probed = sum(1 for f in self.files() if f.attached and not f.error)
        failed = sum(1 for f in self.files() if f.error)
        self.metrics.set("cuda_files", probed, state="probed")
        self.metrics.set("cuda_files", failed, state="not_probeable")
        self.metrics.set("cuda_uprobes", sum(f.probes for f in self.files()))


def discover(header: Path, proc: Path = Path("/proc")) -> tuple[list[CudaFile], dict[int, str]]:
    """Every CUDA file mapped on this host now, and per process what could not be probed."""
    d = Discovery(load_apis(header), proc)
    d.scan(d.all_pids())
    return list(d.files.values()), dict(d.notes)
