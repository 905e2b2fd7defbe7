"""Shared fixtures: a real Jaeger (session), the privileged-test gate, a free-port helper.

Tests import helpers from here or from tests/jaeger.py by module name (pytest puts tests/ on
sys.path because it has no __init__.py): `from conftest import free_port`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests start agents with subprocess.Popen(preexec_fn=...), which forks this (threaded)
# process with its atfork handlers; gRPC's (loaded here by the exporter tests) can then abort
# the child before it execs ("Epoll1Poller ... epoll_wait error: Bad file descriptor"). The
# agent never forks; only the test process needs gRPC's fork support off, before grpc loads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from jaeger import Jaeger, JaegerError, find_binary, free_port, missing_binary_message

__all__ = ["free_port", "privileged_missing"]

TRACEFS = Path("/sys/kernel/tracing")


def _mounted_fstype(mountpoint: Path) -> str | None:
    """The filesystem type mounted at `mountpoint` (from /proc/self/mounts, readable by all)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    fstype = None
    for line in lines:
        fields = line.split()
        if len(fields) >= 3 and fields[1] == str(mountpoint):
            fstype = fields[2]  # the last mount on a path is the visible one
    return fstype


def privileged_missing() -> str | None:
    """Why real BPF cannot run here, naming each missing piece and its fix; None when it can."""
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append(
            f"not running as root (euid {os.geteuid()}): run the privileged tests as root, "
            "e.g. `sudo make test`"
        )
    if _mounted_fstype(TRACEFS) != "tracefs":
        problems.append(
            f"tracefs is not mounted at {TRACEFS}: `mount -t tracefs tracefs {TRACEFS}` "
            "(`make setup` does this)"
        )
    release = os.uname().release
    build = Path(f"/lib/modules/{release}/build")
    if not build.exists():
        what = "is a dangling link" if build.is_symlink() else "is missing"
        problems.append(
            f"kernel headers: {build} {what}: install linux-headers-{release}, or run "
            "`make setup` (links Debian's linux-headers-amd64, enough for tracepoint-only probes)"
        )
    return "; ".join(problems) or None


@pytest.fixture(autouse=True)
def _workloads_keep_the_default_slice() -> Iterator[None]:
    """An agent started in this process (the session's, or a test's) asks for a longer CPU slice
    for every thread of it (--cpu-slice-ms), and the servers and clients tests start afterwards
    would inherit it. On a node the workloads keep the kernel's default: so do they, from the
    next test on."""
    yield
    from tracejoin.host.scheduling import set_slice

    for tid in os.listdir("/proc/self/task"):
        # OSError: a thread that ended, or a kernel without sched_setattr
        with contextlib.suppress(OSError):
            set_slice(int(tid), 0)


@pytest.fixture(scope="session")
def privileged() -> None:
    """Skip (with the exact missing piece and its fix) unless real BPF can be loaded here; for
    fixtures of any scope."""
    reason = privileged_missing()
    if reason:
        pytest.skip(f"privileged test needs: {reason}")


@pytest.fixture
def require_root(privileged: None) -> None:
    """The same, for a test function."""


@pytest.fixture(scope="session")
def jaeger() -> Iterator[Jaeger]:
    """A Jaeger v2 process with in-memory storage on free loopback ports, for the session.

    A missing binary fails (not skips): CI always builds it with `make setup`.
    """
    binary = find_binary()
    if binary is None:
        pytest.fail(missing_binary_message(), pytrace=False)
    instance = Jaeger(binary)
    try:
        instance.start()
    except JaegerError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="session")
def agent(jaeger: Jaeger) -> Iterator[object]:
    """The real pipeline, loaded once per session, filtered to a pool of test ports."""
    reason = privileged_missing()
    if reason:
        pytest.skip(reason)
    from harness import Agent, free_ports

    a = Agent(free_ports(64), "http://" + jaeger.otlp_grpc_endpoint)  # one per take_port()
    a.start()
    yield a
    a.shutdown()
