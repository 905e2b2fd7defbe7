"""Files tracejoin writes (capture output, span files, traces): private to the user who runs it.

The agent runs as root and writes into directories an operator names, which may be shared
(/tmp) or writable by others. Whatever sits at the target path is never trusted:

- a symbolic link is never followed (O_NOFOLLOW): a link planted at `spans.otlp.jsonl` cannot
  make root write, truncate or append to the file it points to;
- the result is a regular file with one link, owned by this user: a FIFO (which would block the
  open), a device, another user's file or a hard link to someone's file is refused before a
  byte is written or truncated;
- its mode is exactly 0600 (span data names the host's processes, paths and peers), also when
  an existing file of ours had a wider one.

Refusals raise UnsafeFileError (an OSError) with a message naming the path and the reason.
Here in core so that exporters, which may not import the commands, use it too.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import IO, Any

MODE = 0o600


class UnsafeFileError(OSError):
    """The target path is a symbolic link or not a file of ours: nothing was written."""


def open_private(
    path: str | os.PathLike[str],
    mode: str = "w",
    *,
    encoding: str | None = "utf-8",
    errors: str | None = None,
) -> IO[Any]:
    """Open `path` for writing as a private (0600) regular file of ours, never following a link.

    mode: "w"/"wb" (truncate or create) or "a"/"ab" (append or create); binary modes take no
    encoding. Raises UnsafeFileError for a symbolic link or a file that is not a plain file of
    ours, OSError for the rest (a missing directory, a full disk)."""
    if mode not in ("w", "wb", "a", "ab"):
        raise ValueError(f"open_private: mode must be w, wb, a or ab, not {mode!r}")
    path = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
    # O_NONBLOCK: opening a FIFO for writing would otherwise wait for a reader forever.
    flags |= os.O_NONBLOCK | (os.O_APPEND if mode.startswith("a") else 0)
    try:
        fd = os.open(path, flags, MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise UnsafeFileError(
                errno.ELOOP,
                f"refusing to write {path}: it is a symbolic link (to {_target(path)}); "
                "tracejoin never follows a link where it writes a file: remove it",
            ) from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader
            raise UnsafeFileError(
                errno.ENXIO, f"refusing to write {path}: it is a FIFO, not a regular file"
            ) from None
        raise
    try:
        _check(fd, path)
        if not mode.startswith("a"):
            os.ftruncate(fd, 0)  # only now: a refused file is left as it was
        os.fchmod(fd, MODE)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if "b" in mode:
            return os.fdopen(fd, mode)
        return os.fdopen(fd, mode, encoding=encoding, errors=errors)
    except BaseException:
        os.close(fd)
        raise


def write_private(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace `path`'s contents with `data` (text as UTF-8), as open_private does."""
    with open_private(path, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def _check(fd: int, path: str) -> None:
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "it is not a regular file"
    elif st.st_uid != os.geteuid():
        why = f"it belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()})"
    elif st.st_nlink != 1:
        why = f"it has {st.st_nlink} hard links (it could be another file's alias)"
    if why is not None:
        raise UnsafeFileError(errno.EPERM, f"refusing to write {path}: {why}; remove it")


def _target(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"
