"""The records ring buffer, read without a Python call per record.

BCC's reader (`open_ring_buffer` + `ring_buffer_poll`) is libbpf's, which calls back into Python
once per record through ctypes. Where `_ring_read.c` was compiled at install, RingReader maps the
ring itself, as libbpf does (the consumer page read-write; the producer page and the data pages,
which the kernel maps twice in a row so no record wraps, read-only), waits on the map's fd with
epoll, and copies every committed record out in one C call. Where it was not, HttpProbes keeps
BCC's reader: the same records, one callback each (tests run both).
"""

from __future__ import annotations

import mmap
import select
import struct

try:  # the compiled consumer (built where a C compiler was, at install)
    from tracejoin.kernel._ring_read import consume as _consume
except ImportError:  # pragma: no cover - BCC's per-record callback reader, under the same tests
    _consume = None

COMPILED = _consume is not None

# One consume() takes at most this many records: a producer that never lets up cannot keep
# the reader in one call (the rest waits for the next poll).
MAX_BATCH = 65_536
_POS = struct.Struct("<Q")  # consumer_pos, producer_pos: each the first word of its page


class RingWakeups:
    """Waits for a ring's wake-ups, by the map's fd. Edge-triggered: epoll reports the
    kernel's wake-ups only. Level-triggered, the fd stays ready after one wake-up for as long as
    each wait finds a record in the ring, which at a few thousand records a second is every
    wait: the reader then spins on batches of a few records, each paying the wake-up and cold
    caches, and the kernel's BPF_RB_NO_WAKEUP buys nothing. A wake-up that comes while no one
    waits ends the next wait at once. (Both readers use it: RingReader, and BCC's, whose own
    poll is libbpf's level-triggered one.)"""

    def __init__(self, map_fd: int) -> None:
        self._epoll = select.epoll()
        self._epoll.register(map_fd, select.EPOLLIN | select.EPOLLET)

    def wait(self, timeout_ms: int) -> str:
        """Up to timeout_ms: "woken" (the kernel's wake-up) or "timeout"."""
        return "woken" if self._epoll.poll(timeout_ms / 1000) else "timeout"

    def close(self) -> None:
        self._epoll.close()


class RingReader:
    """A BPF_MAP_TYPE_RINGBUF map's consumer, by its fd and size (max_entries, a power of two
    pages). close() unmaps; the map itself belongs to whoever loaded it."""

    def __init__(self, map_fd: int, size: int) -> None:
        if _consume is None:
            raise RuntimeError("the compiled ring reader was not built (see `tracejoin doctor`)")
        if size <= 0 or size & (size - 1):
            raise ValueError(f"ring size {size} is not a power of two")
        page = mmap.PAGESIZE
        self._page, self._mask = page, size - 1
        self._cons = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self._prod = mmap.mmap(
                map_fd, page + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page
            )
        except Exception:
            self._cons.close()
            raise
        self._wakeups = RingWakeups(map_fd)
        self._more = False  # the last consume stopped at max_records: records are waiting
        # how the last poll() ended its wait: "woken" (the kernel's wake-up), "timeout", or
        # "none" (no wait: timeout 0, or records were left behind)
        self.last_wait = "none"

    def poll(self, timeout_ms: int, max_records: int = MAX_BATCH) -> list[bytes]:
        """Wait up to timeout_ms (0: not at all) for the kernel's wake-up, then take the
        committed records, at most max_records. The kernel wakes the reader only when half the
        ring could be full (bpf/http_conn.h emit()), so the wait usually runs out: the records
        are taken anyway. When the last call left records behind, this one does not wait (with
        edge-triggered epoll, records already there wake no one)."""
        if timeout_ms and not self._more:
            self.last_wait = self._wakeups.wait(timeout_ms)
        else:
            self.last_wait = "none"
        return self.consume(max_records)

    def consume(self, max_records: int = MAX_BATCH) -> list[bytes]:
        assert _consume is not None
        batch = _consume(self._cons, self._prod, self._page, self._mask, max_records)
        self._more = len(batch) >= max_records
        return batch

    def backlog(self) -> float:
        """The share of the ring written and not yet consumed, now (an estimate: the two
        positions are read one after the other, without ordering)."""
        (cons,) = _POS.unpack_from(self._cons)
        (prod,) = _POS.unpack_from(self._prod)
        return max(0, prod - cons) / (self._mask + 1)

    def close(self) -> None:
        self._wakeups.close()
        self._prod.close()
        self._cons.close()
