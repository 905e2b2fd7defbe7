"""Ring-buffer bytes -> typed records.

Byte 0 of every record is its type; decoders register by type, with the least and the most
bytes a record of that type has (an HTTP record ends after its last used work-set member).
Unknown types and short records are counted (decode_errors{reason}) and dropped, never fatal.
The layout and constants live in tracejoin.core.record (the mirror of bpf/http_record.h); they
are re-exported here for the modules that import them from the kernel side.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from tracejoin.core.hpack import huffman_decode
from tracejoin.core.metrics import Metrics
from tracejoin.core.record import (
    CNT_MAX,
    H2F_METHOD_HUFF,
    H2F_PATH_HUFF,
    H2F_TP_HUFF,
    HTTP_METHOD_MAX,
    HTTP_PATH_MAX,
    KERNEL_COUNTERS,
    REC_HTTP,
    REC_HTTP_FIXED_SIZE,
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
    WS_SLOTS,
    WSF_CUDA,
    HttpRecord,
    RunqWait,
    WsMember,
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


def decode_http(data: bytes) -> HttpRecord | None:
    """An HTTP record from its fixed part plus the work-set members it says it uses (all of it
    with WSF_CUDA); None when the bytes hold less than that (short)."""
    rec = HttpRecord.from_buffer_copy(data.ljust(_HTTP_SIZE, b"\0"))
    if len(data) < REC_HTTP_FIXED_SIZE + min(rec.ws_nslots, WS_SLOTS) * _MEMBER_SIZE:
        return None
    if rec.ws_flags & WSF_CUDA and len(data) < _HTTP_SIZE:
        return None  # says it carries CUDA sums, and does not
    if rec.h2_flags & (H2F_TP_HUFF | H2F_PATH_HUFF | H2F_METHOD_HUFF):
        _h2_decode_values(rec)
    return rec


def _put(rec: HttpRecord, field: str, value: bytes, cap: int) -> None:
    off = getattr(HttpRecord, field).offset
    ctypes.memmove(ctypes.addressof(rec) + off, value[:cap].ljust(cap, b"\0"), cap)


def _h2_decode_values(rec: HttpRecord) -> None:
    """An HTTP/2 stream's Huffman-coded values, decoded in place (RFC 7541 5.2), so everything
    downstream reads them as it reads HTTP/1.x ones. A traceparent that does not decode is left
    with length 0 (rejected as missing-or-malformed downstream, never guessed). The kernel
    stopped a Huffman-coded :path where a '?' could begin (bpf/http2_scan.h h2_str_byte, then
    flagged truncated), so a partial last code is dropped here; cutting at '?' again costs
    nothing and keeps the rule in one more place."""
    if rec.h2_flags & H2F_TP_HUFF:
        raw = ctypes.string_at(ctypes.addressof(rec) + HttpRecord.tp.offset, TP_CAP)
        tp = huffman_decode(raw[: min(rec.tp_len, TP_CAP)]) if rec.tp_len <= TP_CAP else None
        _put(rec, "tp", tp or b"", TP_CAP)
        rec.tp_len = min(len(tp), 0xFFFF) if tp is not None else 0
    if rec.h2_flags & H2F_PATH_HUFF:
        raw = ctypes.string_at(ctypes.addressof(rec) + HttpRecord.path.offset, HTTP_PATH_MAX)
        cut = bool(rec.flags & REQF_PATH_TRUNC)
        path = huffman_decode(raw[: min(rec.path_len, HTTP_PATH_MAX)], partial=cut) or b""
        for stop in (b"?", b"#"):
            if stop in path:
                path, cut = path.split(stop, 1)[0], False
        if len(path) > HTTP_PATH_MAX:
            path, cut = path[:HTTP_PATH_MAX], True
        _put(rec, "path", path, HTTP_PATH_MAX)
        rec.path_len = len(path)
        rec.flags = rec.flags | REQF_PATH_TRUNC if cut else rec.flags & ~REQF_PATH_TRUNC
    if rec.h2_flags & H2F_METHOD_HUFF:
        raw = ctypes.string_at(ctypes.addressof(rec) + HttpRecord.method.offset, HTTP_METHOD_MAX)
        method = huffman_decode(raw[: min(rec.method_len, HTTP_METHOD_MAX)]) or b""
        _put(rec, "method", method, HTTP_METHOD_MAX)
        rec.method_len = min(len(method), HTTP_METHOD_MAX)
    rec.h2_flags &= ~(H2F_TP_HUFF | H2F_PATH_HUFF | H2F_METHOD_HUFF)


_HTTP_SIZE, _MEMBER_SIZE = ctypes.sizeof(HttpRecord), ctypes.sizeof(WsMember)


class RecordDecoder:
    """Dispatch on byte 0; count what cannot be decoded."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._by_type: dict[int, tuple[int, int, Decoder]] = {}
        self.register(REC_HTTP, REC_HTTP_FIXED_SIZE, decode_http, ctypes.sizeof(HttpRecord))

    def register(
        self, rec_type: int, size: int, decoder: Decoder, max_size: int | None = None
    ) -> None:
        """`decoder` gets at least `size` and at most `max_size` (default: `size`) bytes and
        returns None when they are short for what the record says it holds."""
        self._by_type[rec_type] = (size, max_size or size, decoder)

    def decode(self, data: bytes) -> object | None:
        if not data:
            self._metrics.inc("decode_errors", reason="empty")
            return None
        entry = self._by_type.get(data[0])
        if entry is None:
            self._metrics.inc("decode_errors", reason="unknown_type")
            return None
        size, max_size, decoder = entry
        rec = decoder(data[:max_size]) if len(data) >= size else None
        if rec is None:
            self._metrics.inc("decode_errors", reason="short")
        return rec
