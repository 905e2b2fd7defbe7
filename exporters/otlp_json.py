"""tracejoin spans -> OTLP/JSON (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding).

OTLP/JSON is the proto3 JSON mapping with OTLP's own exceptions: trace and span ids are
lowercase hex (not base64), enums are integers, field names are lowerCamelCase. int64/fixed64
values (times, intValue) are decimal strings as in the proto3 mapping; fields holding their
default value are left out. The grouping (one ResourceSpans per Resource, one tracejoin scope)
matches tracejoin.exporters.otlp_proto, so both encoders describe the same request.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tracejoin.core.model import AttrValue, Resource, Span
from tracejoin.exporters.otlp_proto import SCOPE_NAME, SCOPE_VERSION

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_M64 = (1 << 64) - 1

_SCOPE = {"name": SCOPE_NAME, "version": SCOPE_VERSION}
_resource_cache: dict[Resource, dict[str, Any]] = {}
_RESOURCE_CACHE_MAX = 1024


def _any_value(value: object) -> dict[str, Any]:
    # bool first: it is an int subclass.
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        if _INT64_MIN <= value <= _INT64_MAX:
            return {"intValue": str(value)}
        return {"stringValue": str(value)}  # beyond int64: as otlp_proto, lossless text
    if isinstance(value, float):
        if math.isfinite(value):
            return {"doubleValue": value}
        # proto3 JSON spells non-finite doubles as strings.
        return {
            "doubleValue": "NaN"
            if math.isnan(value)
            else ("Infinity" if value > 0 else "-Infinity")
        }
    if isinstance(value, str):
        return {"stringValue": value}
    return {"stringValue": str(value)}


def _attributes(attrs: Mapping[str, AttrValue]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _any_value(v)} for k, v in attrs.items()]


def _resource(resource: Resource) -> dict[str, Any]:
    enc = _resource_cache.get(resource)
    if enc is None:
        attrs = _attributes(dict(resource.attributes))
        enc = {"attributes": attrs} if attrs else {}
        if len(_resource_cache) >= _RESOURCE_CACHE_MAX:
            _resource_cache.clear()
        _resource_cache[resource] = enc
    return enc


def span_dict(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {
        "traceId": f"{span.trace_id & ((1 << 128) - 1):032x}",
        "spanId": f"{span.span_id & _M64:016x}",
    }
    if span.parent_span_id:
        out["parentSpanId"] = f"{span.parent_span_id & _M64:016x}"
    flags = span.trace_flags & 0xFF
    if flags:
        out["flags"] = flags
    if span.name:
        out["name"] = span.name
    if span.kind:
        out["kind"] = span.kind
    if span.start_ns:
        out["startTimeUnixNano"] = str(span.start_ns & _M64)
    if span.end_ns:
        out["endTimeUnixNano"] = str(span.end_ns & _M64)
    if span.attributes:
        out["attributes"] = _attributes(span.attributes)
    if span.events:
        events = []
        for ev in span.events:
            e: dict[str, Any] = {}
            if ev.time_ns:
                e["timeUnixNano"] = str(ev.time_ns & _M64)
            if ev.name:
                e["name"] = ev.name
            if ev.attributes:
                e["attributes"] = _attributes(ev.attributes)
            events.append(e)
        out["events"] = events
    if span.status_code or span.status_message:
        status: dict[str, Any] = {}
        if span.status_message:
            status["message"] = span.status_message
        if span.status_code:
            status["code"] = span.status_code
        out["status"] = status
    return out


def encode_request_dict(spans: Iterable[Span]) -> dict[str, Any]:
    """One ExportTraceServiceRequest as a JSON-ready dict."""
    groups: dict[Resource, list[dict[str, Any]]] = {}
    for span in spans:
        groups.setdefault(span.resource, []).append(span_dict(span))
    resource_spans = []
    for resource, span_dicts in groups.items():
        rs: dict[str, Any] = {}
        res = _resource(resource)
        if res:
            rs["resource"] = res
        rs["scopeSpans"] = [{"scope": _SCOPE, "spans": span_dicts}]
        resource_spans.append(rs)
    return {"resourceSpans": resource_spans} if resource_spans else {}


def encode_request_json(spans: Iterable[Span]) -> str:
    """One ExportTraceServiceRequest as compact OTLP/JSON text (no newline)."""
    return json.dumps(encode_request_dict(spans), separators=(",", ":"), ensure_ascii=False)


_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids_to_base64(obj: Any) -> Any:
    """Rewrite OTLP/JSON's hex ids into the base64 that the generic proto3 JSON parser expects."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in _ID_KEYS and isinstance(v, str):
                out[k] = base64.b64encode(bytes.fromhex(v)).decode() if v else ""
            else:
                out[k] = _hex_ids_to_base64(v)
        return out
    if isinstance(obj, list):
        return [_hex_ids_to_base64(v) for v in obj]
    return obj


def decode_request_json(text: str | dict[str, Any]) -> ExportTraceServiceRequest:
    """Parse one OTLP/JSON request (a line of a JsonLinesFileExporter file) into protobuf.

    Raises ValueError (json.JSONDecodeError, json_format.ParseError) on malformed input.
    """
    obj = json.loads(text) if isinstance(text, str) else text
    msg = ExportTraceServiceRequest()
    json_format.ParseDict(_hex_ids_to_base64(obj), msg)
    return msg
