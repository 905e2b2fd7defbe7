"""The span as tracejoin hands it to exporters.

Plain slotted dataclasses rather than OpenTelemetry SDK objects: building an SDK span costs
tens of microseconds, and exporters encode these straight into OTLP protobuf/JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

AttrValue = str | int | float | bool

# OTLP enum values (opentelemetry/proto/trace/v1/trace.proto).
KIND_INTERNAL = 1
KIND_SERVER = 2
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2


@dataclass(frozen=True, slots=True)
class Resource:
    """What produced the span: one per served process. Hashable so exporters can group by it."""

    attributes: tuple[tuple[str, AttrValue], ...]

    def get(self, key: str) -> AttrValue | None:
        for k, v in self.attributes:
            if k == key:
                return v
        return None


@dataclass(slots=True)
class Event:
    name: str
    time_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)


@dataclass(slots=True)
class Span:
    trace_id: int  # 128-bit
    span_id: int  # 64-bit
    parent_span_id: int  # 0: a root span
    name: str
    kind: int
    start_ns: int  # Unix epoch nanoseconds
    end_ns: int
    resource: Resource
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    status_code: int = STATUS_UNSET
    status_message: str = ""
    trace_flags: int = 1

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"

    @property
    def span_id_hex(self) -> str:
        return f"{self.span_id:016x}"

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


class EncodedSpan(NamedTuple):
    """A span the span builder already wrote as the body of an OTLP `Span` message (the
    object-free path, pipeline/span_bytes.py). Only destinations that send OTLP protobuf take it
    (their `accepts_encoded`); they place `body` under `resource`'s ResourceSpans as it is.
    A named tuple: span_bytes' batch writer makes one per request in C, as a tuple."""

    resource: Resource
    body: bytes


# What a destination's queue carries: a span object, or one already encoded (OTLP destinations).
ExportSpan = Span | EncodedSpan
