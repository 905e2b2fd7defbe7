"""The compiled ring consumer (agent/kernel/_ring_read.c) on rings laid out by hand, the way the
kernel lays them out (kernel/bpf/ringbuf.c): an 8-byte header per record (length, with BUSY and
DISCARD bits), records 8-byte aligned, the data pages mapped twice in a row. The real kernel's
ring is read through it in every test that runs the agent (HttpProbes uses it where it was
built); test_loss_accounting runs BCC's reader beside it."""

from __future__ import annotations

import struct

import pytest
from tracejoin.kernel import ring

pytestmark = pytest.mark.skipif(not ring.COMPILED, reason="the compiled ring reader was not built")

PAGE = 4096
SIZE = 4096  # the data area: one page, so wrapping is easy to reach
BUSY, DISCARD = 1 << 31, 1 << 30


class FakeRing:
    """The consumer page and the producer page + data mapped twice, as bytearrays."""

    def __init__(self) -> None:
        self.cons = bytearray(PAGE)
        self.prod = bytearray(PAGE + 2 * SIZE)
        self.pos = 0  # producer_pos

    def write(self, payload: bytes, flags: int = 0) -> int:
        """Append a record (header + payload, rounded up to 8) at the producer position; it is
        written into both copies of the data, as the double mapping shows it. Returns its
        header's position."""
        at = self.pos
        rec = struct.pack("<II", len(payload) | flags, 0) + payload
        rec += b"\0" * (-len(rec) % 8)
        for i, b in enumerate(rec):
            off = (at + i) % SIZE
            self.prod[PAGE + off] = b
            self.prod[PAGE + SIZE + off] = b
        self.pos += len(rec)
        struct.pack_into("<Q", self.prod, 0, self.pos)
        return at

    def set_flags(self, at: int, flags: int) -> None:
        (length,) = struct.unpack_from("<I", self.prod, PAGE + at % SIZE)
        for base in (PAGE, PAGE + SIZE):
            struct.pack_into(
                "<I", self.prod, base + at % SIZE, (length & ~(BUSY | DISCARD)) | flags
            )

    @property
    def consumer_pos(self) -> int:
        return struct.unpack_from("<Q", self.cons, 0)[0]

    def consume(self, max_records: int = ring.MAX_BATCH) -> list[bytes]:
        assert ring._consume is not None
        return ring._consume(self.cons, bytes(self.prod), PAGE, SIZE - 1, max_records)


def test_every_committed_record_in_order_with_the_consumer_past_them():
    r = FakeRing()
    records = [bytes([i]) * n for i, n in enumerate([1, 7, 8, 9, 300, 0, 55])]
    for rec in records:
        r.write(rec)
    assert r.consume() == records
    assert r.consumer_pos == r.pos  # every header and padding stepped over
    assert r.consume() == []  # nothing twice


def test_a_discarded_record_is_skipped_and_a_busy_one_stops_the_read():
    r = FakeRing()
    r.write(b"kept")
    r.write(b"discarded", DISCARD)
    busy = r.write(b"still reserved", BUSY)
    r.write(b"after the busy one")
    assert r.consume() == [b"kept"]
    assert r.consumer_pos == busy  # the reserved record and what follows wait
    r.set_flags(busy, 0)  # committed
    assert r.consume() == [b"still reserved", b"after the busy one"]
    assert r.consumer_pos == r.pos


def test_a_record_across_the_end_of_the_data_reads_whole():
    r = FakeRing()
    filler = b"f" * (SIZE - 8 - 8 - 16)  # leaves 16 bytes before the end for the next header
    r.write(filler)
    assert r.consume() == [filler]
    across = bytes(range(200))
    r.write(across)  # header at SIZE - 16, its payload runs past the end into the second copy
    assert r.consume() == [across]
    assert r.consumer_pos == r.pos > SIZE


def test_a_batch_is_bounded_and_the_rest_waits():
    r = FakeRing()
    for i in range(10):
        r.write(bytes([i]))
    assert r.consume(max_records=4) == [bytes([i]) for i in range(4)]
    assert r.consume() == [bytes([i]) for i in range(4, 10)]


