"""tracejoin.core.files: output files are private (0600) and never written through a link."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest
from tracejoin.core.files import MODE, UnsafeFileError, open_private, write_private


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_new_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)  # a umask of 0 would leave a plain open()'s 0666 as is
    try:
        write_private(tmp_path / "a.txt", "hello\n")
        with open_private(tmp_path / "b.bin", "wb") as fh:
            fh.write(b"\x00\x01")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").read_text() == "hello\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert _mode(tmp_path / "a.txt") == MODE == 0o600
    assert _mode(tmp_path / "b.bin") == 0o600


def test_existing_file_of_ours_is_replaced_or_appended_and_made_private(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    path.write_text("old contents\n")
    path.chmod(0o644)
    write_private(path, "new\n")
    assert path.read_text() == "new\n"
    assert _mode(path) == 0o600
    path.chmod(0o666)
    with open_private(path, "a") as fh:
        fh.write("more\n")
    assert path.read_text() == "new\nmore\n"
    assert _mode(path) == 0o600


@pytest.mark.parametrize("mode", ["w", "a"])
def test_symlink_at_the_target_is_not_followed(tmp_path: Path, mode: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    link = tmp_path / "summary.txt"
    link.symlink_to(victim)
    with pytest.raises(UnsafeFileError) as err, open_private(link, mode) as fh:
        fh.write("overwritten\n")
    msg = str(err.value)
    assert str(link) in msg and "symbolic link" in msg and str(victim) in msg, msg
    assert victim.read_text() == "precious\n"  # not truncated, not appended to
    assert _mode(victim) == 0o644  # not chmod-ed through the link
    assert link.is_symlink()  # left for the operator to look at


def test_dangling_symlink_does_not_create_its_target(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "created-by-root"
    target.parent.mkdir()
    link = tmp_path / "counters.json"
    link.symlink_to(target)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        write_private(link, "{}")
    assert not target.exists()


def test_hard_link_to_another_file_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    alias = tmp_path / "capture.json"
    os.link(victim, alias)
    with pytest.raises(UnsafeFileError, match="2 hard links"):
        write_private(alias, "x")
    assert victim.read_text() == "precious\n"


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "spans.otlp.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeFileError, match="FIFO"):
        open_private(fifo, "a")
    # With a reader waiting, the open succeeds at once, and the type check refuses it.
    reader = threading.Thread(target=lambda: open(fifo, "rb").close(), daemon=True)
    reader.start()
    for _ in range(10_000):
        try:
            open_private(fifo, "w")
        except UnsafeFileError as exc:
            if "not a regular file" in str(exc):
                break  # refused after the open, by type
            assert "FIFO" in str(exc)  # ENXIO: the reader has not reached open() yet
        else:
            pytest.fail("a FIFO was opened for writing")
        time.sleep(0.001)
    else:
        pytest.fail("the reader never opened the FIFO")
    reader.join(5)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a file to another user")
def test_another_users_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    path.write_text("theirs\n")
    os.chown(path, 65534, 65534)
    with pytest.raises(UnsafeFileError, match="belongs to uid 65534"):
        write_private(path, "ours\n")
    assert path.read_text() == "theirs\n"


def test_missing_directory_is_a_plain_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_private(tmp_path / "nope" / "x", "y")


def test_bad_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        open_private("/tmp/x", "r")
