"""tracejoin spans -> OTLP protobuf (ExportTraceServiceRequest), written straight to wire bytes.

This is the per-span hot path. The Span message itself is written by tracejoin.core.otlp_wire;
here the spans are grouped under their ResourceSpans/ScopeSpans. A span the span builder already
wrote as bytes (model.EncodedSpan, the object-free path) is placed as it is, never re-encoded.
Senders send the bytes as they are; `encode_request` parses them into a message for callers that
want one.
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


def encode_request_bytes(spans: Iterable[Span | EncodedSpan]) -> bytes:
    """Serialized ExportTraceServiceRequest: one ResourceSpans per distinct Resource, in order of
    first appearance, each with one ScopeSpans for the tracejoin scope."""
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
