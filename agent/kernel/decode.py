"""Ring-buffer bytes -> typed records.

Byte 0 of every record is its type; decoders register by type. Unknown types and short records
are counted (decode_errors{reason}) and dropped, never fatal. The layout and constants live in
tracejoin.core.record (the mirror of bpf/http_record.h); they are re-exported here for the
modules that import them from the kernel side.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from tracejoin.core.metrics import Metrics
from tracejoin.core.record import (
    CNT_MAX,
    HTTP_METHOD_MAX,
    HTTP_PATH_MAX,
    KERNEL_COUNTERS,
    REC_HTTP,
    REQF_FIRST_ON_CONN,
    REQF_HDR_DONE,
    REQF_NO_RESPONSE,
    REQF_PATH_TRUNC,
    REQF_RESP_TRUNC,
    REQF_RESP_UNTERM,
    REQF_TLB_HW,
    REQF_TP_SPLIT,
    REQF_TP_WINDOW,
    REQF_TUPLE,
    RUNQ_SLOTS,
    TP_CAP,
    HttpRecord,
    RunqWait,
)

__all__ = [
    "CNT_MAX",
    "HTTP_METHOD_MAX",
    "HTTP_PATH_MAX",
    "KERNEL_COUNTERS",
    "REC_HTTP",
    "REQF_FIRST_ON_CONN",
    "REQF_HDR_DONE",
    "REQF_NO_RESPONSE",
    "REQF_PATH_TRUNC",
    "REQF_RESP_TRUNC",
    "REQF_RESP_UNTERM",
    "REQF_TLB_HW",
    "REQF_TP_SPLIT",
    "REQF_TP_WINDOW",
    "REQF_TUPLE",
    "RUNQ_SLOTS",
    "TP_CAP",
    "Decoder",
    "HttpRecord",
    "RecordDecoder",
    "RunqWait",
]

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
