"""OTLP trace protobuf, written straight to wire bytes: the primitives, attribute encoding and
the Span message. Shared by the exporters (model.Span -> bytes, exporters/otlp_proto.py) and the
span builder's object-free path (record -> bytes, pipeline/span_bytes.py), so both write the
same bytes for the same span.

Building protobuf message objects field by field costs ~2 µs per attribute; writing the wire
format by hand, with the encoded attribute keys, the repeating (key, string value) pairs and each
Resource cached, costs a fraction of that.

Field numbers are from opentelemetry/proto/{collector/trace,trace,common,resource}/v1/*.proto.
Fields are written in whatever order is cheapest; protobuf parsers accept any order.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from tracejoin.core.model import AttrValue, Resource, Span

_INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
_U64 = 1 << 64
M64 = _U64 - 1

# Single-byte varints; most lengths and small ints hit this table.
V1 = tuple(bytes((i,)) for i in range(128))


def varint(n: int) -> bytes:
    """Unsigned LEB128; callers map negative int64 to its two's complement first. Unrolled up
    to 4 bytes (28 bits: sizes, ports, durations up to 268 ms), the common lengths here."""
    if n < 0x80:
        return V1[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0x200000:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, n >> 14))
    if n < 0x10000000:
        return bytes(
            ((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, ((n >> 14) & 0x7F) | 0x80, n >> 21)
        )
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def ld(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: tag, length, body."""
    n = len(body)
    return tag + (V1[n] if n < 0x80 else varint(n)) + body


# Tags: (field_number << 3) | wire_type, pre-encoded.
_T_KV_KEY = b"\x0a"  # KeyValue.key
_T_KV_VALUE = b"\x12"  # KeyValue.value
T_ANY_STRING = b"\x0a"  # AnyValue.string_value
_T_ANY_BOOL = b"\x10"
T_ANY_INT = b"\x18"
_T_ANY_DOUBLE = b"\x21"
T_SPAN_ATTR = b"\x4a"  # Span.attributes (9)
_T_SPAN_EVENT = b"\x5a"  # Span.events (11)
T_SPAN_NAME = b"\x2a"  # Span.name (5)
T_SPAN_KIND = b"\x30"  # Span.kind (6)
T_SPAN_STATUS = b"\x7a"  # Span.status (15)
_T_EVENT_NAME = b"\x12"  # Event.name (2)
_T_EVENT_ATTR = b"\x1a"  # Event.attributes (3)
_T_RES_ATTR = b"\x0a"  # Resource.attributes (1)
_T_STATUS_MSG = b"\x12"  # Status.message (2)
_T_STATUS_CODE = b"\x18"  # Status.code (3)
_T_RS_RESOURCE = b"\x0a"  # ResourceSpans.resource (1)
T_RS_SCOPE_SPANS = b"\x12"  # ResourceSpans.scope_spans (2)
T_SS_SCOPE = b"\x0a"  # ScopeSpans.scope (1)
T_SS_SPAN = b"\x12"  # ScopeSpans.spans (2)
T_REQ_RS = b"\x0a"  # ExportTraceServiceRequest.resource_spans (1)

# Fixed-size span fields in one pack each: trace_id(1) + span_id(2) [+ parent_span_id(4)] as
# big-endian ids, then start(7)/end(8) fixed64 and flags(16, tag 0x85 0x01) fixed32 little-endian.
IDS = struct.Struct(">2sQQ2sQ").pack
IDS_PARENT = struct.Struct(">2sQQ2sQ2sQ").pack
TIMES_FLAGS = struct.Struct("<BQBQ2sI").pack
_EVENT_TIME = struct.Struct("<BQ").pack  # Event.time_unix_nano (1), fixed64
_DOUBLE = struct.Struct("<d").pack

# Caches. Keys and (key, str value) pairs repeat across spans (method, route, host, pid...);
# each is bounded and simply cleared when full, which keeps memory flat under high-cardinality
# values at the cost of re-encoding.
_CACHE_MAX = 8192
_CACHEABLE_STR_LEN = 128
_key_prefix: dict[str, bytes] = {}  # key -> KeyValue.key field + KeyValue.value tag
_str_kv: dict[tuple[str, str], bytes] = {}  # (key, str value) -> length-prefixed KeyValue
_bool_kv: dict[tuple[str, bool], bytes] = {}
_resource_fields: dict[Resource, bytes] = {}  # Resource -> ResourceSpans.resource field


def utf8(s: str) -> bytes:
    # A lone surrogate becomes "?" rather than failing the batch (receivers reject bad UTF-8).
    return s.encode("utf-8", "replace")


def key_field(key: str) -> bytes:
    kp = _key_prefix.get(key)
    if kp is None:
        if len(_key_prefix) >= _CACHE_MAX:
            _key_prefix.clear()
        kp = _key_prefix[key] = ld(_T_KV_KEY, utf8(key)) + _T_KV_VALUE
    return kp


