"""tracejoin spans -> OTLP protobuf (ExportTraceServiceRequest), written straight to wire bytes.

This is the per-span hot path. The Span message itself is written by tracejoin.core.otlp_wire;
here the spans are grouped under their ResourceSpans/ScopeSpans. A span the span builder already
wrote as bytes (model.EncodedSpan, the object-free path) is placed as it is, never re-encoded.
Senders send the bytes as they are; `encode_request` parses them into a message for callers that
want one. Where `_request_bytes.c` was compiled at install, a batch of EncodedSpans is framed in
one C call (its bodies copied once, no Python per span but a model.Span's encode_span);
`encode_request_bytes_py` is the reference.
"""

from __future__ import annotations

from collections.abc import Iterable

import tracejoin
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tracejoin.core.model import EncodedSpan, Resource, Span
from tracejoin.core.otlp_wire import (
    T_REQ_RS,
    T_RS_SCOPE_SPANS,
    T_SS_SCOPE,
    T_SS_SPAN,
    V1,
    encode_span,
    ld,
    resource_field,
    varint,
)

SCOPE_NAME = "tracejoin"
SCOPE_VERSION = tracejoin.__version__

_SCOPE_FIELD = ld(
    T_SS_SCOPE, ld(b"\x0a", SCOPE_NAME.encode()) + ld(b"\x12", SCOPE_VERSION.encode())
)
_HEADS = (T_REQ_RS, T_RS_SCOPE_SPANS, T_SS_SPAN, _SCOPE_FIELD)

try:  # compiled where a C compiler was, at install: the same bytes, faster
    from tracejoin.exporters._request_bytes import request as _request_c
except ImportError:  # pragma: no cover - the pure-Python path, under the same tests
    _request_c = None
_request = _request_c  # None: every request in Python (tests and the bench switch it)
COMPILED = _request_c is not None


def use_compiled(on: bool) -> None:
    """For tests and the bench: frame requests with _request_bytes.c (as installed) or not."""
    global _request
    if on and _request_c is None:
        raise RuntimeError("_request_bytes.c was not built (gcc, python3-dev: scripts/setup.sh)")
    _request = _request_c if on else None


def encode_request_bytes(spans: Iterable[Span | EncodedSpan]) -> bytes:
    """Serialized ExportTraceServiceRequest: one ResourceSpans per distinct Resource, in order of
    first appearance, each with one ScopeSpans for the tracejoin scope."""
    if _request is not None:
        batch = spans if type(spans) is list else list(spans)
        out = _request(batch, EncodedSpan, resource_field, _HEADS, encode_span)
        if out is not None:
            return out
        spans = batch  # more resources than the C groups
    return encode_request_bytes_py(spans)


def encode_request_bytes_py(spans: Iterable[Span | EncodedSpan]) -> bytes:
    """encode_request_bytes in Python: the reference, and the fallback."""
    # Look the Resource up by object identity (cheap), and hash it by value only once per
    # distinct object per batch, so equal Resources from different objects still share a group.
    groups: dict[bytes, list[bytes]] = {}
    by_id: dict[int, tuple[Resource, list[bytes]]] = {}  # holds res: its id stays unique
    for span in spans:
        res = span.resource
        entry = by_id.get(id(res))
        if entry is None:
            entry = by_id[id(res)] = (res, groups.setdefault(resource_field(res), []))
        group = entry[1]
        body = span.body if isinstance(span, EncodedSpan) else encode_span(span)
        n = len(body)
        group += (T_SS_SPAN, V1[n] if n < 0x80 else varint(n), body)
    # One join for the whole request: each message's length is known from its parts, so the
    # spans (hundreds of KiB) are copied once, not once per enclosing message.
    out: list[bytes] = []
    for res_field, span_parts in groups.items():
        scope_len = len(_SCOPE_FIELD) + sum(map(len, span_parts))
        scope_head = T_RS_SCOPE_SPANS + varint(scope_len)
        out += (T_REQ_RS, varint(len(res_field) + len(scope_head) + scope_len), res_field)
        out += (scope_head, _SCOPE_FIELD)
        out += span_parts
    return b"".join(out)


def encode_request(spans: Iterable[Span | EncodedSpan]) -> ExportTraceServiceRequest:
    """The same request as a protobuf message (parsed from the bytes, which is fast in upb)."""
    return ExportTraceServiceRequest.FromString(encode_request_bytes(spans))
