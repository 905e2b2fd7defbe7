"""Build the CUDA test doubles (tests/cuda_src/*.c) with the C compiler, at test time.

`build(dir)` gives a driver `libcuda.so.1`, a runtime `libcudart.so.12` linked against it, the
same runtime under an auditwheel-style hashed name (`libcudart-<hash>.so.12`), and an HTTP
server executable with the runtime linked in statically. The runtime calls the driver beneath
it, as the real one does, so counting both layers would count twice.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).parent / "cuda_src"
SYNC_US = 30_000  # what the driver's cuStreamSynchronize sleeps
HASHED = "libcudart-4f2a9c1b.so.12"


@dataclass(frozen=True)
class Stubs:
    dir: Path
    driver: Path  # libcuda.so.1
    runtime: Path  # libcudart.so.12
    hashed: Path  # libcudart-<hash>.so.12
    static_server: Path  # executable: runtime linked in, driver shared
    shared_server: Path  # the same server, runtime and driver shared (bench/cuda_cost.py)


def compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def build(out: Path) -> Stubs:
    cc = compiler()
    assert cc, "no C compiler"
    out.mkdir(parents=True, exist_ok=True)
    drv, rt, hashed = out / "libcuda.so.1", out / "libcudart.so.12", out / HASHED
    opt = ["-O2", "-Wall", f"-DSTUB_SYNC_US={SYNC_US}"]

    def run(*args: str) -> None:
        subprocess.run([cc, *opt, *args], check=True)

    run("-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(drv), str(SRC / "cuda.c"))
    link = [f"-L{out}", "-l:libcuda.so.1", f"-Wl,-rpath,{out}"]
    for lib in (rt, hashed):
        soname = f"-Wl,-soname,{lib.name}"
        run("-shared", "-fPIC", soname, "-o", str(lib), str(SRC / "cudart.c"), *link)
    server = out / "cuda-static-server"
    run("-o", str(server), str(SRC / "server.c"), str(SRC / "cudart.c"), *link)
    shared = out / "cuda-shared-server"
    run("-o", str(shared), str(SRC / "server.c"), "-l:libcudart.so.12", *link)
    return Stubs(out, drv, rt, hashed, server, shared)