def _any_value(value: object) -> bytes:
    """AnyValue body for a value off the fast path: bool before int (bool is an int)."""
    if isinstance(value, bool):
        return _T_ANY_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        if _INT64_MIN <= value <= INT64_MAX:
            return T_ANY_INT + varint(value & M64)
        return ld(T_ANY_STRING, utf8(str(value)))  # beyond int64: keep it lossless as text
    if isinstance(value, float):
        return _T_ANY_DOUBLE + _DOUBLE(value)
    if isinstance(value, str):
        return ld(T_ANY_STRING, utf8(value))
    return ld(T_ANY_STRING, utf8(str(value)))


def kv_slow(key: str, value: object) -> bytes:
    """Length-prefixed KeyValue for any value, off the fast path."""
    return ld(b"", key_field(key) + ld(b"", _any_value(value)))


def append_attributes(parts: list[bytes], tag: bytes, attrs: Mapping[str, AttrValue]) -> None:
    """Append one `tag` KeyValue field per attribute to `parts`."""
    str_kv = _str_kv
    key_prefix = _key_prefix
    for key, value in attrs.items():
        if type(value) is str:
            enc = str_kv.get((key, value))
            if enc is None:
                enc = kv_slow(key, value)
                if len(value) <= _CACHEABLE_STR_LEN:
                    if len(str_kv) >= _CACHE_MAX:
                        str_kv.clear()
                    str_kv[(key, value)] = enc
            parts += (tag, enc)
            continue
        kp = key_prefix.get(key) or key_field(key)
        if len(kp) < 100:  # then every length below is a single-byte varint
            if type(value) is int and 0 <= value <= INT64_MAX:
                av = varint(value)
                la = len(av) + 1
                # KeyValue: key field, value tag, AnyValue length, AnyValue (int tag + varint).
                parts += (tag, V1[len(kp) + 1 + la], kp, V1[la], T_ANY_INT, av)
                continue
            if type(value) is float:
                # AnyValue is 9 bytes: double tag + 8.
                parts += (tag, V1[len(kp) + 10], kp, b"\x09\x21", _DOUBLE(value))
                continue
        if type(value) is bool:
            enc = _bool_kv.get((key, value))
            if enc is None:
                if len(_bool_kv) >= _CACHE_MAX:
                    _bool_kv.clear()
                enc = _bool_kv[(key, value)] = kv_slow(key, value)
            parts += (tag, enc)
            continue
        parts += (tag, kv_slow(key, value))


def resource_field(resource: Resource) -> bytes:
    field = _resource_fields.get(resource)
    if field is None:
        parts: list[bytes] = []
        append_attributes(parts, _T_RES_ATTR, dict(resource.attributes))
        # An attribute-less Resource is left out, as the JSON encoder leaves out "resource".
        field = ld(_T_RS_RESOURCE, b"".join(parts)) if parts else b""
        if len(_resource_fields) >= _CACHE_MAX:
            _resource_fields.clear()
        _resource_fields[resource] = field
    return field


def status_body(code: int, message: str) -> bytes:
    body = ld(_T_STATUS_MSG, utf8(message)) if message else b""
    if code:
        body += _T_STATUS_CODE + varint(code & M64)
    return body


def span_head(
    trace_id: int, span_id: int, parent_id: int, start_ns: int, end_ns: int, flags: int
) -> bytes:
    """A Span message's ids, times and flags: trace_id(1), span_id(2), parent_span_id(4) when
    there is a parent, start(7), end(8), flags(16)."""
    if parent_id:
        ids = IDS_PARENT(
            b"\x0a\x10",
            (trace_id >> 64) & M64,
            trace_id & M64,
            b"\x12\x08",
            span_id & M64,
            b"\x22\x08",
            parent_id & M64,
        )
    else:
        ids = IDS(b"\x0a\x10", (trace_id >> 64) & M64, trace_id & M64, b"\x12\x08", span_id & M64)
    return ids + TIMES_FLAGS(0x39, start_ns & M64, 0x41, end_ns & M64, b"\x85\x01", flags & 0xFF)


def encode_span(span: Span) -> bytes:
    """The body of one OTLP Span message."""
    name = utf8(span.name)
    nl = len(name)
    parts = [
        span_head(
            span.trace_id,
            span.span_id,
            span.parent_span_id,
            span.start_ns,
            span.end_ns,
            span.trace_flags,
        ),
        T_SPAN_NAME,
        V1[nl] if nl < 0x80 else varint(nl),
        name,
    ]
    if span.kind:
        parts += (T_SPAN_KIND, varint(span.kind & M64))
    if span.attributes:
        append_attributes(parts, T_SPAN_ATTR, span.attributes)
    for ev in span.events:
        ev_parts = [_EVENT_TIME(0x09, ev.time_ns & M64), ld(_T_EVENT_NAME, utf8(ev.name))]
        if ev.attributes:
            append_attributes(ev_parts, _T_EVENT_ATTR, ev.attributes)
        parts.append(ld(_T_SPAN_EVENT, b"".join(ev_parts)))
    if span.status_code or span.status_message:
        parts.append(ld(T_SPAN_STATUS, status_body(span.status_code, span.status_message)))
    return b"".join(parts)
