"""Ring-buffer bytes -> typed records: the ctypes mirror of bpf/http_record.h.

Byte 0 of every record is its type; decoders register by type. Unknown types and short records
are counted (decode_errors{reason}) and dropped, never fatal.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from tracejoin.core.metrics import Metrics

REC_HTTP = 1

HTTP_METHOD_MAX = 8
HTTP_PATH_MAX = 96
TP_CAP = 56
RUNQ_SLOTS = 4

# record flags (REQF_* in bpf/http_record.h)
REQF_TP_WINDOW = 0x0001
REQF_HDR_DONE = 0x0002
REQF_NO_RESPONSE = 0x0004
REQF_RESP_UNTERM = 0x0008
REQF_PATH_TRUNC = 0x0010
REQF_TP_SPLIT = 0x0020
REQF_TUPLE = 0x0040
REQF_FIRST_ON_CONN = 0x0080
REQF_TLB_HW = 0x0100
REQF_RESP_TRUNC = 0x0200

# indices of the per-CPU `counters` map (CNT_* in bpf/http_record.h)
KERNEL_COUNTERS = {
    0: "records_submitted",
    1: "ringbuf_full",
    2: "pipeline_slots_full",
    3: "non_http_connections",
    4: "request_state_lost",
    5: "read_copy_failed",
}
CNT_MAX = 8


class RunqWait(ctypes.Structure):
    _fields_ = (("start_ns", ctypes.c_uint64), ("dur_ns", ctypes.c_uint64))


class HttpRecord(ctypes.Structure):
    """Mirror of struct http_record. tests/test_decode.py checks it against the C layout."""

    _fields_ = (
        ("type", ctypes.c_uint8),
        ("family", ctypes.c_uint8),
        ("method_len", ctypes.c_uint8),
        ("path_len", ctypes.c_uint8),
        ("flags", ctypes.c_uint16),
        ("status", ctypes.c_uint16),
        ("lport", ctypes.c_uint16),
        ("rport", ctypes.c_uint16),
        ("tp_len", ctypes.c_uint16),
        ("tp_count", ctypes.c_uint8),
        ("_pad0", ctypes.c_uint8),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("fd", ctypes.c_uint32),
        ("_pad1", ctypes.c_uint32),
        ("conn_id", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
        ("arrival_ns", ctypes.c_uint64),
        ("read_ns", ctypes.c_uint64),
        ("resp_start_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        ("est_ns", ctypes.c_uint64),
        ("req_bytes", ctypes.c_uint64),
        ("resp_bytes", ctypes.c_uint64),
        ("laddr", ctypes.c_uint8 * 16),
        ("raddr", ctypes.c_uint8 * 16),
        ("method", ctypes.c_char * HTTP_METHOD_MAX),
        ("path", ctypes.c_char * HTTP_PATH_MAX),
        ("tp", ctypes.c_char * TP_CAP),
        ("runq_ns", ctypes.c_uint64),
        ("runq_max_ns", ctypes.c_uint64),
        ("offcpu_ns", ctypes.c_uint64),
        ("tlb_a", ctypes.c_uint64),
        ("tlb_b", ctypes.c_uint64),
        ("minflt", ctypes.c_uint32),
        ("majflt", ctypes.c_uint32),
        ("nr_switches", ctypes.c_uint32),
        ("retrans", ctypes.c_uint32),
        ("srtt_us", ctypes.c_uint32),
        ("unacked_max", ctypes.c_uint32),
        ("runq", RunqWait * RUNQ_SLOTS),
    )

    def method_str(self) -> str:
        return bytes(self.method[: self.method_len]).decode("ascii", "replace")

    def method_bytes(self) -> bytes:
        # As path_bytes: the bytes as sent, a NUL included (core.text.http_method judges them).
        raw = ctypes.string_at(ctypes.addressof(self) + HttpRecord.method.offset, HTTP_METHOD_MAX)
        return raw[: min(self.method_len, HTTP_METHOD_MAX)]

    def path_bytes(self) -> bytes:
        # ctypes c_char arrays stop at NUL; the length field is the truth.
        raw = ctypes.string_at(ctypes.addressof(self) + HttpRecord.path.offset, HTTP_PATH_MAX)
        return raw[: min(self.path_len, HTTP_PATH_MAX)]

    def traceparent_bytes(self) -> bytes:
        """The captured value prefix: at most 56 bytes, trailing OWS excluded."""
        raw = ctypes.string_at(ctypes.addressof(self) + HttpRecord.tp.offset, TP_CAP)
        return raw[: min(self.tp_len, TP_CAP)]


Decoder = Callable[[bytes], object]


class RecordDecoder:
    """Dispatch on byte 0; count what cannot be decoded."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._by_type: dict[int, tuple[int, Decoder]] = {}
        self.register(REC_HTTP, ctypes.sizeof(HttpRecord), HttpRecord.from_buffer_copy)

    def register(self, rec_type: int, size: int, decoder: Decoder) -> None:
        self._by_type[rec_type] = (size, decoder)

    def decode(self, data: bytes) -> object | None:
        if not data:
            self._metrics.inc("decode_errors", reason="empty")
            return None
        entry = self._by_type.get(data[0])
        if entry is None:
            self._metrics.inc("decode_errors", reason="unknown_type")
            return None
        size, decoder = entry
        if len(data) < size:
            self._metrics.inc("decode_errors", reason="short")
            return None
        return decoder(data[:size])