def test_a_length_beyond_the_ring_is_an_error_not_a_read_past_it():
    r = FakeRing()
    at = r.write(b"x")
    struct.pack_into("<I", r.prod, PAGE + at, SIZE + 1)
    with pytest.raises(RuntimeError, match="longer than the ring"):
        r.consume()
    assert r.consumer_pos == 0  # nothing consumed


def test_mappings_smaller_than_the_ring_are_refused():
    assert ring._consume is not None
    with pytest.raises(ValueError, match="smaller than the ring"):
        ring._consume(bytearray(PAGE), bytes(PAGE + SIZE), PAGE, SIZE - 1, 10)
    with pytest.raises(TypeError):
        ring._consume(bytes(PAGE), bytes(PAGE + 2 * SIZE), PAGE, SIZE - 1, 10)  # read-only


def test_the_reader_refuses_a_size_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        ring.RingReader(-1, 3 * PAGE)


# A real ring buffer, written by a program on this process's getppid(2) with the flags put in
# `flags` (1: BPF_RB_NO_WAKEUP, 2: BPF_RB_FORCE_WAKEUP), read through RingReader.
WAKE_PROGRAM = """
BPF_RINGBUF_OUTPUT(ring, 1);
BPF_ARRAY(flags, u64, 1);
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if ((bpf_get_current_pid_tgid() >> 32) != TGID)
        return 0;
    int zero = 0;
    u64 *f = flags.lookup(&zero);
    if (!f)
        return 0;
    u64 v = *f;
    ring.ringbuf_output(&v, sizeof(v), v);
    return 0;
}
"""
NO_WAKEUP, FORCE_WAKEUP = 1, 2


@pytest.fixture
def kernel_ring(require_root):
    import ctypes
    import os

    from bcc import BPF

    bpf = BPF(text=WAKE_PROGRAM.encode(), cflags=[f"-DTGID={os.getpid()}"])
    map_fd = bpf[b"ring"].map_fd
    reader = ring.RingReader(map_fd, PAGE)

    def submit(flags: int, n: int = 1) -> None:
        bpf[b"flags"][ctypes.c_int(0)] = ctypes.c_uint64(flags)
        for _ in range(n):
            os.getppid()

    try:
        yield reader, submit, map_fd
    finally:
        reader.close()
        bpf.cleanup()


@pytest.mark.privileged
def test_only_the_kernels_wake_up_ends_a_wait(kernel_ring):
    """After a forced wake-up has been read, records submitted without one are taken when the
    wait runs out, not at once: a level-triggered epoll would report the fd ready again for as
    long as the ring held anything, and the reader would spin on tiny batches."""
    reader, submit, _ = kernel_ring
    submit(FORCE_WAKEUP)
    assert reader.poll(10_000) == [struct.pack("<Q", FORCE_WAKEUP)]
    assert reader.last_wait == "woken"
    submit(NO_WAKEUP, 3)
    assert reader.poll(50) == [struct.pack("<Q", NO_WAKEUP)] * 3
    assert reader.last_wait == "timeout"
    submit(FORCE_WAKEUP)  # a wake-up that came while no one waited is not lost
    assert reader.poll(10_000) == [struct.pack("<Q", FORCE_WAKEUP)]
    assert reader.last_wait == "woken"


@pytest.mark.privileged
def test_records_left_behind_are_taken_without_waiting(kernel_ring):
    reader, submit, _ = kernel_ring
    submit(NO_WAKEUP, 5)
    assert len(reader.poll(0, max_records=2)) == 2
    assert reader.poll(60_000) == [struct.pack("<Q", NO_WAKEUP)] * 3
    assert reader.last_wait == "none"


@pytest.mark.privileged
def test_bccs_reader_waits_on_the_same_wake_ups(kernel_ring):
    """BCC's reader (no compiler) consumes through libbpf but waits on RingWakeups: records
    already in the ring, and more without a wake-up, do not end its wait; a wake-up does."""
    _, submit, map_fd = kernel_ring
    wakeups = ring.RingWakeups(map_fd)
    try:
        submit(FORCE_WAKEUP)
        assert wakeups.wait(10_000) == "woken"
        submit(NO_WAKEUP, 3)  # nothing consumed: four records wait in the ring
        assert wakeups.wait(50) == "timeout"
        submit(FORCE_WAKEUP)
        assert wakeups.wait(10_000) == "woken"
    finally:
        wakeups.close()
